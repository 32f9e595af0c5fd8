"""Per-token log-probabilities and entropies of a linear head at a temperature, without the logits.

For hidden states ``x`` (N, D) (any leading shape, flattened), head ``W`` (V, D), bias ``b`` (V,)
or None, targets ``y`` (N,) and temperature ``tau > 0``::

    s = (x W^T + b) / tau                      (N, V), one chunk of rows at a time
    logp_n = log_softmax(s_n)[y_n]             (0 where y_n == ignore_index)
    H_n = logsumexp(s_n) - sum_v p_nv s_nv     (the entropy of p_n = softmax(s_n); 0 where ignored)

Both outputs are float32 and differentiable in ``x``, ``W`` and ``b``: with upstream gradients
``g`` (of ``logp``) and ``h`` (of ``H``), per row ::

    dL/ds = g (onehot(y) - p) - h p (log p + H),    dL/dz = dL/ds / tau

and ``dx = (dL/dz) W``, ``dW = (dL/dz)^T x``, ``db = sum_rows dL/dz``. The forward pass runs
one logits GEMM and the row-statistics kernel per chunk
(:mod:`~liger_kernel.ops.head_epilogue`) and keeps x, W, b, y and each row's statistics (lse,
entropy, target logit: 36 bytes a token): ``g`` and ``h`` are known only in backward and dW
depends on them row by row, so the backward hands the scalar ``sum_n g_n logp_n + h_n H_n`` to
the chunked head engine, which writes each chunk's logit gradient in place from the kept
statistics (one pass over each chunk in backward instead of two). The forward also keeps the
logits of its leading chunks, one chunk budget's worth; the backward recomputes the others
(8 N D V flops in all when every chunk is recomputed, 6 N D V when one chunk holds the batch,
as for a loss whose upstream gradient is a scalar). Chunks follow the engine's budget
(:class:`~liger_kernel.ops.chunked_head.ChunkedHeadConfig`); logits are one GEMM in the input
dtype with float32 accumulation, every statistic after is float32, and the logit gradient is
rounded to the input dtype for the gradient GEMMs.

This is what an RL trainer computing its own policy loss needs (the log-probabilities of the
sampled tokens and the entropy bonus). :class:`LigerFusedLinearScaledCrossEntropyFunction` is the
same computation in the call shape verl uses: ``apply(_input (N, D), weight (V, D), target (N,),
temperature=1.0, ignore_index=-100, m_tiles_per_cluster=1, return_entropy=False)`` returning the
negative log-probabilities ``-logp`` (and ``H`` with ``return_entropy``). Deviation from the
best-known library: the entropy is returned in float32, not in the input dtype.

:func:`fused_linear_token_statistics` (:class:`LigerFusedLinearTokenStatisticsFunction`) is the
general form an RL trainer's fused head needs (TRL's, through
:mod:`liger_kernel.transformers.trl_fused_head`): the logits transformed as
``s = softcap(z * logit_scale) / temperature`` before the softmax, and besides ``logp`` each
only when asked: the entropy, ``log sum p^2``, the mean of ``s`` and whether the target is the
first argmax; float32 accumulation of dW optional. Same passes and costs as above.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from liger_kernel.ops.autograd import EagerUnderCompile, InputGradients, strictly_once_differentiable
from liger_kernel.ops.checks import check_linear_operands, check_temperature, check_tensor
from liger_kernel.ops.chunked_head import (
    _logits,
    autocast_operands,
    chunked_head_loss_and_grads,
    per_token_chunks,
)
from liger_kernel.ops.head_chunking import gemm_reduction_precision
from liger_kernel.ops.head_epilogue import STAT_COLUMNS, LogitRowStatistics, SavedRowStatistics
from liger_kernel.ops.loss_checks import start_target_check


def log_prob_entropy_rows(temperature: float = 1.0, ignore_index: int | None = None,
                          with_entropy: bool = True) -> LogitRowStatistics:
    """The engine's ``token_fn`` of this op: per logit row ``z`` (R, V) and target ``y`` (R,),
    ``[logp]`` or ``[logp, H]`` (R, K) float32 at ``s = z / temperature``, both 0 where
    ``y == ignore_index`` (when one is given); any other target outside [0, V) reads token 0."""
    return LogitRowStatistics(ignore_index, temperature, entropy=with_entropy)


def _check(x, weight, bias, target, temperature, ignore_index):
    check_temperature(temperature)
    check_tensor(target, "target")
    if target.dtype.is_floating_point:
        raise TypeError(f"target must hold integer token ids, got {target.dtype}")
    if x.dim() < 1 or tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target must have shape {tuple(x.shape[:-1])} (the input's leading shape), "
                         f"got {tuple(target.shape)}")
    check_linear_operands(x.reshape(-1, x.shape[-1]), weight, bias, "_input")
    # The range check's verdict is awaited once the chunk loop is queued (waiting first would
    # drain the GPU's queue and expose the backward's launches); a bad target never addresses
    # memory (it reads token 0) and the results computed with it are discarded by the raise.
    flat = target.reshape(-1)
    return start_target_check(flat if flat.dtype in (torch.int64, torch.int32) else flat.long(), flat.shape[0],
                              weight.shape[0], ignore_index)


def row_chunks(x: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, ...] = (True, True)) -> list[tuple[int, int]]:
    """Row ranges of 2-D ``x``: those of the engine's backward pass (for the gradients ``needs``
    says the call produces), so forward and backward compute the same logits."""
    return list(per_token_chunks(x, weight, needs).row_ranges)


# The optional per-token outputs, in the order they are returned after the log-probabilities.
TOKEN_STATISTICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class TokenStatistics(NamedTuple):
    """What :func:`fused_linear_token_statistics` returns; None for an output not asked for."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None
    mean_logits: torch.Tensor | None
    is_top1: torch.Tensor | None


