"""LayerNorm over the last dimension, matching ``torch.nn.functional.layer_norm``.

Shapes: ``X`` is (..., H) with any number of leading dimensions (N rows, any strides),
``W`` and ``B`` are (H,) (``B`` may be None). The output has X's shape and dtype; the
per-row ``mean`` and ``rstd`` (N,) fp32 are saved for backward. All arithmetic is in
fp32; the output is rounded once to X's dtype.

Forward, per row x of length H::

    mu   = mean(x)
    r    = 1 / sqrt(mean((x - mu)^2) + eps)        (biased variance, as torch)
    xhat = (x - mu) * r
    y    = xhat * w + b

The statistics are taken about the row's first element s (d = x - s, mu = s + mean(d),
x - mu = d - mean(d)): the same in exact arithmetic, and exact in fp32 for a constant row,
whose d are all 0, so y == b exactly and xhat == 0 in the backward, as torch gives (the fp32
mean of n copies of c is not c, and rstd = 1/sqrt(eps) would amplify its error). Rows that
fit one register tile compute mean(d) and then the centred variance from registers
(two-pass, no cancellation); wider rows (> ``RowNormConfig.max_fused_block``) merge
per-column-block (mean, M2) pairs of d with Chan's update, then normalise in a second pass.

Backward, with g = dy * w::

    dx = r * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum_rows(dy * xhat)
    db = sum_rows(dy)

dw and db are reduced deterministically in fp32: each of P persistent programs sums its
own rows into row p of a (P, H) buffer, then one more launch sums the P rows of both
buffers in a fixed order and rounds them to the parameters' dtypes.

``in_place=True`` (opt-in, as for RMSNorm; default False) lets the backward write dx over
dy's storage when dy is contiguous with x's dtype, so the backward allocates no N x H buffer
(only the small (P, H) partials). It is the caller's promise that nobody else reads dy
afterwards: not a gradient passed in by the caller (``y.backward(g)``) or kept by a hook, not
one autograd also hands to another input (``LayerNorm(x) + r`` with ``r`` requiring grad).

The kernels are the row-normalisation kernels shared with RMSNorm
(``ops.row_norm.row_norm_forward_kernel`` / ``row_norm_backward_kernel``) with ``CENTER=True``:
one pass forward (read X, W, B; write y, mean, rstd), one persistent pass backward (read
dy, X, W, mean, rstd; write dx and the partial dW/dB); launch tunables are the
fields of ``ops.row_norm_geometry.RowNormConfig`` (override them with
``ops.config.override_launch_config``). Constant rows give xhat = 0, y = b and finite
gradients (rstd = 1/sqrt(eps)); empty inputs give empty outputs and zero dw/db. Meta
tensors give meta outputs of the right shape and dtype (no kernel runs).
"""

import math
from typing import Optional, Tuple  # Optional, not "X | None", in custom-op schemas for older torch

import torch

from liger_kernel.ops.autograd import InputGradients, strictly_once_differentiable
from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.checks import as_rows, check_in_place
from liger_kernel.ops.grad_ownership import backward_writes_into_grad
from liger_kernel.ops.launch import liger_custom_op
from liger_kernel.ops.row_norm import (
    ROW_NORM_CAST_FP32,
    check_row_norm_args,
    row_norm_backward,
    row_norm_forward_kernel,
)
from liger_kernel.ops.row_norm_geometry import row_norm_launch


def check_layer_norm_args(X: object, W: object, B: object, eps: object) -> None:
    """Raise ``TypeError``/``ValueError`` naming the offending argument."""
    check_row_norm_args(X, W, B, eps)


def _launch_args(launch, backward: bool) -> dict:
    return dict(CENTER=True, CASTING=ROW_NORM_CAST_FP32, **launch.kernel_args(backward))


@liger_custom_op("layer_norm_forward")
def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
                       eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Returns ``(y, mean, rstd)``: y like x, mean/rstd (N,) fp32."""
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    # Allocated in x's shape (contiguous) and returned as is: an ordinary tensor, not a view
    # of a private (N, H) buffer, so callers may edit it in place.
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_rows = y.view(n_rows, n_cols)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0 and n_cols > 0:
        launch = row_norm_launch(n_rows, n_cols, x.device, center=True)
        w = weight.contiguous()
        launch_kernel(row_norm_forward_kernel, (launch.n_tiles,),
            rows, w, bias.contiguous() if bias is not None else w, y_rows, mean, rstd,
            n_rows, n_cols, rows.stride(0), y_rows.stride(0),
            eps, 0.0,
            HAS_BIAS=bias is not None, **_launch_args(launch, backward=False),
        )
    return y, mean, rstd


@layer_norm_forward.register_fake
def _layer_norm_forward_fake(x, weight, bias, eps):
    n_rows = math.prod(x.shape[:-1])
    stats = x.new_empty((n_rows,), dtype=torch.float32)
    return x.new_empty(x.shape), stats, torch.empty_like(stats)


@liger_custom_op("layer_norm_backward", mutates_args=("grad_output",))
def layer_norm_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor], mean: torch.Tensor,  # noqa: UP045
                        rstd: torch.Tensor, in_place: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernel. Returns ``(grad_x, grad_weight, grad_bias)``.

    ``grad_bias`` is like ``bias``, or an empty tensor when there is no bias (only its
    shape and dtype are read). With ``in_place=True`` (caller guarantees grad_output is
    contiguous with x's dtype) grad_x is written into ``grad_output`` and the returned
    grad_x is an empty tensor (a custom op may not return an alias of its input).
    """
    grad_x, grad_weight, grad_bias = row_norm_backward(grad_output, x, weight, bias, mean, rstd, 0.0, True,
                                                       ROW_NORM_CAST_FP32, in_place)
    if grad_bias is None:
        grad_bias = weight.new_empty((0,))
    return grad_x, grad_weight, grad_bias


@layer_norm_backward.register_fake
def _layer_norm_backward_fake(grad_output, x, weight, bias, mean, rstd, in_place):
    grad_bias = torch.empty_like(bias) if bias is not None else weight.new_empty((0,))
    grad_x = x.new_empty((0,)) if in_place else x.new_empty(x.shape)
    return grad_x, torch.empty_like(weight), grad_bias


class LigerLayerNormFunction(torch.autograd.Function):
    """``y = LayerNorm(X) * W + B`` over the last dim, as ``F.layer_norm``.

    ``apply(X, W, B, eps, in_place=False)`` with X (..., H), W (H,), B (H,) or None; returns
    y with X's shape and dtype. Gradients flow to X, W and B. ``in_place``: see the module
    docstring (dx written over dy's storage).
    """

    @staticmethod
    def forward(ctx, X: torch.Tensor, W: torch.Tensor, B: torch.Tensor | None,
                eps: float = 1e-6, in_place: bool = False) -> torch.Tensor:
        check_layer_norm_args(X, W, B, eps)
        check_in_place(in_place)
        y, mean, rstd = layer_norm_forward(X, W, B, float(eps))
        ctx.save_for_backward(X, W, B, mean, rstd)
        ctx.in_place = in_place
        return y

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        X, W, B, mean, rstd = ctx.saved_tensors
        write_into_grad = backward_writes_into_grad(ctx.in_place, grad_output, X)
        grad_x, grad_w, grad_b = layer_norm_backward(grad_output, X, W, B, mean, rstd, write_into_grad)
        if write_into_grad:
            grad_x = grad_output
        return _LAYER_NORM_GRADS(X=grad_x, W=grad_w, B=grad_b if B is not None else None)


_LAYER_NORM_GRADS = InputGradients(LigerLayerNormFunction.forward)
