"""Compatibility shim: ``liger_kernel.transformers.trainer.orpo_trainer._FSDPForwardRedirection``,
which axolotl 0.19 uses to run its fused loss on an FSDP-wrapped ``lm_head`` with the head's
parameters gathered. The work is done by
:func:`liger_kernel.transformers.distributed.call_as_wrapped_forward`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from liger_kernel.transformers.distributed import call_as_wrapped_forward

__all__ = ["_FSDPForwardRedirection"]


class _FSDPForwardRedirection:
    """``_FSDPForwardRedirection()(wrapper, method, *args, **kwargs)``: ``method(*args, **kwargs)``
    run as the forward of the module the FSDP ``wrapper`` holds (see
    :func:`~liger_kernel.transformers.distributed.call_as_wrapped_forward`)."""

    def __call__(self, wrapper_module: nn.Module, method, *args: Any, **kwargs: Any) -> Any:
        return call_as_wrapped_forward(wrapper_module, method, *args, **kwargs)