def check_token_statistics(outputs) -> tuple[str, ...]:
    """``outputs`` as a tuple of names from :data:`TOKEN_STATISTICS` (each once, any order)."""
    if isinstance(outputs, str) or not all(isinstance(name, str) for name in outputs):
        raise TypeError(f"outputs must be a tuple of names among {TOKEN_STATISTICS}, got {outputs!r}")
    unknown = [name for name in outputs if name not in TOKEN_STATISTICS]
    if unknown:
        raise ValueError(f"unknown output {unknown[0]!r}; the outputs besides the log-probabilities are "
                         f"{', '.join(TOKEN_STATISTICS)}")
    return tuple(name for name in TOKEN_STATISTICS if name in outputs)


def token_statistics_rows(ignore_index: int | None, temperature: float, softcap: float | None, logit_scale: float,
                          outputs: tuple[str, ...] = ()) -> LogitRowStatistics:
    """The row statistics of ``[logp, *outputs]`` (columns in :data:`TOKEN_STATISTICS` order) at
    ``s = softcap(z * logit_scale) / temperature``."""
    return LogitRowStatistics(ignore_index, temperature, softcap, logit_scale,
                              **{name: name in outputs for name in TOKEN_STATISTICS})


@torch.compiler.disable
def token_statistics_forward(x, weight, bias, target, rows: LogitRowStatistics, needs=(True, True)):
    """``(columns, stats, kept, config)`` for 2-D ``x`` (N, D), on the backward's chunks: the (N, K)
    float32 columns of ``rows``, the (N, 9) row statistics behind them (what the backward's
    gradient pass reads), the logits of the leading chunks the backward reads instead of
    recomputing (``[(z, None)]``, see :func:`~liger_kernel.ops.chunked_head.per_token_chunks`) and
    the chunk configuration the backward must use. No graph (never traced: a graph break under
    ``torch.compile``, since the loop switches cuBLAS's reduction precision, global state Dynamo
    refuses to see change, so the Function runs eagerly)."""
    out = torch.empty((x.shape[0], len(rows.column_names(1))), device=x.device, dtype=torch.float32)
    stats = torch.empty((x.shape[0], STAT_COLUMNS), device=x.device, dtype=torch.float32)
    chunks = per_token_chunks(x, weight, needs)
    kept: list[tuple[torch.Tensor, None]] = []
    with torch.no_grad(), torch.autocast(device_type=x.device.type, enabled=False), gemm_reduction_precision():
        for i, (a, b) in enumerate(chunks.row_ranges):
            logits = _logits(x[a:b], weight, bias)
            out[a:b], (stats[a:b], *_) = rows.statistics(logits, target[a:b])
            if i < chunks.n_kept:
                kept.append((logits, None))
    return out, stats, kept, chunks.config


