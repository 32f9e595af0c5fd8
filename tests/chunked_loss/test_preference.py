"""Preference losses (DPO with TRL's loss types and f-divergences, ORPO, SimPO and CPO with
AlphaPO's reward shaping, KTO) against float64 references.

The references materialise the float64 logits and follow the published formulas in TRL's form
(per-sequence log-probs summed over the completion's counted tokens, or averaged where the
method averages; tokens labelled -100 do not count; losses averaged over the batch's pairs,
KTO's over its sequences). Every batch has ignored tokens and one sequence whose tokens are all
ignored (not for ORPO, whose log-odds of a zero-token sequence are infinite), chunk boundaries
inside the batch, and an upstream gradient other than 1. See ``tests/chunked_loss/reference.py``
for the tolerances (the FLCE tests').
"""

import math

import pytest
import torch
import torch.nn.functional as F

from liger_kernel.chunked_loss import (
    LigerFusedLinearCPOLoss,
    LigerFusedLinearDPOLoss,
    LigerFusedLinearKTOLoss,
    LigerFusedLinearORPOLoss,
    LigerFusedLinearSimPOLoss,
)
from liger_kernel.ops.chunked_head import ChunkedHeadConfig
from liger_kernel.ops.config import override_launch_config
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


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------


def make_batch(n_seqs, seq_len, hidden, vocab, dtype, with_bias, all_ignored=True, scale=2.0):
    x = torch.randn(n_seqs, seq_len, hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, hidden, device=DEVICE) * scale / hidden**0.5).to(dtype)
    bias = (torch.randn(vocab, device=DEVICE) * 0.5).to(dtype) if with_bias else None
    target = torch.randint(0, vocab, (n_seqs, seq_len), device=DEVICE)
    target[torch.rand(n_seqs, seq_len, device=DEVICE) < 0.3] = IGNORE
    target[:, 0] = torch.randint(0, vocab, (n_seqs,), device=DEVICE)  # every sequence counts a token ...
    if all_ignored and n_seqs > 2:
        target[n_seqs - 1] = IGNORE  # ... except one, with every token ignored
    return x, weight, bias, target


def make_ref_head(x, weight, bias):
    """A reference head near the policy's (so log-ratios are O(1), not O(T))."""
    ref_x = (x.float() + 0.3 * torch.randn_like(x.float())).to(x.dtype)
    ref_w = (weight.float() + 0.3 * weight.float().std() * torch.randn_like(weight.float())).to(weight.dtype)
    ref_b = bias.detach().clone() if bias is not None else None
    return ref_x, ref_w, ref_b


def leaves_of(x, weight, bias):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]


# --------------------------------------------------------------------------------------
# Float64 references (TRL's conventions)
# --------------------------------------------------------------------------------------


def token_logps(logits, labels):
    """(B, T) log p(label) (0 where ignored), (B, T) counted mask. A reference computes its loss
    from these log-probs and returns them as its per-token quantities ``q``."""
    counted = labels != IGNORE
    logp = logits.log_softmax(-1).gather(-1, torch.where(counted, labels, 0).unsqueeze(-1)).squeeze(-1)
    return logp * counted, counted


def ref_token_logps(ref_logits, labels):
    """The reference head's (B, T) token log-probs as a float64 leaf (:func:`rounded_leaf`: the
    engine computes them in float32), and the counted mask."""
    tok, counted = token_logps(ref_logits, labels)
    return rounded_leaf(tok) * counted, counted


def with_ref(q, ref_tok):
    """What a reference returns as its per-token quantities: ``q``, and the reference head's
    token log-probs where the loss used them."""
    return q if ref_tok is None else (q, ref_tok)


def seq_logps(tok, counted, average):
    s = tok.sum(-1)
    return s / counted.sum(-1).clamp_min(1) if average else s


def reference_scores(u, f_divergence, coef):
    """f-DPO scores f'(t) at t = exp(u) (TRL's DPOTrainer, f-DPO paper)."""
    t = torch.exp(u)
    if f_divergence == "reverse_kl":
        return u
    if f_divergence == "forward_kl":
        return 1 - 1 / t
    if f_divergence == "js_divergence":
        return torch.log(2 * t / (t + 1))
    if f_divergence == "alpha_divergence":
        # (t^(a-1) - 1) / (a - 1) tends to log t as a -> 1.
        return u if coef == 1.0 else (t ** (coef - 1) - 1) / (coef - 1)
    raise AssertionError(f_divergence)


