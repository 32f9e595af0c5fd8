"""Cross entropy over a large vocabulary, with the gradient computed in the forward pass.

Notation, for one row (token) ``i`` of logits ``x`` of width ``V`` with target ``y``:

* optional Gemma-2 soft-capping: ``s = c * tanh(x / c)`` (``s = x`` without a cap);
* ``lse = log(sum_c exp(s_c))`` and ``p_c = exp(s_c - lse)`` (softmax);
* class weights ``w`` (all ones without), ``W = sum_c w_c``; label smoothing ``eps``.

Per-row loss, exactly torch's ``F.cross_entropy`` (``nll_loss`` plus its label-smoothing
term, class weights applied to both)::

    ce_i = (1 - eps) * w_y * (lse - s_y) + (eps / V) * sum_c w_c * (lse - s_c)
         = (1 - eps) * w_y * (lse - s_y) + (eps / V) * (lse * W - sum_c w_c s_c)
    z_i  = lse_square_scale * lse**2                               (z-loss, PaLM)

Rows whose target is ``ignore_index`` contribute zero loss and zero gradient.
Reductions: ``"sum"`` adds the counted rows, ``"none"`` returns ``ce_i + z_i`` per row, and
``"mean"`` divides the cross entropy by ``D_ce = sum_{i counted} w_{y_i}`` (the number of
counted rows without class weights; torch's weighted mean) and the z-loss by the number
of counted rows ``D_z`` (the z-loss is a per-token regulariser, not class weighted)::

    loss = sum_i ce_i / D_ce + sum_i z_i / D_z

Gradient of row ``i``'s contribution with respect to ``s`` (``d_c = 1`` where ``c = y``)::

    dL/ds_c = p_c * [((1 - eps) w_y + (eps / V) W) / D_ce + 2 * lse_square_scale * lse / D_z]
              - (1 - eps) * w_y * d_c / D_ce - (eps / V) * w_c / D_ce

(``D_ce = D_z = 1`` for ``"sum"`` and ``"none"``), and through the cap
``dL/dx_c = dL/ds_c * (1 - tanh(x_c / c)**2)``.

The kernel makes two passes over each row: pass 1 keeps a running max and rescaled sum
of exponentials (online log-sum-exp), the smoothing sum and the first arg-max, per lane of
:data:`CE_LANE_WIDTH` columns (merged once at the end of the row: for lanes ``l`` with
maxima ``m_l`` and sums ``S_l``, ``lse = M + log(sum_l S_l exp(m_l - M))``, ``M = max_l m_l``);
pass 2 writes the gradient, by default over the logits themselves, and the target's
``- d_c`` term once after the loop. The loss's backward only
multiplies that stored gradient by the upstream gradient (a scalar, or one value per row
for ``"none"``), in place, skipping rows whose factor is exactly 1 (decided on the device,
without a host sync). So the extra memory is O(N), never a second (N, V) buffer.

Differences from ``F.cross_entropy`` (all documented in :class:`LigerCrossEntropyFunction`):
the loss is float32 for every logits dtype; a ``"mean"`` over a batch whose targets are
all ignored is 0 with zero gradients (torch gives NaN); class weights get no gradient.
"""

import functools
import numbers
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from liger_kernel.ops.autograd import once_differentiable
from liger_kernel.ops.checks import check_float_dtype, check_same_device, check_tensor
from liger_kernel.ops.launch import (
    cdiv,
    is_interpreter,
    launch_kernel,
    liger_custom_op,
    multiprocessor_count,
    next_power_of_2,
    num_programs_for_rows,
    row_launch_settings,
)
from liger_kernel.ops.scaling import scale_gradient

# Column block of the row loop (a power of two; tests lower it to exercise the multi-block
# path on small vocabularies). H200, N 8192, V 128256 bf16, in-place forward
# (scripts/ce_config_check.py, 2026-12-03): 32768 (32 warps) 1.82-1.85 ms, 16384 2.06-2.27 ms,
# 8192 2.07-2.14 ms, for either prefetch setting and 2 or 4 programs per SM; with the per-lane
# statistics below (run 5, tune_ce_lanes.csv): 32768 1.30 ms, 16384 1.59-1.61, 8192 1.49-1.83.
CE_MAX_BLOCK = 32768

# Programs per SM of the persistent row loop. Few resident rows per SM keep a row's
# second read (pass 2) in L2: a 128K-vocab bf16 row is 256 KB and H200's L2 is 50 MB.
CE_PROGRAMS_PER_SM = 4

# Load each column block one iteration ahead (register double-buffering) in both passes.
CE_PREFETCH = True

# Pass 1 keeps its running statistics per "lane": each column block is viewed as
# (BLOCK / CE_LANE_WIDTH, CE_LANE_WIDTH) and reduced along the short axis only, which stays
# within a thread (or a few lanes of one warp). One cross-warp reduction per row instead of
# two per block: with one or two programs per SM (so a row's second read hits L2), the
# shared-memory barriers of per-block reductions stalled the whole SM every block. Costs
# one extra exp per CE_LANE_WIDTH elements (rescaling the lane sums). CE_LANE_WIDTH =
# CE_MAX_BLOCK gives the earlier per-block statistics. H200, N 8192, V 128256 bf16, 32768-column
# blocks, 1 or 2 programs per SM (2026-12-03, run 5): lanes of 8 or 32 1.300-1.306 ms, per-block
# 1.42-1.43 ms (1.89 ms before the target's one-hot term moved out of the loop).
CE_LANE_WIDTH = 8

