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
``lane_width`` columns (:class:`CrossEntropyConfig`; merged once at the end of the row: for
lanes ``l`` with maxima ``m_l`` and sums ``S_l``, ``lse = M + log(sum_l S_l exp(m_l - M))``,
``M = max_l m_l``); pass 2 writes the gradient and then the target's ``- d_c`` term once.
The loss's backward only multiplies that stored gradient by the upstream gradient (a
scalar, or one value per row for ``"none"``), in place, skipping rows whose factor is
exactly 1 (decided on the device, without a host sync).

Memory: by default the gradient takes one more (N, V) buffer of the logits' dtype and the
logits keep their values. With ``in_place=True`` (the caller's promise that nothing reads the
logits afterwards, e.g. a temporary ``lm_head(h).float().view(-1, V)``) it is written over
the logits, so the extra memory is O(N); the logits' version counter is bumped, so an op that
saved them for its backward fails loudly instead of reading the gradient.

Differences from ``F.cross_entropy`` (all documented in :class:`LigerCrossEntropyFunction`):
a ``"mean"`` over a batch whose targets are all ignored is 0 with zero gradients (torch
gives NaN); class weights get no gradient. The loss has the logits' dtype, as torch's
(computed in float32, rounded once at the end).
"""

import dataclasses

import torch
import triton
import triton.language as tl

from liger_kernel.ops.autograd import InputGradients, strictly_once_differentiable
from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.checks import check_float_dtype, check_in_place, check_same_device
from liger_kernel.ops.config import FixedLaunchConfig, launch_config
from liger_kernel.ops.launch import (
    is_meta,
    liger_custom_op,
    num_programs_for_rows,
    row_launch_settings,
)
from liger_kernel.ops.loss_checks import check_class_weight, start_target_check
from liger_kernel.ops.loss_options import (
    CrossEntropyOptions,
    CrossEntropyOutput,
)
from liger_kernel.ops.loss_reduction import mean_denominators, reduce_rows
from liger_kernel.ops.numerics import tanh_and_sech2
from liger_kernel.ops.scaling import scale_gradient

__all__ = ["CrossEntropyConfig", "CrossEntropyOutput", "LigerCrossEntropyFunction", "cross_entropy_forward",
           "cross_entropy_forward_in_place", "launch_cross_entropy_kernel"]


@dataclasses.dataclass(frozen=True)
class CrossEntropyConfig(FixedLaunchConfig):
    """Launch parameters of the cross-entropy row kernel (the same for every shape).

    * ``max_block``: column block of the row loop (a power of two). At V = 128256 bf16 on
      the H200, 32768 (32 warps) beats 16384 and 8192 (``docs/performance.md``).
    * ``programs_per_sm``: persistent programs per SM. Few resident rows per SM keep a
      row's second read (pass 2) in L2: a 128K-vocab bf16 row is 256 KB.
    * ``prefetch``: load each column block one iteration ahead (register double-buffering)
      in both passes.
    * ``lane_width``: pass 1 keeps its statistics per lane of this many columns: each block
      is viewed as (max_block / lane_width, lane_width) and reduced along the short axis
      only, within a thread, so a row costs one cross-warp reduction instead of two per
      block (whose shared-memory barriers stall the SM when only one or two programs run on
      it), for one extra exp per lane_width elements. ``lane_width = max_block`` gives
      per-block statistics.
    """

    max_block: int = 32768
    programs_per_sm: float = 4
    prefetch: bool = True
    lane_width: int = 8

    @classmethod
    def search_space(cls):
        for max_block in (8192, 16384, 32768):
            for programs_per_sm in (1, 2, 4):
                for lane_width in (8, 32, max_block):
                    yield cls(max_block=max_block, programs_per_sm=programs_per_sm, lane_width=lane_width)


@triton.jit
def _lane_update(x, cols, mask, lane_max, lane_sum, lane_smooth, lane_best, lane_best_index,
                 class_weight_ptr, softcap, HAS_CLASS_WEIGHT: tl.constexpr, HAS_LABEL_SMOOTHING: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, COMPUTE_ACCURACY: tl.constexpr):
    """Fold one (lanes, width) column block of raw fp32 logits ``x`` (-inf where masked)
    into the per-lane pass-1 statistics; every reduction runs along axis 1 only.

    Per lane: running max of the (capped) logits and ``sum exp(s - shift)`` relative to it
    (shift 0 while the max is -inf), ``sum w_c s_c`` (label smoothing), and
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
        capped, _ = tanh_and_sech2(x / softcap)
        x = tl.where(mask, softcap * capped, float("-inf"))
    new_max = tl.maximum(lane_max, tl.max(x, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
    if HAS_LABEL_SMOOTHING:
        if HAS_CLASS_WEIGHT:
            w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            lane_smooth += tl.sum(w * tl.where(mask, x, 0.0), axis=1)
        else:
            lane_smooth += tl.sum(tl.where(mask, x, 0.0), axis=1)
    return new_max, lane_sum, lane_smooth, lane_best, lane_best_index


@triton.jit
def _rescaled_sum(part_max, part_sum, new_max):
    """``part_sum`` (relative to ``part_max``) relative to ``new_max >= part_max``; an all -inf
    part adds 0 (not 0 * exp(0 - new_max), which overflows for a very negative new_max)."""
    scaled = part_sum * tl.exp(part_max - tl.where(new_max == float("-inf"), 0.0, new_max))
    return tl.where(part_max == float("-inf"), 0.0, scaled)


@triton.jit
def _row_loss(lse, target_logit, smooth_sum, weight_total_ptr, target_weight, n_cols, label_smoothing,
              lse_square_scale, ce_scale, z_scale, HAS_CLASS_WEIGHT: tl.constexpr,
              HAS_LABEL_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
    """``(ce_i, z_i)`` of one row, already divided by the mean's denominators (see module docstring).
    ``weight_total_ptr`` holds ``sum_c w_c`` (read only with class weights and label smoothing)."""
    if HAS_LABEL_SMOOTHING:
        weight_total = tl.load(weight_total_ptr) if HAS_CLASS_WEIGHT else n_cols * 1.0
        ce_loss = (1.0 - label_smoothing) * target_weight * (lse - target_logit)
        ce_loss += (label_smoothing / n_cols) * (lse * weight_total - smooth_sum)
    else:
        ce_loss = target_weight * (lse - target_logit)
    z_loss = 0.0
    if HAS_Z_LOSS:
        z_loss = lse_square_scale * lse * lse * z_scale
    return ce_loss * ce_scale, z_loss


@triton.jit
def _gradient_coefficients(lse, target_weight, weight_total_ptr, n_cols, label_smoothing, lse_square_scale,
                           ce_scale, z_scale, row_scale, HAS_CLASS_WEIGHT: tl.constexpr,
                           HAS_LABEL_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
    """``(prob_coef, onehot_coef, uniform_coef)`` with dL/ds_c = prob_coef p_c - onehot_coef d_c - uniform_coef w_c."""
    if HAS_LABEL_SMOOTHING:
        weight_total = tl.load(weight_total_ptr) if HAS_CLASS_WEIGHT else n_cols * 1.0
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
        capped, cap_slope = tanh_and_sech2(x / softcap)
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


@triton.jit
def _row_statistics(logits_row, n_cols, class_weight_ptr, softcap, HAS_CLASS_WEIGHT: tl.constexpr,
                    HAS_LABEL_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE_ACCURACY: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, PREFETCH: tl.constexpr, LANE_WIDTH: tl.constexpr):
    """Pass 1 over one row: ``(lse, smooth_sum, best_index)``, from an online
    log-sum-exp, the smoothing sums and the first arg-max kept per lane (:func:`_lane_update`)."""
    lane_offsets = (tl.arange(0, BLOCK_SIZE // LANE_WIDTH)[:, None] * LANE_WIDTH
                    + tl.arange(0, LANE_WIDTH)[None, :])
    lane_max = tl.full([BLOCK_SIZE // LANE_WIDTH], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_SIZE // LANE_WIDTH], tl.float32)
    lane_smooth = tl.zeros([BLOCK_SIZE // LANE_WIDTH], tl.float32)
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
        lane_max, lane_sum, lane_smooth, lane_best, lane_best_index = _lane_update(
            x, cols, mask, lane_max, lane_sum, lane_smooth, lane_best, lane_best_index,
            class_weight_ptr, softcap, HAS_CLASS_WEIGHT, HAS_LABEL_SMOOTHING, HAS_SOFTCAP,
            COMPUTE_ACCURACY)
    running_max = tl.max(lane_max, axis=0)
    sum_exp = tl.sum(_rescaled_sum(lane_max, lane_sum, running_max), axis=0)
    best_index = 0
    if COMPUTE_ACCURACY:
        best_raw = tl.max(lane_best, axis=0)
        best_index = tl.min(tl.where(lane_best == best_raw, lane_best_index, 2147483647), axis=0)
    shift = tl.where(running_max == float("-inf"), 0.0, running_max)
    return shift + tl.log(sum_exp), tl.sum(lane_smooth, axis=0), best_index


@triton.jit
def _store_row_gradient(logits_row, grad_row, n_cols, target, target_valid, safe_target, target_raw, lse,
                        prob_coef, onehot_coef, uniform_coef, class_weight_ptr, softcap,
                        HAS_CLASS_WEIGHT: tl.constexpr, HAS_LABEL_SMOOTHING: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr, BLOCK_SIZE: tl.constexpr, PREFETCH: tl.constexpr):
    """Pass 2 over one row: dL/dx stored to ``grad_row`` (which may be ``logits_row`` itself),
    last block first: the blocks pass 1 read most recently are the likeliest still in L2."""
    offsets = tl.arange(0, BLOCK_SIZE)
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
            x_next = tl.load(logits_row + behind, mask=(behind >= 0) & (behind < n_cols), other=float("-inf"))
        else:
            x = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        grad = _block_gradient(x, cols, mask, target, lse, prob_coef, onehot_coef, uniform_coef,
                               class_weight_ptr, softcap, HAS_CLASS_WEIGHT, HAS_LABEL_SMOOTHING,
                               HAS_SOFTCAP, WITH_ONEHOT=False)
        tl.store(grad_row + cols, grad.to(grad_row.dtype.element_ty), mask=mask)
    if target_valid:
        # The loop left out the one-hot term (a compare and select per element); the target's
        # gradient is rewritten once, after every thread's stores above (the barrier orders
        # them before this one).
        tl.debug_barrier()
        target_grad = _block_gradient(target_raw, safe_target, target_valid, target, lse, prob_coef,
                                      onehot_coef, uniform_coef, class_weight_ptr, softcap,
                                      HAS_CLASS_WEIGHT, HAS_LABEL_SMOOTHING, HAS_SOFTCAP)
        tl.store(grad_row + safe_target, target_grad.to(grad_row.dtype.element_ty))


@triton.jit
def _cross_entropy_kernel(
    logits_ptr, logits_row_stride, grad_ptr, grad_row_stride, target_ptr, target_stride, class_weight_ptr,
    weight_total_ptr, row_scale_ptr, loss_ptr, z_loss_ptr, correct_ptr, ce_denominator_ptr, z_denominator_ptr, n_rows, n_cols,
    ignore_index, label_smoothing, lse_square_scale, softcap,
    HAS_CLASS_WEIGHT: tl.constexpr, HAS_LABEL_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, MEAN_REDUCTION: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, COMPUTE_ACCURACY: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PREFETCH: tl.constexpr, LANE_WIDTH: tl.constexpr,
):
    """Per row: loss, z-loss, correctness and (optionally) dL/dx.

    Persistent programs, one row at a time, two passes over the row (column-block loop).
    """
    offsets = tl.arange(0, BLOCK_SIZE)
    if MEAN_REDUCTION:
        ce_scale = 1.0 / tl.load(ce_denominator_ptr).to(tl.float32)
        z_scale = 1.0 / tl.load(z_denominator_ptr).to(tl.float32)
    else:
        ce_scale = 1.0
        z_scale = 1.0
    # int64 row index: row * stride passes 2**31 for large N * V.
    for row in tl.range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        logits_row = logits_ptr + row * logits_row_stride
        grad_row = grad_ptr + row * grad_row_stride
        target = tl.load(target_ptr + row * target_stride)
        if target == ignore_index:
            if COMPUTE_GRAD:
                zeros = tl.zeros([BLOCK_SIZE], dtype=tl.float32).to(grad_ptr.dtype.element_ty)
                for start in range(0, n_cols, BLOCK_SIZE):
                    cols = start + offsets
                    tl.store(grad_row + cols, zeros, mask=cols < n_cols)
            tl.store(loss_ptr + row, 0.0)
            tl.store(z_loss_ptr + row, 0.0)
            tl.store(correct_ptr + row, 0.0)
        else:
            # A target outside [0, V) is never used as an address: loads go through a clamped
            # index and the one-hot comparison simply never matches. Its loss is NaN so the
            # bad label is visible even where the host-side check is skipped (torch.compile).
            target_valid = (target >= 0) & (target < n_cols)
            safe_target = tl.where(target_valid, target, 0)
            # The target's raw logit, read before pass 2 can overwrite the row in place
            # (only this program writes this row, and not before pass 2).
            target_raw = tl.load(logits_row + safe_target).to(tl.float32)
            if HAS_SOFTCAP:
                capped_target, _ = tanh_and_sech2(target_raw / softcap)
                target_logit = softcap * capped_target
            else:
                target_logit = target_raw
            lse, smooth_sum, best_index = _row_statistics(
                logits_row, n_cols, class_weight_ptr, softcap, HAS_CLASS_WEIGHT, HAS_LABEL_SMOOTHING, HAS_SOFTCAP,
                COMPUTE_ACCURACY, BLOCK_SIZE, PREFETCH, LANE_WIDTH)

            if HAS_CLASS_WEIGHT:
                target_weight = tl.load(class_weight_ptr + safe_target, mask=target_valid, other=0.0)
                target_weight = target_weight.to(tl.float32)
            else:
                target_weight = 1.0
            ce_loss, z_loss = _row_loss(lse, target_logit, smooth_sum, weight_total_ptr, target_weight, n_cols,
                                        label_smoothing, lse_square_scale, ce_scale, z_scale, HAS_CLASS_WEIGHT,
                                        HAS_LABEL_SMOOTHING, HAS_Z_LOSS)
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
                    lse, target_weight, weight_total_ptr, n_cols, label_smoothing, lse_square_scale, ce_scale, z_scale,
                    row_scale, HAS_CLASS_WEIGHT, HAS_LABEL_SMOOTHING, HAS_Z_LOSS)
                _store_row_gradient(logits_row, grad_row, n_cols, target, target_valid, safe_target, target_raw, lse,
                                    prob_coef, onehot_coef, uniform_coef, class_weight_ptr, softcap, HAS_CLASS_WEIGHT,
                                    HAS_LABEL_SMOOTHING, HAS_SOFTCAP, BLOCK_SIZE, PREFETCH)


def launch_cross_entropy_kernel(logits: torch.Tensor, grad: torch.Tensor, target: torch.Tensor,
                                class_weight: torch.Tensor | None, row_scale: torch.Tensor | None,
                                loss_rows: torch.Tensor, z_rows: torch.Tensor, correct_rows: torch.Tensor,
                                ce_denominator: torch.Tensor, z_denominator: torch.Tensor, ignore_index: int,
                                label_smoothing: float, lse_square_scale: float, softcap: float, mean_reduction: bool,
                                compute_grad: bool, compute_accuracy: bool) -> None:
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
    config = launch_config(CrossEntropyConfig)
    block, num_warps = row_launch_settings(n_cols, config.max_block)
    grid = (num_programs_for_rows(n_rows, logits.device, config.programs_per_sm),)
    # sum_c w_c for label smoothing: one float32 sum here rather than a second class-weighted
    # lane sum in every row's pass 1 (the two together crash Triton 3.9's LLVM lowering).
    weight_total = None
    if class_weight is not None and label_smoothing > 0:
        weight_total = class_weight.sum(dtype=torch.float32).reshape(1)
    launch_kernel(_cross_entropy_kernel, grid,
        logits,
        logits.stride(0),
        grad if compute_grad else logits,
        grad.stride(0) if compute_grad else 0,
        target,
        target.stride(0),
        class_weight if class_weight is not None else loss_rows,
        weight_total if weight_total is not None else loss_rows,
        row_scale if row_scale is not None else loss_rows,
        loss_rows,
        z_rows,
        correct_rows,
        ce_denominator,
        z_denominator,
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
        PREFETCH=config.prefetch,
        LANE_WIDTH=min(config.lane_width, block),
        num_warps=num_warps,
    )


def _rows_disjoint(logits: torch.Tensor) -> bool:
    # The gradient may only overwrite logits whose rows are disjoint and unit-stride;
    # otherwise (an expanded or transposed view) it goes to a fresh buffer.
    n_rows, n_cols = logits.shape
    return logits.stride(1) == 1 and (n_rows <= 1 or logits.stride(0) >= n_cols)


def _forward(logits, target, class_weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
             compute_grad, compute_accuracy, in_place):
    """Both forward launchers: ``in_place`` lets the gradient overwrite ``logits``."""
    n_rows, n_cols = logits.shape
    device = logits.device
    loss_rows = torch.empty(n_rows, device=device, dtype=torch.float32)
    z_rows = torch.empty_like(loss_rows)
    correct_rows = torch.empty_like(loss_rows)
    ce_denominator, z_denominator, n_counted = mean_denominators(target, class_weight, ignore_index, n_cols)
    write_in_place = compute_grad and in_place and _rows_disjoint(logits)
    if compute_grad and not write_in_place:
        grad = torch.empty((n_rows, n_cols), device=device, dtype=logits.dtype)
    else:
        grad = logits.new_empty((0,))
    launch_cross_entropy_kernel(
        logits, logits if write_in_place else grad, target, class_weight, None, loss_rows, z_rows, correct_rows,
        ce_denominator, z_denominator, ignore_index, label_smoothing, lse_square_scale, softcap,
        reduction == "mean", compute_grad, compute_accuracy,
    )
    if write_in_place:
        # Triton writes behind autograd's back; bumping the version makes any other op that
        # saved these logits for its backward fail loudly instead of using the gradient.
        torch.autograd.graph.increment_version(logits)
    return (*reduce_rows(loss_rows, z_rows, correct_rows, n_counted, reduction), grad)


def _forward_fake(logits, target, class_weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
                  compute_grad, compute_accuracy, in_place):
    n_rows, n_cols = logits.shape
    reduced_shape = (n_rows,) if reduction == "none" else ()
    reduced = [logits.new_empty(reduced_shape, dtype=torch.float32) for _ in range(3)]
    if compute_grad and not (in_place and _rows_disjoint(logits)):
        grad = logits.new_empty((n_rows, n_cols))
    else:
        grad = logits.new_empty((0,))
    return (*reduced, grad)


# Two ops, so that each declares exactly what it writes. Under torch.compile (and for fake
# or meta tensors) only the first is used: the traced forward never overwrites the logits,
# and an op declaring a mutation inside an autograd Function's forward costs a clone of the
# logits under functionalization.


def _forward_launcher(in_place: bool):
    """The launcher registered as one of the two ops (its annotations are the op's schema)."""

    def launcher(logits: torch.Tensor, target: torch.Tensor, class_weight: torch.Tensor | None, ignore_index: int,
                 label_smoothing: float, lse_square_scale: float, softcap: float, reduction: str, compute_grad: bool,
                 compute_accuracy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _forward(logits, target, class_weight, ignore_index, label_smoothing, lse_square_scale, softcap,
                        reduction, compute_grad, compute_accuracy, in_place)

    def fake(logits, target, class_weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
             compute_grad, compute_accuracy):
        return _forward_fake(logits, target, class_weight, ignore_index, label_smoothing, lse_square_scale, softcap,
                             reduction, compute_grad, compute_accuracy, in_place)

    return launcher, fake


# Launcher: float32 loss, z-loss, token accuracy (reduced per ``reduction``) and dL/dlogits of
# ``logits`` (N, V) with unit column stride and ``target`` (N,) integer; ``softcap <= 0``
# disables the cap; arguments are trusted (checked by the autograd Function). The gradient
# is a fresh (N, V) tensor of the logits' dtype (empty without ``compute_grad``), and the
# logits are left untouched.
_launcher, _cross_entropy_forward_fake = _forward_launcher(False)
cross_entropy_forward = liger_custom_op("cross_entropy_forward")(_launcher)
cross_entropy_forward.register_fake(_cross_entropy_forward_fake)
# The same, but with ``compute_grad`` (and rows of ``logits`` that are disjoint) the gradient
# overwrites ``logits`` and the returned gradient is an empty placeholder: only for logits
# nothing else can read (the autograd Function decides).
_launcher, _fake = _forward_launcher(True)
cross_entropy_forward_in_place = liger_custom_op("cross_entropy_forward_in_place", mutates_args=("logits",))(_launcher)
cross_entropy_forward_in_place.register_fake(_fake)


def _cross_entropy(ctx, logits, target, weight, options: CrossEntropyOptions, overwrite: bool,
                   loss_dtype: torch.dtype | None = None):
    """The forward of both autograd Functions; ``overwrite``: the logits may take the gradient;
    ``loss_dtype``: the dtype of the loss (None: the logits', as torch's)."""
    if loss_dtype is not None and not (isinstance(loss_dtype, torch.dtype) and loss_dtype.is_floating_point):
        raise TypeError(f"loss_dtype must be None or a floating-point torch.dtype, got {loss_dtype!r}")
    check_float_dtype(logits, "input")
    if logits.dim() != 2:
        raise ValueError(f"input (logits) must be 2-D (N, V), got shape {tuple(logits.shape)}")
    n_rows, n_cols = logits.shape
    if n_cols < 1:
        raise ValueError("input (logits) must have at least one class")
    meta = is_meta(logits, target, weight)
    if not meta:
        check_same_device([("input", logits), ("target", target), ("weight", weight)])
    weight = check_class_weight(weight, n_cols)
    start_target_check(target, n_rows, n_cols, options.ignore_index).wait()
    if logits.stride(1) != 1 and n_cols > 1:
        logits = logits.contiguous()

    compute_grad = bool(ctx.needs_input_grad[0])
    if meta:
        forward = _cross_entropy_forward_fake
    elif overwrite and not torch.compiler.is_compiling():
        forward = cross_entropy_forward_in_place
    else:
        forward = cross_entropy_forward
    loss, z_loss, accuracy, grad = forward(
        logits, target, weight, *options.kernel_options, options.reduction, compute_grad,
        options.return_token_accuracy,
    )
    if compute_grad and grad.shape != logits.shape:
        grad = logits  # the kernel wrote the gradient over the logits
    ctx.compute_grad = compute_grad
    ctx.save_for_backward(grad if compute_grad else None)
    # torch's dtype for the loss (unless asked otherwise): computed in float32, rounded once here.
    # Only when the dtype differs: a no-op ``.to`` returns its input object, and an autograd
    # Function's traced forward must not return a tensor that another traced op also produced.
    # torch 2.11's Dynamo returns every intermediate of the forward as an extra output, so the
    # loss tensor would be output twice; autograd records the later slot on it, and the loss's
    # gradient would reach backward as zeros (tests/function_graphs.py checks for the pattern).
    loss_dtype = loss_dtype or logits.dtype
    if loss.dtype != loss_dtype:
        loss, z_loss = loss.to(loss_dtype), z_loss.to(loss_dtype)
    ctx.mark_non_differentiable(z_loss, accuracy)
    return loss, z_loss, accuracy


class LigerCrossEntropyFunction(torch.autograd.Function):
    """Cross entropy of ``logits`` (N, V) against class indices ``target`` (N,).

    ``forward(ctx, logits, target, weight=None, ignore_index=-100, lse_square_scale=0.0,
    label_smoothing=0.0, reduction="mean", softcap=None, return_token_accuracy=False,
    in_place=False)`` returns ``(loss, z_loss, token_accuracy)``, each a scalar
    (``"mean"``/``"sum"``) or (N,) (``"none"``); ``loss`` and ``z_loss`` have the logits'
    dtype (as ``F.cross_entropy``'s loss; computed in float32), ``token_accuracy`` is
    float32; only ``loss`` is differentiable. See
    :class:`~liger_kernel.ops.loss_options.CrossEntropyOutput` for their meaning and the
    module docstring for the math. Meta tensors give meta outputs.

    The gradient is computed during the forward pass, into a fresh (N, V) buffer: the logits
    keep their values. ``in_place=True`` is the caller's promise that nothing reads the logits
    afterwards (a temporary passed straight in): then the gradient is written over them
    (where their rows are disjoint and unit-stride, and not under ``torch.compile``), and an
    op that saved them fails loudly in its backward. Without a gradient to compute (no grad
    mode, or logits not requiring grad) the logits are left untouched.

    Differs from ``F.cross_entropy``: a ``"mean"`` whose targets are all ``ignore_index``
    is 0 (torch: NaN); class weights receive no gradient. Backward may run only once per
    forward (it scales the stored gradient in place; a second call fails autograd's
    saved-tensor version check).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                ignore_index: int = -100, lse_square_scale: float = 0.0, label_smoothing: float = 0.0,
                reduction: str = "mean", softcap: float | None = None, return_token_accuracy: bool = False,
                in_place: bool = False):
        options = CrossEntropyOptions(ignore_index=ignore_index, label_smoothing=label_smoothing,
                                      lse_square_scale=lse_square_scale, softcap=softcap, reduction=reduction,
                                      return_token_accuracy=return_token_accuracy)
        return _cross_entropy(ctx, logits, target, weight, options, check_in_place(in_place))

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_loss, grad_z_loss=None, grad_accuracy=None):
        return _CROSS_ENTROPY_GRADS(logits=_logits_gradient(ctx, grad_loss))


class CrossEntropyFunctionFromOptions(torch.autograd.Function):
    """:class:`LigerCrossEntropyFunction` for callers holding validated options:
    ``apply(logits, target, weight, options, in_place, loss_dtype=None)``."""

    @staticmethod
    def forward(ctx, logits, target, weight, options, in_place, loss_dtype=None):
        return _cross_entropy(ctx, logits, target, weight, options, check_in_place(in_place), loss_dtype)

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_loss, grad_z_loss=None, grad_accuracy=None):
        return _FROM_OPTIONS_GRADS(logits=_logits_gradient(ctx, grad_loss))


def _logits_gradient(ctx, grad_loss: torch.Tensor) -> torch.Tensor | None:
    """The gradient the forward stored, scaled by ``grad_loss`` (None when none was computed)."""
    (grad,) = ctx.saved_tensors
    if not ctx.compute_grad:
        return None
    grad = scale_gradient(grad, grad_loss)
    # A fresh alias of the buffer, not the input tensor itself: autograd can then hand it
    # to a leaf's .grad as is, instead of cloning an (N, V) tensor it sees shared.
    return grad.detach()


_CROSS_ENTROPY_GRADS = InputGradients(LigerCrossEntropyFunction.forward)
_FROM_OPTIONS_GRADS = InputGradients(CrossEntropyFunctionFromOptions.forward)

