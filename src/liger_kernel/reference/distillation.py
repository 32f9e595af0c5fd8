"""Pure-torch references of the logits-level distillation and RL losses, written from the
published formulas (TRL's ``generalized_jsd_loss`` and ``GRPOTrainer``, torch's ``kl_div``).

Tests call them on float64 copies of the inputs; autograd gives the reference gradients.
Nothing here is fast or memory-lean: every intermediate is a full (N, V) tensor.
"""

import math

import torch
import torch.nn.functional as F


def _counted(labels, ignore_index, n_rows, device):
    if labels is None:
        return torch.ones(n_rows, dtype=torch.bool, device=device)
    return labels.reshape(-1) != ignore_index


def jsd_reference(student_logp, teacher_logp, shift_labels=None, beta=0.5, ignore_index=-100):
    """Generalised JSD (TRL's convention: beta 0 is KL(teacher || student), 1 is KL(student ||
    teacher), else beta KL(P || M) + (1 - beta) KL(Q || M) with M = beta P + (1 - beta) Q),
    summed over the vocabulary, averaged over counted rows (0 when none count)."""
    x = student_logp.reshape(-1, student_logp.shape[-1])
    y = teacher_logp.reshape(-1, teacher_logp.shape[-1])
    if beta == 0.0:
        per_row = F.kl_div(x, y, reduction="none", log_target=True).sum(-1)
    elif beta == 1.0:
        per_row = F.kl_div(y, x, reduction="none", log_target=True).sum(-1)
    else:
        mixture = torch.logsumexp(torch.stack([x + math.log(1.0 - beta), y + math.log(beta)]), dim=0)
        per_row = (beta * F.kl_div(mixture, y, reduction="none", log_target=True)
                   + (1.0 - beta) * F.kl_div(mixture, x, reduction="none", log_target=True)).sum(-1)
    counted = _counted(shift_labels, ignore_index, x.shape[0], x.device)
    return (per_row * counted).sum() / counted.sum().clamp_min(1)


def kl_div_reference(input, target, reduction="batchmean", log_target=False):
    """torch's ``kl_div`` (the definition the op follows for targets above its eps)."""
    return F.kl_div(input, target, reduction=reduction, log_target=log_target)


def tvd_reference(p, q, shift_labels=None, reduction="batchmean", ignore_index=-100):
    """Total variation distance ``|p - q| / 2`` per element, ignored rows zeroed, reduced as
    "none" (elements), "sum", "mean" (over counted rows times V), "batchmean" (over counted rows)."""
    rows_p = p.reshape(-1, p.shape[-1])
    rows_q = q.reshape(-1, q.shape[-1])
    counted = _counted(shift_labels, ignore_index, rows_p.shape[0], p.device)
    elements = 0.5 * (rows_p - rows_q).abs() * counted[:, None]
    n = counted.sum().clamp_min(1)
    if reduction == "none":
        return elements.reshape(p.shape)
    if reduction == "sum":
        return elements.sum()
    if reduction == "mean":
        return elements.sum() / (n * p.shape[-1])
    return elements.sum() / n


def selective_log_softmax_reference(logits, input_ids, temperature=1.0, mask=None):
    """``(logp, entropy)`` of ``softmax(logits / T)``: the log-probability of each id and the
    entropy, per position, zero where ``mask`` is 0."""
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    logp = logp_all.gather(-1, input_ids.long().unsqueeze(-1)).squeeze(-1) if input_ids is not None else None
    if mask is not None:
        keep = mask != 0
        entropy = entropy * keep
        logp = None if logp is None else logp * keep
    return logp, entropy


def grpo_loss_reference(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask=None,
                        temperature=0.9, beta=0.04, eps_low=0.2, eps_high=0.4, loss_type="dapo",
                        max_completion_length=None, importance_sampling_level="token", sapo_temperature_pos=1.0,
                        sapo_temperature_neg=1.05, vllm_is_ratio=None):
    """TRL ``GRPOTrainer._compute_loss`` on logits (B, L + 1, V) (last position dropped): returns
    ``(loss, per_token_loss * mask, per_token_kl * mask or None, is_clipped * mask)``."""
    n_batch, n_positions = completion_ids.shape
    mask = torch.ones(n_batch, n_positions, dtype=logits.dtype, device=logits.device) if completion_mask is None \
        else completion_mask.to(logits.dtype)
    logp, _ = selective_log_softmax_reference(logits[:, :n_positions], completion_ids, temperature)
    old = logp.detach() if old_logp is None else old_logp.to(logits.dtype)
    log_ratio = logp - old
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logits.dtype).unsqueeze(-1)
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=eps_high).detach() * adv * logp
        clipped = (ratio > eps_high) & (adv > 0)
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, sapo_temperature_pos), torch.full_like(adv, sapo_temperature_neg))
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    else:
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
        clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    per_token = per_token.expand(n_batch, n_positions)
    clipped = clipped.expand(n_batch, n_positions).to(logits.dtype)
    if vllm_is_ratio is not None:
        per_token = per_token * vllm_is_ratio.to(logits.dtype).reshape(n_batch, -1)
    kl = None
    if beta != 0.0:
        delta = ref_logp.to(logits.dtype) - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    masked = per_token * mask
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (n_batch * (max_completion_length or n_positions))
    elif loss_type in ("dapo", "cispo"):
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "luspo":
        loss = (masked * mask.sum(-1, keepdim=True)).mean()
    else:
        raise ValueError(loss_type)
    return loss, masked, None if kl is None else kl * mask, clipped * mask
