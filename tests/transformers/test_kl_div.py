"""``LigerKLDIVLoss`` / ``liger_kl_div``: drop-in for ``nn.KLDivLoss`` / ``F.kl_div``."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.utils import DEVICE, assert_close


def test_exported_names_resolve():
    from liger_kernel.transformers import LigerKLDIVLoss, liger_kl_div

    assert issubclass(LigerKLDIVLoss, nn.KLDivLoss) and callable(liger_kl_div)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "batchmean"])
@pytest.mark.parametrize("log_target", [False, True])
def test_module_is_a_drop_in_for_torch(reduction, log_target):
    from liger_kernel.transformers import LigerKLDIVLoss

    x = torch.randn(3, 4, 29, device=DEVICE).log_softmax(-1).requires_grad_()
    t = torch.randn(3, 4, 29, device=DEVICE).log_softmax(-1)
    t = t if log_target else t.exp()
    ours = LigerKLDIVLoss(reduction=reduction, log_target=log_target)
    assert ours.eps == 1e-10 and ours.reduction == reduction
    out = ours(x, t)
    x64 = x.detach().double().requires_grad_()
    expected = nn.KLDivLoss(reduction=reduction, log_target=log_target)(x64, t.double())
    upstream = torch.randn_like(expected)
    (out * upstream.float()).sum().backward()
    (expected * upstream).sum().backward()
    assert_close(out, expected, torch.float32, scale=20)
    assert_close(x.grad, x64.grad, torch.float32)


def test_functional_follows_torch_defaults_and_legacy_flags():
    from liger_kernel.transformers import liger_kl_div

    x = torch.randn(5, 13, device=DEVICE).log_softmax(-1)
    t = torch.randn(5, 13, device=DEVICE).softmax(-1)
    assert_close(liger_kl_div(x, t), F.kl_div(x.double(), t.double()), torch.float32, scale=20)
    assert_close(liger_kl_div(x, t, size_average=False), F.kl_div(x.double(), t.double(), reduction="sum"),
                 torch.float32, scale=20)


def test_traces_as_one_graph():
    from liger_kernel.transformers import LigerKLDIVLoss

    loss_fn = LigerKLDIVLoss(reduction="batchmean", log_target=True)

    def step(logits, target):
        return loss_fn(logits.log_softmax(-1), target)

    logits = torch.randn(5, 29, device=DEVICE, requires_grad=True)
    target = torch.randn(5, 29, device=DEVICE).log_softmax(-1)
    eager = step(logits, target)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    traced = torch.compile(step, backend="aot_eager", fullgraph=True)(logits, target)
    (traced_grad,) = torch.autograd.grad(traced, logits)
    assert_close(traced, eager, torch.float32)
    assert_close(traced_grad, eager_grad, torch.float32)
