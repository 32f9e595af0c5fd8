"""Per-token divergence of a student head from a teacher head, and the student's entropy, without the logits.

Student hidden states ``x_s`` (N, D_s) through ``W_s`` (V, D_s), ``b_s``; teacher ``x_t`` (N, D_t)
through ``W_t`` (V, D_t), ``b_t`` (the same vocabulary). Per row, each side's logits transformed
as ``s = cap_s(z_s * scale_s) / tau`` and ``t = cap_t(z_t * scale_t) / tau`` (``cap(u) = c
tanh(u / c)``, none without a cap), ``P = softmax(s)``, ``Q = softmax(t)``::

    beta = 0:   d = KL(Q || P)                           (forward KL)
    beta = 1:   d = KL(P || Q)                           (reverse KL)
    otherwise:  M = (1 - beta) P + beta Q,  d = beta KL(Q || M) + (1 - beta) KL(P || M)
    H = -sum_v P_v log P_v                               (the student's entropy; no gradient)

float32 (N,). ``d`` is differentiable in the student's ``x_s``, ``W_s`` and ``b_s`` only (the
teacher is a constant). The forward computes both heads' logits chunk by chunk and their rows'
statistics with the Triton passes of :mod:`~liger_kernel.ops.distillation_epilogue`, keeping
the inputs and both heads' logits of its leading chunks (one chunk budget's worth); the
backward hands ``sum_n g_n d_n`` to the chunked head engine (:mod:`~liger_kernel.ops.chunked_head`)
with the teacher as its second head, which recomputes the other chunks' logits and writes the
student's gradient in place (closed form). dW accumulates in
float32. The logits are one GEMM in each head's dtype (fp32 accumulation), every statistic after
is float32.

This is the per-token divergence TRL's distillation trainer (>= 1.13) computes with
``ChunkedDivergenceFunction``; :mod:`liger_kernel.transformers.trl_fused_head` serves that call
shape with it.
"""

from __future__ import annotations

import contextlib

import torch

from liger_kernel.ops.autograd import EagerUnderCompile, InputGradients, strictly_once_differentiable
from liger_kernel.ops.checks import check_beta, check_linear_operands, check_temperature
from liger_kernel.ops.chunked_head import (
    _logits,
    chunked_head_loss_and_grads,
    per_token_chunks,
)
from liger_kernel.ops.distillation_epilogue import GeneralizedJSDRows
from liger_kernel.ops.head_chunking import gemm_reduction_precision
from liger_kernel.ops.head_epilogue import check_logit_transform


@torch.compiler.disable
def divergence_forward(x_s, w_s, b_s, x_t, w_t, b_t, rows: GeneralizedJSDRows, needs=(True, True)):
    """``(out, kept, config)``: (N, 2) float32 ``[d, H]`` chunk by chunk, both heads' logits of the
    leading chunks the backward reads instead of recomputing (``[(z_s, z_t)]``, see
    :func:`~liger_kernel.ops.chunked_head.per_token_chunks`), and the chunk configuration the
    backward must use; no graph (never traced: the loop switches cuBLAS's reduction precision,
    global state Dynamo refuses to see change)."""
    out = torch.empty((x_s.shape[0], 2), device=x_s.device, dtype=torch.float32)
    # The backward's chunks (the teacher's logits beside the student's), so both compute the same logits.
    chunks = per_token_chunks(x_s, w_s, needs, beside=x_t)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad(), torch.autocast(device_type=x_s.device.type, enabled=False), gemm_reduction_precision():
        for i, (a, b) in enumerate(chunks.row_ranges):
            student, teacher = _logits(x_s[a:b], w_s, b_s), _logits(x_t[a:b], w_t, b_t)
            out[a:b] = rows.statistics(student, teacher)[0][:, 1:]
            if i < chunks.n_kept:
                kept.append((student, teacher))
    return out, kept, chunks.config


