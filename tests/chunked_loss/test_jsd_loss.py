"""Generalised JSD distillation on fused heads against TRL's GKD formula on float64 logits.

beta 0 / 1 (forward / reverse KL) and in between, temperature != 1, hard and soft weights,
ignored rows (and a batch with every row ignored), a teacher with a larger (padded)
vocabulary and another hidden size, (B, T, D) inputs, chunks that cut the rows, fp32 and bf16.
"""

import pytest
import torch

from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
from liger_kernel.chunked_loss.functional import liger_fused_linear_jsd
from liger_kernel.chunked_loss.fused_linear_distillation import (
    LigerFusedLinearDistillationBase,  # as axolotl imports it
)
from tests.chunked_loss.reference import generalized_jsd_reference, run_distillation_case
from tests.utils import DEVICE


def jsd_case(beta, weight_hard_loss=0.5, weight_soft_loss=0.5, temperature=1.0, dtype=torch.float32, n_rows=13,
             student_hidden=16, teacher_hidden=24, vocab=37, returns_parts=False, **kwargs):
    loss_fn = LigerFusedLinearJSDLoss(weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta,
                                      temperature=temperature, return_soft_hard_loss=returns_parts)
    return run_distillation_case(loss_fn, lambda s, t: generalized_jsd_reference(s, t, beta), weight_hard_loss, weight_soft_loss, temperature, dtype, n_rows,
                                 student_hidden, teacher_hidden, vocab, returns_parts=returns_parts, **kwargs)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature, weights", [(1.0, (0.5, 0.5)), (2.0, (0.0, 1.0)), (0.7, (0.8, 0.3))])
def test_matches_float64(beta, temperature, weights):
    jsd_case(beta, *weights, temperature=temperature)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bf16(beta):
    jsd_case(beta, 0.3, 0.7, temperature=1.5, dtype=torch.bfloat16, n_rows=9, student_hidden=32, teacher_hidden=32,
             vocab=53)


@pytest.mark.parametrize("case", [
    dict(teacher_vocab=41),  # teacher head padded beyond the student's vocabulary
    dict(leading=(3, 5), n_rows=15, with_bias=False),  # (B, T, D) inputs and (B, T) labels
    dict(chunk_rows=4),  # several chunks
    dict(chunk_rows=1, n_rows=5, vocab=2),  # one row per chunk, V = 2
    dict(all_ignored=True),
    dict(returns_parts=True, temperature=3.0),
])
def test_options(case):
    jsd_case(0.4, 0.6, 0.9, **case)


def test_gkd_call_shape_and_functional():
    """TRL's GKD trainer: ``LigerFusedLinearJSDLoss(beta=..., ignore_index=-100, temperature=..., compiled=False,
    weight_hard_loss=0.0, weight_soft_loss=1.0)`` called with keywords; the functional form takes the
    Function's positional order."""
    loss_fn = LigerFusedLinearJSDLoss(beta=0.2, ignore_index=-100, temperature=1.3, compiled=False,
                                      weight_hard_loss=0.0, weight_soft_loss=1.0)
    xs, xt = torch.randn(6, 8, device=DEVICE), torch.randn(6, 12, device=DEVICE)
    ws, wt = torch.randn(17, 8, device=DEVICE), torch.randn(17, 12, device=DEVICE)
    labels = torch.tensor([3, -100, 4, 5, -100, 16], device=DEVICE)
    a = xs.clone().requires_grad_()
    loss = loss_fn(student_input=a, student_weight=ws, teacher_input=xt, teacher_weight=wt, true_labels=labels,
                   student_bias=None, teacher_bias=None)
    loss.backward()
    b = xs.clone().requires_grad_()
    loss_f = liger_fused_linear_jsd(b, ws, xt, wt, labels, None, None, 0.0, 1.0, 0.2, -100, 1.3)
    loss_f.backward()
    torch.testing.assert_close(loss_f, loss.detach())
    torch.testing.assert_close(b.grad, a.grad)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="beta"):
        LigerFusedLinearJSDLoss(beta=1.5)
    with pytest.raises(ValueError, match="beta"):
        LigerFusedLinearJSDLoss(beta=True)
    with pytest.raises(ValueError, match="temperature"):
        LigerFusedLinearJSDLoss(temperature=0.0)
    loss_fn = LigerFusedLinearJSDLoss()
    with pytest.raises(ValueError, match="smaller"):
        loss_fn(torch.randn(4, 8, device=DEVICE), torch.randn(9, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE), torch.randn(7, 8, device=DEVICE), torch.zeros(4, device=DEVICE).long())
    with pytest.raises(ValueError, match="target"):
        loss_fn(torch.randn(4, 8, device=DEVICE), torch.randn(9, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE), torch.randn(9, 8, device=DEVICE), torch.zeros(3, device=DEVICE).long())
    with pytest.raises(ValueError, match="labels"):
        loss_fn(torch.randn(4, 8, device=DEVICE), torch.randn(9, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE), torch.randn(9, 8, device=DEVICE), torch.full((4,), 9, device=DEVICE))


