"""Paired preference losses (DPO, ORPO, SimPO, CPO) of a linear head, without materialising the logits.

Batch layout: ``_input`` (B, T, D) hidden states and ``target`` (B, T) token ids, the first
B/2 sequences the chosen completions and the last B/2 the rejected ones, sequence i pairing
with sequence i + B/2. Tokens whose target is ``ignore_index`` do not count.

Per sequence s, with ``z = x W^T + b`` (float32 after the GEMM) and the counted tokens
``M_s = {t : target[s, t] != ignore_index}``::

    logp_s = sum_{t in M_s} log softmax(z_{s,t})[target[s, t]]          (average_log_prob=False)
    logp_s = that sum / max(|M_s|, 1)                                     (average_log_prob=True)

    chosen_logps = logp[:B/2], rejected_logps = logp[B/2:]
    nll = -sum_{s < B/2} sum_{t in M'_s} log softmax(z_{s,t})[y'_{s,t}] / max(#counted chosen tokens, 1)

with ``y' = nll_target`` (or ``target``) and ``M'`` its counted tokens. A reference head
(``use_ref_model`` with ``ref_input, ref_weight, ref_bias``) gives ``ref_chosen_logps`` and
``ref_rejected_logps`` the same way, under no_grad; precomputed ones may be passed instead. The
loss is ``alpha * nll`` (when ``compute_nll_loss``) plus the subclass's
``preference_loss_fn(chosen_logps, rejected_logps, full_target, beta=..., **loss_kwargs)``,
which returns the preference loss summed over its pairs and divided by the batch's number of
pairs (``full_target.shape[0] // 2``), optionally followed by extra metrics.

Returns ``(loss, (chosen_logps (B/2,), rejected_logps (B/2,), chosen_logits_mean,
rejected_logits_mean, nll_loss, *extra))``, the metrics detached; ``*_logits_mean`` is the mean
of every logit of that half (all positions, ignored ones included, all vocabulary entries).
Extra metrics with a leading dimension have one entry per pair; 0-d ones are sums over pairs.

Computation: :mod:`liger_kernel.ops.chunked_head` (chunks of whole pairs within the fused
linear cross entropy's memory budget, or two passes when one pair does not fit); gradients for
``_input``, ``weight`` and ``bias`` are computed in the forward pass and scaled in backward.

Differences from the best-known implementation of this API: ``chunk_size`` and ``compiled``
are accepted and ignored (chunks are sized by the memory budget, nothing is compiled); a
sequence with every token ignored has an average log-probability of 0 and an empty chosen
half an NLL of 0, instead of NaN.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from liger_kernel.ops.autograd import EagerUnderCompile, strictly_once_differentiable
from liger_kernel.ops.chunked_head import (
    chunked_head_loss_and_grads,
    save_head_grads,
    scaled_head_grads,
    target_log_probs,
    upstream_loss_gradient,
)


def check_targets(target: torch.Tensor, _input: torch.Tensor, name: str = "target") -> None:
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an integer tensor of token ids")
    if tuple(target.shape) != tuple(_input.shape[:2]):
        raise ValueError(f"{name} has shape {tuple(target.shape)}; it must be (batch, seq_len) = "
                         f"{tuple(_input.shape[:2])}")


def sequence_log_probs(token_logps: torch.Tensor, counted: torch.Tensor, average: bool) -> torch.Tensor:
    """Per-sequence sum (or mean over counted tokens, 0 for none) of (G, T) token log-probs."""
    total = token_logps.sum(-1)
    if average:
        total = total / counted.sum(-1).clamp_min(1)
    return total


def wpo_sequence_weights(token_logps: torch.Tensor, log_sum_sq_probs: torch.Tensor,
                         counted: torch.Tensor) -> torch.Tensor:
    """WPO's per-sequence weights (G,) of (G, T) token log-probs and ``log sum_v p_v^2``, a constant::

        w_s = exp( sum_{t in M_s} (log p(y_t) - log sum_v p_{t,v}^2) / max(|M_s|, 1) )

    (the geometric mean over the counted tokens of the target's probability relative to the
    distribution's own expected probability; 1 for a sequence with no counted token)."""
    aligned = (token_logps.detach() - log_sum_sq_probs) * counted
    return torch.exp(aligned.sum(-1) / counted.sum(-1).clamp_min(1))


def reference_head(use_ref_model: bool, ref_input, ref_weight, ref_bias):
    """``(ref_input, ref_weight, ref_bias)`` when a reference head is to be run, else None."""
    if use_ref_model and ref_weight is not None and ref_input is not None:
        return ref_input, ref_weight, ref_bias
    return None


def length_desensitized_token_weights(counted: torch.Tensor, ld_alpha: float) -> torch.Tensor:
    """LD-DPO's token weights (G, T) of a paired (chosen then rejected) counted mask: 1 on each
    sequence's first ``min(n_chosen, n_rejected)`` counted tokens (the length the pair shares),
    ``ld_alpha`` on the counted tokens after them, 0 on ignored ones."""
    half = counted.shape[0] // 2
    lengths = counted.sum(-1)
    shared = torch.minimum(lengths[:half], lengths[half:]).repeat(2)
    beyond = counted.cumsum(-1) > shared[:, None]
    return torch.where(beyond, ld_alpha, 1.0) * counted


def policy_and_reference_log_probs(q: torch.Tensor, q_ref: torch.Tensor | None, counted: torch.Tensor,
                                   precomputed: tuple, average: bool, token_weights: torch.Tensor | None = None):
    """Per-sequence log-probs (G,) of a group's policy head, and of its reference: the reference
    head's (``q_ref``), else the precomputed ones (``precomputed[0]``), else None. With
    ``token_weights`` (G, T) each token's log-prob is weighed (LD-DPO) before the sum."""
    def token_logps(quantities):
        return quantities[..., 0] if token_weights is None else quantities[..., 0] * token_weights

    logps = sequence_log_probs(token_logps(q), counted, average)
    if q_ref is not None:
        return logps, sequence_log_probs(token_logps(q_ref), counted, average)
    return logps, (precomputed[0] if precomputed else None)


def preference_head_forward(ctx, bias_position: int, _input, weight, bias, ignore_index: int, group_fn,
                            token_args: list, group_args: list, ref_head, paired: bool, additive: bool = True,
                            log_sum_sq_probs: bool = False):
    """Loss and metrics of ``group_fn`` over the chunked head ``target_log_probs(ignore_index,
    log_sum_sq_probs=log_sum_sq_probs)``, keeping the gradients of ``_input``, ``weight`` and
    ``bias`` (forward input ``bias_position``) that the Function's inputs need for
    :func:`preference_head_backward`. ``additive=False`` for a loss that couples the batch's
    pairs (the engine's two passes)."""
    needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
             bias is not None and bool(ctx.needs_input_grad[bias_position]))
    ref_input, ref_weight, ref_bias = ref_head or (None, None, None)
    loss, metrics, grads = chunked_head_loss_and_grads(
        _input, weight, bias, target_log_probs(ignore_index, log_sum_sq_probs=log_sum_sq_probs), group_fn,
        token_args=token_args, group_args=group_args, ref_x=ref_input, ref_weight=ref_weight, ref_bias=ref_bias, paired=paired,
        additive=additive, needs=needs)
    save_head_grads(ctx, grads)
    return loss, metrics


