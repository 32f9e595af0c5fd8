"""Per-token log-probabilities and entropies through a fused head, against float64 autograd.

Both outputs get upstream gradients (as a policy loss with an entropy bonus gives them), or
only one of them; temperature != 1; ignored tokens; odd shapes; fp32 and bf16; verl's call shape.
"""

import pytest
import torch

from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction
from liger_kernel.ops.chunked_head import ChunkedHeadConfig
from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.fused_linear_logprobs import fused_linear_logprobs, log_prob_entropy_rows, row_chunks
from liger_kernel.ops.head_chunking import ChunkPlan
from tests.chunked_loss.reference import assert_grads_match, assert_loss_match, reference_grads
from tests.utils import DEVICE

IGNORE = -100


def reference_rows(logits, target, temperature):
    """float64 (logp, entropy) per row, 0 where ignored."""
    valid = target != IGNORE
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp_all.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return picked * valid, entropy * valid


def random_head(leading, hidden, vocab, dtype, with_bias):
    """Fresh ``(x, weight, bias, target)``, about 30% of the targets ignored (never the first)."""
    x = torch.randn(*leading, hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, hidden, device=DEVICE) * 3 / hidden**0.5).to(dtype)
    bias = torch.randn(vocab, device=DEVICE).to(dtype) if with_bias else None
    target = torch.randint(0, vocab, leading, device=DEVICE)
    target[torch.rand(leading, device=DEVICE) < 0.3] = IGNORE
    target.view(-1)[0] = 0
    return x, weight, bias, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leading, hidden, vocab, temperature, with_bias, grads_of, chunk_rows", [
    ((3, 7), 16, 37, 0.7, True, "both", None),
    ((11,), 8, 2, 1.0, False, "both", 4),
    ((2, 5), 32, 101, 1.6, True, "logp", 3),
    ((4, 1), 16, 53, 0.9, False, "entropy", None),
])
def test_matches_float64(dtype, leading, hidden, vocab, temperature, with_bias, grads_of, chunk_rows):
    x, weight, bias, target = random_head(leading, hidden, vocab, dtype, with_bias)
    g = torch.randn(leading, device=DEVICE) * (grads_of != "entropy")
    h = torch.randn(leading, device=DEVICE) * (grads_of != "logp")
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    override = {} if chunk_rows is None else {"chunk_rows": chunk_rows}
    with override_launch_config(ChunkedHeadConfig, **override):
        logp, entropy = fused_linear_logprobs(leaves[0], leaves[1], target, leaves[2], temperature)
        assert logp.shape == entropy.shape == leading and logp.dtype == entropy.dtype == torch.float32
        # Only the outputs the loss reads get an upstream gradient (the other's is None in backward).
        terms = ([(logp * g).sum()] if grads_of != "entropy" else []) + \
            ([(entropy * h).sum()] if grads_of != "logp" else [])
        sum(terms).backward()
        ranges = row_chunks(x.reshape(-1, hidden), weight)
    plan = ChunkPlan(False, tuple(((a, b),) for a, b in ranges), ())
    n = target.numel()

    def loss_of_logits(logits, _):
        q = torch.stack(reference_rows(logits.reshape(n, vocab), target.reshape(-1), temperature), -1).view(1, n, 2)
        lp, ent = q[0, :, 0], q[0, :, 1]  # the loss is a function of q
        value = (lp * g.reshape(-1)).sum() + (ent * h.reshape(-1)).sum()
        return value, (lp.detach(), ent.detach()), q

    x_rows = x.reshape(1, n, hidden)
    _, (lp_ref, ent_ref), grads_ref, bounds, _ = reference_grads(loss_of_logits, x_rows, weight, bias, plan,
                                                               logit_scale=1 / temperature)
    assert_loss_match(logp.reshape(-1), lp_ref, "log-probabilities")
    assert_loss_match(entropy.reshape(-1), ent_ref, "entropies")
    assert float(logp.detach().reshape(-1)[target.reshape(-1) == IGNORE].abs().sum()) == 0.0
    grads_ref[0], bounds[0] = grads_ref[0].view(x.shape), bounds[0].reshape(x.shape)
    assert_grads_match(leaves, grads_ref, bounds, len(ranges))


