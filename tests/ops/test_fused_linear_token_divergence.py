"""Per-token student-teacher divergence and student entropy through two fused heads, against float64 autograd.

Forward KL, reverse KL and the generalised JSD; soft-caps and logit scales on either side,
temperature, biases, heads of different widths, odd shapes, fp32 and bf16, chunk boundaries.
"""

import pytest
import torch

from liger_kernel.ops.chunked_head import ChunkedHeadConfig, per_token_chunks
from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.fused_linear_token_divergence import LigerFusedLinearTokenDivergenceFunction
from liger_kernel.ops.head_chunking import ChunkPlan
from tests.chunked_loss.reference import engine_logits
from tests.ops.test_cross_entropy import assert_grad_close
from tests.ops.test_fused_linear_logprobs import count_engine_logit_gemms, transformed
from tests.utils import DEVICE


def reference(z_s, z_t, beta, temperature, student, teacher):
    """float64 ``(d, H)`` per row, written from the definitions (no log-space mixture tricks);
    ``student`` and ``teacher`` are ``(logit_scale, softcap)``."""
    p = torch.softmax(transformed(z_s, temperature, student[1], student[0]), -1)
    q = torch.softmax(transformed(z_t, temperature, teacher[1], teacher[0]), -1)

    def kl(a, b):
        return (a * (a.log() - b.log())).sum(-1)

    if beta == 0.0:
        d = kl(q, p)
    elif beta == 1.0:
        d = kl(p, q)
    else:
        m = (1 - beta) * p + beta * q
        d = beta * kl(q, m) + (1 - beta) * kl(p, m)
    return d, -(p * p.log()).sum(-1)


def head(n, hidden, vocab, with_bias, dtype):
    x = torch.randn(n, hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, hidden, device=DEVICE) * 2 / hidden**0.5).to(dtype)
    bias = torch.randn(vocab, device=DEVICE).to(dtype) if with_bias else None
    return x, weight, bias


