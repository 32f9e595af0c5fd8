"""Every kernel gives bitwise identical outputs and gradients on two runs with the same inputs.

Reductions (dW of the norms, dW/dX of the fused linear cross entropy, the loss sums) are
done in a fixed order, never by atomics whose order varies. On CPU the interpreter is
sequential, so this is meaningful mainly on the GPU, where shapes are large enough to
spread over every SM.
"""

import pytest
import torch

from liger_kernel.transformers.functional import (
    liger_cross_entropy,
    liger_fused_linear_cross_entropy,
    liger_geglu,
    liger_layer_norm,
    liger_rms_norm,
    liger_rotary_pos_emb,
    liger_swiglu,
)
from tests.utils import DEVICE, FULL_SHAPES

ROWS, HIDDEN = (4099, 4096) if FULL_SHAPES else (37, 129)
VOCAB = 32003 if FULL_SHAPES else 1007


def _run_twice(fn, *inputs):
    results = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        upstream = [torch.ones_like(o) for o in outs]
        torch.autograd.backward(outs, upstream)
        results.append([o.detach().clone() for o in outs] + [t.grad.clone() for t in leaves if t.grad is not None])
    return results


def _bitwise_equal(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "results differ between two identical runs"


def _rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("casting_mode", ["llama", "gemma"])
def test_rms_norm_deterministic(casting_mode):
    x, w = _rand(ROWS, HIDDEN), _rand(HIDDEN)
    _bitwise_equal(*_run_twice(lambda x, w: liger_rms_norm(x, w, 1e-6, 0.0, casting_mode, False), x, w))


def test_layer_norm_deterministic():
    x, w, b = _rand(ROWS, HIDDEN), _rand(HIDDEN), _rand(HIDDEN)
    _bitwise_equal(*_run_twice(lambda x, w, b: liger_layer_norm(x, w, b, 1e-5), x, w, b))


@pytest.mark.parametrize("fn", [liger_swiglu, liger_geglu])
def test_gated_activation_deterministic(fn):
    _bitwise_equal(*_run_twice(fn, _rand(ROWS, HIDDEN), _rand(ROWS, HIDDEN)))


def test_rope_deterministic():
    batch, seq, dim = 2, 33, 64
    q = _rand(batch, seq, 8, dim).transpose(1, 2)
    k = _rand(batch, seq, 2, dim).transpose(1, 2)
    angle = torch.randn(1, seq, dim, device=DEVICE)
    cos, sin = angle.cos(), angle.sin()
    _bitwise_equal(*_run_twice(lambda q, k: liger_rotary_pos_emb(q, k, cos, sin), q, k))


def test_cross_entropy_deterministic():
    logits = _rand(ROWS // 4 + 1, VOCAB)
    target = torch.randint(0, VOCAB, (logits.shape[0],), device=DEVICE)
    _bitwise_equal(*_run_twice(lambda x: liger_cross_entropy(x, target, label_smoothing=0.1), logits))


def test_fused_linear_cross_entropy_deterministic():
    n, d = (2049, 512) if FULL_SHAPES else (19, 32)
    x, w, b = _rand(n, d), _rand(VOCAB, d), _rand(VOCAB)
    target = torch.randint(0, VOCAB, (n,), device=DEVICE)
    _bitwise_equal(*_run_twice(lambda x, w, b: liger_fused_linear_cross_entropy(x, w, target, bias=b), x, w, b))
