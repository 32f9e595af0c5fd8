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
