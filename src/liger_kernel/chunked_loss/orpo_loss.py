"""Odds Ratio Preference Optimization (ORPO), fused with the linear head.

With per-sequence *average* log-probs ``c``, ``r`` of the chosen and rejected completions
(``average_log_prob=True``, as TRL's ORPO) and ``log odds(p) = log p - log(1 - p)``::

    log_odds = (c - r) - (log(1 - exp(c)) - log(1 - exp(r)))
    loss     = nll - beta * mean_pairs log s(log_odds)

(``nll`` the chosen tokens' mean negative log-likelihood, on ``nll_target`` if given, when
``compute_nll_loss``). Extra metrics: ``chosen_rewards = beta c``, ``rejected_rewards = beta r``
(B/2,), and the batch means ``log_odds_ratio = mean log s(log_odds)`` and
``log_odds_chosen = mean log_odds``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from liger_kernel.chunked_loss.fused_linear_preference import LigerFusedLinearPreferenceBase
from liger_kernel.ops.autograd import InputGradients


class LigerFusedLinearORPOFunction(LigerFusedLinearPreferenceBase):
    @staticmethod
    def preference_loss_fn(chosen_logps, rejected_logps, full_target, beta=0.1):
        n_pairs = full_target.shape[0] // 2
        log_odds = (chosen_logps - rejected_logps) - (
            torch.log1p(-torch.exp(chosen_logps)) - torch.log1p(-torch.exp(rejected_logps)))
        log_sigmoid_odds = F.logsigmoid(log_odds)
        loss = -beta * log_sigmoid_odds.sum() / n_pairs
        return (loss, beta * chosen_logps, beta * rejected_logps, log_sigmoid_odds.sum() / n_pairs,
                log_odds.sum() / n_pairs)

    @classmethod
    def forward(cls, ctx, _input, weight, target, bias=None, ignore_index=-100, beta=0.1, compute_nll_loss=True,
                nll_target=None, compiled=True, chunk_size=1):
        """Returns ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
        chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen))``."""
        return super().forward(cls=cls, ctx=ctx, _input=_input, weight=weight, target=target, bias=bias,
                               ignore_index=ignore_index, beta=beta, compute_nll_loss=compute_nll_loss,
                               nll_target=nll_target, compiled=compiled, chunk_size=chunk_size,
                               average_log_prob=True)

    @staticmethod
    def backward(ctx, *grad_output):
        grad_input, grad_weight, _, grad_bias = LigerFusedLinearPreferenceBase.backward(ctx, grad_output)[:4]
        return _GRADS(_input=grad_input, weight=grad_weight, bias=grad_bias)


_GRADS = InputGradients(LigerFusedLinearORPOFunction.forward)


class LigerFusedLinearORPOLoss(torch.nn.Module):
    """ORPO loss fused with the linear head; called as ``(lin_weight, _input, target, bias, nll_target)``."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, compute_nll_loss: bool = True,
                 compiled: bool = True, chunk_size: int = 1):
        super().__init__()
        self.ignore_index = ignore_index
        self.beta = beta
        self.compute_nll_loss = compute_nll_loss
        self.compiled = compiled
        self.chunk_size = chunk_size

    def forward(self, lin_weight, _input, target, bias=None, nll_target=None):
        return LigerFusedLinearORPOFunction.apply(_input, lin_weight, target, bias, self.ignore_index, self.beta,
                                                  self.compute_nll_loss, nll_target, self.compiled, self.chunk_size)