class LigerFusedLinearTokenDivergenceFunction(EagerUnderCompile, torch.autograd.Function):
    """``apply(x_s, w_s, b_s, x_t, w_t, b_t, beta, temperature, student_logit_scale,
    student_softcap, teacher_logit_scale, teacher_softcap, backward_context)`` -> ``(d, H)``,
    each (N,) float32; see the module docstring. ``backward_context``: a callable returning a
    context manager the backward runs in (e.g. one gathering sharded heads again), or None."""

    @staticmethod
    def forward(ctx, x_s, w_s, b_s, x_t, w_t, b_t, beta, temperature=1.0, student_logit_scale=1.0,
                student_softcap=None, teacher_logit_scale=1.0, teacher_softcap=None, backward_context=None):
        check_temperature(temperature)
        check_beta(beta)
        if x_s.dim() != 2 or x_t.dim() != 2 or x_s.shape[0] != x_t.shape[0]:
            raise ValueError(f"student and teacher hidden states must be 2-D with the same rows, got "
                             f"{tuple(x_s.shape)} and {tuple(x_t.shape)}")
        check_linear_operands(x_s, w_s, b_s, "student_hidden", "student_weight", "student_bias")
        check_linear_operands(x_t, w_t, b_t, "teacher_hidden", "teacher_weight", "teacher_bias")
        if w_s.shape[0] != w_t.shape[0]:
            raise ValueError(f"student and teacher vocabularies differ: {w_s.shape[0]} and {w_t.shape[0]}")
        check_logit_transform(student_logit_scale, student_softcap, "student_logit_scale",
                              "student_final_logit_softcapping")
        check_logit_transform(teacher_logit_scale, teacher_softcap, "teacher_logit_scale",
                              "teacher_final_logit_softcapping")
        x_s, x_t = x_s.contiguous(), x_t.contiguous()
        student, teacher = (float(student_logit_scale), student_softcap), (float(teacher_logit_scale), teacher_softcap)
        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        rows = GeneralizedJSDRows(beta, temperature, with_hard_loss=False, student=student, teacher=teacher,
                                  entropy=True)
        out, kept, ctx.chunk_config = divergence_forward(x_s, w_s, b_s, x_t, w_t, b_t, rows, needs)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x_s, w_s, b_s, x_t, w_t, b_t)
        # Not saved tensors: the backward takes them out of this list one by one, so each chunk is
        # freed as soon as its gradient is consumed (saved tensors would live to the backward's end).
        ctx.kept_logits = kept
        ctx.rows = GeneralizedJSDRows(beta, temperature, with_hard_loss=False, student=student, teacher=teacher)
        ctx.backward_context = backward_context if backward_context is not None else contextlib.nullcontext
        entropy = out[:, 1]
        ctx.mark_non_differentiable(entropy)
        return out[:, 0], entropy

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_divergence, _grad_entropy):
        x_s, w_s, b_s, x_t, w_t, b_t = ctx.saved_tensors
        if grad_divergence is None:
            return _DIVERGENCE_GRADS()

        def group_fn(q, q_ref, upstream):  # q: (G, 1, [hard (0), d])
            return (q[:, 0, 1] * upstream).sum(), ()

        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b_s is not None and ctx.needs_input_grad[2])
        with ctx.backward_context():
            _, _, grads = chunked_head_loss_and_grads(
                x_s.unsqueeze(1), w_s, b_s, ctx.rows, group_fn, group_args=(grad_divergence.float(),),
                ref_x=x_t.unsqueeze(1), ref_weight=w_t, ref_bias=b_t, ref_logits_to_token_fn=True, needs=needs,
                accum_fp32=True, kept_logits=ctx.kept_logits, chunk_config=ctx.chunk_config)
        grad_x = grads.x.view(x_s.shape) if grads.x is not None else None
        return _DIVERGENCE_GRADS(x_s=grad_x, w_s=grads.weight, b_s=grads.bias)


_DIVERGENCE_GRADS = InputGradients(LigerFusedLinearTokenDivergenceFunction.forward)
