"""Generalised JSD of a student and a teacher logits chunk, and the student's gradient in place.

The closed-form ``token_fn`` of the fused linear JSD distillation loss on the chunked head
engine (:mod:`liger_kernel.ops.chunked_head`, with the teacher as its second head). Per row,
with ``P = softmax(z_s / tau)`` the student's and ``Q = softmax(z_t / tau)`` the teacher's
distribution (TRL's GKD convention; each side's logits may first be transformed as
``cap(z * scale) / tau``, ``cap(u) = c tanh(u / c)``, and ``dd/dz_s`` then carries that
transform's slope instead of ``1 / tau``)::

    beta = 0:   d = KL(Q || P)                                  dd/ds_v = P_v - Q_v
    beta = 1:   d = KL(P || Q)                                  dd/ds_v = P_v (log P_v - log Q_v - d)
    otherwise:  M = (1 - beta) P + beta Q,
                d = beta KL(Q || M) + (1 - beta) KL(P || M)     dd/ds_v = (1 - beta) P_v (log(P_v / M_v) - KL(P || M))

(the last from ``dd/dP_v = (1 - beta) log(P_v / M_v)``, the ``beta Q / M`` and ``(1 - beta) P / M``
terms summing to one, pulled back through the softmax), and ``dd/dz_s = dd/ds / tau``. The hard
loss beside it is the cross entropy of the student's logits at temperature 1,
``h = lse(z_s) - z_s[y]`` with ``dh/dz_s = softmax(z_s) - onehot(y)``.

Three Triton passes over the chunk in the GEMMs' dtype: the row statistics of
:mod:`~liger_kernel.ops.head_epilogue` (log-sum-exp of each side), a row reduction for ``d``
(and ``KL(P || M)``), and an elementwise pass that writes ``dL/dz_s`` over the student's
logits. All float32; the gradient is rounded once to the chunk's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.checks import check_beta, check_temperature
from liger_kernel.ops.config import launch_config
from liger_kernel.ops.head_epilogue import (
    ENTROPY,
    LSE,
    HeadEpilogueConfig,
    check_logit_transform,
    row_statistics,
    transform_flags,
    transform_logits,
    transformed_logits,
)
from liger_kernel.ops.launch import cdiv, is_interpreter, next_power_of_2
from liger_kernel.ops.numerics import round_to_dtype

FORWARD_KL, REVERSE_KL, MIXTURE = 0, 1, 2


@triton.jit
def _log_mixture(log_p, log_q, log_student_weight, log_teacher_weight):
    """``log((1 - beta) P + beta Q)`` from the two log-probabilities, without overflow."""
    a = log_p + log_student_weight
    b = log_q + log_teacher_weight
    top = tl.maximum(a, b)
    top = tl.where(top == -float("inf"), 0.0, top)
    return top + tl.log(tl.exp(a - top) + tl.exp(b - top))


@triton.jit
def _divergence_rows_kernel(student_ptr, student_stride, teacher_ptr, teacher_stride, lse_ptr, out_ptr, n_cols,
                            inv_temperature, beta, log_student_weight, log_teacher_weight, student_scale,
                            student_softcap, teacher_scale, teacher_softcap, MODE: tl.constexpr,
                            STUDENT_SCALED: tl.constexpr, STUDENT_SOFTCAPPED: tl.constexpr,
                            TEACHER_SCALED: tl.constexpr, TEACHER_SOFTCAPPED: tl.constexpr, BLOCK: tl.constexpr):
    """Per row: ``out[row] = (d, KL(P || M))`` (the second only for the mixture)."""
    row = tl.program_id(0).to(tl.int64)
    lse_s = tl.load(lse_ptr + row * 2)
    lse_t = tl.load(lse_ptr + row * 2 + 1)
    zero = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
    sum_p = zero
    sum_q = zero
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z_s = tl.load(student_ptr + row * student_stride + cols, mask=mask, other=0.0).to(tl.float32)
        z_t = tl.load(teacher_ptr + row * teacher_stride + cols, mask=mask, other=0.0).to(tl.float32)
        s, _ = transformed_logits(z_s, student_scale, student_softcap, inv_temperature, STUDENT_SCALED,
                                  STUDENT_SOFTCAPPED)
        t, _ = transformed_logits(z_t, teacher_scale, teacher_softcap, inv_temperature, TEACHER_SCALED,
                                  TEACHER_SOFTCAPPED)
        log_p = tl.where(mask, s - lse_s, -float("inf"))
        log_q = tl.where(mask, t - lse_t, -float("inf"))
        p = tl.exp(log_p)
        q = tl.exp(log_q)
        if MODE == 0:
            sum_q += tl.sum(tl.where(q > 0.0, q * (log_q - log_p), 0.0), axis=0)
        elif MODE == 1:
            sum_p += tl.sum(tl.where(p > 0.0, p * (log_p - log_q), 0.0), axis=0)
        else:
            log_m = _log_mixture(log_p, log_q, log_student_weight, log_teacher_weight)
            sum_q += tl.sum(tl.where(q > 0.0, q * (log_q - log_m), 0.0), axis=0)
            sum_p += tl.sum(tl.where(p > 0.0, p * (log_p - log_m), 0.0), axis=0)
    if MODE == 0:
        divergence = sum_q
    elif MODE == 1:
        divergence = sum_p
    else:
        divergence = beta * sum_q + (1.0 - beta) * sum_p
    tl.store(out_ptr + row * 2, divergence)
    tl.store(out_ptr + row * 2 + 1, sum_p)


@triton.jit
def _divergence_grad_kernel(student_ptr, student_stride, teacher_ptr, teacher_stride, lse_ptr, rows_ptr,
                            hard_lse_ptr, labels_ptr, coefficients_ptr, n_cols, inv_temperature, beta,
                            log_student_weight, log_teacher_weight, student_scale, student_softcap, teacher_scale,
                            teacher_softcap, MODE: tl.constexpr, HARD: tl.constexpr, STUDENT_SCALED: tl.constexpr,
                            STUDENT_SOFTCAPPED: tl.constexpr, TEACHER_SCALED: tl.constexpr,
                            TEACHER_SOFTCAPPED: tl.constexpr, BLOCK: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    ptrs = student_ptr + row * student_stride + cols
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    s, slope = transformed_logits(z, student_scale, student_softcap, inv_temperature, STUDENT_SCALED,
                                  STUDENT_SOFTCAPPED)
    log_p = s - tl.load(lse_ptr + row * 2)
    p = tl.exp(log_p)
    z_t = tl.load(teacher_ptr + row * teacher_stride + cols, mask=mask, other=0.0).to(tl.float32)
    t, _ = transformed_logits(z_t, teacher_scale, teacher_softcap, inv_temperature, TEACHER_SCALED,
                              TEACHER_SOFTCAPPED)
    log_q = t - tl.load(lse_ptr + row * 2 + 1)
    c_hard = tl.load(coefficients_ptr + row * 2)
    c_soft = tl.load(coefficients_ptr + row * 2 + 1)
    if MODE == 0:
        soft = p - tl.exp(log_q)
    elif MODE == 1:
        soft = tl.where(p > 0.0, p * (log_p - log_q - tl.load(rows_ptr + row * 2)), 0.0)
    else:
        log_m = _log_mixture(log_p, log_q, log_student_weight, log_teacher_weight)
        soft = tl.where(p > 0.0, (1.0 - beta) * p * (log_p - log_m - tl.load(rows_ptr + row * 2 + 1)), 0.0)
    grad = c_soft * soft * slope
    if HARD:
        label = tl.load(labels_ptr + row)
        probability = tl.exp(z - tl.load(hard_lse_ptr + row))
        grad += c_hard * (probability - tl.where(cols == label, 1.0, 0.0))
    grad = round_to_dtype(grad, student_ptr.dtype.element_ty, ROUND_BY_HAND)
    tl.store(ptrs, grad.to(student_ptr.dtype.element_ty), mask=mask)


def _mode(beta: float) -> int:
    return FORWARD_KL if beta == 0 else REVERSE_KL if beta == 1 else MIXTURE


class GeneralizedJSDRows:
    """The closed-form ``token_fn`` of a student-teacher divergence on the chunked head engine.

    ``statistics(z_s, z_t, y=None) -> ((R, K) [hard, soft(, H)], state)`` and ``logit_grad_(z_s,
    state, dL/dq, z_t, y=None)`` on the student's and teacher's (R, V) chunks (same vocabulary):
    ``soft`` the divergence ``d`` of the module docstring, ``hard`` the cross entropy of the
    student's raw logits against ``y`` (only ``with_hard_loss``, else 0), ``H`` the student's
    entropy (only ``entropy``; no gradient flows through it). Each side's logits are transformed
    as ``cap(z * scale) / tau`` (``student`` / ``teacher``: ``(scale, softcap or None)``). Columns
    are 0 where ``y == ignore_index``; without labels every row counts. Calling the object
    computes the same columns with torch ops (differentiable in ``z_s``).
    """

    def __init__(self, beta: float, temperature: float = 1.0, ignore_index: int = -100,
                 with_hard_loss: bool = True, student: tuple[float, float | None] = (1.0, None),
                 teacher: tuple[float, float | None] = (1.0, None), entropy: bool = False):
        check_beta(beta)
        check_temperature(temperature)
        check_logit_transform(*student, "the student's logit scale", "the student's soft-cap")
        check_logit_transform(*teacher, "the teacher's logit scale", "the teacher's soft-cap")
        self.beta, self.temperature, self.ignore_index = float(beta), float(temperature), ignore_index
        self.with_hard_loss, self.entropy = with_hard_loss, entropy
        self.student = (float(student[0]), student[1])
        self.teacher = (float(teacher[0]), teacher[1])

    def _log_weights(self) -> tuple[float, float]:
        beta = self.beta
        return (math.log(1 - beta) if beta < 1 else -math.inf), (math.log(beta) if beta > 0 else -math.inf)

    def _labels(self, target: torch.Tensor | None, n_rows: int, vocab: int, device: torch.device):
        if target is None:
            return torch.ones(n_rows, dtype=torch.bool, device=device), torch.zeros(n_rows, dtype=torch.long,
                                                                                   device=device)
        target = target.reshape(-1).long()
        counted = target != self.ignore_index
        return counted, torch.where(counted & (target >= 0) & (target < vocab), target, torch.zeros_like(target))

    def __call__(self, z_s: torch.Tensor, z_t: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        counted, ids = self._labels(target, z_s.shape[0], z_s.shape[-1], z_s.device)
        log_p = transform_logits(z_s, *self.student, self.temperature).log_softmax(-1)
        log_q = transform_logits(z_t, *self.teacher, self.temperature).log_softmax(-1)
        beta = self.beta
        if beta == 0:
            soft = (log_q.exp() * (log_q - log_p)).sum(-1)
        elif beta == 1:
            soft = (log_p.exp() * (log_p - log_q)).sum(-1)
        else:
            log_m = torch.logaddexp(log_p + math.log(1 - beta), log_q + math.log(beta))
            soft = beta * (log_q.exp() * (log_q - log_m)).sum(-1) + (1 - beta) * (log_p.exp() * (log_p - log_m)).sum(-1)
        if self.with_hard_loss:
            hard = -z_s.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        else:
            hard = torch.zeros_like(soft)
        columns = [hard * counted, soft * counted]
        if self.entropy:
            columns.append((-(log_p.exp() * log_p).sum(-1) * counted).detach())
        return torch.stack(columns, dim=-1)

    def _kernel_options(self) -> dict:
        log_student_weight, log_teacher_weight = self._log_weights()
        return dict(inv_temperature=1.0 / self.temperature, beta=self.beta, log_student_weight=log_student_weight,
                    log_teacher_weight=log_teacher_weight, student_scale=self.student[0],
                    student_softcap=float(self.student[1] or 1.0), teacher_scale=self.teacher[0],
                    teacher_softcap=float(self.teacher[1] or 1.0))

    def _flags(self) -> dict:
        return dict(MODE=_mode(self.beta), **transform_flags(*self.student, "STUDENT_"),
                    **transform_flags(*self.teacher, "TEACHER_"))

    def statistics(self, z_s: torch.Tensor, z_t: torch.Tensor, target: torch.Tensor | None = None):
        if z_s.shape != z_t.shape:
            raise ValueError(f"student and teacher chunks must have one shape, got {tuple(z_s.shape)} and "
                             f"{tuple(z_t.shape)}")
        n_rows, n_cols = z_s.shape
        counted, ids = self._labels(target, n_rows, n_cols, z_s.device)
        student_stats = row_statistics(z_s, None, temperature=self.temperature, scale=self.student[0],
                                       softcap=self.student[1], entropy=self.entropy)
        teacher_stats = row_statistics(z_t, None, temperature=self.temperature, scale=self.teacher[0],
                                       softcap=self.teacher[1])
        lse = torch.stack([student_stats[:, LSE], teacher_stats[:, LSE]], dim=1).contiguous()
        rows = torch.empty((n_rows, 2), device=z_s.device, dtype=torch.float32)
        hard_lse = None
        if self.with_hard_loss:
            plain = self.temperature == 1.0 and self.student == (1.0, None)
            hard_lse = lse[:, 0].contiguous() if plain else row_statistics(z_s, None)[:, LSE].contiguous()
            label_logits = z_s.gather(1, ids.unsqueeze(1)).squeeze(1).float()
            hard = (hard_lse - label_logits) * counted
        else:
            hard = torch.zeros(n_rows, device=z_s.device)
        if n_rows:
            config = launch_config(HeadEpilogueConfig)
            launch_kernel(_divergence_rows_kernel, (n_rows,), z_s, z_s.stride(0), z_t, z_t.stride(0), lse, rows,
                          n_cols, *self._kernel_options().values(), **self._flags(),
                          BLOCK=min(config.statistics_block, next_power_of_2(n_cols)),
                          num_warps=config.statistics_warps)
        columns = [hard, rows[:, 0] * counted]
        if self.entropy:
            columns.append(student_stats[:, ENTROPY] * counted)
        return torch.stack(columns, dim=-1), (lse, rows, hard_lse, counted, ids)

    def logit_grad_(self, z_s: torch.Tensor, state, grad_q: torch.Tensor, z_t: torch.Tensor,
                    target: torch.Tensor | None = None) -> torch.Tensor:
        lse, rows, hard_lse, counted, ids = state
        n_rows, n_cols = z_s.shape
        if n_rows == 0:
            return z_s
        coefficients = (grad_q[:, :2].float() * counted.unsqueeze(-1)).contiguous()
        config = launch_config(HeadEpilogueConfig)
        block = min(config.gradient_block, next_power_of_2(n_cols))
        launch_kernel(_divergence_grad_kernel, (n_rows, cdiv(n_cols, block)), z_s, z_s.stride(0), z_t,
                      z_t.stride(0), lse, rows, hard_lse if hard_lse is not None else lse, ids, coefficients, n_cols,
                      *self._kernel_options().values(), **self._flags(), HARD=self.with_hard_loss, BLOCK=block,
                      ROUND_BY_HAND=is_interpreter(), num_warps=config.gradient_warps)
        return z_s
