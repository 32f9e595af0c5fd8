"""Reference cross-entropy losses: float64 definitions for the tests, HF's recipes for the benchmarks.

* :func:`cross_entropy` is the definition of :mod:`liger_kernel.ops.cross_entropy` (loss
  with z-loss, the z-loss alone, token accuracy), computed in float64 from the exact values
  of its inputs (differentiable: gradients flow back to the given logits).
* :func:`linear_cross_entropy` is the same on ``x @ W.T + b``.
* :func:`hf_causal_lm_cross_entropy` and :func:`hf_linear_cross_entropy` are what HF's
  ``ForCausalLMLoss`` does on already shifted, flattened logits (upcast to float32, mean
  over counted tokens), without and with the LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0, reduction: str = "mean",
                  softcap: float | None = None, lse_square_scale: float = 0.0):
    """``(loss, z_loss, token_accuracy)`` of ``logits`` (N, V) against ``target`` (N,), float64:
    ``F.cross_entropy`` of the (optionally soft-capped) logits plus the
    z-loss ``lse_square_scale * logsumexp**2`` of each counted row (averaged over counted rows
    for ``"mean"``); accuracy: the first arg-max of the raw logits equals the target, over
    counted rows."""
    raw = logits.double()
    x = softcap * torch.tanh(raw / softcap) if softcap else raw
    loss = F.cross_entropy(x, target.long(), weight=None if weight is None else weight.double(),
                           ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
    counted = target != ignore_index
    z_rows = lse_square_scale * torch.logsumexp(x, dim=-1) ** 2 * counted
    correct = ((raw.argmax(dim=-1) == target) & counted).double()
    n_counted = counted.sum().clamp_min(1)
    if reduction == "none":
        z_loss, accuracy = z_rows, correct
    else:
        z_loss = z_rows.sum() / (n_counted if reduction == "mean" else 1)
        accuracy = correct.sum() / n_counted
    return loss + z_loss, z_loss, accuracy


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, **options):
    """:func:`cross_entropy` of ``x @ weight.T + bias``, all in float64."""
    return cross_entropy(F.linear(x.double(), weight.double(), None if bias is None else bias.double()), target,
                         **options)


def hf_causal_lm_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                               ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF ``ForCausalLMLoss`` on already shifted, flattened logits: float32 upcast, mean CE."""
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="mean")


def hf_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                            ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The LM head then HF's loss: logits materialised in the input dtype, upcast, mean CE."""
    return hf_causal_lm_cross_entropy(F.linear(x, weight), target, ignore_index)
