"""Per-token log-probabilities and entropy of tempered logits, and the GRPO family of losses on them.

Notation, for one row (token) of logits ``x`` of width ``V``, temperature ``T`` and selected
token ``t``: ``s = x / T``, ``lse = log sum_c exp(s_c)``, ``p_c = exp(s_c - lse)``::

    logp    = s_t - lse                                   (selected-token log-probability)
    H       = -sum_c p_c log p_c = lse - sum_c p_c s_c    (entropy of the tempered distribution)

Gradients, for upstream gradients ``g`` of logp and ``h`` of H (``d_c = 1`` where ``c = t``)::

    dlogp/ds_c = d_c - p_c
    dH/ds_c    = -p_c (s_c - lse + H)
    dL/dx_c    = (g (d_c - p_c) - h p_c (s_c - lse + H)) / T

Rows whose ``mask`` is 0 give logp = H = 0 and a zero gradient. The forward kernel makes one
pass per row (online log-sum-exp: a running max ``m``, ``S0 = sum exp(s - m)`` and, for the
entropy, ``S1 = sum exp(s - m) (s - m)``, both rescaled when ``m`` grows; ``lse = m + log S0``
and ``H = log S0 - S1 / S0``, whose terms are of the size of ``H``, not of ``s``) and
keeps ``lse`` and ``H`` per row (O(N)); the backward kernel reads the logits once more and
writes the gradient into a fresh buffer (the logits stay intact for any other reader).

GRPO-family losses (:func:`grpo_loss`, TRL's ``GRPOTrainer`` conventions), from the per-token
``logp`` above, old log-probabilities ``old`` (``logp`` detached when not given: on-policy),
per-sequence advantages ``A`` and the completion mask::

    token level:    r = exp(logp - old)
    sequence level: r = exp(sum_l mask (logp - old) / max(1, sum_l mask))    (GSPO; one per sequence)
    grpo, dapo, bnpo, dr_grpo, luspo:  l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    cispo:                             l = -sg(min(r, eps_high)) A logp       (sg: no gradient)
    sapo:                              l = -sigmoid(tau (r - 1)) (4 / tau) A, tau = tau_pos if A > 0 else tau_neg
    optional vLLM importance ratio w:  l = w l
    beta != 0:                         l += beta (exp(ref - logp) - (ref - logp) - 1)

and the reduction of ``loss_type`` over the masked per-token losses: ``grpo``/``sapo`` the mean
over sequences of each sequence's masked mean; ``bnpo`` the masked mean; ``dr_grpo`` the
masked sum over ``B * max_completion_length``; ``dapo``/``cispo`` the masked sum over the
number of counted tokens (averaged over the processes of an initialised process group);
``luspo`` the mean of ``l * sum_l mask``. The vocabulary-wide work (log-softmax and its
gradient) runs in the kernels here; the per-token formulas act on (B, L) tensors, through
autograd, so every option gets its exact gradient.
"""

import torch
import triton
import triton.language as tl

from liger_kernel.ops.autograd import InputGradients, strictly_once_differentiable
from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.checks import check_float_dtype, check_temperature, check_tensor
from liger_kernel.ops.config import launch_config
from liger_kernel.ops.launch import is_interpreter, is_meta, liger_custom_op
from liger_kernel.ops.numerics import round_to_dtype
from liger_kernel.ops.vocab_rows import VocabRowConfig, check_devices, run_launcher


class SelectiveLogSoftmaxConfig(VocabRowConfig):
    """Launch configuration of the per-token log-probability / entropy kernels."""


