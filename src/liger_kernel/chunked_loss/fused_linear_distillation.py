"""Distillation losses of a student head against a teacher head, without materialising either's logits.

Rows ``n = 1..N`` of student hidden states ``x_s`` (N, D_s) (or (B, T, D_s)) with head ``W_s`` (V, D_s)
(bias ``b_s``) and teacher hidden states ``x_t`` (N, D_t) with head ``W_t`` (V', D_t) (bias ``b_t``),
labels ``y`` (N,) (``ignore_index`` where a row does not count), temperature ``tau``::

    z_s = x_s W_s^T + b_s,   z_t = x_t W_t^T + b_t                  (per row, (V,) and (V',))
    hard_n = -log_softmax(z_s)[y_n]                                  (no temperature; 0 where ignored)
    soft_n = d(pad(z_s / tau), z_t / tau)                            (0 where ignored)
    loss = w_hard * sum_n hard_n / n_valid + w_soft * sum_n soft_n / n_valid

with ``n_valid = max(1, #{n : y_n != ignore_index})`` and ``d`` a subclass's
:meth:`LigerFusedLinearDistillationBase.distillation_loss_fn`. When the teacher's vocabulary is
larger (V' > V: the same tokenizer with a padded teacher head), the student's scaled logits are
padded with zeros up to V', as the best-known library does.

The chunked head engine (:mod:`liger_kernel.ops.chunked_head`) evaluates both heads on chunks of
rows (the teacher's under no_grad), the loss on each chunk, and accumulates the student's
gradients (input, head weight, bias); the teacher gets none.

Subclass contract (as axolotl and others use it): a staticmethod
``distillation_loss_fn(student_logits, teacher_logits, target=None, ignore_index=-100, **kwargs)``
gets float32 (R, V') / (R, V') temperature-scaled logits of a chunk of rows, the chunk's labels
(R,) and the keyword arguments (``beta`` and the forward's ``loss_kwargs``), and returns either the
per-row losses (R,) (the base zeroes the ignored rows) or the sum over the counted rows (0-d, the
hook masks); rows must not interact. A ``forward(cls, ctx, ...)`` calls
``super().forward(cls=cls, ctx=ctx, student_input=..., ...)`` (the keywords of :meth:`forward`),
and ``backward(ctx, grad_output, *args)`` returns ``LigerFusedLinearDistillationBase.backward(ctx,
grad_output, *args)[:6]`` followed by one None per further forward argument.

``compiled`` and ``chunk_size`` are accepted and ignored: the engine sizes chunks by its memory
budget (:class:`~liger_kernel.ops.chunked_head.ChunkedHeadConfig`) and compiles nothing.
"""

from __future__ import annotations

import torch

from liger_kernel.chunked_loss.fused_linear_ppo import grads_in_dtypes, one_dtype_head
from liger_kernel.ops.autograd import EagerUnderCompile, InputGradients, strictly_once_differentiable
from liger_kernel.ops.checks import check_temperature, check_tensor
from liger_kernel.ops.chunked_head import (
    chunked_head_loss_and_grads,
    save_head_grads,
    scaled_head_grads,
    upstream_loss_gradient,
)
from liger_kernel.ops.loss_checks import start_target_check


def _as_groups(t: torch.Tensor, name: str) -> torch.Tensor:
    """(N, D) or (B, T, D) hidden states as (N, 1, D): one engine group per row, so chunks hold any number of rows."""
    if t.dim() == 3:
        t = t.reshape(-1, t.shape[-1])
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (tokens, hidden) or 3-D (batch, seq_len, hidden), got {tuple(t.shape)}")
    return t.unsqueeze(1)


def distillation_token_fn(loss_fn, temperature, ignore_index, student_vocab, teacher_vocab, compute_ce_loss,
                          loss_kwargs):
    """``token_fn(z_s, z_t, y) -> (R, 2)``: per row the hard loss and the soft loss (see the module docstring).

    A 0-d chunk sum from ``loss_fn`` is carried as that sum spread evenly over the chunk's rows:
    the losses only ever add the column up, and each chunk is one-pass (every group is one row).
    """

    def token_fn(z_s, z_t, target):
        target = target.reshape(-1)
        counted = target != ignore_index
        rows = z_s.shape[0]
        if compute_ce_loss:
            # Out-of-range labels read token 0 (the range check raises once the chunks are queued).
            inside = counted & (target >= 0) & (target < student_vocab)
            ids = torch.where(inside, target, torch.zeros_like(target)).long().unsqueeze(-1)
            hard = -z_s.log_softmax(-1).gather(-1, ids).squeeze(-1) * counted
        else:
            hard = z_s.new_zeros(rows)
        s = z_s / temperature
        if teacher_vocab > student_vocab:
            s = torch.cat([s, s.new_zeros(rows, teacher_vocab - student_vocab)], dim=-1)
        soft = loss_fn(s, z_t / temperature, target=target, ignore_index=ignore_index, **loss_kwargs)
        if soft.dim() == 0:
            soft = soft.expand(rows) / max(rows, 1)
        elif soft.shape == (rows,):
            soft = soft * counted
        else:
            raise ValueError(f"distillation_loss_fn must return a 0-d sum or ({rows},) per-row losses, "
                             f"got {tuple(soft.shape)}")
        return torch.stack([hard, soft.float()], dim=-1)

    return token_fn


