"""Direct Preference Optimization (DPO) and its TRL loss types, fused with the linear head.

With per-sequence log-probs (see :mod:`~liger_kernel.chunked_loss.fused_linear_preference`;
summed over the completion by default, as TRL does) and the reference's, per pair::

    c = chosen_logps - ref_chosen_logps,  r = rejected_logps - ref_rejected_logps

the f-divergence of ``f_divergence_type`` (f-DPO; its derivative f' of the ratio t = e^u)
turns each log-ratio u into a score::

    reverse_kl        u                                    (the default: plain DPO)
    forward_kl        1 - e^(-u)
    js_divergence     log 2 + log s(u)
    alpha_divergence  (e^((a - 1) u) - 1) / (a - 1),  a = f_alpha_divergence_coef
                      ((a - 1) u capped at 80 as TRL does; u itself when |a - 1| < 1e-6)

and, with ``C``, ``R`` the chosen and rejected scores and ``d = C - R``, the loss types are::

    sigmoid       -(1 - ls) log s(b d) - ls log s(-b d)      (ls = label_smoothing: cDPO)
    hinge         relu(1 - b d)
    ipo           (C / n_c - R / n_r - 1 / (2 b))^2           (n = counted tokens, >= 1)
    sigmoid_norm  -log s(b (C / n_c - R / n_r))
    exo_pair      q log(q / (1 - ls)) + (1 - q) log((1 - q) / ls),  q = s(b d)
    robust        ((1 - ls)(-log s(b d)) + ls log s(-b d)) / (1 - 2 ls)
    discopop      (1 - m)(-log s(b d)) + m exp(-b d),  m = s(b d / tau)
    sft           mean NLL of the chosen tokens (TRL's SFT term; see below)
    nca_pair      -log s(b c) - 0.5 log s(-b c) - 0.5 log s(-b r)
    bco_pair      -log s(b c) - log s(-b r)
    sppo_hard     (c - 1 / (2 b))^2 + (r + 1 / (2 b))^2
    apo_zero      1 - s(b c) + s(b r)
    apo_down      s(b c) + 1 - s(b d)
    aot           -(1 - ls) log s(b e) - ls log s(-b e),  e_k = sort(pi)_k - sort(rho)_k
    aot_unpaired  the same with e_k = sort(c)_k - sort(r)_k

(s the logistic sigmoid, b = beta; in ``aot`` ``pi = chosen_logps - rejected_logps`` and
``rho`` the reference's, each sorted ascending over the batch's pairs, so ``e`` couples the
pairs and the loss runs over the whole batch at once). Only the types above ``nca_pair`` take
a non-default f-divergence (TRL's rule; the others are functions of c and r, not of d).

``loss_type`` is one type or a sequence of them (TRL's multi-loss, e.g. MPO's ``["sigmoid",
"bco_pair", "sft"]``), summed with ``loss_weights`` (1 each by default); each pair loss is
averaged over the pairs. ``sft`` is the NLL the base computes, added with its weight on top of
``alpha * nll`` when ``compute_nll_loss``. Without a reference (``use_ref_model=False``) the
reference log-probs are 0. Extra metrics: ``chosen_rewards = b c`` and ``rejected_rewards =
b r`` (B/2,).

``use_weighting`` is WPO (TRL's): each pair's loss is multiplied by ``w_chosen * w_rejected``,
``w = exp(mean over the counted tokens of log p(y_t) - log sum_v p_v^2)``, a constant (see
:func:`~liger_kernel.chunked_loss.fused_linear_preference.wpo_sequence_weights`); not with
``aot``/``aot_unpaired`` (TRL's rule: they pair ranks, not sequences) nor ``sft`` (TRL scales its
batch NLL by the batch's mean pair weight, a coupling the base's separate NLL term does not carry).

``ld_alpha`` (LD-DPO, TRL's; None: off) weighs the tokens of each sequence beyond the first
``min(n_chosen, n_rejected)`` counted ones of its pair by ``ld_alpha`` in the summed log-probs of
the policy and the reference head (precomputed reference log-probs are used as given)::

    logps = sum_{t shared} log p(y_t) + ld_alpha * sum_{t beyond} log p(y_t)

``ipo`` and ``sigmoid_norm`` follow TRL in normalising each score by its sequence's number of
counted tokens (with ``average_log_prob=True`` the log-probs are already per-token means and
are used as they are); the returned ``chosen_logps`` and rewards are those before that
normalisation. ``sigmoid`` with ``label_smoothing`` is TRL's conservative DPO; at 0 it is the
plain loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from liger_kernel.chunked_loss.fused_linear_preference import LigerFusedLinearPreferenceBase
from liger_kernel.chunked_loss.simpo_loss import smoothed_logistic_loss
from liger_kernel.ops.autograd import InputGradients

# Types that are functions of the score difference d, so take any f-divergence.
SCORE_DIFFERENCE_TYPES = ("sigmoid", "hinge", "ipo", "sigmoid_norm", "exo_pair", "robust", "discopop", "sft")
# Types that sort over the batch's pairs (their loss is not a sum of per-pair terms).
BATCH_SORTED_TYPES = ("aot", "aot_unpaired")
DPO_LOSS_TYPES = (*SCORE_DIFFERENCE_TYPES, "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
                  *BATCH_SORTED_TYPES)
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# TRL caps (a - 1) u before the exponential of the alpha-divergence at this value (float32's range).
ALPHA_DIVERGENCE_EXPONENT_CAP = 80.0


def dpo_loss_types(loss_type: str | Sequence[str]) -> tuple[str, ...]:
    """``loss_type`` as a tuple of loss types (one string is one type)."""
    return (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)


def check_dpo_options(loss_type: str | Sequence[str], label_smoothing: float,
                      f_divergence_type: str = "reverse_kl", loss_weights: Sequence[float] | None = None,
                      use_weighting: bool = False, ld_alpha: float | None = None,
                      average_log_prob: bool = False) -> None:
    types = dpo_loss_types(loss_type)
    if not types:
        raise ValueError("loss_type needs at least one loss type")
    for name in types:
        if name not in DPO_LOSS_TYPES:
            raise ValueError(f"Unsupported loss_type: {name!r}; choose one of {', '.join(DPO_LOSS_TYPES)}")
    if loss_weights is not None and len(loss_weights) != len(types):
        raise ValueError(f"loss_weights has {len(loss_weights)} entries for {len(types)} loss types")
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(f"Unsupported f_divergence_type: {f_divergence_type!r}; choose one of "
                         f"{', '.join(F_DIVERGENCE_TYPES)}")
    if f_divergence_type != "reverse_kl" and not set(types) <= set(SCORE_DIFFERENCE_TYPES):
        raise ValueError(f"f_divergence_type={f_divergence_type!r} needs loss types among "
                         f"{', '.join(SCORE_DIFFERENCE_TYPES)}, got {', '.join(types)}")
    if ld_alpha is not None and not 0.0 <= ld_alpha <= 1.0:
        raise ValueError(f"ld_alpha must lie in [0, 1], got {ld_alpha}")
    if ld_alpha is not None and average_log_prob:
        raise ValueError("ld_alpha weighs summed log-probs; it does not combine with average_log_prob=True")
    unweighted = sorted(set(types) & {"sft", *BATCH_SORTED_TYPES})
    if use_weighting and unweighted:
        raise ValueError(f"use_weighting (WPO) does not apply to {', '.join(unweighted)}")
    if "exo_pair" in types and not 0.0 < label_smoothing < 1.0:
        raise ValueError("loss_type='exo_pair' needs 0 < label_smoothing < 1 (the EXO paper uses 1e-3)")
    if "robust" in types and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"loss_type='robust' needs label_smoothing in [0, 0.5), got {label_smoothing}")
    if set(types) & {"sigmoid", *BATCH_SORTED_TYPES} and not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5], got {label_smoothing}")


def f_divergence_scores(logratio: torch.Tensor, f_divergence_type: str, alpha_coef: float) -> torch.Tensor:
    """The f-DPO score of each log-ratio ``u`` (see the module docstring)."""
    if f_divergence_type == "reverse_kl":
        return logratio
    if f_divergence_type == "forward_kl":
        return -torch.expm1(-logratio)
    if f_divergence_type == "js_divergence":
        return math.log(2.0) + F.logsigmoid(logratio)
    if f_divergence_type == "alpha_divergence":
        if abs(alpha_coef - 1.0) < 1e-6:
            return logratio
        exponent = ((alpha_coef - 1.0) * logratio).clamp(max=ALPHA_DIVERGENCE_EXPONENT_CAP)
        return torch.expm1(exponent) / (alpha_coef - 1.0)
    raise ValueError(f"Unsupported f_divergence_type: {f_divergence_type!r}")


def dpo_pair_losses(c, r, beta, loss_type, label_smoothing=0.0, discopop_tau=0.05, n_chosen=None, n_rejected=None,
                    chosen_scores=None, rejected_scores=None, policy_margins=None, ref_margins=None):
    """Per-pair losses of one pairwise DPO loss type (see the module docstring) of the log-ratios
    ``c``, ``r``; ``chosen_scores``, ``rejected_scores`` are their f-divergence scores (the
    log-ratios by default) and ``policy_margins``, ``ref_margins`` the chosen-minus-rejected
    log-probs of the policy and the reference (``aot``)."""
    big_c = c if chosen_scores is None else chosen_scores
    big_r = r if rejected_scores is None else rejected_scores
    bd = beta * (big_c - big_r)
    ls = label_smoothing
    if loss_type == "sigmoid":
        return smoothed_logistic_loss(bd, ls)
    if loss_type == "hinge":
        return torch.relu(1 - bd)
    if loss_type in ("ipo", "sigmoid_norm"):
        if n_chosen is not None:
            big_c, big_r = big_c / n_chosen.clamp_min(1), big_r / n_rejected.clamp_min(1)
        if loss_type == "ipo":
            return (big_c - big_r - 1 / (2 * beta)) ** 2
        return -F.logsigmoid(beta * (big_c - big_r))
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
    if loss_type == "aot":
        gap = torch.sort(policy_margins).values - torch.sort(ref_margins).values
        return smoothed_logistic_loss(beta * gap, ls)
    if loss_type == "aot_unpaired":
        return smoothed_logistic_loss(beta * (torch.sort(c).values - torch.sort(r).values), ls)
    raise ValueError(f"Unsupported loss_type: {loss_type!r}; choose one of {', '.join(DPO_LOSS_TYPES)}")


class LigerFusedLinearDPOFunction(LigerFusedLinearPreferenceBase):
    token_counts_to_loss_fn = True

    @staticmethod
    def preference_loss_fn(chosen_logps, rejected_logps, full_target, ref_chosen_logps=None, ref_rejected_logps=None,
                           beta=0.1, loss_type="sigmoid", label_smoothing=0.0, discopop_tau=0.05,
                           chosen_token_counts=None, rejected_token_counts=None, f_divergence_type="reverse_kl",
                           f_alpha_divergence_coef=0.5, loss_weights=None, pair_weights=None):
        """Mean over the batch's pairs of the weighted DPO losses of this chunk's pairs (``sft``
        excluded: the base adds it as its NLL), each pair's weighed by ``pair_weights`` (WPO)
        when given, and (chosen, rejected) rewards."""
        ref_c = ref_chosen_logps if ref_chosen_logps is not None else torch.zeros_like(chosen_logps)
        ref_r = ref_rejected_logps if ref_rejected_logps is not None else torch.zeros_like(rejected_logps)
        c, r = chosen_logps - ref_c, rejected_logps - ref_r
        pair_args = dict(
            n_chosen=chosen_token_counts, n_rejected=rejected_token_counts,
            chosen_scores=f_divergence_scores(c, f_divergence_type, f_alpha_divergence_coef),
            rejected_scores=f_divergence_scores(r, f_divergence_type, f_alpha_divergence_coef),
            policy_margins=chosen_logps - rejected_logps, ref_margins=ref_c - ref_r)
        types = dpo_loss_types(loss_type)
        losses = torch.zeros_like(c)
        for name, weight in zip(types, loss_weights or (1.0,) * len(types)):
            if name != "sft":
                losses = losses + weight * dpo_pair_losses(c, r, beta, name, label_smoothing, discopop_tau,
                                                           **pair_args)
        if pair_weights is not None:
            losses = losses * pair_weights
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
        f_divergence_type="reverse_kl",
        f_alpha_divergence_coef=0.5,
        loss_weights=None,
        use_weighting=False,
        ld_alpha=None,
    ):
        """DPO loss of ``_input`` (B, T, D) through ``weight`` (V, D) (+ ``bias``) against ``target`` (B, T).

        ``loss_type`` is a type or a sequence of types weighed by ``loss_weights`` (see the module
        docstring). Returns ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean,
        rejected_logits_mean, nll_loss, chosen_rewards, rejected_rewards))``.
        """
        check_dpo_options(loss_type, label_smoothing, f_divergence_type, loss_weights, use_weighting, ld_alpha,
                          average_log_prob)
        types = dpo_loss_types(loss_type)
        weights = tuple(float(w) for w in loss_weights) if loss_weights is not None else (1.0,) * len(types)
        # The sft term is the base's chosen-token NLL, so it joins alpha * nll with its own weight.
        sft_weight = sum(w for name, w in zip(types, weights) if name == "sft")
        nll_weight = (alpha if compute_nll_loss else 0.0) + sft_weight
        return super().forward(
            cls=cls, ctx=ctx, _input=_input, weight=weight, target=target, bias=bias, chunk_size=chunk_size,
            ignore_index=ignore_index, alpha=nll_weight, beta=beta,
            compute_nll_loss=compute_nll_loss or "sft" in types, compiled=compiled, use_ref_model=use_ref_model,
            ref_input=ref_input, ref_weight=ref_weight, ref_bias=ref_bias, average_log_prob=average_log_prob,
            ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
            couples_pairs=bool(set(types) & set(BATCH_SORTED_TYPES)), wpo_weighting=use_weighting, ld_alpha=ld_alpha,
            loss_type=types,
            label_smoothing=label_smoothing, discopop_tau=discopop_tau, f_divergence_type=f_divergence_type,
            f_alpha_divergence_coef=f_alpha_divergence_coef, loss_weights=weights,
        )

    @staticmethod
    def backward(ctx, *grad_output):
        grad_input, grad_weight, _, grad_bias = LigerFusedLinearPreferenceBase.backward(ctx, grad_output)[:4]
        return _GRADS(_input=grad_input, weight=grad_weight, bias=grad_bias)


_GRADS = InputGradients(LigerFusedLinearDPOFunction.forward)


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
        loss_type: str | Sequence[str] = "sigmoid",
        label_smoothing: float = 0.0,
        discopop_tau: float = 0.05,
        f_divergence_type: str = "reverse_kl",
        f_alpha_divergence_coef: float = 0.5,
        loss_weights: Sequence[float] | None = None,
        use_weighting: bool = False,
        ld_alpha: float | None = None,
    ):
        super().__init__()
        check_dpo_options(loss_type, label_smoothing, f_divergence_type, loss_weights, use_weighting, ld_alpha,
                          average_log_prob)
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
        self.f_divergence_type = f_divergence_type
        self.f_alpha_divergence_coef = f_alpha_divergence_coef
        self.loss_weights = loss_weights
        self.use_weighting = use_weighting
        self.ld_alpha = ld_alpha

    def forward(self, lin_weight, _input, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None,
                ref_chosen_logps=None, ref_rejected_logps=None):
        return LigerFusedLinearDPOFunction.apply(
            _input, lin_weight, target, bias, ref_input, ref_weight, ref_bias, self.ignore_index, self.beta,
            self.compute_nll_loss, self.compiled, self.use_ref_model, self.average_log_prob, self.chunk_size,
            self.loss_type, self.label_smoothing, self.discopop_tau, self.alpha, ref_chosen_logps,
            ref_rejected_logps, self.f_divergence_type, self.f_alpha_divergence_coef, self.loss_weights,
            self.use_weighting, self.ld_alpha,
        )
