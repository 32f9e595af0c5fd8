"""Total variation distance between two distributions given as probabilities.

Per element, for distributions ``p`` (the input) and ``q`` (the target) over the last
dimension::

    l = |p - q| / 2            (the row sum is TV(p, q) = sum_c |p_c - q_c| / 2)

Rows whose ``shift_labels`` entry equals ``ignore_index`` contribute 0 (and get a zero
gradient); ``n`` is the number of counted rows (all rows without labels, at least 1).
Reductions: ``"none"`` the elements (input's shape), ``"sum"`` their sum, ``"batchmean"``
their sum over ``n``, ``"mean"`` their sum over ``n * V``. Gradients, for upstream gradient
``g`` (per element for ``"none"``, else the scalar over the reduction's denominator)::

    dl/dp = g sign(p - q) / 2        dl/dq = -dl/dp

with ``sign(0) = 0``, torch's choice for ``abs``. The gradient needs only p and q, so it is
computed in the backward pass into fresh buffers (the inputs are never overwritten); the
forward allocates only its row sums (or the elements for ``"none"``).
"""

import torch
import triton
import triton.language as tl

from liger_kernel.ops.autograd import InputGradients, strictly_once_differentiable
from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.config import launch_config
from liger_kernel.ops.launch import is_interpreter, liger_custom_op
from liger_kernel.ops.loss_options import check_ignore_index
from liger_kernel.ops.numerics import round_to_dtype
from liger_kernel.ops.vocab_rows import (
    VocabRowConfig,
    as_vocab_rows,
    check_devices,
    check_distribution_pair,
    counted_rows,
    gradient_buffer,
    labelled_vocab_rows,
    loss_output,
    run_launcher,
)

TVD_REDUCTIONS = ("none", "sum", "mean", "batchmean")


class TVDConfig(VocabRowConfig):
    """Launch configuration of the total-variation kernels."""