class LigerFusedLinearDistillationBase(EagerUnderCompile, torch.autograd.Function):
    """Base of the fused-head distillation losses; see the module docstring."""

    @staticmethod
    def distillation_loss_fn(student_logits, teacher_logits, target=None, ignore_index=-100, **kwargs):
        raise NotImplementedError("a LigerFusedLinearDistillationBase subclass must define distillation_loss_fn")

    @classmethod
    def closed_form_token_fn(cls, temperature, ignore_index, student_vocab, teacher_vocab, compute_ce_loss,
                             loss_kwargs):
        """A ``token_fn`` with the engine's closed-form path computing what ``distillation_token_fn``
        computes for these options, or None (autograd through ``distillation_loss_fn``)."""
        return None

    @staticmethod
    def forward(cls, ctx, student_input, student_weight, teacher_input, teacher_weight, target, student_bias=None,
                teacher_bias=None, chunk_size=1024, ignore_index=-100, weight_hard_loss=0.5, weight_soft_loss=0.5,
                beta=0.5, compute_ce_loss=True, temperature=1.0, compiled=True, return_soft_hard_loss=False,
                accum_dtype=None, **loss_kwargs):
        """``loss`` (0-d float32), or ``(loss, soft_loss, hard_loss)`` with ``return_soft_hard_loss``.

        Shapes: ``student_input`` (N, D_s) or (B, T, D_s), ``student_weight`` (V, D_s),
        ``teacher_input`` likewise with D_t, ``teacher_weight`` (V', D_t) with V' >= V, ``target``
        (N,) or (B, T). Hidden states and a head of different dtypes compute in the wider one.
        Gradients (kept for :meth:`backward`) flow to the student's input, weight and bias;
        ``accum_dtype=torch.float32`` accumulates the weight gradient over chunks in float32.
        """
        check_temperature(temperature)
        x_s = _as_groups(student_input, "student_input")
        x_t = _as_groups(teacher_input, "teacher_input")
        check_tensor(target, "target")
        if target.numel() != x_s.shape[0] or target.dtype.is_floating_point:
            raise ValueError(f"target must hold {x_s.shape[0]} integer labels, got {tuple(target.shape)} "
                             f"{target.dtype}")
        target = target.reshape(-1, 1)
        student_vocab, teacher_vocab = student_weight.shape[0], teacher_weight.shape[0]
        if teacher_vocab < student_vocab:
            raise ValueError(f"the teacher's vocabulary ({teacher_vocab}) is smaller than the student's ({student_vocab})")
        counted = target != ignore_index
        # Awaited after the chunk loop is queued (no host sync before it); a bad label reads token 0.
        flat_target = target.reshape(-1).long()
        target_check = start_target_check(flat_target, flat_target.shape[0], student_vocab, ignore_index,
                                          "target labels") \
            if compute_ce_loss else None
        n_valid = counted.sum().clamp(min=1).float()
        loss_kwargs = dict(loss_kwargs, beta=beta)
        # The cross-entropy costs a second log-softmax of every chunk: skipped when nothing reads it.
        ce_needed = compute_ce_loss and (weight_hard_loss != 0 or return_soft_hard_loss)
        token_fn = cls.closed_form_token_fn(temperature, ignore_index, student_vocab, teacher_vocab, ce_needed,
                                            loss_kwargs)
        if token_fn is None:
            token_fn = distillation_token_fn(cls.distillation_loss_fn, temperature, ignore_index, student_vocab,
                                             teacher_vocab, ce_needed, loss_kwargs)

        def group_fn(q, q_ref):
            hard = q[..., 0].sum() / n_valid
            soft = q[..., 1].sum() / n_valid
            return weight_hard_loss * hard + weight_soft_loss * soft, (soft.detach(), hard.detach())

        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                 student_bias is not None and bool(ctx.needs_input_grad[5]))
        teacher = one_dtype_head(x_t, teacher_weight, teacher_bias)
        loss, (soft, hard), grads = chunked_head_loss_and_grads(
            *one_dtype_head(x_s, student_weight, student_bias), token_fn, group_fn, token_args=(target,),
            ref_x=teacher[0], ref_weight=teacher[1], ref_bias=teacher[2], needs=needs, ref_logits_to_token_fn=True,
            accum_fp32=accum_dtype == torch.float32)
        if target_check is not None:
            target_check.wait()
        grads = grads_in_dtypes(grads, x_s, student_weight, student_bias)
        if grads.x is not None:
            grads.x = grads.x.view(student_input.shape)
        save_head_grads(ctx, grads)
        if return_soft_hard_loss:
            ctx.mark_non_differentiable(soft, hard)
            return loss, soft, hard
        return loss

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_output, *args):
        """(d_student_input, d_student_weight, None, None, None, d_student_bias) scaled by the upstream gradient."""
        grad_x, grad_w, grad_b = scaled_head_grads(ctx, upstream_loss_gradient((grad_output,)))
        return grad_x, grad_w, None, None, None, grad_b


