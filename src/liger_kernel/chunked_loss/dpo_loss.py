"""Direct Preference Optimization (DPO) and its TRL loss types, fused with the linear head.

With per-sequence log-probs (see :mod:`~liger_kernel.chunked_loss.fused_linear_preference`;
summed over the completion by default, as TRL does) and the reference's, per pair::

    c = chosen_logps - ref_chosen_logps,  r = rejected_logps - ref_rejected_logps,  d = c - r

    sigmoid    -(1 - ls) log s(b d) - ls log s(-b d)            (ls = label_smoothing: cDPO)
    hinge      relu(1 - b d)
    ipo        (c / n_c - r / n_r - 1 / (2 b))^2                 (n = counted tokens, >= 1)
    exo_pair   q log(q / (1 - ls)) + (1 - q) log((1 - q) / ls),  q = s(b d)
    nca_pair   -log s(b c) - 0.5 log s(-b c) - 0.5 log s(-b r)
    robust     ((1 - ls)(-log s(b d)) + ls log s(-b d)) / (1 - 2 ls)
    bco_pair   -log s(b c) - log s(-b r)
    sppo_hard  (c - 1 / (2 b))^2 + (r + 1 / (2 b))^2
    apo_zero   1 - s(b c) + s(b r)
    apo_down   s(b c) + 1 - s(b d)
    discopop   (1 - m)(-log s(b d)) + m exp(-b d),  m = s(b d / tau)

(s the logistic sigmoid, b = beta), averaged over the pairs; ``alpha * nll`` is added when
``compute_nll_loss``. Without a reference (``use_ref_model=False``) the reference log-probs are
0. Extra metrics: ``chosen_rewards = b c`` and ``rejected_rewards = b r`` (B/2,).

``ipo`` follows TRL in normalising each log-ratio by its sequence's number of counted tokens
(with ``average_log_prob=True`` the log-probs are already per-token means and are used as
they are); the returned ``chosen_logps`` and rewards are those before that normalisation.
``sigmoid`` with ``label_smoothing`` is TRL's conservative DPO; at 0 it is the plain loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from liger_kernel.chunked_loss.fused_linear_preference import LigerFusedLinearPreferenceBase

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop")


def check_dpo_options(loss_type: str, label_smoothing: float) -> None:
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"Unsupported loss_type: {loss_type!r}; choose one of {', '.join(DPO_LOSS_TYPES)}")
    if loss_type == "exo_pair" and not 0.0 < label_smoothing < 1.0:
        raise ValueError("loss_type='exo_pair' needs 0 < label_smoothing < 1 (the EXO paper uses 1e-3)")
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"loss_type='robust' needs label_smoothing in [0, 0.5), got {label_smoothing}")
    if loss_type == "sigmoid" and not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5], got {label_smoothing}")


def dpo_pair_losses(c, r, beta, loss_type, label_smoothing=0.0, discopop_tau=0.05, n_chosen=None, n_rejected=None):
    """Per-pair DPO losses of the chosen and rejected log-ratios ``c``, ``r`` (see the module docstring)."""
    d = c - r
    bd = beta * d
    ls = label_smoothing
    if loss_type == "sigmoid":
        return -(1 - ls) * F.logsigmoid(bd) - ls * F.logsigmoid(-bd)
    if loss_type == "hinge":
        return torch.relu(1 - bd)
    if loss_type == "ipo":
        if n_chosen is not None:
            d = c / n_chosen.clamp_min(1) - r / n_rejected.clamp_min(1)
        return (d - 1 / (2 * beta)) ** 2
    if loss_type == "exo_pair":
        q_win = torch.sigmoid(bd)
        return q_win * (F.logsigmoid(bd) - math.log1p(-ls)) + (1 - q_win) * (F.logsigmoid(-bd) - math.log(ls))
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
    if loss_type == "robust":
        return (-(1 - ls) * F.logsigmoid(bd) + ls * F.logsigmoid(-bd)) / (1 - 2 * ls)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)
    if loss_type == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * c) + 1 - torch.sigmoid(bd)
    if loss_type == "discopop":
        mix = torch.sigmoid(bd / discopop_tau)
        return (1 - mix) * -F.logsigmoid(bd) + mix * torch.exp(-bd)
    raise ValueError(f"Unsupported loss_type: {loss_type!r}; choose one of {', '.join(DPO_LOSS_TYPES)}")


class LigerFusedLinearDPOFunction(LigerFusedLinearPreferenceBase):
    token_counts_to_loss_fn = True

    @staticmethod
    def preference_loss_fn(chosen_logps, rejected_logps, full_target, ref_chosen_logps=None, ref_rejected_logps=None,
                           beta=0.1, loss_type="sigmoid", label_smoothing=0.0, discopop_tau=0.05,
                           chosen_token_counts=None, rejected_token_counts=None):
        """Mean over the batch's pairs of the DPO loss of this chunk's pairs, and (chosen, rejected) rewards."""
        c = chosen_logps - (ref_chosen_logps if ref_chosen_logps is not None else 0.0)
        r = rejected_logps - (ref_rejected_logps if ref_rejected_logps is not None else 0.0)
        losses = dpo_pair_losses(c, r, beta, loss_type, label_smoothing, discopop_tau, chosen_token_counts,
                                 rejected_token_counts)
        return losses.sum() / (full_target.shape[0] // 2), beta * c, beta * r

    @classmethod
    def forward(
        cls,
        ctx,
        _input,
        weight,
        target,
        bias=None,
        ref_input=None,
        ref_weight=None,
        ref_bias=None,
        ignore_index=-100,
        beta=0.1,
        compute_nll_loss=False,
        compiled=True,
        use_ref_model=True,
        average_log_prob=False,
        chunk_size=1,
        loss_type="sigmoid",
        label_smoothing=0.0,
        discopop_tau=0.05,
        alpha=1.0,
        ref_chosen_logps=None,
        ref_rejected_logps=None,
    ):
        """DPO loss of ``_input`` (B, T, D) through ``weight`` (V, D) (+ ``bias``) against ``target`` (B, T).

        Returns ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean,
        nll_loss, chosen_rewards, rejected_rewards))``.
        """
        check_dpo_options(loss_type, label_smoothing)
        return super().forward(
            cls=cls, ctx=ctx, _input=_input, weight=weight, target=target, bias=bias, chunk_size=chunk_size,
            ignore_index=ignore_index, alpha=alpha, beta=beta, compute_nll_loss=compute_nll_loss, compiled=compiled,
            use_ref_model=use_ref_model, ref_input=ref_input, ref_weight=ref_weight, ref_bias=ref_bias,
            average_log_prob=average_log_prob, ref_chosen_logps=ref_chosen_logps,
            ref_rejected_logps=ref_rejected_logps, loss_type=loss_type, label_smoothing=label_smoothing,
            discopop_tau=discopop_tau,
        )

    @staticmethod
    def backward(ctx, *grad_output):
        grads = LigerFusedLinearPreferenceBase.backward(ctx, grad_output)[:4]
        return *grads, *(None,) * 16


class LigerFusedLinearDPOLoss(torch.nn.Module):
    """DPO loss fused with the linear head; called as ``(lin_weight, _input, target, bias, ref_input,
    ref_weight, ref_bias)`` (TRL's order), returning ``(loss, metrics)`` as
    :meth:`LigerFusedLinearDPOFunction.forward`."""

    def __init__(
        self,
        ignore_index: int = -100,
        beta: float = 0.1,
        alpha: float = 1.0,
        compute_nll_loss: bool = False,
        compiled: bool = True,
        use_ref_model: bool = True,
        average_log_prob: bool = False,
        chunk_size: int = 1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        discopop_tau: float = 0.05,
    ):
        super().__init__()
        check_dpo_options(loss_type, label_smoothing)
        self.ignore_index = ignore_index
        self.beta = beta
        self.alpha = alpha
        self.compute_nll_loss = compute_nll_loss
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.average_log_prob = average_log_prob
        self.chunk_size = chunk_size
        self.loss_type = loss_type
        self.label_smoothing = label_smoothing
        self.discopop_tau = discopop_tau

    def forward(self, lin_weight, _input, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None,
                ref_chosen_logps=None, ref_rejected_logps=None):
        return LigerFusedLinearDPOFunction.apply(
            _input, lin_weight, target, bias, ref_input, ref_weight, ref_bias, self.ignore_index, self.beta,
            self.compute_nll_loss, self.compiled, self.use_ref_model, self.average_log_prob, self.chunk_size,
            self.loss_type, self.label_smoothing, self.discopop_tau, self.alpha, ref_chosen_logps,
            ref_rejected_logps,
        )
