"""The preference losses used the way their callers use them (TRL's DPO and KTO trainers, the
functional forms, and subclasses of the base in the style downstream projects write)."""

import pytest
import torch
import torch.nn.functional as F

from liger_kernel.chunked_loss import (
    LigerFusedLinearDPOLoss,
    LigerFusedLinearKTOLoss,
    LigerFusedLinearPreferenceBase,
    liger_fused_linear_dpo,
)
from liger_kernel.chunked_loss.functional import liger_fused_linear_kto
from tests.chunked_loss.test_preference import make_batch, make_ref_head
from tests.utils import DEVICE


def test_trl_dpo_call():
    """TRL's ``_compute_loss_liger``: positional ``(weight, hidden, labels, bias, ref_hidden, ref_weight,
    ref_bias)``, a bias-free head, and seven metrics."""
    x, weight, _, target = make_batch(4, 6, 16, 41, torch.float32, with_bias=False)
    ref_x, ref_w, _ = make_ref_head(x, weight, None)
    hidden = x.requires_grad_()
    lm_weight = weight.requires_grad_()
    loss_fn = LigerFusedLinearDPOLoss(beta=0.1, loss_type="sigmoid")
    loss, metrics = loss_fn(lm_weight, hidden, target, None, ref_x, ref_w, None)
    chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss, chosen_r, rejected_r = metrics
    assert chosen_logps.shape == rejected_logps.shape == chosen_r.shape == rejected_r.shape == (2,)
    assert chosen_logits_mean.dim() == rejected_logits_mean.dim() == nll_loss.dim() == 0
    loss.backward()
    assert hidden.grad.shape == hidden.shape and lm_weight.grad.shape == lm_weight.shape


def test_trl_kto_call_on_a_sliced_hidden_state():
    """TRL's KTO passes ``last_hidden_state[:, :-1]`` (not contiguous) by keyword and unpacks six sums."""
    x, weight, bias, target = make_batch(3, 5, 16, 23, torch.float32, with_bias=True)
    full = torch.randn(3, 6, 16, device=DEVICE, requires_grad=True)
    ref_x, ref_w, ref_b = make_ref_head(x, weight, bias)
    loss_fn = LigerFusedLinearKTOLoss(beta=0.1, use_ref_model=True)
    loss, (c_logps, r_logps, c_logits, r_logits, c_rewards, r_rewards) = loss_fn(
        _input=full[:, :-1], lin_weight=weight, target=target, bias=bias,
        preference_labels=torch.tensor([True, False, True], device=DEVICE), ref_input=ref_x, ref_weight=ref_w,
        ref_bias=ref_b, kl=torch.zeros(1, device=DEVICE))
    for m in (c_logps, r_logps, c_logits, r_logits, c_rewards, r_rewards):
        assert m.dim() == 0
    loss.backward()
    assert full.grad.shape == full.shape and bool((full.grad[:, -1] == 0).all())


def test_functional_forms_take_the_function_arguments():
    x, weight, bias, target = make_batch(4, 3, 8, 19, torch.float32, with_bias=True)
    module_loss, _ = LigerFusedLinearDPOLoss(beta=0.3, use_ref_model=False)(weight, x, target, bias)
    loss, metrics = liger_fused_linear_dpo(x, weight, target, bias, None, None, None, -100, 0.3, False, True, False)
    torch.testing.assert_close(loss, module_loss)
    labels = torch.tensor([True, False, False, True], device=DEVICE)
    loss, metrics = liger_fused_linear_kto(x, weight, target, labels, bias, None, None, None, None, -100, 0.1, True,
                                           False)
    assert loss.dim() == 0 and len(metrics) == 6


