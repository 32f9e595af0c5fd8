"""Generalised Jensen-Shannon divergence on given log-probabilities (distillation).

See :mod:`liger_kernel.ops.jsd` for the math, the memory behaviour and the differences from
the best-known implementation, whose names, argument order and defaults these follow.
"""

import torch
from torch import nn

from liger_kernel.ops.jsd import LigerJSDFunction

__all__ = ["LigerJSD", "liger_jsd"]


def liger_jsd(input: torch.Tensor, target: torch.Tensor, shift_labels: torch.Tensor | None = None,
              beta: float = 0.5, ignore_index: int = -100) -> torch.Tensor:
    """Generalised JSD of student log-probabilities ``input`` and teacher log-probabilities
    ``target`` (..., V): ``beta`` 0 is KL(teacher || student), 1 is KL(student || teacher).
    Rows whose ``shift_labels`` is ``ignore_index`` are left out; float32 scalar, the mean over
    counted rows."""
    return LigerJSDFunction.apply(input, target, shift_labels, beta, ignore_index)


class LigerJSD(nn.Module):
    """``LigerJSD(beta=0.5, ignore_index=-100)``, called as ``(log_q, log_p, shift_labels=None)``
    with the student's log-probabilities ``log_q`` first; see :func:`liger_jsd`."""

    def __init__(self, beta: float = 0.5, ignore_index: int = -100):
        super().__init__()
        self.beta = beta
        self.ignore_index = ignore_index

    def forward(self, log_q: torch.Tensor, log_p: torch.Tensor,
                shift_labels: torch.Tensor | None = None) -> torch.Tensor:
        return LigerJSDFunction.apply(log_q, log_p, shift_labels, self.beta, self.ignore_index)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}"