def reference_dpo_losses(c, r, beta, loss_type, ls, tau, n_c, n_r, f_divergence=("reverse_kl", 0.5), margins=None):
    """TRL's DPOTrainer per-pair losses of the chosen/rejected log-ratios; ``margins`` the
    policy's and the reference's chosen-minus-rejected log-probs (aot)."""
    sc, sr = reference_scores(c, *f_divergence), reference_scores(r, *f_divergence)
    d = sc - sr
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * d) * (1 - ls) - F.logsigmoid(-beta * d) * ls
    if loss_type == "hinge":
        return torch.relu(1 - beta * d)
    if loss_type == "ipo":
        return (sc / n_c.clamp(min=1.0) - sr / n_r.clamp(min=1.0) - 1 / (2 * beta)) ** 2
    if loss_type == "sigmoid_norm":
        return -F.logsigmoid(beta * (sc / n_c.clamp(min=1.0) - sr / n_r.clamp(min=1.0)))
    if loss_type == "exo_pair":
        qw, ql = torch.sigmoid(beta * d), torch.sigmoid(-beta * d)
        return qw * (F.logsigmoid(beta * d) - math.log(1 - ls)) + ql * (F.logsigmoid(-beta * d) - math.log(ls))
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
    if loss_type == "robust":
        clean = -(1 - ls) * F.logsigmoid(beta * d)
        flipped = -ls * F.logsigmoid(-beta * d)
        return (clean - flipped) / (1 - 2 * ls)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)
    if loss_type == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * c) + 1 - torch.sigmoid(beta * d)
    if loss_type == "discopop":
        logits = beta * d
        mod = torch.sigmoid(logits / tau)
        return -F.logsigmoid(logits) * (1 - mod) + torch.exp(-logits) * mod
    if loss_type in ("aot", "aot_unpaired"):
        # Optimal transport between the batch's two empirical distributions: match them rank by rank.
        first, second = margins if loss_type == "aot" else (c, r)
        gap = first.sort().values - second.sort().values
        return -F.logsigmoid(beta * gap) * (1 - ls) - F.logsigmoid(-beta * gap) * ls
    raise AssertionError(loss_type)


def chosen_nll(tok, counted):
    """Mean NLL over the chosen half's counted tokens (TRL's ``cross_entropy`` on the chosen
    labels), of :func:`token_logps`' outputs."""
    half = tok.shape[0] // 2
    return -tok[:half].sum() / counted[:half].sum().clamp_min(1)


def pair_metrics(logits, logps, vocab):
    half = logps.shape[0] // 2
    denom = half * logits.shape[1] * vocab
    return [logps[:half], logps[half:], logits[:half].sum() / denom, logits[half:].sum() / denom]


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def check(module_call, reference_loss, x, weight, bias, paired, chunk_rows, ref_head=None, at_engine_logits=False,
          additive=True):
    """Run ``module_call(leaves)`` under a chunk override and compare loss, metrics and grads
    with ``reference_loss(logits64, ref_logits64) -> (loss, metrics, q)`` (``additive=False``
    for a loss that couples the pairs, which the engine runs in two passes)."""
    with override_launch_config(ChunkedHeadConfig, chunk_rows=chunk_rows):
        plan = engine_plan(x, weight, paired, additive)
        leaves = leaves_of(x, weight, bias)
        loss, metrics = module_call(*leaves)
    upstream = float(torch.rand(()) + 0.5)
    (loss * upstream).backward()
    ref_logits = engine_logits(*ref_head, plan).double() if ref_head is not None else None
    loss_ref, metrics_ref, grads_ref, bounds, loss_allowance = reference_grads(
        reference_loss, x, weight, bias, plan, ref_logits, fp32_at_engine_logits=at_engine_logits)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_loss_match(loss, loss_ref, allowance=loss_allowance)
    assert len(metrics) == len(metrics_ref), (len(metrics), len(metrics_ref))
    for i, (got, want) in enumerate(zip(metrics, metrics_ref)):
        assert not got.requires_grad and got.shape == want.shape, (i, got.shape, want.shape)
        torch.testing.assert_close(got.double(), want.detach().double(), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, i=i: f"metric {i}\n{m}")
    assert_grads_match(leaves, grads_ref, bounds, len(plan.row_ranges), upstream)
    return metrics