class LabelledDistillationFunction(LigerFusedLinearDistillationBase):
    """The argument order of the library's distillation Functions: ``apply(student_input, student_weight,
    teacher_input, teacher_weight, true_labels, student_bias=None, teacher_bias=None, weight_hard_loss=0.5,
    weight_soft_loss=0.5, beta=0.5, ignore_index=-100, temperature=1.0, compiled=True, chunk_size=1024,
    return_soft_hard_loss=False)``. A subclass defines ``distillation_loss_fn`` (and ``check_options``)."""

    @staticmethod
    def check_options(beta: float) -> None:
        """Raise on a ``beta`` the subclass's loss does not define."""

    @classmethod
    def forward(cls, ctx, student_input, student_weight, teacher_input, teacher_weight, true_labels,
                student_bias=None, teacher_bias=None, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5,
                ignore_index=-100, temperature=1.0, compiled=True, chunk_size=1024, return_soft_hard_loss=False):
        cls.check_options(beta)
        return LigerFusedLinearDistillationBase.forward(
            cls, ctx, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias,
            teacher_bias, chunk_size=chunk_size, ignore_index=ignore_index, weight_hard_loss=weight_hard_loss,
            weight_soft_loss=weight_soft_loss, beta=beta, temperature=temperature, compiled=compiled,
            return_soft_hard_loss=return_soft_hard_loss)

    @staticmethod
    def backward(ctx, grad_output, *args):
        grad_input, grad_weight, *_, grad_bias = LigerFusedLinearDistillationBase.backward(ctx, grad_output, *args)[:6]
        return _LABELLED_GRADS(student_input=grad_input, student_weight=grad_weight, student_bias=grad_bias)


_LABELLED_GRADS = InputGradients(LabelledDistillationFunction.forward)


class LabelledDistillationLoss(torch.nn.Module):
    """nn.Module over a :class:`LabelledDistillationFunction` (class attribute ``function``).

    ``__init__(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, ignore_index=-100, temperature=1.0,
    compiled=True, chunk_size=1024, return_soft_hard_loss=False)``; ``forward(student_input, student_weight,
    teacher_input, teacher_weight, true_labels, student_bias=None, teacher_bias=None)``.
    """

    function: type[LabelledDistillationFunction]

    def __init__(self, weight_hard_loss: float = 0.5, weight_soft_loss: float = 0.5, beta: float = 0.5,
                 ignore_index: int = -100, temperature: float = 1.0, compiled: bool = True, chunk_size: int = 1024,
                 return_soft_hard_loss: bool = False):
        super().__init__()
        self.function.check_options(beta)
        check_temperature(temperature)
        self.weight_hard_loss, self.weight_soft_loss, self.beta = weight_hard_loss, weight_soft_loss, beta
        self.ignore_index, self.temperature, self.compiled = ignore_index, temperature, compiled
        self.chunk_size, self.return_soft_hard_loss = chunk_size, return_soft_hard_loss

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
                teacher_bias=None):
        return self.function.apply(
            student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
            self.weight_hard_loss, self.weight_soft_loss, self.beta, self.ignore_index, self.temperature,
            self.compiled, self.chunk_size, self.return_soft_hard_loss)
