"""Unpaired preference losses (KTO) of a linear head, without materialising the logits.

Batch layout: ``_input`` (B, T, D), ``target`` (B, T) and ``preference_labels`` (B,) bool,
True for a desirable (chosen) completion and False for an undesirable one, in any order and
any proportion. Per sequence s, ``logp_s`` is the sum (``average_log_prob=False``) or mean
over counted tokens (0 for none) of ``log softmax(z_{s,t})[target[s, t]]`` over the tokens
whose target is not ``ignore_index``; a reference head (``use_ref_model`` with ``ref_input,
ref_weight, ref_bias``, under no_grad) or precomputed ``ref_logps`` (B,) give ``ref_logp_s``.
The loss is the subclass's ``preference_loss_fn(log_probs, preference_labels, full_target,
ref_log_prob_chunk=..., **loss_kwargs)``, summed over its sequences and normalised by the
whole batch (``full_target``), optionally followed by extra 0-d metrics (sums over sequences).

Returns ``(loss, (chosen_logps_sum, rejected_logps_sum, chosen_logits_sum, rejected_logits_sum,
*extra))``, 0-d and detached: sums over the desirable (resp. undesirable) sequences of their
log-probs, and of every logit of theirs (all positions and vocabulary entries).

Computation: :mod:`liger_kernel.ops.chunked_head` (chunks of whole sequences within the fused
linear cross entropy's budget, or two passes); gradients for ``_input``, ``weight`` and
``bias`` are computed in the forward pass and scaled in backward. ``chunk_size`` and
``compiled`` are accepted and ignored.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from liger_kernel.chunked_loss.fused_linear_preference import check_targets, sequence_log_probs
from liger_kernel.ops.autograd import once_differentiable
from liger_kernel.ops.chunked_head import (
    TargetLogProbs,
    chunked_head_loss_and_grads,
    save_head_grads,
    scaled_head_grads,
    upstream_loss_gradient,
)


class LigerFusedLinearUnpairedPreferenceBase(torch.autograd.Function):
    """Base of the unpaired preference losses; subclass as :class:`LigerFusedLinearPreferenceBase`
    (``backward`` returns the grads of ``_input``, ``weight``, ``target``, ``preference_labels``
    and ``bias``, i.e. ``[:5]``)."""

    @abstractmethod
    def preference_loss_fn(*args, **kwargs):
        """The preference loss of a chunk's sequences; defined by subclasses."""
        raise NotImplementedError("Preference loss function must be implemented.")

    @staticmethod
    def forward(
        cls,
        ctx,
        _input,
        weight,
        target,
        preference_labels,
        bias=None,
        chunk_size=1,
        ignore_index=-100,
        compiled=True,
        use_ref_model=False,
        ref_input=None,
        ref_weight=None,
        ref_bias=None,
        average_log_prob=False,
        ref_logps=None,
        **loss_kwargs,
    ):
        check_targets(target, _input)
        n_seqs = target.shape[0]
        if not isinstance(preference_labels, torch.Tensor) or preference_labels.numel() != n_seqs:
            raise ValueError(f"preference_labels must be a tensor of {n_seqs} booleans (True = desirable)")
        labels = preference_labels.reshape(-1).to(device=_input.device, dtype=torch.bool)
        with_ref_head = bool(use_ref_model) and ref_weight is not None and ref_input is not None
        if use_ref_model and not with_ref_head and ref_logps is None:
            raise ValueError("use_ref_model=True needs ref_input and ref_weight (or precomputed ref_logps)")
        group_args = [target != ignore_index, labels]
        if ref_logps is not None and not with_ref_head:
            if not isinstance(ref_logps, torch.Tensor) or ref_logps.numel() != n_seqs:
                raise ValueError(f"ref_logps must be a tensor of {n_seqs} per-sequence log-probs")
            group_args.append(ref_logps.reshape(-1).to(device=_input.device, dtype=torch.float32))
        loss_fn = cls.preference_loss_fn

        def group_fn(q, q_ref, counted, labels, *precomputed):
            logps = sequence_log_probs(q[..., 0], counted, average_log_prob)
            kwargs = dict(loss_kwargs)
            if q_ref is not None:
                kwargs["ref_log_prob_chunk"] = sequence_log_probs(q_ref[..., 0], counted, average_log_prob)
            elif precomputed:
                kwargs["ref_log_prob_chunk"] = precomputed[0]
            outputs = loss_fn(logps, labels, target, **kwargs)
            loss, *extra = outputs if isinstance(outputs, tuple) else (outputs,)
            row_sums = q[..., -1].sum(-1)
            metrics = (logps[labels].sum(), logps[~labels].sum(), row_sums[labels].sum(), row_sums[~labels].sum(),
                       *extra)
            return loss, metrics

        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                 bias is not None and bool(ctx.needs_input_grad[4]))
        loss, metrics, grads = chunked_head_loss_and_grads(
            _input, weight, bias, TargetLogProbs(ignore_index), group_fn, token_args=[target],
            group_args=group_args, ref_x=ref_input if with_ref_head else None,
            ref_weight=ref_weight if with_ref_head else None, ref_bias=ref_bias if with_ref_head else None,
            paired=False, additive=True, needs=needs)
        save_head_grads(ctx, grads)
        return loss, metrics

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_output):
        grad_input, grad_weight, grad_bias = scaled_head_grads(ctx, upstream_loss_gradient(grad_output))
        return grad_input, grad_weight, None, None, grad_bias
