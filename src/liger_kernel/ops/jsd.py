"""Generalised Jensen-Shannon divergence between student and teacher log-probabilities.

Notation, for one row (token) of width ``V``: student log-probabilities ``x`` (the input,
``Q = exp(x)``), teacher log-probabilities ``y`` (the target, ``P = exp(y)``), ``beta`` in [0, 1]
and the mixture ``M = beta * P + (1 - beta) * Q``. The per-row divergence is::

    JSD_beta = beta * KL(P || M) + (1 - beta) * KL(Q || M)
             = sum_c [beta * P_c * (y_c - log M_c) + (1 - beta) * Q_c * (x_c - log M_c)]

with ``log M_c = logaddexp(log(beta) + y_c, log(1 - beta) + x_c)``. Both ends are the limits
used by TRL's ``generalized_jsd_loss`` (at beta = 0 or 1 the formula above is identically 0):

* ``beta = 0``: forward KL, ``KL(P || Q) = sum_c P_c (y_c - x_c)``;
* ``beta = 1``: reverse KL, ``KL(Q || P) = sum_c Q_c (x_c - y_c)``.

The loss is the sum over rows divided by the number of counted rows ``n``: rows whose
``shift_labels`` entry equals ``ignore_index`` count for nothing (all rows count without
labels). Gradients, with ``x`` and ``y`` treated as free coordinates (as autograd on the
formula above treats log-probabilities), each divided by ``n``::

    mixture:  dL/dx_c = (1 - beta) Q_c (x_c - log M_c)      dL/dy_c = beta P_c (y_c - log M_c)
    beta = 0: dL/dx_c = -P_c                                 dL/dy_c = P_c (y_c - x_c + 1)
    beta = 1: dL/dx_c = Q_c (x_c - y_c + 1)                  dL/dy_c = -Q_c

A term whose probability is 0 (a log-probability of -inf) contributes 0, its limit.

The kernel makes one pass over each row pair and writes the gradients during the forward
pass into fresh buffers (never over the inputs: the student's log-probabilities are what
``log_softmax`` saved for its own backward). Backward only scales those buffers by the
upstream gradient, in place (they belong to this op alone). Extra memory: one (N, V)
buffer per input that requires grad, which autograd's backward would allocate anyway.
"""


import math

import torch
import triton
import triton.language as tl

from liger_kernel.ops.autograd import InputGradients, strictly_once_differentiable
from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.checks import check_beta
from liger_kernel.ops.config import launch_config
from liger_kernel.ops.launch import is_interpreter, is_meta, liger_custom_op
from liger_kernel.ops.loss_options import check_ignore_index
from liger_kernel.ops.numerics import round_to_dtype
from liger_kernel.ops.scaling import scale_gradient
from liger_kernel.ops.vocab_rows import (
    VocabRowConfig,
    check_devices,
    check_distribution_pair,
    counted_rows,
    gradient_buffer,
    labelled_vocab_rows,
    run_launcher,
)

# MODE of the kernel, from beta.
FORWARD_KL, REVERSE_KL, MIXTURE = 0, 1, 2
# The same values for the kernels (a @triton.jit function reads only constexpr globals).
_FORWARD_KL, _REVERSE_KL = tl.constexpr(FORWARD_KL), tl.constexpr(REVERSE_KL)


class JSDConfig(VocabRowConfig):
    """Launch configuration of :func:`jsd_forward`."""


@triton.jit
def _jsd_terms(x, y, log_beta, log_one_minus_beta, beta, MODE: tl.constexpr):
    """``(dL/dx, dL/dy)`` per element before the 1/n scaling; their sum is the loss element
    for the mixture, and the loss element is returned separately for the two KL ends."""
    q = tl.exp(x)
    p = tl.exp(y)
    if MODE == _FORWARD_KL:
        p_term = tl.where(p > 0.0, p * (y - x), 0.0)
        return -p, p_term + p, p_term
    elif MODE == _REVERSE_KL:
        q_term = tl.where(q > 0.0, q * (x - y), 0.0)
        return q_term + q, -q, q_term
    else:
        a = x + log_one_minus_beta
        b = y + log_beta
        # logaddexp(a, b) = max + log(1 + exp(-|a - b|)): one exp instead of two. Both -inf
        # (probability 0 on both sides) gives -inf; the terms below are then 0.
        m = tl.maximum(a, b)
        gap = tl.where(m == float("-inf"), 0.0, tl.abs(a - b))
        log_m = m + tl.log(1.0 + tl.exp(-gap))
        dx = tl.where(q > 0.0, (1.0 - beta) * q * (x - log_m), 0.0)
        dy = tl.where(p > 0.0, beta * p * (y - log_m), 0.0)
        return dx, dy, dx + dy


