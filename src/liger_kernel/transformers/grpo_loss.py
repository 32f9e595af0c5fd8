"""GRPO-family losses and per-token log-probabilities / entropy on given logits.

See :mod:`liger_kernel.ops.grpo_loss` for the math. :func:`triton_grpo_loss` follows the
best-known implementation's function of that name (arguments, defaults, return values).
"""

from liger_kernel.ops.grpo_loss import (
    fused_selective_log_softmax,
    grpo_loss,
    selective_log_softmax,
    token_entropy,
)

__all__ = ["fused_selective_log_softmax", "selective_log_softmax", "token_entropy", "triton_grpo_loss"]


def triton_grpo_loss(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask=None,
                     temperature=0.9, beta=0.04, eps_low=0.2, eps_high=0.4, inplace=True, loss_type="dapo",
                     max_completion_length=None, importance_sampling_level="token", reduce=False,
                     sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vllm_is_ratio=None):
    """GRPO-family loss on logits (B, L + 1, V); see :func:`liger_kernel.ops.grpo_loss.grpo_loss`.

    ``reduce=False`` (the default): ``(per_token_loss, per_token_kl, is_clipped)``, each (B, L)
    (``per_token_kl`` None when ``beta == 0``). ``reduce=True``: ``(loss, metrics)`` with
    ``metrics = [kl_mean, clip_ratio]``, or ``[clip_ratio]`` when ``beta == 0``. ``inplace`` is
    accepted for compatibility and not used: the logits are never overwritten.
    """
    result = grpo_loss(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask, temperature, beta,
                       eps_low, eps_high, loss_type, max_completion_length, importance_sampling_level, reduce,
                       sapo_temperature_pos, sapo_temperature_neg, vllm_is_ratio)
    if not reduce:
        return result
    loss, kl_mean, clip_ratio = result
    return loss, ([kl_mean] if beta != 0.0 else []) + [clip_ratio]
