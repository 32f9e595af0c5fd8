"""RMSNorm over the last dimension: one Triton pass forward, one persistent pass backward.

Shapes: ``X`` is (..., H) with any number of leading dimensions (N rows in total, any
strides), ``W`` is (H,). The output has X's shape; ``rstd`` (N,) fp32 is saved for the
backward pass instead of the normalised output.

Forward, per row x (statistics always in fp32, r = rstd)::

    r    = 1 / sqrt(mean(x^2) + eps)
    xhat = x * r
    y    = xhat * (w + offset)

``casting_mode`` picks where the rounding to low precision happens, so each mode matches
its Hugging Face reference:

* ``"llama"`` (``LlamaRMSNorm``): ``y = (w + offset) * round_x(xhat)``, i.e. normalise in
  fp32, round to the input dtype, then multiply by the weight; the output dtype is
  ``torch.promote_types(x.dtype, w.dtype)``, as for HF's ``self.weight * h.to(input_dtype)``.
* ``"gemma"`` (``GemmaRMSNorm``): ``y = round_x(xhat * (offset + float(w)))``, all in fp32,
  output in x's dtype. Gemma uses ``offset=1.0`` with zero-initialised weights.
* ``"none"``: computed in the input dtype, every step rounded to it as torch rounds
  ``x * rsqrt(x.pow(2).mean(-1) + eps) * w`` in that dtype (the squares, their mean, the sum
  with eps, the rsqrt, each product); only the sum of squares is accumulated in fp32, as
  torch's reduction does. Output in x's dtype.

Backward, with g = dy * (w + offset) (in fp32)::

    dx = r * (g - xhat * mean(g * xhat))
    dw = sum_rows(dy * xhat)

In ``"llama"`` and ``"none"`` modes the xhat in dw is the one the forward actually
multiplied by w (rounded to the input dtype), and g is rounded to the input dtype, which
is what autograd of the HF module does through its ``.to(input_dtype)``. dw is reduced
deterministically in fp32: each of P persistent programs sums its own rows into row p of
a (P, H) fp32 buffer, which is then summed in a fixed order.

``in_place=True`` (opt-in; default False) lets the backward write dx over dy's storage (no
new N x H buffer). It is the caller's promise that nobody else reads dy afterwards (see
``ops.grad_ownership.backward_writes_into_grad``): not a gradient the caller passes in
(``y.backward(g)``), not one a hook keeps, not one autograd also hands to another branch
(the output added straight to a residual stream). The patched models make that promise for
the norms inside decoder layers; the kernel still allocates dx where dy is not contiguous
or not of x's dtype.

Rows of all zeros give y = 0 and rstd = 1/sqrt(eps) (finite for eps > 0); empty inputs
give empty outputs and a zero dw.

Launch: the kernels are the row-normalisation kernels shared with LayerNorm
(``ops.row_norm.row_norm_forward_kernel`` / ``row_norm_backward_kernel``, ``CENTER=False``).
Forward: one program per tile of rows (narrow rows are packed several to a tile), one
read of X and W, one write of y and rstd. Backward: persistent programs, one read of dy,
X, W and rstd, one write of dx and of the (P, H) partial dW, which one more launch sums
over P (fixed order) into dW of W's dtype. Rows wider than ``RowNormConfig.max_fused_block``
are processed in column blocks (two passes over the row, the second mostly from L2) instead
of one register tile. Tile sizes, warps and programs per SM are the fields of
``ops.row_norm_geometry.RowNormConfig`` (override them with ``ops.config.override_launch_config``).

Meta tensors give meta outputs of the right shape and dtype (no kernel runs); under
``torch.compile`` the launchers are opaque custom ops with fake implementations.
"""

import math
from typing import Tuple

import torch

from liger_kernel.ops.autograd import InputGradients, strictly_once_differentiable
from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.checks import as_rows, check_in_place
from liger_kernel.ops.grad_ownership import backward_writes_into_grad
from liger_kernel.ops.launch import liger_custom_op
from liger_kernel.ops.row_norm import (
    ROW_NORM_CAST_FP32,
    ROW_NORM_CAST_LLAMA,
    ROW_NORM_CAST_NONE,
    check_row_norm_args,
    row_norm_backward,
    row_norm_forward_kernel,
)
from liger_kernel.ops.row_norm_geometry import row_norm_launch

CASTING_MODES = {
    "none": ROW_NORM_CAST_NONE,
    "llama": ROW_NORM_CAST_LLAMA,
    "gemma": ROW_NORM_CAST_FP32,
}


def _casting_code(casting_mode: str) -> int:
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {sorted(CASTING_MODES)}, got {casting_mode!r}")
    return CASTING_MODES[casting_mode]