@triton.jit
def _selective_log_softmax_kernel(logits_ptr, stride_b, stride_l, ids_ptr, ids_stride_b, ids_stride_l,
                                  mask_ptr, mask_stride_b, mask_stride_l, logp_ptr, entropy_ptr, lse_ptr,
                                  n_positions, n_cols, inv_temperature,
                                  HAS_IDS: tl.constexpr, HAS_MASK: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr,
                                  BLOCK_SIZE: tl.constexpr):
    """One program per row ``(b, l)`` of (B, L, V) logits: logp, H and lse (see module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // n_positions
    pos = row % n_positions
    skip = False
    if HAS_MASK:
        skip = tl.load(mask_ptr + b * mask_stride_b + pos * mask_stride_l) == 0
    if skip:
        tl.store(logp_ptr + row, 0.0)
        tl.store(entropy_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
    else:
        logits_row = logits_ptr + b * stride_b + pos * stride_l
        offsets = tl.arange(0, BLOCK_SIZE)
        running_max = float("-inf")
        shift = 0.0
        sum_exp = 0.0
        sum_exp_ds = 0.0
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + offsets
            s = tl.load(logits_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) * inv_temperature
            new_max = tl.maximum(running_max, tl.max(s, axis=0))
            new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(running_max - new_shift)
            e = tl.exp(s - new_shift)
            if COMPUTE_ENTROPY:
                # S1 = sum exp(s - shift) (s - shift), kept relative to the current shift:
                # moving the shift from a to b turns it into exp(a - b) (S1 + (a - b) S0).
                sum_exp_ds = ((sum_exp_ds + (shift - new_shift) * sum_exp) * rescale
                              + tl.sum(e * tl.where(e > 0.0, s - new_shift, 0.0), axis=0))
            sum_exp = sum_exp * rescale + tl.sum(e, axis=0)
            running_max = new_max
            shift = new_shift
        lse = running_max + tl.log(sum_exp)
        logp = 0.0
        if HAS_IDS:
            token = tl.load(ids_ptr + b * ids_stride_b + pos * ids_stride_l)
            # An id outside [0, V) is never used as an address (the host check reports it).
            token = tl.where((token >= 0) & (token < n_cols), token, 0)
            logp = tl.load(logits_row + token).to(tl.float32) * inv_temperature - lse
        entropy = 0.0
        if COMPUTE_ENTROPY:
            # H = lse - sum p s = log S0 - S1 / S0 with S1 relative to the max: every term is
            # of the size of H, not of the logits (an absolute sum p s of ~20 would cost H
            # ~20 ulps of rounding, which its gradient p (log p + H) / T passes on).
            entropy = tl.log(sum_exp) - sum_exp_ds / sum_exp
        tl.store(logp_ptr + row, logp)
        tl.store(entropy_ptr + row, entropy)
        tl.store(lse_ptr + row, lse)


@triton.jit
def _selective_log_softmax_backward_kernel(logits_ptr, stride_b, stride_l, ids_ptr, ids_stride_b, ids_stride_l,
                                           mask_ptr, mask_stride_b, mask_stride_l, grad_logp_ptr, grad_entropy_ptr,
                                           lse_ptr, entropy_ptr, dx_ptr, dx_stride_b, dx_stride_l, n_positions, n_cols,
                                           inv_temperature,
                                           HAS_IDS: tl.constexpr, HAS_MASK: tl.constexpr,
                                           HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                           ROUND_BY_HAND: tl.constexpr):
    """dL/dx of one row (zeros for a masked row) into ``dx`` (B, L, V) with unit column stride."""
    row = tl.program_id(0).to(tl.int64)
    b = row // n_positions
    pos = row % n_positions
    offsets = tl.arange(0, BLOCK_SIZE)
    dx_row = dx_ptr + b * dx_stride_b + pos * dx_stride_l
    skip = False
    if HAS_MASK:
        skip = tl.load(mask_ptr + b * mask_stride_b + pos * mask_stride_l) == 0
    if skip:
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + offsets
            tl.store(dx_row + cols, tl.zeros([BLOCK_SIZE], tl.float32).to(dx_ptr.dtype.element_ty),
                     mask=cols < n_cols)
    else:
        logits_row = logits_ptr + b * stride_b + pos * stride_l
        lse = tl.load(lse_ptr + row)
        grad_logp = 0.0
        token = -1
        if HAS_IDS:
            grad_logp = tl.load(grad_logp_ptr + row).to(tl.float32)
            token = tl.load(ids_ptr + b * ids_stride_b + pos * ids_stride_l)
        grad_entropy = 0.0
        entropy = 0.0
        if HAS_ENTROPY_GRAD:
            grad_entropy = tl.load(grad_entropy_ptr + row).to(tl.float32)
            entropy = tl.load(entropy_ptr + row)
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + offsets
            mask = cols < n_cols
            s = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature
            p = tl.exp(s - lse)
            ds = -grad_logp * p
            if HAS_IDS:
                ds = tl.where(cols == token, ds + grad_logp, ds)
            if HAS_ENTROPY_GRAD:
                ds -= grad_entropy * p * tl.where(p > 0.0, s - lse + entropy, 0.0)
            dx = round_to_dtype(ds * inv_temperature, dx_ptr.dtype.element_ty, ROUND_BY_HAND)
            tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _strides3(t: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


@liger_custom_op("selective_log_softmax_forward")
def selective_log_softmax_forward(logits: torch.Tensor, ids: torch.Tensor | None, mask: torch.Tensor | None,
                                  temperature: float, compute_entropy: bool
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher: ``(logp, entropy, lse)``, float32 (B, L) each, for logits (B, L, V) with unit
    column stride, ``ids``/``mask`` (B, L) or None. Arguments are trusted."""
    n_batch, n_positions, n_cols = logits.shape
    out = [torch.empty((n_batch, n_positions), device=logits.device, dtype=torch.float32) for _ in range(3)]
    n_rows = n_batch * n_positions
    if n_rows:
        config = launch_config(SelectiveLogSoftmaxConfig, n_cols)
        placeholder = out[0]
        launch_kernel(
            _selective_log_softmax_kernel, (n_rows,), logits, logits.stride(0), logits.stride(1),
            ids if ids is not None else placeholder, *_strides3(ids),
            mask if mask is not None else placeholder, *_strides3(mask),
            out[0], out[1], out[2], n_positions, n_cols, 1.0 / temperature,
            HAS_IDS=ids is not None, HAS_MASK=mask is not None, COMPUTE_ENTROPY=compute_entropy,
            BLOCK_SIZE=config.block_size, num_warps=config.num_warps,
        )
    return out[0], out[1], out[2]