# (B, T, D, V, chunk_rows): chunks of one or two pairs with a ragged end, T = 1, two passes (rows < 2T).
PAIR_SHAPES = [(6, 5, 16, 37, 20), (4, 1, 8, 29, 2), (4, 6, 16, 101, 7)]


# --------------------------------------------------------------------------------------
# DPO
# --------------------------------------------------------------------------------------

DPO_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
             "apo_down", "discopop", "aot", "aot_unpaired", "sigmoid_norm", "sft"]
SMOOTHING = {"sigmoid": 0.1, "exo_pair": 1e-3, "robust": 0.2, "aot": 0.15}
BATCH_SORTED = {"aot", "aot_unpaired"}


def dpo_reference(target, beta, loss_type, ls, tau, average, use_ref, precomputed, alpha, nll,
                  f_divergence=("reverse_kl", 0.5), loss_weights=None):
    """TRL's DPO loss: ``loss_type`` one type or a list summed with ``loss_weights``; ``sft`` the
    mean NLL of the chosen tokens."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = loss_weights or [1.0] * len(types)

    def loss_of_logits(logits, ref_logits):
        tok, counted = token_logps(logits, target)
        logps = seq_logps(tok, counted, average)
        half = target.shape[0] // 2
        ref, ref_tok = torch.zeros_like(logps), None
        if use_ref and precomputed is not None:
            ref = torch.cat(precomputed).double()
        elif use_ref:
            ref_tok, ref_counted = ref_token_logps(ref_logits, target)
            ref = seq_logps(ref_tok, ref_counted, average)
        c, r = logps[:half] - ref[:half], logps[half:] - ref[half:]
        margins = (logps[:half] - logps[half:], ref[:half] - ref[half:])
        counts = counted.sum(-1).double()
        n_c, n_r = (torch.ones_like(c), torch.ones_like(r)) if average else (counts[:half], counts[half:])
        loss = logits.new_zeros(())
        for name, weight in zip(types, weights):
            if name == "sft":
                loss = loss + weight * chosen_nll(tok, counted)
            else:
                loss = loss + weight * reference_dpo_losses(c, r, beta, name, ls, tau, n_c, n_r, f_divergence,
                                                            margins).mean()
        # The NLL metric is the chosen tokens' NLL whenever it enters the loss (compute_nll_loss or sft).
        nll_loss = chosen_nll(tok, counted) if nll or "sft" in types else logits.new_zeros(())
        metrics = pair_metrics(logits, logps, logits.shape[-1]) + [nll_loss, beta * c, beta * r]
        return loss + (alpha * chosen_nll(tok, counted) if nll else 0.0), metrics, with_ref(tok, ref_tok)

    return loss_of_logits


@pytest.mark.parametrize("loss_type", DPO_TYPES)
@pytest.mark.parametrize("n_seqs, seq_len, hidden, vocab, chunk_rows", PAIR_SHAPES[:2])
def test_dpo_loss_types_fp32(loss_type, n_seqs, seq_len, hidden, vocab, chunk_rows):
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, torch.float32, with_bias=True)
    ref_head = make_ref_head(x, weight, bias)
    beta, ls = 0.3, SMOOTHING.get(loss_type, 0.0)
    loss_fn = LigerFusedLinearDPOLoss(beta=beta, loss_type=loss_type, label_smoothing=ls)
    check(lambda xi, w, b: loss_fn(w, xi, target, b, *ref_head),
          dpo_reference(target, beta, loss_type, ls, 0.05, False, True, None, 1.0, False),
          x, weight, bias, True, chunk_rows, ref_head, at_engine_logits=loss_type == "discopop",
          additive=loss_type not in BATCH_SORTED)


# (f_divergence_type, f_alpha_divergence_coef): the alpha-divergence on both sides of 1, and at
# 1 (where TRL falls back to the log-ratio).
F_DIVERGENCES = [("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.3),
                 ("alpha_divergence", 1.7), ("alpha_divergence", 1.0)]


@pytest.mark.parametrize("f_divergence", F_DIVERGENCES, ids=lambda f: f"{f[0]}-{f[1]}")
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "sigmoid_norm", "exo_pair", "robust",
                                       "discopop"])
def test_dpo_f_divergences_fp32(f_divergence, loss_type):
    n_seqs, seq_len, hidden, vocab, chunk_rows = PAIR_SHAPES[0]
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, torch.float32, with_bias=True)
    ref_head = make_ref_head(x, weight, bias)
    beta, ls = 0.7, SMOOTHING.get(loss_type, 0.0)
    loss_fn = LigerFusedLinearDPOLoss(beta=beta, loss_type=loss_type, label_smoothing=ls,
                                      f_divergence_type=f_divergence[0], f_alpha_divergence_coef=f_divergence[1])
    check(lambda xi, w, b: loss_fn(w, xi, target, b, *ref_head),
          dpo_reference(target, beta, loss_type, ls, 0.05, False, True, None, 1.0, False, f_divergence),
          x, weight, bias, True, chunk_rows, ref_head, at_engine_logits=loss_type == "discopop")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_type", sorted(BATCH_SORTED))
def test_dpo_aot_sorts_over_the_batch(dtype, loss_type):
    """Many pairs whose reference margins are ordered unlike the policy's (precomputed, random), so
    that rank matching differs from pairing each sequence with its own partner."""
    # Chunks of two pairs, were the engine to split this loss by pairs.
    n_seqs, seq_len, hidden, vocab, chunk_rows = 16, 3, 8, 23, 13
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, dtype, with_bias=False)
    half = n_seqs // 2
    ref_logps = (torch.randn(half, device=DEVICE) * 2 - 6, torch.randn(half, device=DEVICE) * 2 - 6)
    beta, ls = 0.5, 0.05
    loss_fn = LigerFusedLinearDPOLoss(beta=beta, loss_type=loss_type, label_smoothing=ls)
    check(lambda xi, w, b: loss_fn(w, xi, target, b, ref_chosen_logps=ref_logps[0], ref_rejected_logps=ref_logps[1]),
          dpo_reference(target, beta, loss_type, ls, 0.05, False, True, ref_logps, 1.0, False),
          x, weight, bias, True, chunk_rows, additive=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_seqs, seq_len, hidden, vocab, chunk_rows", PAIR_SHAPES)
@pytest.mark.parametrize("options", [
    dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 0.6]),
    dict(loss_type=["aot", "sft"], label_smoothing=0.1, compute_nll_loss=True, alpha=0.5),
    dict(loss_type="aot_unpaired", average_log_prob=True),
    dict(loss_type=["sigmoid_norm", "ipo"], f_divergence_type="js_divergence", loss_weights=[1.5, 0.5]),
], ids=["mpo", "aot_sft_nll", "aot_unpaired_avg", "js_sigmoid_norm_ipo"])
def test_dpo_loss_combinations(dtype, n_seqs, seq_len, hidden, vocab, chunk_rows, options):
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, dtype, with_bias=True)
    ref_head = make_ref_head(x, weight, bias)
    beta = 0.4
    loss_fn = LigerFusedLinearDPOLoss(beta=beta, **options)
    types = options["loss_type"]
    reference = dpo_reference(target, beta, types, options.get("label_smoothing", 0.0), 0.05,
                              options.get("average_log_prob", False), True, None, options.get("alpha", 1.0),
                              options.get("compute_nll_loss", False),
                              (options.get("f_divergence_type", "reverse_kl"), 0.5), options.get("loss_weights"))
    check(lambda xi, w, b: loss_fn(w, xi, target, b, *ref_head), reference, x, weight, bias, True, chunk_rows,
          ref_head, additive=not BATCH_SORTED & set([types] if isinstance(types, str) else types))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_seqs, seq_len, hidden, vocab, chunk_rows", PAIR_SHAPES)
@pytest.mark.parametrize("options", [
    dict(loss_type="sigmoid", with_bias=False),
    dict(loss_type="ipo", average_log_prob=True, compute_nll_loss=True, alpha=0.5, with_bias=True),
    dict(loss_type="apo_zero", use_ref_model=False, with_bias=True),
    dict(loss_type="discopop", precomputed=True, with_bias=False, discopop_tau=0.3),
], ids=["sigmoid", "ipo_avg_nll", "no_ref", "precomputed_ref"])
def test_dpo_options(dtype, n_seqs, seq_len, hidden, vocab, chunk_rows, options):
    options = dict(options)
    with_bias, precomputed = options.pop("with_bias"), options.pop("precomputed", False)
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, dtype, with_bias)
    ref_head = make_ref_head(x, weight, bias)
    beta = 0.2
    loss_fn = LigerFusedLinearDPOLoss(beta=beta, **options)
    use_ref = options.get("use_ref_model", True)
    ref_logps = None
    if precomputed:
        half = n_seqs // 2
        ref_logps = (torch.randn(half, device=DEVICE) - 3, torch.randn(half, device=DEVICE) - 3)

        def call(xi, w, b):
            return loss_fn(w, xi, target, b, ref_chosen_logps=ref_logps[0], ref_rejected_logps=ref_logps[1])
    elif use_ref:
        def call(xi, w, b):
            return loss_fn(w, xi, target, b, *ref_head)
    else:
        def call(xi, w, b):
            return loss_fn(w, xi, target, b)
    reference = dpo_reference(target, beta, options["loss_type"], 0.0, options.get("discopop_tau", 0.05),
                              options.get("average_log_prob", False), use_ref, ref_logps, options.get("alpha", 1.0),
                              options.get("compute_nll_loss", False))
    check(call, reference, x, weight, bias, True, chunk_rows, ref_head if use_ref and not precomputed else None,
          at_engine_logits=options["loss_type"] == "discopop")


def wpo_reference(target, beta, loss_type, loss_weights, average):
    """TRL's DPO with ``use_weighting``: each pair's loss times ``w_c w_r``, ``w`` the exp of the
    mean over the counted tokens of ``log p(y_t) - log sum_v p_v^2``, held constant (WPO, Eq. 2)."""
    inner = dpo_reference(target, beta, loss_type, 0.0, 0.05, average, True, None, 1.0, False,
                          loss_weights=loss_weights)
    types = [loss_type] if isinstance(loss_type, str) else loss_type

    def loss_of_logits(logits, ref_logits):
        _, metrics, _ = inner(logits, ref_logits)
        tok, counted = token_logps(logits, target)
        log_sum_sq = torch.logsumexp(2 * logits.log_softmax(-1), -1)
        weights = torch.exp(((tok - log_sum_sq) * counted).sum(-1) / counted.sum(-1).clamp_min(1)).detach()
        half = target.shape[0] // 2
        logps = seq_logps(tok, counted, average)
        ref_tok, ref_counted = ref_token_logps(ref_logits, target)
        ref = seq_logps(ref_tok, ref_counted, average)
        c, r = logps[:half] - ref[:half], logps[half:] - ref[half:]
        counts = counted.sum(-1).double()
        n_c, n_r = (torch.ones_like(c), torch.ones_like(r)) if average else (counts[:half], counts[half:])
        per_pair = sum(w * reference_dpo_losses(c, r, beta, name, 0.0, 0.05, n_c, n_r)
                       for name, w in zip(types, loss_weights or [1.0] * len(types)))
        return (per_pair * weights[:half] * weights[half:]).mean(), metrics, with_ref(tok, ref_tok)

    return loss_of_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_seqs, seq_len, hidden, vocab, chunk_rows", PAIR_SHAPES)
@pytest.mark.parametrize("loss_type, loss_weights, average", [("sigmoid", None, False), ("ipo", None, True),
                                                              (["bco_pair", "hinge"], [0.7, 1.3], False)])
def test_dpo_wpo_weighting(dtype, n_seqs, seq_len, hidden, vocab, chunk_rows, loss_type, loss_weights, average):
    # A sharper head (scale 4) so that the weights spread over a range instead of sitting near 1/V.
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, dtype, with_bias=True, scale=4.0)
    ref_head = make_ref_head(x, weight, bias)
    beta = 0.3
    loss_fn = LigerFusedLinearDPOLoss(beta=beta, loss_type=loss_type, loss_weights=loss_weights, use_weighting=True,
                                      average_log_prob=average)
    check(lambda xi, w, b: loss_fn(w, xi, target, b, *ref_head),
          wpo_reference(target, beta, loss_type, loss_weights, average), x, weight, bias, True, chunk_rows, ref_head)


def ld_dpo_reference(target, beta, loss_type, ld_alpha):
    """TRL's DPO with ``ld_alpha`` (LD-DPO): in both heads' summed log-probs, the tokens of a
    sequence past the completion length its pair shares (the shorter one's) weigh ``ld_alpha``."""

    def weighted_logps(logits, reference_head=False):
        tok, counted = ref_token_logps(logits, target) if reference_head else token_logps(logits, target)
        position = counted.long().cumsum(-1)
        lengths = counted.sum(-1)
        half = target.shape[0] // 2
        shared = torch.minimum(lengths[:half], lengths[half:])
        shared = torch.cat([shared, shared])[:, None]
        in_shared = (position > 0) & (position <= shared)
        return (tok * in_shared).sum(-1) + ld_alpha * (tok * (position > shared)).sum(-1), tok, counted

    def loss_of_logits(logits, ref_logits):
        logps, tok, counted = weighted_logps(logits)
        ref, ref_tok, _ = weighted_logps(ref_logits, reference_head=True)
        half = target.shape[0] // 2
        c, r = logps[:half] - ref[:half], logps[half:] - ref[half:]
        counts = counted.sum(-1).double()
        loss = reference_dpo_losses(c, r, beta, loss_type, 0.0, 0.05, counts[:half], counts[half:]).mean()
        metrics = pair_metrics(logits, logps, logits.shape[-1]) + [logits.new_zeros(()), beta * c,
                                                                   beta * r]
        return loss, metrics, with_ref(tok, ref_tok)

    return loss_of_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_seqs, seq_len, hidden, vocab, chunk_rows", PAIR_SHAPES)
@pytest.mark.parametrize("loss_type, ld_alpha", [("sigmoid", 0.3), ("ipo", 0.0), ("bco_pair", 0.75)])
def test_dpo_ld_alpha(dtype, n_seqs, seq_len, hidden, vocab, chunk_rows, loss_type, ld_alpha):
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, dtype, with_bias=True)
    ref_head = make_ref_head(x, weight, bias)
    beta = 0.3
    loss_fn = LigerFusedLinearDPOLoss(beta=beta, loss_type=loss_type, ld_alpha=ld_alpha)
    check(lambda xi, w, b: loss_fn(w, xi, target, b, *ref_head), ld_dpo_reference(target, beta, loss_type, ld_alpha),
          x, weight, bias, True, chunk_rows, ref_head)


