"""Use a module's full parameters outside its ``forward`` under sharded data parallelism.

The fused linear cross entropy reads ``lm_head.weight`` directly instead of calling
``lm_head``; that is the point of the fusion (the logits are never materialised). Sharded
data parallel wrappers only materialise a module's parameters around a call of that module,
through the module's forward hooks:

* FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps every parameter as a sharded
  ``DTensor`` between calls and swaps in the all-gathered tensors from a forward pre-hook
  of the module (or of the nearest ancestor) that ``fully_shard`` was applied to. Applied
  to the root and the decoder layers only, ``lm_head`` belongs to the root group and its
  weight is already gathered inside the root forward, where the fused loss runs. When
  ``lm_head`` (or a parent below the root) is sharded on its own, its weight is still a
  ``DTensor`` shard at that point.
* DeepSpeed ZeRO-3 partitions every parameter (``param.ds_id`` set, ``param.data`` of size 0)
  and gathers a module's parameters in that module's forward pre-hook, re-gathers them in
  its backward pre-hook and partitions them again afterwards.

:func:`call_with_full_parameters` therefore runs the loss *as the forward of the module*:
for that one call ``module.forward`` is the loss function, so every hook the wrapper put on
the module runs exactly as it would for ``module(hidden_states)``. FSDP2 all-gathers the
weight, casts the floating inputs for its mixed-precision policy, registers the
reduce-scatter of the weight gradient for the backward and reshards after the forward;
ZeRO-3 gathers and releases the partitions and re-gathers them for the backward. Gradients
therefore land on the sharded parameters as for an unfused ``lm_head`` call. When nothing
is sharded the function is called directly (no hooks, no overhead, and nothing for
``torch.compile`` to trace through).

Tensor parallelism (a weight that is still a ``DTensor`` inside its module's forward) is
not supported by the fused loss and raises a ``NotImplementedError``.

``accelerate`` (``device_map`` dispatch, ``cpu_offload``, disk offload) works differently: it
replaces the module's ``forward`` on the instance by a wrapper that runs the hook's
pre-forward (move the inputs to the execution device; with offload, load the weights, which
sit on the ``meta`` device in between), then ``module._old_forward``, then the post-forward.
:func:`call_with_full_parameters` runs ``fn`` as that ``_old_forward`` for one call, so the
hook does for the loss what it does for ``module(hidden_states)``; :func:`forward_is_wrapped`
tells callers that read a module's parameters directly when to call the module instead, and
:func:`accelerate_hooked` which of those wrappers is accelerate's.

:func:`unwrapped_class` gives the class a module had before ``fully_shard`` replaced it by
its ``FSDP<Class>`` subclass, for checks such as "``lm_head`` is a plain ``nn.Linear``".

This module needs only torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import torch
from torch import nn

from liger_kernel.ops.module_attributes import set_attribute

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor as DTensorType

DTensor: type[torch.Tensor] | None
FSDPModule: type | None
try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support
    DTensor = None
try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch < 2.6 keeps FSDP2 under its private name; or no distributed
    try:
        from torch.distributed._composable.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None

T = TypeVar("T")


def _is_dtensor(tensor: torch.Tensor | None) -> TypeGuard[DTensorType]:
    return DTensor is not None and isinstance(tensor, DTensor)


def _is_zero3_partitioned(tensor: torch.Tensor | None) -> bool:
    # ``ds_status`` is a ``ZeroParamStatus`` enum; comparing by name avoids importing deepspeed.
    if tensor is None or not hasattr(tensor, "ds_id"):
        return False
    status = getattr(tensor, "ds_status", None)
    return getattr(status, "name", "AVAILABLE") != "AVAILABLE"


def unwrapped_class(module: nn.Module) -> type:
    """The class ``module`` had before ``fully_shard`` made it an ``FSDP<Class>``.

    FSDP2 swaps the class of every module it shards for a dynamic subclass with bases
    ``(FSDPModule, <original class>)``; code that decides by exact class (``type(m) is
    nn.Linear``, to exclude subclasses such as quantised linears) must look through it.
    """
    cls = type(module)
    if FSDPModule is not None and isinstance(module, FSDPModule):
        originals = [base for base in cls.__bases__ if not issubclass(base, FSDPModule)]
        if len(originals) == 1:
            return originals[0]
    return cls


def forward_is_wrapped(module: nn.Module) -> bool:
    """True when calling ``module`` runs more than its class's ``forward``: an accelerate hook
    (``_hf_hook``; its pre-forward materialises offloaded weights, which are ``meta`` tensors
    until then) or any other ``forward`` stored on the instance. Reading such a module's
    parameters outside its call bypasses that code, so it must be called instead."""
    return getattr(module, "_hf_hook", None) is not None or "forward" in vars(module)


def accelerate_hooked(module: nn.Module) -> bool:
    """True when ``module``'s forward is accelerate's hook wrapper (``add_hook_to_module``),
    which calls ``module._old_forward`` between the hook's pre- and post-forward."""
    return getattr(module, "_hf_hook", None) is not None and "_old_forward" in vars(module)


