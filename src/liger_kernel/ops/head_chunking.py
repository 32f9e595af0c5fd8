"""Chunk sizing, chunk plans and GEMMs of every loss computed through a linear head without its logits.

The fused linear cross entropy and the chunked head engine (preference, RL, distillation and
log-prob losses) walk the N token rows of the hidden states in chunks of C rows. Per chunk
they run three GEMMs of the same size, ``Z_c = X_c W^T`` (2 C D V flops), ``dX_c = G_c W`` and
``dW += G_c^T X_c``, and a memory-bound epilogue over the (C, V) chunk. The GEMMs are the floor
(6 N D V flops for a trained head); what chunking adds is

* the epilogue's passes over the chunk (about 3 C V element reads and writes), and
* one read and one write of all of dW per chunk (``addmm_`` with ``beta = 1``): 2 V D
  elements, N / C times.

Both shrink relative to the GEMMs as C grows, and memory grows with C, so the chunk is sized
from a budget: :class:`HeadChunkConfig` gives the (C, V) buffer the larger of a minimum and a
fraction of the call's gradient bytes (dX + dW, the memory the call must produce anyway),
or exactly ``budget_bytes`` when the caller sets it. The chunks are then balanced (N split
into equal chunks, so the last one is not a sliver) and rounded up to a multiple of 64 rows
(tensor-core friendly GEMM shapes) where the budget allows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from liger_kernel.ops.config import FixedLaunchConfig, launch_config


@dataclasses.dataclass(frozen=True)
class HeadChunkConfig(FixedLaunchConfig):
    """How many token rows a head-bound loss processes per chunk.

    ``budget_fraction`` of the call's gradient bytes (dX + dW), but at least
    ``min_budget_bytes``, is the budget of one (C, V) logits chunk; ``budget_bytes``, when set,
    replaces both (the caller's memory budget). At the N = 8192, D = 4096, V = 128256 bf16
    target shape the gradients take 1066 MiB; three quarters of it hold 3268 rows, so three
    balanced chunks of 2752: dW is re-read and re-written twice instead of twenty times
    (``docs/performance.md``), at a peak of 1.66x the gradients' bytes. ``row_multiple`` rounds the rows of chunks that large;
    ``max_chunk_rows`` caps them (None: no cap), e.g. to cross many chunk boundaries on small
    test shapes.
    """

    budget_fraction: float = 0.75
    min_budget_bytes: int = 128 * 2**20
    budget_bytes: int | None = None
    row_multiple: int = 64
    max_chunk_rows: int | None = None

    @classmethod
    def search_space(cls):
        for fraction in (0.125, 0.25, 0.5, 0.75, 1.0):
            yield cls(budget_fraction=fraction)


def budget_rows(n_cols: int, element_size: int, floor_bytes: int = 0) -> int:
    """The most rows of ``n_cols`` ``element_size``-byte logits one chunk may hold, for a call
    whose gradients take ``floor_bytes`` (the budget of :class:`HeadChunkConfig`), at least 1."""
    config = launch_config(HeadChunkConfig)
    if config.budget_bytes is not None:
        budget = config.budget_bytes
    else:
        budget = max(config.min_budget_bytes, int(config.budget_fraction * floor_bytes))
    most = max(1, budget // max(1, n_cols * element_size))
    if config.max_chunk_rows is not None:
        most = max(1, min(most, config.max_chunk_rows))
    return most


def balanced_ranges(n_items: int, most: int) -> list[tuple[int, int]]:
    """``[0, n_items)`` cut into the fewest ranges of at most ``most`` items, of equal sizes
    (the first ones one longer where it does not divide)."""
    if n_items <= 0:
        return []
    n_ranges = -(-n_items // max(1, most))
    base, extra = divmod(n_items, n_ranges)
    ranges, start = [], 0
    for i in range(n_ranges):
        stop = start + base + (i < extra)
        ranges.append((start, stop))
        start = stop
    return ranges


Ranges = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """How the engine splits a batch: ``one_pass`` and, per chunk, its row ranges (of the
    flattened (B*T) rows, concatenated in order) and, in one-pass mode, its group ranges."""

    one_pass: bool
    row_ranges: tuple[Ranges, ...]
    group_ranges: tuple[Ranges, ...]


def units_per_chunk(unit_rows: int, chunk_rows: int, unit_overshoot: float = 1.0) -> int:
    """Whole units of ``unit_rows`` rows a one-pass chunk holds for a budget of ``chunk_rows``:
    the count nearest the budget, at most ``unit_overshoot * chunk_rows`` rows; 0 where even one
    unit is over that."""
    limit = int(chunk_rows * unit_overshoot)
    fit = limit // max(1, unit_rows)
    nearest = (2 * chunk_rows + unit_rows) // (2 * max(1, unit_rows))  # round half up
    return min(fit, max(1, nearest))


def chunk_plan(n_groups: int, seq_len: int, paired: bool, additive: bool, chunk_rows: int,
               unit_overshoot: float = 1.0) -> ChunkPlan:
    """The chunks of a (B=n_groups, T=seq_len) batch for a budget of ``chunk_rows`` rows of logits
    per chunk.

    One pass when the loss is additive and a unit (a group, or a pair of groups) fits within
    ``unit_overshoot`` times the budget: chunks of :func:`units_per_chunk` whole units at most,
    as few as that allows, balanced. Otherwise two passes over balanced row ranges of at most
    ``chunk_rows``.
    """
    n_rows = n_groups * seq_len
    unit_rows = seq_len * (2 if paired else 1)
    if n_rows == 0:
        return ChunkPlan(True, (), ())
    units = units_per_chunk(unit_rows, chunk_rows, unit_overshoot)
    if additive and units >= 1:
        half = n_groups // 2
        n_units = half if paired else n_groups
        groups = []
        for start, stop in balanced_ranges(n_units, units):
            groups.append(((start, stop), (half + start, half + stop)) if paired else ((start, stop),))
        rows = tuple(tuple((a * seq_len, b * seq_len) for a, b in g) for g in groups)
        return ChunkPlan(True, rows, tuple(groups))
    return ChunkPlan(False, tuple((r,) for r in balanced_ranges(n_rows, chunk_rows)), ())


def chunk_rows_for(n_rows: int, n_cols: int, element_size: int, floor_bytes: int = 0) -> int:
    """Rows per chunk of an (n_rows, n_cols) logits computation of ``element_size``-byte
    elements, for a call whose gradients take ``floor_bytes``: the most rows the budget of
    :class:`HeadChunkConfig` holds, balanced over the chunks that takes and rounded up to a
    multiple of ``row_multiple`` where the budget allows, at least 1 and at most ``n_rows``."""
    most = budget_rows(n_cols, element_size, floor_bytes)
    n_rows = max(1, n_rows)
    if most >= n_rows:
        return n_rows
    n_chunks = -(-n_rows // most)
    rows = -(-n_rows // n_chunks)
    multiple = launch_config(HeadChunkConfig).row_multiple
    if rows >= multiple:
        rounded_up = -(-rows // multiple) * multiple
        rows = rounded_up if rounded_up <= most else rows
    return max(1, min(rows, most, n_rows))


def gradient_bytes(x: torch.Tensor, weight: torch.Tensor, input_grad: bool, weight_grad: bool) -> int:
    """The bytes of the dX and dW a call produces: the floor its chunk budget is a fraction of."""
    return (x.numel() * x.element_size() if input_grad else 0) + \
        (weight.numel() * weight.element_size() if weight_grad else 0)


@contextlib.contextmanager
def gemm_reduction_precision():
    """Within this block, cuBLAS reduces split-K partial sums in fp32.

    By default torch lets cuBLAS reduce them in bf16/fp16. The dX GEMM reduces over the
    whole vocabulary (K = V, up to 262144), where those extra roundings would dominate the
    error, so the chunk GEMMs run with fp32 reductions.
    """
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


# Longest reduction one float32 GEMM call accumulates (see :func:`grad_input_rows`).
FP32_REDUCTION_SLICE = 8192


def grad_input_rows(grad_chunk: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``grad_chunk @ weight`` ((C, V) x (V, D), the dX rows of a chunk), into ``out`` if given.

    The reduction runs over the whole vocabulary. A GEMM accumulates it along K in one fp32
    chain per output tile unless cuBLAS splits K, which it does only where the output has few
    tiles (small chunks): with large chunks the chain is V long, and its rounding error (about
    sqrt(V) ulps of the target row of W, which dominates the running sum) exceeds float32's
    usual accuracy. For float32 operands the reduction is therefore split into slices of at most
    ``FP32_REDUCTION_SLICE`` whose products are summed, so the error no longer depends on the
    chunk size. Low-precision operands need no split: their fp32 accumulation is far more
    accurate than the bf16/fp16 result.
    """
    n_cols = weight.shape[0]
    if grad_chunk.dtype != torch.float32 or n_cols <= FP32_REDUCTION_SLICE:
        return torch.matmul(grad_chunk, weight, out=out)
    n_slices = -(-n_cols // FP32_REDUCTION_SLICE)
    step = -(-n_cols // n_slices)
    out = torch.matmul(grad_chunk[:, :step], weight[:step], out=out)
    for start in range(step, n_cols, step):
        out.addmm_(grad_chunk[:, start:start + step], weight[start:start + step])
    return out


@functools.cache
def _fp32_out_addmm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``addmm(out_dtype=float32, out=acc)`` accumulates low-precision products in place here.

    That cuBLAS path (torch >= 2.8 on CUDA) lets an fp32 dW accumulate bf16/fp16 chunk
    products with no dW-sized temporary. Probed once per device and dtype, numerically.
    """
    try:
        a = torch.randn(64, 32, device=device).to(dtype)
        b = torch.randn(32, 48, device=device).to(dtype)
        acc = torch.randn(64, 48, device=device)
        expected = acc + a.float() @ b.float()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, expected, atol=1e-3, rtol=1e-3))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def accumulate_grad_weight(
    grad_weight: torch.Tensor, grad_chunk: torch.Tensor, x_chunk: torch.Tensor, first: bool
) -> None:
    """``grad_weight += grad_chunk^T @ x_chunk`` in place, without a dW-sized temporary.

    With ``first`` and matching dtypes, ``grad_weight`` may hold garbage: the product is
    written over it (saving the zero fill and one read of dW).
    """
    if grad_weight.dtype == grad_chunk.dtype:
        if first:
            torch.mm(grad_chunk.t(), x_chunk, out=grad_weight)
        else:
            grad_weight.addmm_(grad_chunk.t(), x_chunk)
        return
    # float32 accumulator for low-precision operands.
    if _fp32_out_addmm_works(grad_weight.device, grad_chunk.dtype):
        torch.addmm(grad_weight, grad_chunk.t(), x_chunk, out_dtype=torch.float32, out=grad_weight)
        return
    # Fallback: vocabulary slices, so the low-precision temporary stays chunk-sized.
    n_rows, n_cols = grad_chunk.shape
    slice_cols = max(1, (n_rows * n_cols) // max(1, x_chunk.shape[1]))
    for start in range(0, n_cols, slice_cols):
        stop = min(start + slice_cols, n_cols)
        grad_weight[start:stop].add_(grad_chunk[:, start:stop].t() @ x_chunk)