@selective_log_softmax_forward.register_fake
def _selective_log_softmax_forward_fake(logits, ids, mask, temperature, compute_entropy):
    return tuple(logits.new_empty(logits.shape[:2], dtype=torch.float32) for _ in range(3))


@liger_custom_op("selective_log_softmax_backward")
def selective_log_softmax_backward(logits: torch.Tensor, ids: torch.Tensor | None, mask: torch.Tensor | None,
                                   grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                                   lse: torch.Tensor, entropy: torch.Tensor, temperature: float,
                                   extra_positions: int) -> torch.Tensor:
    """Launcher: dL/dlogits, a fresh contiguous (B, L + extra_positions, V) tensor of the
    logits' dtype whose last ``extra_positions`` positions (logits the loss did not read) are
    zero. ``ids`` without ``grad_logp`` (or the reverse) is not used; ``grad_*`` are
    contiguous (B, L)."""
    n_batch, n_positions, n_cols = logits.shape
    dx = torch.empty((n_batch, n_positions + extra_positions, n_cols), device=logits.device, dtype=logits.dtype)
    if extra_positions:
        dx[:, n_positions:].zero_()
    n_rows = n_batch * n_positions
    if n_rows:
        config = launch_config(SelectiveLogSoftmaxConfig, n_cols)
        has_ids = ids is not None and grad_logp is not None
        launch_kernel(
            _selective_log_softmax_backward_kernel, (n_rows,), logits, logits.stride(0), logits.stride(1),
            ids if has_ids else lse, *_strides3(ids if has_ids else None),
            mask if mask is not None else lse, *_strides3(mask),
            grad_logp if has_ids else lse, grad_entropy if grad_entropy is not None else lse, lse, entropy, dx,
            dx.stride(0), dx.stride(1),
            n_positions, n_cols, 1.0 / temperature,
            HAS_IDS=has_ids, HAS_MASK=mask is not None, HAS_ENTROPY_GRAD=grad_entropy is not None,
            BLOCK_SIZE=config.block_size, ROUND_BY_HAND=is_interpreter(), num_warps=config.num_warps,
        )
    return dx


@selective_log_softmax_backward.register_fake
def _selective_log_softmax_backward_fake(logits, ids, mask, grad_logp, grad_entropy, lse, entropy, temperature,
                                         extra_positions):
    n_batch, n_positions, n_cols = logits.shape
    return logits.new_empty((n_batch, n_positions + extra_positions, n_cols))


def _check_index_like(t: torch.Tensor | None, shape: torch.Size, name: str, integer: bool) -> None:
    if t is None:
        return
    check_tensor(t, name)
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; it must match the logits' leading shape {tuple(shape)}")
    if integer and t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold token ids as int64 (or int32), got dtype {t.dtype}")
    if t.dtype.is_complex:
        raise TypeError(f"{name} must be real, got dtype {t.dtype}")