# --------------------------------------------------------------------------------------
# ORPO, SimPO, CPO
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_seqs, seq_len, hidden, vocab, chunk_rows", PAIR_SHAPES)
@pytest.mark.parametrize("with_nll_target", [False, True])
def test_orpo(dtype, n_seqs, seq_len, hidden, vocab, chunk_rows, with_nll_target):
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, dtype, with_bias=with_nll_target,
                                         all_ignored=False)
    nll_target = None
    if with_nll_target:
        nll_target = torch.where(torch.rand_like(target, dtype=torch.float) < 0.5, IGNORE, target)
        nll_target[:, 0] = target[:, 0]
    beta = 0.4
    loss_fn = LigerFusedLinearORPOLoss(beta=beta)

    def reference(logits, _):
        tok, counted = token_logps(logits, target)
        q = tok
        nll_tok, nll_counted = tok, counted
        if nll_target is not None:  # the NLL's tokens are a second per-token quantity
            nll_tok, nll_counted = token_logps(logits, nll_target)
            q = torch.stack([tok, nll_tok], -1)
            tok, nll_tok = q[..., 0], q[..., 1]
        logps = seq_logps(tok, counted, True)
        half = n_seqs // 2
        c, r = logps[:half], logps[half:]
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        ratio = F.logsigmoid(log_odds)
        nll = chosen_nll(nll_tok, nll_counted)
        metrics = pair_metrics(logits, logps, vocab) + [nll, beta * c, beta * r, ratio.mean(), log_odds.mean()]
        return nll - beta * ratio.mean(), metrics, q

    check(lambda xi, w, b: loss_fn(w, xi, target, b, nll_target=nll_target), reference, x, weight, bias, True,
          chunk_rows)


