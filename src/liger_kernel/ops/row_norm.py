"""Row normalisation shared by RMSNorm and LayerNorm: the forward and backward kernels, their launch
geometry and the summation of the backward's per-program weight-gradient partials."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from liger_kernel.ops.checks import as_rows
from liger_kernel.ops.launch import (
    MAX_BLOCK,
    MAX_FUSED_BLOCK,
    _persistent_grid,
    cdiv,
    is_interpreter,
    launch_kernel,
    multiprocessor_count,
    next_power_of_2,
    row_launch_settings,
)
from liger_kernel.ops.numerics import round_to_dtype

# ======================================================================================
# Row normalisation (RMSNorm, LayerNorm): shared kernels and launch tunables.
#
# Both norms normalise each row by per-row statistics and then scale (and shift):
#     xhat = (x - mu) * rstd,   y = xhat * (w + offset) [+ b]
# with mu = 0, rstd = 1/sqrt(mean(x^2) + eps) for RMSNorm and mu = mean(x),
# rstd = 1/sqrt(var(x) + eps) for LayerNorm. One forward and one backward kernel serve
# both, specialised by constexpr flags (CENTER, HAS_BIAS, CASTING); the full math and the
# casting rules are in the docstrings of ops/rms_norm.py and ops/layer_norm.py.
# ======================================================================================



# How the normalised row meets the weight (the CASTING constexpr of the kernels below).
ROW_NORM_CAST_NONE = 0  # every step rounded to the input dtype, as torch would compute in that dtype
ROW_NORM_CAST_LLAMA = 1  # statistics in fp32, xhat rounded to the input dtype, then times the weight
ROW_NORM_CAST_FP32 = 2  # everything in fp32, rounded once on output (Gemma RMSNorm, LayerNorm)

# ---- Tunables (change these after GPU measurements; nothing else hard-codes them) ----
# Elements per program tile when a whole row fits one tile: rows narrower than this are
# packed ROW_NORM_TILE_ELEMENTS // width to a tile so small hidden sizes still move
# enough bytes per program.
ROW_NORM_TILE_ELEMENTS = 4096
ROW_NORM_MAX_ROWS_PER_TILE = 256
# Backward warps: the backward keeps ~6 fp32 values per element live (dy, x, w, g, xhat,
# the dW accumulator), so it gets fewer elements per thread than the forward: ptxas (sm_90)
# gives the fused RMSNorm backward ~110 registers at 16 elements/thread (4096 cols, 8 warps:
# only 2 programs = 16 warps fit an SM) and 64 at 8 elements/thread (16 warps, 2 programs =
# 32 warps per SM). Measured (sweep below), 16 per thread with 8192-element tiles (2 rows of
# 4096, 16 warps) is the fastest: more bytes in flight per program beat occupancy here.
ROW_NORM_BACKWARD_ELEMENTS_PER_THREAD = 16
# Backward persistent grid: programs per SM = ROW_NORM_WARPS_PER_SM // backward warps,
# clamped to [1, ROW_NORM_MAX_PROGRAMS_PER_SM]. Each program owns one fp32 row of the
# (P, H) partial dW buffer, so fewer programs also means a smaller final reduction.
# ptxas gives the 16-warp backward ~110 registers a thread, so only one such program is
# resident per SM anyway: 16 (one program per SM, P = #SMs) beats 32 (a second wave of
# programs and twice the partials). H200 run 6, 16384 x 4096 bf16 fwd+bwd: RMSNorm
# 0.1793 vs 0.1858 ms, LayerNorm 0.1851 vs 0.1951 ms.
ROW_NORM_WARPS_PER_SM = 16
ROW_NORM_MAX_PROGRAMS_PER_SM = 4
# Backward tile when a whole row fits one tile (the forward uses ROW_NORM_TILE_ELEMENTS):
# ROW_NORM_BACKWARD_TILE_ROWS rows, within [ROW_NORM_BACKWARD_MIN_TILE_ELEMENTS,
# ROW_NORM_BACKWARD_TILE_ELEMENTS] elements. H200 sweeps, fwd+bwd bf16, CUDA-graph timing:
# run 2 (RMSNorm 16384 x 4096) 8192-element tiles at 16 elements/thread 0.197 ms, 4096 at
# 8/thread 0.225 ms; run 6, at 16 elements/thread: 16384 x 4096 RMSNorm 0.1795 ms (8192)
# vs 0.2102 (4096), but 8192 x 2048 RMSNorm 0.0552 (4096) vs 0.0609 (8192), LayerNorm
# 0.0573 vs 0.0688: two rows a tile is the best at both widths.
ROW_NORM_BACKWARD_TILE_ELEMENTS = 8192
ROW_NORM_BACKWARD_MIN_TILE_ELEMENTS = 4096
ROW_NORM_BACKWARD_TILE_ROWS = 2
# Backward of fused rows: load the next tile while the current one is reduced and stored.
ROW_NORM_BACKWARD_PREFETCH = True
# Backward dW/dB accumulation of a multi-row tile: None picks per shape (a (rows, cols)
# register accumulator summed once at the end when a tile's rows lie in different warps,
# where a per-tile sum over rows is a shared-memory reduction; the per-tile sum when each
# thread holds whole columns). H200, llama-1b e2e (8192 x 2048, tiles of 4 x 2048 over
# 2 x 8 warps): 77.6 -> 41.1 us per backward with the accumulator. True/False force one.
ROW_NORM_BACKWARD_ROW_ACCUMULATOR = None
# Forward warps: None keeps row_launch_settings' choice for the tile (8 warps, 16 elements
# per thread, for a 4096-element tile); a number sets the elements each thread holds.
# LayerNorm (CENTER) has its own: its two dependent row reductions (mean, then the centred
# variance) each cross every warp of the row, so fewer warps per row pay off there. Only
# whole-row tiles use it (rows wider than MAX_FUSED_BLOCK keep the heuristic).
# H200, 16384 x 4096 bf16 forward (run 6): RMSNorm None 0.0703 ms, 32 0.0721; LayerNorm
# None 0.0775 ms, 32 0.0726.
ROW_NORM_FORWARD_ELEMENTS_PER_THREAD = None
ROW_NORM_CENTERED_FORWARD_ELEMENTS_PER_THREAD = 32
# The backward's (P, H) fp32 partials are summed by one Triton launch per backward
# (dW and dB together, rounded straight to the parameter dtype); False uses torch's
# ``partials.sum(0).to(dtype)``, two launches per parameter, for A/B measurements.
# H200 run 6 (16384 x 4096): RMSNorm fwd+bwd 0.1932 ms against torch's 0.1968; narrow
# column blocks spread the sum over more SMs: 16 columns 0.1822 ms, 64 columns 0.1857.
ROW_NORM_TRITON_PARTIALS_SUM = True
PARTIALS_SUM_BLOCK_ROWS = 64
PARTIALS_SUM_BLOCK_COLS = 16


@dataclasses.dataclass(frozen=True)
class RowNormLaunch:
    """Launch geometry shared by the forward and backward row-normalisation kernels."""

    block_rows: int  # rows per forward tile (power of two)
    backward_block_rows: int  # rows per backward tile (power of two)
    block_cols: int  # columns per tile (power of two); a row wider than this is looped over
    num_warps: int  # forward
    backward_num_warps: int
    fused: bool  # the whole row fits one tile (single pass over registers)
    n_tiles: int  # forward grid: one program per tile
    backward_programs: int  # backward grid: persistent programs striding over the tiles
    round_by_hand: bool  # interpreter only: see round_to_dtype
    backward_prefetch: bool
    backward_row_accumulator: bool  # dW/dB kept per tile row until the end (see the tunable)


def row_norm_launch(n_rows: int, n_cols: int, device: torch.device, center: bool = False) -> RowNormLaunch:
    """Tile shape, warps and grid sizes for normalising ``n_rows`` rows of ``n_cols``
    (``center``: LayerNorm, which subtracts the mean).

    Memoised (a training step asks for the same few shapes hundreds of times, and the
    host time of a launch shows as GPU idle time when the GPU outpaces Python); the key
    includes the tunables, so changing one (``benchmarks.tune``) takes effect at once.
    """
    tunables = (MAX_FUSED_BLOCK, MAX_BLOCK, ROW_NORM_TILE_ELEMENTS, ROW_NORM_MAX_ROWS_PER_TILE,
                ROW_NORM_BACKWARD_ELEMENTS_PER_THREAD, ROW_NORM_WARPS_PER_SM, ROW_NORM_MAX_PROGRAMS_PER_SM,
                ROW_NORM_BACKWARD_TILE_ELEMENTS, ROW_NORM_BACKWARD_MIN_TILE_ELEMENTS, ROW_NORM_BACKWARD_TILE_ROWS,
                ROW_NORM_BACKWARD_PREFETCH, ROW_NORM_BACKWARD_ROW_ACCUMULATOR, is_interpreter())
    forward_elements_per_thread = (ROW_NORM_CENTERED_FORWARD_ELEMENTS_PER_THREAD if center
                                   else ROW_NORM_FORWARD_ELEMENTS_PER_THREAD)
    return _row_norm_launch(n_rows, n_cols, multiprocessor_count(device), forward_elements_per_thread, tunables)


def row_norm_grad_buffers(grad_output: torch.Tensor, x: torch.Tensor,
                          in_place: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dy_rows, dx_rows, grad_x)`` for a norm backward launch over x's rows.

    In place, dx is written over dy and ``grad_x`` is an empty placeholder (a custom op may
    not return an alias of its input; the caller returns grad_output); otherwise dx is a
    fresh buffer and ``grad_x`` its view in x's shape.
    """
    n_rows, n_cols = as_rows(x).shape
    if in_place:
        dy_rows = grad_output.view(n_rows, n_cols)
        return dy_rows, dy_rows, x.new_empty((0,))
    dx_rows = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    return as_rows(grad_output), dx_rows, dx_rows.view(x.shape)