def logits64(x, weight, bias, dtype, plan):
    """float64 logits of the float64 leaves; in low precision moved (no gradient) onto the values
    the engine's own GEMM calls give on its own chunks (``plan``). That GEMM accumulates in float32
    and rounds once, so a logit within float32 rounding of the midpoint of two ``dtype`` values
    can round to the other one than its exact value does: one ulp, which moves ``d`` by far more
    than float32 noise (3.0e-5 for LIGER_TEST_SEED=281938752)."""
    z = x @ weight.t() + (bias if bias is not None else 0)
    if dtype == torch.float32:
        return z
    low = [t.detach().to(dtype) if t is not None else None for t in (x, weight, bias)]
    engine = engine_logits(low[0].unsqueeze(0), low[1], low[2], plan)[0].double()
    # Within one ulp of the exact logits: a GEMM that dropped a term would not be.
    ulp = torch.finfo(dtype).eps * torch.maximum(z.detach().abs(), engine.abs())
    assert ((engine - z.detach()).abs() <= ulp + 1e-30).all()
    return z + (engine - z.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, d_s, d_t, vocab, beta, temperature, student, teacher, with_bias, chunk_rows", [
    (13, 16, 24, 37, 0.0, 0.8, (1.3, 5.0), (0.7, None), True, None),
    (9, 8, 8, 53, 1.0, 1.0, (1.0, None), (1.0, 3.0), False, 4),
    (7, 32, 16, 29, 0.5, 1.7, (0.6, 4.0), (1.0, 4.0), True, 3),
    (1, 16, 8, 2, 0.1, 1.0, (1.0, None), (1.0, None), False, None),
])
def test_matches_float64(dtype, n, d_s, d_t, vocab, beta, temperature, student, teacher, with_bias, chunk_rows):
    x_s, w_s, b_s = head(n, d_s, vocab, with_bias, dtype)
    x_t, w_t, b_t = head(n, d_t, vocab, with_bias, dtype)
    g = torch.randn(n, device=DEVICE)
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x_s, w_s, b_s)]
    override = {} if chunk_rows is None else {"chunk_rows": chunk_rows}
    with override_launch_config(ChunkedHeadConfig, **override):
        d, entropy = LigerFusedLinearTokenDivergenceFunction.apply(*leaves, x_t, w_t, b_t, beta, temperature,
                                                                   *student, *teacher)
        assert d.dtype == entropy.dtype == torch.float32 and d.shape == entropy.shape == (n,)
        assert d.requires_grad and not entropy.requires_grad
        (d * g).sum().backward()
        plan = ChunkPlan(False, tuple((r,) for r in per_token_chunks(x_s, w_s, (True, True), x_t).row_ranges), ())
    ref_leaves = [t.double().requires_grad_() if t is not None else None for t in (x_s, w_s, b_s)]
    z_s = logits64(*ref_leaves, dtype, plan)
    z_t = logits64(x_t.double(), w_t.double(), b_t.double() if with_bias else None, dtype, plan)
    d_ref, h_ref = reference(z_s, z_t, beta, temperature, student, teacher)
    expected = torch.autograd.grad((d_ref * g).sum(), [t for t in ref_leaves if t is not None])
    torch.testing.assert_close(d.double(), d_ref.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(entropy.double(), h_ref.detach(), atol=2e-5, rtol=2e-5)
    for name, leaf, reference_grad in zip(("x", "weight", "bias"), [t for t in leaves if t is not None], expected):
        assert leaf.grad.dtype == dtype, name
        # bf16: the logit gradient and each GEMM output are rounded once to bf16.
        assert_grad_close(leaf.grad, reference_grad, dtype, name, tol_scale=10 if dtype == torch.float32 else 2)


def test_bad_arguments_raise():
    x, w, _ = head(4, 8, 7, False, torch.float32)
    args = (x, w, None, x, w, None)
    with pytest.raises(ValueError, match="beta"):
        LigerFusedLinearTokenDivergenceFunction.apply(*args, 1.5)
    with pytest.raises(ValueError, match="temperature"):
        LigerFusedLinearTokenDivergenceFunction.apply(*args, 0.5, 0.0)
    with pytest.raises(ValueError, match="student_final_logit_softcapping"):
        LigerFusedLinearTokenDivergenceFunction.apply(*args, 0.5, 1.0, 1.0, -2.0)
    with pytest.raises(ValueError, match="vocabularies"):
        LigerFusedLinearTokenDivergenceFunction.apply(x, w, None, x, torch.randn(9, 8, device=DEVICE), None, 0.5)
    with pytest.raises(ValueError, match="same rows"):
        LigerFusedLinearTokenDivergenceFunction.apply(x, w, None, x[:3], w, None, 0.5)


def test_backward_runs_in_the_given_context():
    """The context a caller passes (e.g. one gathering sharded heads again) wraps the backward's
    recomputation, and only that; the token-statistics Function takes the same argument."""
    import contextlib

    from liger_kernel.ops.fused_linear_logprobs import LigerFusedLinearTokenStatisticsFunction

    events = []

    @contextlib.contextmanager
    def context():
        events.append("enter")
        yield
        events.append("exit")

    x, w, _ = head(5, 8, 11, False, torch.float32)
    x.requires_grad_()
    d, _ = LigerFusedLinearTokenDivergenceFunction.apply(x, w, None, x.detach(), w, None, 0.5, 1.0, 1.0, None, 1.0,
                                                         None, context)
    assert events == []
    d.sum().backward()
    assert events == ["enter", "exit"]
    target = torch.randint(0, 11, (5,), device=DEVICE)
    logp = LigerFusedLinearTokenStatisticsFunction.apply(x, w, None, target, 1.0, None, 1.0, (), -100, False,
                                                         context)[0]
    assert events == ["enter", "exit"]
    logp.sum().backward()
    assert events == ["enter", "exit"] * 2


@pytest.mark.parametrize("keep", [True, False])
def test_kept_chunks_skip_both_heads_gemms(monkeypatch, keep):
    """The forward keeps both heads' logits of its leading chunks (one chunk budget's rows); the
    backward recomputes only the other chunks' (student and teacher), frees the kept ones, and
    its gradients are those of a backward that recomputes every chunk."""
    x_s, w_s, b_s = head(11, 16, 23, True, torch.bfloat16)
    x_t, w_t, b_t = head(11, 8, 23, False, torch.bfloat16)
    g = torch.randn(11, device=DEVICE)
    backward_gemms = count_engine_logit_gemms(monkeypatch)
    grads = []
    for keep_forward_logits in (keep, False):
        leaves = [t.detach().clone().requires_grad_() for t in (x_s, w_s, b_s)]
        with override_launch_config(ChunkedHeadConfig, chunk_rows=4, keep_forward_logits=keep_forward_logits):
            d, _ = LigerFusedLinearTokenDivergenceFunction.apply(*leaves, x_t, w_t, b_t, 0.5, 1.3)
            kept = d.grad_fn.kept_logits
            assert len(kept) == (1 if keep_forward_logits else 0)
            backward_gemms.clear()
            (d * g).sum().backward()
        assert kept == []
        # 11 rows in chunks of 4, 4, 3: each recomputed chunk costs a student and a teacher GEMM.
        assert sorted(backward_gemms) == ([3, 3, 4, 4] if keep_forward_logits else [3, 3, 4, 4, 4, 4])
        grads.append([leaf.grad for leaf in leaves])
    for ours, recomputing in zip(*grads):
        torch.testing.assert_close(ours, recomputing, rtol=0, atol=0)