class _ForwardKLFunction(LigerFusedLinearDistillationBase):
    """A subclass written the way downstream trainers extend the base: a loss hook returning the chunk's
    sum, ``super().forward(cls=cls, ctx=ctx, ...)`` with keywords, and the base's backward sliced."""

    @staticmethod
    def distillation_loss_fn(student_logits, teacher_logits, target=None, ignore_index=-100, **kwargs):
        kl = torch.nn.functional.kl_div(student_logits.log_softmax(-1), teacher_logits.softmax(-1),
                                        reduction="none").sum(-1)
        if target is not None:
            kl = kl.masked_fill(target == ignore_index, 0.0)
        return kl.sum()

    @classmethod
    def forward(cls, ctx, student_input, student_weight, teacher_input, teacher_weight, target, student_bias=None,
                teacher_bias=None, temperature=4.0, compiled=True, chunk_size=1024):
        return super().forward(cls=cls, ctx=ctx, student_input=student_input, student_weight=student_weight,
                               teacher_input=teacher_input, teacher_weight=teacher_weight, target=target,
                               student_bias=student_bias, teacher_bias=teacher_bias, chunk_size=chunk_size,
                               ignore_index=-100, weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5,
                               compute_ce_loss=False, temperature=temperature, compiled=compiled)

    @staticmethod
    def backward(ctx, grad_output, *args):
        grads = LigerFusedLinearDistillationBase.backward(ctx, grad_output, *args)[:6]
        return (*grads, None, None, None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subclass_of_the_base(dtype):
    def call(xs, ws, xt, wt, labels, bs, bt):
        return _ForwardKLFunction.apply(xs, ws, xt, wt, labels, bs, bt, 2.0)

    run_distillation_case(call, lambda s, t: generalized_jsd_reference(s, t, 0.0), 0.0, 1.0, 2.0, dtype, 10, 16, 16,
                          29, chunk_rows=4)


def test_bf16_hidden_states_with_float32_heads():
    """Hidden states in bf16, heads kept in float32: computed as with the hidden states upcast."""
    xs, xt = torch.randn(7, 8, device=DEVICE).bfloat16(), torch.randn(7, 12, device=DEVICE).bfloat16()
    ws, wt = torch.randn(17, 8, device=DEVICE), torch.randn(17, 12, device=DEVICE)
    labels = torch.tensor([3, -100, 4, 5, -100, 16, 0], device=DEVICE)
    loss_fn = LigerFusedLinearJSDLoss(beta=0.3, temperature=1.2)
    mixed = [xs.clone().requires_grad_(), ws.clone().requires_grad_()]
    upcast = [xs.float().requires_grad_(), ws.clone().requires_grad_()]
    losses = [loss_fn(a, w, t, wt, labels) for (a, w), t in ((mixed, xt), (upcast, xt.float()))]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1])
    assert mixed[0].grad.dtype == torch.bfloat16
    torch.testing.assert_close(mixed[0].grad, upcast[0].grad.bfloat16())
    torch.testing.assert_close(mixed[1].grad, upcast[1].grad)


def test_hard_loss_reported_at_weight_zero():
    """TRL's weights (hard 0, soft 1): the cross-entropy is still reported when asked for."""
    jsd_case(0.2, 0.0, 1.0, temperature=1.4, returns_parts=True)