def _check_ids_range(ids: torch.Tensor, mask: torch.Tensor | None, n_cols: int) -> None:
    # One host sync; skipped while torch.compile traces (the kernel never addresses memory
    # with a bad id: it reads column 0 instead).
    if torch.compiler.is_compiling() or ids.numel() == 0 or is_meta(ids):
        return
    bad = (ids < 0) | (ids >= n_cols)
    if mask is not None:
        bad &= mask != 0
    if bool(bad.any()):
        raise ValueError(f"input_ids contains token id {int(ids[bad][0])} outside [0, {n_cols}) at a counted position")


class LigerSelectiveLogSoftmaxFunction(torch.autograd.Function):
    """Per-token log-probability of ``input_ids`` and entropy under ``softmax(logits / T)``.

    ``forward(ctx, logits, input_ids, temperature=1.0, mask=None, compute_entropy=False,
    drop_last_position=False)``: ``logits`` (..., V) float, ``input_ids`` (...) integer (or
    None: entropy only), ``mask`` (...) (0 marks a position to skip) or None. Returns
    ``(logp, entropy)``, float32 of the leading shape; ``entropy`` is zeros unless
    ``compute_entropy``. Both are differentiable (see the module docstring); masked positions
    give 0 and no gradient.

    ``drop_last_position``: ``logits`` are (B, L + 1, V) as a causal LM returns them with one
    position more than the ``input_ids`` (B, L) it scores; the last position is not read, and
    its gradient is zero. The gradient is then written straight into a buffer of the full
    logits' shape, instead of a (B, L, V) one that autograd would pad into a second.
    """

    @staticmethod
    def forward(ctx, logits, input_ids, temperature=1.0, mask=None, compute_entropy=False, drop_last_position=False):
        check_float_dtype(logits, "logits")
        if logits.dim() < 1 or logits.shape[-1] < 1:
            raise ValueError(f"logits must have a non-empty last dimension (the vocabulary), got {tuple(logits.shape)}")
        if input_ids is None and not compute_entropy:
            raise ValueError("give input_ids, compute_entropy=True, or both")
        check_devices([("logits", logits), ("input_ids", input_ids), ("mask", mask)])
        temperature = check_temperature(temperature)
        if drop_last_position and (logits.dim() != 3 or logits.shape[1] < 1):
            raise ValueError(f"drop_last_position needs logits (B, L + 1, V), got shape {tuple(logits.shape)}")
        lead = logits.shape[:-1] if not drop_last_position else (logits.shape[0], logits.shape[1] - 1)
        _check_index_like(input_ids, lead, "input_ids", integer=True)
        _check_index_like(mask, lead, "mask", integer=False)
        if mask is not None and mask.dtype == torch.bool:
            mask = mask.to(torch.uint8)
        if input_ids is not None:
            _check_ids_range(input_ids, mask, logits.shape[-1])
        rows3, ids2, mask2 = _as_positions(logits, input_ids, mask, drop_last_position)
        logp, entropy, lse = run_launcher(selective_log_softmax_forward, rows3, ids2, mask2, temperature,
                                          bool(compute_entropy))
        ctx.save_for_backward(logits, input_ids, mask, lse, entropy)
        ctx.temperature = temperature
        ctx.compute_entropy = bool(compute_entropy)
        ctx.drop_last_position = bool(drop_last_position)
        if input_ids is None:
            ctx.mark_non_differentiable(logp)
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp.view(lead), entropy.view(lead)

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        logits, input_ids, mask, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return _SELECTIVE_LOG_SOFTMAX_GRADS()
        rows3, ids2, mask2 = _as_positions(logits, input_ids, mask, ctx.drop_last_position)
        shape2 = rows3.shape[:2]
        if input_ids is None:
            grad_logp = None
        if not ctx.compute_entropy:
            grad_entropy = None
        grad_logp = None if grad_logp is None else grad_logp.reshape(shape2).float().contiguous()
        grad_entropy = None if grad_entropy is None else grad_entropy.reshape(shape2).float().contiguous()
        dx = run_launcher(selective_log_softmax_backward, rows3, ids2, mask2, grad_logp, grad_entropy, lse,
                          entropy, ctx.temperature, int(ctx.drop_last_position))
        return _SELECTIVE_LOG_SOFTMAX_GRADS(logits=dx.view(logits.shape))


_SELECTIVE_LOG_SOFTMAX_GRADS = InputGradients(LigerSelectiveLogSoftmaxFunction.forward)


