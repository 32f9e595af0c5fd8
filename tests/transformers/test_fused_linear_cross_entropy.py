"""LigerFusedLinearCrossEntropyLoss module: argument order, options, HF-style LM-head usage."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.head_chunking import HeadChunkConfig
from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
from liger_kernel.transformers.cross_entropy import CrossEntropyOutput
from tests.ops.test_cross_entropy import assert_grad_close, assert_loss_close
from tests.utils import DEVICE


@pytest.fixture(autouse=True)
def _small_chunks():
    with override_launch_config(HeadChunkConfig, max_chunk_rows=5):
        yield


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_matches_lm_head_then_cross_entropy(reduction):
    batch, seq, hidden, vocab = 2, 7, 24, 301
    lm_head = nn.Linear(hidden, vocab, bias=True, device=DEVICE)
    hidden_states = torch.randn(batch, seq, hidden, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq), device=DEVICE)
    labels[0, :2] = -100
    ce_weight = torch.rand(vocab, device=DEVICE) + 0.5
    loss_fn = LigerFusedLinearCrossEntropyLoss(ce_weight=ce_weight, label_smoothing=0.1, reduction=reduction)
    shifted = hidden_states[:, :-1].reshape(-1, hidden)
    loss = loss_fn(lm_head.weight, shifted, labels[:, 1:].reshape(-1), lm_head.bias)

    ref_h = hidden_states.detach().double().requires_grad_()
    ref_w = lm_head.weight.detach().double().requires_grad_()
    ref_b = lm_head.bias.detach().double().requires_grad_()
    logits = F.linear(ref_h[:, :-1].reshape(-1, hidden), ref_w, ref_b)
    ref = F.cross_entropy(
        logits, labels[:, 1:].reshape(-1), weight=ce_weight.double(), label_smoothing=0.1, reduction=reduction
    )
    upstream = torch.rand_like(ref) + 0.5
    loss.backward(upstream.float())
    ref.backward(upstream)
    assert_loss_close(loss, ref, batch * seq)
    assert_grad_close(hidden_states.grad, ref_h.grad, torch.float32)
    assert_grad_close(lm_head.weight.grad, ref_w.grad, torch.float32)
    assert_grad_close(lm_head.bias.grad, ref_b.grad, torch.float32)


def test_module_num_items_in_batch_pattern_with_frozen_head():
    # HF with num_items_in_batch: reduction="sum", divided by the count; lm_head frozen.
    hidden, vocab = 16, 128
    lm_head = nn.Linear(hidden, vocab, bias=False, device=DEVICE).requires_grad_(False)
    x = torch.randn(13, hidden, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, vocab, (13,), device=DEVICE)
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum", softcap=30.0)
    loss = loss_fn(lm_head.weight, x, labels) / 13
    loss.backward()
    ref_x = x.detach().double().requires_grad_()
    logits = 30.0 * torch.tanh(ref_x @ lm_head.weight.double().t() / 30.0)
    ref = F.cross_entropy(logits, labels, reduction="sum") / 13
    ref.backward()
    assert_loss_close(loss, ref, 13)
    assert_grad_close(x.grad, ref_x.grad, torch.float32)
    assert lm_head.weight.grad is None


def test_module_named_outputs_and_repr():
    loss_fn = LigerFusedLinearCrossEntropyLoss(
        lse_square_scale=1e-4, return_z_loss=True, return_token_accuracy=True, accum_dtype=torch.float32
    )
    weight = torch.randn(50, 8, device=DEVICE)
    out = loss_fn(weight, torch.randn(6, 8, device=DEVICE), torch.randint(0, 50, (6,), device=DEVICE))
    assert isinstance(out, CrossEntropyOutput)
    assert out.z_loss.item() > 0 and 0.0 <= out.token_accuracy.item() <= 1.0
    assert "accum_dtype=torch.float32" in repr(loss_fn)


def _token_scaled_reference(x, weight, bias, target, ce_weight, reduction, ignore_index=-100, **options):
    """float64: ``p_i * l_i`` per row (``p_i`` the detached probability of the target under the
    soft-capped logits, 0 for ignored rows), reduced like the unscaled loss; also the z-loss."""
    from liger_kernel.reference.losses import cross_entropy

    logits = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    loss_rows, z_rows, _ = cross_entropy(logits, target, weight=ce_weight, reduction="none",
                                         ignore_index=ignore_index, **options)
    softcap = options.get("softcap")
    with torch.no_grad():
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        counted = target != ignore_index
        p = logits.softmax(-1).gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1) * counted
    ce_rows, z_rows = (loss_rows - z_rows) * p, z_rows * p
    if reduction == "none":
        return ce_rows + z_rows, z_rows
    if reduction == "sum":
        return (ce_rows + z_rows).sum(), z_rows.sum()
    n_counted = counted.sum().clamp_min(1)
    ce_denominator = n_counted if ce_weight is None else ce_weight.double()[target.clamp_min(0)][counted].sum()
    return ce_rows.sum() / ce_denominator + z_rows.sum() / n_counted, z_rows.sum() / n_counted


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [
    {},
    {"label_smoothing": 0.1, "class_weight": True},
    {"softcap": 3.0, "lse_square_scale": 1e-2},
], ids=["plain", "smoothing_class_weight", "softcap_z_loss"])
def test_use_token_scaling_matches_float64_reference(reduction, options):
    """``use_token_scaling=True`` (upstream Liger's option, set by axolotl's ``liger_use_token_scaling``):
    each row's loss times the detached probability of its target, against float64 autograd.
    Logits of standard deviation ~2.5 make the probabilities (and the soft-cap) vary between rows;
    (a row with p_y near 1 would add the float32 cancellation of p_y - 1 that tests/ops allows for)."""
    options = dict(options)
    n_rows, hidden, vocab = 19, 24, 157
    ce_weight = torch.rand(vocab, device=DEVICE) + 0.5 if options.pop("class_weight", False) else None
    x = torch.randn(n_rows, hidden, device=DEVICE, requires_grad=True)
    weight = (torch.randn(vocab, hidden, device=DEVICE) * 0.5).requires_grad_()
    bias = torch.randn(vocab, device=DEVICE, requires_grad=True)
    target = torch.randint(0, vocab, (n_rows,), device=DEVICE)
    target[torch.rand(n_rows, device=DEVICE) < 0.3] = -100
    target[0] = 5
    loss_fn = LigerFusedLinearCrossEntropyLoss(ce_weight=ce_weight, reduction=reduction, use_token_scaling=True,
                                               return_z_loss=True, **options)
    out = loss_fn(weight, x, target, bias)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    ref_loss, ref_z = _token_scaled_reference(*leaves[:2], leaves[2], target, ce_weight, reduction, **options)
    upstream = torch.rand_like(ref_loss) + 0.5
    out.loss.backward(upstream.float())
    ref_loss.backward(upstream)
    assert_loss_close(out.loss, ref_loss, n_rows)
    assert_loss_close(out.z_loss, ref_z.detach(), n_rows)
    for got, leaf in zip((x, weight, bias), leaves):
        assert_grad_close(got.grad, leaf.grad, torch.float32)
    # the scaling changes the loss (the test would pass an implementation that ignored it otherwise)
    unscaled = LigerFusedLinearCrossEntropyLoss(ce_weight=ce_weight, reduction=reduction, **options)(
        weight, x, target, bias)
    assert not torch.allclose(unscaled, out.loss)


def test_use_token_scaling_functional_and_rejected_combination():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    x = torch.randn(6, 8, device=DEVICE)
    weight = torch.randn(11, 8, device=DEVICE)
    target = torch.randint(0, 11, (6,), device=DEVICE)
    module = LigerFusedLinearCrossEntropyLoss(use_token_scaling=True)(weight, x, target)
    torch.testing.assert_close(liger_fused_linear_cross_entropy(x, weight, target, use_token_scaling=True), module)
    with pytest.raises(ValueError, match="use_token_scaling"):
        liger_fused_linear_cross_entropy(x, weight, target, ce_weight=torch.ones(11, device=DEVICE),
                                         lse_square_scale=1e-3, use_token_scaling=True)
