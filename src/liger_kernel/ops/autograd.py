"""Autograd helpers shared by every Function in :mod:`liger_kernel.ops`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

# --------------------------------------------------------------------------------------
# Backward passes are differentiable once only.
#
# Every backward here runs Triton kernels (or writes into buffers) that autograd cannot see
# through, so the gradients it returns have no graph back to the inputs: differentiating
# them again (``create_graph=True``, then a second backward) must raise, never return a
# second derivative that silently lacks this op's part.
# --------------------------------------------------------------------------------------


class _SecondDerivativeRaises(torch.autograd.Function):
    """``apply(n, *tensors)``: aliases of the first ``n`` tensors (a once-differentiable
    backward's gradients); differentiating them raises. The other tensors (the Function's
    saved inputs) only connect this node to them, so that a second derivative with respect
    to them, ``torch.autograd.grad(.., inputs)`` included, runs into it."""

    @staticmethod
    def forward(ctx, n_grads: int, *tensors: torch.Tensor):
        # Aliases, not the inputs themselves: autograd attaches this node to outputs only.
        return tuple(t.detach() for t in tensors[:n_grads])

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError("trying to differentiate twice a liger_kernel op: its backward is once_differentiable "
                           "(double backward is not supported)")


def _warn_unanchored_second_derivative(function_name: str) -> None:
    # Python's default filter shows each distinct message once.
    import warnings

    warnings.warn(
        f"{function_name}'s backward ran with create_graph=True. It is once-differentiable and keeps "
        "none of its inputs: differentiating its gradients again raises through backward(), but "
        "torch.autograd.grad(.., inputs) of them silently leaves out this op's part of the second "
        "derivative. Use the PyTorch op where second derivatives are needed.",
        stacklevel=4,
    )


def strictly_once_differentiable(backward):
    """``torch.autograd.function.once_differentiable`` for an autograd Function's backward,
    closing the gaps through which a second derivative comes out silently wrong (hence its
    own name: it is stricter than torch's decorator).

    torch's decorator runs the backward without grad and, under ``create_graph=True``, marks
    the gradients so that differentiating them raises, but only when an incoming gradient
    requires grad, and with a node connected to nothing: with incoming gradients that do
    not require grad (the gradient of ``y.sum()``) the results look constant in the inputs,
    and ``torch.autograd.grad(f(grad_x) + g(x), x)`` never reaches the marking node; either
    way the second derivative silently lacks this op's part. Here, under ``create_graph``,
    every gradient is marked by a node also connected to the saved inputs that require
    grad, which a second derivative with respect to them must pass. (A Function that saves
    none of its inputs, e.g. one that keeps only gradients computed in its forward, is
    marked unconnected, as by torch's decorator, and warns (once per Function): there
    ``torch.autograd.grad(.., inputs)`` of its gradients cannot be made to raise.) Without
    ``create_graph`` the backward's results are returned untouched.
    """
    checked = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():
            # No graph asked for (the usual backward, run with grad mode off): nothing to
            # mark, and no need for torch's no_grad context (host time on every call).
            return backward(ctx, *grads)
        if torch.compiler.is_compiling():
            return checked(ctx, *grads)
        # Unpacked before the backward runs: it may scale a saved buffer in place, which a
        # later unpack would report as a modified saved tensor.
        anchors = [t for t in ctx.saved_tensors if isinstance(t, torch.Tensor) and t.requires_grad]
        if not anchors and any(ctx.needs_input_grad):
            _warn_unanchored_second_derivative(type(ctx).__name__.removesuffix("Backward"))
        outputs = checked(ctx, *grads)
        single = not isinstance(outputs, tuple)
        results = [outputs] if single else list(outputs)
        positions = [i for i, r in enumerate(results) if isinstance(r, torch.Tensor)]
        if positions:
            # Detached leaves that require grad (as torch's decorator makes them), so that the
            # node is recorded even where no anchor requires grad.
            marked = _SecondDerivativeRaises.apply(
                len(positions), *(results[i].detach().requires_grad_() for i in positions), *anchors)
            for i, tensor in zip(positions, marked):
                results[i] = tensor
        return results[0] if single else tuple(results)

    return wrapper


class EagerUnderCompile:
    """Mixin for an autograd Function whose forward Dynamo cannot trace (a Python loop over
    chunks that switches cuBLAS's reduction precision, host reads of data-dependent sizes):
    under ``torch.compile`` its ``apply`` is a graph break and the Function runs eagerly, with
    the same results; ``fullgraph=True`` raises at it. List it before ``torch.autograd.Function``
    among the bases."""

    @classmethod
    def apply(cls, *args, **kwargs):
        return _apply_eagerly(cls, *args, **kwargs)


@torch.compiler.disable
def _apply_eagerly(cls, *args, **kwargs):
    return super(EagerUnderCompile, cls).apply(*args, **kwargs)


class InputGradients:
    """The tuple an autograd Function's backward returns, laid out from its forward's signature:
    one entry per parameter after ``ctx``, the gradients named in the call, None elsewhere.

    Built once per Function, right after its class (``_GRADS = InputGradients(MyFunction.forward)``),
    so no count of trailing Nones is kept by hand; a call only builds a tuple (which Dynamo
    traces). ``_GRADS()`` is the all-None tuple of a backward with nothing to compute.
    """

    def __init__(self, forward: Callable[..., Any]) -> None:
        parameters = list(inspect.signature(forward).parameters.values())[1:]
        variadic = [p.name for p in parameters if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if variadic:
            raise TypeError(f"{forward.__qualname__} takes *{variadic[0]}: its inputs cannot be counted")
        self.names = tuple(p.name for p in parameters)

    def __call__(self, **gradients: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        unknown = [name for name in gradients if name not in self.names]
        if unknown:
            raise TypeError(f"no forward input named {unknown[0]!r}; the inputs are {', '.join(self.names)}")
        return tuple(gradients.get(name) for name in self.names)
