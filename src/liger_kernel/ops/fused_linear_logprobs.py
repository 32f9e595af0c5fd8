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
(:mod:`~liger_kernel.ops.head_epilogue`) and keeps only x, W, b and y: ``g`` and ``h`` are
known only in backward and dW depends on them row by row, so the backward hands the scalar
``sum_n g_n logp_n + h_n H_n`` to the chunked head engine, which recomputes each chunk's
logits and writes their gradient in place (8 N D V flops in all, against 6 N D V for a loss
whose upstream gradient is a scalar). Chunks follow the engine's budget
(:class:`~liger_kernel.ops.chunked_head.ChunkedHeadConfig`); logits are one GEMM in the input
dtype with float32 accumulation, every statistic after is float32, and the logit gradient is
rounded to the input dtype for the gradient GEMMs.

This is what an RL trainer computing its own policy loss needs (the log-probabilities of the
sampled tokens and the entropy bonus). :class:`LigerFusedLinearScaledCrossEntropyFunction` is the
same computation in the call shape verl uses: ``apply(_input (N, D), weight (V, D), target (N,),
temperature=1.0, ignore_index=-100, m_tiles_per_cluster=1, return_entropy=False)`` returning the
negative log-probabilities ``-logp`` (and ``H`` with ``return_entropy``). Deviation from the
best-known library: the entropy is returned in float32, not in the input dtype.
"""

from __future__ import annotations

import torch

from liger_kernel.ops.autograd import EagerUnderCompile, strictly_once_differentiable
from liger_kernel.ops.checks import check_tensor
from liger_kernel.ops.chunked_head import (
    ChunkedHeadConfig,
    HeadGrads,
    _logits,
    check_head_args,
    chunk_plan,
    chunked_head_loss_and_grads,
)
from liger_kernel.ops.config import launch_config
from liger_kernel.ops.head_chunking import gemm_reduction_precision, gradient_bytes
from liger_kernel.ops.head_epilogue import LogitRowStatistics, check_temperature
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
    check_head_args(x.reshape(1, -1, x.shape[-1]), weight, bias)
    # The range check's verdict is awaited once the chunk loop is queued (waiting first would
    # drain the GPU's queue and expose the backward's launches); a bad target never addresses
    # memory (it reads token 0) and the results computed with it are discarded by the raise.
    flat = target.reshape(-1)
    return start_target_check(flat if flat.dtype in (torch.int64, torch.int32) else flat.long(), flat.shape[0],
                              weight.shape[0], ignore_index)


def row_chunks(x: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, ...] = (True, True)) -> list[tuple[int, int]]:
    """Row ranges of 2-D ``x``: those of the engine's backward pass (every row a group, the
    closed-form path, for the gradients ``needs`` says the call produces), so forward and
    backward compute the same logits."""
    n_rows = x.shape[0]
    floor_bytes = gradient_bytes(x, weight, bool(needs[0]), bool(needs[1]))
    rows = launch_config(ChunkedHeadConfig, n_rows, weight.shape[0], floor_bytes, x.element_size()).chunk_rows
    if rows < 1:
        raise ValueError(f"ChunkedHeadConfig.chunk_rows must be >= 1, got {rows}")
    return [r for (r,) in chunk_plan(n_rows, 1, False, True, rows).row_ranges]


@torch.compiler.disable
def logprobs_and_entropy_forward(x, weight, bias, target, temperature, ignore_index, needs=(True, True)):
    """(N, 2) float32 ``[logp, H]`` of 2-D ``x`` (N, D), chunk by chunk, no graph.

    Never traced (a graph break under ``torch.compile``): the loop switches cuBLAS's reduction
    precision, global state Dynamo refuses to see change, so the Function runs eagerly."""
    n_rows = x.shape[0]
    out = torch.empty((n_rows, 2), device=x.device, dtype=torch.float32)
    rows = log_prob_entropy_rows(temperature, ignore_index)
    with torch.no_grad(), torch.autocast(device_type=x.device.type, enabled=False), gemm_reduction_precision():
        for a, b in row_chunks(x, weight, needs):
            out[a:b] = rows.statistics(_logits(x[a:b], weight, bias), target[a:b])[0]
    return out


def logprobs_and_entropy_backward(x, weight, bias, target, temperature, ignore_index, grad_out, needs) -> HeadGrads:
    """(dx, dW, db) for upstream gradients ``grad_out`` (N, 2) of ``[logp, H]``.

    They are the gradients of the scalar ``sum_n grad_out[n] . [logp_n, H_n]``, which the chunked
    head engine computes with every row a group of its own (one pass, each chunk's logits
    recomputed, its gradient formed in place by :func:`log_prob_entropy_rows`' closed form).
    """

    def group_fn(q, q_ref, upstream):
        return (q[:, 0, :] * upstream).sum(), ()

    _, _, grads = chunked_head_loss_and_grads(x.unsqueeze(1), weight, bias, log_prob_entropy_rows(temperature, ignore_index),
                                              group_fn,
                                              token_args=(target.unsqueeze(1),), group_args=(grad_out,), needs=needs)
    if grads.x is not None:
        grads.x = grads.x.view(x.shape)
    return grads


class LigerFusedLinearLogProbsFunction(EagerUnderCompile, torch.autograd.Function):
    """``apply(x, weight, bias, target, temperature=1.0, ignore_index=-100)`` -> ``(logp, entropy)``,
    both float32 with ``x``'s leading shape; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, temperature=1.0, ignore_index=-100):
        target_check = _check(x, weight, bias, target, temperature, ignore_index)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        t1 = target.reshape(-1)
        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        out = logprobs_and_entropy_forward(x2, weight, bias, t1, temperature, ignore_index, needs)
        target_check.wait()
        ctx.save_for_backward(x2, weight, bias, t1)
        ctx.temperature, ctx.ignore_index, ctx.x_shape = temperature, ignore_index, x.shape
        lead = tuple(x.shape[:-1])
        return out[:, 0].reshape(lead), out[:, 1].reshape(lead)

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        x2, weight, bias, t1 = ctx.saved_tensors
        grad_out = torch.zeros((x2.shape[0], 2), device=x2.device, dtype=torch.float32)
        if grad_logp is not None:
            grad_out[:, 0] = grad_logp.reshape(-1)
        if grad_entropy is not None:
            grad_out[:, 1] = grad_entropy.reshape(-1)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        grads = logprobs_and_entropy_backward(x2, weight, bias, t1, ctx.temperature, ctx.ignore_index, grad_out,
                                              needs)
        grad_x = grads.x.view(ctx.x_shape) if grads.x is not None else None
        return grad_x, grads.weight, grads.bias, None, None, None


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
