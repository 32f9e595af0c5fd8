"""Whether outside code can see a buffer a module makes at this call: the in-place writes' guard.

The kernels write a gradient over a buffer (the norms' dx over dy, the gated MLPs' da/db over
the gate/up activations, the cross entropy's gradient over the logits) only where the caller
promised that nothing else reads it (``in_place=True``; ``docs/api.md``, "Memory ownership").
The modules that make that promise for buffers they create themselves check at each call that
no hook can see those buffers: a module's hooks (forward, forward pre, backward, backward pre)
receive its inputs, outputs and their gradients, and torch's global module hooks receive those
of every module. Hooks are registered state, read here as is; nothing is inferred from
reference counts.
"""

from __future__ import annotations

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
