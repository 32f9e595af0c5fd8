"""Cosine-similarity distillation on fused student and teacher heads.

Per row, with temperature-scaled logits ``s = z_s / tau`` and ``t = z_t / tau``
(:mod:`.fused_linear_distillation` for the rest of the loss)::

    d = beta * (1 - <s, t> / max(|s| |t|, eps)),   eps = 1e-8

Deviation from the best-known library: rows whose label is ``ignore_index`` count 0 here (the
loss is divided by the number of counted rows, so an uncounted row must not add to the sum).
"""

from __future__ import annotations

import torch

from liger_kernel.chunked_loss.fused_linear_distillation import (
    LabelledDistillationFunction,
    LabelledDistillationLoss,
)

COSINE_EPS = 1e-8


def cosine_distance_rows(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """(R,) ``beta * (1 - cos(s, t))`` of logit rows."""
    dot = (student_logits * teacher_logits).sum(-1)
    norms = student_logits.norm(dim=-1) * teacher_logits.norm(dim=-1)
    return beta * (1 - dot / norms.clamp(min=COSINE_EPS))


class LigerFusedLinearCosineSimilarityFunction(LabelledDistillationFunction):
    """``apply(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias,
    teacher_bias, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, ignore_index=-100, temperature=1.0,
    compiled=True, chunk_size=1024, return_soft_hard_loss=False)`` -> loss or (loss, soft, hard)."""

    @staticmethod
    def distillation_loss_fn(student_logits, teacher_logits, target=None, ignore_index=-100, beta=1.0):
        return cosine_distance_rows(student_logits, teacher_logits, beta)  # the base zeroes ignored rows


class LigerFusedLinearCosineSimilarityLoss(LabelledDistillationLoss):
    """Cosine-similarity distillation (plus an optional cross-entropy on the labels) of fused heads.

    ``LigerFusedLinearCosineSimilarityLoss(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5,
    ignore_index=-100, temperature=1.0, compiled=True, chunk_size=1024, return_soft_hard_loss=False)``;
    ``forward(student_input, student_weight, teacher_input, teacher_weight, true_labels,
    student_bias=None, teacher_bias=None)``.
    """

    function = LigerFusedLinearCosineSimilarityFunction