class LigerFusedLinearTokenStatisticsFunction(EagerUnderCompile, torch.autograd.Function):
    """``apply(x, weight, bias, target, temperature, softcap, logit_scale, outputs, ignore_index,
    accum_fp32, backward_context)`` -> ``(logp, entropy, log_sum_sq_probs, mean_logits, is_top1)``.

    Per row, at ``s = softcap(z * logit_scale) / temperature`` (``softcap(u) = c tanh(u / c)``,
    none when ``softcap`` is None) of the logits ``z = x W^T + b``, ``p = softmax(s)``::

        logp             = s_y - logsumexp(s)        differentiable
        entropy          = -sum_v p_v log p_v        differentiable
        log_sum_sq_probs = log sum_v p_v^2           no gradient
        mean_logits      = sum_v s_v / V             no gradient
        is_top1          = y is the first argmax of s (bool; a tie with an earlier token is False)

    float32 (is_top1 bool), ``x``'s leading shape, each optional one only when named in
    ``outputs`` (None otherwise), all 0 (False) where ``y == ignore_index``. With upstream
    gradients ``g`` of ``logp`` and ``h`` of the entropy, ``dL/ds = g (onehot(y) - p) - h p (log p
    + H)`` and ``dL/dz = dL/ds * ds/dz`` (``ds/dz = logit_scale sech^2(z logit_scale / c) /
    temperature``): the engine recomputes each chunk's logits in backward and writes this in place,
    an entropy that gets no gradient costing nothing there. ``accum_fp32`` accumulates dW over the
    chunks in float32 (returned in the weight's dtype). ``backward_context``: a callable returning
    a context manager the backward runs in (e.g. one that gathers a sharded head again), or None.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, target, temperature=1.0, softcap=None, logit_scale=1.0, outputs=("entropy",),
                ignore_index=-100, accum_fp32=False, backward_context=None):
        outputs = check_token_statistics(outputs)
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        rows = token_statistics_rows(ignore_index, temperature, softcap, logit_scale, outputs)
        target_check = _check(x, weight, bias, target, temperature, ignore_index)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        t1 = target.reshape(-1)
        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        out, stats, kept, ctx.chunk_config = token_statistics_forward(x2, weight, bias, t1, rows, needs)
        target_check.wait()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x2, weight, bias, t1, stats)
        # Not saved tensors: the backward takes them out of this list one by one, so each chunk is
        # freed as soon as its gradient is consumed (saved tensors would live to the backward's end).
        ctx.kept_logits = kept
        ctx.options = (ignore_index, temperature, softcap, logit_scale, bool(accum_fp32))
        ctx.backward_context = backward_context if backward_context is not None else contextlib.nullcontext
        ctx.x_shape = x.shape
        lead = tuple(x.shape[:-1])
        ignored = (t1 == ignore_index).reshape(lead)
        results = dict(zip(("logprobs",) + outputs, out.unbind(1)))
        for name in ("log_sum_sq_probs", "mean_logits"):
            if name in results:  # the statistics kernel does not zero these on ignored rows
                results[name] = results[name].reshape(lead).masked_fill(ignored, 0.0)
        if "is_top1" in results:
            results["is_top1"] = (results["is_top1"].reshape(lead) > 0) & ~ignored
        values = tuple(results[name].reshape(lead) if name in results else None
                       for name in ("logprobs",) + TOKEN_STATISTICS)
        ctx.mark_non_differentiable(*(v for v in values[2:] if v is not None))
        return values

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_logp, grad_entropy, *_):
        grad_x, grad_weight, grad_bias = _token_statistics_input_grads(ctx, grad_logp, grad_entropy)
        return _TOKEN_STATISTICS_GRADS(x=grad_x, weight=grad_weight, bias=grad_bias)


def _token_statistics_input_grads(ctx, grad_logp, grad_entropy):
    """(dx, dW, db) for upstream gradients of the log-probs and the entropy (either may be None):
    the gradients of ``sum_n g_n logp_n + h_n H_n``, which the engine computes with every row a
    group of its own, recomputing each chunk's logits and writing their gradient in place from the
    row statistics the forward kept (no second statistics pass; an entropy without upstream
    gradient costs nothing)."""
    x2, weight, bias, t1, stats = ctx.saved_tensors
    if grad_logp is None and grad_entropy is None:
        return None, None, None
    ignore_index, temperature, softcap, logit_scale, accum_fp32 = ctx.options
    with_entropy = grad_entropy is not None
    grad_out = torch.zeros((x2.shape[0], 1 + with_entropy), device=x2.device, dtype=torch.float32)
    if grad_logp is not None:
        grad_out[:, 0] = grad_logp.reshape(-1)
    if with_entropy:
        grad_out[:, 1] = grad_entropy.reshape(-1)
    rows = token_statistics_rows(ignore_index, temperature, softcap, logit_scale,
                                 ("entropy",) if with_entropy else ())

    def group_fn(q, q_ref, upstream):
        return (q[:, 0, :] * upstream).sum(), ()

    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
    with ctx.backward_context():
        _, _, grads = chunked_head_loss_and_grads(x2.unsqueeze(1), weight, bias, SavedRowStatistics(rows), group_fn,
                                                  token_args=(t1.unsqueeze(1), stats.unsqueeze(1)),
                                                  group_args=(grad_out,),
                                                  needs=needs, accum_fp32=accum_fp32,
                                                  kept_logits=ctx.kept_logits, chunk_config=ctx.chunk_config)
    return (grads.x.view(ctx.x_shape) if grads.x is not None else None), grads.weight, grads.bias


_TOKEN_STATISTICS_GRADS = InputGradients(LigerFusedLinearTokenStatisticsFunction.forward)


def fused_linear_token_statistics(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                  bias: torch.Tensor | None = None, *, temperature: float = 1.0,
                                  softcap: float | None = None, logit_scale: float = 1.0,
                                  outputs: tuple[str, ...] = ("entropy",), ignore_index: int = -100,
                                  accum_dtype: torch.dtype | None = None) -> TokenStatistics:
    """Per-token ``logprobs`` and the ``outputs`` asked for (:data:`TOKEN_STATISTICS`) of ``x``
    (..., D) through the head ``(weight (V, D), bias (V,))`` at
    ``s = softcap(z * logit_scale) / temperature``; see
    :class:`LigerFusedLinearTokenStatisticsFunction` for the math.

    ``accum_dtype``: None accumulates dW over chunks in the weight's dtype, ``torch.float32`` in
    float32. Under ``torch.autocast`` the head runs in the autocast dtype (as ``F.linear``).
    """
    if accum_dtype not in (None, torch.float32):
        raise ValueError(f"accum_dtype must be None (the weight's dtype) or torch.float32, got {accum_dtype!r}")
    outputs = check_token_statistics(outputs)
    x, weight, bias = autocast_operands(x, weight, bias)
    return TokenStatistics(*LigerFusedLinearTokenStatisticsFunction.apply(
        x, weight, bias, target, temperature, softcap, logit_scale, outputs, ignore_index,
        accum_dtype == torch.float32))


class LigerFusedLinearLogProbsFunction(LigerFusedLinearTokenStatisticsFunction):
    """``apply(x, weight, bias, target, temperature=1.0, ignore_index=-100)`` -> ``(logp, entropy)``,
    both float32 with ``x``'s leading shape; see the module docstring (the two-output form of
    :class:`LigerFusedLinearTokenStatisticsFunction`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, temperature=1.0, ignore_index=-100):
        logp, entropy, *_ = LigerFusedLinearTokenStatisticsFunction.forward(
            ctx, x, weight, bias, target, temperature, None, 1.0, ("entropy",), ignore_index, False, None)
        return logp, entropy

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        grad_x, grad_weight, grad_bias = _token_statistics_input_grads(ctx, grad_logp, grad_entropy)
        return _LOG_PROBS_GRADS(x=grad_x, weight=grad_weight, bias=grad_bias)


