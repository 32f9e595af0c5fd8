"""Generalised JSD of fused student and teacher heads (no logits), as an nn.Module and a function.

``LigerFusedLinearJSD(jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype=None)`` called as
``(student_input (N, D_s), student_weight (V, D_s), teacher_input (N, D_t), teacher_weight (V, D_t),
shift_labels (N,) or None)`` returns ::

    loss = sum_{n counted} JSD_beta(softmax(z_s,n / tau), softmax(z_t,n / tau)) / max(1, #counted)

with ``JSD_beta`` as in :mod:`liger_kernel.chunked_loss.jsd_loss` (``jsd_beta`` 0 and 1 are the
forward KL(teacher || student) and the reverse KL(student || teacher)); a row counts when its
label is not ``ignore_index``, every row when ``shift_labels`` is None. It is the soft part of
:class:`~liger_kernel.chunked_loss.LigerFusedLinearJSDLoss` (no cross-entropy), on the same chunked
head engine; gradients flow to the student's input and weight. ``accum_dtype=torch.float32``
accumulates the weight gradient over chunks in float32.
"""

from __future__ import annotations

import torch

from liger_kernel.chunked_loss.fused_linear_distillation import LigerFusedLinearDistillationBase
from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDFunction
from liger_kernel.ops.checks import check_beta, check_temperature


class _SoftJSDFunction(LigerFusedLinearJSDFunction):
    """``apply(student_input, student_weight, teacher_input, teacher_weight, labels, beta, ignore_index,
    temperature, accum_dtype)`` -> the soft JSD loss."""

    @classmethod
    def forward(cls, ctx, student_input, student_weight, teacher_input, teacher_weight, labels, beta, ignore_index,
                temperature, accum_dtype):
        check_beta(beta)
        return LigerFusedLinearDistillationBase.forward(
            cls, ctx, student_input, student_weight, teacher_input, teacher_weight, labels, None, None,
            ignore_index=ignore_index, weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta, compute_ce_loss=False,
            temperature=temperature, accum_dtype=accum_dtype)

    @staticmethod
    def backward(ctx, grad_output, *args):
        grad_x, grad_w = LigerFusedLinearDistillationBase.backward(ctx, grad_output)[:2]
        return grad_x, grad_w, None, None, None, None, None, None, None


def liger_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None,
                           jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                           accum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The loss of :class:`LigerFusedLinearJSD` (see the module docstring)."""
    if shift_labels is None:
        # Every row counts: any label other than ignore_index does (the soft loss never reads its value).
        shift_labels = torch.full(student_input.shape[:-1], 0 if ignore_index != 0 else 1,
                                  dtype=torch.long, device=student_input.device)
    return _SoftJSDFunction.apply(student_input, student_weight, teacher_input, teacher_weight, shift_labels,
                                  jsd_beta, ignore_index, temperature, accum_dtype)


class LigerFusedLinearJSD(torch.nn.Module):
    """Generalised JSD of fused student and teacher heads; see the module docstring."""

    def __init__(self, jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                 accum_dtype: torch.dtype | None = None):
        super().__init__()
        check_beta(jsd_beta)
        check_temperature(temperature)
        self.jsd_beta, self.ignore_index, self.temperature, self.accum_dtype = (jsd_beta, ignore_index, temperature,
                                                                                accum_dtype)

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels=None):
        return liger_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels,
                                      self.jsd_beta, self.ignore_index, self.temperature, self.accum_dtype)
