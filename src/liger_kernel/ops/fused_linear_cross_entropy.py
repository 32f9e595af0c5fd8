"""Cross entropy of a linear layer's output without materialising the (N, V) logits.

For hidden states ``X`` (N, D), an output projection ``W`` (V, D) with optional bias
``b`` (V,), and class-index targets ``y`` (N,), the loss is the cross entropy of the
logits ``Z = X W^T + b``, with every option of :mod:`liger_kernel.ops.cross_entropy`
(class weights, ``ignore_index``, label smoothing, z-loss, soft-capping, reductions), and
the same per-row loss and logit gradient ``G = dL/dZ`` defined there. By the chain rule::

    dL/dX = G W          (N, D)
    dL/dW = G^T X        (V, D)
    dL/db = sum_i G_i    (V,)

Rows are processed in chunks of ``C`` rows so that only one (C, V) logits buffer exists:
per chunk, ``Z_c = X_c W^T (+ b)`` (cuBLAS, written into the reused buffer), the
cross-entropy kernel overwrites ``Z_c`` with ``G_c`` in place, then ``dX_c = G_c W`` is
written into its rows of dX and ``dW += G_c^T X_c`` is accumulated in place (``addmm_``,
``beta = 1``; the first chunk writes dW outright) into a preallocated dW, so no temporary
of dW's size appears. ``C`` comes from the memory budget every head-bound loss shares
(:class:`~liger_kernel.ops.head_chunking.HeadChunkConfig`): each chunk re-reads and
re-writes dW, so time falls as ``C`` grows and memory rises. The mean's
denominators are computed once for the whole batch on the device, so the chunk loop never
syncs with the host; the target range check (which must sync to raise) is awaited only after
the loop is queued.

For ``"mean"``/``"sum"`` these gradients are computed in the forward pass and backward
only multiplies them by the (scalar) upstream gradient. For ``"none"`` the upstream
gradient ``g`` (N,) is only known in backward and dW depends on it non-separably
(``dW = sum_i g_i G_i^T X_i``), so the forward computes only the losses and backward
recomputes each chunk's logits with ``G_i`` scaled by ``g_i`` inside the kernel.

The loss is float32 whatever the input dtype: this loss replaces HF's causal-LM loss, which
upcasts the logits to float32 before its cross entropy, so its loss is float32 too.

Memory beyond the gradients themselves: the (C, V) chunk buffer plus O(N + V).
"""

import torch

from liger_kernel.ops.autograd import InputGradients, strictly_once_differentiable
from liger_kernel.ops.checks import check_linear_operands, check_same_device
from liger_kernel.ops.cross_entropy import launch_cross_entropy_kernel
from liger_kernel.ops.head_chunking import (
    accumulate_grad_weight,
    chunk_rows_for,
    gemm_reduction_precision,
    grad_input_rows,
    gradient_bytes,
)
from liger_kernel.ops.launch import is_meta, liger_custom_op
from liger_kernel.ops.loss_checks import check_class_weight, start_target_check
from liger_kernel.ops.loss_options import CrossEntropyOptions
from liger_kernel.ops.loss_reduction import mean_denominators, reduce_rows
from liger_kernel.ops.scaling import scale_gradient


