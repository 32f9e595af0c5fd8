"""Cross entropy loss module and functional form, drop-in for ``nn.CrossEntropyLoss``.

See :mod:`liger_kernel.ops.cross_entropy` for the math and memory behaviour: by default
the gradient is written over the input logits, which must not be reused afterwards.
"""

from typing import Union

import torch
from torch import nn

from liger_kernel.ops.cross_entropy import CrossEntropyOutput, LigerCrossEntropyFunction

__all__ = ["CrossEntropyOutput", "LigerCrossEntropyLoss", "liger_cross_entropy"]


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
    in_place: bool = True,
) -> Union[torch.Tensor, CrossEntropyOutput]:
    """Cross entropy of logits ``input`` (N, V) against class indices ``target`` (N,).

    Same arguments and results as ``torch.nn.functional.cross_entropy`` (class ``weight``
    (V,), ``ignore_index``, ``reduction`` "mean"/"sum"/"none", ``label_smoothing``), plus:

    * ``softcap``: apply ``softcap * tanh(input / softcap)`` first (Gemma 2);
    * ``lse_square_scale``: add the z-loss ``lse_square_scale * logsumexp(row)**2`` of each
      counted row (averaged over counted rows for "mean");
    * ``return_z_loss`` / ``return_token_accuracy``: return a
      :class:`CrossEntropyOutput` ``(loss, z_loss, token_accuracy)`` instead of the loss
      alone (unrequested fields are ``None``);
    * ``in_place`` (default True): the gradient is computed now and written over
      ``input``, whose values are then garbage; pass False to keep ``input`` intact.

    The loss is float32. A "mean" over all-ignored targets is 0 with zero gradient
    (torch returns NaN). Raises ``ValueError``/``TypeError`` on bad shapes, dtypes or
    target values outside ``[0, V)`` (that value check syncs once with the device in eager
    mode and is skipped under ``torch.compile``, where a bad target gives a NaN loss).
    """
    loss, z_loss, accuracy = LigerCrossEntropyFunction.apply(
        input,
        target,
        weight,
        ignore_index,
        lse_square_scale,
        label_smoothing,
        reduction,
        softcap,
        return_token_accuracy,
        in_place,
    )
    if not (return_z_loss or return_token_accuracy):
        return loss
    return CrossEntropyOutput(
        loss,
        z_loss if return_z_loss else None,
        accuracy if return_token_accuracy else None,
    )


class LigerCrossEntropyLoss(nn.Module):
    """``nn.CrossEntropyLoss`` with the extras of :func:`liger_cross_entropy`.

    ``forward(input (N, V), target (N,))``; ``input`` is overwritten by its gradient
    (``in_place=True``, the default) unless ``in_place=False``.
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        in_place: bool = True,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.return_token_accuracy = return_token_accuracy
        self.in_place = in_place

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> Union[torch.Tensor, CrossEntropyOutput]:
        return liger_cross_entropy(
            input,
            target,
            weight=self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale,
            softcap=self.softcap,
            return_z_loss=self.return_z_loss,
            return_token_accuracy=self.return_token_accuracy,
            in_place=self.in_place,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, lse_square_scale={self.lse_square_scale}, "
            f"softcap={self.softcap}, in_place={self.in_place}"
        )