_LOG_PROBS_GRADS = InputGradients(LigerFusedLinearLogProbsFunction.forward)


def fused_linear_logprobs(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          bias: torch.Tensor | None = None, temperature: float = 1.0,
                          ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` per token of ``x`` (..., D) through the head ``(weight, bias)`` at ``temperature``."""
    return LigerFusedLinearLogProbsFunction.apply(x, weight, bias, target, temperature, ignore_index)


class LigerFusedLinearScaledCrossEntropyFunction:
    """verl's call shape: ``apply(_input, weight, target, temperature=1.0, ignore_index=-100,
    m_tiles_per_cluster=1, return_entropy=False)`` -> ``-logp`` or ``(-logp, entropy)`` (float32).

    ``m_tiles_per_cluster`` (a tiling knob of a Hopper kernel) is checked and otherwise ignored.
    """

    @staticmethod
    def apply(_input, weight, target, temperature=1.0, ignore_index=-100, m_tiles_per_cluster=1,
              return_entropy=False):
        if isinstance(m_tiles_per_cluster, bool) or not isinstance(m_tiles_per_cluster, int) \
                or m_tiles_per_cluster < 1:
            raise ValueError(f"m_tiles_per_cluster must be an int >= 1, got {m_tiles_per_cluster!r}")
        if not isinstance(return_entropy, bool):
            raise TypeError("return_entropy must be a bool")
        logp, entropy = fused_linear_logprobs(_input, weight, target, None, temperature, ignore_index)
        return (-logp, entropy) if return_entropy else -logp
