"""LigerFusedLinearJSD (student and teacher heads fused, no logits) against float64 generalised JSD."""

import pytest
import torch

from liger_kernel.transformers import LigerFusedLinearJSD, liger_fused_linear_jsd
from tests.chunked_loss.reference import generalized_jsd_reference, run_distillation_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("jsd_beta, temperature, case", [
    (0.5, 1.0, {}),
    (0.0, 2.0, dict(chunk_rows=3)),
    (1.0, 0.8, dict(leading=(3, 4), n_rows=12)),
    (0.1, 1.0, dict(all_ignored=True)),
])
def test_matches_float64(dtype, jsd_beta, temperature, case):
    module = LigerFusedLinearJSD(jsd_beta=jsd_beta, temperature=temperature)

    def call(xs, ws, xt, wt, labels, bs, bt):
        return module(xs, ws, xt, wt, labels)

    case = {"n_rows": 11, **case}
    run_distillation_case(call, lambda s, t: generalized_jsd_reference(s, t, jsd_beta), 0.0, 1.0, temperature, dtype,
                          student_hidden=16, teacher_hidden=24, vocab=37, with_bias=False, **case)


def test_without_labels_every_row_counts():
    xs, xt, ws, wt = torch.randn(7, 8), torch.randn(7, 5), torch.randn(13, 8), torch.randn(13, 5)
    a, b = xs.clone().requires_grad_(), xs.clone().requires_grad_()
    loss = liger_fused_linear_jsd(a, ws, xt, wt, None, jsd_beta=0.3, temperature=1.1)
    loss_all = LigerFusedLinearJSD(jsd_beta=0.3, temperature=1.1)(b, ws, xt, wt, torch.zeros(7, dtype=torch.long))
    loss.backward()
    loss_all.backward()
    expected = generalized_jsd_reference((xs.double() @ ws.double().t()) / 1.1, (xt.double() @ wt.double().t()) / 1.1,
                                         0.3).mean()
    torch.testing.assert_close(loss.detach().double(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(loss_all.detach(), loss.detach())
    torch.testing.assert_close(b.grad, a.grad)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="beta"):
        LigerFusedLinearJSD(jsd_beta=-0.1)
    with pytest.raises(ValueError, match="beta"):
        LigerFusedLinearJSD(jsd_beta=False)
    with pytest.raises(ValueError, match="temperature"):
        LigerFusedLinearJSD(temperature=0)
    with pytest.raises(ValueError, match="temperature"):
        LigerFusedLinearJSD(temperature=float("inf"))


def test_functional_module_exports_it():
    """``liger_kernel.transformers.functional.liger_fused_linear_jsd``, upstream Liger's functional name."""
    from liger_kernel.transformers import functional
    from liger_kernel.transformers.fused_linear_jsd import liger_fused_linear_jsd

    assert functional.liger_fused_linear_jsd is liger_fused_linear_jsd
    assert "liger_fused_linear_jsd" in functional.__all__
