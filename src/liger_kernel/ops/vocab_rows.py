"""Machinery shared by the row-wise losses over a vocabulary (JSD, KL divergence, TVD, per-token
log-probabilities): their launch configuration, argument checks, the device-side count of
counted rows, and running a launcher on meta tensors.

Every such kernel walks one row of width ``V`` per program in column blocks of
``block_size``; :class:`VocabRowConfig` is the frozen launch configuration each op subclasses
(so overrides name one op), with the block and warp heuristic of
:func:`~liger_kernel.ops.launch.row_launch_settings`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from liger_kernel.ops.checks import check_float_dtype, check_same_device, check_tensor
from liger_kernel.ops.config import LaunchConfig
from liger_kernel.ops.launch import is_interpreter, is_meta, row_launch_settings

# Widest column block of the row loop. The divergences are elementwise plus one row sum, so a
# block only needs to be wide enough to keep the loads in flight; wider blocks spill.
VOCAB_MAX_BLOCK = 8192


@dataclasses.dataclass(frozen=True)
class VocabRowConfig(LaunchConfig):
    """Column block (a power of two) and warps of a one-program-per-row vocabulary kernel."""

    block_size: int
    num_warps: int

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_warps < 1:
            raise ValueError(f"num_warps must be positive, got {self.num_warps}")

    @classmethod
    def heuristic(cls, n_cols: int):
        block, warps = row_launch_settings(n_cols, VOCAB_MAX_BLOCK)
        return cls(block_size=block, num_warps=warps)

    @classmethod
    def search_space(cls, n_cols: int) -> Iterator[VocabRowConfig]:
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16, 32):
                if block // (32 * warps) >= 1:
                    yield cls(block_size=block, num_warps=1 if is_interpreter() else warps)


def run_launcher(launcher, *args):
    """Call a :func:`~liger_kernel.ops.launch.liger_custom_op` launcher, through its registered
    op (whose fake implementation serves the meta device) when a tensor argument is meta."""
    if is_meta(*(a for a in args if isinstance(a, torch.Tensor))):
        return launcher.op(*args)
    return launcher(*args)


def check_devices(named: Iterable[tuple[str, torch.Tensor | None]]) -> None:
    """All tensors on one device usable by the kernels; meta tensors must all be meta."""
    named = list(named)
    tensors = [t for _, t in named if t is not None]
    for name, t in named:
        if t is not None:
            check_tensor(t, name)
    if is_meta(*tensors):
        if not all(t.device.type == "meta" for t in tensors):
            raise ValueError("either every tensor or none must be on the meta device")
        return
    check_same_device(named)


def check_distribution_pair(input: torch.Tensor, target: torch.Tensor, input_name: str = "input",
                            target_name: str = "target") -> None:
    """Two float tensors of one shape with at least one dimension (rows over the last one)."""
    check_float_dtype(input, input_name)
    check_float_dtype(target, target_name)
    if input.shape != target.shape:
        raise ValueError(f"{input_name} has shape {tuple(input.shape)} but {target_name} has shape "
                         f"{tuple(target.shape)}; they must match")
    if input.dim() == 0 or input.shape[-1] < 1:
        raise ValueError(f"{input_name} must have a non-empty last dimension (the vocabulary), got shape "
                         f"{tuple(input.shape)}")


def check_labels(labels: torch.Tensor | None, n_rows: int, name: str = "shift_labels") -> torch.Tensor | None:
    """``labels`` (N,) of integer class indices, one per row, made contiguous; None stays None."""
    if labels is None:
        return None
    check_tensor(labels, name)
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold integer class indices (int64 or int32), got dtype {labels.dtype}")
    if labels.dim() != 1 or labels.shape[0] != n_rows:
        raise ValueError(f"{name} must have shape ({n_rows},), one per row, got {tuple(labels.shape)}")
    return labels.contiguous()


def labelled_vocab_rows(input: torch.Tensor, target: torch.Tensor, shift_labels: torch.Tensor | None):
    """``(input_rows, target_rows, labels)``: the (N, V) row views of a checked distribution
    pair and its optional per-row ``shift_labels`` as checked (N,) class indices (or None)."""
    input_rows = as_vocab_rows(input)
    target_rows = as_vocab_rows(target)
    labels = None
    if shift_labels is not None:
        check_tensor(shift_labels, "shift_labels")
        labels = check_labels(shift_labels.reshape(-1), input_rows.shape[0])
    return input_rows, target_rows, labels


def counted_rows(labels: torch.Tensor | None, ignore_index: int, n_rows: int, device: torch.device) -> torch.Tensor:
    """(1,) float32 device tensor: the rows whose label is not ``ignore_index`` (all rows without
    labels), at least 1, so that a batch with every row ignored gives 0 rather than 0/0.
    Computed on the device: no host sync."""
    if labels is None:
        return torch.full((1,), float(max(n_rows, 1)), device=device, dtype=torch.float32)
    return (labels != ignore_index).sum(dtype=torch.float32).clamp_min(1.0).reshape(1)


def as_vocab_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., V) as (N, V) rows with unit column stride and disjoint rows, copying only
    if it must (a kernel addresses ``row * stride0 + col``)."""
    if x.dim() == 1:
        x = x.unsqueeze(0)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[1] > 1 and rows.stride(1) != 1 or rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]:
        rows = rows.contiguous()
    return rows


def loss_output(x: torch.Tensor, elementwise: bool) -> torch.Tensor:
    """The forward's output buffer for (N, V) rows ``x``: the elements in ``x``'s dtype (a
    ``"none"`` reduction) or float32 row sums (N,). Also the fake implementations' result."""
    if elementwise:
        return x.new_empty(x.shape)
    return x.new_empty(x.shape[:1], dtype=torch.float32)


def gradient_buffer(x: torch.Tensor, wanted: bool) -> torch.Tensor:
    """A fresh contiguous buffer of ``x``'s shape and dtype for its gradient, or an empty
    placeholder where that gradient is not wanted. Also the fake implementations' result."""
    return x.new_empty(x.shape) if wanted else x.new_empty((0,))