def _chunked_loss_and_grads(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
                            class_weight: torch.Tensor | None, row_scale: torch.Tensor | None, ignore_index: int,
                            label_smoothing: float, lse_square_scale: float, softcap: float, mean_reduction: bool,
                            compute_accuracy: bool, grad_input_needed: bool, grad_weight_needed: bool,
                            grad_bias_needed: bool, accum_fp32: bool, floor_bytes: int):
    """The chunk loop. Returns per-row (loss, z_loss, correct), the mean's count, and the grads.

    Gradients not asked for are returned as empty tensors. With ``row_scale`` (N,) each
    row's logit gradient is multiplied by it (the ``"none"`` backward). ``floor_bytes``, the
    bytes of the gradients the whole call produces, sizes the chunks (the same in the
    ``"none"`` forward, which computes none, and its backward: same chunks, same logits).
    """
    n_rows, hidden = x.shape
    n_cols = weight.shape[0]
    device = x.device
    loss_rows = torch.empty(n_rows, device=device, dtype=torch.float32)
    z_rows = torch.empty_like(loss_rows)
    correct_rows = torch.empty_like(loss_rows)
    ce_denominator, z_denominator, n_counted = mean_denominators(target, class_weight, ignore_index, n_cols)

    # Placeholders for gradients not needed are distinct tensors: custom-op outputs must not alias.
    grad_input = torch.empty_like(x) if grad_input_needed else x.new_empty((0,))
    weight_accum_dtype = torch.float32 if accum_fp32 else weight.dtype
    if not grad_weight_needed:
        grad_weight = x.new_empty((0,))
    elif weight_accum_dtype == weight.dtype and n_rows > 0:
        grad_weight = torch.empty(weight.shape, device=device, dtype=weight_accum_dtype)  # first chunk writes it
    else:
        grad_weight = torch.zeros(weight.shape, device=device, dtype=weight_accum_dtype)
    grad_bias = (
        torch.zeros(n_cols, device=device, dtype=torch.float32) if grad_bias_needed else x.new_empty((0,))
    )
    compute_grad = grad_input_needed or grad_weight_needed or grad_bias_needed

    if n_rows > 0:
        with gemm_reduction_precision():
            chunk_rows = chunk_rows_for(n_rows, n_cols, x.element_size(), floor_bytes)
            chunk_buffer = torch.empty((chunk_rows, n_cols), device=device, dtype=x.dtype)
            weight_t = weight.t()
            for start in range(0, n_rows, chunk_rows):
                stop = min(start + chunk_rows, n_rows)
                x_chunk = x[start:stop]
                logits = chunk_buffer[: stop - start]
                if bias is None:
                    torch.matmul(x_chunk, weight_t, out=logits)
                else:
                    torch.addmm(bias, x_chunk, weight_t, out=logits)
                launch_cross_entropy_kernel(
                    logits,
                    logits,
                    target[start:stop],
                    class_weight,
                    None if row_scale is None else row_scale[start:stop],
                    loss_rows[start:stop],
                    z_rows[start:stop],
                    correct_rows[start:stop],
                    ce_denominator,
                    z_denominator,
                    ignore_index,
                    label_smoothing,
                    lse_square_scale,
                    softcap,
                    mean_reduction,
                    compute_grad,
                    compute_accuracy,
                )
                if grad_input_needed:
                    grad_input_rows(logits, weight, out=grad_input[start:stop])
                if grad_weight_needed:
                    accumulate_grad_weight(grad_weight, logits, x_chunk, first=start == 0)
                if grad_bias_needed:
                    grad_bias.add_(logits.sum(dim=0, dtype=torch.float32))
            del chunk_buffer
    if grad_weight_needed and grad_weight.dtype != weight.dtype:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias_needed and bias is not None:  # callers ask for grad_bias only with a bias
        grad_bias = grad_bias.to(bias.dtype)
    return loss_rows, z_rows, correct_rows, n_counted, grad_input, grad_weight, grad_bias


@liger_custom_op("fused_linear_cross_entropy_forward")
def fused_linear_cross_entropy_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    compute_accuracy: bool,
    grad_input_needed: bool,
    grad_weight_needed: bool,
    grad_bias_needed: bool,
    accum_fp32: bool,
    floor_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher: (loss, z_loss, token_accuracy, dX, dW, dB) for unit upstream gradient.

    ``x`` (N, D) contiguous, ``weight`` (V, D), ``bias`` (V,) or None, ``target`` (N,).
    Losses are float32, reduced per ``reduction``; gradients not needed are empty tensors
    (callers pass all grad flags False for ``"none"``, whose gradients come from
    :func:`fused_linear_cross_entropy_backward`). Arguments are trusted.
    """
    with torch.autocast(device_type=x.device.type, enabled=False):
        loss_rows, z_rows, correct_rows, n_counted, grad_input, grad_weight, grad_bias = (
            _chunked_loss_and_grads(x, weight, target, bias, class_weight, None, ignore_index, label_smoothing,
                                    lse_square_scale, softcap, reduction == "mean", compute_accuracy,
                                    grad_input_needed, grad_weight_needed, grad_bias_needed, accum_fp32,
                                    floor_bytes)
        )
    return (
        *reduce_rows(loss_rows, z_rows, correct_rows, n_counted, reduction),
        grad_input,
        grad_weight,
        grad_bias,
    )


def _fake_grads(x, weight, bias, grad_input_needed, grad_weight_needed, grad_bias_needed):
    return (
        torch.empty_like(x) if grad_input_needed else x.new_empty((0,)),
        weight.new_empty(weight.shape) if grad_weight_needed else x.new_empty((0,)),
        bias.new_empty(bias.shape) if grad_bias_needed else x.new_empty((0,)),
    )


@fused_linear_cross_entropy_forward.register_fake
def _fused_linear_cross_entropy_forward_fake(x, weight, target, bias, class_weight, ignore_index, label_smoothing,
                                             lse_square_scale, softcap, reduction, compute_accuracy,
                                             grad_input_needed, grad_weight_needed, grad_bias_needed, accum_fp32,
                                             floor_bytes):
    shape = (x.shape[0],) if reduction == "none" else ()
    losses = [x.new_empty(shape, dtype=torch.float32) for _ in range(3)]
    return (*losses, *_fake_grads(x, weight, bias, grad_input_needed, grad_weight_needed, grad_bias_needed))


@liger_custom_op("fused_linear_cross_entropy_backward")
def fused_linear_cross_entropy_backward(grad_rows: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                        target: torch.Tensor, bias: torch.Tensor | None,
                                        class_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float,
                                        lse_square_scale: float, softcap: float, grad_input_needed: bool,
                                        grad_weight_needed: bool, grad_bias_needed: bool, accum_fp32: bool,
                                        floor_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher for the ``"none"`` backward: (dX, dW, dB) for per-row upstream gradient ``grad_rows`` (N,).

    Recomputes each chunk's logits; the kernel scales row ``i`` of the logit gradient by
    ``grad_rows[i]`` before the two matmuls.
    """
    grad_rows = grad_rows.to(torch.float32).contiguous()
    with torch.autocast(device_type=x.device.type, enabled=False):
        *_, grad_input, grad_weight, grad_bias = _chunked_loss_and_grads(
            x, weight, target, bias, class_weight, grad_rows, ignore_index, label_smoothing, lse_square_scale,
            softcap, False, False, grad_input_needed, grad_weight_needed, grad_bias_needed, accum_fp32, floor_bytes)
    return grad_input, grad_weight, grad_bias