def _as_positions(logits, ids, mask, drop_last_position=False):
    """Views as (B, L, V) logits with unit column stride and (B, L) ids / mask (a copy only
    where the leading dimensions cannot be merged); without the last position if asked."""
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        logits = logits.contiguous()
    if drop_last_position:
        rows3 = logits[:, :-1]
    elif logits.dim() == 3:
        rows3 = logits
    elif logits.dim() == 1:
        rows3 = logits.view(1, 1, -1)
    else:
        rows3 = logits.reshape(1, -1, logits.shape[-1])
    shape2 = rows3.shape[:2]
    ids2 = None if ids is None else ids.reshape(shape2)
    mask2 = None if mask is None else mask.reshape(shape2)
    return rows3, ids2, mask2


def selective_log_softmax(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                          mask: torch.Tensor | None = None, return_entropy: bool = False):
    """Differentiable per-token log-probabilities ``log softmax(logits / T)[input_ids]``, float32
    of ``input_ids``' shape; with ``return_entropy``, also the per-token entropy: ``(logp, H)``.

    ``logits`` (..., V), ``input_ids`` (...) aligned with them (no shift), ``mask`` (...) or None.
    """
    logp, entropy = LigerSelectiveLogSoftmaxFunction.apply(logits, input_ids, temperature, mask, return_entropy, False)
    return (logp, entropy) if return_entropy else logp


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable per-token entropy of ``softmax(logits / T)``, float32 of the leading shape."""
    return LigerSelectiveLogSoftmaxFunction.apply(logits, None, temperature, mask, True, False)[1]


@torch.no_grad()
def fused_selective_log_softmax(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 0.9,
                                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token log-probabilities of completions, without gradient (old / reference policy).

    The best-known implementation's signature and conventions, which its callers (axolotl)
    use: ``logits`` (B, L + 1, V) as a causal LM returns them with ``logits_to_keep = L + 1``;
    the last position is dropped and ``input_ids[:, -L:]`` are scored against positions
    ``0..L-1``; ``mask`` (B, >= L) likewise (its last L columns; 0 marks a skipped position,
    whose result is 0). Returns float32 (B, L). The default temperature 0.9 is that
    implementation's; :func:`selective_log_softmax` is the differentiable, unshifted form.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, L + 1, V), got shape {tuple(logits.shape)}")
    n_positions = logits.shape[1] - 1
    if n_positions < 0:
        raise ValueError("logits must have at least one position")
    ids = input_ids[:, input_ids.shape[1] - n_positions:]
    if mask is not None:
        mask = mask[:, mask.shape[1] - n_positions:]
    logp, _ = LigerSelectiveLogSoftmaxFunction.apply(logits, ids, temperature, mask, False, True)
    return logp


# --------------------------------------------------------------------------------------
# GRPO-family losses on logits.
# --------------------------------------------------------------------------------------

LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo")


def _dapo_normalizer(mask: torch.Tensor) -> torch.Tensor:
    """Counted tokens, summed over the processes of an initialised group and divided by their
    number (each process then divides its sum by the global average), at least 1."""
    normalizer = mask.sum()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        normalizer = normalizer.clone()
        torch.distributed.all_reduce(normalizer)
        normalizer = normalizer / torch.distributed.get_world_size()
    return normalizer.clamp_min(1.0)


def reduce_grpo_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str,
                     max_completion_length: int | None = None) -> torch.Tensor:
    """The scalar loss of ``loss_type`` from masked per-token losses (B, L); see the module docstring."""
    n_batch, n_positions = per_token_loss.shape
    masked = per_token_loss * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp_min(1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp_min(1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (n_batch * (max_completion_length or n_positions))
    if loss_type in ("dapo", "cispo"):
        return masked.sum() / _dapo_normalizer(mask)
    if loss_type == "luspo":
        return (masked * mask.sum(-1, keepdim=True)).mean()
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def grpo_per_token_terms(logp, old_logp, ref_logp, advantages, mask, beta, eps_low, eps_high, loss_type,
                         importance_sampling_level, sapo_temperature_pos, sapo_temperature_neg, vllm_is_ratio):
    """Per-token ``(loss, kl or None, is_clipped)`` (B, L) from per-token log-probabilities ``logp``
    (differentiable); the formulas of the module docstring. Masked positions are not yet zeroed."""
    old = logp.detach() if old_logp is None else old_logp.float()
    advantage = advantages.float().reshape(-1, 1)
    log_ratio = logp - old
    if importance_sampling_level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1.0)
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        loss = -torch.clamp(ratio, max=eps_high).detach() * advantage * logp
        clipped = (ratio > eps_high) & (advantage > 0)
    elif loss_type == "sapo":
        tau = torch.where(advantage > 0, sapo_temperature_pos, sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantage
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    else:
        clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
        loss = -torch.minimum(ratio * advantage, clipped_ratio * advantage)
        clipped = ((ratio < 1.0 - eps_low) & (advantage < 0)) | ((ratio > 1.0 + eps_high) & (advantage > 0))
    loss = loss.expand_as(logp)
    clipped = clipped.expand_as(logp).float()
    if vllm_is_ratio is not None:
        loss = loss * vllm_is_ratio.float().reshape(logp.shape[0], -1)
    kl = None
    if beta != 0.0:
        delta = ref_logp.float() - logp
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + beta * kl
    return loss, kl, clipped


def grpo_loss(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask=None, temperature=0.9,
              beta=0.04, eps_low=0.2, eps_high=0.4, loss_type="dapo", max_completion_length=None,
              importance_sampling_level="token", reduce=True, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
              vllm_is_ratio=None):
    """GRPO-family loss on logits (B, L + 1, V) (the last position is dropped, as the caller
    keeps ``L + 1`` logits); ``completion_ids`` and ``completion_mask`` (B, L), ``advantages`` (B,),
    ``old_logp`` / ``ref_logp`` (B, L) or None (``ref_logp`` needed when ``beta != 0``),
    ``vllm_is_ratio`` (B, L), (B, 1), (B,) or None.

    ``reduce=True``: ``(loss, kl_mean or None, clip_ratio)``, the reduced loss of ``loss_type``
    and the masked means of the per-token KL and clipping indicator. ``reduce=False``:
    ``(per_token_loss, per_token_kl or None, is_clipped)``, each (B, L) and zero where masked.
    Only the loss is differentiable (with respect to the logits).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    if importance_sampling_level == "sequence" and loss_type in ("cispo", "sapo"):
        raise ValueError(f"loss_type {loss_type!r} has no sequence-level importance sampling")
    if loss_type == "sapo" and not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        raise ValueError("sapo_temperature_pos and sapo_temperature_neg must be positive")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("ref_logp is needed when beta != 0")
    if logits.dim() != 3 or completion_ids.dim() != 2:
        raise ValueError(f"logits must be (B, L + 1, V) and completion_ids (B, L), got {tuple(logits.shape)} "
                         f"and {tuple(completion_ids.shape)}")
    n_batch, n_positions = completion_ids.shape
    if logits.shape[:2] != (n_batch, n_positions + 1):
        raise ValueError(f"logits {tuple(logits.shape)} must have shape (B, L + 1, V) for completion_ids "
                         f"{tuple(completion_ids.shape)}")
    mask = (torch.ones_like(completion_ids, dtype=torch.float32) if completion_mask is None
            else completion_mask.float())
    logp, _ = LigerSelectiveLogSoftmaxFunction.apply(logits, completion_ids, temperature, completion_mask, False, True)
    loss, kl, clipped = grpo_per_token_terms(
        logp, old_logp, ref_logp, advantages, mask, float(beta), float(eps_low), float(eps_high), loss_type,
        importance_sampling_level, float(sapo_temperature_pos), float(sapo_temperature_neg), vllm_is_ratio)
    if not reduce:
        return loss * mask, None if kl is None else (kl * mask).detach(), (clipped * mask).detach()
    counted = mask.sum().clamp_min(1.0)
    kl_mean = None if kl is None else ((kl * mask).sum() / counted).detach()
    clip_ratio = ((clipped * mask).sum() / counted).detach()
    return reduce_grpo_loss(loss, mask, loss_type, max_completion_length), kl_mean, clip_ratio


class GrpoLossFunction:
    """The best-known implementation's ``GrpoLossFunction.apply`` call, argument for argument:
    ``apply(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask, temperature,
    beta, eps_low, eps_high, inplace, loss_type="grpo", max_completion_length=None, reduce=True,
    importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    vllm_is_ratio=None)``, computed by :func:`grpo_loss`. ``inplace`` is accepted and not used:
    the logits gradient always goes to a fresh buffer (the caller's logits stay readable)."""

    @staticmethod
    def apply(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask, temperature, beta, eps_low,
              eps_high, inplace=False, loss_type="grpo", max_completion_length=None, reduce=True,
              importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
              vllm_is_ratio=None):
        return grpo_loss(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask, temperature,
                         beta, eps_low, eps_high, loss_type, max_completion_length, importance_sampling_level,
                         reduce, sapo_temperature_pos, sapo_temperature_neg, vllm_is_ratio)