def reference_alphapo_reward(logps, a):
    """AlphaPO's reward r = (1 - p^(-a)) / a of a sequence probability p = exp(logps); log p at a = 0."""
    return logps if a == 0 else (1 - torch.exp(logps) ** (-a)) / a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_seqs, seq_len, hidden, vocab, chunk_rows", PAIR_SHAPES[::2])
@pytest.mark.parametrize("label_smoothing, compute_nll_loss, alphapo_alpha", [(0.0, True, 0.0), (0.15, False, 0.0),
                                                                             (0.0, False, 0.6), (0.1, True, -0.4)])
def test_simpo(dtype, n_seqs, seq_len, hidden, vocab, chunk_rows, label_smoothing, compute_nll_loss, alphapo_alpha):
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, dtype, with_bias=True)
    beta, gamma, alpha = 2.0, 0.7, 0.6
    loss_fn = LigerFusedLinearSimPOLoss(beta=beta, gamma=gamma, alpha=alpha, label_smoothing=label_smoothing,
                                        compute_nll_loss=compute_nll_loss, alphapo_alpha=alphapo_alpha)

    def reference(logits, _):
        tok, counted = token_logps(logits, target)
        logps = seq_logps(tok, counted, True)
        half = n_seqs // 2
        rewards = reference_alphapo_reward(logps, alphapo_alpha)
        h = beta * (rewards[:half] - rewards[half:]) - gamma
        loss = (-F.logsigmoid(h) * (1 - label_smoothing) - F.logsigmoid(-h) * label_smoothing).mean()
        nll = chosen_nll(tok, counted) if compute_nll_loss else logits.new_zeros(())
        metrics = pair_metrics(logits, logps, vocab) + [nll, beta * rewards[:half], beta * rewards[half:]]
        return loss + alpha * nll, metrics, tok

    check(lambda xi, w, b: loss_fn(w, xi, target, b), reference, x, weight, bias, True, chunk_rows)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "simpo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alphapo_alpha, average_log_prob", [(0.0, False), (0.25, True), (-0.15, False)])
