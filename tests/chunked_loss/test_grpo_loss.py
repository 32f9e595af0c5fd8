"""GRPO-family losses on a fused head against TRL's formulas on float64 logits.

Inputs make every term matter: old log-probabilities scattered around the current ones so
that ratios vary along each row (token- and sequence-level importance sampling differ) and
many are clipped on both sides, advantages of both signs, one of them 0, and unbalanced, one completion with
every token masked, padded tails, beta > 0 with a reference that differs from the policy,
temperature != 1, and chunks that cut the batch (or a completion: the two-pass path).
"""

import pytest
import torch

from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss, LigerFusedLinearPPOBase
from liger_kernel.chunked_loss.functional import liger_fused_linear_grpo
from liger_kernel.chunked_loss.grpo_loss import LOSS_TYPES, LigerFusedLinearGRPOFunction
from liger_kernel.ops.chunked_head import ChunkedHeadConfig
from liger_kernel.ops.config import override_launch_config
from tests.chunked_loss.reference import (
    assert_grads_match,
    assert_loss_match,
    engine_logits,
    engine_plan,
    grpo_reference,
    reference_grads,
    rounded_leaf,
    selected_logprobs,
)
from tests.utils import DEVICE


def make_inputs(batch, seq_len, hidden, vocab, dtype, with_bias, temperature, ref_head=False):
    x = torch.randn(batch, seq_len, hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, hidden, device=DEVICE) * 2 / hidden**0.5).to(dtype)
    bias = torch.randn(vocab, device=DEVICE).to(dtype) if with_bias else None
    ids = torch.randint(0, vocab, (batch, seq_len), device=DEVICE)
    mask = (torch.rand(batch, seq_len, device=DEVICE) > 0.2).long()
    mask[0] = 1  # one completion with no padding
    mask[0, 0] = 1
    if batch > 2:
        mask[1] = 0  # one completion with every token masked
        mask[2, seq_len // 2:] = 0  # a padded tail
        ids[2, seq_len // 2:] = vocab - 1  # padding reads a pad id, as TRL's completions do
    adv = torch.randn(batch, device=DEVICE) + 0.4  # unbalanced
    adv[0] = abs(float(adv[0])) + 0.1
    if batch > 2:
        adv[-1] = -abs(float(adv[-1])) - 0.1
    if batch > 3:
        adv[-2] = 0.0  # a group whose rewards were all equal
    with torch.no_grad():
        z = x.double() @ weight.double().t() + (bias.double() if with_bias else 0)
        logp = selected_logprobs(z, ids, temperature).float()
    old = logp + 0.3 * torch.randn_like(logp)
    ref = logp + 0.5 * torch.randn_like(logp)
    head = None
    if ref_head:
        head = (torch.randn(batch, seq_len, hidden, device=DEVICE).to(dtype),
                (torch.randn(vocab, hidden, device=DEVICE) * 2 / hidden**0.5).to(dtype),
                torch.randn(vocab, device=DEVICE).to(dtype) if with_bias else None)
    return x, weight, bias, ids, mask, adv, old, ref, head


def run_case(dtype=torch.float32, shape=(4, 6, 16, 37), with_bias=True, temperature=0.7, given_old=True,
             ref_mode="given", vllm=None, adv_per_token=False, num_items=None, chunk_rows=None, **options):
    batch, seq_len, hidden, vocab = shape
    x, weight, bias, ids, mask, adv, old, ref, head = make_inputs(
        batch, seq_len, hidden, vocab, dtype, with_bias, temperature, ref_head=ref_mode == "head")
    if adv_per_token:
        adv = adv[:, None] + 0.3 * torch.randn(batch, seq_len, device=DEVICE)
    vllm_ratio = None
    if vllm == "token":
        vllm_ratio = torch.rand(batch, seq_len, device=DEVICE) + 0.5
    elif vllm == "sequence":
        vllm_ratio = torch.rand(batch, device=DEVICE) + 0.5
    old = old if given_old else None
    options.setdefault("beta", 0.1)
    loss_fn = LigerFusedLinearGRPOLoss(temperature=temperature, use_ref_model=ref_mode != "none", **options)
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    override = {} if chunk_rows is None else {"chunk_rows": chunk_rows}
    flat = LigerFusedLinearGRPOFunction.token_local(**options)
    with override_launch_config(ChunkedHeadConfig, **override):
        plan = engine_plan(as_groups(x, flat), weight, False, True)
        loss, metrics = loss_fn(
            leaves[0], leaves[1], ids, mask, adv, leaves[2], ref_per_token_logps=ref if ref_mode == "given" else None,
            old_per_token_logps=old, ref_input=head[0] if head else None, ref_weight=head[1] if head else None,
            ref_bias=head[2] if head else None, vllm_is_ratio=vllm_ratio, num_items_in_batch=num_items)
    upstream = float(torch.rand(()) + 0.5)
    (loss * upstream).backward()

    ref_logits = None
    if head:  # the engine's rounding of the reference logits, on its own chunks
        ref_logits = engine_logits(as_groups(head[0], flat), *head[1:], plan).double().view(batch, seq_len, -1)

    def loss_of_logits(logits, ref_z):
        q = selected_logprobs(logits, ids, temperature).unsqueeze(-1)  # the loss is a function of q
        logp = q[..., 0]
        ref_logp = {"given": ref, "none": None}.get(ref_mode)
        if ref_mode == "head":
            ref_logp = rounded_leaf(selected_logprobs(ref_z, ids, temperature))
        vllm_ref = vllm_ratio[:, None] if vllm_ratio is not None and vllm_ratio.dim() == 1 else vllm_ratio
        weights_from = rounded_leaf(logp, copy_of_q=True)
        value, aux = grpo_reference(logp, mask, adv, old, ref_logp, vllm_ref, num_items, **reference_options(options),
                                    weights_from=weights_from)
        return value, aux, (q, weights_from, ref_logp) if ref_mode == "head" else (q, weights_from)

    def loss_of_engine_logits(logits, ref_z):
        # q as the loss used it (a view made afterwards would get no gradient, and no allowance)
        return loss_of_logits(logits.view(batch, seq_len, -1), ref_z)

    loss_ref, metrics_ref, grads_ref, bounds, loss_allowance = reference_grads(
        loss_of_engine_logits, as_groups(x, flat), weight, bias, plan, ref_logits, logit_scale=1 / temperature)
    grads_ref[0], bounds[0] = grads_ref[0].view(x.shape), bounds[0].reshape(x.shape)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_loss_match(loss, loss_ref, allowance=loss_allowance)
    assert len(metrics) == len(metrics_ref) == (2 if options["beta"] != 0 else 1)
    for got, want in zip(metrics, metrics_ref):
        assert not got.requires_grad
        torch.testing.assert_close(got.double(), want.double(), atol=1e-4, rtol=1e-4)
    assert_grads_match(leaves, grads_ref, bounds, len(plan.row_ranges), upstream)
    return loss, plan


def as_groups(x, token_local):
    """Hidden states as the engine's groups: a token each for token-local losses, else a completion each."""
    return x.reshape(-1, 1, x.shape[-1]) if token_local else x


def reference_options(options):
    """The loss options the reference takes (its names differ for vespo's four parameters)."""
    out = dict(options)
    vespo = tuple(out.pop(k, d) for k, d in (("vespo_k_pos", 2.0), ("vespo_lambda_pos", 3.0), ("vespo_k_neg", 3.0),
                                               ("vespo_lambda_neg", 2.0)))
    out["vespo"] = vespo
    return out


@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_types_match_trl(loss_type, importance_sampling_level):
    eps_high = 3.0 if loss_type == "cispo" else 0.28  # cispo's bound is on the ratio itself
    run_case(loss_type=loss_type, importance_sampling_level=importance_sampling_level, epsilon_low=0.2,
             epsilon_high=eps_high, max_completion_length=8)


@pytest.mark.parametrize("loss_type, level", [("grpo", "sequence"), ("dapo", "token"), ("cispo", "token"),
                                              ("sapo", "token")])
def test_bf16(loss_type, level):
    run_case(dtype=torch.bfloat16, shape=(3, 5, 32, 53), loss_type=loss_type, importance_sampling_level=level,
             epsilon_high=3.0 if loss_type == "cispo" else 0.2)


OPTION_CASES = {
    "on_policy_beta0": dict(given_old=False, beta=0.0, ref_mode="none", loss_type="grpo"),
    "on_policy_kl_to_ref": dict(given_old=False, loss_type="bnpo"),
    "ref_head": dict(ref_mode="head", loss_type="dapo"),
    "ref_head_bf16": dict(ref_mode="head", loss_type="grpo", dtype=torch.bfloat16, importance_sampling_level="sequence"),
    "no_ref_model_beta": dict(ref_mode="none", loss_type="dapo"),
    "vllm_token": dict(vllm="token", loss_type="grpo"),
    "vllm_sequence_vespo": dict(vllm="sequence", loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5),
    "delta": dict(delta=1.05, loss_type="dapo"),
    "bias_correction_kl": dict(use_bias_correction_kl=True, loss_type="grpo", importance_sampling_level="sequence"),
    "temperature_1_no_bias": dict(temperature=1.0, with_bias=False, loss_type="dr_grpo", max_completion_length=11),
    "num_items_in_batch": dict(num_items=57, loss_type="dapo"),
    "advantages_per_token": dict(adv_per_token=True, loss_type="bnpo"),
    "sapo_temperatures": dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
    "odd_shape_t1": dict(shape=(3, 1, 8, 2), loss_type="grpo"),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options_match_trl(case):
    run_case(**OPTION_CASES[case])


@pytest.mark.parametrize("loss_type, level, chunk_rows", [("grpo", "sequence", 4), ("luspo", "token", 7),
                                                          ("dapo", "token", 1), ("vespo", "token", 4),
                                                          ("grpo", "token", 4), ("sapo", "sequence", 13)])
def test_chunks_cut_the_batch(loss_type, level, chunk_rows):
    """Chunks of a few rows: any rows for token-local losses; else whole completions, or two passes when one
    is over the chunk's limit (a third over its budget)."""
    _, plan = run_case(shape=(5, 6, 16, 29), loss_type=loss_type, importance_sampling_level=level,
                       chunk_rows=chunk_rows)
    token_local = level == "token" and loss_type != "vespo"
    limit = int(chunk_rows * ChunkedHeadConfig(chunk_rows=chunk_rows).unit_overshoot)
    assert len(plan.row_ranges) > 1 and plan.one_pass == (token_local or limit >= 6)


def test_sequence_level_differs_from_token_level():
    """The inputs exercise GSPO: its loss is not GRPO's on the same batch."""
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    state = torch.random.get_rng_state()
    token, _ = run_case(loss_type="grpo", importance_sampling_level="token")
    torch.random.set_rng_state(state)
    sequence, _ = run_case(loss_type="grpo", importance_sampling_level="sequence")
    # Random batches put the two losses ~1e-3 to 1e-1 apart; fp32 rounding of an O(1) loss is ~1e-7.
    assert abs(float(token.detach()) - float(sequence.detach())) > 1e-5


def test_trl_call_shape_and_functional():
    """GRPOTrainer's constructor and keyword call; the functional form takes the Function's positional order."""
    x, weight, bias, ids, mask, adv, old, ref, _ = make_inputs(4, 5, 8, 13, torch.float32, True, 0.9)
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, temperature=0.9,
                                       use_ref_model=True, loss_type="dapo", max_completion_length=5,
                                       importance_sampling_level="token", delta=None, use_bias_correction_kl=False,
                                       sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                                       vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    xs = x.clone().requires_grad_()
    loss, metrics = loss_fn(_input=xs, lin_weight=weight, selected_token_ids=ids, attention_mask=mask,
                            advantages=adv, bias=bias, old_per_token_logps=old, ref_per_token_logps=ref,
                            vllm_is_ratio=None)
    mean_kl, clip_ratio = metrics[0], metrics[-1]
    assert mean_kl.dim() == 0 and clip_ratio.dim() == 0 and 0 <= float(clip_ratio) <= 1
    loss.backward()
    xf = x.clone().requires_grad_()
    loss_f, metrics_f = liger_fused_linear_grpo(xf, weight, ids, mask, adv, bias, ref, old, None, None, None, 0.04,
                                                0.2, 0.28, "dapo", 5, "token", 1.0, 1.05, 0.9)
    loss_f.backward()
    torch.testing.assert_close(loss_f, loss.detach())
    torch.testing.assert_close(xf.grad, xs.grad)
    torch.testing.assert_close(metrics_f[-1], clip_ratio)


def test_every_token_masked():
    x, weight, bias, ids, mask, adv, old, ref, _ = make_inputs(3, 4, 8, 11, torch.float32, True, 1.0)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    loss, (kl, clip_ratio) = LigerFusedLinearGRPOLoss(loss_type="grpo")(
        leaves[0], leaves[1], ids, torch.zeros_like(mask), adv, leaves[2], ref, old)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(kl) == 0.0 and float(clip_ratio) == 0.0
    for leaf in leaves:
        assert torch.count_nonzero(leaf.grad) == 0


def test_bad_arguments_raise():
    x, weight, bias, ids, mask, adv, old, ref, _ = make_inputs(3, 4, 8, 11, torch.float32, False, 1.0)
    with pytest.raises(ValueError, match="loss_type"):
        LigerFusedLinearGRPOLoss(loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        LigerFusedLinearGRPOLoss(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="use_ref_model"):
        LigerFusedLinearGRPOLoss(use_ref_model=True)(x, weight, ids, mask, adv)
    with pytest.raises(ValueError, match="advantages"):
        LigerFusedLinearGRPOLoss(beta=0.0)(x, weight, ids, mask, adv[:2])
    bad = ids.clone()
    bad[0, 0] = 11
    with pytest.raises(ValueError, match="selected_token_ids"):  # only the ids wrong
        LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False)(x, weight, bad, mask, adv)
    with pytest.raises(ValueError, match="temperature"):
        LigerFusedLinearGRPOLoss(beta=0.0, temperature=0.0)(x, weight, ids, mask, adv)


class _ReinforceFunction(LigerFusedLinearPPOBase):
    """A minimal subclass of the PPO base: REINFORCE, -mean_b sum_t A_b m logp, with one metric."""

    @staticmethod
    def ppo_loss_fn(per_token_logps, attention_mask, advantages, full_attention_mask, ref_per_token_logps=None,
                    old_per_token_logps=None, vllm_is_ratio=None, token_normalizer=None, scale=1.0):
        loss = -(advantages[:, None] * per_token_logps * attention_mask).sum() * scale / full_attention_mask.shape[0]
        return loss, ((per_token_logps * attention_mask).sum() / token_normalizer,)

    @classmethod
    def forward(cls, ctx, _input, weight, selected_token_ids, attention_mask, advantages, bias=None, scale=1.0):
        return LigerFusedLinearPPOBase.forward(cls, ctx, _input, weight, selected_token_ids, attention_mask,
                                               advantages, bias, temperature=1.3, scale=scale)

    @staticmethod
    def backward(ctx, grad_output, *grad_metrics):
        return LigerFusedLinearPPOBase.backward(ctx, grad_output)[:6] + (None,)


def test_subclass_of_the_ppo_base():
    x, weight, bias, ids, mask, adv, _, _, _ = make_inputs(5, 4, 16, 23, torch.float32, True, 1.3)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    with override_launch_config(ChunkedHeadConfig, chunk_rows=8):
        loss, (mean_logp,) = _ReinforceFunction.apply(leaves[0], leaves[1], ids, mask, adv, leaves[2], 0.7)
        plan = engine_plan(x, weight, False, True)
    loss.backward()

    def loss_of_logits(logits, _):
        q = selected_logprobs(logits, ids, 1.3).unsqueeze(-1)  # the loss is a function of q
        logp = q[..., 0]
        value = -(adv.double()[:, None] * logp * mask).sum() * 0.7 / x.shape[0]
        return value, ((logp * mask).sum() / mask.sum(),), q

    loss_ref, (logp_ref,), grads_ref, bounds, loss_allowance = reference_grads(loss_of_logits, x, weight, bias, plan,
                                                                               logit_scale=1 / 1.3)
    assert_loss_match(loss, loss_ref, allowance=loss_allowance)
    assert_loss_match(mean_logp, logp_ref.detach(), "metric")
    assert_grads_match(leaves, grads_ref, bounds, len(plan.row_ranges))


def test_bf16_hidden_states_with_float32_head():
    """TRL's cast_lm_head_to_fp32: bf16 hidden states, float32 head. The loss is the float32 one of the
    upcast hidden states, and each gradient comes back in its tensor's dtype."""
    x, weight, bias, ids, mask, adv, old, ref, head = make_inputs(4, 5, 16, 31, torch.float32, True, 1.0, True)
    x16 = x.bfloat16()
    loss_fn = LigerFusedLinearGRPOLoss(loss_type="bnpo", importance_sampling_level="sequence")
    mixed = [x16.clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()]
    upcast = [x16.float().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()]
    ref_head = (head[0].bfloat16(), head[1], head[2])
    results = [loss_fn(*leaves[:2], ids, mask, adv, leaves[2], None, old, *ref_head) for leaves in (mixed, upcast)]
    for loss, _ in results:
        loss.backward()
    torch.testing.assert_close(results[0][0], results[1][0])
    assert mixed[0].grad.dtype == torch.bfloat16
    torch.testing.assert_close(mixed[0].grad, upcast[0].grad.bfloat16())
    torch.testing.assert_close(mixed[1].grad, upcast[1].grad)
    torch.testing.assert_close(mixed[2].grad, upcast[2].grad)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_empty_batch(level):
    x = torch.zeros(0, 4, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(11, 8, device=DEVICE, requires_grad=True)
    loss, (kl, clip_ratio) = LigerFusedLinearGRPOLoss(beta=0.1, use_ref_model=False, loss_type="grpo",
                                                      importance_sampling_level=level)(
        x, weight, torch.zeros(0, 4, dtype=torch.long, device=DEVICE), torch.zeros(0, 4, device=DEVICE),
        torch.zeros(0, device=DEVICE))
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(kl) == 0.0 and float(clip_ratio) == 0.0
    assert x.grad.shape == x.shape and float(weight.grad.abs().sum()) == 0.0


def test_sequence_level_clip_ratio_is_token_weighted():
    """GSPO (``importance_sampling_level="sequence"``): the clip ratio TRL logs from this loss is the
    fraction of counted tokens whose sequence's ratio is clipped, as in the best-known library
    (a clipped completion of 5 tokens weighs 5, not 1): here 5 / 8, where a count of sequences
    would give 1 / 3."""
    batch, seq_len, hidden, vocab = 3, 5, 8, 13
    x = torch.randn(batch, seq_len, hidden, device=DEVICE)
    weight = torch.randn(vocab, hidden, device=DEVICE) / hidden**0.5
    ids = torch.randint(0, vocab, (batch, seq_len), device=DEVICE)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], device=DEVICE)
    adv = torch.tensor([1.0, 1.0, -1.0], device=DEVICE)
    with torch.no_grad():
        logp = selected_logprobs(x.double() @ weight.double().t(), ids, 1.0).float()
    old = logp.clone()
    old[0] -= 1.0  # ratio e^1 > 1 + eps_high with a positive advantage: clipped; the others have ratio 1
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, loss_type="grpo", importance_sampling_level="sequence",
                                       use_ref_model=False)
    _, (clip_ratio,) = loss_fn(x, weight, ids, mask, adv, old_per_token_logps=old)
    torch.testing.assert_close(clip_ratio.double(), torch.tensor(5 / 8, dtype=torch.float64, device=DEVICE))
