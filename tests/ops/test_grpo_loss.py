"""Per-token log-probabilities / entropy kernels and the GRPO-family losses on logits against
float64 references (TRL's formulas), forward and backward."""

import pytest
import torch

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.grpo_loss import (
    SelectiveLogSoftmaxConfig,
    fused_selective_log_softmax,
    grpo_loss,
    selective_log_softmax,
    token_entropy,
)
from liger_kernel.reference.distillation import grpo_loss_reference, selective_log_softmax_reference
from tests.utils import DEVICE, assert_close, shapes

SHAPES = shapes([(2, 5, 37), (3, 4, 100)], [(4, 256, 32000), (2, 512, 4099)])


def _mask(n_batch, n_positions):
    mask = (torch.rand(n_batch, n_positions, device=DEVICE) > 0.3).long()
    mask[-1] = 0  # one sequence with every position masked
    mask[0] = 1  # and one with none
    return mask


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_mask", [False, True])
def test_log_probs_and_entropy_match_reference(shape, dtype, temperature, with_mask):
    n_batch, n_positions, vocab = shape
    logits = (3.0 * torch.randn(shape, device=DEVICE)).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (n_batch, n_positions), device=DEVICE)
    mask = _mask(n_batch, n_positions) if with_mask else None
    with override_launch_config(SelectiveLogSoftmaxConfig, block_size=32):
        logp, entropy = selective_log_softmax(logits, ids, temperature, mask, return_entropy=True)
        g_logp, g_entropy = torch.randn_like(logp), torch.randn_like(entropy)
        ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref_logp, ref_entropy = selective_log_softmax_reference(ref_logits, ids, temperature, mask)
    ((ref_logp * g_logp.double()).sum() + (ref_entropy * g_entropy.double()).sum()).backward()
    assert logp.dtype == entropy.dtype == torch.float32
    assert_close(logp, ref_logp, torch.float32, scale=20, msg="logp")
    assert_close(entropy, ref_entropy, torch.float32, scale=20, msg="entropy")
    assert_close(logits.grad, ref_logits.grad, dtype, scale=2, msg="logits grad")


def test_entropy_error_does_not_grow_with_the_logits_size():
    """H = log S0 - S1 / S0 with S1 = sum exp(s - m) (s - m): every term is of H's size.

    Logits offset by +20 (softmax is unchanged) give s = x / T ~ 30..45. Error model (u =
    2**-24, independent roundings): the roundings of s_c (<= 2u |s_c| ~ 5e-6 each) enter H
    through the weights p_c (log p_c + H), so their sum over the few dominant classes stays
    ~1e-6; the running sums over 128 blocks of 32 add ~sqrt(128) u |S1 / S0| ~ 2e-6 (|S1 / S0|
    is ~H ~ 3 here). Hence 8e-6. Summing p s itself (|p s| ~ 45, the former form) costs
    sqrt(128) u 45 ~ 3e-5 and fails this bound, as it failed the gradient's at V = 32000 on
    the GPU (the gradient carries H's error times p |g_H| / T)."""
    logits = 3.0 * torch.randn(1, 16, 4096, device=DEVICE) + 20.0
    with override_launch_config(SelectiveLogSoftmaxConfig, block_size=32):
        entropy = token_entropy(logits, 0.7)
    _, ref_entropy = selective_log_softmax_reference(logits.double(), torch.zeros(1, 16, dtype=torch.long,
                                                                                  device=DEVICE), 0.7)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=8e-6, rtol=0)


def test_entropy_alone_and_log_probs_alone():
    logits = torch.randn(3, 6, 41, device=DEVICE, requires_grad=True)
    ids = torch.randint(0, 41, (3, 6), device=DEVICE)
    ref_logits = logits.detach().double().requires_grad_()
    ref_logp, ref_entropy = selective_log_softmax_reference(ref_logits, ids, 1.3)
    entropy = token_entropy(logits, 1.3)
    logp = selective_log_softmax(logits, ids, 1.3)
    (entropy.sum() - 2 * logp.sum()).backward()
    (ref_entropy.sum() - 2 * ref_logp.sum()).backward()
    assert_close(entropy, ref_entropy, torch.float32, scale=20)
    assert_close(logits.grad, ref_logits.grad, torch.float32, scale=2)


def test_fused_selective_log_softmax_shifts_like_its_callers_expect():
    n_batch, n_positions, vocab = 3, 5, 53
    logits = torch.randn(n_batch, n_positions + 1, vocab, device=DEVICE, requires_grad=True)
    input_ids = torch.randint(0, vocab, (n_batch, 7 + n_positions), device=DEVICE)  # prompt + completion
    mask = torch.ones_like(input_ids)
    mask[1, -2:] = 0
    out = fused_selective_log_softmax(logits, input_ids, 0.9, mask)
    assert out.shape == (n_batch, n_positions) and not out.requires_grad
    ref, _ = selective_log_softmax_reference(logits.detach().double()[:, :-1], input_ids[:, -n_positions:], 0.9,
                                             mask[:, -n_positions:])
    assert_close(out, ref, torch.float32, scale=20)
    assert torch.count_nonzero(out[1, -2:]) == 0


