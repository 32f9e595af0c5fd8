"""Total variation distance kernels against the float64 reference, forward and backward."""

import pytest
import torch

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.tvd import LigerTVDLossFunction, TVDConfig
from liger_kernel.reference.distillation import tvd_reference
from tests.utils import DEVICE, assert_close, shapes

IGNORE = -100
SHAPES = shapes([(6, 37), (2, 3, 100)], [(512, 32000), (8, 64, 4099)])


def _probs(shape, dtype):
    return (2.0 * torch.randn(shape, device=DEVICE)).softmax(-1).to(dtype).requires_grad_()


def _labels(n_rows, vocab, kind):
    if kind == "none":
        return None
    labels = torch.randint(0, vocab, (n_rows,), device=DEVICE)
    labels[::2 if kind == "some_ignored" else 1] = IGNORE
    return labels


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "batchmean"])
@pytest.mark.parametrize("label_kind", ["none", "some_ignored", "all_ignored"])
def test_tvd_matches_reference(shape, dtype, reduction, label_kind):
    p, q = _probs(shape, dtype), _probs(shape, dtype)
    labels = _labels(p.numel() // shape[-1], shape[-1], label_kind)
    with override_launch_config(TVDConfig, block_size=32):
        out = LigerTVDLossFunction.apply(p, q, labels, reduction, IGNORE)
    p64, q64 = p.detach().double().requires_grad_(), q.detach().double().requires_grad_()
    expected = tvd_reference(p64, q64, labels, reduction, IGNORE)
    upstream = torch.randn_like(expected)
    with override_launch_config(TVDConfig, block_size=32):
        (out * upstream.to(out.dtype)).sum().backward()
    (expected * upstream).sum().backward()
    assert out.shape == expected.shape
    assert_close(out, expected, dtype if reduction == "none" else torch.float32,
                 scale=1 if reduction == "none" else 20, msg="loss")
    scale = 2.0 if reduction == "none" and dtype != torch.float32 else 1.0
    assert_close(p.grad, p64.grad, dtype, scale=scale, msg="p grad")
    assert_close(q.grad, q64.grad, dtype, scale=scale, msg="q grad")


def test_tvd_gradient_is_zero_where_p_equals_q():
    p = _probs((3, 17), torch.float32)
    q = p.detach().clone()
    q[:, 5:] = _probs((3, 12), torch.float32).detach() * q[:, 5:].sum(-1, keepdim=True)
    LigerTVDLossFunction.apply(p, q, None, "sum", IGNORE).backward()
    assert torch.count_nonzero(p.grad[:, :5]) == 0
    assert torch.count_nonzero(p.grad[:, 5:]) > 0


def test_tvd_second_use_of_inputs_sees_their_values():
    logits = torch.randn(4, 29, device=DEVICE, requires_grad=True)
    p = logits.softmax(-1)  # softmax saves its output for backward
    q = torch.randn(4, 29, device=DEVICE).softmax(-1)
    before = p.detach().clone()
    (LigerTVDLossFunction.apply(p, q, None, "batchmean", IGNORE) + (p * p).sum()).backward()
    assert torch.equal(p.detach(), before)
    ref = logits.detach().double().requires_grad_()
    ref_p = ref.softmax(-1)
    (tvd_reference(ref_p, q.double()) + (ref_p * ref_p).sum()).backward()
    assert_close(logits.grad, ref.grad, torch.float32, scale=4)


def test_tvd_meta_tensors_give_meta_outputs():
    p = torch.empty(4, 33, device="meta", requires_grad=True)
    out = LigerTVDLossFunction.apply(p, torch.empty(4, 33, device="meta"), None, "batchmean", IGNORE)
    assert out.device.type == "meta" and out.shape == ()
    (grad,) = torch.autograd.grad(out, p)
    assert grad.device.type == "meta" and grad.shape == p.shape


def test_tvd_rejects_bad_arguments():
    p = _probs((3, 8), torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        LigerTVDLossFunction.apply(p, p, None, "avg", IGNORE)
    with pytest.raises(ValueError, match="shift_labels"):
        LigerTVDLossFunction.apply(p, p, torch.zeros(5, dtype=torch.long, device=DEVICE), "sum", IGNORE)


def test_tvd_ignored_rows_may_hold_anything():
    p = _probs((4, 21), torch.float32)
    q = _probs((4, 21), torch.float32).detach().clone()
    q[1] = float("nan")  # e.g. an uninitialised padding row
    labels = torch.tensor([3, IGNORE, 5, 7], device=DEVICE)
    loss = LigerTVDLossFunction.apply(p, q, labels, "sum", IGNORE)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(p.grad).all() and torch.count_nonzero(p.grad[1]) == 0