@fused_linear_cross_entropy_backward.register_fake
def _fused_linear_cross_entropy_backward_fake(grad_rows, x, weight, target, bias, class_weight, ignore_index,
                                              label_smoothing, lse_square_scale, softcap, grad_input_needed,
                                              grad_weight_needed, grad_bias_needed, accum_fp32, floor_bytes):
    return _fake_grads(x, weight, bias, grad_input_needed, grad_weight_needed, grad_bias_needed)


def _check_linear_args(x, weight, bias, accum_dtype) -> None:
    # The devices are checked with the target's and ce_weight's (check_same_device).
    check_linear_operands(x, weight, bias, same_device=False, autocast_casts=True)
    if accum_dtype is not None and accum_dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"accum_dtype must be None, torch.float32 or the weight dtype, got {accum_dtype}")


def _fused_linear_cross_entropy(ctx, _input, weight, target, bias, ce_weight, options: CrossEntropyOptions,
                                accum_dtype):
    """The forward of both autograd Functions."""
    _check_linear_args(_input, weight, bias, accum_dtype)
    n_rows, n_cols = _input.shape[0], weight.shape[0]
    meta = is_meta(_input, weight, target, bias, ce_weight)
    if not meta:
        check_same_device([("input", _input), ("weight", weight), ("target", target), ("bias", bias),
                           ("ce_weight", ce_weight)])
    ce_weight = check_class_weight(ce_weight, n_cols, "ce_weight")
    # The range check's verdict is awaited only after the chunk loop is queued: waiting
    # first would drain the GPU's queue (a bad target never addresses memory; the
    # results computed with one are discarded by the raise).
    target_check = start_target_check(target, n_rows, n_cols, options.ignore_index)
    x = _input.contiguous()
    accum_fp32 = accum_dtype == torch.float32 and weight.dtype != torch.float32
    # needs_input_grad covers only the arguments given to apply (bias may be omitted).
    needs_input, needs_weight, _, needs_bias = (tuple(ctx.needs_input_grad) + (False,) * 4)[:4]
    needs_bias = bool(needs_bias) and bias is not None
    kernel_options = options.kernel_options
    in_forward = options.reduction != "none"
    floor_bytes = gradient_bytes(x, weight, bool(needs_input), bool(needs_weight))
    forward = _fused_linear_cross_entropy_forward_fake if meta else fused_linear_cross_entropy_forward
    loss, z_loss, accuracy, grad_input, grad_weight, grad_bias = forward(
        x, weight, target, bias, ce_weight, *kernel_options, options.reduction, options.return_token_accuracy,
        bool(needs_input) and in_forward, bool(needs_weight) and in_forward, needs_bias and in_forward, accum_fp32,
        floor_bytes,
    )
    target_check.wait()
    ctx.reduction = options.reduction
    ctx.needs = (bool(needs_input), bool(needs_weight), needs_bias)
    if in_forward:
        ctx.save_for_backward(grad_input, grad_weight, grad_bias)
    else:
        ctx.options = kernel_options
        ctx.accum_fp32 = accum_fp32
        ctx.floor_bytes = floor_bytes
        ctx.save_for_backward(x, weight, target, bias, ce_weight)
    ctx.mark_non_differentiable(z_loss, accuracy)
    return loss, z_loss, accuracy


class LigerFusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Cross entropy of ``input @ weight.T + bias`` against ``target``, chunked over rows.

    ``forward(ctx, input (N, D), weight (V, D), target (N,), bias=None, ce_weight=None,
    ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
    softcap=None, return_token_accuracy=False, accum_dtype=None)`` returns
    ``(loss, z_loss, token_accuracy)`` as :class:`~liger_kernel.ops.cross_entropy.LigerCrossEntropyFunction`
    does, but float32 for every input dtype (see the module docstring); only ``loss`` is
    differentiable. Gradients flow to ``input``, ``weight`` and ``bias``, each skipped when
    it does not require grad (e.g. a frozen ``weight``). ``accum_dtype=torch.float32``
    accumulates dW over chunks in float32 (then casts to the weight dtype; dX rows are single
    GEMMs with float32 accumulation either way). Meta tensors give meta outputs. Backward
    may run only once per forward.
    """

    @staticmethod
    def forward(ctx, _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, ce_weight: torch.Tensor | None = None, ignore_index: int = -100,
                lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
                softcap: float | None = None, return_token_accuracy: bool = False,
                accum_dtype: torch.dtype | None = None):
        options = CrossEntropyOptions(ignore_index=ignore_index, label_smoothing=label_smoothing,
                                      lse_square_scale=lse_square_scale, softcap=softcap, reduction=reduction,
                                      return_token_accuracy=return_token_accuracy)
        return _fused_linear_cross_entropy(ctx, _input, weight, target, bias, ce_weight, options, accum_dtype)

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_loss, grad_z_loss=None, grad_accuracy=None):
        grad_input, grad_weight, grad_bias = _input_grads(ctx, grad_loss)
        return _GRADS(_input=grad_input, weight=grad_weight, bias=grad_bias)


def _input_grads(ctx, grad_loss):
    """(dX, dW, dB) for the loss's upstream gradient, None where not needed: the forward's
    gradients scaled, or (``"none"``) recomputed chunk by chunk with the per-row upstream."""
    needs_input, needs_weight, needs_bias = ctx.needs
    if ctx.reduction != "none":
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        if needs_input:
            grad_input = scale_gradient(grad_input, grad_loss)
        if needs_weight:
            grad_weight = scale_gradient(grad_weight, grad_loss)
        if needs_bias:
            grad_bias = scale_gradient(grad_bias, grad_loss)
    else:
        x, weight, target, bias, ce_weight = ctx.saved_tensors
        backward = (_fused_linear_cross_entropy_backward_fake if is_meta(x)
                    else fused_linear_cross_entropy_backward)
        grad_input, grad_weight, grad_bias = backward(
            grad_loss, x, weight, target, bias, ce_weight, *ctx.options, needs_input, needs_weight, needs_bias,
            ctx.accum_fp32, ctx.floor_bytes,
        )
    return (grad_input if needs_input else None, grad_weight if needs_weight else None,
            grad_bias if needs_bias else None)


_GRADS = InputGradients(LigerFusedLinearCrossEntropyFunction.forward)


class FusedLinearCrossEntropyFunctionFromOptions(torch.autograd.Function):
    """:class:`LigerFusedLinearCrossEntropyFunction` taking validated options instead of
    keywords: ``apply(input, weight, target, bias, ce_weight, options, accum_dtype)``."""

    @staticmethod
    def forward(ctx, _input, weight, target, bias, ce_weight, options, accum_dtype):
        return _fused_linear_cross_entropy(ctx, _input, weight, target, bias, ce_weight, options, accum_dtype)

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_loss, grad_z_loss=None, grad_accuracy=None):
        grad_input, grad_weight, grad_bias = _input_grads(ctx, grad_loss)
        return _FROM_OPTIONS_GRADS(_input=grad_input, weight=grad_weight, bias=grad_bias)


_FROM_OPTIONS_GRADS = InputGradients(FusedLinearCrossEntropyFunctionFromOptions.forward)
