"""The fused linear JSD's closed-form epilogue against float64 autograd of the same per-row losses.

Forward KL (beta 0), reverse KL (beta 1) and mixtures, temperatures, with and without the hard
cross entropy, ignored labels, fp32 and bf16 chunks, vocabularies that are not a multiple of the tile.
"""

import math

import pytest
import torch

from liger_kernel.ops.distillation_epilogue import GeneralizedJSDRows
from tests.utils import DEVICE, shapes

IGNORE = -100
SHAPES = shapes(small=[(11, 301), (4, 2)], full=[(64, 128256), (129, 32003)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows, vocab", SHAPES)
@pytest.mark.parametrize("beta, temperature, hard", [(0.0, 1.0, True), (1.0, 0.7, True), (0.5, 1.0, False),
                                                     (0.3, 1.3, True)])
def test_matches_float64(dtype, n_rows, vocab, beta, temperature, hard):
    z_s = (torch.randn(n_rows, vocab, device=DEVICE) * 3).to(dtype)
    z_t = (torch.randn(n_rows, vocab, device=DEVICE) * 3).to(dtype)
    target = torch.randint(0, vocab, (n_rows,), device=DEVICE)
    target[torch.rand(n_rows, device=DEVICE) < 0.3] = IGNORE
    token_fn = GeneralizedJSDRows(beta, temperature, IGNORE, hard)
    z64 = z_s.double().requires_grad_()
    q64 = token_fn(z64, z_t.double(), target)
    grad_q = torch.randn(q64.shape, device=DEVICE, dtype=torch.float64)
    (expected,) = torch.autograd.grad(q64, z64, grad_q)

    before = z_s.clone()
    q, state = token_fn.statistics(z_s, z_t, target)
    assert torch.equal(z_s, before)
    torch.testing.assert_close(q.double(), q64.detach(), atol=2e-5 * (vocab / 1000) ** 0.5, rtol=1e-5)
    grad = token_fn.logit_grad_(z_s, state, grad_q.float(), z_t, target)
    assert grad.data_ptr() == z_s.data_ptr() and grad.dtype == dtype
    err = (grad.double() - expected).abs()
    # float32 log-probabilities carry absolute errors of a few ulps of the scaled logits |z| / tau
    # (growing like sqrt(V) over the row's sums). The row KL that the gradient subtracts (d at
    # beta = 1, KL(P || M) <= -log(1 - beta) for a mixture, none at beta = 0) is formed from
    # p = exp(log p): an error e common to every log p (the rounding of the row's log-sum-exp)
    # scales every p by 1 + e and moves sum p (log p - log q) by e (1 + KL), so its error is that
    # of log p times 1 + KL (LIGER_TEST_SEED=1793: d = 17.7 off by 2.6e-5). The gradient multiplies
    # these by |dL/dq| / tau; bf16 then adds one rounding. (The logits as drawn: z_s now holds
    # the gradient.)
    logit_scale = 1 + float(before.abs().max() + z_t.abs().max()) / temperature
    kl = q64.detach()[:, 1:2].abs() if beta == 1.0 else (-math.log(1 - beta) if beta > 0 else 0.0)
    atol = 5e-7 * float(grad_q.abs().max()) * logit_scale * (1 + kl) / temperature * max(1.0, vocab / 300) ** 0.5
    bound = (2e-6 if dtype == torch.float32 else 2**-8) * expected.abs() + atol
    assert bool((err <= bound).all()), float(err.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_transforms_entropy_and_no_labels_match_float64(dtype, beta):
    """Per-side logit scale and soft-cap, the student's entropy column, every row counted without labels."""
    n_rows, vocab, temperature = 7, 203, 0.9
    z_s = (torch.randn(n_rows, vocab, device=DEVICE) * 4).to(dtype)
    z_t = (torch.randn(n_rows, vocab, device=DEVICE) * 4).to(dtype)
    token_fn = GeneralizedJSDRows(beta, temperature, with_hard_loss=False, student=(1.3, 6.0), teacher=(0.8, None),
                                  entropy=True)
    z64 = z_s.double().requires_grad_()
    q64 = token_fn(z64, z_t.double())
    assert q64.shape == (n_rows, 3) and bool((q64[:, 0] == 0).all())
    grad_q = torch.randn(q64.shape, device=DEVICE, dtype=torch.float64)
    (expected,) = torch.autograd.grad(q64, z64, grad_q)  # the entropy column is detached
    q, state = token_fn.statistics(z_s, z_t)
    torch.testing.assert_close(q.double(), q64.detach(), atol=2e-5, rtol=1e-5)
    logit_scale = 1 + 1.3 * float(z_s.abs().max() + z_t.abs().max()) / temperature  # before z_s holds the gradient
    grad = token_fn.logit_grad_(z_s, state, grad_q.float(), z_t)
    atol = 5e-7 * float(grad_q.abs().max()) * logit_scale / temperature
    bound = (2e-6 if dtype == torch.float32 else 2**-8) * expected.abs() + atol
    err = (grad.double() - expected).abs()
    assert bool((err <= bound).all()), float(err.max())


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="beta"):
        GeneralizedJSDRows(1.5)
    with pytest.raises(ValueError, match="beta"):
        GeneralizedJSDRows(True)  # a bool is not a mixing weight
    with pytest.raises(ValueError, match="soft-cap"):
        GeneralizedJSDRows(0.5, teacher=(1.0, -2.0))
    with pytest.raises(ValueError, match="one shape"):
        GeneralizedJSDRows(0.5).statistics(torch.zeros(2, 5, device=DEVICE), torch.zeros(2, 6, device=DEVICE),
                                           torch.zeros(2, dtype=torch.long, device=DEVICE))
