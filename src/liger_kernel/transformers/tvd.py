"""Total variation distance loss between two distributions given as probabilities.

See :mod:`liger_kernel.ops.tvd` for the math and the differences from the best-known
implementation, whose names, argument order and defaults these follow.
"""

import torch
from torch import nn

from liger_kernel.ops.tvd import LigerTVDLossFunction

__all__ = ["LigerTVDLoss", "liger_tvd"]


def liger_tvd(input: torch.Tensor, target: torch.Tensor, shift_labels: torch.Tensor | None = None,
              reduction: str = "mean", ignore_index: int = -100) -> torch.Tensor:
    """Total variation distance ``sum |input - target| / 2`` per row of (..., V) probabilities,
    reduced by ``reduction`` ("none", "sum", "mean" over counted elements, "batchmean" over
    counted rows); rows whose ``shift_labels`` is ``ignore_index`` are left out."""
    return LigerTVDLossFunction.apply(input, target, shift_labels, reduction, ignore_index)


class LigerTVDLoss(nn.Module):
    """``LigerTVDLoss(reduction="batchmean", ignore_index=-100)``, called as
    ``(p, q, shift_labels=None)``; see :func:`liger_tvd`."""

    def __init__(self, reduction: str = "batchmean", ignore_index: int = -100):
        super().__init__()
        self.reduction = reduction
        self.ignore_index = ignore_index

    def forward(self, p: torch.Tensor, q: torch.Tensor, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
        return LigerTVDLossFunction.apply(p, q, shift_labels, self.reduction, self.ignore_index)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, ignore_index={self.ignore_index}"
