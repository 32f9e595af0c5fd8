"""LigerCrossEntropyLoss as a drop-in for nn.CrossEntropyLoss (module wiring, buffers, outputs)."""

import pytest
import torch
from torch import nn

from liger_kernel.transformers import LigerCrossEntropyLoss
from liger_kernel.transformers.cross_entropy import CrossEntropyOutput
from liger_kernel.transformers.functional import liger_cross_entropy
from tests.ops.test_cross_entropy import assert_grad_close, assert_loss_close, reference_cross_entropy
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
    upstream = torch.rand_like(ref) + 0.5
    loss.backward(upstream.float())
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
