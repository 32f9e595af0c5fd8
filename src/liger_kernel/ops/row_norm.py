"""Row normalisation shared by RMSNorm and LayerNorm: the forward and backward kernels and the
summation of the backward's per-program weight-gradient partials (their launch configuration and
geometry: ops/row_norm_geometry.py).

Both norms normalise each row by per-row statistics and then scale (and shift)::

    xhat = (x - mu) * rstd,   y = xhat * (w + offset) [+ b]

with mu = 0, rstd = 1/sqrt(mean(x^2) + eps) for RMSNorm and mu = mean(x),
rstd = 1/sqrt(mean((x - mu)^2) + eps) for LayerNorm. One forward and one backward kernel
serve both, specialised by constexpr flags (CENTER, HAS_BIAS, CASTING); the full math and
the casting rules are in the docstrings of ops/rms_norm.py and ops/layer_norm.py.

LayerNorm's statistics are taken about a shift, the row's first element s::

    d = x - s,   mu_d = mean(d),   x - mu = d - mu_d,   mu = s + mu_d

which changes nothing in exact arithmetic but makes a constant row exact in fp32: every
d is 0, so mu = s, x - mu = 0, y = b and xhat = 0 in the backward, as torch gives. (The
fp32 sum of n copies of c is not n * c, and the error of mean(x), amplified by
rstd = 1/sqrt(eps), would show as |y - b| up to ~0.1 at H = 70000.) For a near-constant row
(all elements within a factor 2 of s) d is exact (Sterbenz) and small, so x - mu is
accurate to the spread of the row, not to the ulp of its magnitude. s is one extra load
per row from the cache line the tile load brings in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.checks import (
    as_rows,
    check_float_dtype,
    check_last_dim,
    check_same_device,
    check_tensor,
)
from liger_kernel.ops.launch import (
    cdiv,
    is_interpreter,
)
from liger_kernel.ops.numerics import round_to_dtype
from liger_kernel.ops.row_norm_geometry import RowNormLaunch, row_norm_launch

# How the normalised row meets the weight (the CASTING constexpr of the kernels below).
ROW_NORM_CAST_NONE = 0  # every step rounded to the input dtype, as torch would compute in that dtype
ROW_NORM_CAST_LLAMA = 1  # statistics in fp32, xhat rounded to the input dtype, then times the weight
ROW_NORM_CAST_FP32 = 2  # everything in fp32, rounded once on output (Gemma RMSNorm, LayerNorm)
# The same values for the kernels (a @triton.jit function reads only constexpr globals).
_CAST_NONE = tl.constexpr(ROW_NORM_CAST_NONE)
_CAST_LLAMA = tl.constexpr(ROW_NORM_CAST_LLAMA)


def check_row_norm_args(X: object, W: object, B: object, eps: object) -> None:
    """The checks RMSNorm and LayerNorm share: ``X`` (..., H) and ``W`` (H,) (and ``B`` (H,)
    unless None) float tensors on one device, ``eps`` a finite float >= 0. Raises
    ``TypeError``/``ValueError`` naming the offending argument."""
    X, W = check_tensor(X, "X"), check_tensor(W, "W")
    check_float_dtype(X, "X")
    check_float_dtype(W, "W")
    if W.dim() != 1:
        raise ValueError(f"W must be 1-D of shape (hidden_size,), got shape {tuple(W.shape)}")
    check_last_dim(X, W.shape[0], "X", "W.shape[0]")
    if B is not None:
        B = check_tensor(B, "B")
        check_float_dtype(B, "B")
        if B.shape != W.shape:
            raise ValueError(f"B has shape {tuple(B.shape)}; it must match W's shape {tuple(W.shape)}")
    check_same_device([("X", X), ("W", W), ("B", B)])
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


def row_norm_grad_buffers(grad_output: torch.Tensor, x: torch.Tensor,
                          in_place: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dy_rows, dx_rows, grad_x)`` for a norm backward launch over x's rows.

    In place, dx is written over dy and ``grad_x`` is an empty placeholder (a custom op may
    not return an alias of its input; the caller returns grad_output); otherwise ``grad_x``
    is a fresh tensor of x's shape (contiguous, not a view) and ``dx_rows`` its (N, H) view.
    """
    n_rows, n_cols = as_rows(x).shape
    if in_place:
        dy_rows = grad_output.view(n_rows, n_cols)
        return dy_rows, dy_rows, x.new_empty((0,))
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return as_rows(grad_output), grad_x.view(n_rows, n_cols), grad_x


