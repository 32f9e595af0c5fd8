"""GRPO and its variants on a fused linear head (no logits), with TRL's GRPOTrainer conventions.

Per token of completion b (``m`` the loss mask, ``A_b`` the advantage, ``logp`` the policy's
log-probabilities at temperature ``tau`` (:mod:`.fused_linear_ppo`), ``old`` the sampling
policy's (the current one, detached, when not given), ``ref`` the reference policy's)::

    log r[b, t] = logp - old                                     (importance_sampling_level="token")
    log r[b]    = sum_t m (logp - old) / max(1, sum_t m)         ("sequence", GSPO; one ratio a row)
    r = exp(log r)

    grpo, bnpo, dr_grpo, dapo, luspo:
        l = -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)   (min(r, delta) only with delta)
    cispo:  l = -sg(min(r, eps_high)) A logp
    sapo:   l = -A (4 / s) sigmoid(s (r - 1)),   s = sapo_temperature_pos if A > 0 else sapo_temperature_neg
    vespo:  l = -sg(phi_b) A logp,  log w_b = clamp(sum_t m clamp(logp - old, -20, 20)
                                                    + sum_t log vllm_is_ratio, log 1e-8, 20),
            phi_b = exp(lam + k log w_b - lam w_b),  (k, lam) = (k_pos, lam_pos) if A >= 0 else (k_neg, lam_neg)

    l *= vllm_is_ratio                                  (when given; not for vespo, where it is in phi)
    l += beta * kl,  kl = exp(ref - logp) - (ref - logp) - 1      (k3; times r with use_bias_correction_kl)

and the loss, with B the batch size and T its padded completion length::

    grpo, sapo:        mean_b [ sum_t m l / max(1, sum_t m) ]
    bnpo:              sum m l / max(1, sum m)
    dr_grpo:           sum m l / (B * max_completion_length)
    dapo, cispo, vespo: sum m l / N,  N = num_items_in_batch / world_size if given, else the batch's
                       token count summed over ranks / world_size (at least 1)
    luspo:             sum_{b,t} l[b, t] (sum_t m[b]) / (B * T')   (every entry, padding included, as
                       TRL's mean; T' = 1 when l has one entry a row)

Metrics, as TRL's GRPOTrainer reads them (``metrics[0]`` the KL when ``beta != 0``,
``metrics[-1]`` the clip ratio): ``(mean_kl, clip_ratio)`` or ``(clip_ratio,)``: ``kl`` as it
enters the loss (times ``r`` with ``use_bias_correction_kl``), a mean over the batch's counted
tokens, and the fraction of the batch's counted tokens whose ratio is clipped in the direction
of their advantage (with ``importance_sampling_level="sequence"`` a clipped sequence counts all
its tokens, as in the best-known library, whose value TRL's trainers log as ``clip_ratio``;
TRL's own loss logs ``clip_ratio/region_mean`` as a fraction of sequences there)
(``r < 1 - eps_low`` with ``A < 0`` or ``r > 1 + eps_high`` with ``A > 0``; for cispo ``r > eps_high`` with ``A > 0``; always 0 for sapo and vespo).

Deviations from TRL / the best-known library, on purpose:
* ``compiled`` and ``chunk_size`` are accepted and ignored: chunks are sized by the engine's
  memory budget (:class:`~liger_kernel.ops.chunked_head.ChunkedHeadConfig`); nothing is compiled.
* ``importance_sampling_level="sequence"`` is accepted for every loss type (TRL warns for
  some); vespo computes its own sequence weight and ignores the level, as in TRL.
* ``beta != 0`` without a reference (``use_ref_model=False``) uses the current policy, detached,
  as the reference: the KL term and its gradient are then 0.
* An empty batch (B = 0) has loss 0 (TRL's mean over no completions is NaN).
* Token-level ratios (every loss type but vespo) make the loss a sum of per-token terms, so
  the engine chunks tokens freely in one pass (:meth:`LigerFusedLinearGRPOFunction.token_local`);
  sequence-level ratios and vespo chunk whole completions (two passes when one exceeds a chunk).
"""

from __future__ import annotations

import math

import torch