def _grpo_inputs(n_batch=4, n_positions=6, vocab=37, dtype=torch.float32, old=True):
    logits = (2.0 * torch.randn(n_batch, n_positions + 1, vocab, device=DEVICE)).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (n_batch, n_positions), device=DEVICE)
    with torch.no_grad():
        base = torch.log_softmax(logits.double()[:, :-1] / 0.9, -1).gather(-1, ids[..., None])[..., 0]
    # Old / reference log-probs near the current ones, varied per token, so that ratios fall on
    # both sides of every clip bound.
    old_logp = (base + 0.4 * torch.randn_like(base)).float() if old else None
    ref_logp = (base + 0.3 * torch.randn_like(base)).float()
    advantages = torch.randn(n_batch, device=DEVICE)
    mask = _mask(n_batch, n_positions)
    return logits, old_logp, ref_logp, ids, advantages, mask


GRPO_CASES = [(t, "token") for t in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo")] + [
    (t, "sequence") for t in ("grpo", "dapo", "bnpo", "dr_grpo")]


@pytest.mark.parametrize("loss_type,level", GRPO_CASES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("old", [True, False])
def test_grpo_loss_matches_trl_formulas(loss_type, level, beta, old):
    logits, old_logp, ref_logp, ids, advantages, mask = _grpo_inputs(old=old)
    vllm_ratio = torch.rand(logits.shape[0], logits.shape[1] - 1, device=DEVICE) + 0.5
    kwargs = dict(temperature=0.9, beta=beta, eps_low=0.2, eps_high=0.28 if loss_type != "cispo" else 1.5,
                  loss_type=loss_type, max_completion_length=9, importance_sampling_level=level,
                  vllm_is_ratio=vllm_ratio)
    loss, kl_mean, clip_ratio = grpo_loss(logits, old_logp, ref_logp, ids, advantages, mask, reduce=True, **kwargs)
    loss.backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref_loss, _, ref_kl, ref_clipped = grpo_loss_reference(
        ref_logits, None if old_logp is None else old_logp.double(), ref_logp.double(), ids, advantages.double(),
        mask, vllm_is_ratio=vllm_ratio.double(), **{k: v for k, v in kwargs.items() if k != "vllm_is_ratio"})
    ref_loss.backward()
    assert_close(loss, ref_loss, torch.float32, scale=20, msg="loss")
    assert_close(logits.grad, ref_logits.grad, torch.float32, scale=4, msg="logits grad")
    counted = mask.sum().clamp(min=1)
    assert_close(clip_ratio, ref_clipped.sum() / counted, torch.float32, scale=20, msg="clip ratio")
    if beta:
        assert_close(kl_mean, ref_kl.sum() / counted, torch.float32, scale=20, msg="kl")
    else:
        assert kl_mean is None
    assert torch.count_nonzero(logits.grad[:, -1]) == 0  # the dropped last position


def test_grpo_loss_per_token_outputs_bf16():
    logits, old_logp, ref_logp, ids, advantages, mask = _grpo_inputs(dtype=torch.bfloat16, vocab=70)
    per_token, kl, clipped = grpo_loss(logits, old_logp, ref_logp, ids, advantages, mask, reduce=False,
                                       temperature=0.9, beta=0.04, loss_type="grpo")
    upstream = torch.randn_like(per_token)
    (per_token * upstream).sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    _, ref_per_token, ref_kl, ref_clipped = grpo_loss_reference(
        ref_logits, old_logp.double(), ref_logp.double(), ids, advantages.double(), mask, temperature=0.9,
        beta=0.04, loss_type="grpo")
    (ref_per_token * upstream.double()).sum().backward()
    assert_close(per_token, ref_per_token, torch.float32, scale=20)
    assert_close(kl, ref_kl, torch.float32, scale=20)
    assert torch.equal(clipped, ref_clipped.float())
    assert_close(logits.grad, ref_logits.grad, torch.bfloat16, scale=2)


def test_logits_are_not_overwritten():
    logits, old_logp, ref_logp, ids, advantages, mask = _grpo_inputs()
    before = logits.detach().clone()
    loss, _, _ = grpo_loss(logits, old_logp, ref_logp, ids, advantages, mask, reduce=True)
    (loss + logits.pow(2).sum()).backward()
    assert torch.equal(logits.detach(), before)


def test_meta_tensors_give_meta_outputs():
    logits = torch.empty(2, 4, 33, device="meta", requires_grad=True)
    ids = torch.empty(2, 4, dtype=torch.long, device="meta")
    logp, entropy = selective_log_softmax(logits, ids, 0.8, None, return_entropy=True)
    assert logp.device.type == entropy.device.type == "meta" and logp.shape == (2, 4)
    (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), logits)
    assert grad.device.type == "meta" and grad.shape == logits.shape


def test_rejects_bad_arguments():
    logits = torch.randn(2, 3, 11, device=DEVICE)
    ids = torch.randint(0, 11, (2, 3), device=DEVICE)
    with pytest.raises(ValueError, match="temperature"):
        selective_log_softmax(logits, ids, 0.0)
    with pytest.raises(ValueError, match="outside"):
        selective_log_softmax(logits, ids + 11)
    with pytest.raises(ValueError, match="shape"):
        selective_log_softmax(logits, ids[:, :2])
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(torch.randn(2, 4, 11, device=DEVICE), None, None, ids, torch.randn(2, device=DEVICE),
                  loss_type="ppo", beta=0.0)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(torch.randn(2, 4, 11, device=DEVICE), None, None, ids, torch.randn(2, device=DEVICE), beta=0.1)