def preference_head_backward(ctx, grad_output: tuple) -> tuple:
    """``(grad_input, grad_weight, grad_bias)`` of :func:`preference_head_forward`, scaled by the
    loss's upstream gradient."""
    return scaled_head_grads(ctx, upstream_loss_gradient(grad_output))


class LigerFusedLinearPreferenceBase(EagerUnderCompile, torch.autograd.Function):
    """Base of the paired preference losses; see the module docstring.

    Subclasses define ``preference_loss_fn(chosen_logps, rejected_logps, full_target, beta, ...)``
    and a ``forward(cls, ctx, ...)`` classmethod that calls
    ``super().forward(cls=cls, ctx=ctx, _input=..., weight=..., target=..., ...)``; their
    ``backward(ctx, *grad_output)`` returns ``LigerFusedLinearPreferenceBase.backward(ctx,
    grad_output)[:4]`` (grads of ``_input``, ``weight``, ``target`` (None) and ``bias``) followed by
    one None per further argument. A subclass whose preference loss wants each sequence's number
    of counted tokens (as ``chosen_token_counts``, ``rejected_token_counts``, passed when the
    log-probs are sums, not means) sets ``token_counts_to_loss_fn = True``. A loss that is not a
    sum over pairs (one that sorts over the batch) passes ``couples_pairs=True`` to ``forward``:
    ``preference_loss_fn`` then sees the whole batch at once. ``wpo_weighting=True`` hands it WPO's
    pair weights ``pair_weights`` (B/2,) (see :func:`wpo_sequence_weights`). ``ld_alpha`` (not
    None) weighs each pair's tokens beyond its shared length by ``ld_alpha`` in both heads'
    log-probs (LD-DPO, :func:`length_desensitized_token_weights`).
    """

    token_counts_to_loss_fn = False

    @abstractmethod
    def preference_loss_fn(*args, **kwargs):
        """The preference loss of a chunk's pairs; defined by subclasses."""
        raise NotImplementedError("Preference loss function must be implemented.")

    @staticmethod
    def forward(cls, ctx, _input, weight, target, bias=None, chunk_size=1, ignore_index=-100, alpha=1.0, beta=0.1,
                compute_nll_loss=True, nll_target=None, compiled=True, use_ref_model=False, ref_input=None,
                ref_weight=None, ref_bias=None, average_log_prob=True, ref_chosen_logps=None,
                ref_rejected_logps=None, couples_pairs=False, wpo_weighting=False, ld_alpha=None,
                **loss_kwargs):
        """Loss and metrics of the module docstring.

        ``_input`` (B, T, D), ``weight`` (V, D), ``target`` (B, T), ``bias`` (V,) or None,
        ``nll_target`` (B, T) or None, ``ref_input`` (B, T, D') with ``ref_weight`` (V, D') and
        ``ref_bias`` when ``use_ref_model``, or precomputed ``ref_chosen_logps`` and
        ``ref_rejected_logps`` (B/2,) (used when no reference head is given). ``loss_kwargs``
        go to ``cls.preference_loss_fn``.
        """
        check_targets(target, _input)
        n_seqs = target.shape[0]
        if n_seqs % 2:
            raise ValueError(f"the batch must hold chosen then rejected sequences (an even count), got {n_seqs}")
        if nll_target is not None:
            check_targets(nll_target, _input, "nll_target")
        ref_head = reference_head(use_ref_model, ref_input, ref_weight, ref_bias)
        with_precomputed = ref_chosen_logps is not None or ref_rejected_logps is not None
        if with_precomputed and (ref_chosen_logps is None or ref_rejected_logps is None):
            raise ValueError("precomputed reference log-probs need both ref_chosen_logps and ref_rejected_logps")
        if use_ref_model and ref_head is None and not with_precomputed:
            raise ValueError("use_ref_model=True needs ref_input and ref_weight (or precomputed ref_chosen_logps "
                             "and ref_rejected_logps)")
        use_precomputed = with_precomputed and ref_head is None
        n_pairs = n_seqs // 2
        vocab = weight.shape[0]
        seq_len = target.shape[1]
        nll_labels = target if nll_target is None else nll_target
        chosen_nll_count = (nll_labels[:n_pairs] != ignore_index).sum().clamp_min(1).float()
        logits_count = float(max(1, n_pairs * seq_len * vocab))
        loss_fn = cls.preference_loss_fn
        # Token counts normalise summed log-probs (mean log-probs are normalised already).
        wants_counts = cls.token_counts_to_loss_fn and not average_log_prob

        group_args = [target != ignore_index]
        if use_precomputed:
            for name, t in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
                if not isinstance(t, torch.Tensor) or t.numel() != n_pairs:
                    raise ValueError(f"{name} must be a tensor of {n_pairs} per-pair log-probs")
            group_args.append(torch.cat([ref_chosen_logps.reshape(-1), ref_rejected_logps.reshape(-1)])
                              .to(device=_input.device, dtype=torch.float32))

        def group_fn(q, q_ref, counted, *precomputed):
            half = q.shape[0] // 2
            token_weights = None if ld_alpha is None else length_desensitized_token_weights(counted, ld_alpha)
            logps, ref_logps = policy_and_reference_log_probs(q, q_ref, counted, precomputed, average_log_prob,
                                                              token_weights)
            kwargs = dict(loss_kwargs)
            if ref_logps is not None:
                kwargs.update(ref_chosen_logps=ref_logps[:half], ref_rejected_logps=ref_logps[half:])
            if wants_counts:
                counts = counted.sum(-1).float()
                kwargs.update(chosen_token_counts=counts[:half], rejected_token_counts=counts[half:])
            if wpo_weighting:
                weights = wpo_sequence_weights(q[..., 0], q[..., -2], counted)
                kwargs.update(pair_weights=weights[:half] * weights[half:])
            outputs = loss_fn(logps[:half], logps[half:], target, beta=beta, **kwargs)
            preference_loss, *extra = outputs if isinstance(outputs, tuple) else (outputs,)
            # Columns of target_log_probs: log p(target), [log p(nll_target)], [log sum p^2], row sum of the logits.
            nll_column = 0 if nll_target is None else 1
            nll = -q[:half, :, nll_column].sum() / chosen_nll_count if compute_nll_loss else q.new_zeros(())
            loss = preference_loss + alpha * nll
            row_sums = q[..., -1]
            metrics = (logps[:half], logps[half:], row_sums[:half].sum() / logits_count,
                       row_sums[half:].sum() / logits_count, nll, *extra)
            return loss, metrics

        token_args = [target] if nll_target is None else [target, nll_target]
        return preference_head_forward(ctx, 3, _input, weight, bias, ignore_index, group_fn, token_args,
                                       group_args, ref_head, paired=True, additive=not couples_pairs,
                                       log_sum_sq_probs=wpo_weighting)

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, *grad_output):
        grad_input, grad_weight, grad_bias = preference_head_backward(ctx, grad_output)
        return grad_input, grad_weight, None, grad_bias


class FusedLinearPreferenceModule(torch.nn.Module):
    """Module form of a preference Function ``function``: keeps its options (the Function's
    arguments after ``bias``, in order) as attributes of the same names and is called as
    ``(lin_weight, _input, target, bias)``."""

    function: type[torch.autograd.Function]

    def __init__(self, **options) -> None:
        super().__init__()
        self.option_names = tuple(options)
        for name, value in options.items():
            setattr(self, name, value)

    def forward(self, lin_weight, _input, target, bias=None):
        return self.function.apply(_input, lin_weight, target, bias, *(getattr(self, n) for n in self.option_names))
