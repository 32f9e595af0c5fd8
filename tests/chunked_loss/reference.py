"""Float64 references for the chunked head losses, and how their results are compared.

fp32 inputs: the reference differentiates the loss through ``x @ W.T + b`` in float64; the
engine's logits are one float32 GEMM and everything after is float32, so losses and gradients
agree to float32 rounding, relative to each gradient's largest entry (the FLCE tests'
tolerances, ``tests.ops.test_cross_entropy.assert_grad_close``), plus a per-entry allowance for
cancellation inside the logit gradient (:func:`fp32_cancellation`, and
:func:`distillation_fp32_allowance` for the distillation losses).

Low-precision inputs: the logits are a bf16 GEMM output (as an HF ``lm_head``), so the reference
takes the logits the engine's own GEMM calls give on the engine's own chunks (one bf16 ulp of a
logit moves a probability by up to 1.6%), evaluates the loss and its logit gradient ``G`` in
float64 at them, and forms ``dX = G W``, ``dW = G^T X``, ``dB = sum G`` in float64. The engine
rounds ``G`` to bf16 (u = 2**-8) and each GEMM output once, dW once per chunk (accumulated in
bf16), and backward rounds once more when it scales by the upstream gradient; the componentwise
bound ``|ours - ref| <= k u (|G| |W|)`` (resp. ``|G|^T |X|``, ``sum |G|``) then holds with
``k = 3`` for dX and dB and ``k = chunks + 2`` for dW, plus float32 noise in ``G`` itself.
"""

from __future__ import annotations

import torch

from liger_kernel.ops.chunked_head import ChunkedHeadConfig
from liger_kernel.ops.config import launch_config
from liger_kernel.ops.fused_linear_cross_entropy import gemm_reduction_precision
from liger_kernel.ops.head_chunking import chunk_plan
from tests.ops.test_cross_entropy import assert_grad_close

BF16_UNIT = 2.0**-8


def engine_plan(x, weight, paired, additive, needs=(True, True)):
    """The chunk plan the engine uses for this batch (same configuration and overrides)."""
    n_groups, seq_len, _ = x.shape
    floor = (x.numel() * x.element_size() if needs[0] else 0) + \
        (weight.numel() * weight.element_size() if needs[1] else 0)
    config = launch_config(ChunkedHeadConfig, n_groups * seq_len, weight.shape[0], floor)
    return chunk_plan(n_groups, seq_len, paired, additive, config.chunk_rows, config.unit_overshoot)


def engine_logits(x, weight, bias, plan):
    """(B, T, V) logits in x's dtype by the engine's GEMM calls on its chunks."""
    n_groups, seq_len, hidden = x.shape
    x_rows = x.detach().reshape(-1, hidden)
    out = x_rows.new_empty((x_rows.shape[0], weight.shape[0]))
    with gemm_reduction_precision():
        for ranges in plan.row_ranges:
            rows = torch.cat([x_rows[a:b] for a, b in ranges])
            z = rows @ weight.detach().t() if bias is None else torch.addmm(bias.detach(), rows, weight.detach().t())
            offset = 0
            for a, b in ranges:
                out[a:b] = z[offset: offset + b - a]
                offset += b - a
    return out.view(n_groups, seq_len, -1)