# Row splitting (see _cross_entropy_kernel): with one program per row, the row must be read
# twice (statistics, then gradient), and at 256 KB per 128K-vocab bf16 row the second read
# misses L2 (hundreds of rows in flight exceed its 50 MB). Rows of at least
# CE_SPLIT_MIN_ROW_BYTES are instead shared by cdiv(V, CE_SPLIT_BLOCK) programs that each
# keep their block in registers and exchange per-block statistics: one read of the row.
# Off by default: measured slower on the H200 (2026-12-03, N 8192, V 128256 bf16, CUDA-graph
# timing): best split setting 2.19 ms (32768-column parts) against 1.87-1.89 ms for the
# two-pass kernel (1.30 ms since its per-lane statistics, run 5). Each group of programs
# waits for its slowest part once per row, and with one row per group in flight that
# latency is not hidden. Tested on the GPU either way.
CE_SPLIT_ROWS = False
CE_SPLIT_MIN_ROW_BYTES = 128 * 1024
CE_SPLIT_BLOCK = 16384
# At CE_SPLIT_BLOCK = 16384 (16 warps) ptxas (sm_90) gives the plain-loss kernel 128 registers
# and no spills; at 32768 (32 warps) it spills 216 bytes per thread.
# Programs per SM for the split kernel (at most: the launcher lowers it to what the compiled
# kernel's registers and shared memory allow, since a cooperative launch needs the whole grid
# resident; one always fits, and is used for a configuration's first launch).
CE_SPLIT_PROGRAMS_PER_SM = 1
# Warps of each split program (0: from the block width, as everywhere else).
CE_SPLIT_NUM_WARPS = 0

REDUCTIONS = ("mean", "sum", "none")


class CrossEntropyOutput(NamedTuple):
    """What the cross-entropy losses return when ``return_z_loss`` or ``return_token_accuracy`` is set.

    ``loss`` is differentiable and already includes the z-loss. ``z_loss`` (the z-loss part
    of ``loss``, reduced like it) and ``token_accuracy`` are detached diagnostics, ``None``
    unless requested. ``token_accuracy`` is the fraction of counted (non-ignored) tokens
    whose arg-max logit (first index on ties, like ``torch.argmax``) equals the target, for
    ``"mean"`` and ``"sum"``; for ``"none"`` it is 1.0/0.0 per row (0 for ignored rows).
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None


@triton.jit
def _tanh_and_sech2(x):
    """``(tanh(x), 1 - tanh(x)**2)`` to float32 accuracy, with plain ``tl`` ops only.

    From ``e = exp(-2|x|)`` (never overflows; -inf gives e = 0): ``tanh = (1 - e) / (1 + e)``
    and ``sech**2 = 4e / (1 + e)**2``, the latter free of the cancellation in ``1 - t*t``
    where the cap saturates. Below |x| = 1/4, where ``1 - e`` would cancel, the Taylor
    series to x**9 (truncation < 1e-8 relative) gives tanh instead.
    """
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    one_plus_e = 1.0 + e
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.25, series, (1.0 - e) / one_plus_e)
    t = tl.where(x < 0.0, -t, t)
    return t, 4.0 * e / (one_plus_e * one_plus_e)


@triton.jit
def _block_statistics(x, cols, mask, start, safe_target, class_weight_ptr, softcap,
                      BLOCK_SIZE: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, HAS_LABEL_SMOOTHING: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, COMPUTE_ACCURACY: tl.constexpr):
    """Pass-1 statistics of one column block of raw fp32 logits ``x`` (-inf where masked).

    Returns ``(block_max, sum_exp, target_logit, smooth_sum, weight_sum, best_raw, best_index)``:
    the max of the (capped) logits s, ``sum exp(s - shift)`` with ``shift`` the max (0 while
    it is -inf), s at the target if it lies in this block (else 0), ``sum w_c s_c`` and
    ``sum w_c`` (label smoothing), and the first arg-max of the raw logits.
    """
    best_raw = float("-inf")
    best_index = 0
    if COMPUTE_ACCURACY:
        best_raw = tl.max(x, axis=0)
        best_index = tl.min(tl.where(x == best_raw, cols, 2147483647), axis=0)
    if HAS_SOFTCAP:
        capped, _ = _tanh_and_sech2(x / softcap)
        x = tl.where(mask, softcap * capped, float("-inf"))
    # Only the block that holds the target pays for the one-hot selection.
    target_logit = 0.0
    if (safe_target >= start) & (safe_target < start + BLOCK_SIZE):
        target_logit = tl.sum(tl.where(cols == safe_target, x, 0.0), axis=0)
    block_max = tl.max(x, axis=0)
    # exp(-inf - -inf) is NaN: shift an all -inf block by 0 instead.
    shift = tl.where(block_max == float("-inf"), 0.0, block_max)
    sum_exp = tl.sum(tl.exp(x - shift), axis=0)
    smooth_sum = 0.0
    weight_sum = 0.0
    if HAS_LABEL_SMOOTHING:
        if HAS_CLASS_WEIGHT:
            w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            smooth_sum = tl.sum(w * tl.where(mask, x, 0.0), axis=0)
            weight_sum = tl.sum(w, axis=0)
        else:
            smooth_sum = tl.sum(tl.where(mask, x, 0.0), axis=0)
    return block_max, sum_exp, target_logit, smooth_sum, weight_sum, best_raw, best_index


@triton.jit
def _lane_update(x, cols, mask, lane_max, lane_sum, lane_smooth, lane_weight, lane_best, lane_best_index,
                 class_weight_ptr, softcap, HAS_CLASS_WEIGHT: tl.constexpr, HAS_LABEL_SMOOTHING: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, COMPUTE_ACCURACY: tl.constexpr):
    """Fold one (lanes, width) column block of raw fp32 logits ``x`` (-inf where masked)
    into the per-lane pass-1 statistics; every reduction runs along axis 1 only.

    Per lane: running max of the (capped) logits and ``sum exp(s - shift)`` relative to it
    (shift 0 while the max is -inf), ``sum w_c s_c`` and ``sum w_c`` (label smoothing), and
    the first arg-max of the raw logits (columns arrive in increasing order per lane, so a
    strictly greater block maximum is the only one that replaces it).
    """
    if COMPUTE_ACCURACY:
        b_best = tl.max(x, axis=1)
        b_index = tl.min(tl.where(x == b_best[:, None], cols, 2147483647), axis=1)
        better = b_best > lane_best
        lane_best_index = tl.where(better, b_index, lane_best_index)
        lane_best = tl.where(better, b_best, lane_best)
    if HAS_SOFTCAP:
        capped, _ = _tanh_and_sech2(x / softcap)
        x = tl.where(mask, softcap * capped, float("-inf"))
    new_max = tl.maximum(lane_max, tl.max(x, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
    if HAS_LABEL_SMOOTHING:
        if HAS_CLASS_WEIGHT:
            w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            lane_smooth += tl.sum(w * tl.where(mask, x, 0.0), axis=1)
            lane_weight += tl.sum(w, axis=1)
        else:
            lane_smooth += tl.sum(tl.where(mask, x, 0.0), axis=1)
    return new_max, lane_sum, lane_smooth, lane_weight, lane_best, lane_best_index


@triton.jit
def _rescaled_sum(part_max, part_sum, new_max):
    """``part_sum`` (relative to ``part_max``) relative to ``new_max >= part_max``; an all -inf
    part adds 0 (not 0 * exp(0 - new_max), which overflows for a very negative new_max)."""
    scaled = part_sum * tl.exp(part_max - tl.where(new_max == float("-inf"), 0.0, new_max))
    return tl.where(part_max == float("-inf"), 0.0, scaled)


@triton.jit
def _row_loss(lse, target_logit, smooth_sum, weight_total, target_weight, n_cols, label_smoothing,
              lse_square_scale, ce_scale, z_scale, HAS_CLASS_WEIGHT: tl.constexpr,
              HAS_LABEL_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
    """``(ce_i, z_i)`` of one row, already divided by the mean's denominators (see module docstring)."""
    if HAS_LABEL_SMOOTHING:
        if not HAS_CLASS_WEIGHT:
            weight_total = n_cols * 1.0
        ce_loss = (1.0 - label_smoothing) * target_weight * (lse - target_logit)
        ce_loss += (label_smoothing / n_cols) * (lse * weight_total - smooth_sum)
    else:
        ce_loss = target_weight * (lse - target_logit)
    z_loss = 0.0
    if HAS_Z_LOSS:
        z_loss = lse_square_scale * lse * lse * z_scale
    return ce_loss * ce_scale, z_loss


