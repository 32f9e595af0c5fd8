"""``LigerTVDLoss`` / ``liger_tvd``: the callers' names, defaults and call convention."""

import pytest
import torch

from liger_kernel.reference.distillation import tvd_reference
from tests.utils import DEVICE, assert_close


def test_exported_names_resolve():
    from liger_kernel.transformers import LigerTVDLoss, liger_tvd

    assert LigerTVDLoss().reduction == "batchmean" and callable(liger_tvd)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "batchmean"])
def test_module_with_shift_labels(reduction):
    from liger_kernel.transformers import LigerTVDLoss

    p = torch.randn(8, 31, device=DEVICE).softmax(-1).requires_grad_()
    q = torch.randn(8, 31, device=DEVICE).softmax(-1)
    labels = torch.randint(0, 31, (8,), device=DEVICE)
    labels[1::3] = -100
    out = LigerTVDLoss(reduction=reduction)(p, q, labels)
    p64 = p.detach().double().requires_grad_()
    expected = tvd_reference(p64, q.double(), labels, reduction)
    upstream = torch.randn_like(expected)
    (out * upstream.float()).sum().backward()
    (expected * upstream).sum().backward()
    assert_close(out, expected, torch.float32, scale=20)
    assert_close(p.grad, p64.grad, torch.float32)


def test_functional_default_is_mean():
    from liger_kernel.transformers import liger_tvd

    p = torch.randn(3, 11, device=DEVICE).softmax(-1)
    q = torch.randn(3, 11, device=DEVICE).softmax(-1)
    assert_close(liger_tvd(p, q), tvd_reference(p.double(), q.double(), reduction="mean"), torch.float32, scale=20)


def test_traces_as_one_graph():
    from liger_kernel.transformers import liger_tvd

    def step(logits, q, labels):
        return liger_tvd(logits.softmax(-1), q, labels, "batchmean")

    logits = torch.randn(5, 29, device=DEVICE, requires_grad=True)
    q = torch.randn(5, 29, device=DEVICE).softmax(-1)
    labels = torch.tensor([1, -100, 2, 3, 4], device=DEVICE)
    eager = step(logits, q, labels)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    traced = torch.compile(step, backend="aot_eager", fullgraph=True)(logits, q, labels)
    (traced_grad,) = torch.autograd.grad(traced, logits)
    assert_close(traced, eager, torch.float32)
    assert_close(traced_grad, eager_grad, torch.float32)