def reference_grads(loss_of_logits, x, weight, bias, plan, ref_logits=None, fp32_at_engine_logits=False,
                    logit_scale=1.0):
    """Float64 ``(loss, aux, grads, bounds, loss_allowance)`` of ``loss_of_logits(logits64,
    ref_logits64) -> (loss, aux, q)``, ``q`` the per-token quantities (B, T) or (B, T, K) the loss
    is a function of: the very tensor the loss was computed from (a view taken afterwards gets no
    gradient, and its allowance would be zero), or a tuple ``(q, *rounded)`` with leaves from
    :func:`rounded_leaf`.

    fp32: autograd through the float64 GEMM; ``bounds`` are then the per-entry float32
    allowances of :func:`fp32_allowance`, ``loss_allowance`` the first-order effect of the
    per-token quantities' rounding on the loss's value (``sum |dL/dq| e``, every path through
    ``q`` counted, including weights the loss holds constant). With ``fp32_at_engine_logits`` the
    float64 loss is taken at the engine's float32 logits instead, for losses whose slope varies
    fast with the log-probs (DiscoPOP's ``sigmoid(x / 0.05)``): there the float32 GEMM's
    rounding of each logit, summed over a sequence, moves the gradient by more than float32
    tolerances, and what is tested is everything after that GEMM, as for bf16. Low precision:
    at the engine's rounded logits, with the componentwise bounds of the module docstring (and
    no loss allowance beyond :func:`assert_loss_match`'s).
    ``logit_scale``: the factor the loss applies to the logits before its softmax (1 / temperature).
    """
    x64, w64 = x.detach().double(), weight.detach().double()
    b64 = bias.detach().double() if bias is not None else None
    if x.dtype == torch.float32:
        if fp32_at_engine_logits:
            logits = engine_logits(x, weight, bias, plan).double().requires_grad_()
            leaves, logits_error = [logits], None
        else:
            leaves = [t.clone().requires_grad_() for t in (x64, w64) + ((b64,) if b64 is not None else ())]
            logits = leaves[0] @ leaves[1].t() + (leaves[2] if b64 is not None else 0)
            logits_error = 4 * 2.0**-24 * x64.shape[-1] * (x64.reshape(-1, x64.shape[-1]).abs() @ w64.abs().t())
        loss, aux, q = loss_of_logits(logits, ref_logits)
        q, *rounded = q if isinstance(q, tuple) else (q,)
        *grads, grad_q = torch.autograd.grad(loss, leaves + [q], allow_unused=True, create_graph=True)
        assert grad_q is not None, "the reference's q is not what its loss was computed from"
        if fp32_at_engine_logits:
            g = grads[0].detach().reshape(-1, logits.shape[-1])
            grads = [(g @ w64).view_as(x64), g.t() @ x64.reshape(-1, x64.shape[-1]), g.sum(0)]
        grads = [grad.detach() for grad in grads]
        errors = rounding_errors(q, rounded, weight.shape[0], logits, logits_error)
        slopes = torch.autograd.grad(loss, [q, *rounded], retain_graph=True, allow_unused=True)
        loss_allowance = sum(float((slope.abs().reshape(-1) * e).sum()) for slope, e in zip(slopes, errors)
                             if slope is not None)
        bounds = fp32_allowance(grad_q, q, rounded, errors, x64, w64, weight.shape[0], logits.detach(), logit_scale)
        return loss.detach(), aux, grads, bounds, loss_allowance
    logits = engine_logits(x, weight, bias, plan).double().requires_grad_()
    loss, aux, _ = loss_of_logits(logits, ref_logits)
    (g,) = torch.autograd.grad(loss, logits)
    g = g.reshape(-1, g.shape[-1])
    xr = x64.reshape(-1, x64.shape[-1])
    grads = [(g @ w64).view_as(x64), g.t() @ xr, g.sum(0)]
    bounds = [(g.abs() @ w64.abs()).view_as(x64), g.abs().t() @ xr.abs(), g.abs().sum(0)]
    return loss.detach(), aux, grads, bounds, 0.0


def rounding_errors(q, rounded, vocab, logits, logits_error=None):
    """Flattened per-entry bounds on the float32 rounding of ``q`` and of each ``rounded`` leaf.

    The engine's log-softmax quantities are off by up to ``4u (1 + log V)(1 + |q|)`` an entry
    (``u = 2**-24``); where the reference's logits are exact (float64 GEMM), ``q`` also carries
    the float32 GEMM's rounding of each logit (``logits_error``, (rows, V)) through ``|dq/dz|``,
    as does a leaf that copies ``q`` (:func:`rounded_leaf` with ``copy_of_q``)."""
    import math

    errors = [4 * 2.0**-24 * (1 + math.log(vocab)) * (1 + t.detach().abs().reshape(-1)) for t in (q, *rounded)]
    if logits_error is not None:
        propagated = _propagated_logits_error(q, logits, logits_error)
        errors = [e + propagated if i == 0 or getattr(rounded[i - 1], "copy_of_q", False) else e
                  for i, e in enumerate(errors)]
    return errors


