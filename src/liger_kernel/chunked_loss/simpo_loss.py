"""Simple Preference Optimization (SimPO), fused with the linear head.

With per-sequence *average* log-probs ``c``, ``r`` (length-normalised rewards, no reference)::

    h    = beta (R(c) - R(r)) - gamma
    loss = mean_pairs [ -(1 - ls) log s(h) - ls log s(-h) ]  +  alpha * nll

(``ls`` = label_smoothing; ``nll`` when ``compute_nll_loss``). ``R`` is the identity unless
``alphapo_alpha`` (``a``) is non-zero: AlphaPO's reward shaping (TRL's CPO ``alpha``; its
``loss_type="alphapo"`` is this SimPO loss with the shaping and no NLL term)::

    R(l) = (1 - p^(-a)) / a = -expm1(-a l) / a,   p = e^l

which tends to ``l`` as ``a -> 0``. Extra metrics: ``chosen_rewards = beta R(c)``,
``rejected_rewards = beta R(r)`` (B/2,).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from liger_kernel.chunked_loss.fused_linear_preference import (
    FusedLinearPreferenceModule,
    LigerFusedLinearPreferenceBase,
)
from liger_kernel.ops.autograd import InputGradients


def smoothed_logistic_loss(h: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-(1 - ls) log s(h) - ls log s(-h)`` per pair."""
    return -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def alphapo_rewards(logps: torch.Tensor, alphapo_alpha: float) -> torch.Tensor:
    """AlphaPO's shaped reward ``(1 - exp(logps)^(-a)) / a`` of log-probs (``logps`` itself at a = 0)."""
    if alphapo_alpha == 0.0:
        return logps
    return -torch.expm1(-alphapo_alpha * logps) / alphapo_alpha


class LigerFusedLinearSimPOFunction(LigerFusedLinearPreferenceBase):
    @staticmethod
    def preference_loss_fn(chosen_logps, rejected_logps, full_target, beta=0.1, gamma=0.5, label_smoothing=0.0,
                           alphapo_alpha=0.0):
        chosen_rewards = alphapo_rewards(chosen_logps, alphapo_alpha)
        rejected_rewards = alphapo_rewards(rejected_logps, alphapo_alpha)
        h = beta * (chosen_rewards - rejected_rewards) - gamma
        loss = smoothed_logistic_loss(h, label_smoothing).sum() / (full_target.shape[0] // 2)
        return loss, beta * chosen_rewards, beta * rejected_rewards

    @classmethod
    def forward(cls, ctx, _input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0,
                label_smoothing=0.0, compute_nll_loss=False, compiled=True, gamma=0.5, chunk_size=1,
                alphapo_alpha=0.0):
        """Returns ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
        chosen_rewards, rejected_rewards))``."""
        return super().forward(cls=cls, ctx=ctx, _input=_input, weight=weight, target=target, bias=bias,
                               ignore_index=ignore_index, alpha=alpha, beta=beta, label_smoothing=label_smoothing,
                               compute_nll_loss=compute_nll_loss, compiled=compiled, gamma=gamma,
                               chunk_size=chunk_size, average_log_prob=True, alphapo_alpha=alphapo_alpha)

    @staticmethod
    def backward(ctx, *grad_output):
        grad_input, grad_weight, _, grad_bias = LigerFusedLinearPreferenceBase.backward(ctx, grad_output)[:4]
        return _GRADS(_input=grad_input, weight=grad_weight, bias=grad_bias)


_GRADS = InputGradients(LigerFusedLinearSimPOFunction.forward)


class LigerFusedLinearSimPOLoss(FusedLinearPreferenceModule):
    """SimPO loss fused with the linear head; called as ``(lin_weight, _input, target, bias)``."""

    function = LigerFusedLinearSimPOFunction

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                 compute_nll_loss: bool = True, compiled: bool = True, gamma: float = 0.5, chunk_size: int = 1,
                 alphapo_alpha: float = 0.0):
        super().__init__(ignore_index=ignore_index, beta=beta, alpha=alpha, label_smoothing=label_smoothing,
                         compute_nll_loss=compute_nll_loss, compiled=compiled, gamma=gamma, chunk_size=chunk_size,
                         alphapo_alpha=alphapo_alpha)