def rms_norm_output_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, casting_mode: str) -> torch.dtype:
    """dtype of the RMSNorm output: promoted in llama mode (as HF), the input's otherwise."""
    if casting_mode == "llama":
        return torch.promote_types(x_dtype, w_dtype)
    return x_dtype


def check_rms_norm_args(X: object, W: object, eps: object, offset: object, casting_mode: object,
                        in_place: object) -> None:
    """Raise ``TypeError``/``ValueError`` naming the offending argument."""
    check_row_norm_args(X, W, None, eps)
    if not isinstance(offset, (int, float)) or isinstance(offset, bool):
        raise TypeError(f"offset must be a float, got {type(offset).__name__}")
    if not isinstance(casting_mode, str):
        raise TypeError(f"casting_mode must be a str, got {type(casting_mode).__name__}")
    _casting_code(casting_mode)
    check_in_place(in_place)


def _n_rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


@liger_custom_op("rms_norm_forward")
def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                     casting_mode: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Returns ``(y, rstd)``: y like x, rstd (N,) fp32."""
    casting = _casting_code(casting_mode)
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    # Allocated in x's shape (contiguous) and returned as is: the output is an ordinary
    # tensor, not a view of a private (N, H) buffer, so callers may edit it in place.
    y = torch.empty(x.shape, dtype=rms_norm_output_dtype(x.dtype, weight.dtype, casting_mode), device=x.device)
    y_rows = y.view(n_rows, n_cols)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0 and n_cols > 0:
        launch = row_norm_launch(n_rows, n_cols, x.device)
        launch_kernel(row_norm_forward_kernel, (launch.n_tiles,),
            rows, weight.contiguous(), rows, y_rows, rstd, rstd,  # no bias, no mean: unused pointers
            n_rows, n_cols, rows.stride(0), y_rows.stride(0),
            eps, offset,
            CENTER=False, HAS_BIAS=False, CASTING=casting, **launch.kernel_args(backward=False),
        )
    return y, rstd


@rms_norm_forward.register_fake
def _rms_norm_forward_fake(x, weight, eps, offset, casting_mode):
    out_dtype = rms_norm_output_dtype(x.dtype, weight.dtype, casting_mode)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((_n_rows(x),), dtype=torch.float32)


@liger_custom_op("rms_norm_backward", mutates_args=("grad_output",))
def rms_norm_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      offset: float, casting_mode: str, in_place: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel. Returns ``(grad_x, grad_weight)``.

    With ``in_place=True`` (caller guarantees grad_output is contiguous with x's dtype)
    grad_x is written into ``grad_output`` and the returned grad_x is an empty tensor
    (a custom op may not return an alias of its input); the caller uses grad_output.
    """
    casting = _casting_code(casting_mode)
    grad_x, grad_weight, _ = row_norm_backward(grad_output, x, weight, None, rstd, rstd, offset, False, casting,
                                               in_place)
    return grad_x, grad_weight


@rms_norm_backward.register_fake
def _rms_norm_backward_fake(grad_output, x, weight, rstd, offset, casting_mode, in_place):
    grad_x = x.new_empty((0,)) if in_place else x.new_empty(x.shape)
    return grad_x, torch.empty_like(weight)


class LigerRMSNormFunction(torch.autograd.Function):
    """``y = RMSNorm(X) * (W + offset)`` over the last dim; see the module docstring.

    ``apply(X, W, eps, offset=0.0, casting_mode="llama", in_place=False)`` with X (..., H)
    and W (H,); returns y with X's shape. Gradients flow to X and W. ``in_place=True``: the
    backward may write dx over the incoming gradient (the module docstring says when).
    """

    @staticmethod
    def forward(ctx, X: torch.Tensor, W: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
                casting_mode: str = "llama", in_place: bool = False) -> torch.Tensor:
        check_rms_norm_args(X, W, eps, offset, casting_mode, in_place)
        y, rstd = rms_norm_forward(X, W, float(eps), float(offset), casting_mode)
        ctx.save_for_backward(X, W, rstd)
        ctx.offset = float(offset)
        ctx.casting_mode = casting_mode
        ctx.in_place = in_place
        return y

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        X, W, rstd = ctx.saved_tensors
        write_into_grad = backward_writes_into_grad(ctx.in_place, grad_output, X)
        grad_x, grad_w = rms_norm_backward(grad_output, X, W, rstd, ctx.offset, ctx.casting_mode,
                                           write_into_grad)
        if write_into_grad:
            grad_x = grad_output
        return _RMS_NORM_GRADS(X=grad_x, W=grad_w)


_RMS_NORM_GRADS = InputGradients(LigerRMSNormFunction.forward)
