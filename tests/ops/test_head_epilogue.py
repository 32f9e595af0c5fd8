"""The head engine's epilogue kernels against float64 autograd of the same per-row quantities.

Statistics (log-probs of up to two labels, entropy, log sum p^2, row sums, top-1) and the
in-place logit gradient, on chunks in fp32 and bf16, with temperature, soft-capping and a
logit scale, ignored and out-of-range labels, vocabularies that are not a multiple of the tile.
"""

import pytest
import torch

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.head_epilogue import HeadEpilogueConfig, LogitRowStatistics, transform_logits
from tests.utils import DEVICE, shapes

IGNORE = -100
NO_GRADIENT = ("log_sum_sq_probs", "mean_logits", "is_top1")

SHAPES = shapes(small=[(13, 300), (5, 2), (7, 1031)], full=[(64, 128256), (33, 262144), (256, 32003)])

OPTION_SETS = {
    "logp": dict(),
    "logp_entropy_ignore": dict(entropy=True, ignore_index=IGNORE),
    "everything": dict(temperature=0.7, softcap=5.0, logit_scale=1.3, entropy=True, log_sum_sq_probs=True,
                       row_sum=True, mean_logits=True, is_top1=True),
    "preference": dict(ignore_index=IGNORE, temperature=1.4, log_sum_sq_probs=True, row_sum=True),
}


def make_rows(n_rows, vocab, dtype, n_labels, with_ignore):
    logits = (torch.randn(n_rows, vocab, device=DEVICE) * 3).to(dtype)
    labels = []
    for _ in range(n_labels):
        label = torch.randint(0, vocab, (n_rows,), device=DEVICE)
        if with_ignore:
            label[torch.rand(n_rows, device=DEVICE) < 0.3] = IGNORE
        labels.append(label)
    return logits, labels


def upstream_for(token_fn, q64, n_labels):
    """Random dL/dq, zero on the columns no gradient flows through."""
    grad_q = torch.randn(q64.shape, device=DEVICE, dtype=torch.float64)
    for i, name in enumerate(token_fn.column_names(n_labels)):
        if name in NO_GRADIENT:
            grad_q[:, i] = 0
    return grad_q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows, vocab", SHAPES)
@pytest.mark.parametrize("options", list(OPTION_SETS))
def test_statistics_and_gradient_match_float64(dtype, n_rows, vocab, options):
    opts = OPTION_SETS[options]
    n_labels = 2 if options == "preference" else 1
    token_fn = LogitRowStatistics(**opts)
    logits, labels = make_rows(n_rows, vocab, dtype, n_labels, "ignore_index" in opts)
    z64 = logits.double().requires_grad_()
    q64 = token_fn(z64, *labels)
    grad_q = upstream_for(token_fn, q64, n_labels)
    (expected,) = torch.autograd.grad(q64, z64, grad_q)

    before = logits.clone()
    q, state = token_fn.statistics(logits, *labels)
    assert torch.equal(logits, before), "the statistics pass must leave the chunk alone"
    assert q.dtype == torch.float32 and q.shape == q64.shape
    # float32 statistics of the rounded logits: relative to the row's log-sum-exp magnitude, the
    # summation error growing as sqrt(V), and never below four float32 ulps of that magnitude (a
    # log-prob is s_y - lse, a difference of two such numbers: at V = 2 the sqrt(V) term alone
    # fell below what float32 resolves).
    scale = 1 + float(q64.detach().abs().max())
    atol = scale * max(4e-6 * (vocab / 1000) ** 0.5, 4 * torch.finfo(torch.float32).eps)
    torch.testing.assert_close(q.double(), q64.detach(), atol=atol, rtol=1e-5)

    grad = token_fn.logit_grad_(logits, state, grad_q.float(), *labels)
    assert grad.data_ptr() == logits.data_ptr() and grad.dtype == dtype
    if dtype == torch.float32:
        # float32 knows p_i = exp(s_i - lse) only to the rounding of s_i - lse, two ulps of the row's
        # largest |s| (delta): the gradient moves by about (|g| + |h|) p_i delta, which no relative
        # bound covers where p_y is near 1 and the target's g (1 - p_y) cancels.
        s64 = transform_logits(z64.detach(), token_fn.logit_scale, token_fn.softcap, token_fn.temperature)
        delta = 2 * torch.finfo(torch.float32).eps * (1 + s64.abs().amax(-1, keepdim=True))
        rounding = delta * grad_q.abs().sum(-1, keepdim=True) * s64.softmax(-1)
        err = (grad.double() - expected).abs()
        bound = 2e-6 * float(expected.abs().max()) + 1e-5 * expected.abs() + rounding
        assert bool((err <= bound).all()), f"largest excess {float((err - bound).max()):.3g}"
    else:
        # One rounding to bf16 (half an ulp, 2**-9 relative) of a float32-exact value.
        err = (grad.double() - expected).abs()
        assert bool((err <= 2**-8 * expected.abs() + 1e-6 * float(expected.abs().max())).all()), float(err.max())