def test_cpo(loss_type, dtype, alphapo_alpha, average_log_prob):
    n_seqs, seq_len, hidden, vocab, chunk_rows = PAIR_SHAPES[0]
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, dtype, with_bias=False)
    beta, alpha, ls, gamma = 0.1, 0.8, 0.1, 0.4
    loss_fn = LigerFusedLinearCPOLoss(beta=beta, alpha=alpha, label_smoothing=ls, loss_type=loss_type,
                                      simpo_gamma=gamma, alphapo_alpha=alphapo_alpha,
                                      average_log_prob=average_log_prob)

    def reference(logits, _):
        tok, counted = token_logps(logits, target)
        logps = seq_logps(tok, counted, average_log_prob)
        half = n_seqs // 2
        rewards = reference_alphapo_reward(logps, alphapo_alpha)
        d = rewards[:half] - rewards[half:]
        if loss_type == "simpo":
            d = d - gamma / beta
        if loss_type in ("sigmoid", "simpo"):
            losses = -F.logsigmoid(beta * d) * (1 - ls) - F.logsigmoid(-beta * d) * ls
        elif loss_type == "hinge":
            losses = torch.relu(1 - beta * d)
        else:
            losses = (d - 1 / (2 * beta)) ** 2
        nll = chosen_nll(tok, counted)
        metrics = pair_metrics(logits, logps, vocab) + [nll, beta * rewards[:half], beta * rewards[half:]]
        return losses.mean() + alpha * nll, metrics, tok

    check(lambda xi, w, b: loss_fn(w, xi, target, b), reference, x, weight, bias, True, chunk_rows)


