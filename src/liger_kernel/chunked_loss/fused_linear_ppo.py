"""Policy-gradient losses of a linear head's per-token log-probabilities, without the logits.

:class:`LigerFusedLinearPPOBase` is the base of the RL losses (:mod:`.grpo_loss`): the policy's
hidden states ``x`` (B, T, D) of B completions, its head ``W`` (V, D) (and bias), and the
sampled tokens ``y`` (B, T) give the per-token log-probabilities at temperature ``tau``

    logp[b, t] = log_softmax(x[b, t] W^T / tau + b / tau)[y[b, t]]

which a subclass's :meth:`~LigerFusedLinearPPOBase.ppo_loss_fn` turns into a loss. The chunked
head engine (:mod:`liger_kernel.ops.chunked_head`) computes ``logp`` a chunk of whole
completions at a time, differentiates the loss through it and accumulates the gradients of
``x``, ``W`` and the bias, so the (B, T, V) logits never exist. A reference policy enters as
given per-token log-probabilities ``ref_per_token_logps`` (B, T) or as a second head
(``ref_input``, ``ref_weight``, ``ref_bias``) whose log-probabilities of the same tokens the
engine computes on the same chunks, under no_grad, at the same temperature.

Contract of ``ppo_loss_fn``: it is called on a chunk of G whole completions with
``per_token_logps`` (G, T) (differentiable), the chunk's ``attention_mask`` (G, T) (1 where a
token counts), ``advantages`` (G,) or (G, T), the whole batch's ``full_attention_mask`` (B, T)
for normalisers, the chunk's ``ref_per_token_logps`` / ``old_per_token_logps`` /
``vllm_is_ratio`` (or None) and the loss's keyword arguments, and returns ``(loss, metrics)``.
It must be *additive*: the loss of the batch is the sum of its chunks' losses (every
normaliser comes from ``full_attention_mask`` or from the keywords ``token_normalizer``, the
batch's token count computed once per call, summed over data-parallel ranks when
``torch.distributed`` is initialised, and ``sequence_lengths``, the counted tokens of each
token's completion, shaped as ``attention_mask``), and so are the 0-d metrics. When one
completion has more tokens than a chunk holds, the engine computes ``logp`` for the whole batch
first and calls ``ppo_loss_fn`` once on all of it; the result is the same, at the cost of a
second logits GEMM.

Token-local losses avoid that: when :meth:`~LigerFusedLinearPPOBase.token_local` says the loss
is a sum of per-token terms (each reading only its own token's values and batch-wide
normalisers, as GRPO with token-level ratios does), every token is a group of its own: chunks
hold any rows, always in one pass, and ``ppo_loss_fn`` sees (R, 1) tensors for R tokens
(``advantages`` and ``vllm_is_ratio`` broadcast to every token), ``full_attention_mask`` still
(B, T).

Off-policy and on-policy: without ``old_per_token_logps`` the old policy is the current one,
detached (importance ratios are 1 in value and carry the policy gradient).
"""

from __future__ import annotations

import inspect

import torch

from liger_kernel.ops.autograd import EagerUnderCompile, strictly_once_differentiable
from liger_kernel.ops.checks import check_temperature, check_tensor
from liger_kernel.ops.chunked_head import (
    chunked_head_loss_and_grads,
    save_head_grads,
    scaled_head_grads,
    upstream_loss_gradient,
)
from liger_kernel.ops.fused_linear_logprobs import log_prob_entropy_rows
from liger_kernel.ops.loss_checks import start_target_check


