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
of dW's size appears. ``C`` is what fits the larger of ``chunk_budget_bytes`` and
``chunk_floor_fraction`` of the dW + dX bytes (:class:`FusedLinearCrossEntropyConfig`): each
chunk re-reads and re-writes dW, so time falls as ``C`` grows and memory rises. The mean's
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

The pieces (:func:`chunk_rows_for`, :func:`accumulate_grad_weight`,
:func:`~liger_kernel.ops.scaling.scale_gradient`) are shared by other chunked losses.
"""

import contextlib
import dataclasses
import functools

import torch

from liger_kernel.ops.autograd import once_differentiable
from liger_kernel.ops.checks import check_float_dtype, check_same_device, check_tensor
from liger_kernel.ops.config import FixedLaunchConfig, launch_config
from liger_kernel.ops.cross_entropy import launch_cross_entropy_kernel
from liger_kernel.ops.launch import liger_custom_op
from liger_kernel.ops.loss_options import (
    CrossEntropyOptions,
    check_class_weight,
    is_meta,
    mean_denominators,
    reduce_rows,
    start_target_check,
)
from liger_kernel.ops.scaling import scale_gradient


@dataclasses.dataclass(frozen=True)
class FusedLinearCrossEntropyConfig(FixedLaunchConfig):
    """Chunk sizing of the fused linear cross entropy (see :func:`chunk_rows_for`).

    The (C, V) chunk buffer gets the larger of ``chunk_budget_bytes`` and
    ``chunk_floor_fraction`` of the memory floor (the bytes of the dW and dX the call
    computes). Every chunk re-reads and re-writes all of dW in its update, so the chunk must
    stay deep where dW is large; the fraction keeps peak memory within 1.10x of the floor
    there. 96 MiB is 9% of the N=8192, D=4096, V=128256 bf16 floor (1066 MiB), a chunk of
    384 rows; 128-row chunks are much slower (``docs/performance.md``). Below a ~1.1 GiB
    floor the 96 MiB minimum exceeds 10% of it: lower ``chunk_budget_bytes`` to trade that
    memory back for time. Chunks of at least ``chunk_row_multiple`` rows are rounded down to
    a multiple of it (tensor-core friendly GEMM shapes), smaller ones to a power of two.
    ``max_chunk_rows`` caps the chunk (None: no cap), e.g. to run many chunks on small shapes.
    """

    chunk_budget_bytes: int = 96 * 2**20
    chunk_floor_fraction: float = 0.085
    chunk_row_multiple: int = 64
    max_chunk_rows: int | None = None

    @classmethod
    def search_space(cls):
        for mib in (64, 96, 128, 192, 256, 512):
            yield cls(chunk_budget_bytes=mib * 2**20)


@contextlib.contextmanager
def gemm_reduction_precision():
    """Within this block, cuBLAS reduces split-K partial sums in fp32.

    By default torch lets cuBLAS reduce them in bf16/fp16. The dX GEMM reduces over the
    whole vocabulary (K = V, up to 262144), where those extra roundings would dominate the
    error, so the chunk GEMMs run with fp32 reductions.
    """
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


def chunk_rows_for(n_rows: int, n_cols: int, element_size: int, floor_bytes: int = 0) -> int:
    """Rows per chunk of an (n_rows, n_cols) logits computation: as many as fit the chunk
    budget of :class:`FusedLinearCrossEntropyConfig` (for ``floor_bytes``, the gradient bytes
    of the call), rounded, at least 1 and at most ``n_rows``."""
    config = launch_config(FusedLinearCrossEntropyConfig)
    budget = max(config.chunk_budget_bytes, int(config.chunk_floor_fraction * floor_bytes))
    rows = max(1, budget // max(1, n_cols * element_size))
    if rows >= config.chunk_row_multiple:
        rows -= rows % config.chunk_row_multiple
    else:
        rows = 1 << (rows.bit_length() - 1)
    if config.max_chunk_rows is not None:
        rows = min(rows, config.max_chunk_rows)
    return max(1, min(rows, n_rows))


@functools.cache
def _fp32_out_addmm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``addmm(out_dtype=float32, out=acc)`` accumulates low-precision products in place here.

    That cuBLAS path (torch >= 2.8 on CUDA) lets an fp32 dW accumulate bf16/fp16 chunk
    products with no dW-sized temporary. Probed once per device and dtype, numerically.
    """
    try:
        a = torch.randn(64, 32, device=device).to(dtype)
        b = torch.randn(32, 48, device=device).to(dtype)
        acc = torch.randn(64, 48, device=device)
        expected = acc + a.float() @ b.float()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, expected, atol=1e-3, rtol=1e-3))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def accumulate_grad_weight(
    grad_weight: torch.Tensor, grad_chunk: torch.Tensor, x_chunk: torch.Tensor, first: bool
) -> None:
    """``grad_weight += grad_chunk^T @ x_chunk`` in place, without a dW-sized temporary.

    With ``first`` and matching dtypes, ``grad_weight`` may hold garbage: the product is
    written over it (saving the zero fill and one read of dW).
    """
    if grad_weight.dtype == grad_chunk.dtype:
        if first:
            torch.mm(grad_chunk.t(), x_chunk, out=grad_weight)
        else:
            grad_weight.addmm_(grad_chunk.t(), x_chunk)
        return
    # float32 accumulator for low-precision operands.
    if _fp32_out_addmm_works(grad_weight.device, grad_chunk.dtype):
        torch.addmm(grad_weight, grad_chunk.t(), x_chunk, out_dtype=torch.float32, out=grad_weight)
        return
    # Fallback: vocabulary slices, so the low-precision temporary stays chunk-sized.
    n_rows, n_cols = grad_chunk.shape
    slice_cols = max(1, (n_rows * n_cols) // max(1, x_chunk.shape[1]))
    for start in range(0, n_cols, slice_cols):
        stop = min(start + slice_cols, n_cols)
        grad_weight[start:stop].add_(grad_chunk[:, start:stop].t() @ x_chunk)


def _chunked_loss_and_grads(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
                            class_weight: torch.Tensor | None, row_scale: torch.Tensor | None, ignore_index: int,
                            label_smoothing: float, lse_square_scale: float, softcap: float, mean_reduction: bool,
                            compute_accuracy: bool, grad_input_needed: bool, grad_weight_needed: bool,
                            grad_bias_needed: bool, accum_fp32: bool):
    """The chunk loop. Returns per-row (loss, z_loss, correct), the mean's count, and the grads.

    Gradients not asked for are returned as empty tensors. With ``row_scale`` (N,) each
    row's logit gradient is multiplied by it (the ``"none"`` backward).
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
            floor_bytes = (grad_input.numel() * grad_input.element_size()
                           + (weight.numel() * weight.element_size() if grad_weight_needed else 0))
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
                    torch.matmul(logits, weight, out=grad_input[start:stop])
                if grad_weight_needed:
                    accumulate_grad_weight(grad_weight, logits, x_chunk, first=start == 0)
                if grad_bias_needed:
                    grad_bias.add_(logits.sum(dim=0, dtype=torch.float32))
            del chunk_buffer
    if grad_weight_needed and grad_weight.dtype != weight.dtype:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias_needed:
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
                                    grad_input_needed, grad_weight_needed, grad_bias_needed, accum_fp32)
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
                                             grad_input_needed, grad_weight_needed, grad_bias_needed, accum_fp32):
    shape = (x.shape[0],) if reduction == "none" else ()
    losses = [x.new_empty(shape, dtype=torch.float32) for _ in range(3)]
    return (*losses, *_fake_grads(x, weight, bias, grad_input_needed, grad_weight_needed, grad_bias_needed))


@liger_custom_op("fused_linear_cross_entropy_backward")
def fused_linear_cross_entropy_backward(grad_rows: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                        target: torch.Tensor, bias: torch.Tensor | None,
                                        class_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float,
                                        lse_square_scale: float, softcap: float, grad_input_needed: bool,
                                        grad_weight_needed: bool, grad_bias_needed: bool,
                                        accum_fp32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher for the ``"none"`` backward: (dX, dW, dB) for per-row upstream gradient ``grad_rows`` (N,).

    Recomputes each chunk's logits; the kernel scales row ``i`` of the logit gradient by
    ``grad_rows[i]`` before the two matmuls.
    """
    grad_rows = grad_rows.to(torch.float32).contiguous()
    with torch.autocast(device_type=x.device.type, enabled=False):
        *_, grad_input, grad_weight, grad_bias = _chunked_loss_and_grads(
            x, weight, target, bias, class_weight, grad_rows, ignore_index, label_smoothing, lse_square_scale,
            softcap, False, False, grad_input_needed, grad_weight_needed, grad_bias_needed, accum_fp32)
    return grad_input, grad_weight, grad_bias


@fused_linear_cross_entropy_backward.register_fake
def _fused_linear_cross_entropy_backward_fake(grad_rows, x, weight, target, bias, class_weight, ignore_index,
                                              label_smoothing, lse_square_scale, softcap, grad_input_needed,
                                              grad_weight_needed, grad_bias_needed, accum_fp32):
    return _fake_grads(x, weight, bias, grad_input_needed, grad_weight_needed, grad_bias_needed)


def _check_linear_args(x, weight, bias, accum_dtype) -> None:
    check_float_dtype(x, "input")
    check_float_dtype(weight, "weight")
    if x.dim() != 2:
        raise ValueError(f"input must be 2-D (N, D) hidden states, got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (V, D), got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}; its last dimension must equal input's hidden size {x.shape[1]}"
        )
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one row (class)")
    if weight.dtype != x.dtype:
        raise TypeError(
            f"input ({x.dtype}) and weight ({weight.dtype}) must have the same dtype "
            "(or run under torch.autocast, which casts both)"
        )
    if bias is not None:
        check_tensor(bias, "bias")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias has dtype {bias.dtype}; it must match input's {x.dtype}")
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
    forward = _fused_linear_cross_entropy_forward_fake if meta else fused_linear_cross_entropy_forward
    loss, z_loss, accuracy, grad_input, grad_weight, grad_bias = forward(
        x, weight, target, bias, ce_weight, *kernel_options, options.reduction, options.return_token_accuracy,
        bool(needs_input) and in_forward, bool(needs_weight) and in_forward, needs_bias and in_forward, accum_fp32,
    )
    target_check.wait()
    ctx.reduction = options.reduction
    ctx.needs = (bool(needs_input), bool(needs_weight), needs_bias)
    if in_forward:
        ctx.save_for_backward(grad_input, grad_weight, grad_bias)
    else:
        ctx.options = kernel_options
        ctx.accum_fp32 = accum_fp32
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
    @once_differentiable
    def backward(ctx, grad_loss, grad_z_loss=None, grad_accuracy=None):
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
                ctx.accum_fp32,
            )
        return (
            grad_input if needs_input else None,
            grad_weight if needs_weight else None,
            None,
            grad_bias if needs_bias else None,
        ) + (None,) * 8


class FusedLinearCrossEntropyFunction(LigerFusedLinearCrossEntropyFunction):
    """:class:`LigerFusedLinearCrossEntropyFunction` for callers holding validated options:
    ``apply(input, weight, target, bias, ce_weight, options, accum_dtype)``."""

    @staticmethod
    def forward(ctx, _input, weight, target, bias, ce_weight, options, accum_dtype):
        return _fused_linear_cross_entropy(ctx, _input, weight, target, bias, ce_weight, options, accum_dtype)
