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

from liger_kernel.chunked_loss.fused_linear_preference import (
    check_targets,
    policy_and_reference_log_probs,
    preference_head_backward,
    preference_head_forward,
    reference_head,
)
from liger_kernel.ops.autograd import EagerUnderCompile, strictly_once_differentiable


class LigerFusedLinearUnpairedPreferenceBase(EagerUnderCompile, torch.autograd.Function):
    """Base of the unpaired preference losses; subclass as :class:`LigerFusedLinearPreferenceBase`
    (``backward`` returns the grads of ``_input``, ``weight``, ``target``, ``preference_labels``
    and ``bias``, i.e. ``[:5]``)."""

    @abstractmethod
    def preference_loss_fn(*args, **kwargs):
        """The preference loss of a chunk's sequences; defined by subclasses."""
        raise NotImplementedError("Preference loss function must be implemented.")

    @staticmethod
    def forward(cls, ctx, _input, weight, target, preference_labels, bias=None, chunk_size=1, ignore_index=-100,
                compiled=True, use_ref_model=False, ref_input=None, ref_weight=None, ref_bias=None,
                average_log_prob=False, ref_logps=None, **loss_kwargs):
        check_targets(target, _input)
        n_seqs = target.shape[0]
        if not isinstance(preference_labels, torch.Tensor) or preference_labels.numel() != n_seqs:
            raise ValueError(f"preference_labels must be a tensor of {n_seqs} booleans (True = desirable)")
        labels = preference_labels.reshape(-1).to(device=_input.device, dtype=torch.bool)
        ref_head = reference_head(use_ref_model, ref_input, ref_weight, ref_bias)
        if use_ref_model and ref_head is None and ref_logps is None:
            raise ValueError("use_ref_model=True needs ref_input and ref_weight (or precomputed ref_logps)")
        group_args = [target != ignore_index, labels]
        if ref_logps is not None and ref_head is None:
            if not isinstance(ref_logps, torch.Tensor) or ref_logps.numel() != n_seqs:
                raise ValueError(f"ref_logps must be a tensor of {n_seqs} per-sequence log-probs")
            group_args.append(ref_logps.reshape(-1).to(device=_input.device, dtype=torch.float32))
        loss_fn = cls.preference_loss_fn

        def group_fn(q, q_ref, counted, labels, *precomputed):
            logps, ref_logps = policy_and_reference_log_probs(q, q_ref, counted, precomputed, average_log_prob)
            kwargs = dict(loss_kwargs)
            if ref_logps is not None:
                kwargs["ref_log_prob_chunk"] = ref_logps
            outputs = loss_fn(logps, labels, target, **kwargs)
            loss, *extra = outputs if isinstance(outputs, tuple) else (outputs,)
            row_sums = q[..., -1].sum(-1)
            metrics = (logps[labels].sum(), logps[~labels].sum(), row_sums[labels].sum(), row_sums[~labels].sum(),
                       *extra)
            return loss, metrics

        return preference_head_forward(ctx, 4, _input, weight, bias, ignore_index, group_fn, [target], group_args,
                                       ref_head, paired=False)

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, *grad_output):
        grad_input, grad_weight, grad_bias = preference_head_backward(ctx, grad_output)
        return grad_input, grad_weight, None, None, grad_bias