def fp32_allowance(grad_q, q, rounded, errors, x64, w64, vocab, logits=None, logit_scale=1.0):
    """:func:`fp32_cancellation` plus what the rounding of the per-token quantities does to the
    loss's slope ``c = dL/dq``: with ``e`` their :func:`rounding_errors`, ``c`` moves by up to
    ``|H| e``, ``H`` the float64 derivative of ``c`` in ``q`` and in each ``rounded`` leaf (large
    where the loss bends sharply, as DiscoPOP's ``sigmoid(x / 0.05)``, the f-divergences'
    exponentials of a sequence's log-ratio, or VESPO's weight ``exp(k log w - lam w)``). A row's
    logit gradient has ``|dq/dz| <= 1`` an entry and ``<= 2`` summed over the vocabulary, so
    ``delta_c_r`` reaches dX row r as ``2 max|W| delta_c_r``, dW as ``sum_r delta_c_r |x_r|`` and
    dB as ``sum_r delta_c_r``."""
    base = fp32_cancellation(grad_q.detach(), x64, w64, vocab, logits, logit_scale)
    if not grad_q.requires_grad:  # the loss is linear in q
        return base
    flat_grad = grad_q.reshape(-1)
    inputs = [q, *rounded]
    hessian = torch.stack([_hessian_row(flat_grad[i], inputs) for i in range(flat_grad.numel())])
    delta_c = (hessian.abs() @ torch.cat(errors)).reshape(x64.shape[0] * x64.shape[1], -1).sum(-1)
    xr = x64.reshape(-1, x64.shape[-1]).abs()
    extra = [(2 * float(w64.abs().max()) * delta_c).view(*x64.shape[:2], 1).expand_as(x64),
             (delta_c @ xr).expand_as(w64), delta_c.sum().expand(w64.shape[0])]
    return [b + e for b, e in zip(base, extra)]


def _propagated_logits_error(q, logits, logits_error):
    """``sum_v |dq_rk/dz_rv| logits_error_rv`` for every entry of ``q`` (rows independent)."""
    flat_q = q.reshape(logits_error.shape[0], -1)
    columns = []
    for k in range(flat_q.shape[-1]):
        (jac,) = torch.autograd.grad(flat_q[:, k].sum(), logits, retain_graph=True, allow_unused=True)
        if jac is None:
            columns.append(torch.zeros(flat_q.shape[0], dtype=q.dtype, device=q.device))
            continue
        columns.append((jac.reshape(-1, jac.shape[-1]).abs() * logits_error).sum(-1))
    return torch.stack(columns, dim=-1).reshape(-1)


def _hessian_row(grad_entry, inputs):
    """``d grad_entry / d t`` for each ``t`` in ``inputs``, flattened and concatenated."""
    if not grad_entry.requires_grad:
        return torch.cat([torch.zeros_like(t).reshape(-1) for t in inputs])
    rows = torch.autograd.grad(grad_entry, inputs, retain_graph=True, allow_unused=True)
    return torch.cat([torch.zeros_like(t).reshape(-1) if row is None else row.reshape(-1)
                      for row, t in zip(rows, inputs)])


def rounded_leaf(values, copy_of_q=False):
    """``values`` as a float64 leaf of the reference's graph, for per-token quantities the engine
    computes in float32 but takes no gradient through: the reference head's log-probs, or (with
    ``copy_of_q``, same shape as ``q``) the policy's own log-probs where the loss holds a weight
    made of them constant (VESPO's ``phi``, CISPO's clipped ratio). A reference computes those
    from the leaf and returns it after ``q`` (``(q, leaf, ...)``), so that the allowances charge
    its rounding through the loss's curvature and value."""
    leaf = values.detach().double().requires_grad_()
    leaf.copy_of_q = copy_of_q
    return leaf


