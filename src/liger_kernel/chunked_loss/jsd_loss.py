"""Generalised Jensen-Shannon distillation on fused student and teacher heads (TRL's GKD convention).

Per row, with ``P = softmax(z_s / tau)`` the student's and ``Q = softmax(z_t / tau)`` the teacher's
distribution and ``beta`` in [0, 1] (:mod:`.fused_linear_distillation` for the rest of the loss)::

    beta = 0:      d = KL(Q || P) = sum_v Q (log Q - log P)          (forward KL)
    beta = 1:      d = KL(P || Q) = sum_v P (log P - log Q)          (reverse KL)
    otherwise:     M = (1 - beta) P + beta Q,
                   d = beta KL(Q || M) + (1 - beta) KL(P || M)

the ``generalized_jsd_loss`` of TRL's GKD trainer, summed over counted rows and divided by their
number. TRL's trainers construct ``LigerFusedLinearJSDLoss(beta=..., ignore_index=-100,
temperature=..., compiled=False, weight_hard_loss=0.0, weight_soft_loss=1.0)`` and call it as
``(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias,
teacher_bias)``.
"""

from __future__ import annotations

import math

import torch

from liger_kernel.chunked_loss.fused_linear_distillation import (
    LabelledDistillationFunction,
    LabelledDistillationLoss,
)
from liger_kernel.ops.checks import check_beta
from liger_kernel.ops.distillation_epilogue import GeneralizedJSDRows


def _kl_rows(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from log-probabilities (R, V)."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def generalized_jsd_rows(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """(R,) generalised JSD of (already temperature-scaled) logit rows; see the module docstring."""
    log_p = student_logits.log_softmax(-1)
    log_q = teacher_logits.log_softmax(-1)
    if beta == 0:
        return _kl_rows(log_q, log_p)
    if beta == 1:
        return _kl_rows(log_p, log_q)
    log_m = torch.logaddexp(log_p + math.log(1 - beta), log_q + math.log(beta))
    return beta * _kl_rows(log_q, log_m) + (1 - beta) * _kl_rows(log_p, log_m)


class LigerFusedLinearJSDFunction(LabelledDistillationFunction):
    """``apply(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias,
    teacher_bias, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, ignore_index=-100, temperature=1.0,
    compiled=True, chunk_size=1024, return_soft_hard_loss=False)`` -> loss or (loss, soft, hard)."""

    @staticmethod
    def check_options(beta: float) -> None:
        check_beta(beta)

    @staticmethod
    def distillation_loss_fn(student_logits, teacher_logits, target=None, ignore_index=-100, beta=0.5):
        return generalized_jsd_rows(student_logits, teacher_logits, beta)  # the base zeroes ignored rows

    @classmethod
    def closed_form_token_fn(cls, temperature, ignore_index, student_vocab, teacher_vocab, compute_ce_loss,
                             loss_kwargs):
        # Triton passes over the chunks in their own dtype where the two heads share a vocabulary.
        if teacher_vocab != student_vocab or set(loss_kwargs) != {"beta"}:
            return None
        return GeneralizedJSDRows(loss_kwargs["beta"], temperature, ignore_index, compute_ce_loss)


class LigerFusedLinearJSDLoss(LabelledDistillationLoss):
    """Generalised JSD (plus an optional cross-entropy on the labels) of fused student/teacher heads.

    ``LigerFusedLinearJSDLoss(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, ignore_index=-100,
    temperature=1.0, compiled=True, chunk_size=1024, return_soft_hard_loss=False)``;
    ``forward(student_input, student_weight, teacher_input, teacher_weight, true_labels,
    student_bias=None, teacher_bias=None)``. See the module docstring.
    """

    function = LigerFusedLinearJSDFunction