def test_verl_call_shape():
    """``LigerFusedLinearScaledCrossEntropyFunction.apply(_input, weight, target, temperature, ignore_index,
    m_tiles_per_cluster, return_entropy)`` -> negative log-probabilities (and entropies)."""
    x, weight = torch.randn(9, 8, device=DEVICE), torch.randn(19, 8, device=DEVICE)
    target = torch.randint(0, 19, (9,), device=DEVICE)
    target[2] = IGNORE
    nll, entropy = LigerFusedLinearScaledCrossEntropyFunction.apply(x, weight, target, 0.8, IGNORE, 1, True)
    lp_ref, ent_ref = reference_rows(x.double() @ weight.double().t(), target, 0.8)
    assert_loss_match(nll, -lp_ref, "nll")
    assert_loss_match(entropy, ent_ref, "entropy")
    only = LigerFusedLinearScaledCrossEntropyFunction.apply(x, weight, target, temperature=0.8)
    torch.testing.assert_close(only, nll)


def test_bad_arguments_raise():
    x, weight = torch.randn(4, 8, device=DEVICE), torch.randn(7, 8, device=DEVICE)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprobs(x, weight, torch.zeros(4, device=DEVICE).long(), temperature=0.0)
    with pytest.raises(ValueError, match="target"):
        fused_linear_logprobs(x, weight, torch.zeros(5, device=DEVICE).long())
    with pytest.raises(ValueError, match="target"):
        fused_linear_logprobs(x, weight, torch.full((4,), 7))
    with pytest.raises(ValueError, match="m_tiles_per_cluster"):
        LigerFusedLinearScaledCrossEntropyFunction.apply(x, weight, torch.zeros(4, device=DEVICE).long(), m_tiles_per_cluster=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy, temperature, ignore_index", [(True, 0.7, IGNORE), (False, 1.3, None),
                                                                     (True, 1.0, None), (False, 1.0, IGNORE)])
def test_closed_form_gradient_matches_autograd(dtype, with_entropy, temperature, ignore_index):
    """The in-place statistics and logit gradient the engine uses instead of autograd, on the
    chunk in its own dtype, against float64 autograd of the same rows."""
    rows = log_prob_entropy_rows(temperature, ignore_index, with_entropy)
    logits = (torch.randn(9, 23, device=DEVICE) * 3).to(dtype)
    target = torch.randint(0, 23, (9,), device=DEVICE)
    target[2] = IGNORE  # ignored, or (without ignore_index) out of range: reads token 0
    grad_q = torch.randn(9, 2 if with_entropy else 1, device=DEVICE)
    z = logits.double().requires_grad_()
    q64 = rows(z, target)
    (expected,) = torch.autograd.grad(q64, z, grad_q.double())
    before = logits.clone()
    q, state = rows.statistics(logits, target)
    assert torch.equal(logits, before)  # the statistics leave the logits alone
    torch.testing.assert_close(q.double(), q64.detach(), atol=1e-5, rtol=1e-5)
    got = rows.logit_grad_(logits, state, grad_q, target)
    assert got.data_ptr() == logits.data_ptr() and got.dtype == dtype
    # One rounding to the chunk's dtype: half an ulp of the largest entry.
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8 * float(expected.abs().max())
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=1e-5 if dtype == torch.float32 else 2**-8)


# --------------------------------------------------------------------------------------
# fused_linear_token_statistics: soft-cap, logit scale and the optional statistics
# --------------------------------------------------------------------------------------

ALL_STATISTICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def transformed(logits, temperature, softcap, logit_scale):
    """``s = softcap(z * logit_scale) / temperature`` (float64 in, float64 out)."""
    z = logits * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def reference_statistics(logits, target, temperature, softcap, logit_scale):
    """float64 ``(logp, entropy, log_sum_sq_probs, mean_logits, is_top1, top-2 gap)`` per row,
    0 (False) where ignored; ``is_top1`` against the first argmax."""
    valid = target != IGNORE
    s = transformed(logits, temperature, softcap, logit_scale)
    log_p = torch.log_softmax(s, dim=-1)
    logp = log_p.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1) * valid
    entropy = -(log_p.exp() * log_p).sum(-1) * valid
    log_sum_sq = torch.logsumexp(2 * log_p, dim=-1) * valid
    mean = s.mean(-1) * valid
    top1 = (s.argmax(-1) == target) & valid
    top2 = s.topk(min(2, s.shape[-1]), dim=-1).values
    gap = top2[:, 0] - top2[:, -1] if s.shape[-1] > 1 else torch.full_like(mean, float("inf"))
    return logp, entropy, log_sum_sq, mean, top1, gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leading, hidden, vocab, temperature, softcap, logit_scale, with_bias, grads_of, outputs, "
                         "chunk_rows, accum_dtype", [
                             ((3, 7), 16, 37, 0.7, None, 1.0, True, "both", ALL_STATISTICS, None, None),
                             ((11,), 8, 2, 1.0, 2.0, 0.5, False, "logp", ("mean_logits", "is_top1"), 4,
                              torch.float32),
                             ((2, 5), 32, 101, 1.6, 5.0, 2.0, True, "entropy", ALL_STATISTICS, 3, torch.float32),
                             ((4, 1), 16, 53, 0.9, 30.0, 1.0, False, "both", ("log_sum_sq_probs", "entropy"), None,
                              None),
                         ])