def fp32_cancellation(grad_q, x64, w64, vocab, logits=None, logit_scale=1.0):
    """Per-entry float32 allowance for cancellation inside a chunk's logit gradient.

    A row's logit gradient is ``sum_k c_rk dq_rk/dz_r`` with ``c = dL/dq``; each derivative of a
    log-softmax quantity holds differences such as ``onehot - p`` that cancel in float32 where
    ``p`` is near one-hot, leaving an absolute error of a few units ``u = 2**-24`` of
    ``c_r = sum_k |c_rk|`` (times ``1 + log V`` for entropy-like terms) however small the
    difference is. Propagated through the GEMMs: ``4u c_r (1 + log V) max|W|`` in row r of dX,
    ``4u sum_r c_r |x_r|`` in dW, ``4u sum_r c_r`` in dB.
    """
    import math

    unit = 4 * 2.0**-24 * (1 + math.log(vocab))
    if logits is not None:
        # ``s_y - lse`` of the scaled logits ``s`` is rounded to ulps of ``|lse| <= max|s| + log V``,
        # and ``dq/dz`` carries the scale once more.
        largest = logits.detach().reshape(-1, logits.shape[-1]).abs().amax(-1) * logit_scale
        unit = 4 * 2.0**-24 * (1 + math.log(vocab) + 2 * largest) * logit_scale
    c = unit * grad_q.detach().abs().reshape(x64.shape[0] * x64.shape[1], -1).sum(-1)
    xr = x64.reshape(-1, x64.shape[-1]).abs()
    return [(c * float(w64.abs().max())).view(*x64.shape[:2], 1).expand_as(x64),
            (c @ xr).expand_as(w64), c.sum().expand(w64.shape[0])]


def distillation_fp32_allowance(student_logits, teacher_logits, labels, soft_terms, weight_hard_loss,
                                weight_soft_loss, temperature, x64, w64, ignore_index=-100):
    """Per-entry float32 allowance ``[dX, dW, dB]`` for the distillation losses (float64 logits (N, V) / (N, V')).

    The engine's logit gradient of row r is ``G_r = c_h g^hard_r + (c_s / tau) g^soft_r`` with
    ``c = w / n_valid`` on counted rows (0 elsewhere), each ``g`` a float32 sum of terms whose
    magnitudes are, per entry j:

    * hard (cross-entropy, log-softmax backward ``onehot - p sum(onehot)``): ``y_j + 2 p_j``;
    * soft, softmax-based (:func:`softmax_soft_terms`): ``3 p_j + q_j`` with ``p``, ``q`` the
      student's and teacher's ``softmax(z / tau)`` (the loss's terms in log space are weighted by
      ``p`` or ``q``, each row of which sums to 1, and the log-softmax backward adds ``p_j`` times
      a row sum of at most 2);
    * soft, cosine (:func:`cosine_soft_terms`): ``beta (|t_j| / (|s| |t|) + |s_j| / |s|^2)``.

    float32 rounds each term to a few units ``u = 2**-24`` and the logs they are formed from to
    ``u`` times ``1 + log V`` (entropy-like terms), however much the terms cancel (a V = 2 row's
    entries are equal and opposite and the bias gradient sums such rows of both signs), so
    ``|e_rj| <= 4 u (1 + log V) m_rj`` with ``m`` the weighted magnitudes above. Propagated through
    the GEMMs: ``|e| |W|`` in dX, ``|e|^T |X|`` in dW, ``sum_r |e_r|`` in dB.
    """
    import math

    n_rows, vocab = student_logits.shape
    counted = labels.reshape(-1) != ignore_index
    n_valid = counted.sum().clamp(min=1).double()
    p = torch.softmax(student_logits, -1)
    onehot = torch.nn.functional.one_hot(torch.where(counted, labels.reshape(-1), 0), vocab).double()
    s = student_logits / temperature
    pad = teacher_logits.shape[-1] - vocab
    if pad:
        s = torch.cat([s, s.new_zeros(n_rows, pad)], dim=-1)
    hard = weight_hard_loss * (onehot + 2 * p)
    soft = weight_soft_loss / temperature * soft_terms(s, teacher_logits / temperature)[:, :vocab]
    unit = 4 * 2.0**-24 * (1 + math.log(teacher_logits.shape[-1]))
    e = unit * (hard.abs() + soft.abs()) * (counted.double() / n_valid)[:, None]
    xr = x64.reshape(-1, x64.shape[-1]).abs()
    return [e @ w64.abs(), e.t() @ xr, e.sum(0)]


