"""KL-divergence kernels against torch's ``kl_div`` in float64, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.kl_div import KLDivConfig, LigerKLDivLossFunction
from tests.utils import DEVICE, assert_close, shapes

SHAPES = shapes([(5, 37), (2, 3, 100)], [(512, 32000), (8, 64, 4099)])
REDUCTIONS = ["none", "sum", "mean", "batchmean"]


def _inputs(shape, dtype, log_target, target_grad=True):
    x = (2.0 * torch.randn(shape, device=DEVICE)).log_softmax(-1).to(dtype).requires_grad_()
    t = (2.0 * torch.randn(shape, device=DEVICE)).log_softmax(-1)
    t = (t if log_target else t.exp()).to(dtype).requires_grad_(target_grad)
    return x, t


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_matches_torch(shape, dtype, reduction, log_target):
    x, t = _inputs(shape, dtype, log_target)
    with override_launch_config(KLDivConfig, block_size=32):
        out = LigerKLDivLossFunction.apply(x, t, reduction, log_target, 0.0)
    x64 = x.detach().double().requires_grad_()
    t64 = t.detach().double().requires_grad_()
    expected = F.kl_div(x64, t64, reduction=reduction, log_target=log_target)
    upstream = torch.randn_like(expected)
    with override_launch_config(KLDivConfig, block_size=32):
        (out * upstream.to(out.dtype)).sum().backward()
    (expected * upstream).sum().backward()
    assert out.shape == expected.shape
    if reduction == "none":
        assert out.dtype == dtype
        assert_close(out, expected, dtype, msg="elements")
    else:
        assert out.dtype == torch.float32
        assert_close(out, expected, torch.float32, scale=20, msg="loss")
    # A per-element upstream gradient in bf16 is itself rounded: one more rounding.
    scale = 2.0 if reduction == "none" and dtype != torch.float32 else 1.0
    assert_close(x.grad, x64.grad, dtype, scale=scale, msg="input grad")
    assert_close(t.grad, t64.grad, dtype, scale=scale, msg="target grad")


def test_kl_div_zero_targets_contribute_zero_and_eps_matters_only_below_it():
    x, t = _inputs((4, 29), torch.float32, False, target_grad=False)
    t = t.detach().clone()
    t[:, :5] = 0.0
    out = LigerKLDivLossFunction.apply(x, t, "sum", False, 1e-10)
    out.backward()
    x64 = x.detach().double().requires_grad_()
    expected = F.kl_div(x64, t.double(), reduction="sum")
    expected.backward()
    assert_close(out, expected, torch.float32, scale=20)
    assert_close(x.grad, x64.grad, torch.float32)
    negative = t.clone()
    negative[0, 7] = -0.1
    assert torch.isnan(LigerKLDivLossFunction.apply(x.detach(), negative, "sum", False, 1e-10))


def test_kl_div_second_use_of_input_sees_its_values():
    logits = torch.randn(3, 23, device=DEVICE, requires_grad=True)
    log_probs = logits.log_softmax(-1)
    before = log_probs.detach().clone()
    t = torch.randn(3, 23, device=DEVICE).softmax(-1)
    loss = LigerKLDivLossFunction.apply(log_probs, t, "batchmean", False, 1e-10) + log_probs.pow(2).sum()
    loss.backward()
    assert torch.equal(log_probs.detach(), before)
    ref = logits.detach().double().requires_grad_()
    ref_lp = ref.log_softmax(-1)
    (F.kl_div(ref_lp, t.double(), reduction="batchmean") + ref_lp.pow(2).sum()).backward()
    assert_close(logits.grad, ref.grad, torch.float32, scale=4)


@pytest.mark.parametrize("reduction", ["none", "batchmean"])
def test_kl_div_meta_tensors_give_meta_outputs(reduction):
    x = torch.empty(4, 33, device="meta", requires_grad=True)
    t = torch.empty(4, 33, device="meta")
    out = LigerKLDivLossFunction.apply(x, t, reduction, False, 1e-10)
    assert out.device.type == "meta" and out.shape == (x.shape if reduction == "none" else ())
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert grad.device.type == "meta" and grad.shape == x.shape


def test_kl_div_rejects_bad_arguments():
    x, t = _inputs((3, 8), torch.float32, False)
    with pytest.raises(ValueError, match="reduction"):
        LigerKLDivLossFunction.apply(x, t, "avg", False, 1e-10)
    with pytest.raises(ValueError, match="shape"):
        LigerKLDivLossFunction.apply(x, t[:, :3], "sum", False, 1e-10)
