"""Kahneman-Tversky Optimization (KTO), fused with the linear head.

With per-sequence log-ratios ``rho_s = logp_s - ref_logp_s`` (``ref_logp = 0`` without a
reference), the KL estimate ``kl`` (a scalar the caller computes from mismatched completions,
clamped at 0 by TRL; no term when None) and ``b = beta``::

    desirable s:    w_d (1 - s(b (rho_s - kl)))
    undesirable s:  w_u (1 - s(b (kl - rho_s)))
    loss = sum_s of those / B                      (the mean over the whole batch, as TRL)

(``w_d`` = desirable_weight, ``w_u`` = undesirable_weight). Extra metrics: the sums of the
rewards ``b rho_s`` over the desirable and the undesirable sequences. See
:mod:`~liger_kernel.chunked_loss.fused_linear_unpaired_preference` for the log-probs and the
other metrics.
"""

from __future__ import annotations

import torch

from liger_kernel.chunked_loss.fused_linear_unpaired_preference import LigerFusedLinearUnpairedPreferenceBase
from liger_kernel.ops.autograd import InputGradients


class LigerFusedLinearKTOFunction(LigerFusedLinearUnpairedPreferenceBase):
    @staticmethod
    def preference_loss_fn(log_prob_chunk, preference_labels_chunk, full_target, ref_log_prob_chunk=None, beta=0.1,
                           kl=None, desirable_weight=1.0, undesirable_weight=1.0):
        logratios = log_prob_chunk - ref_log_prob_chunk if ref_log_prob_chunk is not None else log_prob_chunk
        sign = torch.where(preference_labels_chunk, 1.0, -1.0)
        shifted = logratios - kl.reshape(()).to(logratios.dtype) if kl is not None else logratios
        losses = 1 - torch.sigmoid(beta * shifted * sign)
        losses = losses * torch.where(preference_labels_chunk, desirable_weight, undesirable_weight)
        rewards = beta * logratios
        return (losses.sum() / full_target.shape[0], rewards[preference_labels_chunk].sum(),
                rewards[~preference_labels_chunk].sum())

    @classmethod
    def forward(cls, ctx, _input, weight, target, preference_labels, bias=None, ref_input=None, ref_weight=None,
                ref_bias=None, kl=None, ignore_index=-100, beta=0.1, compiled=True, use_ref_model=True,
                average_log_prob=False, chunk_size=1, desirable_weight=1.0, undesirable_weight=1.0, ref_logps=None):
        """KTO loss of ``_input`` (B, T, D) through ``weight`` (V, D) (+ ``bias``) against ``target`` (B, T)
        with ``preference_labels`` (B,). Returns ``(loss, (chosen_logps_sum, rejected_logps_sum,
        chosen_logits_sum, rejected_logits_sum, chosen_rewards_sum, rejected_rewards_sum))``."""
        if kl is not None and (not isinstance(kl, torch.Tensor) or kl.numel() != 1):
            raise ValueError("kl must be None or a one-element tensor (the batch's KL estimate)")
        return super().forward(cls=cls, ctx=ctx, _input=_input, weight=weight, target=target,
                               preference_labels=preference_labels, bias=bias, ignore_index=ignore_index,
                               beta=beta, compiled=compiled, use_ref_model=use_ref_model, ref_input=ref_input,
                               ref_weight=ref_weight, ref_bias=ref_bias, average_log_prob=average_log_prob,
                               kl=kl.detach() if kl is not None else None, chunk_size=chunk_size,
                               desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                               ref_logps=ref_logps)

    @staticmethod
    def backward(ctx, *grad_output):
        grad_input, grad_weight, _, _, grad_bias = LigerFusedLinearUnpairedPreferenceBase.backward(ctx, grad_output)[:5]
        return _GRADS(_input=grad_input, weight=grad_weight, bias=grad_bias)


_GRADS = InputGradients(LigerFusedLinearKTOFunction.forward)


class LigerFusedLinearKTOLoss(torch.nn.Module):
    """KTO loss fused with the linear head; called as ``(_input, lin_weight, target, bias, preference_labels,
    ref_input, ref_weight, ref_bias, kl)`` (TRL passes them by keyword)."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, compiled: bool = True,
                 use_ref_model: bool = False, average_log_prob: bool = False, chunk_size: int = 1,
                 desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
        super().__init__()
        self.ignore_index = ignore_index
        self.beta = beta
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.average_log_prob = average_log_prob
        self.chunk_size = chunk_size
        self.desirable_weight = desirable_weight
        self.undesirable_weight = undesirable_weight

    def forward(self, _input, lin_weight, target, bias=None, preference_labels=None, ref_input=None, ref_weight=None,
                ref_bias=None, kl=None, ref_logps=None):
        return LigerFusedLinearKTOFunction.apply(
            _input, lin_weight, target, preference_labels, bias, ref_input, ref_weight, ref_bias, kl,
            self.ignore_index, self.beta, self.compiled, self.use_ref_model, self.average_log_prob, self.chunk_size,
            self.desirable_weight, self.undesirable_weight, ref_logps)