def softmax_soft_terms(s, t):
    """Per-entry term magnitudes ``3 p + q`` of a softmax-based soft loss's gradient in ``s`` (see
    :func:`distillation_fp32_allowance`)."""
    return 3 * torch.softmax(s, -1) + torch.softmax(t, -1)


def cosine_soft_terms(beta):
    """Per-entry term magnitudes of ``beta (1 - cos(s, t))``'s gradient in ``s``:
    ``beta (|t| / (|s| |t|) + |s| / |s|^2)`` (see :func:`distillation_fp32_allowance`)."""

    def terms(s, t):
        s_norm, t_norm = s.norm(dim=-1, keepdim=True), t.norm(dim=-1, keepdim=True)
        return beta * (t.abs() / (s_norm * t_norm) + s.abs() / s_norm**2)

    return terms


def assert_grads_match(leaves, ref_grads, bounds, n_chunks, upstream=1.0, names=("input", "weight", "bias")):
    """Each leaf's grad against ``upstream * ref``: FLCE fp32 tolerances, or the bf16 bounds."""
    for name, leaf, ref, bound in zip(names, leaves, ref_grads, bounds or [None] * 3):
        if leaf is None or not leaf.requires_grad:
            continue
        assert leaf.grad is not None, f"no grad for {name}"
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype, name
        expected = ref * upstream
        if leaf.dtype == torch.float32:
            assert_grad_close(leaf.grad, expected, torch.float32, f"grad {name}", extra=bound * abs(upstream))
            continue
        units = (n_chunks + 2 if name == "weight" else 3) * BF16_UNIT
        allowed = units * bound * abs(upstream) + 1e-6 * float(expected.abs().max()) + 1e-12
        excess = ((leaf.grad.double() - expected).abs() - allowed).max()
        assert excess <= 0, f"grad {name}: exceeds the componentwise bound by {float(excess):.3g}"


def assert_loss_match(actual, expected, msg="loss", allowance=0.0):
    """float32 tolerances plus ``allowance``, the reference's bound on the loss's sensitivity to rounding."""
    torch.testing.assert_close(actual.double(), expected.double(), atol=2e-5 + allowance, rtol=2e-5,
                               msg=lambda m: f"{msg}\n{m}")


# --------------------------------------------------------------------------------------
# RL and distillation references (float64, written from TRL's published formulas)
# --------------------------------------------------------------------------------------


def selected_logprobs(logits, ids, temperature):
    """(B, T) log-softmax of ``logits / temperature`` at ``ids`` (token 0 for an id outside the vocabulary)."""
    safe = torch.where((ids >= 0) & (ids < logits.shape[-1]), ids, torch.zeros_like(ids))
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)


