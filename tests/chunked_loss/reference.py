"""Float64 references for the chunked head losses, and how their results are compared.

fp32 inputs: the reference differentiates the loss through ``x @ W.T + b`` in float64; the
engine's logits are one float32 GEMM and everything after is float32, so losses and gradients
agree to float32 rounding, relative to each gradient's largest entry (the FLCE tests'
tolerances, ``tests.ops.test_cross_entropy.assert_grad_close``).

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

from liger_kernel.ops.chunked_head import ChunkedHeadConfig, chunk_plan
from liger_kernel.ops.config import launch_config
from liger_kernel.ops.fused_linear_cross_entropy import gemm_reduction_precision
from tests.ops.test_cross_entropy import assert_grad_close

BF16_UNIT = 2.0**-8


def engine_plan(x, weight, paired, additive, needs=(True, True)):
    """The chunk plan the engine uses for this batch (same configuration and overrides)."""
    n_groups, seq_len, _ = x.shape
    floor = (x.numel() * x.element_size() if needs[0] else 0) + \
        (weight.numel() * weight.element_size() if needs[1] else 0)
    rows = launch_config(ChunkedHeadConfig, n_groups * seq_len, weight.shape[0], floor).chunk_rows
    return chunk_plan(n_groups, seq_len, paired, additive, rows)


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


def reference_grads(loss_of_logits, x, weight, bias, plan, ref_logits=None, fp32_at_engine_logits=False):
    """Float64 (loss, aux, grads, bounds) of ``loss_of_logits(logits64, ref_logits64) -> (loss, aux, q)``,
    ``q`` the per-token quantities (B, T, K) the loss is a function of.

    fp32: autograd through the float64 GEMM; ``bounds`` are then the per-entry float32
    cancellation allowances (see :func:`fp32_cancellation`). With ``fp32_at_engine_logits`` the
    float64 loss is taken at the engine's float32 logits instead, for losses whose slope varies
    fast with the log-probs (DiscoPOP's ``sigmoid(x / 0.05)``): there the float32 GEMM's
    rounding of each logit, summed over a sequence, moves the gradient by more than float32
    tolerances, and what is tested is everything after that GEMM, as for bf16. Low precision:
    at the engine's rounded logits, with the componentwise bounds of the module docstring.
    """
    x64, w64 = x.detach().double(), weight.detach().double()
    b64 = bias.detach().double() if bias is not None else None
    if x.dtype == torch.float32 and fp32_at_engine_logits:
        logits = engine_logits(x, weight, bias, plan).double().requires_grad_()
        loss, aux, q = loss_of_logits(logits, ref_logits)
        g, grad_q = torch.autograd.grad(loss, [logits, q], allow_unused=True)
        grad_q = torch.zeros_like(q) if grad_q is None else grad_q
        g = g.reshape(-1, g.shape[-1])
        grads = [(g @ w64).view_as(x64), g.t() @ x64.reshape(-1, x64.shape[-1]), g.sum(0)]
        return loss.detach(), aux, grads, fp32_cancellation(grad_q, x64, w64, weight.shape[0])
    if x.dtype == torch.float32:
        leaves = [t.clone().requires_grad_() for t in (x64, w64) + ((b64,) if b64 is not None else ())]
        logits = leaves[0] @ leaves[1].t() + (leaves[2] if b64 is not None else 0)
        loss, aux, q = loss_of_logits(logits, ref_logits)
        *grads, grad_q = torch.autograd.grad(loss, leaves + [q], allow_unused=True)
        grad_q = torch.zeros_like(q) if grad_q is None else grad_q
        return loss.detach(), aux, list(grads), fp32_cancellation(grad_q, x64, w64, weight.shape[0])
    logits = engine_logits(x, weight, bias, plan).double().requires_grad_()
    loss, aux, _ = loss_of_logits(logits, ref_logits)
    (g,) = torch.autograd.grad(loss, logits)
    g = g.reshape(-1, g.shape[-1])
    xr = x64.reshape(-1, x64.shape[-1])
    grads = [(g @ w64).view_as(x64), g.t() @ xr, g.sum(0)]
    bounds = [(g.abs() @ w64.abs()).view_as(x64), g.abs().t() @ xr.abs(), g.abs().sum(0)]
    return loss.detach(), aux, grads, bounds


def fp32_cancellation(grad_q, x64, w64, vocab):
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
    c = grad_q.detach().abs().sum(-1).reshape(-1)
    xr = x64.reshape(-1, x64.shape[-1]).abs()
    return [(unit * c * float(w64.abs().max())).view(*x64.shape[:2], 1).expand_as(x64),
            (unit * (c @ xr)).expand_as(w64), (unit * c.sum()).expand(w64.shape[0])]


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


def assert_loss_match(actual, expected, msg="loss"):
    torch.testing.assert_close(actual.double(), expected.double(), atol=2e-5, rtol=2e-5, msg=lambda m: f"{msg}\n{m}")
