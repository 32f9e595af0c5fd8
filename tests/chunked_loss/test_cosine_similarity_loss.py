"""Cosine-similarity distillation on fused heads against float64: beta * (1 - cos(z_s / tau, z_t / tau)) per
counted row, plus the weighted cross-entropy on the labels."""

import pytest
import torch

from liger_kernel.chunked_loss import LigerFusedLinearCosineSimilarityLoss
from liger_kernel.chunked_loss.functional import liger_fused_linear_cosine
from tests.chunked_loss.reference import cosine_soft_terms, run_distillation_case


def cosine_reference(beta):
    return lambda s, t: beta * (1 - torch.nn.functional.cosine_similarity(s, t, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta, temperature, weights, case", [
    (0.5, 1.0, (0.5, 0.5), {}),
    (1.0, 2.0, (0.0, 1.0), dict(chunk_rows=3, with_bias=False)),
    (0.8, 0.7, (0.3, 0.9), dict(teacher_vocab=43, returns_parts=True)),
    (0.5, 1.0, (0.5, 0.5), dict(all_ignored=True)),
])
def test_matches_float64(dtype, beta, temperature, weights, case):
    loss_fn = LigerFusedLinearCosineSimilarityLoss(weight_hard_loss=weights[0], weight_soft_loss=weights[1], beta=beta,
                                                   temperature=temperature,
                                                   return_soft_hard_loss=case.get("returns_parts", False))
    run_distillation_case(loss_fn, cosine_reference(beta), *weights, temperature, dtype, 11, 16, 24, 37,
                          soft_terms=cosine_soft_terms(beta), **case)


def test_functional_matches_module():
    xs, xt, ws, wt = torch.randn(5, 8), torch.randn(5, 6), torch.randn(13, 8), torch.randn(13, 6)
    labels = torch.tensor([1, -100, 2, 3, 12])
    a, b = xs.clone().requires_grad_(), xs.clone().requires_grad_()
    loss = LigerFusedLinearCosineSimilarityLoss(beta=0.7, temperature=1.2)(a, ws, xt, wt, labels)
    loss_f = liger_fused_linear_cosine(b, ws, xt, wt, labels, None, None, 0.5, 0.5, 0.7, -100, 1.2)
    loss.backward()
    loss_f.backward()
    torch.testing.assert_close(loss_f.detach(), loss.detach())
    torch.testing.assert_close(b.grad, a.grad)