# --------------------------------------------------------------------------------------
# KTO
# --------------------------------------------------------------------------------------


def kto_reference(target, labels, beta, kl, w_d, w_u, use_ref, average, precomputed=None):
    def loss_of_logits(logits, ref_logits):
        tok, counted = token_logps(logits, target)
        logps = seq_logps(tok, counted, average)
        ref, ref_tok = torch.zeros_like(logps), None
        if precomputed is not None:
            ref = precomputed.double()
        elif use_ref:
            ref_tok, ref_counted = ref_token_logps(ref_logits, target)
            ref = seq_logps(ref_tok, ref_counted, average)
        rho = logps - ref
        k = float(kl) if kl is not None else 0.0
        chosen = rho[labels]
        rejected = rho[~labels]
        # TRL's kto_loss: desirable and undesirable losses concatenated, then the mean over the batch.
        losses = torch.cat([w_d * (1 - torch.sigmoid(beta * (chosen - k))),
                            w_u * (1 - torch.sigmoid(beta * (k - rejected)))])
        row_sums = logits.sum(-1).sum(-1)
        metrics = [logps[labels].sum(), logps[~labels].sum(), row_sums[labels].sum(), row_sums[~labels].sum(),
                   (beta * chosen).sum(), (beta * rejected).sum()]
        return losses.mean(), metrics, with_ref(tok, ref_tok)

    return loss_of_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_seqs, seq_len, hidden, vocab, chunk_rows", [(7, 5, 16, 37, 11), (5, 1, 8, 29, 1),
                                                                       (6, 4, 16, 53, 3)])