def parameters_on_meta(module: nn.Module) -> bool:
    """True when one of ``module``'s own parameters has no data here (accelerate offload)."""
    return any(p.is_meta for p in module.parameters(recurse=False))


def parameters_are_sharded(module: nn.Module) -> bool:
    """True when one of ``module``'s own parameters is not materialised right now.

    That is an FSDP2 ``DTensor`` shard or a DeepSpeed ZeRO-3 partition; inside the forward of
    the sharded module (or of its FSDP2 root) the parameters are full and this is False.
    """
    return any(_is_dtensor(p) or _is_zero3_partitioned(p) for p in module.parameters(recurse=False))


def call_with_full_parameters(module: nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Return ``fn(module, *args, **kwargs)`` with ``module``'s parameters materialised.

    ``fn`` must read the parameters from ``module`` (``module.weight``), not from a
    reference taken earlier: under FSDP2 the gathered weight is a different tensor object.
    Pass the input tensors (hidden states, labels) through ``args``/``kwargs`` rather than
    closing over them, so the wrapper's hooks see them (FSDP2 registers the gradient
    reduce-scatter on the inputs and casts them under a mixed-precision policy).

    With an accelerate hook on ``module``, ``fn`` runs as the module's ``_old_forward`` for
    this one call, inside the hook: its pre-forward moves the inputs to the execution device
    and loads offloaded weights, its post-forward moves the result back and offloads them.

    Raises ``NotImplementedError`` when a parameter is still a ``DTensor`` inside the
    module's forward (tensor parallelism).
    """
    if accelerate_hooked(module):
        original = module.__dict__["_old_forward"]
        set_attribute(module, "_old_forward", lambda *call_args, **call_kwargs: fn(module, *call_args, **call_kwargs))
        try:
            return module(*args, **kwargs)
        finally:
            set_attribute(module, "_old_forward", original)
    if not parameters_are_sharded(module):
        return fn(module, *args, **kwargs)

    def as_forward(*call_args: Any, **call_kwargs: Any) -> T:
        for name, param in module.named_parameters(recurse=False):
            if _is_dtensor(param):
                raise NotImplementedError(
                    f"{type(module).__name__}.{name} is a DTensor inside its module's forward "
                    f"(placements {param.placements}): the fused linear cross entropy does not "
                    "support a tensor-parallel lm_head; patch with fused_linear_cross_entropy=False"
                )
        return fn(module, *call_args, **call_kwargs)

    # An instance attribute shadows the class's forward for this one call; a forward already
    # bound on the instance (another patch) is put back afterwards.
    previous = module.__dict__.get("forward", None)
    module.forward = as_forward
    try:
        return module(*args, **kwargs)
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def call_as_wrapped_forward(wrapper: nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Return ``fn(*args, **kwargs)`` run as the forward of the module an FSDP (v1) ``wrapper`` holds.

    ``FullyShardedDataParallel`` all-gathers the parameters of the modules it wraps only inside
    ``wrapper(...)``; calling a part of the wrapped model directly (its decoder without the
    head, or the head's weight in a fused loss) would see flat shards. For this one call the
    wrapped module's ``forward`` is ``fn``, so the wrapper's pre- and post-forward run around
    it with ``args``/``kwargs`` passed through. The wrapped module's own ``forward`` is back in
    place when ``fn`` starts (``fn`` may call it) and after an exception.
    """
    inner = getattr(wrapper, "_fsdp_wrapped_module", None)
    if not isinstance(inner, nn.Module):
        raise TypeError(f"{type(wrapper).__name__} is not an FSDP wrapper (it has no '_fsdp_wrapped_module')")
    previous = inner.__dict__.get("forward", None)

    def restore() -> None:
        if previous is None:
            inner.__dict__.pop("forward", None)
        else:
            inner.forward = previous

    def as_forward(*call_args: Any, **call_kwargs: Any) -> T:
        restore()
        return fn(*call_args, **call_kwargs)

    inner.forward = as_forward
    try:
        return wrapper(*args, **kwargs)
    finally:
        restore()
