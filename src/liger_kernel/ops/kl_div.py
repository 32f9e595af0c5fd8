"""Kullback-Leibler divergence loss, as ``torch.nn.functional.kl_div``: input ``x`` in log space.

Per element, for a target ``t`` given as probabilities (``log_target=False``) or log-probabilities
(``log_target=True``)::

    log_target=False:  l = t log(max(t, eps)) - t x     (0 where t = 0; NaN where t < 0, as torch)
    log_target=True:   l = exp(t) (t - x)

Reductions (as torch): ``"none"`` the elements (input's shape), ``"sum"`` their sum, ``"mean"``
their sum over the number of elements, ``"batchmean"`` their sum over ``input.shape[0]``. With
``eps = 0`` (or any ``eps`` below every positive target) the loss is torch's exactly; the
default ``eps = 1e-10`` (the best-known implementation's) only changes targets below it.

Gradients, for upstream gradient ``g`` (per element for ``"none"``, else the scalar times the
reduction's ``1 / D``)::

    dl/dx = -g t                              (log_target: -g exp(t))
    dl/dt = g (log(max(t, eps)) + 1 - x)      (log_target: g exp(t) (t - x + 1)); 0 where t = 0

(torch gives NaN for dl/dt at t = 0). The gradient needs only the target (and the input for
the target's gradient), so it is computed in the backward pass: the forward keeps nothing but
references to the inputs and allocates only its (O(N)) row sums, or the elements for
``"none"``; backward writes fresh gradient buffers (the inputs are never overwritten).
"""

import torch
import triton
import triton.language as tl

from liger_kernel.ops.autograd import InputGradients, strictly_once_differentiable
from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.config import launch_config
from liger_kernel.ops.launch import is_interpreter, liger_custom_op
from liger_kernel.ops.numerics import round_to_dtype
from liger_kernel.ops.vocab_rows import (
    VocabRowConfig,
    as_vocab_rows,
    check_devices,
    check_distribution_pair,
    gradient_buffer,
    loss_output,
    run_launcher,
)

KL_REDUCTIONS = ("none", "sum", "mean", "batchmean")


class KLDivConfig(VocabRowConfig):
    """Launch configuration of the KL-divergence kernels."""


@triton.jit
def _kl_element(x, t, eps, LOG_TARGET: tl.constexpr):
    if LOG_TARGET:
        return tl.exp(t) * (t - x)
    else:
        entropy_term = tl.where(t > 0.0, t * tl.log(tl.maximum(t, eps)), tl.where(t == 0.0, 0.0, float("nan")))
        return entropy_term - t * x


