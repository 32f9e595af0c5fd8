"""The chunked head engine against plain autograd through materialised float64 logits.

A toy loss exercises every path: per-token quantities (the target's log-probability, the
entropy and the row sum of the logits), a nonlinear function of per-sequence sums, a second
head, pairs (chosen = first half, rejected = second half), a loss that is not additive over
groups (two passes), chunks smaller than one sequence (two passes), chunk boundaries inside
the batch, T = 1, odd vocabularies, bias or none, and an upstream gradient other than 1.
"""

import pytest
import torch
import torch.nn.functional as F

from liger_kernel.ops.chunked_head import ChunkedHeadConfig, chunked_head_loss
from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.head_chunking import chunk_plan, units_per_chunk
from tests.chunked_loss.reference import (
    assert_grads_match,
    assert_loss_match,
    engine_logits,
    engine_plan,
    reference_grads,
    rounded_leaf,
)
from tests.utils import DEVICE

IGNORE = -100


def token_quantities(logits, target):
    """(R, 3): log p(target) (0 where ignored), entropy, row sum of logits."""
    logp = logits.log_softmax(-1)
    counted = target != IGNORE
    picked = logp.gather(-1, torch.where(counted, target, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.stack([picked * counted, entropy * counted, logits.sum(-1)], dim=-1)


def make_group_fn(n_groups, paired, additive):
    """Toy loss of per-sequence sums; normalisers from the whole batch, so it is additive over groups."""

    def group_fn(q, q_ref, mask, weights):
        logp = q[..., 0].sum(1)
        entropy = q[..., 1].sum(1)
        if q_ref is not None:
            logp = logp - q_ref[..., 0].sum(1)
        if not additive:
            # (sum over the batch)^2 couples every group: only the two-pass path is exact.
            return (logp.sum() / n_groups) ** 2 + 0.1 * entropy.mean() * logp.mean(), (logp.detach(),)
        if paired:
            half = q.shape[0] // 2
            margin = logp[:half] - logp[half:]
            loss = (-F.logsigmoid(0.7 * margin) * weights[:half]).sum() / (n_groups // 2)
            loss = loss + 0.01 * (entropy**2).sum() / n_groups
            return loss, (margin.detach(), q[..., 2].sum().detach())
        loss = (weights * F.softplus(0.3 * logp)).sum() / n_groups + 0.01 * (entropy**2).sum() / n_groups
        return loss, (logp.detach(), q[..., 2].sum().detach())

    return group_fn


def make_batch(n_groups, seq_len, hidden, vocab, dtype, with_bias, with_ref):
    x = torch.randn(n_groups, seq_len, hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, hidden, device=DEVICE) * 2 / hidden**0.5).to(dtype)
    bias = torch.randn(vocab, device=DEVICE).to(dtype) if with_bias else None
    target = torch.randint(0, vocab, (n_groups, seq_len), device=DEVICE)
    target[torch.rand(n_groups, seq_len, device=DEVICE) < 0.25] = IGNORE
    target[0, 0] = torch.randint(0, vocab, ())  # a counted token, so the gradients are not all cancellation noise
    if n_groups > 1:
        target[1] = IGNORE  # one sequence with every token ignored
    ref = None
    if with_ref:
        ref = (torch.randn(n_groups, seq_len, hidden, device=DEVICE).to(dtype),
               (torch.randn(vocab, hidden, device=DEVICE) * 2 / hidden**0.5).to(dtype),
               torch.randn(vocab, device=DEVICE).to(dtype) if with_bias else None)
    weights = torch.rand(n_groups, device=DEVICE) + 0.5
    return x, weight, bias, target, ref, weights


def run_case(n_groups, seq_len, hidden, vocab, dtype, with_bias, paired, with_ref, additive, chunk_rows):
    x, weight, bias, target, ref, weights = make_batch(n_groups, seq_len, hidden, vocab, dtype, with_bias, with_ref)
    mask = target != IGNORE
    group_fn = make_group_fn(n_groups, paired, additive)
    with override_launch_config(ChunkedHeadConfig, chunk_rows=chunk_rows):
        plan = engine_plan(x, weight, paired, additive)
        leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
        loss, metrics = chunked_head_loss(
            leaves[0], leaves[1], leaves[2], token_quantities, group_fn, token_args=(target,),
            group_args=(mask, weights), ref_x=ref[0] if ref else None, ref_weight=ref[1] if ref else None,
            ref_bias=ref[2] if ref else None, paired=paired, additive=additive)
    upstream = float(torch.rand(()) + 0.5)
    (loss * upstream).backward()

    ref_logits = None
    if ref:
        ref_logits = engine_logits(ref[0], ref[1], ref[2], plan).double()  # the engine's rounding of its logits

    def loss_of_logits(logits, ref_z):
        q = token_quantities(logits.reshape(-1, vocab), target.reshape(-1)).view(n_groups, seq_len, 3)
        q_ref = None
        if ref_z is not None:
            q_ref = rounded_leaf(token_quantities(ref_z.reshape(-1, vocab), target.reshape(-1)))
            q_ref = q_ref.view(n_groups, seq_len, 3)
        return (*group_fn(q, q_ref, mask, weights), q if q_ref is None else (q, q_ref))

    loss_ref, metrics_ref, grads_ref, bounds, loss_allowance = reference_grads(loss_of_logits, x, weight, bias, plan,
                                                                               ref_logits)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_loss_match(loss, loss_ref, allowance=loss_allowance)
    assert len(metrics) == len(metrics_ref)
    for got, want in zip(metrics, metrics_ref):
        assert not got.requires_grad and got.shape == want.shape
        torch.testing.assert_close(got.double(), want.double(), atol=1e-4, rtol=1e-4)
    assert_grads_match(leaves, grads_ref, bounds, len(plan.row_ranges), upstream)
    return plan


# (B, T, D, V, chunk_rows): chunk boundaries inside the batch, T = 1, V prime / 2 / not a power of 2.
SHAPES = [(4, 5, 16, 37, 10), (6, 3, 32, 101, 7), (2, 1, 8, 2, 1), (4, 7, 16, 257, 1000)]


@pytest.mark.parametrize("n_groups, seq_len, hidden, vocab, chunk_rows", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paired, with_ref, with_bias", [(False, False, True), (True, True, False),
                                                         (True, False, True), (False, True, False)])
def test_matches_float64(n_groups, seq_len, hidden, vocab, chunk_rows, dtype, paired, with_ref, with_bias):
    plan = run_case(n_groups, seq_len, hidden, vocab, dtype, with_bias, paired, with_ref, True, chunk_rows)
    overshoot = ChunkedHeadConfig(chunk_rows=chunk_rows).unit_overshoot
    assert plan.one_pass == (seq_len * (2 if paired else 1) <= int(chunk_rows * overshoot))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paired, additive, chunk_rows", [(True, True, 3), (False, True, 3), (False, False, 5),
                                                          (True, False, 1000)])
