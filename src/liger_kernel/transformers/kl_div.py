"""KL divergence loss, drop-in for ``torch.nn.KLDivLoss`` / ``torch.nn.functional.kl_div``.

See :mod:`liger_kernel.ops.kl_div` for the math and the (documented) differences from torch.
"""

import torch
from torch import nn

from liger_kernel.ops.kl_div import LigerKLDivLossFunction

__all__ = ["LigerKLDIVLoss", "liger_kl_div"]


def liger_kl_div(input: torch.Tensor, target: torch.Tensor, size_average=None, reduce=None,
                 reduction: str = "mean", log_target: bool = False, eps: float = 1e-10) -> torch.Tensor:
    """``torch.nn.functional.kl_div`` with ``input`` in log space. ``size_average`` and ``reduce``
    are torch's deprecated flags: given, they select the reduction as torch's legacy rule does."""
    if size_average is not None or reduce is not None:
        reduction = nn.modules.loss._Reduction.legacy_get_string(size_average, reduce)
    return LigerKLDivLossFunction.apply(input, target, reduction, log_target, eps)


class LigerKLDIVLoss(nn.KLDivLoss):
    """``torch.nn.KLDivLoss`` (same arguments, plus ``eps`` first as in the best-known
    implementation: ``LigerKLDIVLoss(eps=1e-10, *args, **kwargs)``), called as ``(input, target)``."""

    def __init__(self, eps: float = 1e-10, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, y_pred: torch.Tensor, y_true: torch.Tensor) -> torch.Tensor:
        return LigerKLDivLossFunction.apply(y_pred, y_true, self.reduction, self.log_target, self.eps)
