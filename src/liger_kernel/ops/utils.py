"""Compatibility shim: ``liger_kernel.ops.utils``, the import path downstream Triton kernels use
(axolotl's ``kernels/rms_norm_gated.py`` and ``kernels/gemma4_fused_rope.py``) for launch helpers.

The module name is the callers', not ours: the helpers' real homes are
:mod:`liger_kernel.ops.launch` (launch geometry) and :mod:`liger_kernel.ops.checks`; this file
only adapts them to the call shapes those callers expect. Nothing in this package imports it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl
from torch.torch_version import TorchVersion

from liger_kernel.ops.launch import MAX_BLOCK, next_power_of_2, row_launch_settings

__all__ = ["calculate_settings", "compare_version", "ensure_contiguous", "torch_to_triton_dtype"]

# The Triton element type of each float dtype the kernels take.
torch_to_triton_dtype = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def calculate_settings(n: int) -> tuple[int, int]:
    """``(BLOCK_SIZE, num_warps)`` for a kernel that holds a whole row of ``n`` elements in one block.

    ``BLOCK_SIZE`` is the next power of two >= ``n`` (callers rely on one block covering the
    row); ``num_warps`` grows with it as in :func:`liger_kernel.ops.launch.row_launch_settings`.
    Raises ``RuntimeError`` when the row needs a block above :data:`~liger_kernel.ops.launch.MAX_BLOCK`.
    """
    block = next_power_of_2(n)
    if block > MAX_BLOCK:
        raise RuntimeError(f"a row of n = {n} elements needs a block of {block}, above the largest "
                           f"single-block size {MAX_BLOCK}")
    return row_launch_settings(n, max_block=MAX_BLOCK)


def compare_version(package: str, op: Callable[[Any, Any], bool], target: str) -> bool:
    """``op(version of package, target)``, e.g. ``compare_version("triton", operator.ge, "3.0.0")``.

    The version is the imported module's ``__version__`` compared as a PEP 440 version; a
    package that cannot be imported compares False.
    """
    try:
        module = importlib.import_module(package)
    except ImportError:
        return False
    return bool(op(TorchVersion(str(module.__version__)), target))


def ensure_contiguous(fn: Callable) -> Callable:
    """Decorator for an autograd ``forward``/``backward(ctx, *args, **kwargs)``: every tensor
    argument is made contiguous (a copy only where it is not) before ``fn`` runs."""

    def contiguous(value: Any) -> Any:
        return value.contiguous() if isinstance(value, torch.Tensor) else value

    @functools.wraps(fn)
    def wrapper(ctx, *args: Any, **kwargs: Any):
        return fn(ctx, *map(contiguous, args), **{name: contiguous(v) for name, v in kwargs.items()})

    return wrapper
