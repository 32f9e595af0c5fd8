"""Generalised JSD kernel against the float64 reference (TRL's formula), forward and backward."""

import pytest
import torch

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.jsd import JSDConfig, LigerJSDFunction
from liger_kernel.reference.distillation import jsd_reference
from tests.utils import DEVICE, assert_close, shapes

IGNORE = -100
SHAPES = shapes([(6, 37), (3, 2, 100)], [(512, 32000), (8, 128, 4099)])


def _log_probs(shape, dtype, scale=2.0):
    return (scale * torch.randn(shape, device=DEVICE)).log_softmax(-1).to(dtype)


def _labels(n_rows, vocab, kind):
    if kind == "none":
        return None
    labels = torch.randint(0, vocab, (n_rows,), device=DEVICE)
    if kind == "some_ignored":
        labels[::2] = IGNORE
    else:
        labels[:] = IGNORE
    return labels


def _check(shape, dtype, beta, label_kind, target_grad=True, upstream=1.0):
    x = _log_probs(shape, dtype).requires_grad_()
    y = _log_probs(shape, dtype).requires_grad_(target_grad)
    n_rows = x.numel() // shape[-1]
    labels = _labels(n_rows, shape[-1], label_kind)
    loss = LigerJSDFunction.apply(x, y, labels, beta, IGNORE)
    (loss * upstream).backward()
    x64 = x.detach().double().requires_grad_()
    y64 = y.detach().double().requires_grad_(target_grad)
    expected = jsd_reference(x64, y64, labels, beta, IGNORE)
    (expected * upstream).backward()
    assert loss.dtype == torch.float32
    assert_close(loss, expected, torch.float32, scale=20, msg="loss")
    assert_close(x.grad, x64.grad, dtype, msg="input grad")
    if target_grad:
        assert_close(y.grad, y64.grad, dtype, msg="target grad")
    else:
        assert y.grad is None


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2])
@pytest.mark.parametrize("label_kind", ["none", "some_ignored", "all_ignored"])
def test_jsd_matches_reference(shape, dtype, beta, label_kind):
    # A 32-column block makes every odd vocabulary end in a partial block.
    with override_launch_config(JSDConfig, block_size=32):
        _check(shape, dtype, beta, label_kind)


@pytest.mark.parametrize("beta", [0.0, 0.7, 1.0])
def test_jsd_teacher_without_grad_and_scaled_upstream(beta):
    _check((5, 53), torch.float32, beta, "some_ignored", target_grad=False, upstream=-2.5)


def test_jsd_all_ignored_is_zero_with_zero_grads():
    x = _log_probs((4, 19), torch.float32).requires_grad_()
    y = _log_probs((4, 19), torch.float32)
    loss = LigerJSDFunction.apply(x, y, torch.full((4,), IGNORE, device=DEVICE), 0.5, IGNORE)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(x.grad) == 0


def test_jsd_leaves_logits_intact_for_a_second_use():
    logits = torch.randn(6, 41, device=DEVICE, requires_grad=True)
    teacher = _log_probs((6, 41), torch.float32)
    student = torch.log_softmax(logits, dim=-1)  # log_softmax saves its output for backward
    before = student.detach().clone()
    loss = LigerJSDFunction.apply(student, teacher, None, 0.5, IGNORE)
    weights = torch.randn(6, 41, device=DEVICE)
    (loss + (student * weights).sum()).backward()
    assert torch.equal(student.detach(), before)
    ref_logits = logits.detach().double().requires_grad_()
    ref_student = torch.log_softmax(ref_logits, dim=-1)
    (jsd_reference(ref_student, teacher.double(), None, 0.5) + (ref_student * weights.double()).sum()).backward()
    assert_close(logits.grad, ref_logits.grad, torch.float32, scale=4)


def test_jsd_meta_tensors_give_meta_outputs():
    x = torch.empty(4, 33, device="meta", requires_grad=True)
    y = torch.empty(4, 33, device="meta")
    loss = LigerJSDFunction.apply(x, y, torch.empty(4, dtype=torch.long, device="meta"), 0.5, IGNORE)
    assert loss.device.type == "meta" and loss.shape == ()
    (grad,) = torch.autograd.grad(loss, x)
    assert grad.device.type == "meta" and grad.shape == x.shape


def test_jsd_rejects_bad_arguments():
    x = _log_probs((3, 8), torch.float32)
    with pytest.raises(ValueError, match="beta"):
        LigerJSDFunction.apply(x, x, None, 1.5, IGNORE)
    with pytest.raises(ValueError, match="shape"):
        LigerJSDFunction.apply(x, x[:, :4], None, 0.5, IGNORE)
    with pytest.raises(ValueError, match="shift_labels"):
        LigerJSDFunction.apply(x, x, torch.zeros(2, dtype=torch.long, device=DEVICE), 0.5, IGNORE)
    with pytest.raises(TypeError, match="shift_labels"):
        LigerJSDFunction.apply(x, x, torch.zeros(3, device=DEVICE), 0.5, IGNORE)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_jsd_teacher_zero_probabilities_contribute_their_limit(beta):
    # A teacher with some tokens at probability exactly 0 (log-probability -inf), as after
    # masking its vocabulary: those terms are 0 in the limit, where 0 * -inf would give NaN.
    x = _log_probs((4, 45), torch.float32).requires_grad_()
    logits = 2.0 * torch.randn(4, 45, device=DEVICE)
    logits[:, ::3] = float("-inf")
    y = logits.log_softmax(-1)
    loss = LigerJSDFunction.apply(x, y, None, beta, IGNORE)
    loss.backward()
    x64 = x.detach().double().requires_grad_()
    finite = y.double().clamp_min(-1e4)  # exp(-1e4) is 0 in float64: the same limit, no NaN
    expected = jsd_reference(x64, finite, None, beta)
    expected.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert_close(loss, expected, torch.float32, scale=20)
    assert_close(x.grad, x64.grad, torch.float32)


def test_launch_config_heuristic_search_space_and_validation():
    config = JSDConfig.heuristic(128256)
    assert config.block_size & (config.block_size - 1) == 0 and config.block_size <= 128256
    assert len(set(JSDConfig.search_space(128256))) > 1
    with pytest.raises(ValueError, match="power of two"):
        JSDConfig(block_size=48, num_warps=4)
    with pytest.raises(TypeError):
        with override_launch_config(JSDConfig, block=64):
            pass
