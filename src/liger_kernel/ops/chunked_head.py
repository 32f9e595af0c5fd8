"""Losses of a linear head's output, computed chunk by chunk without materialising the logits.

The engine behind :mod:`liger_kernel.chunked_loss`: preference (DPO, ORPO, SimPO, CPO, KTO),
RL and distillation losses all read a (tokens x vocabulary) head the same way, so they share
this one loop, which keeps at most one chunk of logits alive, as the fused linear cross entropy
(:mod:`liger_kernel.ops.fused_linear_cross_entropy`) does for supervised training.

Contract
--------
Inputs: hidden states ``x`` (B, T, D) of B groups (sequences) of T positions, a head
``W`` (V, D) and optional bias ``b`` (V,); logits ``Z = x W^T + b`` (B, T, V). A loss is
given as two functions:

* ``token_fn(z, *token_args) -> q``: per-row quantities ``q`` (R, K) float32 of logit rows
  ``z`` (R, V) float32 (e.g. the log-probability of the target, an entropy, a row sum), with
  ``token_args`` tensors (B, T, ...) sliced to the same R rows (flattened to (R, ...)).
  Differentiable in ``z``; rows must not interact (row r of ``q`` depends on row r of ``z``).
* ``group_fn(q, q_ref, *group_args) -> (loss, metrics)``: ``q`` (G, T, K) of G whole groups,
  upcast to float64 (the sequence-level math costs nothing next to the logits, and float64
  keeps cancellations such as ``1 - sigmoid(9)`` from eating float32 digits), ``q_ref`` the
  same quantities of the second head or None, ``group_args`` tensors (B, ...) sliced to the
  same groups. ``loss`` is a 0-d tensor, differentiable in ``q``, returned as
  float32; ``metrics`` a tuple of tensors (detached, float64 ones cast to float32, on return).

The loss is ``L = group_fn(token_fn(Z))`` over the whole batch. By the chain rule, with
``G = dL/dZ`` (B*T, V) (exact: ``c = dL/dq`` by autograd through ``group_fn``, then pulled
back through ``token_fn`` chunk by chunk)::

    dL/dx = G W          (B*T, D)
    dL/dW = G^T x        (V, D)
    dL/db = sum_rows G   (V,)

``group_fn`` is *additive* when it is a sum over groups: calling it on any split of the batch
into whole groups and adding the losses gives the loss of the whole batch (normalisers such as
"divide by the number of pairs" or "by the batch's token count" are computed from the whole
batch beforehand and closed over), 0-d metrics add up the same way, and every metric with a
leading dimension has one entry per group (per pair when ``paired``) in group order. Such a
loss runs in **one pass**: each chunk of whole groups computes its logits (in the input dtype,
fp32 accumulation), upcasts them to float32, evaluates ``token_fn`` and ``group_fn``, forms
its ``G``, then writes its ``dx`` rows (``G W``) and accumulates ``dW += G^T x`` and
``db += sum G``. When one group's rows exceed the chunk (long sequences), or
the loss is not additive (e.g. it sorts over the batch), the engine runs **two passes** over
row chunks that need not respect groups: the first computes ``q`` (and ``q_ref``) under
no_grad; ``group_fn`` then runs once on the whole batch (B, T, K) and autograd gives
``dL/dq``; the second pass recomputes each chunk's logits and pulls ``dL/dq`` back through
``token_fn`` (a vector-Jacobian product per chunk; a closed form reuses the first pass's row
statistics, so its second pass only writes the gradient). It costs one more logits GEMM and is
exact for every loss of this form.

``paired=True`` is for preference pairs: the first B/2 groups are the chosen sequences and the
second B/2 the rejected ones, group i pairing with group i + B/2. A chunk then holds whole
pairs, and ``group_fn`` sees (2c, T, K) with its c chosen groups first, the same layout as the
whole batch, so its code does not depend on the chunking.

An optional second head (a reference model or a teacher: ``ref_x`` (B, T, D), ``ref_weight``
(V', D'), ``ref_bias``) is evaluated on the same chunk rows under no_grad and its
``token_fn`` quantities are handed to ``group_fn`` as ``q_ref``. Losses that compare the two
distributions row by row (distillation: JSD, KL) set ``ref_logits_to_token_fn``: ``token_fn``
is then called as ``token_fn(z, z_ref, *token_args)`` with the second head's float32 logits
rows ``z_ref`` (R, V') (no gradient flows to them) and ``q_ref`` is None.

Each chunk's ``G`` is formed through ``c = dL/dq`` (autograd on the small (G, T, K) tensor),
then pulled back through ``token_fn``: by autograd on a float32 copy of the chunk, or, for a
``token_fn`` with the closed-form protocol of
:class:`~liger_kernel.ops.head_epilogue.LogitRowStatistics` (``statistics(z, *args) -> (q,
state)``, ``logit_grad_(z, state, c, *args) -> G``; :func:`target_log_probs`, the label
log-probabilities every preference and RL loss reads), by two Triton passes over the chunk in
the GEMM's dtype: one for the row statistics, one writing ``G`` over the logits. A chunk then
holds that one (C, V) buffer, which the two gradient GEMMs read directly. Per chunk the work
is three GEMMs (the floor) plus about three passes over the chunk's memory.

Chunk size: :class:`ChunkedHeadConfig`, from the budget every head-bound loss shares
(:mod:`liger_kernel.ops.head_chunking`: a fraction of the dW + dX bytes), counting the bytes a
logit costs on the chunk's path (the element size on the closed-form path; 12 bytes under
autograd: the upcast logits, a log-softmax and the gradient); a one-pass chunk holds the number
of whole units nearest that budget, up to a third over it. Gradients are computed in the
forward pass for a unit upstream gradient; backward only scales them
(:mod:`liger_kernel.ops.scaling`).

Precision: logits are one GEMM in the input dtype with float32 accumulation (as an HF model's
``lm_head``), every statistic after is float32; ``G`` is rounded to the input dtype for the two
gradient GEMMs, and dW accumulates over chunks in the weight dtype unless ``accum_fp32``.
Under ``torch.autocast`` both heads run in the autocast dtype (as ``F.linear`` would) and the
gradients are returned in the operands' own dtypes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import overload

import torch

from liger_kernel.ops.autograd import EagerUnderCompile, InputGradients, strictly_once_differentiable
from liger_kernel.ops.checks import check_linear_operands, check_tensor
from liger_kernel.ops.config import LaunchConfig, launch_config
from liger_kernel.ops.head_chunking import (
    ChunkPlan,
    Ranges,
    accumulate_grad_weight,
    budget_rows,
    chunk_plan,
    gemm_reduction_precision,
    grad_input_rows,
    gradient_bytes,
)
from liger_kernel.ops.head_epilogue import LogitRowStatistics
from liger_kernel.ops.launch import is_interpreter
from liger_kernel.ops.scaling import scale_gradient

TokenFn = Callable[..., torch.Tensor]
GroupFn = Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]]

# Bytes per logit a chunk holds when ``token_fn`` is differentiated by autograd: the float32
# logits, autograd's saved log-softmax and the float32 gradient.
AUTOGRAD_BYTES_PER_LOGIT = 12


@dataclasses.dataclass(frozen=True)
class ChunkedHeadConfig(LaunchConfig):
    """The rows of logits a chunk holds: ``chunk_rows`` from the memory budget (:func:`chunk_plan`
    balances the chunks under it). In one-pass mode a chunk holds whole units (groups, or pairs
    of groups), as many as come nearest to ``chunk_rows``, never more than ``unit_overshoot``
    times it: a budget of 1.6 pairs then takes two pairs a chunk rather than one (half the dW
    re-reads, fuller GEMMs), and a unit up to a third over the budget still runs in one pass
    (two passes cost a third more GEMM work). At the default budget (three quarters of the
    gradients' bytes) the chunk then stays within the gradients' bytes, the peak within twice them.

    ``keep_forward_logits``: a per-token op whose backward recomputes its forward's chunks
    (log-probabilities, per-token divergences: :func:`per_token_chunks`) keeps the logits of its
    leading chunks from forward to backward, as many rows as one chunk's budget. The backward
    reads them instead of recomputing them (one logits GEMM less per kept chunk) and frees each
    once used, before any recomputed chunk is allocated, so its peak is where one recomputed
    chunk would put it; at most one chunk's budget is held between the two passes."""

    chunk_rows: int
    unit_overshoot: float = 4 / 3
    keep_forward_logits: bool = True

    def __post_init__(self):
        if not self.unit_overshoot >= 1.0:
            raise ValueError(f"ChunkedHeadConfig.unit_overshoot must be >= 1, got {self.unit_overshoot!r}")

    @classmethod
    def heuristic(cls, n_rows: int, n_cols: int, floor_bytes: int, bytes_per_logit: int = 4) -> ChunkedHeadConfig:
        return cls(chunk_rows=min(max(1, n_rows), budget_rows(n_cols, bytes_per_logit, floor_bytes)))


def engine_chunk_config(x: torch.Tensor, weight: torch.Tensor, needs: Sequence[bool], closed_form: bool,
                        beside: torch.Tensor | None = None) -> ChunkedHeadConfig:
    """The engine's chunk configuration for hidden states ``x`` (..., D) through ``weight`` (V, D)
    producing the gradients ``needs`` says: each logit costs its element size on the closed-form
    path (12 bytes under autograd), plus, where ``token_fn`` reads a second head's logits
    ``beside`` the chunk, that head's element size (4 bytes, float32, under autograd)."""
    bytes_per_logit = x.element_size() if closed_form else AUTOGRAD_BYTES_PER_LOGIT
    if beside is not None:
        bytes_per_logit += beside.element_size() if closed_form else 4
    n_rows = x.numel() // max(1, x.shape[-1])
    floor_bytes = gradient_bytes(x, weight, bool(needs[0]), bool(needs[1]))
    config = launch_config(ChunkedHeadConfig, n_rows, weight.shape[0], floor_bytes, bytes_per_logit)
    if config.chunk_rows < 1:
        raise ValueError(f"ChunkedHeadConfig.chunk_rows must be >= 1, got {config.chunk_rows}")
    return config


@dataclasses.dataclass(frozen=True)
class PerTokenChunks:
    """The chunks of a per-token op (every row a group of its own): ``row_ranges`` of 2-D ``x``
    (N, D), those the engine's backward uses, and ``n_kept``, how many leading ones the forward
    keeps the logits of (:attr:`ChunkedHeadConfig.keep_forward_logits`), under ``config``, which the
    backward passes to the engine (``chunk_config``): launch-config overrides are context variables,
    and a backward may run outside the forward's block or, on CUDA, in autograd's device thread."""

    row_ranges: tuple[tuple[int, int], ...]
    n_kept: int
    config: ChunkedHeadConfig


def per_token_chunks(x: torch.Tensor, weight: torch.Tensor, needs: Sequence[bool],
                     beside: torch.Tensor | None = None) -> PerTokenChunks:
    """The chunks the engine uses for a closed-form ``token_fn`` with every row a group of its own
    (per-token outputs), so that a forward pass outside the engine computes exactly the logits
    its backward recomputes, and which of them it keeps (none where no gradient is needed)."""
    config = engine_chunk_config(x, weight, needs, True, beside)
    ranges = tuple(r for (r,) in chunk_plan(x.shape[0], 1, False, True, config.chunk_rows).row_ranges)
    n_kept, kept_rows = 0, 0
    if config.keep_forward_logits and any(needs):
        for a, b in ranges:
            if kept_rows + b - a > config.chunk_rows:
                break
            n_kept, kept_rows = n_kept + 1, kept_rows + b - a
    return PerTokenChunks(ranges, n_kept, config)


def target_log_probs(ignore_index: int, temperature: float = 1.0, log_sum_sq_probs: bool = False) -> LogitRowStatistics:
    """The ``token_fn`` every preference loss reads: per row, the log-probabilities of its labels
    at ``temperature`` (0 where a label is ``ignore_index``), [``log sum_v p_v^2``], and the row
    sum of the logits, as float32 columns in that order (:class:`LogitRowStatistics`)."""
    return LogitRowStatistics(ignore_index, temperature, log_sum_sq_probs=log_sum_sq_probs, row_sum=True)


@dataclasses.dataclass
class HeadGrads:
    """Gradients for a unit upstream gradient; None where not asked for."""

    x: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


# --------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------


def autocast_operands(*tensors: torch.Tensor | None) -> tuple:
    """The floating tensors cast to the autocast dtype where autocast is on for their device
    (what ``F.linear`` would multiply), others unchanged."""
    first = next((t for t in tensors if t is not None), None)
    if first is None or not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def _check_sides(x, paired, token_args, group_args, ref_x, ref_weight, ref_bias) -> torch.Tensor | None:
    """Check the engine's side tensors and second head against ``x`` (B, T, D); returns ``ref_x``
    contiguous."""
    n_groups, seq_len, _ = x.shape
    if paired and n_groups % 2:
        raise ValueError(f"paired losses need an even batch (chosen then rejected), got batch {n_groups}")
    _check_side(token_args, (n_groups, seq_len), x.device, "token_args")
    _check_side(group_args, (n_groups,), x.device, "group_args")
    if (ref_weight is None) != (ref_x is None):
        raise ValueError("the second head needs both ref_input and ref_weight")
    if ref_weight is not None:
        check_linear_operands(ref_x, ref_weight, ref_bias, "ref_input", "ref_weight", "ref_bias", x_dims=3,
                              autocast_casts=True)
        if ref_x.shape[:2] != x.shape[:2]:
            raise ValueError(f"ref_input has shape {tuple(ref_x.shape)}; it must start with {(n_groups, seq_len)}")
        ref_x = ref_x.contiguous()
    return ref_x


def _check_side(tensors: Sequence[torch.Tensor], leading: tuple[int, ...], device: torch.device, what: str) -> None:
    for i, t in enumerate(tensors):
        check_tensor(t, f"{what}[{i}]")
        if tuple(t.shape[: len(leading)]) != leading:
            raise ValueError(f"{what}[{i}] has shape {tuple(t.shape)}; it must start with {leading}")
        if t.device != device:
            raise ValueError(f"{what}[{i}] is on {t.device}, the inputs on {device}")


# --------------------------------------------------------------------------------------
# The chunk loop
# --------------------------------------------------------------------------------------


def _logits(x_rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` in the input dtype (one GEMM, fp32 accumulation)."""
    if bias is None:
        return torch.matmul(x_rows, weight.t())
    return torch.addmm(bias, x_rows, weight.t())


def _gather(t: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """The slices ``t[a:b]`` for ``(a, b)`` in ``ranges``, concatenated (a view for one range)."""
    if len(ranges) == 1:
        return t[ranges[0][0]: ranges[0][1]]
    return torch.cat([t[a:b] for a, b in ranges])


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(G, T, ...) -> (G*T, ...)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


@overload
def _as_float64(q: torch.Tensor) -> torch.Tensor: ...
@overload
def _as_float64(q: None) -> None: ...
def _as_float64(q: torch.Tensor | None) -> torch.Tensor | None:
    # Sequence-level math runs on (G, T, K) tensors, negligible next to the logits: float64
    # there keeps cancellations such as 1 - sigmoid(9) (KTO, APO) from costing float32 digits.
    return q.double() if q is not None else None


def _as_float32(m: torch.Tensor) -> torch.Tensor:
    return m.float() if m.dtype == torch.float64 else m


def _chunk_logit_grad(loss: torch.Tensor, logits: torch.Tensor, outputs_grad: torch.Tensor | None = None):
    """``d loss / d logits`` (zeros where the loss does not depend on them)."""
    if not loss.requires_grad:
        return torch.zeros_like(logits)
    (grad,) = torch.autograd.grad(loss, logits, grad_outputs=outputs_grad, allow_unused=True)
    return torch.zeros_like(logits) if grad is None else grad


class _GradAccumulator:
    """dX rows written, dW and db accumulated, from each chunk's float32 logit gradient."""

    def __init__(self, x, weight, bias, needs, accum_fp32):
        need_x, need_w, need_b = needs
        self.x_dtype = x.dtype
        self.weight = weight
        self.grad_x = torch.empty_like(x) if need_x else None
        self.grad_w = None
        # The first chunk writes dW outright (no zero fill, no read) where the dtypes allow.
        self.grad_w_unwritten = False
        if need_w:
            accum_dtype = torch.float32 if accum_fp32 else weight.dtype
            self.grad_w_unwritten = accum_dtype == weight.dtype
            allocate = torch.empty if self.grad_w_unwritten else torch.zeros
            self.grad_w = allocate(weight.shape, device=weight.device, dtype=accum_dtype)
        self.grad_b = torch.zeros(weight.shape[0], device=x.device, dtype=torch.float32) \
            if (need_b and bias is not None) else None

    def add(self, grad_box: list[torch.Tensor], x_rows: torch.Tensor, write_x: Callable[[torch.Tensor], None]):
        """Consume a chunk's float32 logit gradient, handed over as ``[grad]`` so that it can be
        freed once rounded to the input dtype (before the two GEMMs)."""
        grad_logits = grad_box.pop()
        if self.grad_b is not None:
            self.grad_b.add_(grad_logits.sum(0, dtype=torch.float32))
        g = grad_logits.to(self.x_dtype)
        del grad_logits
        if self.grad_x is not None:
            write_x(grad_input_rows(g, self.weight))
        if self.grad_w is not None:
            accumulate_grad_weight(self.grad_w, g, x_rows, first=self.grad_w_unwritten)
            self.grad_w_unwritten = False

    def result(self, bias) -> HeadGrads:
        grad_w = self.grad_w
        if grad_w is not None and self.grad_w_unwritten:  # no rows
            grad_w.zero_()
        if grad_w is not None and grad_w.dtype != self.weight.dtype:
            grad_w = grad_w.to(self.weight.dtype)
        grad_b = self.grad_b.to(bias.dtype) if self.grad_b is not None else None
        return HeadGrads(self.grad_x, grad_w, grad_b)


def _merge_metrics(per_chunk: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """0-d metrics add up over chunks; others are concatenated along their first dimension."""
    if not per_chunk:
        return ()
    merged = []
    for values in zip(*per_chunk):
        if values[0].dim() == 0:
            merged.append(torch.stack(values).sum(0))
        else:
            merged.append(torch.cat(values))
    return tuple(merged)


def chunked_head_loss_and_grads(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_fn: TokenFn,
    group_fn: GroupFn,
    token_args: Sequence[torch.Tensor] = (),
    group_args: Sequence[torch.Tensor] = (),
    ref_x: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    paired: bool = False,
    additive: bool = True,
    needs: tuple[bool, bool, bool] = (True, True, True),
    accum_fp32: bool = False,
    ref_logits_to_token_fn: bool = False,
    kept_logits: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    chunk_config: ChunkedHeadConfig | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], HeadGrads]:
    """The loss, its metrics and (dx, dW, db) for a unit upstream gradient (see the module docstring).

    ``needs`` says which of (dx, dW, db) to compute. Arguments are checked. Under
    ``torch.autocast`` the heads' operands are cast to the autocast dtype first (as ``F.linear``
    would be) and the gradients cast back to the operands' own dtypes.

    ``kept_logits``: the logits of the leading one-pass chunks as a forward pass outside the
    engine computed them on the same chunks (:func:`per_token_chunks`), one ``(z, z_ref)`` a chunk
    (``z_ref`` the second head's logits where ``token_fn`` reads them, else None). The engine
    uses them instead of recomputing those chunks and takes each out of the list as it goes, so
    a chunk's buffer is freed once its gradient is consumed; the closed form overwrites it.
    ``chunk_config``: the chunks' configuration (default: from the budget, :func:`engine_chunk_config`);
    a backward pass passes its forward's (:attr:`PerTokenChunks.config`), which holds whatever
    launch-config overrides the forward ran under.
    """
    original_dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
    x, weight, bias, ref_x, ref_weight, ref_bias = autocast_operands(x, weight, bias, ref_x, ref_weight, ref_bias)
    check_linear_operands(x, weight, bias, "_input", x_dims=3, autocast_casts=True)
    n_groups, seq_len, _ = x.shape
    ref_x = _check_sides(x, paired, token_args, group_args, ref_x, ref_weight, ref_bias)
    x = x.contiguous()
    n_rows, n_cols = n_groups * seq_len, weight.shape[0]
    closed_form = _in_place(token_fn)
    beside = ref_x if ref_logits_to_token_fn and ref_weight is not None else None
    config = chunk_config or engine_chunk_config(x, weight, needs, closed_form, beside)
    grads = _GradAccumulator(x, weight, bias, needs, accum_fp32)
    plan = chunk_plan(n_groups, seq_len, paired, additive, config.chunk_rows, config.unit_overshoot)
    rows = _Rows(x, weight, bias, token_args, ref_x, ref_weight, ref_bias, ref_logits_to_token_fn, closed_form)
    rows.kept = _checked_kept(kept_logits, plan)
    with torch.autocast(device_type=x.device.type, enabled=False), gemm_reduction_precision():
        if n_rows == 0:
            empty = torch.zeros((0, n_cols), device=x.device)
            q = token_fn(empty, *rows.token_fn_ref_args(()), *rows.token_args)
            q = _as_float64(q.reshape(n_groups, seq_len, q.shape[-1]))
            q_ref = q.clone() if ref_weight is not None and not ref_logits_to_token_fn else None
            loss, metrics = group_fn(q, q_ref, *group_args)
        elif plan.one_pass:
            loss, metrics = _one_pass(rows, plan, token_fn, group_fn, group_args, seq_len, grads)
        else:
            loss, metrics = _two_passes(rows, plan, token_fn, group_fn, group_args, (n_groups, seq_len), grads)
    result = grads.result(bias)
    for name, dtype in zip(("x", "weight", "bias"), original_dtypes):
        grad = getattr(result, name)
        if grad is not None and grad.dtype != dtype:
            setattr(result, name, grad.to(dtype))
    loss = loss.detach()
    # Cast only when needed: a no-op ``.float()`` returns its input object, and a tensor the
    # Function's traced forward returns must not be another traced op's result too (torch
    # 2.11's Dynamo then routes its gradient to another output slot: zero gradients).
    if loss.dtype != torch.float32:
        loss = loss.float()
    return loss, tuple(_as_float32(m.detach()) for m in metrics), result


def _checked_kept(kept_logits: list | None, plan: ChunkPlan) -> list:
    """``kept_logits`` (the list itself: the engine takes its chunks out of it), if the plan's
    leading one-pass chunks can be those chunks."""
    if not kept_logits:
        return []
    if not plan.one_pass or len(kept_logits) > len(plan.row_ranges):
        raise ValueError(f"{len(kept_logits)} kept chunks of logits for a plan of {len(plan.row_ranges)} "
                         f"{'one-pass' if plan.one_pass else 'two-pass'} chunks")
    return kept_logits


class _Rows:
    """The batch as (B*T)-row matrices, and per chunk its logits, its second head's quantities
    and its side tensors."""

    def __init__(self, x, weight, bias, token_args, ref_x, ref_weight, ref_bias, ref_logits_to_token_fn,
                 closed_form):
        self.x, self.weight, self.bias = _rows(x), weight, bias
        self.closed_form = closed_form
        self.token_args = [_rows(t) for t in token_args]
        self.ref_x = _rows(ref_x) if ref_weight is not None else None
        self.ref_weight, self.ref_bias = ref_weight, ref_bias
        self.ref_logits_to_token_fn = ref_logits_to_token_fn and ref_weight is not None
        self.kept: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def chunk_logits(self, ranges: Ranges, x_rows: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """A one-pass chunk's logits and ``token_fn``'s second-head arguments: the next kept chunk's
        (taken out of the list, so that it is freed once used), else computed."""
        if not self.kept:
            return self.logits(ranges, x_rows), self.token_fn_ref_args(ranges)
        logits, ref_logits = self.kept.pop(0)
        expected = (x_rows.shape[0], self.weight.shape[0])
        if tuple(logits.shape) != expected or logits.dtype != x_rows.dtype:
            raise ValueError(f"kept logits of shape {tuple(logits.shape)} ({logits.dtype}) for a chunk of "
                             f"{expected} ({x_rows.dtype})")
        if not self.ref_logits_to_token_fn:
            return logits, ()
        if ref_logits is None or ref_logits.shape[0] != expected[0]:
            raise ValueError("kept logits lack the second head's rows that token_fn reads")
        return logits, (ref_logits if self.closed_form else ref_logits.float(),)

    def ref_logits(self, ranges: Ranges) -> torch.Tensor:
        with torch.no_grad():
            return _logits(_gather(self.ref_x, ranges), self.ref_weight, self.ref_bias)

    def token_fn_ref_args(self, ranges: Ranges) -> tuple:
        """``(ref_logits,)`` where ``token_fn`` takes the second head's logits, else ``()``."""
        if not self.ref_logits_to_token_fn:
            return ()
        if not ranges:  # empty batch
            return (self.x.new_zeros((0, self.ref_weight.shape[0]), dtype=torch.float32),)
        logits = self.ref_logits(ranges)
        return (logits if self.closed_form else logits.float(),)

    def logits(self, ranges: Ranges, x_rows: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            return _logits(_gather(self.x, ranges) if x_rows is None else x_rows, self.weight, self.bias)

    def ref_quantities(self, ranges: Ranges, token_fn: TokenFn, targs) -> torch.Tensor | None:
        """The second head's ``token_fn`` quantities (None without one, or where ``token_fn`` takes its logits)."""
        if self.ref_weight is None or self.ref_logits_to_token_fn:
            return None
        return _quantities(token_fn, self.ref_logits(ranges), targs)

    def write_grad_x(self, grads: _GradAccumulator, ranges: Ranges):
        def write(dx_rows: torch.Tensor) -> None:
            flat = grads.grad_x.view(self.x.shape)
            offset = 0
            for a, b in ranges:
                flat[a:b] = dx_rows[offset: offset + b - a]
                offset += b - a
        return write


def _in_place(token_fn) -> bool:
    """Whether ``token_fn`` has the closed-form path (:class:`LogitRowStatistics`'s protocol):
    ``statistics(z, *args) -> (q, state)`` leaving ``z`` intact, then ``logit_grad_(z, state,
    dL/dq, *args)`` writing ``dL/dz`` over ``z``, both on the chunk in the GEMM's dtype."""
    return hasattr(token_fn, "statistics") and hasattr(token_fn, "logit_grad_")


def _quantities(token_fn, logits: torch.Tensor, extra_args) -> torch.Tensor:
    """``token_fn``'s quantities without gradient."""
    with torch.no_grad():
        if _in_place(token_fn):
            return token_fn.statistics(logits, *extra_args)[0]
        return token_fn(logits.float(), *extra_args)


def _chunk_forward(token_fn, logits, extra_args) -> tuple[torch.Tensor, object, torch.Tensor]:
    """``(q, state, logits)`` of a chunk, what :func:`_chunk_backward` pulls ``dL/dq`` back through:
    the closed form's ``statistics`` over the chunk's logits (left intact), or ``token_fn`` on a
    float32 copy recorded by autograd (``state`` None)."""
    if _in_place(token_fn):
        with torch.no_grad():
            q, state = token_fn.statistics(logits, *extra_args)
        return q, state, logits
    logits = logits.float()
    with torch.enable_grad():
        logits.requires_grad_(True)
        return token_fn(logits, *extra_args), None, logits


def _chunk_backward(token_fn, forward, extra_args, grad_q) -> torch.Tensor:
    """``dL/dz`` of a chunk from its :func:`_chunk_forward` and ``dL/dq`` (the closed form
    overwrites the chunk's logits with it)."""
    q, state, logits = forward
    if _in_place(token_fn):
        with torch.no_grad():
            return token_fn.logit_grad_(logits, state, grad_q, *extra_args)
    with torch.enable_grad():
        return _chunk_logit_grad(q, logits, grad_q)


def _pull_back(token_fn, logits, extra_args, grad_q) -> torch.Tensor:
    """``dL/dz`` of a chunk from its fresh logits and ``dL/dq``."""
    return _chunk_backward(token_fn, _chunk_forward(token_fn, logits, extra_args), extra_args, grad_q)


def _chunk_grad_via_q(token_fn, logits, extra_args, loss_of_q):
    """A chunk's logit gradient through ``dL/dq``: ``loss_of_q(q) -> (loss, aux)`` is
    differentiated with respect to the (R, K) quantities only, then pulled back through
    ``token_fn`` in place (``statistics`` / ``logit_grad_``) or by autograd.
    Returns (grad, loss, aux)."""
    forward = _chunk_forward(token_fn, logits, extra_args)
    with torch.enable_grad():
        q_leaf = forward[0].detach().requires_grad_(True)
        loss, aux = loss_of_q(q_leaf)
        grad_q = _chunk_logit_grad(loss, q_leaf)
    return _chunk_backward(token_fn, forward, extra_args, grad_q), loss, aux


def _one_pass(rows: _Rows, plan: ChunkPlan, token_fn, group_fn, group_args, seq_len, grads):
    loss = torch.zeros((), device=rows.x.device, dtype=torch.float32)
    metrics = []
    for row_ranges, group_ranges in zip(plan.row_ranges, plan.group_ranges):
        x_rows = _gather(rows.x, row_ranges)
        targs = [_gather(t, row_ranges) for t in rows.token_args]
        gargs = [_gather(t, group_ranges) for t in group_args]
        q_ref = rows.ref_quantities(row_ranges, token_fn, targs)
        if q_ref is not None:
            q_ref = q_ref.view(-1, seq_len, q_ref.shape[-1])
        # The closed-form path turns this buffer into the chunk's gradient in place; autograd's
        # path keeps only its float32 copy.
        logits, ref_args = rows.chunk_logits(row_ranges, x_rows)

        def loss_of_q(q, q_ref=q_ref, gargs=gargs):
            return group_fn(_as_float64(q.view(-1, seq_len, q.shape[-1])), _as_float64(q_ref), *gargs)

        grad_logits, chunk_loss, chunk_metrics = _chunk_grad_via_q(token_fn, logits, (*ref_args, *targs), loss_of_q)
        del logits, ref_args
        loss += chunk_loss.detach().float()
        metrics.append(tuple(m.detach() for m in chunk_metrics))
        box = [grad_logits]
        del grad_logits
        grads.add(box, x_rows, rows.write_grad_x(grads, row_ranges))
    return loss, _merge_metrics(metrics)


def _two_passes(rows: _Rows, plan: ChunkPlan, token_fn, group_fn, group_args, batch_shape, grads):
    q_parts: list[torch.Tensor] = []
    q_ref_parts: list[torch.Tensor] = []  # stays empty without a second head's quantities
    # The closed form's per-row state of each chunk (row statistics, a few floats a row): the
    # second pass's gradient kernel reads it instead of a second statistics pass over the
    # recomputed logits (the same GEMM on the same rows: the same logits).
    states: list[object] = []
    closed_form = _in_place(token_fn)
    for row_ranges in plan.row_ranges:
        targs = [_gather(t, row_ranges) for t in rows.token_args]
        extra_args = (*rows.token_fn_ref_args(row_ranges), *targs)
        if closed_form:
            with torch.no_grad():
                q_part, state = token_fn.statistics(rows.logits(row_ranges), *extra_args)
            q_parts.append(q_part)
            states.append(state)
        else:
            q_parts.append(_quantities(token_fn, rows.logits(row_ranges), extra_args))
        del extra_args
        q_ref_part = rows.ref_quantities(row_ranges, token_fn, targs)
        if q_ref_part is not None:
            q_ref_parts.append(q_ref_part)
    q_all = torch.cat(q_parts).view(*batch_shape, -1)
    q_ref = torch.cat(q_ref_parts).view(*batch_shape, -1) if q_ref_parts else None
    with torch.enable_grad():
        q_all.requires_grad_(True)
        loss, metrics = group_fn(_as_float64(q_all), _as_float64(q_ref), *group_args)
        grad_q = _rows(_chunk_logit_grad(loss, q_all))
    for i, row_ranges in enumerate(plan.row_ranges):
        x_rows = _gather(rows.x, row_ranges)
        extra_args = (*rows.token_fn_ref_args(row_ranges), *(_gather(t, row_ranges) for t in rows.token_args))
        logits = rows.logits(row_ranges, x_rows)
        chunk_grad_q = _gather(grad_q, row_ranges)
        if closed_form:
            with torch.no_grad():
                grad_logits = token_fn.logit_grad_(logits, states[i], chunk_grad_q, *extra_args)
            states[i] = None
        else:
            grad_logits = _pull_back(token_fn, logits, extra_args, chunk_grad_q)
        del logits, extra_args
        box = [grad_logits]
        del grad_logits
        grads.add(box, x_rows, rows.write_grad_x(grads, row_ranges))
    return loss, tuple(metrics)


# --------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------


def scale_saved_gradient(grad: torch.Tensor | None, grad_output: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient stored by a forward pass, times the upstream gradient (in place where allowed)."""
    if grad is None or grad_output is None:
        return None
    if grad.device.type == "cuda" or is_interpreter():
        return scale_gradient(grad, grad_output)
    # Plain CPU runs (examples, without Triton's interpreter): the same product in torch.
    return grad.mul_(grad_output.to(grad.dtype))


def upstream_loss_gradient(grad_output: tuple) -> torch.Tensor | None:
    """The loss's upstream gradient from a backward's ``*grad_output``, also when a caller's backward
    forwards the whole tuple as one argument (``Base.backward(ctx, grad_output)``)."""
    first = grad_output[0] if grad_output else None
    if isinstance(first, tuple):
        first = first[0] if first else None
    return first


class LigerChunkedHeadFunction(EagerUnderCompile, torch.autograd.Function):
    """``apply(x, weight, bias, token_fn, group_fn, token_args, group_args, ref_x, ref_weight, ref_bias,
    paired, additive, accum_fp32, ref_logits_to_token_fn)`` -> ``(loss, metrics)``; see the module docstring.

    Gradients flow to ``x``, ``weight`` and ``bias`` (those that require grad); side tensors and
    the second head get none. Backward may run only once per forward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, token_fn, group_fn, token_args=(), group_args=(), ref_x=None,
                ref_weight=None, ref_bias=None, paired=False, additive=True, accum_fp32=False,
                ref_logits_to_token_fn=False):
        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                 bias is not None and bool(ctx.needs_input_grad[2]))
        loss, metrics, grads = chunked_head_loss_and_grads(
            x, weight, bias, token_fn, group_fn, token_args, group_args, ref_x, ref_weight, ref_bias,
            paired=paired, additive=additive, needs=needs, accum_fp32=accum_fp32,
            ref_logits_to_token_fn=ref_logits_to_token_fn)
        save_head_grads(ctx, grads)
        return loss, metrics

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, *grad_output):
        grad_x, grad_weight, grad_bias = scaled_head_grads(ctx, upstream_loss_gradient(grad_output))
        return _HEAD_GRADS(x=grad_x, weight=grad_weight, bias=grad_bias)


_HEAD_GRADS = InputGradients(LigerChunkedHeadFunction.forward)


def save_head_grads(ctx, grads: HeadGrads) -> None:
    """Keep a forward's unit-upstream gradients for :func:`scaled_head_grads`."""
    ctx.has_grads = (grads.x is not None, grads.weight is not None, grads.bias is not None)
    ctx.save_for_backward(*(g for g in (grads.x, grads.weight, grads.bias) if g is not None))


def scaled_head_grads(ctx, grad_loss: torch.Tensor | None) -> tuple:
    """(dx, dW, db) scaled by the loss's upstream gradient, None where not computed."""
    saved = iter(ctx.saved_tensors)
    out = []
    for present in ctx.has_grads:
        out.append(scale_saved_gradient(next(saved), grad_loss) if present else None)
    return tuple(out)


def chunked_head_loss(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, token_fn: TokenFn,
                      group_fn: GroupFn, token_args: Sequence[torch.Tensor] = (),
                      group_args: Sequence[torch.Tensor] = (), ref_x: torch.Tensor | None = None,
                      ref_weight: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None,
                      paired: bool = False, additive: bool = True, accum_fp32: bool = False,
                      ref_logits_to_token_fn: bool = False):
    """Differentiable ``(loss, metrics)`` of ``group_fn(token_fn(x W^T + b))``; see the module docstring."""
    return LigerChunkedHeadFunction.apply(x, weight, bias, token_fn, group_fn, tuple(token_args),
                                          tuple(group_args), ref_x, ref_weight, ref_bias, paired, additive,
                                          accum_fp32, ref_logits_to_token_fn)