class ReferenceFreeSigmoid(LigerFusedLinearPreferenceBase):
    """A downstream subclass in the documented style."""

    @staticmethod
    def preference_loss_fn(chosen_logps, rejected_logps, full_target, beta=0.1, margin=0.0):
        losses = -F.logsigmoid(beta * (chosen_logps - rejected_logps) - margin)
        return losses.sum() / (full_target.shape[0] // 2), chosen_logps - rejected_logps

    @classmethod
    def forward(cls, ctx, _input, weight, target, bias=None, beta=0.1, margin=0.0):
        return super().forward(cls=cls, ctx=ctx, _input=_input, weight=weight, target=target, bias=bias, beta=beta,
                               compute_nll_loss=False, average_log_prob=False, margin=margin)

    @staticmethod
    def backward(ctx, *grad_output):
        grads = LigerFusedLinearPreferenceBase.backward(ctx, grad_output)[:4]
        return *grads, None, None


def test_subclass_matches_dpo_without_reference():
    x, weight, bias, target = make_batch(6, 4, 8, 17, torch.float32, with_bias=True)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    loss, metrics = ReferenceFreeSigmoid.apply(*leaves[:2], target, leaves[2], 0.4)
    loss.backward()
    assert metrics[-1].shape == (3,)
    expected = [t.clone().requires_grad_() for t in (x, weight, bias)]
    dpo_loss, _ = LigerFusedLinearDPOLoss(beta=0.4, use_ref_model=False)(expected[1], expected[0], target, expected[2])
    dpo_loss.backward()
    torch.testing.assert_close(loss, dpo_loss)
    for a, b in zip(leaves, expected):
        torch.testing.assert_close(a.grad, b.grad)


def test_bad_arguments_raise():
    x, weight, bias, target = make_batch(4, 3, 8, 19, torch.float32, with_bias=True)
    with pytest.raises(ValueError, match="loss_type"):
        LigerFusedLinearDPOLoss(loss_type="nope")
    with pytest.raises(ValueError, match="exo_pair"):
        LigerFusedLinearDPOLoss(loss_type="exo_pair")
    with pytest.raises(ValueError, match="f_divergence_type"):
        LigerFusedLinearDPOLoss(f_divergence_type="hellinger")
    with pytest.raises(ValueError, match="f_divergence_type"):
        LigerFusedLinearDPOLoss(loss_type=["sigmoid", "nca_pair"], f_divergence_type="js_divergence")
    with pytest.raises(ValueError, match="loss_weights"):
        LigerFusedLinearDPOLoss(loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="at least one"):
        LigerFusedLinearDPOLoss(loss_type=[])
    with pytest.raises(ValueError, match="label_smoothing"):
        LigerFusedLinearDPOLoss(loss_type="aot", label_smoothing=0.7)
    with pytest.raises(ValueError, match="use_weighting"):
        LigerFusedLinearDPOLoss(loss_type=["sigmoid", "aot"], use_weighting=True)
    with pytest.raises(ValueError, match="ld_alpha"):
        LigerFusedLinearDPOLoss(ld_alpha=1.5)
    with pytest.raises(ValueError, match="ld_alpha"):
        LigerFusedLinearDPOLoss(ld_alpha=0.5, average_log_prob=True)
    with pytest.raises(ValueError, match="use_weighting"):
        LigerFusedLinearDPOLoss(loss_type=["sigmoid", "sft"], use_weighting=True)
    with pytest.raises(ValueError, match="use_ref_model"):
        LigerFusedLinearDPOLoss()(weight, x, target, bias)
    with pytest.raises(ValueError, match="even"):
        LigerFusedLinearDPOLoss(use_ref_model=False)(weight, x[:3], target[:3], bias)
    with pytest.raises(ValueError, match="target"):
        LigerFusedLinearDPOLoss(use_ref_model=False)(weight, x, target[:, :2], bias)
    with pytest.raises(ValueError, match="preference_labels"):
        LigerFusedLinearKTOLoss()(x, weight, target, bias)


def test_under_autocast_like_a_mixed_precision_trainer():
    """fp32 parameters and hidden states under bf16 autocast: the head runs in bf16 (as F.linear
    would), the gradients come back in fp32, equal to those of the same call on bf16 casts."""
    x, weight, bias, target = make_batch(4, 5, 16, 37, torch.float32, with_bias=True)
    ref_x, ref_w, ref_b = make_ref_head(x, weight, bias)
    loss_fn = LigerFusedLinearDPOLoss(beta=0.2)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss, _ = loss_fn(leaves[1], leaves[0], target, leaves[2], ref_x, ref_w, ref_b)
    loss.backward()
    cast = [t.bfloat16().requires_grad_() for t in (x, weight, bias)]
    expected, _ = loss_fn(cast[1], cast[0], target, cast[2], ref_x.bfloat16(), ref_w.bfloat16(), ref_b.bfloat16())
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for got, want in zip(leaves, cast):
        assert got.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad, want.grad.float())