def test_two_passes_match_float64(dtype, paired, additive, chunk_rows):
    """A sequence (or a pair) over the chunk's limit, or a loss coupling all groups: two passes."""
    plan = run_case(4, 5, 16, 53, dtype, True, paired, True, additive, chunk_rows)
    assert not plan.one_pass


def test_plan_covers_rows_once():
    for n_groups, seq_len, paired, additive, rows in [(6, 4, True, True, 8), (6, 4, True, True, 9), (5, 3, False, True, 7),
                                                     (5, 3, False, False, 4), (4, 2, True, True, 1)]:
        plan = chunk_plan(n_groups, seq_len, paired, additive, rows)
        covered = sorted(r for ranges in plan.row_ranges for a, b in ranges for r in range(a, b))
        assert covered == list(range(n_groups * seq_len))
        for ranges in plan.row_ranges:
            assert sum(b - a for a, b in ranges) <= max(rows, 0) or not plan.one_pass
        if plan.one_pass:
            for ranges in plan.group_ranges:
                if paired:  # whole pairs: group i with group i + B/2
                    (a, b), (c, d) = ranges
                    assert (c - a, d - b) == (n_groups // 2, n_groups // 2)


@pytest.mark.parametrize("n_groups, seq_len, paired, chunk_rows, units, one_pass", [
    (16, 1024, True, 3268, 2, True),    # 1.6 pairs of budget: two pairs a chunk (4096 <= 4357 rows)
    (8, 1024, False, 3268, 3, True),    # 3.2 sequences: three
    (8, 4096, False, 3268, 1, True),    # a sequence 25% over the budget: still one pass
    (8, 4096, False, 3000, 0, False),   # 37% over: two passes
    (8, 1024, False, 1400, 1, True),    # 1.37 sequences: one (two would be 2048 > 1866 rows)
])
def test_whole_units_nearest_the_budget(n_groups, seq_len, paired, chunk_rows, units, one_pass):
    overshoot = 4 / 3
    unit_rows = seq_len * (2 if paired else 1)
    assert units_per_chunk(unit_rows, chunk_rows, overshoot) == units
    plan = chunk_plan(n_groups, seq_len, paired, True, chunk_rows, overshoot)
    assert plan.one_pass == one_pass
    limit = int(chunk_rows * overshoot) if one_pass else chunk_rows
    assert all(sum(b - a for a, b in ranges) <= limit for ranges in plan.row_ranges)
    covered = sorted(r for ranges in plan.row_ranges for a, b in ranges for r in range(a, b))
    assert covered == list(range(n_groups * seq_len))
    if one_pass:
        assert len(plan.row_ranges) == -(-(n_groups // (2 if paired else 1)) // units)


def test_frozen_weight_and_empty_batch():
    x, weight, bias, target, _, weights = make_batch(4, 3, 8, 11, torch.float32, True, False)
    mask = target != IGNORE
    x.requires_grad_()
    loss, _ = chunked_head_loss(x, weight, bias, token_quantities, make_group_fn(4, False, True), (target,),
                                (mask, weights))
    loss.backward()
    assert x.grad is not None and weight.grad is None and bias.grad is None
    empty = torch.zeros(0, 3, 8, device=DEVICE, requires_grad=True)
    loss, (logp, _) = chunked_head_loss(empty, weight, None, token_quantities, make_group_fn(1, False, True),
                                        (target[:0],), (mask[:0], weights[:0]))
    assert float(loss.detach()) == 0.0 and logp.shape == (0,)
    loss.backward()
    assert empty.grad.shape == empty.shape


def test_bad_arguments_raise():
    x, weight, bias, target, _, weights = make_batch(3, 2, 8, 11, torch.float32, True, False)
    group_fn = make_group_fn(3, True, True)
    with pytest.raises(ValueError, match="even batch"):
        chunked_head_loss(x, weight, bias, token_quantities, group_fn, (target,), (target != IGNORE, weights),
                          paired=True)
    with pytest.raises(ValueError, match="3-D"):
        chunked_head_loss(x[0], weight, bias, token_quantities, group_fn, (target,))
    with pytest.raises(TypeError, match="same dtype"):
        chunked_head_loss(x, weight.bfloat16(), None, token_quantities, group_fn, (target,))
    with pytest.raises(ValueError, match="token_args"):
        chunked_head_loss(x, weight, bias, token_quantities, group_fn, (target[:, :1],))


@pytest.mark.parametrize("n_labels, temperature, log_sum_sq", [(1, 1.0, False), (2, 0.7, False), (1, 1.0, True),
                                                                (2, 0.7, True)])
def test_target_log_probs_in_place_matches_autograd(n_labels, temperature, log_sum_sq):
    """The closed-form in-place forward and backward against float64 autograd of the same quantities
    (the ``log sum p^2`` column a constant)."""
    from liger_kernel.ops.chunked_head import target_log_probs

    rows, vocab = 13, 97
    logits = torch.randn(rows, vocab, device=DEVICE) * 4
    labels = [torch.randint(0, vocab, (rows,), device=DEVICE) for _ in range(n_labels)]
    for lab in labels:
        lab[torch.rand(rows, device=DEVICE) < 0.3] = IGNORE
    grad_q = torch.randn(rows, n_labels + 1 + log_sum_sq, device=DEVICE)
    token_fn = target_log_probs(IGNORE, temperature, log_sum_sq_probs=log_sum_sq)
    z64 = logits.double().requires_grad_()
    q64 = token_fn(z64, *labels)
    # Written out: log softmax at the temperature, and the raw row sum.
    logp = (z64 / temperature).log_softmax(-1)
    for j, lab in enumerate(labels):
        expected = logp.gather(-1, lab.clamp_min(0).unsqueeze(-1)).squeeze(-1) * (lab != IGNORE)
        torch.testing.assert_close(q64[:, j], expected)
    torch.testing.assert_close(q64[:, -1], z64.sum(-1))
    if log_sum_sq:
        torch.testing.assert_close(q64[:, -2], (logp.exp() ** 2).sum(-1).log())
        assert q64.shape[-1] == n_labels + 2
    (g64,) = torch.autograd.grad(q64, z64, grad_q.double())
    buffer = logits.clone()
    q, state = token_fn.statistics(buffer, *labels)
    torch.testing.assert_close(q.double(), q64.detach(), atol=1e-5, rtol=1e-6)
    g = token_fn.logit_grad_(buffer, state, grad_q, *labels)
    assert g.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(g.double(), g64, atol=1e-6 * float(g64.abs().max()), rtol=1e-5)


def test_two_passes_reuse_the_closed_forms_statistics(monkeypatch):
    """Two passes with a closed-form ``token_fn``: the second pass writes each chunk's gradient from
    the first pass's row statistics (one statistics pass per chunk in all), and gets what the
    autograd path gets on the same quantities."""
    from liger_kernel.ops import head_epilogue

    closed_form = head_epilogue.LogitRowStatistics(IGNORE, entropy=True, row_sum=True)  # token_quantities' columns
    x, weight, bias, target, _, weights = make_batch(4, 5, 16, 53, torch.float32, True, False)
    mask = target != IGNORE
    group_fn = make_group_fn(4, False, False)  # couples the groups: two passes
    counted = head_epilogue.row_statistics
    calls = []
    monkeypatch.setattr(head_epilogue, "row_statistics", lambda *a, **k: calls.append(1) or counted(*a, **k))
    results = []
    for token_fn in (closed_form, token_quantities):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
        with override_launch_config(ChunkedHeadConfig, chunk_rows=6):
            loss, _ = chunked_head_loss(*leaves, token_fn, group_fn, (target,), (mask, weights), additive=False)
        loss.backward()
        results.append((loss.detach(), *(t.grad for t in leaves)))
    assert len(calls) == 4  # 20 rows in chunks of at most 6: four chunks, one statistics pass each
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
