"""Scaling a stored gradient by the upstream gradient (the losses' backward)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.config import FixedLaunchConfig, launch_config
from liger_kernel.ops.launch import (
    is_interpreter,
    liger_custom_op,
    num_programs_for_rows,
    row_launch_settings,
)
from liger_kernel.ops.numerics import round_to_dtype

# The losses compute their input gradients during the forward pass; backward only scales
# them by dL_total/dloss. That factor is very often exactly 1 (loss.backward() on the loss
# itself), and checking it on the host would need a device sync. The kernel reads the
# factor on the device and leaves the tensor untouched where it is 1, so the common case
# costs one launch instead of a full read and write of a vocabulary-sized buffer.


@dataclasses.dataclass(frozen=True)
class ScaleConfig(FixedLaunchConfig):
    """Launch parameters of :func:`scale_in_place`: ``block`` columns per step (a contiguous
    tensor is processed as rows of ``block`` elements) and persistent ``programs_per_sm``."""

    block: int = 4096
    programs_per_sm: float = 4


@triton.jit
def _scale_in_place_kernel(X, SCALE, n_rows, n_cols, row_stride, PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
                           ROUND_BY_HAND: tl.constexpr):
    """``X[i, :] *= s`` in fp32 and rounded back, for rows i of an (n_rows, n_cols) view.

    ``s`` is ``SCALE[0]`` or, with PER_ROW, ``SCALE[i]``. Rows whose factor is exactly 1
    are neither read nor written. Persistent programs stride over rows.
    """
    offsets = tl.arange(0, BLOCK)
    if not PER_ROW:
        scale = tl.load(SCALE).to(tl.float32)
    for row in tl.range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        if PER_ROW:
            scale = tl.load(SCALE + row).to(tl.float32)
        if scale != 1.0:
            for start in range(0, n_cols, BLOCK):
                cols = start + offsets
                mask = cols < n_cols
                ptrs = X + row * row_stride + cols
                x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                y = round_to_dtype(x * scale, X.dtype.element_ty, ROUND_BY_HAND)
                tl.store(ptrs, y.to(X.dtype.element_ty), mask=mask)


def _scale_rows_in_place(x: torch.Tensor, scale: torch.Tensor) -> None:
    """Launcher: ``x`` (R, C) with unit column stride, ``scale`` 0-d/(1,) or (R,)."""
    n_rows, n_cols = x.shape
    if n_rows == 0 or n_cols == 0:
        return
    per_row = scale.numel() != 1
    config = launch_config(ScaleConfig)
    block, num_warps = row_launch_settings(n_cols, config.block)
    grid = (num_programs_for_rows(n_rows, x.device, config.programs_per_sm),)
    launch_kernel(_scale_in_place_kernel, grid, x, scale, n_rows, n_cols, x.stride(0), PER_ROW=per_row,
                  BLOCK=block, ROUND_BY_HAND=is_interpreter(), num_warps=num_warps)


@liger_custom_op("scale_in_place", mutates_args=("x",))
def scale_in_place(x: torch.Tensor, scale: torch.Tensor) -> None:
    """``x *= scale`` in place, skipping the work (on the device, no sync) where the factor is 1.

    ``scale`` is a single value (0-d or one element) or, for a 2-D ``x`` (R, C), one value
    per row (R,). The product is formed in fp32 and rounded once to ``x``'s dtype. A
    contiguous ``x`` is processed as rows of :class:`ScaleConfig` ``block`` elements whatever
    its shape; other layouts fall back to ``torch.mul_``. Nothing happens for a meta ``x``. ``x``'s autograd version is bumped even where
    nothing changed, so a saved tensor scaled here cannot be silently reused by a second
    backward.
    """
    if x.numel() == 0 or x.device.type == "meta":
        return
    torch.autograd.graph.increment_version(x)
    if scale.numel() != 1:
        if x.dim() != 2 or scale.numel() != x.shape[0]:
            raise ValueError(f"a per-row scale needs x (R, C) and scale (R,), got {tuple(x.shape)} and "
                             f"{tuple(scale.shape)}")
        if x.stride(1) == 1 or x.shape[1] == 1:
            _scale_rows_in_place(x, scale.reshape(-1).contiguous())
        else:
            x.mul_(scale.reshape(-1, 1))
        return
    if x.is_contiguous():
        flat = x.view(-1)
        width = min(launch_config(ScaleConfig).block, flat.numel())
        full_rows = flat.numel() // width
        _scale_rows_in_place(flat[: full_rows * width].view(full_rows, width), scale.reshape(1))
        if full_rows * width < flat.numel():
            _scale_rows_in_place(flat[full_rows * width:].view(1, -1), scale.reshape(1))
    elif x.dim() == 2 and x.stride(1) == 1:
        _scale_rows_in_place(x, scale.reshape(1))
    else:
        x.mul_(scale.reshape(()))


def scale_gradient(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` for a loss's backward: in place (see :func:`scale_in_place`) in eager
    mode, out of place while ``torch.compile`` traces (a traced backward must not mutate a
    saved tensor; Inductor fuses the multiply and plans the memory itself)."""
    if torch.compiler.is_compiling():
        if scale.numel() != 1:
            return x * scale.reshape(-1, 1)
        return x * scale.reshape(())
    scale_in_place(x, scale)
    return x
