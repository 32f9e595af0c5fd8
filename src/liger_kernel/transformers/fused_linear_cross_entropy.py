"""Fused linear + cross entropy loss: the LM head and its loss without (N, V) logits.

See :mod:`liger_kernel.ops.fused_linear_cross_entropy` for the chunking and the memory
bound, and :mod:`liger_kernel.ops.cross_entropy` for the loss definitions.

Token scaling (``use_token_scaling=True``, upstream Liger's option of that name): each
counted row's loss ``l_i`` (cross entropy, label smoothing and z-loss included) is multiplied
by ``p_i``, the probability the model gives the row's target, ``p_i = softmax(z_i)[y_i]``
of the (soft-capped) logits, treated as a constant (no gradient flows through ``p_i``):
``loss = sum_i p_i l_i / D`` for ``"mean"`` (``D`` the mean's usual denominator: the count of
counted rows, or the sum of their class weights), ``sum_i p_i l_i`` for ``"sum"``, ``p_i l_i``
per row for ``"none"``; the reported z-loss is scaled the same way, the token accuracy not.
Ignored rows have ``p_i = 0``. It is computed from the op's per-row losses (its ``"none"``
reduction, whose backward takes a per-row gradient), so it costs the ``"none"`` path's
recomputation of the logits in backward, plus one loss-only pass for ``p_i`` when label
smoothing, a z-loss or class weights make ``l_i`` differ from ``-log p_i``.
"""

import dataclasses
from typing import Union

import torch

from liger_kernel.ops.fused_linear_cross_entropy import FusedLinearCrossEntropyFunctionFromOptions
from liger_kernel.ops.loss_options import CrossEntropyOptions, CrossEntropyOutput
from liger_kernel.ops.loss_reduction import mean_denominators, reduce_rows
from liger_kernel.transformers.cross_entropy import CrossEntropyLossBase

__all__ = ["LigerFusedLinearCrossEntropyLoss", "liger_fused_linear_cross_entropy"]