@triton.jit
def _kl_div_forward_kernel(x_ptr, x_stride, t_ptr, t_stride, out_ptr, out_stride, n_cols, eps,
                           LOG_TARGET: tl.constexpr, ELEMENTWISE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           ROUND_BY_HAND: tl.constexpr):
    """One program per row: the elements (``ELEMENTWISE``, into an (N, V) output) or their
    float32 row sum (into ``out_ptr[row]``)."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_SIZE)
    acc = tl.zeros([BLOCK_SIZE], tl.float32)
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(t_ptr + row * t_stride + cols, mask=mask, other=0.0).to(tl.float32)
        element = _kl_element(x, t, eps, LOG_TARGET)
        if ELEMENTWISE:
            element = round_to_dtype(element, out_ptr.dtype.element_ty, ROUND_BY_HAND)
            tl.store(out_ptr + row * out_stride + cols, element.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            acc += tl.where(mask, element, 0.0)
    if not ELEMENTWISE:
        tl.store(out_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def _kl_div_backward_kernel(x_ptr, x_stride, t_ptr, t_stride, g_ptr, g_stride, dx_ptr, dt_ptr, n_cols, eps,
                            grad_scale, LOG_TARGET: tl.constexpr, GRAD_PER_ELEMENT: tl.constexpr,
                            COMPUTE_DX: tl.constexpr, COMPUTE_DT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            ROUND_BY_HAND: tl.constexpr):
    """One program per row: dl/dx and dl/dt into contiguous (N, V) buffers."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_SIZE)
    if not GRAD_PER_ELEMENT:
        g = tl.load(g_ptr).to(tl.float32) * grad_scale
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < n_cols
        if GRAD_PER_ELEMENT:
            g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32) * grad_scale
        t = tl.load(t_ptr + row * t_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG_TARGET:
            p = tl.exp(t)
        else:
            p = t
        if COMPUTE_DX:
            dx = round_to_dtype(-g * p, dx_ptr.dtype.element_ty, ROUND_BY_HAND)
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DT:
            x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
            if LOG_TARGET:
                dt = g * p * (t - x + 1.0)
            else:
                dt = tl.where(t == 0.0, 0.0, g * (tl.log(tl.maximum(t, eps)) + 1.0 - x))
            dt = round_to_dtype(dt, dt_ptr.dtype.element_ty, ROUND_BY_HAND)
            tl.store(dt_ptr + row * n_cols + cols, dt.to(dt_ptr.dtype.element_ty), mask=mask)


@liger_custom_op("kl_div_forward")
def kl_div_forward(input: torch.Tensor, target: torch.Tensor, elementwise: bool, log_target: bool,
                   eps: float) -> torch.Tensor:
    """Launcher: the (N, V) elements in the input's dtype (``elementwise``) or the float32 (N,)
    row sums, for (N, V) rows with unit column stride. Arguments are trusted."""
    n_rows, n_cols = input.shape
    out = loss_output(input, elementwise)
    if n_rows:
        config = launch_config(KLDivConfig, n_cols)
        launch_kernel(_kl_div_forward_kernel, (n_rows,), input, input.stride(0), target, target.stride(0), out,
                      out.stride(0), n_cols, float(eps), LOG_TARGET=log_target, ELEMENTWISE=elementwise,
                      BLOCK_SIZE=config.block_size, ROUND_BY_HAND=is_interpreter(), num_warps=config.num_warps)
    return out


@kl_div_forward.register_fake
def _kl_div_forward_fake(input, target, elementwise, log_target, eps):
    return loss_output(input, elementwise)


@liger_custom_op("kl_div_backward")
def kl_div_backward(input: torch.Tensor, target: torch.Tensor, grad_output: torch.Tensor, grad_scale: float,
                    log_target: bool, eps: float, compute_input_grad: bool, compute_target_grad: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: ``(dl/dinput, dl/dtarget)``, each a fresh contiguous (N, V) tensor of its
    input's dtype or an empty placeholder. ``grad_output`` is one element (the reduced loss's
    gradient, multiplied by ``grad_scale``) or (N, V) rows (``"none"``)."""
    n_rows, n_cols = input.shape
    dx = gradient_buffer(input, compute_input_grad)
    dt = gradient_buffer(target, compute_target_grad)
    if n_rows:
        config = launch_config(KLDivConfig, n_cols)
        per_element = grad_output.numel() != 1
        launch_kernel(_kl_div_backward_kernel, (n_rows,), input, input.stride(0), target, target.stride(0),
                      grad_output, grad_output.stride(0) if per_element else 0, dx if compute_input_grad else input,
                      dt if compute_target_grad else target, n_cols, float(eps), float(grad_scale),
                      LOG_TARGET=log_target, GRAD_PER_ELEMENT=per_element, COMPUTE_DX=compute_input_grad,
                      COMPUTE_DT=compute_target_grad, BLOCK_SIZE=config.block_size,
                      ROUND_BY_HAND=is_interpreter(), num_warps=config.num_warps)
    return dx, dt


@kl_div_backward.register_fake
def _kl_div_backward_fake(input, target, grad_output, grad_scale, log_target, eps, compute_input_grad,
                          compute_target_grad):
    return gradient_buffer(input, compute_input_grad), gradient_buffer(target, compute_target_grad)


def _reduction_denominator(shape: torch.Size, reduction: str) -> float:
    if reduction == "mean":
        return float(max(shape.numel(), 1))
    if reduction == "batchmean":
        return float(max(shape[0], 1)) if len(shape) else 1.0
    return 1.0


class LigerKLDivLossFunction(torch.autograd.Function):
    """``torch.nn.functional.kl_div(input, target, reduction=..., log_target=...)`` (any shape).

    ``forward(ctx, input, target, reduction="batchmean", log_target=False, eps=1e-10)``; see the
    module docstring for the math. Differences from torch: a reduced loss is float32 for every
    input dtype (torch: the input's dtype); ``"none"`` keeps the input's dtype as torch; the
    target's gradient at ``t = 0`` is 0 (torch: NaN); ``eps`` as documented above.
    Differences from the best-known implementation: targets at 0 or negative follow torch
    (it clamps them at ``eps``); the target gets its gradient when it requires grad (it gets
    none); ``"sum"`` and the batch size of ``"batchmean"`` follow torch for inputs of any rank.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, target: torch.Tensor, reduction: str = "batchmean",
                log_target: bool = False, eps: float = 1e-10):
        check_distribution_pair(input, target, "input", "target")
        check_devices([("input", input), ("target", target)])
        if reduction not in KL_REDUCTIONS:
            raise ValueError(f"reduction must be one of {KL_REDUCTIONS}, got {reduction!r}")
        if not float(eps) >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        x = as_vocab_rows(input)
        t = as_vocab_rows(target)
        elementwise = reduction == "none"
        out = run_launcher(kl_div_forward, x, t, elementwise, bool(log_target), float(eps))
        ctx.save_for_backward(input, target)
        ctx.options = (reduction, bool(log_target), float(eps))
        if elementwise:
            return out.view(input.shape)
        return out.sum() / _reduction_denominator(input.shape, reduction)

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        input, target = ctx.saved_tensors
        reduction, log_target, eps = ctx.options
        compute_dx, compute_dt = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
        if not (compute_dx or compute_dt):
            return _KL_DIV_GRADS()
        x = as_vocab_rows(input)
        t = as_vocab_rows(target)
        if reduction == "none":
            grad = as_vocab_rows(grad_output.expand(input.shape))
        else:
            grad = grad_output.reshape(1)
        dx, dt = run_launcher(kl_div_backward, x, t, grad, 1.0 / _reduction_denominator(input.shape, reduction),
                              log_target, eps, compute_dx, compute_dt)
        return _KL_DIV_GRADS(input=dx.view(input.shape) if compute_dx else None,
                             target=dt.view(target.shape) if compute_dt else None)


_KL_DIV_GRADS = InputGradients(LigerKLDivLossFunction.forward)