@triton.jit
def _jsd_kernel(x_ptr, x_stride, y_ptr, y_stride, dx_ptr, dx_stride, dy_ptr, dy_stride, label_ptr, count_ptr,
                loss_ptr, n_cols, ignore_index, beta, log_beta, log_one_minus_beta,
                MODE: tl.constexpr, HAS_LABELS: tl.constexpr, COMPUTE_DX: tl.constexpr, COMPUTE_DY: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """One program per row: the row's share of the loss (already divided by n) and, as asked,
    dL/dx and dL/dy of the row (zeros for an ignored row)."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_SIZE)
    ignored = False
    if HAS_LABELS:
        ignored = tl.load(label_ptr + row) == ignore_index
    if ignored:
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + offsets
            mask = cols < n_cols
            if COMPUTE_DX:
                tl.store(dx_ptr + row * dx_stride + cols, tl.zeros([BLOCK_SIZE], tl.float32).to(
                    dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DY:
                tl.store(dy_ptr + row * dy_stride + cols, tl.zeros([BLOCK_SIZE], tl.float32).to(
                    dy_ptr.dtype.element_ty), mask=mask)
        tl.store(loss_ptr + row, 0.0)
    else:
        scale = 1.0 / tl.load(count_ptr)
        acc = tl.zeros([BLOCK_SIZE], tl.float32)
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
            dx, dy, element = _jsd_terms(x, y, log_beta, log_one_minus_beta, beta, MODE)
            acc += tl.where(mask, element, 0.0)
            if COMPUTE_DX:
                dx = round_to_dtype(dx * scale, dx_ptr.dtype.element_ty, ROUND_BY_HAND)
                tl.store(dx_ptr + row * dx_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DY:
                dy = round_to_dtype(dy * scale, dy_ptr.dtype.element_ty, ROUND_BY_HAND)
                tl.store(dy_ptr + row * dy_stride + cols, dy.to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(loss_ptr + row, tl.sum(acc, axis=0) * scale)


def _mode(beta: float) -> int:
    return FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXTURE


@liger_custom_op("jsd_forward")
def jsd_forward(
    input: torch.Tensor,
    target: torch.Tensor,
    labels: torch.Tensor | None,
    beta: float,
    ignore_index: int,
    compute_input_grad: bool,
    compute_target_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher: ``(loss, dL/dinput, dL/dtarget)`` for (N, V) rows with unit column stride.

    ``loss`` is a float32 scalar; a gradient not asked for is an empty placeholder, one asked
    for a fresh (N, V) tensor of its input's dtype. Arguments are trusted (checked by
    :class:`LigerJSDFunction`).
    """
    n_rows, n_cols = input.shape
    device = input.device
    loss_rows = torch.empty(n_rows, device=device, dtype=torch.float32)
    dx = gradient_buffer(input, compute_input_grad)
    dy = gradient_buffer(target, compute_target_grad)
    count = counted_rows(labels, ignore_index, n_rows, device)
    if n_rows:
        config = launch_config(JSDConfig, n_cols)
        inside = 0.0 < beta < 1.0
        launch_kernel(
            _jsd_kernel, (n_rows,), input, input.stride(0), target, target.stride(0),
            dx if compute_input_grad else input, dx.stride(0) if compute_input_grad else 0,
            dy if compute_target_grad else target, dy.stride(0) if compute_target_grad else 0,
            labels if labels is not None else count, count, loss_rows, n_cols, ignore_index, float(beta),
            math.log(beta) if inside else 0.0, math.log1p(-beta) if inside else 0.0,
            MODE=_mode(beta), HAS_LABELS=labels is not None, COMPUTE_DX=compute_input_grad,
            COMPUTE_DY=compute_target_grad, BLOCK_SIZE=config.block_size, ROUND_BY_HAND=is_interpreter(),
            num_warps=config.num_warps,
        )
    return loss_rows.sum(), dx, dy


@jsd_forward.register_fake
def _jsd_forward_fake(input, target, labels, beta, ignore_index, compute_input_grad, compute_target_grad):
    loss = input.new_empty((), dtype=torch.float32)
    return loss, gradient_buffer(input, compute_input_grad), gradient_buffer(target, compute_target_grad)


class LigerJSDFunction(torch.autograd.Function):
    """Generalised JSD of student log-probabilities ``input`` and teacher log-probabilities
    ``target``, both (..., V); see the module docstring for the math.

    ``forward(ctx, input, target, shift_labels=None, beta=0.5, ignore_index=-100)`` returns
    a float32 scalar: the divergence summed over rows and divided by the number of counted
    rows. ``shift_labels`` (one integer per row, any shape with that many elements) marks the
    rows to ignore with ``ignore_index``.

    Argument order and meaning are those of the best-known implementation (student first,
    as every PyTorch loss takes its prediction first). Differences from it: the loss is
    float32 for every input dtype (it returns the input's dtype); a batch whose rows are all
    ignored gives 0 with zero gradients (it divides by zero); ``target`` gets its gradient
    when it requires grad (it gets none); any leading shape is accepted. Backward may run
    once per forward (it scales the stored gradients in place).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, target: torch.Tensor, shift_labels: torch.Tensor | None = None,
                beta: float = 0.5, ignore_index: int = -100):
        check_distribution_pair(input, target, "input", "target")
        check_devices([("input", input), ("target", target), ("shift_labels", shift_labels)])
        beta = check_beta(beta)
        ignore_index = check_ignore_index(ignore_index)
        x, y, labels = labelled_vocab_rows(input, target, shift_labels)
        compute_dx, compute_dy = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
        loss, dx, dy = run_launcher(jsd_forward, x, y, labels, beta, ignore_index, compute_dx, compute_dy)
        ctx.shapes = (input.shape, target.shape)
        ctx.save_for_backward(dx if compute_dx else None, dy if compute_dy else None)
        return loss

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        dx, dy = ctx.saved_tensors
        grads: list[torch.Tensor | None] = []
        for grad, shape in zip((dx, dy), ctx.shapes):
            if grad is None:
                grads.append(None)
            elif is_meta(grad):
                grads.append((grad * grad_loss).view(shape))
            else:
                grads.append(scale_gradient(grad, grad_loss).detach().view(shape))
        return _JSD_GRADS(input=grads[0], target=grads[1])


_JSD_GRADS = InputGradients(LigerJSDFunction.forward)
