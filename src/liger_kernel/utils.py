"""Compatibility shim: ``liger_kernel.utils``, the import path callers read environment facts from
(axolotl 0.19: ``is_npu_available`` to decide whether to define its Triton kernels,
``PEFT_AVAILABLE`` before testing for PEFT's ``ModulesToSaveWrapper``).

The module name is the callers'. Each name answers the question from the installed packages
and the running torch; the package's own code does not use this module.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["PEFT_AVAILABLE", "is_npu_available", "is_peft_available"]

# Whether ``peft`` is installed (found without importing it).
PEFT_AVAILABLE: bool = importlib.util.find_spec("peft") is not None


def is_peft_available() -> bool:
    return PEFT_AVAILABLE


def is_npu_available() -> bool:
    """Whether an Ascend NPU is usable through ``torch.npu`` (the ``torch_npu`` extension).

    The kernels of this package are Triton kernels for CUDA (and the CPU interpreter); they
    have no NPU variant, so callers use this to decide to skip their own Triton code."""
    npu = getattr(torch, "npu", None)
    is_available = getattr(npu, "is_available", None)
    return bool(is_available()) if callable(is_available) else False
