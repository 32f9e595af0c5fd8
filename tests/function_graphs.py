"""Checks on how Dynamo traces our autograd Functions.

An autograd Function's traced forward must return tensors that no other traced op also
produced. A no-op ``t.to(t.dtype)``, ``t.float()`` on float32 or ``t.contiguous()`` on a
contiguous tensor, and every in-place op (``t.mul_(s)``, ``t += u``), returns the very tensor
object it was given as a new graph node. Some torch releases (2.11) return every intermediate of
the forward as an extra output of the Function; the tensor then appears twice among the
outputs, autograd records the later output slot on it, and the gradient of the returned
output reaches ``backward`` as zeros. Later releases return only the declared outputs, so
comparing gradients alone cannot catch the pattern there: :func:`shared_forward_outputs`
inspects the traced graph, which shows it on every release.
"""

from __future__ import annotations

import operator

import torch


def shared_forward_outputs(gm: torch.fx.GraphModule) -> list[str]:
    """``"<forward>: <output> is <other nodes>"`` for each output of an autograd Function's
    traced forward (the ``fwd_body_*`` subgraph Dynamo builds for each call) that the graph
    goes on to use and whose tensor is the result of another node of that forward too; empty
    when there is none. (Unused outputs do not matter: on releases that return the forward's
    intermediates, those sharing a tensor with an input or with each other are harmless.)"""
    found = []
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for call in module.graph.nodes:
            if call.op != "call_function" or call.target is not torch.ops.higher_order.autograd_function_apply:
                continue
            forward_name = call.args[0].target
            forward = getattr(module, forward_name)
            used = sorted({user.args[1] for user in call.users if user.target is operator.getitem})
            nodes = list(forward.graph.nodes)
            # A Dynamo forward returns ((outputs...), (saved tensors...)).
            outputs = nodes[-1].args[0][0]
            for index in used:
                output = outputs[index]
                value = output.meta.get("example_value") if isinstance(output, torch.fx.Node) else None
                if not isinstance(value, torch.Tensor):
                    continue
                others = [node.name for node in nodes if node is not output and node.meta.get("example_value") is value]
                if others:
                    found.append(f"{forward_name}: {output.name} ({output.target}) is {', '.join(others)}")
    return found


def compile_checking_outputs(fn, found: list[str]):
    """``torch.compile(fn, fullgraph=True)`` with a backend that appends
    :func:`shared_forward_outputs` of every graph to ``found`` and runs the graph through
    AOTAutograd (``aot_eager``), as Inductor would receive it."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        found.extend(shared_forward_outputs(gm))
        return aot_eager(gm, example_inputs)

    return torch.compile(fn, backend=backend, fullgraph=True)