def _autocast_operands(input, weight, bias):
    # Under autocast, F.linear would run in the autocast dtype; cast the operands the same
    # way (autograd carries the gradients back through the casts to fp32 parameters).
    device_type = input.device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):  # meta: no autocast there
        return input, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    return input.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def liger_fused_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ce_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    return_z_loss: bool = False,
    accum_dtype: torch.dtype | None = None,
    use_token_scaling: bool = False,
    return_token_accuracy: bool = False,
) -> Union[torch.Tensor, CrossEntropyOutput]:
    """``F.cross_entropy(input @ weight.T + bias, target, ...)`` without materialising the logits.

    ``input`` (N, D) hidden states (e.g. ``hidden_states.reshape(-1, D)``), ``weight``
    (V, D) the LM head (may be frozen), ``bias`` (V,) or None, ``target`` (N,) class
    indices. ``ce_weight`` (V,) are the class weights; the other options are those of
    :func:`liger_kernel.transformers.cross_entropy.liger_cross_entropy`, and so is the
    return value (the loss, or a :class:`CrossEntropyOutput` when ``return_z_loss`` or
    ``return_token_accuracy`` is set), except that the loss is float32 for every input
    dtype: this loss replaces HF's causal-LM loss, which upcasts the logits to float32 and
    so returns a float32 loss. Meta tensors give meta outputs. ``accum_dtype=torch.float32`` accumulates the
    weight gradient in float32 for bf16/fp16 weights. ``input`` and ``weight`` must share a
    dtype unless autocast is on, in which case both are cast to the autocast dtype.
    ``use_token_scaling=True`` multiplies each row's loss by the (constant) probability of its
    target (see the module docstring). The parameter order is upstream Liger's.
    """
    options = CrossEntropyOptions(ignore_index=ignore_index, label_smoothing=label_smoothing,
                                  lse_square_scale=lse_square_scale, softcap=softcap, reduction=reduction,
                                  return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
    return _fused_linear_cross_entropy(input, weight, target, bias, ce_weight, options, accum_dtype,
                                       use_token_scaling)


def _fused_linear_cross_entropy(input, weight, target, bias, ce_weight, options: CrossEntropyOptions, accum_dtype,
                                use_token_scaling: bool = False):
    input, weight, bias = _autocast_operands(input, weight, bias)
    if use_token_scaling:
        return _token_scaled(input, weight, target, bias, ce_weight, options, accum_dtype)
    loss, z_loss, accuracy = FusedLinearCrossEntropyFunctionFromOptions.apply(input, weight, target, bias, ce_weight, options,
                                                                   accum_dtype)
    return options.outputs(loss, z_loss, accuracy)


def _token_scaled(input, weight, target, bias, ce_weight, options: CrossEntropyOptions, accum_dtype):
    """The token-scaled loss (module docstring) from the op's per-row losses."""
    if options.reduction == "mean" and ce_weight is not None and options.lse_square_scale != 0.0:
        # The op divides a row's cross entropy by the class-weight sum and its z-loss by the
        # count: one per-row factor cannot give both gradients.
        raise ValueError("use_token_scaling with reduction='mean' does not support class weights (ce_weight) "
                         "together with a z-loss (lse_square_scale != 0)")
    rows = dataclasses.replace(options, reduction="none")
    loss_rows, z_rows, correct_rows = FusedLinearCrossEntropyFunctionFromOptions.apply(input, weight, target, bias, ce_weight,
                                                                            rows, accum_dtype)
    plain = options.label_smoothing == 0.0 and options.lse_square_scale == 0.0 and ce_weight is None
    if plain:
        nll_rows = loss_rows.detach()  # -log p_i already
    else:
        nll_options = CrossEntropyOptions(ignore_index=options.ignore_index, softcap=options.softcap, reduction="none")
        with torch.no_grad():
            nll_rows = FusedLinearCrossEntropyFunctionFromOptions.apply(input.detach(), weight.detach(), target,
                                                             None if bias is None else bias.detach(), None,
                                                             nll_options, accum_dtype)[0]
    counted = target.reshape(-1) != options.ignore_index
    scale = torch.where(counted, torch.exp(-nll_rows), torch.zeros_like(nll_rows))
    loss_rows, z_rows = loss_rows * scale, z_rows * scale
    ce_denominator, z_denominator, n_counted = mean_denominators(target, ce_weight, options.ignore_index,
                                                                 weight.shape[0])
    if options.reduction == "mean":
        loss_rows, z_rows = loss_rows / ce_denominator, z_rows / z_denominator
    loss, z_loss, accuracy = reduce_rows(loss_rows, z_rows, correct_rows, n_counted, options.reduction)
    return options.outputs(loss, z_loss, accuracy)


class LigerFusedLinearCrossEntropyLoss(CrossEntropyLossBase):
    """Module form of :func:`liger_fused_linear_cross_entropy`.

    ``forward(lin_weight (V, D), _input (N, D), target (N,), bias=None)``: note the
    weight comes first (the LM head's weight is passed in, not owned by this module).
    """

    weight_name = "ce_weight"

    def __init__(self, ce_weight: torch.Tensor | None = None, ignore_index: int = -100, lse_square_scale: float = 0.0,
                 label_smoothing: float = 0.0, reduction: str = "mean", softcap: float | None = None,
                 return_z_loss: bool = False, accum_dtype: torch.dtype | None = None,
                 use_token_scaling: bool = False, return_token_accuracy: bool = False) -> None:
        super().__init__(ce_weight, ignore_index=ignore_index, lse_square_scale=lse_square_scale,
                         label_smoothing=label_smoothing, reduction=reduction, softcap=softcap,
                         return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
        self.accum_dtype = accum_dtype
        self.use_token_scaling = bool(use_token_scaling)

    def forward(
        self,
        lin_weight: torch.Tensor,
        _input: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> Union[torch.Tensor, CrossEntropyOutput]:
        return _fused_linear_cross_entropy(_input, lin_weight, target, bias, self.ce_weight, self.options,
                                           self.accum_dtype, self.use_token_scaling)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, accum_dtype={self.accum_dtype}, use_token_scaling={self.use_token_scaling}"
