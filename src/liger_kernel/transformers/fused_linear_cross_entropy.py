"""Fused linear + cross entropy loss: the LM head and its loss without (N, V) logits.

See :mod:`liger_kernel.ops.fused_linear_cross_entropy` for the chunking and the memory
bound, and :mod:`liger_kernel.ops.cross_entropy` for the loss definitions.
"""

from typing import Union

import torch

from liger_kernel.ops.fused_linear_cross_entropy import FusedLinearCrossEntropyFunction
from liger_kernel.ops.loss_options import CrossEntropyOptions, CrossEntropyOutput
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
    """
    options = CrossEntropyOptions(ignore_index=ignore_index, label_smoothing=label_smoothing,
                                  lse_square_scale=lse_square_scale, softcap=softcap, reduction=reduction,
                                  return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
    return _fused_linear_cross_entropy(input, weight, target, bias, ce_weight, options, accum_dtype)


def _fused_linear_cross_entropy(input, weight, target, bias, ce_weight, options: CrossEntropyOptions, accum_dtype):
    input, weight, bias = _autocast_operands(input, weight, bias)
    loss, z_loss, accuracy = FusedLinearCrossEntropyFunction.apply(input, weight, target, bias, ce_weight, options,
                                                                   accum_dtype)
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
                 return_token_accuracy: bool = False) -> None:
        super().__init__(ce_weight, ignore_index=ignore_index, lse_square_scale=lse_square_scale,
                         label_smoothing=label_smoothing, reduction=reduction, softcap=softcap,
                         return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
        self.accum_dtype = accum_dtype

    def forward(
        self,
        lin_weight: torch.Tensor,
        _input: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> Union[torch.Tensor, CrossEntropyOutput]:
        return _fused_linear_cross_entropy(_input, lin_weight, target, bias, self.ce_weight, self.options,
                                           self.accum_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, accum_dtype={self.accum_dtype}"