@triton.jit
def _tvd_forward_kernel(p_ptr, p_stride, q_ptr, q_stride, label_ptr, out_ptr, out_stride, n_cols, ignore_index,
                        HAS_LABELS: tl.constexpr, ELEMENTWISE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        ROUND_BY_HAND: tl.constexpr):
    """One program per row: the elements (``ELEMENTWISE``) or their float32 row sum; zeros for
    an ignored row."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_SIZE)
    keep = 1.0
    if HAS_LABELS:
        keep = tl.where(tl.load(label_ptr + row) == ignore_index, 0.0, 1.0)
    acc = tl.zeros([BLOCK_SIZE], tl.float32)
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < n_cols
        p = tl.load(p_ptr + row * p_stride + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row * q_stride + cols, mask=mask, other=0.0).to(tl.float32)
        element = 0.5 * tl.abs(p - q)
        if HAS_LABELS:  # where, not a product: whatever an ignored row holds (NaN) stays out
            element = tl.where(keep > 0.0, element, 0.0)
        if ELEMENTWISE:
            element = round_to_dtype(element, out_ptr.dtype.element_ty, ROUND_BY_HAND)
            tl.store(out_ptr + row * out_stride + cols, element.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            acc += element
    if not ELEMENTWISE:
        tl.store(out_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def _tvd_backward_kernel(p_ptr, p_stride, q_ptr, q_stride, label_ptr, g_ptr, g_stride, count_ptr, dp_ptr, dq_ptr,
                         n_cols, ignore_index, denominator_cols, HAS_LABELS: tl.constexpr,
                         GRAD_PER_ELEMENT: tl.constexpr, DIVIDE_BY_COUNT: tl.constexpr, COMPUTE_DP: tl.constexpr,
                         COMPUTE_DQ: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """One program per row: dl/dp and dl/dq into contiguous (N, V) buffers. The scalar upstream
    gradient is divided by ``count * denominator_cols`` with ``DIVIDE_BY_COUNT``."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_SIZE)
    keep = 1.0
    if HAS_LABELS:
        keep = tl.where(tl.load(label_ptr + row) == ignore_index, 0.0, 1.0)
    if not GRAD_PER_ELEMENT:
        g = tl.load(g_ptr).to(tl.float32)
        if DIVIDE_BY_COUNT:
            g = g / (tl.load(count_ptr) * denominator_cols)
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < n_cols
        if GRAD_PER_ELEMENT:
            g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + row * p_stride + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row * q_stride + cols, mask=mask, other=0.0).to(tl.float32)
        sign = tl.where(p > q, 1.0, tl.where(p < q, -1.0, 0.0))
        dp = 0.5 * g * sign
        if HAS_LABELS:
            dp = tl.where(keep > 0.0, dp, 0.0)
        if COMPUTE_DP:
            dp_out = round_to_dtype(dp, dp_ptr.dtype.element_ty, ROUND_BY_HAND)
            tl.store(dp_ptr + row * n_cols + cols, dp_out.to(dp_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DQ:
            dq_out = round_to_dtype(-dp, dq_ptr.dtype.element_ty, ROUND_BY_HAND)
            tl.store(dq_ptr + row * n_cols + cols, dq_out.to(dq_ptr.dtype.element_ty), mask=mask)


@liger_custom_op("tvd_forward")
def tvd_forward(p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None, ignore_index: int,
                elementwise: bool) -> torch.Tensor:
    """Launcher: the (N, V) elements in p's dtype (``elementwise``) or the float32 (N,) row sums."""
    n_rows, n_cols = p.shape
    out = loss_output(p, elementwise)
    if n_rows:
        config = launch_config(TVDConfig, n_cols)
        launch_kernel(_tvd_forward_kernel, (n_rows,), p, p.stride(0), q, q.stride(0),
                      labels if labels is not None else out, out, out.stride(0), n_cols, ignore_index,
                      HAS_LABELS=labels is not None, ELEMENTWISE=elementwise, BLOCK_SIZE=config.block_size,
                      ROUND_BY_HAND=is_interpreter(), num_warps=config.num_warps)
    return out


@tvd_forward.register_fake
def _tvd_forward_fake(p, q, labels, ignore_index, elementwise):
    return loss_output(p, elementwise)


@liger_custom_op("tvd_backward")
def tvd_backward(p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None, grad_output: torch.Tensor,
                 count: torch.Tensor, ignore_index: int, reduction: str, compute_p_grad: bool,
                 compute_q_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: ``(dl/dp, dl/dq)``, fresh contiguous (N, V) tensors (or empty placeholders)."""
    n_rows, n_cols = p.shape
    dp = gradient_buffer(p, compute_p_grad)
    dq = gradient_buffer(q, compute_q_grad)
    if n_rows:
        config = launch_config(TVDConfig, n_cols)
        per_element = reduction == "none"
        launch_kernel(_tvd_backward_kernel, (n_rows,), p, p.stride(0), q, q.stride(0),
                      labels if labels is not None else count, grad_output,
                      grad_output.stride(0) if per_element else 0, count, dp if compute_p_grad else p,
                      dq if compute_q_grad else q, n_cols, ignore_index,
                      float(n_cols) if reduction == "mean" else 1.0, HAS_LABELS=labels is not None,
                      GRAD_PER_ELEMENT=per_element, DIVIDE_BY_COUNT=reduction in ("mean", "batchmean"),
                      COMPUTE_DP=compute_p_grad, COMPUTE_DQ=compute_q_grad, BLOCK_SIZE=config.block_size,
                      ROUND_BY_HAND=is_interpreter(), num_warps=config.num_warps)
    return dp, dq


@tvd_backward.register_fake
def _tvd_backward_fake(p, q, labels, grad_output, count, ignore_index, reduction, compute_p_grad, compute_q_grad):
    return gradient_buffer(p, compute_p_grad), gradient_buffer(q, compute_q_grad)


class LigerTVDLossFunction(torch.autograd.Function):
    """Total variation distance of ``p`` and ``q`` (..., V); see the module docstring.

    ``forward(ctx, p, q, shift_labels=None, reduction="batchmean", ignore_index=-100)``, the
    best-known implementation's argument order. Differences from it: a reduced loss is float32
    (``"none"`` keeps p's dtype); the gradient where ``p == q`` is 0 (it uses -1/2); ``q`` gets
    its gradient when it requires grad; a batch whose rows are all ignored gives 0 with zero
    gradients (it divides by zero); any leading shape is accepted.
    """

    @staticmethod
    def forward(ctx, p: torch.Tensor, q: torch.Tensor, shift_labels: torch.Tensor | None = None,
                reduction: str = "batchmean", ignore_index: int = -100):
        check_distribution_pair(p, q, "p", "q")
        check_devices([("p", p), ("q", q), ("shift_labels", shift_labels)])
        if reduction not in TVD_REDUCTIONS:
            raise ValueError(f"reduction must be one of {TVD_REDUCTIONS}, got {reduction!r}")
        ignore_index = check_ignore_index(ignore_index)
        p_rows, q_rows, labels = labelled_vocab_rows(p, q, shift_labels)
        n_rows, n_cols = p_rows.shape
        count = counted_rows(labels, ignore_index, n_rows, p.device)
        elementwise = reduction == "none"
        out = run_launcher(tvd_forward, p_rows, q_rows, labels, ignore_index, elementwise)
        ctx.save_for_backward(p, q, labels, count)
        ctx.options = (reduction, ignore_index)
        if elementwise:
            return out.view(p.shape)
        total = out.sum()
        if reduction == "batchmean":
            return total / count.reshape(())
        if reduction == "mean":
            return total / (count.reshape(()) * n_cols)
        return total

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        p, q, labels, count = ctx.saved_tensors
        reduction, ignore_index = ctx.options
        compute_dp, compute_dq = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
        if not (compute_dp or compute_dq):
            return _TVD_GRADS()
        grad = as_vocab_rows(grad_output.expand(p.shape)) if reduction == "none" else grad_output.reshape(1)
        dp, dq = run_launcher(tvd_backward, as_vocab_rows(p), as_vocab_rows(q), labels, grad, count, ignore_index,
                              reduction, compute_dp, compute_dq)
        return _TVD_GRADS(p=dp.view(p.shape) if compute_dp else None, q=dq.view(q.shape) if compute_dq else None)


_TVD_GRADS = InputGradients(LigerTVDLossFunction.forward)