@triton.jit
def _div(total, count):
    """``total / count`` correctly rounded: Triton's ``/`` on fp32 is an approximate division
    on the GPU, and a mean that misses by an ulp (a constant row whose mean is not exactly
    its value) is amplified by rstd up to 1/sqrt(eps)."""
    return tl.math.div_rn(total, count * 1.0)


@triton.jit
def _row_norm_square(x, dtype: tl.constexpr, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """x**2 for the mean of squares; rounded to the input dtype in ``_CAST_NONE``, as ``x.pow(2)`` is there."""
    if CASTING == _CAST_NONE:
        return round_to_dtype(x * x, dtype, ROUND_BY_HAND)
    else:
        return x * x


@triton.jit
def _row_norm_rstd(sum_sq, n_cols, eps, dtype: tl.constexpr, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """1/sqrt(mean + eps) from the row's sum of squares (accumulated in fp32).

    ``_CAST_NONE`` rounds as torch does computing ``rsqrt(x.pow(2).mean() + eps)`` in the input
    dtype: the mean, the sum with eps and the rsqrt each rounded to it. Without that, rstd
    can differ from torch's by an ulp of the dtype, which shows as up to 3 ulps in y.
    """
    mean_sq = _div(sum_sq, n_cols)
    if CASTING == _CAST_NONE:
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
    if CASTING == _CAST_NONE:
        # Emulates computing in the input dtype: each product rounded to it.
        rstd_in = round_to_dtype(rstd, in_dtype, ROUND_BY_HAND)
        xhat = round_to_dtype(xc * rstd_in[:, None], in_dtype, ROUND_BY_HAND)
        w = round_to_dtype(w, in_dtype, ROUND_BY_HAND)
    elif CASTING == _CAST_LLAMA:
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
    # LayerNorm: statistics of d = x - shift (the row's first element; module docstring),
    # mean_d = mean(d), so that x - mean = d - mean_d is exact for a constant row.
    shift = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    if CENTER:
        shift = tl.load(X + rows64 * x_row_stride, mask=row_mask, other=0.0).to(tl.float32)
    mean_d = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    if FUSED:
        cols = tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        xc = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if CENTER:
            xc = tl.where(mask, xc - shift[:, None], 0.0)
            mean_d = _div(tl.sum(xc, axis=1), n_cols)
            xc = tl.where(mask, xc - mean_d[:, None], 0.0)
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
                x = tl.where(mask, x - shift[:, None], 0.0)
                seen = start * 1.0
                block_n = tl.minimum(n_cols - start, BLOCK_COLS) * 1.0
                block_mean = _div(tl.sum(x, axis=1), block_n)
                d = tl.where(mask, x - block_mean[:, None], 0.0)
                delta = block_mean - mean_d
                total = seen + block_n
                mean_d += delta * (block_n / total)
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
                xc = tl.where(mask, (xc - shift[:, None]) - mean_d[:, None], 0.0)
            _row_norm_scale_store(y_rows + cols[None, :], X, W, B, cols, col_mask, mask, xc, rstd, offset,
                                  HAS_BIAS, CASTING, ROUND_BY_HAND)
    tl.store(RSTD + rows64, rstd, mask=row_mask)
    if CENTER:
        tl.store(MEAN + rows64, shift + mean_d, mask=row_mask)


@triton.jit
def _row_norm_grad_weight(W, X, cols, col_mask, offset, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """(w + offset) in fp32 for one column block, rounded as the forward used it."""
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    if CASTING == _CAST_NONE:
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
    if CASTING == _CAST_NONE:
        g = round_to_dtype(g, in_dtype, ROUND_BY_HAND)
        xhat_w = round_to_dtype(xc * round_to_dtype(rstd, in_dtype, ROUND_BY_HAND)[:, None], in_dtype,
                                 ROUND_BY_HAND)
    elif CASTING == _CAST_LLAMA:
        # Autograd through HF's `.to(input_dtype)` rounds dL/dxhat to the input dtype.
        g = round_to_dtype(g, in_dtype, ROUND_BY_HAND)
        xhat_w = round_to_dtype(xhat, in_dtype, ROUND_BY_HAND)
    else:
        xhat_w = xhat
    return dy, xhat, g, xhat_w


@triton.jit
def _row_norm_grad_column_tile(dy_rows, x_rows, W, X, start, n_cols, row_mask, mean, rstd, offset,
                               BLOCK_COLS: tl.constexpr, CENTER: tl.constexpr, CASTING: tl.constexpr,
                               ROUND_BY_HAND: tl.constexpr):
    """The columns ``[start, start + BLOCK_COLS)`` of a tile of rows wider than one block: their
    column and element masks and the gradient terms of :func:`_row_norm_grad_terms`."""
    cols = start + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    w = _row_norm_grad_weight(W, X, cols, col_mask, offset, CASTING, ROUND_BY_HAND)
    dy, xhat, g, xhat_w = _row_norm_grad_terms(
        tl.load(dy_rows + cols[None, :], mask=mask, other=0.0), tl.load(x_rows + cols[None, :], mask=mask, other=0.0),
        X, w, mask, mean, rstd, CENTER, CASTING, ROUND_BY_HAND)
    return cols, col_mask, mask, dy, xhat, g, xhat_w


@triton.jit
def _row_norm_load_tile(DY, X, RSTD, MEAN, rows64, cols, col_mask, n_rows, dy_row_stride, x_row_stride,
                        BLOCK_ROWS: tl.constexpr, CENTER: tl.constexpr):
    """The raw dy and x of a tile of rows (zeros past ``n_rows``) and the rows' rstd and mean
    (zeros without CENTER)."""
    row_mask = rows64 < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    dy_raw = tl.load(DY + rows64[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
    x_raw = tl.load(X + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
    mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    if CENTER:
        mean = tl.load(MEAN + rows64, mask=row_mask, other=0.0)
    return dy_raw, x_raw, rstd, mean


@triton.jit
def _row_norm_dx(g, xhat, proj, g_mean, rstd, DX, CENTER: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """dx = rstd * (g - xhat * mean(g * xhat) [- mean(g)]) in DX's dtype, from the row means
    ``proj`` and ``g_mean`` (the latter read only with CENTER)."""
    dx = g - xhat * proj[:, None]
    if CENTER:
        dx -= g_mean[:, None]
    dx = dx * rstd[:, None]
    if ROUND_BY_HAND:
        dx = round_to_dtype(dx, DX.dtype.element_ty, ROUND_BY_HAND)
    return dx.to(DX.dtype.element_ty)


@triton.jit
def _row_norm_backward_one_block(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, pid, n_programs, n_tiles, partial_row,
    n_rows, n_cols, dy_row_stride, x_row_stride, dx_row_stride, offset,
    CENTER: tl.constexpr, HAS_BIAS: tl.constexpr, CASTING: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr, ROUND_BY_HAND: tl.constexpr, PREFETCH: tl.constexpr, ROW_ACCUMULATOR: tl.constexpr,
):
    """:func:`row_norm_backward_kernel` for rows that fit one column block: each tile is loaded
    once, dx stored, and dW (dB) accumulated in registers over the program's tiles."""
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
        next_dy, next_x, next_rstd, next_mean = _row_norm_load_tile(
            DY, X, RSTD, MEAN, (pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64), cols, col_mask, n_rows,
            dy_row_stride, x_row_stride, BLOCK_ROWS, CENTER)
    for tile in tl.range(pid, n_tiles, n_programs):
        rows64 = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        mask = (rows64 < n_rows)[:, None] & col_mask[None, :]
        if PREFETCH:
            dy_raw, x_raw, rstd, mean = next_dy, next_x, next_rstd, next_mean
            next_dy, next_x, next_rstd, next_mean = _row_norm_load_tile(
                DY, X, RSTD, MEAN, rows64 + n_programs * BLOCK_ROWS, cols, col_mask, n_rows, dy_row_stride,
                x_row_stride, BLOCK_ROWS, CENTER)
        else:
            dy_raw, x_raw, rstd, mean = _row_norm_load_tile(
                DY, X, RSTD, MEAN, rows64, cols, col_mask, n_rows, dy_row_stride, x_row_stride, BLOCK_ROWS, CENTER)
        dy, xhat, g, xhat_w = _row_norm_grad_terms(dy_raw, x_raw, X, w, mask, mean, rstd, CENTER, CASTING,
                                                   ROUND_BY_HAND)
        proj = _div(tl.sum(g * xhat, axis=1), n_cols)
        g_mean = proj  # read only with CENTER
        if CENTER:
            g_mean = _div(tl.sum(g, axis=1), n_cols)
        dx = _row_norm_dx(g, xhat, proj, g_mean, rstd, DX, CENTER, ROUND_BY_HAND)
        tl.store(DX + rows64[:, None] * dx_row_stride + cols[None, :], dx, mask=mask)
        if ROW_ACCUMULATOR:
            dw_acc += dy * xhat_w
            if HAS_BIAS:
                db_acc += dy
        else:
            dw_acc += tl.sum(dy * xhat_w, axis=0)
            if HAS_BIAS:
                db_acc += tl.sum(dy, axis=0)
    dw_total, db_total = dw_acc, db_acc
    if ROW_ACCUMULATOR:
        dw_total, db_total = tl.sum(dw_acc, axis=0), tl.sum(db_acc, axis=0)
    tl.store(DW_PARTIAL + partial_row + cols, dw_total, mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + partial_row + cols, db_total, mask=col_mask)


@triton.jit
def _row_norm_backward_column_blocks(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, pid, n_programs, n_tiles, partial_row,
    n_rows, n_cols, dy_row_stride, x_row_stride, dx_row_stride, offset,
    CENTER: tl.constexpr, HAS_BIAS: tl.constexpr, CASTING: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
):
    """:func:`row_norm_backward_kernel` for rows wider than one column block: per tile, pass 1
    sums ``g * xhat`` (and ``g``) over the column blocks, pass 2 re-reads them for dx and adds the
    tile's dW (dB) to the program's partial row in memory."""
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
            cols, col_mask, mask, dy, xhat, g, xhat_w = _row_norm_grad_column_tile(
                dy_rows, x_rows, W, X, start, n_cols, row_mask, mean, rstd, offset, BLOCK_COLS, CENTER, CASTING,
                ROUND_BY_HAND)
            proj_acc += g * xhat
            if CENTER:
                g_acc += g
        proj = _div(tl.sum(proj_acc, axis=1), n_cols)
        g_mean = _div(tl.sum(g_acc, axis=1), n_cols)
        # Pass 2: dx, and this program's partial dW/dB (its own buffer row, so the
        # read-modify-write needs no atomics; the first tile overwrites garbage).
        first = tile == pid
        for start in range(0, n_cols, BLOCK_COLS):
            cols, col_mask, mask, dy, xhat, g, xhat_w = _row_norm_grad_column_tile(
                dy_rows, x_rows, W, X, start, n_cols, row_mask, mean, rstd, offset, BLOCK_COLS, CENTER, CASTING,
                ROUND_BY_HAND)
            tl.store(dx_rows + cols[None, :], _row_norm_dx(g, xhat, proj, g_mean, rstd, DX, CENTER, ROUND_BY_HAND),
                     mask=mask)
            dw_ptrs = DW_PARTIAL + partial_row + cols
            dw_prev = tl.where(first, 0.0, tl.load(dw_ptrs, mask=col_mask, other=0.0))
            tl.store(dw_ptrs, dw_prev + tl.sum(dy * xhat_w, axis=0), mask=col_mask)
            if HAS_BIAS:
                db_ptrs = DB_PARTIAL + partial_row + cols
                db_prev = tl.where(first, 0.0, tl.load(db_ptrs, mask=col_mask, other=0.0))
                tl.store(db_ptrs, db_prev + tl.sum(dy, axis=0), mask=col_mask)


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
    FUSED: a row fits one column block (:func:`_row_norm_backward_one_block`), else
    :func:`_row_norm_backward_column_blocks`.

    DX may alias DY (in-place backward): every element of DY is read before the same
    program overwrites it, and no other program touches those rows.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_ROWS)
    partial_row = pid.to(tl.int64) * n_cols
    if FUSED:
        _row_norm_backward_one_block(
            DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, pid, n_programs, n_tiles, partial_row,
            n_rows, n_cols, dy_row_stride, x_row_stride, dx_row_stride, offset,
            CENTER, HAS_BIAS, CASTING, BLOCK_ROWS, BLOCK_COLS, ROUND_BY_HAND, PREFETCH, ROW_ACCUMULATOR)
    else:
        _row_norm_backward_column_blocks(
            DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, pid, n_programs, n_tiles, partial_row,
            n_rows, n_cols, dy_row_stride, x_row_stride, dx_row_stride, offset,
            CENTER, HAS_BIAS, CASTING, BLOCK_ROWS, BLOCK_COLS, ROUND_BY_HAND)


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


def sum_partials(partials: torch.Tensor, dtypes: Sequence[torch.dtype],
                 launch: RowNormLaunch | None = None) -> list[torch.Tensor]:
    """Column sums of a norm backward's per-program partials, one new (H,) tensor per slab.

    ``partials`` is (K, P, H) fp32 with K = len(dtypes) in {1, 2} (dW, and dB for
    LayerNorm); slab k is summed over its P rows in fp32 and rounded once to ``dtypes[k]``,
    by one launch for both slabs (torch's ``sum(0).to(dtype)`` would be two per slab).
    ``launch`` gives the tile (default: the configuration's for this shape). The outputs
    never share storage (a custom op's returns must not alias).
    """
    n_slabs, n_partials, n_cols = partials.shape
    if n_slabs != len(dtypes) or n_slabs not in (1, 2):
        raise ValueError(f"partials of shape {tuple(partials.shape)} need 1 or 2 dtypes, got {len(dtypes)}")
    if launch is None:
        launch = row_norm_launch(n_partials, n_cols, partials.device)
    outs = [torch.empty(n_cols, dtype=dtype, device=partials.device) for dtype in dtypes]
    grid = (cdiv(n_cols, launch.partials_sum_block_cols), n_slabs)
    launch_kernel(_sum_partials_kernel, grid, partials, outs[0], outs[-1], n_partials, n_cols,
                  BLOCK_ROWS=launch.partials_sum_block_rows, BLOCK_COLS=launch.partials_sum_block_cols,
                  ROUND_BY_HAND=is_interpreter(), num_warps=4)
    return outs


def row_norm_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      mean: torch.Tensor, rstd: torch.Tensor, offset: float, center: bool, casting: int,
                      in_place: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Host side of a norm's backward: ``(grad_x, grad_weight, grad_bias)``, ``grad_bias`` None
    without ``bias``; ``grad_x`` as :func:`row_norm_grad_buffers` gives it.

    ``mean`` (N,) float32 when ``center`` (LayerNorm), else any (N,) float32 tensor (not read);
    ``rstd`` (N,) float32; ``offset`` and ``casting`` as in :func:`row_norm_backward_kernel`.
    """
    has_bias = bias is not None
    x_rows = as_rows(x)
    n_rows, n_cols = x_rows.shape
    dy_rows, dx_rows, grad_x = row_norm_grad_buffers(grad_output, x, in_place)
    if n_rows == 0 or n_cols == 0:
        return grad_x, torch.zeros_like(weight), torch.zeros_like(bias) if bias is not None else None
    launch = row_norm_launch(n_rows, n_cols, x.device, center=center)
    n_partials = 2 if has_bias else 1
    partials = torch.empty((n_partials, launch.backward_programs, n_cols), dtype=torch.float32, device=x.device)
    launch_kernel(row_norm_backward_kernel, (launch.backward_programs,),
        dy_rows, x_rows, weight.contiguous(), mean, rstd, dx_rows, partials[0], partials[n_partials - 1],
        n_rows, n_cols, dy_rows.stride(0), x_rows.stride(0), dx_rows.stride(0), offset,
        CENTER=center, HAS_BIAS=has_bias, CASTING=casting, **launch.kernel_args(backward=True),
    )
    sums = sum_partials(partials, [weight.dtype] if bias is None else [weight.dtype, bias.dtype], launch)
    return grad_x, sums[0].view(weight.shape), sums[1].view(bias.shape) if bias is not None else None