@pytest.mark.parametrize("block", [16, 64])
def test_tiles_do_not_change_the_result(block):
    """Configurations change the schedule, not the result (statistics to float32 rounding)."""
    token_fn = LogitRowStatistics(IGNORE, 0.8, entropy=True, log_sum_sq_probs=True)
    logits, (label,) = make_rows(9, 203, torch.float32, 1, True)
    q_default, state = token_fn.statistics(logits, label)
    grad_q = torch.randn(q_default.shape, device=DEVICE)
    grad_default = token_fn.logit_grad_(logits.clone(), state, grad_q, label)
    with override_launch_config(HeadEpilogueConfig, statistics_block=block, gradient_block=block):
        q_tiled, state = token_fn.statistics(logits, label)
        grad_tiled = token_fn.logit_grad_(logits.clone(), state, grad_q, label)
    torch.testing.assert_close(q_tiled, q_default, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(grad_tiled, grad_default, atol=1e-6, rtol=1e-5)


def test_top1_is_the_first_argmax():
    """A tie with an earlier column is not a top-1 hit; a tie with a later one is."""
    logits = torch.zeros(3, 6, device=DEVICE)
    logits[0, 2] = logits[0, 4] = 5.0  # label 4 ties with earlier column 2: no
    logits[1, 2] = logits[1, 4] = 5.0  # label 2 ties with later column 4: yes
    logits[2, 1] = 5.0  # label 3, not the max: no
    label = torch.tensor([4, 2, 3], device=DEVICE)
    token_fn = LogitRowStatistics(is_top1=True)
    q, _ = token_fn.statistics(logits, label)
    assert q[:, -1].tolist() == [0.0, 1.0, 0.0]
    assert token_fn(logits, label)[:, -1].tolist() == [0.0, 1.0, 0.0]


def test_minus_infinity_logits_are_finite():
    """Masked vocabulary entries (-inf logits) add nothing to any statistic or gradient."""
    logits = torch.randn(4, 50, device=DEVICE)
    logits[:, 10:20] = float("-inf")
    label = torch.randint(20, 50, (4,), device=DEVICE)
    token_fn = LogitRowStatistics(entropy=True, log_sum_sq_probs=True)
    q, state = token_fn.statistics(logits, label)
    # The same rows without the masked columns (labels shift by the 10 columns removed).
    expected = token_fn(torch.cat([logits[:, :10], logits[:, 20:]], 1), label - 10)
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q, expected, atol=1e-5, rtol=1e-5)
    grad = token_fn.logit_grad_(logits, state, torch.randn(q.shape, device=DEVICE), label)
    assert torch.isfinite(grad).all() and bool((grad[:, 10:20] == 0).all())


def test_bad_options_raise():
    with pytest.raises(ValueError, match="temperature"):
        LogitRowStatistics(temperature=0.0)
    with pytest.raises(ValueError, match="softcap"):
        LogitRowStatistics(softcap=-1.0)
    with pytest.raises(ValueError, match="at most 2"):
        LogitRowStatistics().statistics(torch.zeros(2, 5, device=DEVICE), *[torch.zeros(2, dtype=torch.long,
                                                                                         device=DEVICE)] * 3)