def batch_token_normalizer(attention_mask: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Tokens per process of the whole generation batch, at least 1 (DAPO/CISPO/VESPO's divisor).

    ``num_items_in_batch`` (the count over every micro-batch and process, as TRL passes it)
    divided by the world size; without it, this batch's mask summed over ranks, divided by the
    world size (one all-reduce when ``torch.distributed`` is initialised).
    """
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if distributed else 1
    if num_items_in_batch is not None:
        total = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=attention_mask.device)
    else:
        total = attention_mask.float().sum()
        if distributed:
            torch.distributed.all_reduce(total)
    return (total / world).clamp(min=1.0)


def takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (by name or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def one_dtype_head(x, weight, bias):
    """``(x, weight, bias)`` in their promoted dtype where they differ (e.g. bf16 hidden states with a
    head kept in float32, as TRL's ``cast_lm_head_to_fp32`` does): the logits are then computed in
    the wider dtype, at the cost of a cast copy of the narrower tensors."""
    if x is None or weight is None:
        return x, weight, bias
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if bias is not None:
        dtype = torch.promote_types(dtype, bias.dtype)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def grads_in_dtypes(grads, x, weight, bias):
    """The engine's gradients cast back to the dtypes of the tensors they belong to."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        g = getattr(grads, name)
        if g is not None and g.dtype != t.dtype:
            setattr(grads, name, g.to(t.dtype))
    return grads


def _check_side_tensor(t, name, batch_shape, device, allowed_trailing):
    if t is None:
        return
    check_tensor(t, name)
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the inputs on {device}")
    if t.dim() == 0 or t.shape[0] != batch_shape[0] or tuple(t.shape[1:]) not in allowed_trailing:
        allowed = " or ".join(str((batch_shape[0], *tr)) for tr in allowed_trailing)
        raise ValueError(f"{name} must have shape {allowed}, got {tuple(t.shape)}")


def _checked_batch(_input, weight, selected_token_ids, attention_mask, advantages, ref_per_token_logps,
                   old_per_token_logps, vllm_is_ratio, temperature):
    """The checks of a PPO-family call: ``(batch_shape, vllm_is_ratio as (B, 1) or (B, T), the pending
    range check of the counted token ids)``. The range check is awaited after the chunk loop is
    queued (no host sync before it); a bad id reads token 0 meanwhile."""
    check_temperature(temperature)
    if _input.dim() != 3:
        raise ValueError(f"_input must be 3-D (batch, completion_len, hidden), got shape {tuple(_input.shape)}")
    batch_shape = tuple(_input.shape[:2])
    for name, t in (("selected_token_ids", selected_token_ids), ("attention_mask", attention_mask)):
        check_tensor(t, name)
        if tuple(t.shape) != batch_shape:
            raise ValueError(f"{name} must have shape {batch_shape}, got {tuple(t.shape)}")
    if selected_token_ids.dtype.is_floating_point:
        raise TypeError(f"selected_token_ids must be integer token ids, got {selected_token_ids.dtype}")
    uncounted = -(2**62)
    counted_ids = torch.where(attention_mask.bool(), selected_token_ids.long(), uncounted).reshape(-1)
    target_check = start_target_check(counted_ids, counted_ids.shape[0], weight.shape[0], uncounted,
                                      "selected_token_ids (counted tokens)")
    device = _input.device
    _check_side_tensor(advantages, "advantages", batch_shape, device, [(), (batch_shape[1],)])
    _check_side_tensor(ref_per_token_logps, "ref_per_token_logps", batch_shape, device, [(batch_shape[1],)])
    _check_side_tensor(old_per_token_logps, "old_per_token_logps", batch_shape, device, [(batch_shape[1],)])
    _check_side_tensor(vllm_is_ratio, "vllm_is_ratio", batch_shape, device, [(), (1,), (batch_shape[1],)])
    if vllm_is_ratio is not None and vllm_is_ratio.dim() == 1:
        vllm_is_ratio = vllm_is_ratio.unsqueeze(-1)
    return batch_shape, vllm_is_ratio, target_check


def _reference(use_ref_model, ref_per_token_logps, ref_input, ref_weight, ref_bias):
    """``(reference head or Nones, ref_per_token_logps)``: given log-probs win over a head;
    without ``use_ref_model`` neither is read."""
    if not use_ref_model:
        return (None, None, None), None
    if ref_per_token_logps is not None:
        return (None, None, None), ref_per_token_logps
    if ref_input is None or ref_weight is None:
        raise ValueError("use_ref_model needs ref_per_token_logps or a reference head (ref_input, ref_weight)")
    return one_dtype_head(ref_input, ref_weight, ref_bias), None


def _ppo_group_fn(ppo_loss_fn, present_names, full_mask, loss_kwargs):
    """The engine's ``group_fn``: ``ppo_loss_fn`` on a chunk's sequences, its side tensors
    (named ``present_names``) sliced to them; the reference log-probs from the second head's
    quantities where none were given."""
    def group_fn(q, q_ref, *side):
        chunk = dict(zip(present_names, side))
        ref = chunk.get("ref_per_token_logps")
        if ref is None and q_ref is not None:
            ref = q_ref[..., 0]
        old = chunk.get("old_per_token_logps")
        loss, metrics = ppo_loss_fn(
            per_token_logps=q[..., 0], attention_mask=chunk["attention_mask"], advantages=chunk["advantages"].float(),
            full_attention_mask=full_mask, ref_per_token_logps=None if ref is None else ref.float(),
            old_per_token_logps=None if old is None else old.float(),
            vllm_is_ratio=None if chunk.get("vllm_is_ratio") is None else chunk["vllm_is_ratio"].float(),
            **({"sequence_lengths": chunk["sequence_lengths"]} if "sequence_lengths" in chunk else {}),
            **loss_kwargs)
        return loss, tuple(metrics)

    return group_fn


class LigerFusedLinearPPOBase(EagerUnderCompile, torch.autograd.Function):
    """Base of the fused-head policy-gradient losses; see the module docstring.

    A subclass defines ``ppo_loss_fn`` (a staticmethod) and a ``forward(ctx, ...)`` that calls
    :meth:`forward_chunked` (``LigerFusedLinearPPOBase.forward(cls, ctx, ...)`` is the same),
    and a ``backward`` that returns :meth:`backward`'s first six entries followed by one None
    per further forward argument.
    """

    @staticmethod
    def ppo_loss_fn(per_token_logps, attention_mask, advantages, full_attention_mask, ref_per_token_logps=None,
                    old_per_token_logps=None, vllm_is_ratio=None, **loss_kwargs):
        raise NotImplementedError("a LigerFusedLinearPPOBase subclass must define ppo_loss_fn")

    @staticmethod
    def token_local(**loss_kwargs) -> bool:
        """Whether ``ppo_loss_fn`` with these options is a sum of per-token terms (module docstring)."""
        return False

    @staticmethod
    def forward(cls, ctx, _input, weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                temperature=1.0, use_ref_model=False, vllm_is_ratio=None, num_items_in_batch=None, compiled=True,
                chunk_size=1, **loss_kwargs):
        """``(loss, metrics)`` of ``cls.ppo_loss_fn`` over the batch; gradients kept for :meth:`backward`.

        Shapes: ``_input`` (B, T, D), ``weight`` (V, D), ``bias`` (V,), ``selected_token_ids`` and
        ``attention_mask`` (B, T), ``advantages`` (B,) or (B, T), ``ref_per_token_logps`` and
        ``old_per_token_logps`` (B, T), ``vllm_is_ratio`` (B,), (B, 1) or (B, T), the reference
        head ``ref_input`` (B, T, D'), ``ref_weight`` (V, D'), ``ref_bias`` (V,).
        ``use_ref_model``: the reference log-probabilities are ``ref_per_token_logps`` when given,
        else the reference head's; without ``use_ref_model`` neither is read. ``compiled`` and
        ``chunk_size`` are accepted and ignored (the engine sizes the chunks). ``token_normalizer``
        reaches ``ppo_loss_fn`` only if it takes that keyword (or ``**kwargs``). Hidden states and
        head of different dtypes compute in the wider one (:func:`one_dtype_head`).
        """
        batch_shape, vllm_is_ratio, target_check = _checked_batch(
            _input, weight, selected_token_ids, attention_mask, advantages, ref_per_token_logps,
            old_per_token_logps, vllm_is_ratio, temperature)
        head, ref_per_token_logps = _reference(use_ref_model, ref_per_token_logps, ref_input, ref_weight, ref_bias)

        full_mask = attention_mask.float()
        names = ("attention_mask", "advantages", "ref_per_token_logps", "old_per_token_logps", "vllm_is_ratio",
                 "sequence_lengths")
        ppo_loss_fn = cls.ppo_loss_fn
        lengths = full_mask.sum(-1, keepdim=True).expand(batch_shape) if takes_keyword(
            ppo_loss_fn, "sequence_lengths") else None
        side = (full_mask, advantages, ref_per_token_logps, old_per_token_logps, vllm_is_ratio, lengths)
        x, token_ids = _input, selected_token_ids
        if cls.token_local(**loss_kwargs):
            # Every token its own group: side tensors per token, (B*T, 1).
            side = tuple(None if t is None else (t.unsqueeze(-1) if t.dim() == 1 else t).expand(batch_shape).reshape(
                -1, 1) for t in side)
            x, token_ids = _input.reshape(-1, 1, _input.shape[-1]), selected_token_ids.reshape(-1, 1)
            if head[0] is not None:
                head = (head[0].reshape(-1, 1, head[0].shape[-1]), *head[1:])
        present = [(n, t) for n, t in zip(names, side) if t is not None]
        present_names = [n for n, _ in present]
        if takes_keyword(ppo_loss_fn, "token_normalizer"):
            loss_kwargs["token_normalizer"] = batch_token_normalizer(attention_mask, num_items_in_batch)

        group_fn = _ppo_group_fn(ppo_loss_fn, present_names, full_mask, loss_kwargs)

        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                 bias is not None and bool(ctx.needs_input_grad[5]))
        # Every position reads its own token's log-prob, as TRL's do (luspo weighs padded positions too).
        loss, metrics, grads = chunked_head_loss_and_grads(
            *one_dtype_head(x, weight, bias), log_prob_entropy_rows(temperature, with_entropy=False), group_fn,
            token_args=(token_ids,), group_args=[t for _, t in present], ref_x=head[0],
            ref_weight=head[1], ref_bias=head[2], needs=needs)
        target_check.wait()
        if grads.x is not None:
            grads.x = grads.x.view(_input.shape)
        save_head_grads(ctx, grads_in_dtypes(grads, _input, weight, bias))
        return loss, metrics

    forward_chunked = forward

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_output, *grad_metrics):
        """(d_input, d_weight, None, None, None, d_bias) scaled by the loss's upstream gradient, then Nones."""
        grad_x, grad_w, grad_b = scaled_head_grads(ctx, upstream_loss_gradient((grad_output,)))
        return (grad_x, grad_w, None, None, None, grad_b) + (None,) * 40
