"""Who may write a gradient over a buffer: the caller's promise, and what a module can check.

Writing ``dx`` over a norm's ``dy`` saves an (N, H) buffer while the backward runs, and destroys
``dy``; the gated activations' and the cross entropy's in-place backwards do the same to their
inputs. Only the caller can know that nobody else reads that buffer: autograd hands the very
tensor given to ``y.backward(g)`` to the backward, passes one gradient tensor on unchanged to
both inputs of an addition (``norm(x) + residual``), and hooks may keep it. So the write
happens only where the caller asked for it (``in_place=True``: a contract, see ``docs/api.md``,
"Memory ownership"), never by guessing from reference counts.

A module that makes the promise for buffers it creates itself (a gated MLP's projection
outputs, a decoder-layer norm's output gradient) checks at each call that no hook can see
them (:func:`hooks_may_see`): a module's hooks (forward, forward pre, backward, backward pre)
receive its inputs, outputs and their gradients, and torch's global module hooks those of
every module. Hooks are registered state, read as is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as module_impl

_OWN_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


def global_module_hooks() -> bool:
    """Whether any global module hook is registered (``nn.modules.module.register_module_*_hook``).
    A torch that keeps them elsewhere counts as having some."""
    return any(getattr(module_impl, name, True) for name in _GLOBAL_HOOKS)


def hooks_may_see(module: nn.Module, ignored: tuple = ()) -> bool:
    """Whether a hook may see ``module``'s inputs, outputs or their gradients at this call: one
    of its own hooks (any kind) other than the functions in ``ignored``, or a global module hook."""
    for name in _OWN_HOOKS:
        hooks = getattr(module, name, None)
        if hooks is None:
            continue
        if any(hook not in ignored for hook in hooks.values()):
            return True
    return global_module_hooks()


def backward_writes_into_grad(in_place: bool, grad_output: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a norm's backward writes dx over ``grad_output``.

    ``in_place`` is the caller's promise that ``grad_output`` is private to this backward:
    the norm's output feeds only ops whose backward makes a fresh gradient (projections),
    nothing passes its gradient on to another branch, and no hook keeps it. The patched
    models make that promise for the norms inside decoder layers (``families.NormSpec.in_place``);
    the public modules and functions make it only when their caller passes ``in_place=True``.

    Even then the write is skipped, and dx gets a fresh buffer, where the kernel cannot write
    into ``grad_output``: another dtype than x's, not contiguous, a zero stride (the backward
    of ``y.sum()`` hands over one scalar expanded to y's shape), part of a graph
    (``create_graph=True`` may have saved it), or under ``torch.compile`` (the traced backward
    must not mutate its input; Inductor plans the buffers itself).
    """
    return (in_place and not torch.compiler.is_compiling() and grad_output.dtype == x.dtype
            and grad_output.is_contiguous() and 0 not in grad_output.stride() and not grad_output.requires_grad)
