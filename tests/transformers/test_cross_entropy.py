"""LigerCrossEntropyLoss as a drop-in for nn.CrossEntropyLoss (module wiring, buffers, outputs)."""

import pytest
import torch
from torch import nn

from liger_kernel.reference.losses import cross_entropy as reference_cross_entropy
from liger_kernel.transformers import LigerCrossEntropyLoss
from liger_kernel.transformers.cross_entropy import CrossEntropyOutput
from liger_kernel.transformers.functional import liger_cross_entropy
from liger_kernel.transformers.fused_linear_cross_entropy import (
    LigerFusedLinearCrossEntropyLoss,
    liger_fused_linear_cross_entropy,
)
from tests.ops.test_cross_entropy import assert_grad_close, assert_loss_close
from tests.utils import DEVICE


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_matches_nn_cross_entropy(reduction, dtype):
    n_rows, n_cols = 17, 1007
    weight = torch.rand(n_cols, device=DEVICE) + 0.1
    logits = (torch.randn(n_rows, n_cols, device=DEVICE) * 2).to(dtype)
    target = torch.randint(0, n_cols, (n_rows,), device=DEVICE)
    target[::4] = -100
    ours = LigerCrossEntropyLoss(weight=weight, label_smoothing=0.1, reduction=reduction)
    theirs = nn.CrossEntropyLoss(weight=weight.double(), label_smoothing=0.1, reduction=reduction)
    x = logits.clone().requires_grad_()
    ref_x = logits.double().requires_grad_()
    loss = ours(x, target)
    ref = theirs(ref_x, target)
    upstream = (torch.rand_like(ref) + 0.5).to(dtype).double()  # exact in the loss's dtype
    assert loss.dtype == dtype
    loss.backward(upstream.to(dtype))
    ref.backward(upstream)
    assert_loss_close(loss, ref, n_rows)
    assert_grad_close(x.grad, ref_x.grad, dtype)


def test_module_extras_and_named_outputs():
    n_rows, n_cols = 9, 300
    logits = torch.randn(n_rows, n_cols, device=DEVICE) * 3
    target = torch.randint(0, n_cols, (n_rows,), device=DEVICE)
    module = LigerCrossEntropyLoss(
        lse_square_scale=1e-3, softcap=10.0, return_z_loss=True, return_token_accuracy=True, in_place=False
    )
    out = module(logits, target)
    assert isinstance(out, CrossEntropyOutput)
    loss, z_loss, accuracy = out
    ref_loss, ref_z, ref_acc = reference_cross_entropy(logits, target, softcap=10.0, lse_square_scale=1e-3)
    assert_loss_close(loss, ref_loss, n_rows)
    assert_loss_close(z_loss, ref_z, n_rows)
    assert abs(accuracy.item() - ref_acc.item()) < 1e-6
    assert not z_loss.requires_grad and not accuracy.requires_grad
    assert "softcap=10.0" in repr(module)


def test_module_weight_is_a_buffer_that_follows_the_module():
    module = LigerCrossEntropyLoss(weight=torch.ones(5))
    assert "weight" in dict(module.named_buffers())
    assert "weight" not in module.state_dict()  # not persistent, like a loss hyper-parameter
    module.to(torch.float64)
    assert module.weight.dtype == torch.float64


def test_functional_returns_tensor_unless_asked():
    logits = torch.randn(4, 20, device=DEVICE)
    target = torch.randint(0, 20, (4,), device=DEVICE)
    assert isinstance(liger_cross_entropy(logits.clone(), target), torch.Tensor)
    out = liger_cross_entropy(logits.clone(), target, return_z_loss=True)
    assert out.z_loss is not None and out.token_accuracy is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loss_has_torchs_dtype(dtype):
    """The loss can be compared and combined with torch's: same dtype (computed in fp32)."""
    logits = torch.randn(8, 100, device=DEVICE).to(dtype)
    target = torch.randint(0, 100, (8,), device=DEVICE)
    expected = nn.CrossEntropyLoss()(logits, target)
    ours = LigerCrossEntropyLoss()(logits, target)
    assert ours.dtype == expected.dtype == dtype
    exact = nn.CrossEntropyLoss()(logits.double(), target)
    torch.testing.assert_close(ours.double(), exact, rtol=torch.finfo(dtype).eps, atol=1e-6)
    rows = liger_cross_entropy(logits, target, reduction="none", return_z_loss=True)
    assert rows.loss.dtype == rows.z_loss.dtype == dtype