from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase
from liger_kernel.ops.autograd import InputGradients

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def k3_kl(ref_logps: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: ``exp(ref - logp) - (ref - logp) - 1``."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1.0


@torch.no_grad()
def vespo_weights(advantages, log_ratio, mask, vllm_is_ratio, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's detached per-sequence weight ``phi`` (G, 1); see the module docstring."""
    low = math.log(1e-8)
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if vllm_is_ratio is not None:
        log_w = log_w + vllm_is_ratio.log().clamp(low, 20.0).sum(-1, keepdim=True)
    log_w = log_w.clamp(low, 20.0)
    nonneg = advantages[:, :1] >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_per_token_loss(per_token_logps, attention_mask, advantages, ref_per_token_logps, old_per_token_logps,
                        vllm_is_ratio, beta, epsilon_low, epsilon_high, loss_type, importance_sampling_level,
                        sapo_temperature_pos, sapo_temperature_neg, delta, use_bias_correction_kl,
                        vespo_params):
    """Per-token loss ``l`` (G, T) or (G, 1), the KL (or None), and the clipped-token indicator."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old
    if importance_sampling_level == "token":
        log_weights = log_ratio
    elif importance_sampling_level == "sequence":
        log_weights = (log_ratio * attention_mask).sum(-1, keepdim=True) / attention_mask.sum(-1, keepdim=True).clamp(
            min=1.0)
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    ratio = torch.exp(log_weights)

    if loss_type in CLIPPED_LOSS_TYPES:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        unclipped = torch.clamp(ratio, max=delta) if delta is not None else ratio
        loss = -torch.min(unclipped * adv, clipped * adv)
        is_clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    elif loss_type == "cispo":
        loss = -torch.clamp(ratio, max=epsilon_high).detach() * adv * per_token_logps
        is_clipped = (ratio > epsilon_high) & (adv > 0)
    elif loss_type == "sapo":
        temps = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        loss = -adv * torch.sigmoid(temps * (ratio - 1)) * 4 / temps
        is_clipped = torch.zeros_like(loss, dtype=torch.bool)
    elif loss_type == "vespo":
        phi = vespo_weights(adv, log_ratio, attention_mask, vllm_is_ratio, *vespo_params)
        loss = -phi * adv * per_token_logps
        is_clipped = torch.zeros_like(loss, dtype=torch.bool)
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")

    if vllm_is_ratio is not None and loss_type != "vespo":
        loss = loss * vllm_is_ratio
    kl = None
    if beta != 0.0:
        ref = per_token_logps.detach() if ref_per_token_logps is None else ref_per_token_logps
        kl = k3_kl(ref, per_token_logps)
        if use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + beta * kl
    return loss, kl, is_clipped


class LigerFusedLinearGRPOFunction(LigerFusedLinearPPOBase):
    """``apply(_input, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
    old_per_token_logps, ref_input, ref_weight, ref_bias, beta, epsilon_low, epsilon_high, loss_type,
    max_completion_length, importance_sampling_level, sapo_temperature_pos, sapo_temperature_neg,
    temperature, compiled, use_ref_model, chunk_size, vllm_is_ratio, delta, use_bias_correction_kl,
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, num_items_in_batch)`` -> ``(loss, metrics)``.

    The positional order of the best-known library's function; see the module docstring for the math.
    """

    @staticmethod
    def token_local(importance_sampling_level="token", loss_type="dapo", **options) -> bool:
        """Token-level ratios make every loss type but vespo (whose weight reads the whole completion)
        a sum of per-token terms."""
        return importance_sampling_level == "token" and loss_type != "vespo"

    @staticmethod
    def ppo_loss_fn(per_token_logps, attention_mask, advantages, full_attention_mask, ref_per_token_logps=None,
                    old_per_token_logps=None, vllm_is_ratio=None, token_normalizer=None, sequence_lengths=None,
                    beta=0.04,
                    epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo", max_completion_length=None,
                    importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                    delta=None, use_bias_correction_kl=False, vespo_params=(2.0, 3.0, 3.0, 2.0)):
        """Chunk loss and metrics (additive over chunks: normalisers come from the whole batch)."""
        mask = attention_mask
        per_token_loss, kl, is_clipped = grpo_per_token_loss(
            per_token_logps, mask, advantages, ref_per_token_logps, old_per_token_logps, vllm_is_ratio, beta,
            epsilon_low, epsilon_high, loss_type, importance_sampling_level, sapo_temperature_pos,
            sapo_temperature_neg, delta, use_bias_correction_kl, vespo_params)
        n_seqs = max(1, full_attention_mask.shape[0])  # an empty batch has loss 0, not 0/0
        n_tokens = full_attention_mask.sum().clamp(min=1.0)
        lengths = mask.sum(-1, keepdim=True) if sequence_lengths is None else sequence_lengths
        if loss_type in ("grpo", "sapo"):
            loss = (per_token_loss * mask / lengths.clamp(min=1.0)).sum() / n_seqs
        elif loss_type == "bnpo":
            loss = (per_token_loss * mask).sum() / n_tokens
        elif loss_type == "dr_grpo":
            loss = (per_token_loss * mask).sum() / (n_seqs * max_completion_length)
        elif loss_type in ("dapo", "cispo", "vespo"):
            loss = (per_token_loss * mask).sum() / token_normalizer
        else:  # luspo: TRL's mean over every entry of the per-token loss, padding included
            per_token = per_token_loss.shape == mask.shape
            width = full_attention_mask.shape[1] if per_token else 1
            loss = (per_token_loss * (lengths if per_token else lengths[..., :1])).sum() / (n_seqs * width)
        metrics = []
        if kl is not None:
            metrics.append((kl * mask).sum() / n_tokens)
        # Token-weighted also with one ratio a sequence (GSPO): a clipped sequence counts its tokens.
        metrics.append((is_clipped.expand_as(mask) * mask).sum() / n_tokens)
        return loss, tuple(metrics)

    @classmethod
    def forward(cls, ctx, _input, weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo", max_completion_length=None,
                importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                temperature=1.0, compiled=True, use_ref_model=True, chunk_size=1, vllm_is_ratio=None, delta=None,
                use_bias_correction_kl=False, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                vespo_lambda_neg=2.0, num_items_in_batch=None):
        check_grpo_options(loss_type, importance_sampling_level, max_completion_length, sapo_temperature_pos,
                           sapo_temperature_neg, delta)
        return LigerFusedLinearPPOBase.forward_chunked(
            cls, ctx, _input, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
            old_per_token_logps, ref_input, ref_weight, ref_bias, temperature=temperature,
            use_ref_model=use_ref_model, vllm_is_ratio=vllm_is_ratio, num_items_in_batch=num_items_in_batch,
            beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, loss_type=loss_type,
            max_completion_length=max_completion_length, importance_sampling_level=importance_sampling_level,
            sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg, delta=delta,
            use_bias_correction_kl=use_bias_correction_kl,
            vespo_params=(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg))

    @staticmethod
    def backward(ctx, grad_output, *grad_metrics):
        grad_input, grad_weight, *_, grad_bias = LigerFusedLinearPPOBase.backward(ctx, grad_output)[:6]
        return _GRADS(_input=grad_input, weight=grad_weight, bias=grad_bias)


def check_grpo_options(loss_type, importance_sampling_level, max_completion_length, sapo_temperature_pos,
                       sapo_temperature_neg, delta):
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    if loss_type == "dr_grpo" and not (max_completion_length and max_completion_length > 0):
        raise ValueError("loss_type 'dr_grpo' needs max_completion_length > 0")
    if sapo_temperature_pos <= 0 or sapo_temperature_neg <= 0:
        raise ValueError(f"sapo temperatures must be > 0, got {sapo_temperature_pos}, {sapo_temperature_neg}")
    if delta is not None and delta <= 0:
        raise ValueError(f"delta must be > 0 (or None), got {delta}")


_GRADS = InputGradients(LigerFusedLinearGRPOFunction.forward)


class LigerFusedLinearGRPOLoss(torch.nn.Module):
    """GRPO-family loss of a linear head's hidden states, as TRL's GRPOTrainer constructs and calls it.

    ``LigerFusedLinearGRPOLoss(beta=0.04, compiled=True, use_ref_model=True, chunk_size=1, epsilon_low=0.2,
    epsilon_high=0.2, loss_type="dapo", max_completion_length=None, importance_sampling_level="token",
    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, temperature=1.0, delta=None,
    use_bias_correction_kl=False, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)``

    ``forward(_input (B, T, D), lin_weight (V, D), selected_token_ids (B, T), attention_mask (B, T),
    advantages (B,) or (B, T), bias=None, ref_per_token_logps=None, old_per_token_logps=None,
    ref_input=None, ref_weight=None, ref_bias=None, vllm_is_ratio=None, num_items_in_batch=None)``
    returns ``(loss, metrics)``: ``metrics = (mean_kl, clip_ratio)`` when ``beta != 0``, else
    ``(clip_ratio,)``. See the module docstring for the math and the deviations.
    """

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length: int | None = None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: float | None = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0):
        super().__init__()
        check_grpo_options(loss_type, importance_sampling_level, max_completion_length, sapo_temperature_pos,
                           sapo_temperature_neg, delta)
        self.beta, self.compiled, self.use_ref_model, self.chunk_size = beta, compiled, use_ref_model, chunk_size
        self.epsilon_low, self.epsilon_high, self.loss_type = epsilon_low, epsilon_high, loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
        self.temperature, self.delta, self.use_bias_correction_kl = temperature, delta, use_bias_correction_kl
        self.vespo_k_pos, self.vespo_lambda_pos = vespo_k_pos, vespo_lambda_pos
        self.vespo_k_neg, self.vespo_lambda_neg = vespo_k_neg, vespo_lambda_neg

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                vllm_is_ratio=None, num_items_in_batch=None):
        return LigerFusedLinearGRPOFunction.apply(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
            old_per_token_logps, ref_input, ref_weight, ref_bias, self.beta, self.epsilon_low, self.epsilon_high,
            self.loss_type, self.max_completion_length, self.importance_sampling_level, self.sapo_temperature_pos,
            self.sapo_temperature_neg, self.temperature, self.compiled, self.use_ref_model, self.chunk_size,
            vllm_is_ratio, self.delta, self.use_bias_correction_kl, self.vespo_k_pos, self.vespo_lambda_pos,
            self.vespo_k_neg, self.vespo_lambda_neg, num_items_in_batch)