@functools.lru_cache(maxsize=1024)
def _row_norm_launch(n_rows: int, n_cols: int, n_sms: int, forward_elements_per_thread: int | None,
                     tunables: tuple) -> RowNormLaunch:
    block_cols, _ = row_launch_settings(n_cols)
    fused = block_cols >= n_cols

    def rows_per_tile(tile_elements: int) -> int:
        if not fused:
            return 1
        return min(max(1, tile_elements // block_cols), ROW_NORM_MAX_ROWS_PER_TILE,
                   next_power_of_2(n_rows))

    block_rows = rows_per_tile(ROW_NORM_TILE_ELEMENTS)
    backward_block_rows = rows_per_tile(min(ROW_NORM_BACKWARD_TILE_ELEMENTS, max(
        ROW_NORM_BACKWARD_MIN_TILE_ELEMENTS, ROW_NORM_BACKWARD_TILE_ROWS * block_cols)))
    _, num_warps = row_launch_settings(block_rows * block_cols, max_block=MAX_BLOCK)
    if forward_elements_per_thread is not None and fused and not is_interpreter():
        num_warps = _warps_for(block_rows * block_cols, forward_elements_per_thread)
    backward_num_warps = _warps_for(backward_block_rows * block_cols, ROW_NORM_BACKWARD_ELEMENTS_PER_THREAD)
    if is_interpreter():
        backward_num_warps = num_warps  # ignored by the interpreter, but it sizes the grid below
    n_tiles = cdiv(n_rows, block_rows)
    programs_per_sm = max(1, min(ROW_NORM_MAX_PROGRAMS_PER_SM, ROW_NORM_WARPS_PER_SM // backward_num_warps))
    programs = _persistent_grid(cdiv(n_rows, backward_block_rows), n_sms, programs_per_sm)
    # Triton's default layout gives each warp 32 threads x 8 contiguous columns; a tile row
    # narrower than all warps together puts the tile's rows into different warps.
    row_accumulator = ROW_NORM_BACKWARD_ROW_ACCUMULATOR
    if row_accumulator is None:
        row_accumulator = backward_block_rows > 1 and block_cols < 256 * backward_num_warps
    return RowNormLaunch(block_rows, backward_block_rows, block_cols, num_warps, backward_num_warps, fused, n_tiles,
                         programs, is_interpreter(), ROW_NORM_BACKWARD_PREFETCH, bool(row_accumulator))


def _warps_for(tile_elements: int, elements_per_thread: int) -> int:
    """Warps (a power of two in [1, 32]) giving each thread about ``elements_per_thread``."""
    return next_power_of_2(max(1, min(32, tile_elements // (32 * elements_per_thread))))


@triton.jit
def _div(total, count):
    """``total / count`` correctly rounded: Triton's ``/`` on fp32 is an approximate division
    on the GPU, and a mean that misses by an ulp (a constant row whose mean is not exactly
    its value) is amplified by rstd up to 1/sqrt(eps)."""
    return tl.math.div_rn(total, count * 1.0)


@triton.jit
def _row_norm_square(x, dtype: tl.constexpr, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """x**2 for the mean of squares; rounded to the input dtype in CASTING 0, as ``x.pow(2)`` is there."""
    if CASTING == 0:
        return round_to_dtype(x * x, dtype, ROUND_BY_HAND)
    else:
        return x * x


@triton.jit
def _row_norm_rstd(sum_sq, n_cols, eps, dtype: tl.constexpr, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """1/sqrt(mean + eps) from the row's sum of squares (accumulated in fp32).

    CASTING 0 rounds as torch does computing ``rsqrt(x.pow(2).mean() + eps)`` in the input
    dtype: the mean, the sum with eps and the rsqrt each rounded to it. Without that, rstd
    can differ from torch's by an ulp of the dtype, which shows as up to 3 ulps in y.
    """
    mean_sq = _div(sum_sq, n_cols)
    if CASTING == 0:
        mean_sq = round_to_dtype(mean_sq, dtype, ROUND_BY_HAND)
        return round_to_dtype(tl.rsqrt(round_to_dtype(mean_sq + eps, dtype, ROUND_BY_HAND)), dtype, ROUND_BY_HAND)
    else:
        return tl.rsqrt(mean_sq + eps)


@triton.jit
def _row_norm_scale_store(Y_ptrs, X, W, B, cols, col_mask, mask, xc, rstd, offset,
                          HAS_BIAS: tl.constexpr, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """y = xhat * (w + offset) [+ b] for one tile, rounded as CASTING says, stored to Y_ptrs."""
    in_dtype = X.dtype.element_ty
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    if CASTING == 0:
        # Emulates computing in the input dtype: each product rounded to it.
        rstd_in = round_to_dtype(rstd, in_dtype, ROUND_BY_HAND)
        xhat = round_to_dtype(xc * rstd_in[:, None], in_dtype, ROUND_BY_HAND)
        w = round_to_dtype(w, in_dtype, ROUND_BY_HAND)
    elif CASTING == 1:
        xhat = round_to_dtype(xc * rstd[:, None], in_dtype, ROUND_BY_HAND)
    else:
        xhat = xc * rstd[:, None]
    y = xhat * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_dtype = Y_ptrs.dtype.element_ty
    if ROUND_BY_HAND:
        y = round_to_dtype(y, out_dtype, ROUND_BY_HAND)
    tl.store(Y_ptrs, y.to(out_dtype), mask=mask)


@triton.jit
def row_norm_forward_kernel(
    X, W, B, Y, MEAN, RSTD,
    n_rows, n_cols, x_row_stride, y_row_stride,
    eps, offset,
    CENTER: tl.constexpr, HAS_BIAS: tl.constexpr, CASTING: tl.constexpr,
    FUSED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
):
    """One program per tile of BLOCK_ROWS rows: statistics, then y; stores rstd (and mean)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    x_rows = X + rows64[:, None] * x_row_stride
    y_rows = Y + rows64[:, None] * y_row_stride
    mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    if FUSED:
        cols = tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        xc = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if CENTER:
            mean = _div(tl.sum(xc, axis=1), n_cols)
            xc = tl.where(mask, xc - mean[:, None], 0.0)
        rstd = _row_norm_rstd(tl.sum(_row_norm_square(xc, X.dtype.element_ty, CASTING, ROUND_BY_HAND), axis=1),
                              n_cols, eps, X.dtype.element_ty, CASTING, ROUND_BY_HAND)
        _row_norm_scale_store(y_rows + cols[None, :], X, W, B, cols, col_mask, mask, xc, rstd, offset,
                              HAS_BIAS, CASTING, ROUND_BY_HAND)
    else:
        # Pass 1: statistics over column blocks. LayerNorm merges per-block (mean, M2)
        # pairs (Chan et al.), which avoids the cancellation of E[x^2] - E[x]^2.
        m2 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        sum_sq = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if CENTER:
                seen = start * 1.0
                block_n = tl.minimum(n_cols - start, BLOCK_COLS) * 1.0
                block_mean = _div(tl.sum(x, axis=1), block_n)
                d = tl.where(mask, x - block_mean[:, None], 0.0)
                delta = block_mean - mean
                total = seen + block_n
                mean += delta * (block_n / total)
                m2 += tl.sum(d * d, axis=1) + delta * delta * (seen * block_n / total)
            else:
                sum_sq += _row_norm_square(x, X.dtype.element_ty, CASTING, ROUND_BY_HAND)
        if CENTER:
            rstd = tl.rsqrt(_div(m2, n_cols) + eps)
        else:
            rstd = _row_norm_rstd(tl.sum(sum_sq, axis=1), n_cols, eps, X.dtype.element_ty, CASTING, ROUND_BY_HAND)
        # Pass 2: normalise and store (the row is re-read, mostly from L2).
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            xc = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if CENTER:
                xc = tl.where(mask, xc - mean[:, None], 0.0)
            _row_norm_scale_store(y_rows + cols[None, :], X, W, B, cols, col_mask, mask, xc, rstd, offset,
                                  HAS_BIAS, CASTING, ROUND_BY_HAND)
    tl.store(RSTD + rows64, rstd, mask=row_mask)
    if CENTER:
        tl.store(MEAN + rows64, mean, mask=row_mask)


@triton.jit
def _row_norm_grad_weight(W, X, cols, col_mask, offset, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """(w + offset) in fp32 for one column block, rounded as the forward used it."""
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    if CASTING == 0:
        w = round_to_dtype(w, X.dtype.element_ty, ROUND_BY_HAND)
    return w


@triton.jit
def _row_norm_grad_terms(dy_raw, x_raw, X, w, mask, mean, rstd,
                         CENTER: tl.constexpr, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """From one loaded tile: (dy, xhat, g = dy * w, xhat as the forward multiplied it by w), fp32."""
    in_dtype = X.dtype.element_ty
    dy = dy_raw.to(tl.float32)
    xc = x_raw.to(tl.float32)
    if CENTER:
        xc = tl.where(mask, xc - mean[:, None], 0.0)
    xhat = xc * rstd[:, None]
    g = dy * w[None, :]
    if CASTING == 0:
        g = round_to_dtype(g, in_dtype, ROUND_BY_HAND)
        xhat_w = round_to_dtype(xc * round_to_dtype(rstd, in_dtype, ROUND_BY_HAND)[:, None], in_dtype,
                                 ROUND_BY_HAND)
    elif CASTING == 1:
        # Autograd through HF's `.to(input_dtype)` rounds dL/dxhat to the input dtype.
        g = round_to_dtype(g, in_dtype, ROUND_BY_HAND)
        xhat_w = round_to_dtype(xhat, in_dtype, ROUND_BY_HAND)
    else:
        xhat_w = xhat
    return dy, xhat, g, xhat_w


@triton.jit
def row_norm_backward_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    n_rows, n_cols, dy_row_stride, x_row_stride, dx_row_stride, offset,
    CENTER: tl.constexpr, HAS_BIAS: tl.constexpr, CASTING: tl.constexpr,
    FUSED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
    PREFETCH: tl.constexpr, ROW_ACCUMULATOR: tl.constexpr,
):
    """Persistent programs: program p handles tiles p, p + P, ... and writes its fp32 partial
    dW (and dB) to row p of DW_PARTIAL (DB_PARTIAL), so the final sum over P is fixed-order.

    DX may alias DY (in-place backward): every element of DY is read before the same
    program overwrites it, and no other program touches those rows.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_ROWS)
    partial_row = pid.to(tl.int64) * n_cols
    if FUSED:
        cols = tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        w = _row_norm_grad_weight(W, X, cols, col_mask, offset, CASTING, ROUND_BY_HAND)  # once per program
        # ROW_ACCUMULATOR: accumulated per tile row and summed over rows once at the end,
        # for tiles whose rows lie in different warps (e.g. 4 x 2048 at 16 warps: 2 x 8),
        # where a per-tile sum over rows costs a cross-warp (shared memory) reduction.
        if ROW_ACCUMULATOR:
            dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        else:
            dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        # Software prefetch: the loads of this program's next tile are issued before the
        # current tile's reductions and stores, so a persistent program keeps memory busy
        # instead of alternating load latency and compute (the loop carries the raw tiles).
        # The row statistics travel with the tile: a load of rstd (and mean) issued only when
        # the tile is processed would expose a full memory latency once per tile.
        if PREFETCH:
            rows64 = (pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
            mask = (rows64 < n_rows)[:, None] & col_mask[None, :]
            next_dy = tl.load(DY + rows64[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
            next_x = tl.load(X + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
            next_rstd = tl.load(RSTD + rows64, mask=rows64 < n_rows, other=0.0)
            next_mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            if CENTER:
                next_mean = tl.load(MEAN + rows64, mask=rows64 < n_rows, other=0.0)
        for tile in tl.range(pid, n_tiles, n_programs):
            rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            if PREFETCH:
                dy_raw = next_dy
                x_raw = next_x
                rstd = next_rstd
                mean = next_mean
                ahead = rows64 + n_programs * BLOCK_ROWS
                ahead_rows = ahead < n_rows
                ahead_mask = ahead_rows[:, None] & col_mask[None, :]
                next_dy = tl.load(DY + ahead[:, None] * dy_row_stride + cols[None, :], mask=ahead_mask, other=0.0)
                next_x = tl.load(X + ahead[:, None] * x_row_stride + cols[None, :], mask=ahead_mask, other=0.0)
                next_rstd = tl.load(RSTD + ahead, mask=ahead_rows, other=0.0)
                if CENTER:
                    next_mean = tl.load(MEAN + ahead, mask=ahead_rows, other=0.0)
            else:
                dy_raw = tl.load(DY + rows64[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
                x_raw = tl.load(X + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
                rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
                mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                if CENTER:
                    mean = tl.load(MEAN + rows64, mask=row_mask, other=0.0)
            dy, xhat, g, xhat_w = _row_norm_grad_terms(
                dy_raw, x_raw, X, w, mask, mean, rstd, CENTER, CASTING, ROUND_BY_HAND)
            if CENTER:
                dx = (g - xhat * _div(tl.sum(g * xhat, axis=1), n_cols)[:, None]
                      - _div(tl.sum(g, axis=1), n_cols)[:, None])
            else:
                dx = g - xhat * _div(tl.sum(g * xhat, axis=1), n_cols)[:, None]
            dx = dx * rstd[:, None]
            if ROUND_BY_HAND:
                dx = round_to_dtype(dx, DX.dtype.element_ty, ROUND_BY_HAND)
            tl.store(DX + rows64[:, None] * dx_row_stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if ROW_ACCUMULATOR:
                dw_acc += dy * xhat_w
                if HAS_BIAS:
                    db_acc += dy
            else:
                dw_acc += tl.sum(dy * xhat_w, axis=0)
                if HAS_BIAS:
                    db_acc += tl.sum(dy, axis=0)
        if ROW_ACCUMULATOR:
            dw_total = tl.sum(dw_acc, axis=0)
            db_total = tl.sum(db_acc, axis=0)
        else:
            dw_total = dw_acc
            db_total = db_acc
        tl.store(DW_PARTIAL + partial_row + cols, dw_total, mask=col_mask)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + partial_row + cols, db_total, mask=col_mask)
    else:
        for tile in tl.range(pid, n_tiles, n_programs):
            rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            dy_rows = DY + rows64[:, None] * dy_row_stride
            x_rows = X + rows64[:, None] * x_row_stride
            dx_rows = DX + rows64[:, None] * dx_row_stride
            rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
            mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            if CENTER:
                mean = tl.load(MEAN + rows64, mask=row_mask, other=0.0)
            # Pass 1: the row sums the gradient needs, sum(g * xhat) and sum(g).
            proj_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            g_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                w = _row_norm_grad_weight(W, X, cols, col_mask, offset, CASTING, ROUND_BY_HAND)
                dy, xhat, g, xhat_w = _row_norm_grad_terms(
                    tl.load(dy_rows + cols[None, :], mask=mask, other=0.0),
                    tl.load(x_rows + cols[None, :], mask=mask, other=0.0),
                    X, w, mask, mean, rstd, CENTER, CASTING, ROUND_BY_HAND)
                proj_acc += g * xhat
                if CENTER:
                    g_acc += g
            proj = _div(tl.sum(proj_acc, axis=1), n_cols)
            g_mean = _div(tl.sum(g_acc, axis=1), n_cols)
            # Pass 2: dx, and this program's partial dW/dB (its own buffer row, so the
            # read-modify-write needs no atomics; the first tile overwrites garbage).
            first = tile == pid
            for start in range(0, n_cols, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                w = _row_norm_grad_weight(W, X, cols, col_mask, offset, CASTING, ROUND_BY_HAND)
                dy, xhat, g, xhat_w = _row_norm_grad_terms(
                    tl.load(dy_rows + cols[None, :], mask=mask, other=0.0),
                    tl.load(x_rows + cols[None, :], mask=mask, other=0.0),
                    X, w, mask, mean, rstd, CENTER, CASTING, ROUND_BY_HAND)
                dx = g - xhat * proj[:, None]
                if CENTER:
                    dx -= g_mean[:, None]
                dx = dx * rstd[:, None]
                if ROUND_BY_HAND:
                    dx = round_to_dtype(dx, DX.dtype.element_ty, ROUND_BY_HAND)
                tl.store(dx_rows + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                dw_ptrs = DW_PARTIAL + partial_row + cols
                dw_prev = tl.where(first, 0.0, tl.load(dw_ptrs, mask=col_mask, other=0.0))
                tl.store(dw_ptrs, dw_prev + tl.sum(dy * xhat_w, axis=0), mask=col_mask)
                if HAS_BIAS:
                    db_ptrs = DB_PARTIAL + partial_row + cols
                    db_prev = tl.where(first, 0.0, tl.load(db_ptrs, mask=col_mask, other=0.0))
                    tl.store(db_ptrs, db_prev + tl.sum(dy, axis=0), mask=col_mask)


@triton.jit
def _sum_partials_kernel(PARTIALS, OUT_FIRST, OUT_SECOND, n_partials, n_cols,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """``OUT[c] = sum_p PARTIALS[k, p, c]`` for a column block; program axis 1 picks k
    (0: OUT_FIRST, 1: OUT_SECOND). The order of the sum is fixed by the tile shape alone, so
    the result does not depend on scheduling."""
    which = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    base = PARTIALS + which.to(tl.int64) * n_partials * n_cols
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(base + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        total = round_to_dtype(total, OUT_FIRST.dtype.element_ty, ROUND_BY_HAND)
        tl.store(OUT_FIRST + cols, total.to(OUT_FIRST.dtype.element_ty), mask=col_mask)
    else:
        total = round_to_dtype(total, OUT_SECOND.dtype.element_ty, ROUND_BY_HAND)
        tl.store(OUT_SECOND + cols, total.to(OUT_SECOND.dtype.element_ty), mask=col_mask)


def sum_partials(partials: torch.Tensor, dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Column sums of a norm backward's per-program partials, one new (H,) tensor per slab.

    ``partials`` is (K, P, H) fp32 with K = len(dtypes) in {1, 2} (dW, and dB for
    LayerNorm); slab k is summed over its P rows in fp32 and rounded once to ``dtypes[k]``.
    The outputs never share storage (a custom op's returns must not alias).
    """
    n_slabs, n_partials, n_cols = partials.shape
    if n_slabs != len(dtypes) or n_slabs not in (1, 2):
        raise ValueError(f"partials of shape {tuple(partials.shape)} need 1 or 2 dtypes, got {len(dtypes)}")
    if not ROW_NORM_TRITON_PARTIALS_SUM:
        return [partials[k].sum(dim=0).to(dtypes[k]) for k in range(n_slabs)]
    outs = [torch.empty(n_cols, dtype=dtype, device=partials.device) for dtype in dtypes]
    grid = (cdiv(n_cols, PARTIALS_SUM_BLOCK_COLS), n_slabs)
    launch_kernel(_sum_partials_kernel, grid, partials, outs[0], outs[-1], n_partials, n_cols,
                  BLOCK_ROWS=PARTIALS_SUM_BLOCK_ROWS, BLOCK_COLS=PARTIALS_SUM_BLOCK_COLS,
                  ROUND_BY_HAND=is_interpreter(), num_warps=4)
    return outs