def test_fused_linear_loss_is_float32_like_hf_causal_lm_loss():
    x = torch.randn(6, 8, device=DEVICE).bfloat16()
    weight = torch.randn(30, 8, device=DEVICE).bfloat16()
    target = torch.randint(0, 30, (6,), device=DEVICE)
    hf = nn.functional.cross_entropy(nn.functional.linear(x, weight).float(), target)  # HF upcasts the logits
    ours = liger_fused_linear_cross_entropy(x, weight, target)
    assert ours.dtype == hf.dtype == torch.float32


def test_meta_tensors_give_meta_outputs():
    """Shape inference on meta tensors, forward and backward, modules and functions."""
    logits = torch.empty(6, 50, device="meta", dtype=torch.bfloat16, requires_grad=True)
    target = torch.empty(6, device="meta", dtype=torch.long)
    for reduction, shape in (("mean", ()), ("none", (6,))):
        loss = LigerCrossEntropyLoss(reduction=reduction)(logits, target)
        assert loss.device.type == "meta" and loss.shape == shape and loss.dtype == torch.bfloat16
        loss.sum().backward()
        assert logits.grad.device.type == "meta" and logits.grad.shape == logits.shape
        logits.grad = None
    out = liger_cross_entropy(logits, target, return_z_loss=True, return_token_accuracy=True)
    assert all(t.device.type == "meta" for t in out)
    x = torch.empty(6, 8, device="meta", requires_grad=True)
    weight = torch.empty(50, 8, device="meta", requires_grad=True)
    bias = torch.empty(50, device="meta", requires_grad=True)
    for reduction, shape in (("mean", ()), ("none", (6,))):
        loss = LigerFusedLinearCrossEntropyLoss(reduction=reduction)(weight, x, target, bias)
        assert loss.device.type == "meta" and loss.shape == shape and loss.dtype == torch.float32
        loss.sum().backward()
        assert weight.grad.shape == weight.shape and x.grad.shape == x.shape and bias.grad.shape == bias.shape
        assert weight.grad.device.type == "meta"
        x.grad = weight.grad = bias.grad = None
    assert liger_fused_linear_cross_entropy(x, weight, target).device.type == "meta"


def test_options_are_one_validated_value():
    module = LigerCrossEntropyLoss(label_smoothing=0.1)
    assert module.options.label_smoothing == 0.1 and module.label_smoothing == 0.1
    module.reduction = "sum"
    assert module.options.reduction == "sum"
    with pytest.raises(ValueError, match="reduction"):
        module.reduction = "avg"
    with pytest.raises(ValueError, match="label_smoothing"):
        LigerFusedLinearCrossEntropyLoss(label_smoothing=1.5)
    with pytest.raises(TypeError, match="ignore_index"):
        LigerCrossEntropyLoss(ignore_index=-100.5)


def test_loss_dtype_float32_is_hf_causal_lm_loss():
    """``loss_dtype=torch.float32`` (the patched causal-LM loss) gives HF's float32 loss, which
    upcasts the logits: not a bf16-rounded value."""
    logits = (torch.randn(16, 200, device=DEVICE) * 3).bfloat16()
    target = torch.randint(0, 200, (16,), device=DEVICE)
    hf = nn.functional.cross_entropy(logits.float(), target)
    ours = liger_cross_entropy(logits, target, in_place=False, loss_dtype=torch.float32)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf, rtol=2e-5, atol=1e-5)
    with pytest.raises(TypeError, match="loss_dtype"):
        liger_cross_entropy(logits, target, loss_dtype=torch.int64)
