"""Compatibility shim: ``liger_kernel.transformers.model.loss_utils.LigerForCausalLMLoss``, the
fused causal-LM loss that axolotl's and ms-swift's own model forwards call with the hidden
states and the head's weight instead of logits.

The computation is :func:`~liger_kernel.transformers.fused_linear_cross_entropy.liger_fused_linear_cross_entropy`
with Hugging Face's ``ForCausalLMLoss`` conventions (:mod:`liger_kernel.transformers.causal_lm`);
this module only adapts the call shape.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from liger_kernel.transformers.causal_lm import IGNORE_INDEX, causal_targets, divide_by_items
from liger_kernel.transformers.fused_linear_cross_entropy import liger_fused_linear_cross_entropy

__all__ = ["LigerForCausalLMLoss"]

_LOSS_PARAMETERS = frozenset(inspect.signature(liger_fused_linear_cross_entropy).parameters)


def LigerForCausalLMLoss(  # the callers' name
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None,
    hidden_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    final_logit_softcapping: float | None = None,
    **kwargs: Any,
):
    """Next-token cross entropy of ``hidden_states @ lm_head_weight.T`` without the logits.

    ``hidden_states`` (B, T, H) or (N, H), ``lm_head_weight`` (V, H), ``labels`` (B, T) shifted
    here (``labels[:, t + 1]`` is the target of position ``t``, the last position ignored)
    unless ``shift_labels`` (already aligned) is given. With ``num_items_in_batch`` the loss is
    the sum over counted targets divided by it, else their mean; ``final_logit_softcapping``
    caps the logits first. Further keyword arguments that
    :func:`liger_fused_linear_cross_entropy` takes (``bias``, ``accum_dtype``,
    ``use_token_scaling``, ``return_token_accuracy``, ...) are passed on; others (the
    Trainer's loss kwargs) are ignored. Returns what that function returns.
    """
    shift_labels = causal_targets(labels, shift_labels, ignore_index)
    options = {name: value for name, value in kwargs.items() if name in _LOSS_PARAMETERS}
    options.pop("reduction", None)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    hidden = hidden_states.reshape(-1, hidden_size)
    result = liger_fused_linear_cross_entropy(hidden, lm_head_weight, shift_labels.reshape(-1).to(hidden.device),
                                              ignore_index=ignore_index, softcap=final_logit_softcapping,
                                              reduction=reduction, **options)
    if num_items_in_batch is None:
        return result
    if isinstance(result, torch.Tensor):
        return divide_by_items(result, num_items_in_batch)
    z_loss = None if result.z_loss is None else divide_by_items(result.z_loss, num_items_in_batch)
    return result._replace(loss=divide_by_items(result.loss, num_items_in_batch), z_loss=z_loss)
