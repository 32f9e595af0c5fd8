"""``LigerJSD`` / ``liger_jsd``: the callers' names and call convention, against the reference."""

import pytest
import torch

from liger_kernel.reference.distillation import jsd_reference
from tests.utils import DEVICE, assert_close


def test_exported_names_resolve():
    from liger_kernel.transformers import LigerJSD, liger_jsd
    from liger_kernel.transformers.jsd import LigerJSD as direct

    assert LigerJSD is direct and callable(liger_jsd)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_module_takes_student_then_teacher(beta):
    from liger_kernel.transformers import LigerJSD

    student_logits = torch.randn(2, 5, 43, device=DEVICE, requires_grad=True)
    teacher = torch.randn(2, 5, 43, device=DEVICE).log_softmax(-1)
    labels = torch.randint(0, 43, (10,), device=DEVICE)
    labels[3:6] = -1
    loss_fn = LigerJSD(beta=beta, ignore_index=-1)
    loss = loss_fn(student_logits.log_softmax(-1).view(-1, 43), teacher.view(-1, 43), labels)
    loss.backward()
    ref_logits = student_logits.detach().double().requires_grad_()
    expected = jsd_reference(ref_logits.log_softmax(-1).view(-1, 43), teacher.double().view(-1, 43), labels, beta, -1)
    expected.backward()
    assert_close(loss, expected, torch.float32, scale=20)
    assert_close(student_logits.grad, ref_logits.grad, torch.float32, scale=4)
    assert "beta" in repr(loss_fn)


def test_functional_default_is_half_mixture():
    from liger_kernel.transformers import liger_jsd

    x = torch.randn(4, 17, device=DEVICE).log_softmax(-1)
    y = torch.randn(4, 17, device=DEVICE).log_softmax(-1)
    assert_close(liger_jsd(x, y), jsd_reference(x.double(), y.double(), None, 0.5), torch.float32, scale=20)


def test_traces_as_one_graph():
    from liger_kernel.transformers import liger_jsd

    def step(logits, teacher, labels):
        return liger_jsd(logits.log_softmax(-1), teacher, labels, 0.3)

    logits = torch.randn(6, 37, device=DEVICE, requires_grad=True)
    teacher = torch.randn(6, 37, device=DEVICE).log_softmax(-1)
    labels = torch.tensor([1, -100, 2, 3, -100, 4], device=DEVICE)
    eager = step(logits, teacher, labels)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    traced = torch.compile(step, backend="aot_eager", fullgraph=True)(logits, teacher, labels)
    (traced_grad,) = torch.autograd.grad(traced, logits)
    assert_close(traced, eager, torch.float32)
    assert_close(traced_grad, eager_grad, torch.float32)