def grpo_reference(logp, mask, advantages, old=None, ref=None, vllm_is_ratio=None, num_items_in_batch=None,
                   beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo", max_completion_length=None,
                   importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                   delta=None, use_bias_correction_kl=False, vespo=(2.0, 3.0, 3.0, 2.0), weights_from=None):
    """TRL GRPOTrainer's ``_compute_loss`` on per-token log-probs ``logp`` (B, T): ``(loss, metrics)``,
    metrics as the fused loss returns them: ``(kl, clip_ratio)`` (kl only when beta != 0).
    ``weights_from``: the log-probs (equal to ``logp``) that the weights the loss holds constant
    (CISPO's clipped ratio, VESPO's ``phi``) are made of; by default ``logp`` detached, a
    :func:`rounded_leaf` to charge their rounding."""
    import math

    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv
    old = logp.detach() if old is None else old.to(logp.dtype)
    log_ratio = logp - old
    if importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_w)
    weight_logp = logp.detach() if weights_from is None else weights_from
    if beta != 0.0:
        ref = logp.detach() if ref is None else ref.to(logp.dtype)
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    zero = torch.zeros_like(coef_1, dtype=torch.bool)
    clipped = zero
    if loss_type == "cispo":
        weight_log_ratio = weight_logp - old
        if importance_sampling_level != "token":
            weight_log_ratio = ((weight_log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
        per_token_loss = -torch.clamp(torch.exp(weight_log_ratio), max=epsilon_high) * adv * logp
        clipped = (coef_1 > epsilon_high) & (adv > 0)
    elif loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        c1 = torch.clamp(coef_1, max=delta) if delta is not None else coef_1
        per_token_loss = -torch.min(c1 * adv, coef_2 * adv)
        clipped = ((coef_1 < 1 - epsilon_low) & (adv < 0)) | ((coef_1 > 1 + epsilon_high) & (adv > 0))
    elif loss_type == "sapo":
        temps = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * adv
    elif loss_type == "vespo":
        k_pos, lam_pos, k_neg, lam_neg = vespo
        seq = (torch.clamp(weight_logp - old, -20.0, 20.0) * mask).sum(-1, keepdim=True)
        if vllm_is_ratio is not None:
            seq = seq + torch.clamp(torch.log(vllm_is_ratio.to(logp.dtype)), math.log(1e-8), 20.0).sum(
                -1, keepdim=True)
        log_w_seq = torch.clamp(seq, math.log(1e-8), 20.0)
        k = torch.where(adv >= 0, k_pos, k_neg)
        lam = torch.where(adv >= 0, lam_pos, lam_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w_seq - lam * torch.exp(log_w_seq)).nan_to_num(0.0, 0.0, 0.0)
        per_token_loss = -phi * adv * logp
    else:
        raise ValueError(loss_type)
    if vllm_is_ratio is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * vllm_is_ratio.to(logp.dtype)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    n_seq = logp.shape[0]
    if loss_type in ["grpo", "sapo"]:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (n_seq * max_completion_length)
    elif loss_type in ["cispo", "dapo", "vespo"]:
        n = mask.sum() if num_items_in_batch is None else torch.as_tensor(float(num_items_in_batch))
        loss = (per_token_loss * mask).sum() / n.clamp(min=1.0)
    else:  # luspo
        loss = (per_token_loss * mask.sum(1, keepdim=True)).mean()
    tokens = mask.sum().clamp(min=1.0)
    metrics = []
    if beta != 0.0:
        metrics.append((per_token_kl * mask).sum() / tokens)
    # token-weighted, a sequence-level (GSPO) ratio counting every token of its sequence
    metrics.append((clipped.expand_as(mask) * mask).sum() / tokens)
    return loss, tuple(m.detach() for m in metrics)


def generalized_jsd_reference(student_logits, teacher_logits, beta):
    """Per-row generalised JSD (float64) in probability space: beta 0 is KL(teacher || student), 1 the reverse."""
    p = torch.softmax(student_logits, -1)
    q = torch.softmax(teacher_logits, -1)

    def kl(a, b):
        return (a * (a.log() - b.log())).sum(-1)

    if beta == 0:
        return kl(q, p)
    if beta == 1:
        return kl(p, q)
    m = (1 - beta) * p + beta * q
    return beta * kl(q, m) + (1 - beta) * kl(p, m)


def distillation_reference(student_logits, teacher_logits, labels, soft_rows, weight_hard_loss, weight_soft_loss,
                           temperature, ignore_index=-100):
    """``(loss, (soft, hard), q)``: hard CE on unscaled student logits, soft ``soft_rows(s / tau, t / tau)``
    (student logits zero-padded to the teacher's vocabulary), both summed over counted rows / their count;
    ``q`` (N, 2) the per-row terms the loss sums."""
    counted = labels != ignore_index
    n_valid = counted.sum().clamp(min=1).to(student_logits.dtype)
    hard_rows = torch.nn.functional.cross_entropy(student_logits, torch.where(counted, labels, -100),
                                                  reduction="none")
    s = student_logits / temperature
    pad = teacher_logits.shape[-1] - s.shape[-1]
    if pad:
        s = torch.cat([s, s.new_zeros(s.shape[0], pad)], dim=-1)
    q = torch.stack([hard_rows * counted, soft_rows(s, teacher_logits / temperature) * counted], dim=-1)
    hard, soft = q[:, 0].sum() / n_valid, q[:, 1].sum() / n_valid
    return weight_hard_loss * hard + weight_soft_loss * soft, (soft.detach(), hard.detach()), q


def run_distillation_case(loss_call, soft_rows, weight_hard_loss, weight_soft_loss, temperature, dtype, n_rows,
                          student_hidden, teacher_hidden, vocab, teacher_vocab=None, with_bias=True,
                          ignore_index=-100, all_ignored=False, leading=None, chunk_rows=None,
                          returns_parts=False, soft_terms=softmax_soft_terms):
    """Run ``loss_call(xs, ws, xt, wt, labels, bs, bt)`` and check loss, parts and student gradients
    against :func:`distillation_reference` (one engine group per row, as the distillation base runs);
    fp32 gradients with :func:`distillation_fp32_allowance` (``soft_terms`` the soft loss's term magnitudes)."""
    from liger_kernel.ops.chunked_head import ChunkedHeadConfig
    from liger_kernel.ops.config import override_launch_config
    from tests.utils import DEVICE

    teacher_vocab = teacher_vocab or vocab
    xs = torch.randn(n_rows, student_hidden, device=DEVICE).to(dtype)
    ws = (torch.randn(vocab, student_hidden, device=DEVICE) * 3 / student_hidden**0.5).to(dtype)
    bs = torch.randn(vocab, device=DEVICE).to(dtype) if with_bias else None
    xt = torch.randn(n_rows, teacher_hidden, device=DEVICE).to(dtype)
    wt = (torch.randn(teacher_vocab, teacher_hidden, device=DEVICE) * 3 / teacher_hidden**0.5).to(dtype)
    bt = torch.randn(teacher_vocab, device=DEVICE).to(dtype) if with_bias else None
    labels = torch.randint(0, vocab, (n_rows,), device=DEVICE)
    labels[torch.rand(n_rows, device=DEVICE) < 0.3] = ignore_index
    labels[0] = 1 % vocab
    if all_ignored:
        labels[:] = ignore_index
    shape = (n_rows,) if leading is None else leading
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (xs, ws, bs)]
    override = {} if chunk_rows is None else {"chunk_rows": chunk_rows}
    x_groups = xs.view(n_rows, 1, -1)
    with override_launch_config(ChunkedHeadConfig, **override):
        plan = engine_plan(x_groups, ws, False, True)
        out = loss_call(leaves[0].view(*shape, -1), leaves[1], xt.view(*shape, -1), wt, labels.view(shape),
                        leaves[2], bt)
    loss = out[0] if returns_parts else out
    upstream = float(torch.rand(()) + 0.5)
    (loss * upstream).backward()
    teacher = engine_logits(xt.view(n_rows, 1, -1), wt, bt, plan).double()

    def loss_of_logits(logits, ref_z):
        value, parts, q = distillation_reference(logits.view(n_rows, -1), ref_z.view(n_rows, -1), labels, soft_rows,
                                                 weight_hard_loss, weight_soft_loss, temperature, ignore_index)
        return value, parts, q

    loss_ref, parts_ref, grads_ref, bounds, loss_allowance = reference_grads(loss_of_logits, x_groups, ws, bs, plan,
                                                                             teacher)
    if dtype == torch.float32:
        xs64, ws64 = xs.double(), ws.double()
        student = xs64 @ ws64.t() + (bs.double() if bs is not None else 0)
        bounds = distillation_fp32_allowance(student, teacher.view(n_rows, -1), labels, soft_terms, weight_hard_loss,
                                             weight_soft_loss, temperature, xs64, ws64, ignore_index)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_loss_match(loss, loss_ref, allowance=loss_allowance)
    if returns_parts:
        for got, want in zip(out[1:], parts_ref):
            assert not got.requires_grad
            assert_loss_match(got, want, "soft/hard loss")
    grads_ref[0], bounds[0] = grads_ref[0].view(xs.shape), bounds[0].reshape(xs.shape)
    assert_grads_match(leaves, grads_ref, bounds, len(plan.row_ranges), upstream)
    return loss, leaves