def test_token_statistics_match_float64(dtype, leading, hidden, vocab, temperature, softcap, logit_scale, with_bias,
                                        grads_of, outputs, chunk_rows, accum_dtype):
    from liger_kernel.ops.fused_linear_logprobs import fused_linear_token_statistics

    x, weight, bias, target = random_head(leading, hidden, vocab, dtype, with_bias)
    with_entropy = "entropy" in outputs
    g = torch.randn(leading, device=DEVICE) * (grads_of != "entropy")
    h = torch.randn(leading, device=DEVICE) * (grads_of != "logp" and with_entropy)
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    override = {} if chunk_rows is None else {"chunk_rows": chunk_rows}
    with override_launch_config(ChunkedHeadConfig, **override):
        got = fused_linear_token_statistics(leaves[0], leaves[1], target, leaves[2], temperature=temperature,
                                            softcap=softcap, logit_scale=logit_scale, outputs=outputs,
                                            accum_dtype=accum_dtype)
        for name in ALL_STATISTICS:
            assert (getattr(got, name) is None) == (name not in outputs), name
        assert got.logprobs.shape == leading and got.logprobs.dtype == torch.float32
        terms = ([(got.logprobs * g).sum()] if grads_of != "entropy" else []) + \
            ([(got.entropy * h).sum()] if grads_of != "logp" and with_entropy else [])
        sum(terms).backward()
        ranges = row_chunks(x.reshape(-1, hidden), weight)
    plan = ChunkPlan(False, tuple(((a, b),) for a, b in ranges), ())
    n = target.numel()

    def loss_of_logits(logits, _):
        lp, ent, *rest = reference_statistics(logits.reshape(n, vocab), target.reshape(-1), temperature, softcap,
                                              logit_scale)
        q = torch.stack((lp, ent), -1).view(1, n, 2)
        value = (q[0, :, 0] * g.reshape(-1)).sum() + (q[0, :, 1] * h.reshape(-1)).sum()
        return value, (lp.detach(), ent.detach(), *(t.detach() for t in rest)), q

    x_rows = x.reshape(1, n, hidden)
    _, ref, grads_ref, bounds, _ = reference_grads(loss_of_logits, x_rows, weight, bias, plan,
                                                   logit_scale=logit_scale / temperature)
    lp_ref, ent_ref, sq_ref, mean_ref, top1_ref, gap = ref
    assert_loss_match(got.logprobs.reshape(-1), lp_ref, "log-probabilities")
    for name, expected in (("entropy", ent_ref), ("log_sum_sq_probs", sq_ref), ("mean_logits", mean_ref)):
        if name in outputs:
            value = getattr(got, name)
            assert value.dtype == torch.float32 and value.shape == leading, name
            assert value.requires_grad == (name == "entropy"), name
            assert_loss_match(value.reshape(-1), expected, name)
    if "is_top1" in outputs:
        assert got.is_top1.dtype == torch.bool and got.is_top1.shape == leading
        clear = gap > 1e-3  # rows whose top two logits the float32 rounding cannot swap
        assert torch.equal(got.is_top1.reshape(-1)[clear], top1_ref[clear])
    grads_ref[0], bounds[0] = grads_ref[0].view(x.shape), bounds[0].reshape(x.shape)
    assert_grads_match(leaves, grads_ref, bounds, len(ranges))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_is_top1_takes_the_first_of_tied_maxima(dtype, softcap):
    """Integer inputs make the logits exact, so rows of the head that repeat give exact ties:
    the target counts as top-1 only when no earlier token reaches its logit."""
    from liger_kernel.ops.fused_linear_logprobs import fused_linear_token_statistics

    hidden, vocab = 5, 13
    x = torch.randint(-2, 3, (6, hidden), device=DEVICE).to(dtype)
    weight = torch.randint(-2, 3, (vocab, hidden), device=DEVICE).to(dtype)
    weight[9] = weight[4]
    weight[11] = weight[4]
    x[:, 0] = 20.0  # token 4 (and its copies 9, 11) the unique argmax of every row: 40 - 16 > -20 + 16
    weight[:, 0] = -1.0
    weight[4, 0] = weight[9, 0] = weight[11, 0] = 2.0
    target = torch.tensor([4, 9, 11, 0, IGNORE, 4], device=DEVICE)
    got = fused_linear_token_statistics(x, weight, target, softcap=softcap, outputs=("is_top1",))
    assert got.is_top1.tolist() == [True, False, False, False, False, True]
    reference = reference_statistics(x.double() @ weight.double().t(), target, 1.0, softcap, 1.0)[4]
    assert got.is_top1.tolist() == reference.tolist()


