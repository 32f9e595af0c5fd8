"""Contrastive Preference Optimization (CPO), fused with the linear head.

Reference-free DPO on per-sequence log-probs ``c``, ``r`` (sums by default, means with
``average_log_prob``), plus ``alpha * nll`` on the chosen tokens (when ``compute_nll_loss``).
With ``d = R(c) - R(r)`` and TRL's CPO loss types::

    sigmoid   -(1 - ls) log s(b d) - ls log s(-b d)
    hinge     relu(1 - b d)
    ipo       (d - 1 / (2 b))^2
    simpo     sigmoid with d replaced by d - gamma / b   (gamma = simpo_gamma)

averaged over the pairs. ``R`` is the identity unless ``alphapo_alpha`` (``a``) is non-zero:
AlphaPO's reward shaping, TRL's CPO ``alpha`` (renamed here because ``alpha`` weighs the NLL
term, TRL's ``cpo_alpha``, as in the best-known implementation of this API)::

    R(l) = (1 - p^(-a)) / a = -expm1(-a l) / a,   p = e^l        (-> l as a -> 0)

TRL's ``loss_type="alphapo"`` is ``simpo`` with ``average_log_prob=True``, ``alpha=0`` and
this shaping. Extra metrics: ``chosen_rewards = b R(c)``, ``rejected_rewards = b R(r)``.
"""

from __future__ import annotations

import torch.nn.functional as F

from liger_kernel.chunked_loss.fused_linear_preference import (
    FusedLinearPreferenceModule,
    LigerFusedLinearPreferenceBase,
)
from liger_kernel.chunked_loss.simpo_loss import alphapo_rewards, smoothed_logistic_loss
from liger_kernel.ops.autograd import InputGradients

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


def check_cpo_loss_type(loss_type: str) -> None:
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(f"Unsupported loss_type: {loss_type!r}; choose one of {', '.join(CPO_LOSS_TYPES)}")


class LigerFusedLinearCPOFunction(LigerFusedLinearPreferenceBase):
    @staticmethod
    def preference_loss_fn(chosen_logps, rejected_logps, full_target, beta=0.1, label_smoothing=0.0,
                           loss_type="sigmoid", simpo_gamma=0.5, alphapo_alpha=0.0):
        chosen_rewards = alphapo_rewards(chosen_logps, alphapo_alpha)
        rejected_rewards = alphapo_rewards(rejected_logps, alphapo_alpha)
        d = chosen_rewards - rejected_rewards
        if loss_type == "sigmoid":
            losses = smoothed_logistic_loss(beta * d, label_smoothing)
        elif loss_type == "simpo":
            losses = smoothed_logistic_loss(beta * d - simpo_gamma, label_smoothing)
        elif loss_type == "hinge":
            losses = F.relu(1 - beta * d)
        elif loss_type == "ipo":
            losses = (d - 1 / (2 * beta)) ** 2
        else:
            check_cpo_loss_type(loss_type)
        return losses.sum() / (full_target.shape[0] // 2), beta * chosen_rewards, beta * rejected_rewards

    @classmethod
    def forward(cls, ctx, _input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0,
                label_smoothing=0.0, compute_nll_loss=True, compiled=True, average_log_prob=False, chunk_size=1,
                loss_type="sigmoid", simpo_gamma=0.5, alphapo_alpha=0.0):
        """Returns ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
        chosen_rewards, rejected_rewards))``."""
        check_cpo_loss_type(loss_type)
        return super().forward(cls=cls, ctx=ctx, _input=_input, weight=weight, target=target, bias=bias,
                               ignore_index=ignore_index, alpha=alpha, beta=beta, label_smoothing=label_smoothing,
                               compute_nll_loss=compute_nll_loss, average_log_prob=average_log_prob,
                               compiled=compiled, chunk_size=chunk_size, loss_type=loss_type,
                               simpo_gamma=simpo_gamma, alphapo_alpha=alphapo_alpha)

    @staticmethod
    def backward(ctx, *grad_output):
        grad_input, grad_weight, _, grad_bias = LigerFusedLinearPreferenceBase.backward(ctx, grad_output)[:4]
        return _GRADS(_input=grad_input, weight=grad_weight, bias=grad_bias)


_GRADS = InputGradients(LigerFusedLinearCPOFunction.forward)


class LigerFusedLinearCPOLoss(FusedLinearPreferenceModule):
    """CPO loss fused with the linear head; called as ``(lin_weight, _input, target, bias)``."""

    function = LigerFusedLinearCPOFunction

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                 compute_nll_loss: bool = True, compiled: bool = True, average_log_prob: bool = False,
                 chunk_size: int = 1, loss_type: str = "sigmoid", simpo_gamma: float = 0.5,
                 alphapo_alpha: float = 0.0):
        check_cpo_loss_type(loss_type)
        super().__init__(ignore_index=ignore_index, beta=beta, alpha=alpha, label_smoothing=label_smoothing,
                         compute_nll_loss=compute_nll_loss, compiled=compiled, average_log_prob=average_log_prob,
                         chunk_size=chunk_size, loss_type=loss_type, simpo_gamma=simpo_gamma,
                         alphapo_alpha=alphapo_alpha)