@triton.jit
def _gradient_coefficients(lse, target_weight, weight_total, n_cols, label_smoothing, lse_square_scale,
                           ce_scale, z_scale, row_scale, HAS_CLASS_WEIGHT: tl.constexpr,
                           HAS_LABEL_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
    """``(prob_coef, onehot_coef, uniform_coef)`` with dL/ds_c = prob_coef p_c - onehot_coef d_c - uniform_coef w_c."""
    if HAS_LABEL_SMOOTHING:
        if not HAS_CLASS_WEIGHT:
            weight_total = n_cols * 1.0
        smoothing_per_class = label_smoothing / n_cols
        onehot_coef = (1.0 - label_smoothing) * target_weight * ce_scale * row_scale
        prob_coef = onehot_coef + smoothing_per_class * weight_total * ce_scale * row_scale
        uniform_coef = smoothing_per_class * ce_scale * row_scale
    else:
        onehot_coef = target_weight * ce_scale * row_scale
        prob_coef = onehot_coef
        uniform_coef = 0.0
    if HAS_Z_LOSS:
        prob_coef += 2.0 * lse_square_scale * lse * z_scale * row_scale
    return prob_coef, onehot_coef, uniform_coef


@triton.jit
def _block_gradient(x, cols, mask, target, lse, prob_coef, onehot_coef, uniform_coef, class_weight_ptr, softcap,
                    HAS_CLASS_WEIGHT: tl.constexpr, HAS_LABEL_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    WITH_ONEHOT: tl.constexpr = True):
    """dL/dx for one column block of raw fp32 logits ``x`` (or one logit, with scalar ``x``
    and ``cols``). Without ``WITH_ONEHOT`` the target's ``- onehot_coef`` term is left out
    (the caller stores the target's gradient separately)."""
    if HAS_SOFTCAP:
        capped, cap_slope = _tanh_and_sech2(x / softcap)
        x = softcap * capped
    grad = prob_coef * tl.exp(x - lse)
    if HAS_LABEL_SMOOTHING:
        if HAS_CLASS_WEIGHT:
            grad -= uniform_coef * tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            grad -= uniform_coef
    if WITH_ONEHOT:
        grad = tl.where(cols == target, grad - onehot_coef, grad)
    if HAS_SOFTCAP:
        grad = grad * cap_slope
    return grad


# Per (row, part) statistics exchanged between the programs that share a row (ROW_SPLIT > 1).
_STATS = tl.constexpr(8)


@triton.jit
def _cross_entropy_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_row_stride,
    target_ptr,
    target_stride,
    class_weight_ptr,
    row_scale_ptr,
    loss_ptr,
    z_loss_ptr,
    correct_ptr,
    ce_denominator_ptr,
    z_denominator_ptr,
    stats_ptr,
    arrivals_ptr,
    n_rows,
    n_cols,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_LABEL_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    MEAN_REDUCTION: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    COMPUTE_ACCURACY: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PREFETCH: tl.constexpr,
    LANE_WIDTH: tl.constexpr,
    ROW_SPLIT: tl.constexpr,
    SPLIT_POW2: tl.constexpr,
):
    """Per row: loss, z-loss, correctness and (optionally) dL/dx.

    ``ROW_SPLIT == 1``: persistent programs, one row at a time, two passes over the row
    (column-block loop). ``ROW_SPLIT > 1``: ``ROW_SPLIT`` programs share each row, one
    ``BLOCK_SIZE`` block each, held in registers: each publishes its block's statistics to
    ``stats_ptr``, counts itself in at ``arrivals_ptr[group]`` and waits until the whole
    group has, then reads all parts' statistics and writes its block's gradient. The row
    is read from memory once. Needs every program of the grid resident at once (the
    launcher uses a cooperative launch), so it never runs under the interpreter.
    """
    offsets = tl.arange(0, BLOCK_SIZE)
    if MEAN_REDUCTION:
        ce_scale = 1.0 / tl.load(ce_denominator_ptr).to(tl.float32)
        z_scale = 1.0 / tl.load(z_denominator_ptr).to(tl.float32)
    else:
        ce_scale = 1.0
        z_scale = 1.0
    if ROW_SPLIT == 1:
        first_row = tl.program_id(0).to(tl.int64)
        row_step = tl.num_programs(0)
        part = 0
    else:
        first_row = (tl.program_id(0) // ROW_SPLIT).to(tl.int64)
        row_step = tl.num_programs(0) // ROW_SPLIT
        part = tl.program_id(0) % ROW_SPLIT
    group = first_row
    part_cols = part * BLOCK_SIZE + offsets
    part_mask = part_cols < n_cols
    n_syncs = 0
    if ROW_SPLIT > 1:
        # This part of the next row is loaded before the current row's exchange, so the
        # wait for the other parts overlaps the next load.
        x_next = tl.load(logits_ptr + first_row * logits_row_stride + part_cols,
                         mask=part_mask & (first_row < n_rows), other=float("-inf"))

    # int64 row index: row * stride passes 2**31 for large N * V.
    for row in tl.range(first_row, n_rows, row_step):
        logits_row = logits_ptr + row * logits_row_stride
        grad_row = grad_ptr + row * grad_row_stride
        target = tl.load(target_ptr + row * target_stride)
        if ROW_SPLIT > 1:
            x_part = x_next
            following = row + row_step
            x_next = tl.load(logits_ptr + following * logits_row_stride + part_cols,
                             mask=part_mask & (following < n_rows), other=float("-inf"))
        if target == ignore_index:
            # Every part of a row sees the same target, so all of them skip the exchange.
            if COMPUTE_GRAD:
                zeros = tl.zeros([BLOCK_SIZE], dtype=tl.float32).to(grad_ptr.dtype.element_ty)
                if ROW_SPLIT == 1:
                    for start in range(0, n_cols, BLOCK_SIZE):
                        cols = start + offsets
                        tl.store(grad_row + cols, zeros, mask=cols < n_cols)
                else:
                    tl.store(grad_row + part_cols, zeros, mask=part_mask)
            if part == 0:
                tl.store(loss_ptr + row, 0.0)
                tl.store(z_loss_ptr + row, 0.0)
                tl.store(correct_ptr + row, 0.0)
        else:
            # A target outside [0, V) is never used as an address: loads go through a clamped
            # index and the one-hot comparison simply never matches. Its loss is NaN so the
            # bad label is visible even where the host-side check is skipped (torch.compile).
            target_valid = (target >= 0) & (target < n_cols)
            safe_target = tl.where(target_valid, target, 0)
            if ROW_SPLIT == 1:
                # The target's raw logit, read before pass 2 can overwrite the row in place
                # (only this program writes this row, and not before pass 2).
                target_raw = tl.load(logits_row + safe_target).to(tl.float32)
                if HAS_SOFTCAP:
                    capped_target, _ = _tanh_and_sech2(target_raw / softcap)
                    target_logit = softcap * capped_target
                else:
                    target_logit = target_raw
                # Pass 1: online log-sum-exp, smoothing sums and first arg-max, per lane.
                lane_offsets = (tl.arange(0, BLOCK_SIZE // LANE_WIDTH)[:, None] * LANE_WIDTH
                                + tl.arange(0, LANE_WIDTH)[None, :])
                lane_max = tl.full([BLOCK_SIZE // LANE_WIDTH], float("-inf"), tl.float32)
                lane_sum = tl.zeros([BLOCK_SIZE // LANE_WIDTH], tl.float32)
                lane_smooth = tl.zeros([BLOCK_SIZE // LANE_WIDTH], tl.float32)
                lane_weight = tl.zeros([BLOCK_SIZE // LANE_WIDTH], tl.float32)
                lane_best = tl.full([BLOCK_SIZE // LANE_WIDTH], float("-inf"), tl.float32)
                lane_best_index = tl.zeros([BLOCK_SIZE // LANE_WIDTH], tl.int32)
                if PREFETCH:
                    x_next = tl.load(logits_row + lane_offsets, mask=lane_offsets < n_cols, other=float("-inf"))
                for start in range(0, n_cols, BLOCK_SIZE):
                    cols = start + lane_offsets
                    mask = cols < n_cols
                    if PREFETCH:
                        # The next block's load is issued before this block's reductions.
                        x = x_next.to(tl.float32)
                        ahead = cols + BLOCK_SIZE
                        x_next = tl.load(logits_row + ahead, mask=ahead < n_cols, other=float("-inf"))
                    else:
                        x = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
                    lane_max, lane_sum, lane_smooth, lane_weight, lane_best, lane_best_index = _lane_update(
                        x, cols, mask, lane_max, lane_sum, lane_smooth, lane_weight, lane_best, lane_best_index,
                        class_weight_ptr, softcap, HAS_CLASS_WEIGHT, HAS_LABEL_SMOOTHING, HAS_SOFTCAP,
                        COMPUTE_ACCURACY)
                running_max = tl.max(lane_max, axis=0)
                sum_exp = tl.sum(_rescaled_sum(lane_max, lane_sum, running_max), axis=0)
                smooth_sum = tl.sum(lane_smooth, axis=0)
                weight_total = tl.sum(lane_weight, axis=0)
                best_index = 0
                if COMPUTE_ACCURACY:
                    best_raw = tl.max(lane_best, axis=0)
                    best_index = tl.min(tl.where(lane_best == best_raw, lane_best_index, 2147483647), axis=0)
            else:
                # x_part stays in the logits dtype across the exchange (half the registers of fp32).
                p_max, p_sum, p_target, p_smooth, p_weight, p_best_raw, p_best_index = _block_statistics(
                    x_part.to(tl.float32), part_cols, part_mask, part * BLOCK_SIZE, safe_target, class_weight_ptr, softcap,
                    BLOCK_SIZE, HAS_CLASS_WEIGHT, HAS_LABEL_SMOOTHING, HAS_SOFTCAP, COMPUTE_ACCURACY)
                # Two slots per group, alternating: a part can only reuse a slot after the
                # whole group has passed the exchange in between, i.e. has read the slot.
                slot = stats_ptr + ((group * 2 + n_syncs % 2) * SPLIT_POW2).to(tl.int64) * _STATS
                mine = slot + part * _STATS
                tl.store(mine + 0, p_max)
                tl.store(mine + 1, p_sum)
                tl.store(mine + 2, p_target)
                tl.store(mine + 3, p_smooth)
                tl.store(mine + 4, p_weight)
                tl.store(mine + 5, p_best_raw)
                tl.store(mine + 6, p_best_index.to(tl.float32))
                # Barrier: every thread's stores precede the release below.
                tl.debug_barrier()
                n_syncs += 1
                goal = n_syncs * ROW_SPLIT
                arrived = tl.atomic_add(arrivals_ptr + group, 1, sem="acq_rel") + 1
                while arrived < goal:
                    arrived = tl.atomic_add(arrivals_ptr + group, 0, sem="acquire")
                tl.debug_barrier()
                parts = tl.arange(0, SPLIT_POW2)
                in_row = parts < ROW_SPLIT
                theirs = slot + parts * _STATS
                maxes = tl.load(theirs + 0, mask=in_row, other=float("-inf"), volatile=True)
                sums = tl.load(theirs + 1, mask=in_row, other=0.0, volatile=True)
                running_max = tl.max(maxes, axis=0)
                sum_exp = tl.sum(_rescaled_sum(maxes, sums, running_max), axis=0)
                target_logit = tl.sum(tl.load(theirs + 2, mask=in_row, other=0.0, volatile=True), axis=0)
                smooth_sum = tl.sum(tl.load(theirs + 3, mask=in_row, other=0.0, volatile=True), axis=0)
                weight_total = tl.sum(tl.load(theirs + 4, mask=in_row, other=0.0, volatile=True), axis=0)
                best_index = 0
                if COMPUTE_ACCURACY:
                    best_raws = tl.load(theirs + 5, mask=in_row, other=float("-inf"), volatile=True)
                    best_indices = tl.load(theirs + 6, mask=in_row, other=0.0, volatile=True).to(tl.int32)
                    best_raw = tl.max(best_raws, axis=0)
                    best_index = tl.min(tl.where(best_raws == best_raw, best_indices, 2147483647), axis=0)
            shift = tl.where(running_max == float("-inf"), 0.0, running_max)
            lse = shift + tl.log(sum_exp)

            if HAS_CLASS_WEIGHT:
                target_weight = tl.load(class_weight_ptr + safe_target, mask=target_valid, other=0.0)
                target_weight = target_weight.to(tl.float32)
            else:
                target_weight = 1.0
            ce_loss, z_loss = _row_loss(lse, target_logit, smooth_sum, weight_total, target_weight, n_cols,
                                        label_smoothing, lse_square_scale, ce_scale, z_scale, HAS_CLASS_WEIGHT,
                                        HAS_LABEL_SMOOTHING, HAS_Z_LOSS)
            if part == 0:
                tl.store(loss_ptr + row, tl.where(target_valid, ce_loss + z_loss, float("nan")))
                tl.store(z_loss_ptr + row, z_loss)
                if COMPUTE_ACCURACY:
                    tl.store(correct_ptr + row, tl.where(best_index == target, 1.0, 0.0))
                else:
                    tl.store(correct_ptr + row, 0.0)

            if COMPUTE_GRAD:
                row_scale = 1.0
                if HAS_ROW_SCALE:
                    row_scale = tl.load(row_scale_ptr + row).to(tl.float32)
                prob_coef, onehot_coef, uniform_coef = _gradient_coefficients(
                    lse, target_weight, weight_total, n_cols, label_smoothing, lse_square_scale, ce_scale, z_scale,
                    row_scale, HAS_CLASS_WEIGHT, HAS_LABEL_SMOOTHING, HAS_Z_LOSS)
                if ROW_SPLIT == 1:
                    # Pass 2, last block first: the blocks pass 1 read most recently are the
                    # likeliest still to be in L2.
                    n_blocks = tl.cdiv(n_cols, BLOCK_SIZE)
                    if PREFETCH:
                        last = (n_blocks - 1) * BLOCK_SIZE + offsets
                        x_next = tl.load(logits_row + last, mask=last < n_cols, other=float("-inf"))
                    for block_index in range(0, n_blocks):
                        cols = (n_blocks - 1 - block_index) * BLOCK_SIZE + offsets
                        mask = cols < n_cols
                        if PREFETCH:
                            x = x_next.to(tl.float32)
                            behind = cols - BLOCK_SIZE
                            x_next = tl.load(logits_row + behind, mask=(behind >= 0) & (behind < n_cols),
                                             other=float("-inf"))
                        else:
                            x = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
                        grad = _block_gradient(x, cols, mask, target, lse, prob_coef, onehot_coef, uniform_coef,
                                               class_weight_ptr, softcap, HAS_CLASS_WEIGHT, HAS_LABEL_SMOOTHING,
                                               HAS_SOFTCAP, WITH_ONEHOT=False)
                        tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)
                    if target_valid:
                        # The loop left out the one-hot term (a compare and select per element);
                        # the target's gradient is rewritten once, after every thread's stores
                        # above (the barrier orders them before this one).
                        tl.debug_barrier()
                        target_grad = _block_gradient(target_raw, safe_target, target_valid, target, lse, prob_coef,
                                                      onehot_coef, uniform_coef, class_weight_ptr, softcap,
                                                      HAS_CLASS_WEIGHT, HAS_LABEL_SMOOTHING, HAS_SOFTCAP)
                        tl.store(grad_row + safe_target, target_grad.to(grad_ptr.dtype.element_ty))
                else:
                    grad = _block_gradient(x_part.to(tl.float32), part_cols, part_mask, target, lse, prob_coef, onehot_coef,
                                           uniform_coef, class_weight_ptr, softcap, HAS_CLASS_WEIGHT,
                                           HAS_LABEL_SMOOTHING, HAS_SOFTCAP)
                    tl.store(grad_row + part_cols, grad.to(grad_ptr.dtype.element_ty), mask=part_mask)


def launch_cross_entropy_kernel(
    logits: torch.Tensor,
    grad: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    loss_rows: torch.Tensor,
    z_rows: torch.Tensor,
    correct_rows: torch.Tensor,
    ce_denominator: torch.Tensor,
    z_denominator: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    mean_reduction: bool,
    compute_grad: bool,
    compute_accuracy: bool,
) -> None:
    """Run the row kernel on ``logits`` (N, V) (unit column stride). Internal: no checks.

    Writes float32 per-row ``loss_rows``, ``z_rows``, ``correct_rows`` (N,) and, if
    ``compute_grad``, dL/dlogits into ``grad`` (which may be ``logits`` itself), each row
    multiplied by ``row_scale[i]`` when given. ``ce_denominator``/``z_denominator`` are
    one-element device tensors read only for the mean. ``softcap <= 0`` means no cap.
    Also used chunk by chunk by the fused linear cross entropy.
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    device = logits.device
    split = row_split(n_cols, logits.element_size(), device)
    if split > 1:
        block, num_warps = row_launch_settings(cdiv(n_cols, split), CE_SPLIT_BLOCK)
        num_warps = CE_SPLIT_NUM_WARPS or num_warps
        flags = (class_weight is not None, label_smoothing > 0, lse_square_scale != 0, softcap > 0,
                 row_scale is not None, mean_reduction, compute_grad, compute_accuracy, logits.dtype, grad.dtype)
        occupancy_key = (flags, block, split, num_warps, CE_PREFETCH, device.index)
        # Until this configuration has been compiled once, one program per SM (always resident).
        per_sm = min(CE_SPLIT_PROGRAMS_PER_SM, _split_programs_per_sm.get(occupancy_key, 1))
        groups = max(1, min(n_rows, multiprocessor_count(device) * per_sm // split))
        grid = (groups * split,)
        split_pow2 = next_power_of_2(split)
        stats = torch.empty(groups * 2 * split_pow2 * _STATS, dtype=torch.float32, device=device)
        arrivals = torch.zeros(groups, dtype=torch.int32, device=device)
        extra = {"launch_cooperative_grid": True}
    else:
        block, num_warps = row_launch_settings(n_cols, CE_MAX_BLOCK)
        grid = (num_programs_for_rows(n_rows, device, CE_PROGRAMS_PER_SM),)
        split_pow2 = 1
        stats = arrivals = loss_rows  # unused
        extra = {}
    compiled = launch_kernel(_cross_entropy_kernel, grid,
        logits,
        logits.stride(0),
        grad if compute_grad else logits,
        grad.stride(0) if compute_grad else 0,
        target,
        target.stride(0),
        class_weight if class_weight is not None else loss_rows,
        row_scale if row_scale is not None else loss_rows,
        loss_rows,
        z_rows,
        correct_rows,
        ce_denominator,
        z_denominator,
        stats,
        arrivals,
        n_rows,
        n_cols,
        ignore_index,
        float(label_smoothing),
        float(lse_square_scale),
        float(softcap),
        HAS_CLASS_WEIGHT=class_weight is not None,
        HAS_LABEL_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=lse_square_scale != 0,
        HAS_SOFTCAP=softcap > 0,
        HAS_ROW_SCALE=row_scale is not None,
        MEAN_REDUCTION=mean_reduction,
        COMPUTE_GRAD=compute_grad,
        COMPUTE_ACCURACY=compute_accuracy,
        BLOCK_SIZE=block,
        PREFETCH=CE_PREFETCH,
        LANE_WIDTH=min(CE_LANE_WIDTH, block),
        ROW_SPLIT=split,
        SPLIT_POW2=split_pow2,
        num_warps=num_warps,
        **extra,
    )
    if split > 1 and occupancy_key not in _split_programs_per_sm:
        _split_programs_per_sm[occupancy_key] = resident_programs_per_sm(compiled, num_warps, device)


# Programs per SM the split kernel's cooperative grid may use, per launch configuration,
# learnt from the compiled kernel's registers and shared memory on its first launch.
_split_programs_per_sm: dict = {}


def resident_programs_per_sm(compiled, num_warps: int, device: torch.device) -> int:
    """How many programs of ``compiled`` one SM holds at once (at least 1).

    Registers are allocated per warp in units of 256 (8 per thread); an SM has 64K
    registers, 2048 threads and the device's shared memory per SM.
    """
    n_regs = getattr(compiled, "n_regs", None)
    if not n_regs:
        return 1
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * num_warps)
    by_threads = 2048 // (32 * num_warps)
    shared = getattr(getattr(compiled, "metadata", None), "shared", 0) or 0
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or 0
    by_shared = smem // shared if shared and smem else 32
    return max(1, min(by_regs, by_threads, by_shared, 32))


@functools.cache
def cooperative_launch_supported() -> bool:
    """Whether this Triton can launch a grid cooperatively (all programs resident, or an error)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


def row_split(n_cols: int, element_size: int, device: torch.device) -> int:
    """How many programs share one row of ``n_cols`` logits (1: one program per row).

    Rows of at least :data:`CE_SPLIT_MIN_ROW_BYTES` are split into blocks of at most
    :data:`CE_SPLIT_BLOCK` columns, one per program, when the device can run the exchange
    (a CUDA device, not the interpreter, Triton with cooperative launches) and the whole
    group fits the grid.
    """
    if not CE_SPLIT_ROWS or device.type != "cuda" or is_interpreter() or not cooperative_launch_supported():
        return 1
    if n_cols * element_size < CE_SPLIT_MIN_ROW_BYTES:
        return 1
    split = cdiv(n_cols, CE_SPLIT_BLOCK)
    block = next_power_of_2(cdiv(n_cols, split))
    split = cdiv(n_cols, block)
    if split > multiprocessor_count(device) * CE_SPLIT_PROGRAMS_PER_SM:
        return 1
    return split


def mean_denominators(
    target: torch.Tensor, class_weight: torch.Tensor | None, ignore_index: int, n_cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device scalars ``(D_ce, D_z, n_counted)`` for the mean, computed without a host sync.

    ``D_ce`` is the sum of the class weights of the counted targets (their count without
    weights), ``D_z`` the count. Both are set to 1 when nothing is counted, so an all-ignored
    batch gives loss 0 rather than 0/0.
    """
    counted = target != ignore_index
    n_counted = counted.sum(dtype=torch.float32)
    nothing_counted = n_counted == 0
    z_denominator = torch.where(nothing_counted, 1.0, n_counted)
    if class_weight is None:
        ce_denominator = z_denominator
    else:
        # Clamping keeps the gather in bounds for bad targets; those rows are masked out
        # here, and the host check (or the kernel's NaN) reports them.
        safe_target = target.clamp(0, n_cols - 1).long()
        target_weights = class_weight.float().gather(0, safe_target) * counted
        ce_denominator = torch.where(nothing_counted, 1.0, target_weights.sum())
    return ce_denominator.reshape(1), z_denominator.reshape(1), n_counted


def _writes_in_place(logits: torch.Tensor, in_place: bool) -> bool:
    # The gradient may only overwrite logits whose rows are disjoint and unit-stride;
    # otherwise (an expanded or transposed view) it goes to a fresh buffer.
    n_rows, n_cols = logits.shape
    return in_place and logits.stride(1) == 1 and (n_rows <= 1 or logits.stride(0) >= n_cols)


def _reduce(rows: torch.Tensor, reduction: str, n_counted: torch.Tensor | None = None) -> torch.Tensor:
    if reduction == "none":
        return rows
    total = rows.sum()
    if n_counted is not None:
        total = total / n_counted.clamp_min(1.0)
    return total


@liger_custom_op("cross_entropy_forward", mutates_args=("logits",))
def cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    compute_grad: bool,
    compute_accuracy: bool,
    in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher: loss, z-loss, token accuracy (reduced per ``reduction``) and dL/dlogits.

    ``logits`` (N, V) with unit column stride, ``target`` (N,) integer. When
    ``compute_grad`` and ``in_place`` (and the rows of ``logits`` are disjoint), the
    gradient overwrites ``logits`` and the returned gradient is an empty placeholder;
    otherwise it is a fresh (N, V) tensor of the logits dtype (empty without
    ``compute_grad``). ``softcap <= 0`` disables the cap. Arguments are trusted (checked
    by the autograd Function).
    """
    n_rows, n_cols = logits.shape
    device = logits.device
    loss_rows = torch.empty(n_rows, device=device, dtype=torch.float32)
    z_rows = torch.empty_like(loss_rows)
    correct_rows = torch.empty_like(loss_rows)
    ce_denominator, z_denominator, n_counted = mean_denominators(target, class_weight, ignore_index, n_cols)
    write_in_place = compute_grad and _writes_in_place(logits, in_place)
    if compute_grad and not write_in_place:
        grad = torch.empty((n_rows, n_cols), device=device, dtype=logits.dtype)
    else:
        grad = logits.new_empty((0,))
    launch_cross_entropy_kernel(
        logits,
        logits if write_in_place else grad,
        target,
        class_weight,
        None,
        loss_rows,
        z_rows,
        correct_rows,
        ce_denominator,
        z_denominator,
        ignore_index,
        label_smoothing,
        lse_square_scale,
        softcap,
        reduction == "mean",
        compute_grad,
        compute_accuracy,
    )
    if write_in_place:
        # Triton writes behind autograd's back; bumping the version makes any other op that
        # saved these logits for its backward fail loudly instead of using the gradient.
        torch.autograd.graph.increment_version(logits)
    return (
        _reduce(loss_rows, reduction),
        _reduce(z_rows, reduction),
        _reduce(correct_rows, reduction, n_counted),
        grad,
    )


@cross_entropy_forward.register_fake
def _cross_entropy_forward_fake(
    logits,
    target,
    class_weight,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    reduction,
    compute_grad,
    compute_accuracy,
    in_place,
):
    n_rows, n_cols = logits.shape
    reduced_shape = (n_rows,) if reduction == "none" else ()
    reduced = [logits.new_empty(reduced_shape, dtype=torch.float32) for _ in range(3)]
    if compute_grad and not _writes_in_place(logits, in_place):
        grad = logits.new_empty((n_rows, n_cols))
    else:
        grad = logits.new_empty((0,))
    return (*reduced, grad)


def check_target(
    target: torch.Tensor, n_rows: int, n_cols: int, ignore_index: int, name: str = "target"
) -> None:
    """Shape/dtype checks for class-index targets, plus the value range (one host sync).

    The value check is skipped while ``torch.compile`` traces or a CUDA graph is being
    captured, where a host sync would break the graph; the kernel never addresses memory
    with a bad target anyway and gives it a NaN loss.
    """
    start_target_check(target, n_rows, n_cols, ignore_index, name).wait()


class PendingTargetCheck:
    """The value-range check of a target, started on the device; :meth:`wait` raises.

    Waiting right after starting is a host sync that drains the GPU's queue, so the GPU
    idles while the host launches the next kernels. A caller that launches its kernels
    first (they never address memory with a bad target) and waits afterwards keeps the GPU
    busy: by then the check's result is usually long computed.
    """

    __slots__ = ("_bad", "_flag", "_event", "_target", "_n_cols", "_ignore_index", "_name")

    def __init__(self, target: torch.Tensor | None, n_cols: int = 0, ignore_index: int = -100,
                 name: str = "target") -> None:
        self._target, self._n_cols, self._ignore_index, self._name = target, n_cols, ignore_index, name
        self._bad = self._flag = self._event = None
        if target is None:
            return
        self._bad = ((target != ignore_index) & ((target < 0) | (target >= n_cols))).any()
        if target.is_cuda:
            # Copy the verdict into pinned host memory behind the work queued so far.
            self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._flag.copy_(self._bad, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """Block until the check has run; raise ``ValueError`` naming a bad class index."""
        if self._bad is None:
            return
        if self._event is not None:
            self._event.synchronize()
            bad = bool(self._flag)
        else:
            bad = bool(self._bad)
        if bad:
            target = self._target
            outside = (target != self._ignore_index) & ((target < 0) | (target >= self._n_cols))
            first = int(target[outside][0])
            raise ValueError(
                f"{self._name} contains class index {first} outside [0, {self._n_cols}) that is not "
                f"ignore_index={self._ignore_index}"
            )


def start_target_check(
    target: torch.Tensor, n_rows: int, n_cols: int, ignore_index: int, name: str = "target"
) -> PendingTargetCheck:
    """Shape/dtype checks for class-index targets (raised at once) and the value-range check,
    started on the device and returned unfinished: call ``.wait()`` to raise on a bad value.

    Skipped (a check that passes) while ``torch.compile`` traces or a CUDA graph is being
    captured, where a host sync would break the graph.
    """
    check_tensor(target, name)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold class indices as int64 (or int32), got dtype {target.dtype}")
    if target.dim() != 1:
        raise ValueError(f"{name} must be 1-D (N,), got shape {tuple(target.shape)}")
    if target.shape[0] != n_rows:
        raise ValueError(f"{name} has {target.shape[0]} entries but the input has {n_rows} rows")
    if torch.compiler.is_compiling() or n_rows == 0:
        return PendingTargetCheck(None)
    if target.is_cuda and torch.cuda.is_current_stream_capturing():
        return PendingTargetCheck(None)
    return PendingTargetCheck(target, n_cols, ignore_index, name)


def check_loss_options(
    reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None
) -> float:
    """Validate the scalar options shared by both losses; returns softcap as a float (0 = none)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not float(lse_square_scale) == float(lse_square_scale) or abs(float(lse_square_scale)) == float("inf"):
        raise ValueError(f"lse_square_scale must be finite, got {lse_square_scale}")
    if softcap is None:
        return 0.0
    if not float(softcap) > 0.0 or float(softcap) == float("inf"):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap}")
    return float(softcap)


def check_class_weight(class_weight: torch.Tensor | None, n_cols: int, name: str = "weight") -> torch.Tensor | None:
    """Validate the class weights; returns them as the kernel reads them, with unit stride
    (it addresses ``class_weight_ptr + c``: a strided view such as ``w[::2]`` would be read
    wrong, silently). Copies only a non-contiguous ``class_weight``."""
    if class_weight is None:
        return None
    check_float_dtype(class_weight, name)
    if class_weight.dim() != 1 or class_weight.shape[0] != n_cols:
        raise ValueError(
            f"{name} (class weights) must have shape ({n_cols},), one per class, got {tuple(class_weight.shape)}"
        )
    return class_weight.contiguous()


def check_ignore_index(ignore_index: object) -> int:
    """``ignore_index`` as the kernel's integer: a Python (or NumPy) integer, or a 0-dim
    integer tensor. Anything else raises ``TypeError``: ``int()`` would truncate a float such
    as -100.5 to -100, silently changing which targets are ignored, and a bool is a flag
    given in the wrong place."""
    if isinstance(ignore_index, torch.Tensor):
        dtype = ignore_index.dtype
        integral = ignore_index.dim() == 0 and not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        described = f"a tensor of dtype {dtype} and shape {tuple(ignore_index.shape)}"
    else:
        integral = isinstance(ignore_index, numbers.Integral) and not isinstance(ignore_index, bool)
        described = f"{type(ignore_index).__name__} {ignore_index!r}"
    if not integral:
        raise TypeError(f"ignore_index must be an integer class index (an int or a 0-dim integer tensor), "
                        f"got {described}")
    return int(ignore_index)


class LigerCrossEntropyFunction(torch.autograd.Function):
    """Cross entropy of ``logits`` (N, V) against class indices ``target`` (N,).

    ``forward(ctx, logits, target, weight=None, ignore_index=-100, lse_square_scale=0.0,
    label_smoothing=0.0, reduction="mean", softcap=None, return_token_accuracy=False,
    in_place=True)`` returns ``(loss, z_loss, token_accuracy)``, float32, each a scalar
    (``"mean"``/``"sum"``) or (N,) (``"none"``); only ``loss`` is differentiable. See
    :class:`CrossEntropyOutput` for their meaning and the module docstring for the math.

    The gradient is computed during the forward pass. With ``in_place=True`` it is
    written over ``logits``: **the logits' values are destroyed and must not be reused**
    (if another op saved them for its backward, that backward raises). ``in_place=False``
    keeps them at the cost of one (N, V) gradient buffer. Without a gradient to compute
    (no grad mode, or logits not requiring grad) the logits are left untouched.

    Differs from ``F.cross_entropy``: the loss is float32 for bf16/fp16 logits too; a
    ``"mean"`` whose targets are all ``ignore_index`` is 0 (torch: NaN); class weights
    receive no gradient. Backward may run only once per forward (it scales the stored
    gradient in place; a second call fails autograd's saved-tensor version check).
    """

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        return_token_accuracy: bool = False,
        in_place: bool = True,
    ):
        check_float_dtype(logits, "input")
        if logits.dim() != 2:
            raise ValueError(f"input (logits) must be 2-D (N, V), got shape {tuple(logits.shape)}")
        n_rows, n_cols = logits.shape
        if n_cols < 1:
            raise ValueError("input (logits) must have at least one class")
        check_same_device([("input", logits), ("target", target), ("weight", weight)])
        weight = check_class_weight(weight, n_cols)
        ignore_index = check_ignore_index(ignore_index)
        softcap_value = check_loss_options(reduction, label_smoothing, lse_square_scale, softcap)
        check_target(target, n_rows, n_cols, ignore_index)
        if logits.stride(1) != 1 and n_cols > 1:
            logits = logits.contiguous()

        compute_grad = bool(ctx.needs_input_grad[0])
        loss, z_loss, accuracy, grad = cross_entropy_forward(
            logits,
            target,
            weight,
            ignore_index,
            float(label_smoothing),
            float(lse_square_scale),
            softcap_value,
            reduction,
            compute_grad,
            bool(return_token_accuracy),
            bool(in_place),
        )
        if compute_grad and grad.shape != logits.shape:
            grad = logits  # the kernel wrote the gradient over the logits
        ctx.reduction = reduction
        ctx.compute_grad = compute_grad
        ctx.save_for_backward(grad if compute_grad else None)
        ctx.mark_non_differentiable(z_loss, accuracy)
        return loss, z_loss, accuracy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_z_loss=None, grad_accuracy=None):
        (grad,) = ctx.saved_tensors
        if not ctx.compute_grad:
            return (None,) * 10
        grad = scale_gradient(grad, grad_loss)
        # A fresh alias of the buffer, not the input tensor itself: autograd can then hand it
        # to a leaf's .grad as is, instead of cloning an (N, V) tensor it sees shared.
        return (grad.detach(),) + (None,) * 9