@pytest.mark.parametrize("use_ref, weights, with_kl", [(True, (1.0, 1.0), True), (False, (1.3, 0.6), True),
                                                       (True, (0.8, 1.5), False)])
def test_kto(dtype, n_seqs, seq_len, hidden, vocab, chunk_rows, use_ref, weights, with_kl):
    x, weight, bias, target = make_batch(n_seqs, seq_len, hidden, vocab, dtype, with_bias=use_ref)
    # Unbalanced labels: the KL term and the two weights do not cancel.
    labels = torch.zeros(n_seqs, dtype=torch.bool, device=DEVICE)
    labels[: max(1, n_seqs // 3)] = True
    labels = labels[torch.randperm(n_seqs, device=DEVICE)]
    kl = (torch.rand((), device=DEVICE) * 2 + 0.5) if with_kl else None
    ref_head = make_ref_head(x, weight, bias)
    beta = 0.5
    loss_fn = LigerFusedLinearKTOLoss(beta=beta, use_ref_model=use_ref, desirable_weight=weights[0],
                                      undesirable_weight=weights[1])

    def call(xi, w, b):
        ref_kwargs = dict(ref_input=ref_head[0], ref_weight=ref_head[1], ref_bias=ref_head[2]) if use_ref else {}
        return loss_fn(_input=xi, lin_weight=w, target=target, bias=b, preference_labels=labels, kl=kl, **ref_kwargs)

    check(call, kto_reference(target, labels, beta, kl, *weights, use_ref, False), x, weight, bias, False,
          chunk_rows, ref_head if use_ref else None)


def test_kto_precomputed_reference_and_average():
    x, weight, bias, target = make_batch(5, 4, 16, 31, torch.float32, with_bias=False)
    labels = torch.tensor([True, False, False, True, False], device=DEVICE)
    ref_logps = torch.randn(5, device=DEVICE) - 2
    kl = torch.tensor([0.7], device=DEVICE)
    loss_fn = LigerFusedLinearKTOLoss(beta=0.2, use_ref_model=True, average_log_prob=True)
    check(lambda xi, w, b: loss_fn(xi, w, target, b, labels, kl=kl, ref_logps=ref_logps),
          kto_reference(target, labels, 0.2, kl, 1.0, 1.0, True, True, ref_logps), x, weight, bias, False, 8)