def test_token_statistics_bad_arguments_raise():
    from liger_kernel.ops.fused_linear_logprobs import fused_linear_token_statistics

    x, weight, target = torch.randn(4, 8, device=DEVICE), torch.randn(7, 8, device=DEVICE), torch.zeros(4, device=DEVICE).long()
    with pytest.raises(ValueError, match="unknown output 'logits'"):
        fused_linear_token_statistics(x, weight, target, outputs=("logits",))
    with pytest.raises(TypeError, match="outputs"):
        fused_linear_token_statistics(x, weight, target, outputs="entropy")
    with pytest.raises(ValueError, match="softcap"):
        fused_linear_token_statistics(x, weight, target, softcap=0.0)
    with pytest.raises(ValueError, match="accum_dtype"):
        fused_linear_token_statistics(x, weight, target, accum_dtype=torch.float16)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_token_statistics(x, weight, target, temperature=-1.0)


def test_backward_reads_each_chunk_once(monkeypatch):
    """The backward reuses the forward's row statistics: it runs no statistics pass over the
    recomputed logits, only the gradient pass (and gets the same gradients as a run that does)."""
    from liger_kernel.ops import head_epilogue

    x, weight, _, target = random_head((9,), 16, 41, torch.float32, False)
    g, h = torch.randn(9, device=DEVICE), torch.randn(9, device=DEVICE)
    calls = {"statistics": 0}
    counted = head_epilogue.row_statistics

    def counting(*args, **kwargs):
        calls["statistics"] += 1
        return counted(*args, **kwargs)

    monkeypatch.setattr(head_epilogue, "row_statistics", counting)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight)]
    with override_launch_config(ChunkedHeadConfig, chunk_rows=4):
        logp, entropy = fused_linear_logprobs(leaves[0], leaves[1], target, None, 0.8)
        forward_passes = calls["statistics"]
        ((logp * g).sum() + (entropy * h).sum()).backward()
    assert forward_passes == 3 and calls["statistics"] == forward_passes
    # The same gradients with the statistics recomputed in backward from the fresh logits.
    from liger_kernel.ops.chunked_head import chunked_head_loss_and_grads

    grad_out = torch.stack([g, h], 1)
    rows = log_prob_entropy_rows(0.8, IGNORE)
    with override_launch_config(ChunkedHeadConfig, chunk_rows=4):
        _, _, grads = chunked_head_loss_and_grads(
            x.unsqueeze(1), weight, None, rows, lambda q, q_ref, up: ((q[:, 0, :] * up).sum(), ()),
            token_args=(target.unsqueeze(1),), group_args=(grad_out,), needs=(True, True, False))
    torch.testing.assert_close(leaves[0].grad, grads.x.view(x.shape), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(leaves[1].grad, grads.weight, rtol=1e-6, atol=1e-7)



def count_engine_logit_gemms(monkeypatch) -> list[int]:
    """A list that receives the row count of every logits GEMM the chunked head engine runs."""
    from liger_kernel.ops import chunked_head

    counted = chunked_head._logits
    rows: list[int] = []

    def counting(*args):
        rows.append(args[0].shape[0])
        return counted(*args)

    monkeypatch.setattr(chunked_head, "_logits", counting)
    return rows


@pytest.mark.parametrize("chunk_rows, keep, recomputed", [(4, True, 2), (4, False, 3), (5, True, 1), (9, True, 0)])
def test_backward_recomputes_only_the_chunks_it_did_not_keep(monkeypatch, chunk_rows, keep, recomputed):
    """The forward keeps the logits of its leading chunks, one chunk budget's rows (9 rows in
    chunks of 3 under a budget of 4 keep one; 5 + 4 under 5 keep one; one chunk of 9 is kept
    whole); the backward recomputes only the others, frees every kept chunk, and gets the same
    gradients as a backward that recomputes every chunk."""
    x, weight, bias, target = random_head((9,), 16, 41, torch.bfloat16, True)
    g, h = torch.randn(9, device=DEVICE), torch.randn(9, device=DEVICE)
    backward_gemms = count_engine_logit_gemms(monkeypatch)
    grads = []
    for keep_forward_logits in (keep, False):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
        with override_launch_config(ChunkedHeadConfig, chunk_rows=chunk_rows, keep_forward_logits=keep_forward_logits):
            n_chunks = len(row_chunks(x, weight))
            logp, entropy = fused_linear_logprobs(leaves[0], leaves[1], target, leaves[2], 0.8)
            kept = logp.grad_fn.kept_logits
            n_kept = len(kept)
            backward_gemms.clear()
            ((logp * g).sum() + (entropy * h).sum()).backward()
        assert kept == []
        assert len(backward_gemms) == n_chunks - n_kept
        if keep_forward_logits == keep:
            assert len(backward_gemms) == recomputed
        grads.append([leaf.grad for leaf in leaves])
    for ours, recomputing in zip(*grads):
        torch.testing.assert_close(ours, recomputing, rtol=0, atol=0)


def test_nothing_is_kept_without_gradients():
    """Only a forward whose backward will recompute keeps logits: none where no input needs a
    gradient, and a kept chunk list that does not match the engine's chunks is refused."""
    from liger_kernel.ops.chunked_head import chunked_head_loss_and_grads, per_token_chunks

    x, weight, _, target = random_head((7,), 8, 19, torch.float32, False)
    with override_launch_config(ChunkedHeadConfig, chunk_rows=3):
        assert per_token_chunks(x, weight, (False, False)).n_kept == 0
        assert per_token_chunks(x, weight, (False, True)) == per_token_chunks(x, weight, (True, True))
        assert per_token_chunks(x, weight, (True, False)).n_kept == 1
        logp, _ = fused_linear_logprobs(x, weight.requires_grad_(), target)
        assert len(logp.grad_fn.kept_logits) == 1
        rows = log_prob_entropy_rows(1.0, IGNORE)
        for kept in ([(torch.zeros(2, 19, device=DEVICE), None)], [(torch.zeros(3, 19, device=DEVICE), None)] * 4):
            with pytest.raises(ValueError, match="kept"):
                chunked_head_loss_and_grads(x.unsqueeze(1), weight, None, rows,
                                            lambda q, q_ref: (q[:, 0, 0].sum(), ()),
                                            token_args=(target.unsqueeze(1),), kept_logits=kept)


def test_backward_outside_the_forwards_override_uses_the_forwards_chunks(monkeypatch):
    """A forward run under a chunk override and a backward run after the block (or, on CUDA, in
    autograd's device thread) use the same chunks: the backward reads the kept chunk and
    recomputes only the others, with the gradients of a run entirely within the block."""
    x, weight, _, target = random_head((7,), 8, 19, torch.float32, False)
    g = torch.randn(7, device=DEVICE)
    backward_gemms = count_engine_logit_gemms(monkeypatch)
    grads = []
    for backward_in_block in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight)]
        with override_launch_config(ChunkedHeadConfig, chunk_rows=3):
            logp, _ = fused_linear_logprobs(leaves[0], leaves[1], target)
            loss = (logp * g).sum()
            backward_gemms.clear()
            if backward_in_block:
                loss.backward()
        if not backward_in_block:
            loss.backward()
        assert backward_gemms == [2, 2]  # chunks of 3, 2 and 2 rows, the first kept
        grads.append([leaf.grad for leaf in leaves])
    for outside, inside in zip(*grads):
        torch.testing.assert_close(outside, inside, rtol=0, atol=0)
