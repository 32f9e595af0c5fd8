"""Cross entropy loss module and functional form, drop-in for ``nn.CrossEntropyLoss``.

See :mod:`liger_kernel.ops.cross_entropy` for the math and memory behaviour: the gradient
is computed in the forward pass, into a fresh buffer unless the caller asks for it to be
written over the logits (``in_place=True``, a promise that nothing reads them afterwards).
"""

from __future__ import annotations

import dataclasses
from typing import Union

import torch
from torch import nn

from liger_kernel.ops.cross_entropy import CrossEntropyFunctionFromOptions
from liger_kernel.ops.grad_ownership import hooks_may_see
from liger_kernel.ops.loss_options import (
    OPTION_NAMES,
    CrossEntropyOptions,
    CrossEntropyOutput,
)

__all__ = ["CrossEntropyLossBase", "CrossEntropyOptions", "CrossEntropyOutput", "LigerCrossEntropyLoss",
           "liger_cross_entropy"]


def _cross_entropy(input, target, weight, options: CrossEntropyOptions, in_place: bool, loss_dtype=None):
    loss, z_loss, accuracy = CrossEntropyFunctionFromOptions.apply(input, target, weight, options, in_place,
                                                                   loss_dtype)
    return options.outputs(loss, z_loss, accuracy)


def liger_cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    in_place: bool = False,
    loss_dtype: torch.dtype | None = None,
) -> Union[torch.Tensor, CrossEntropyOutput]:
    """Cross entropy of logits ``input`` (N, V) against class indices ``target`` (N,).

    Same arguments and results as ``torch.nn.functional.cross_entropy`` (class ``weight``
    (V,), ``ignore_index``, ``reduction`` "mean"/"sum"/"none", ``label_smoothing``), plus
    the options of :class:`~liger_kernel.ops.loss_options.CrossEntropyOptions`:

    * ``softcap``: apply ``softcap * tanh(input / softcap)`` first (Gemma 2);
    * ``lse_square_scale``: add the z-loss ``lse_square_scale * logsumexp(row)**2`` of each
      counted row (averaged over counted rows for "mean");
    * ``return_z_loss`` / ``return_token_accuracy``: return a
      :class:`CrossEntropyOutput` ``(loss, z_loss, token_accuracy)`` instead of the loss
      alone (unrequested fields are ``None``);
    * ``in_place`` (default False): True writes the gradient, computed now, over ``input``
      instead of a fresh (N, V) buffer. It is the caller's promise that nothing reads
      ``input`` afterwards (a temporary such as ``lm_head(h).float().view(-1, V)``): logits
      the caller keeps, returns or a hook saw must not be passed with it;
    * ``loss_dtype``: the dtype of the loss and z-loss; None (default) gives ``input``'s
      dtype, as torch's (computed in float32 either way). ``torch.float32`` gives what HF's
      causal-LM loss returns, which upcasts the logits first.

    A "mean" over all-ignored targets is 0 with zero gradient (torch returns NaN). Raises
    ``ValueError``/``TypeError`` on bad shapes, dtypes or target values outside ``[0, V)``
    (that value check syncs once with the device in eager mode and is skipped under
    ``torch.compile``, where a bad target gives a NaN loss). Meta tensors give meta outputs.
    """
    options = CrossEntropyOptions(ignore_index=ignore_index, label_smoothing=label_smoothing,
                                  lse_square_scale=lse_square_scale, softcap=softcap, reduction=reduction,
                                  return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
    return _cross_entropy(input, target, weight, options, in_place, loss_dtype)


def _option_property(name: str) -> property:
    def get(self):
        return getattr(self.options, name)

    def set(self, value):
        self.options = dataclasses.replace(self.options, **{name: value})

    return property(get, set, doc=f"The ``{name}`` option (validated when set).")


class CrossEntropyLossBase(nn.Module):
    """What the cross-entropy loss modules share: one :class:`CrossEntropyOptions` value
    (``self.options``, each field also readable and settable as an attribute, validated when
    set) and the class weights as a non-persistent buffer ``weight_name`` (it follows the
    module's ``.to()``)."""

    weight_name = "weight"

    def __init__(self, class_weight: torch.Tensor | None, **options) -> None:
        super().__init__()
        self.options = CrossEntropyOptions(**options)
        self.register_buffer(self.weight_name, class_weight, persistent=False)

    def extra_repr(self) -> str:
        return self.options.describe()


for _name in OPTION_NAMES:
    setattr(CrossEntropyLossBase, _name, _option_property(_name))


class LigerCrossEntropyLoss(CrossEntropyLossBase):
    """``nn.CrossEntropyLoss`` with the extras of :func:`liger_cross_entropy`.

    ``forward(input (N, V), target (N,))``; ``input`` is overwritten by its gradient only
    when the module was built with ``in_place=True`` (see :func:`liger_cross_entropy`) and no
    hook of the module (its own or a global one) may read its inputs.
    """

    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, lse_square_scale: float = 0.0,
                 label_smoothing: float = 0.0, reduction: str = "mean", softcap: float | None = None,
                 return_z_loss: bool = False, return_token_accuracy: bool = False, in_place: bool = False) -> None:
        super().__init__(weight, ignore_index=ignore_index, lse_square_scale=lse_square_scale,
                         label_smoothing=label_smoothing, reduction=reduction, softcap=softcap,
                         return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
        self.in_place = in_place

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> Union[torch.Tensor, CrossEntropyOutput]:
        in_place = self.in_place and not hooks_may_see(self)
        return _cross_entropy(input, target, self.weight, self.options, in_place)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, in_place={self.in_place}"
