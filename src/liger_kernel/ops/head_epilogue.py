"""Per-row statistics of a chunk of head logits, and the chunk's logit gradient in place.

The epilogue of every head-bound loss of the chunked head engine
(:mod:`liger_kernel.ops.chunked_head`): preference, RL and log-prob losses read, per token row
of logits ``z`` (V,), a few quantities of the distribution ``p = softmax(s)`` at

    s = T(z) = cap(z * scale) / tau,        cap(u) = c tanh(u / c)   (identity without a cap)

and their gradient with respect to ``z`` is a closed form of the same row. Two Triton
kernels walk a (R, V) chunk in the GEMM's dtype (bf16, fp16 or fp32; no float32 copy):

``row_statistics`` (one program per row, one online pass over V) gives, per row::

    lse   = log sum_v exp(s_v)
    H     = lse - sum_v p_v s_v                       entropy, as log d - T / d with the running
                                                      max m, d = sum e_v, e_v = exp(s_v - m),
                                                      T = sum e_v (s_v - m) <= 0: no cancellation
    Q     = log sum_v p_v^2 = log sum e_v^2 - 2 log d
    S_raw = sum_v z_v,  S = sum_v s_v
    M_<y  = max_{v < y} s_v                            (for "the target is the first argmax")
    s_y   = T(z_y) per label y (up to two labels)

``logit_grad_`` (one program per (row, column block)) overwrites the chunk with ``dL/dz`` for
per-row coefficients ``c_j = dL/dlogp_j`` (``logp_j = s_{y_j} - lse``), ``c_H = dL/dH`` and
``c_raw = dL/dS_raw``::

    dL/ds_v = sum_j c_j (1[v = y_j] - p_v) - c_H p_v (log p_v + H)
    dL/dz_v = dL/ds_v / tau * cap'(z_v scale) * scale + c_raw,   cap'(u) = 1 - tanh(u / c)^2

Both are exact in float32 on the rounded logits (as HF's ``logits.float()`` then torch ops);
the gradient is rounded once to the chunk's dtype, as the engine's GEMMs read it.

:class:`LogitRowStatistics` packages them as a ``token_fn`` of the engine: its columns, in
order, are the log-probs of each label, then those asked for of entropy, log sum p^2, the raw
row sum, the mean of ``s`` and the top-1 indicator. Calling the object computes the same
columns with torch ops (differentiable; the float64 reference of the tests).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.checks import check_temperature
from liger_kernel.ops.config import FixedLaunchConfig, launch_config
from liger_kernel.ops.launch import cdiv, is_interpreter, multiprocessor_count, next_power_of_2
from liger_kernel.ops.numerics import round_to_dtype, tanh_and_sech2

# Columns of the statistics buffer (R, STAT_COLUMNS) float32 and of the coefficient buffer
# (R, COEFFICIENT_COLUMNS) float32; the kernels read the same numbers as Triton constants (K_*).
LSE, ENTROPY, LOG_SUM_SQ, RAW_SUM, TRANSFORMED_SUM, MAX_BEFORE_LABEL, ROW_MAX, LABEL_0, LABEL_1 = range(9)
STAT_COLUMNS = 9
C_TOTAL, C_LABEL_0, C_LABEL_1, C_ENTROPY, C_RAW_SUM = range(5)
COEFFICIENT_COLUMNS = 5
MAX_LABELS = 2
K_LSE, K_ENTROPY, K_LOG_SUM_SQ, K_RAW_SUM = tl.constexpr(LSE), tl.constexpr(ENTROPY), tl.constexpr(LOG_SUM_SQ), \
    tl.constexpr(RAW_SUM)
K_TRANSFORMED_SUM, K_MAX_BEFORE_LABEL, K_ROW_MAX = tl.constexpr(TRANSFORMED_SUM), tl.constexpr(MAX_BEFORE_LABEL), \
    tl.constexpr(ROW_MAX)
K_LABEL_0, K_LABEL_1, K_STAT_COLUMNS = tl.constexpr(LABEL_0), tl.constexpr(LABEL_1), tl.constexpr(STAT_COLUMNS)
K_C_TOTAL, K_C_LABEL_0, K_C_LABEL_1 = tl.constexpr(C_TOTAL), tl.constexpr(C_LABEL_0), tl.constexpr(C_LABEL_1)
K_C_ENTROPY, K_C_RAW_SUM, K_COEFFICIENT_COLUMNS = tl.constexpr(C_ENTROPY), tl.constexpr(C_RAW_SUM), \
    tl.constexpr(COEFFICIENT_COLUMNS)


@dataclasses.dataclass(frozen=True)
class HeadEpilogueConfig(FixedLaunchConfig):
    """Column tiles and warps of the two epilogue kernels; the statistics kernel splits rows
    into column ranges until about ``statistics_programs_per_sm`` programs per SM run."""

    statistics_block: int = 4096
    statistics_warps: int = 8
    statistics_programs_per_sm: int = 32
    gradient_block: int = 2048
    gradient_warps: int = 8

    def __post_init__(self):
        self.check_powers_of_two("statistics_block", "statistics_warps", "gradient_block", "gradient_warps")

    @classmethod
    def search_space(cls):
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                yield cls(statistics_block=block, statistics_warps=warps, gradient_block=block, gradient_warps=warps)


@triton.jit
def transformed_logits(z, scale, softcap, inv_temperature, SCALED: tl.constexpr, SOFTCAPPED: tl.constexpr):
    """``s = T(z)`` and ``dT/dz`` (float32)."""
    slope = inv_temperature
    if SCALED:
        z = z * scale
        slope = slope * scale
    if SOFTCAPPED:
        tanh, sech2 = tanh_and_sech2(z / softcap)
        z = softcap * tanh
        slope = slope * sech2
    return z * inv_temperature, slope


# Per (row, column split) partial statistics of the split's columns, combined by
# :func:`_combine_partials`: running max, sum of e = exp(s - max), sum of e (s - max), sum of
# e^2, raw and transformed sums, max of s before the first label.
P_MAX, P_EXP_SUM, P_SHIFTED_SUM, P_SQUARE_SUM, P_RAW_SUM, P_TRANSFORMED_SUM, P_MAX_BEFORE = range(7)
PARTIAL_COLUMNS = 7
K_PARTIAL_COLUMNS = tl.constexpr(PARTIAL_COLUMNS)
# A finite start for the running max: an empty split's shift is then 0 * finite, never nan.
LOWEST_MAX = -3.0e38
K_LOWEST_MAX = tl.constexpr(LOWEST_MAX)


@triton.jit
def _row_statistics_kernel(z_ptr, z_stride, labels_ptr, labels_stride, stats_ptr, partial_ptr, n_cols, span,
                           scale, softcap, inv_temperature, N_LABELS: tl.constexpr, SCALED: tl.constexpr,
                           SOFTCAPPED: tl.constexpr, ENTROPY: tl.constexpr, SUM_SQ: tl.constexpr,
                           RAW_SUM: tl.constexpr, TRANSFORMED_SUM: tl.constexpr, TOP1: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Program (row, split): one online pass over the split's ``span`` columns."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    row_ptr = z_ptr + row * z_stride
    first_label = 0
    if N_LABELS > 0:
        first_label = tl.load(labels_ptr + row * labels_stride)
    zero = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
    running_max = zero + K_LOWEST_MAX
    exp_sum = zero
    shifted_sum = zero  # sum_v e_v (s_v - running_max)
    square_sum = zero
    raw_sum = zero
    transformed_sum = zero
    max_before = zero - float("inf")
    col_start = split * span
    col_stop = tl.minimum(col_start + span, n_cols)
    for start in range(col_start, col_stop, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < col_stop
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if RAW_SUM:
            raw_sum += tl.sum(z, axis=0)
        s, _ = transformed_logits(z, scale, softcap, inv_temperature, SCALED, SOFTCAPPED)
        if TRANSFORMED_SUM:
            transformed_sum += tl.sum(tl.where(mask, s, 0.0), axis=0)
        s = tl.where(mask, s, -float("inf"))
        if TOP1:
            max_before = tl.maximum(max_before, tl.max(tl.where(cols < first_label, s, -float("inf")), axis=0))
        new_max = tl.maximum(running_max, tl.max(s, axis=0))
        rescale = tl.exp(running_max - new_max)
        e = tl.exp(s - new_max)
        if ENTROPY:
            # The running sum shifted to the new max; masked or -inf entries (e = 0, and a finite
            # floor on s - max so that 0 * -inf does not make a nan) add nothing.
            shifted_sum = rescale * (shifted_sum + (running_max - new_max) * exp_sum) \
                + tl.sum(e * tl.maximum(s - new_max, K_LOWEST_MAX), axis=0)
        if SUM_SQ:
            square_sum = square_sum * rescale * rescale + tl.sum(e * e, axis=0)
        exp_sum = exp_sum * rescale + tl.sum(e, axis=0)
        running_max = new_max
    partial = partial_ptr + (row * n_splits + split) * K_PARTIAL_COLUMNS
    tl.store(partial + 0, running_max)
    tl.store(partial + 1, exp_sum)
    tl.store(partial + 2, shifted_sum)
    tl.store(partial + 3, square_sum)
    tl.store(partial + 4, raw_sum)
    tl.store(partial + 5, transformed_sum)
    tl.store(partial + 6, max_before)
    if split == 0:
        out = stats_ptr + row * K_STAT_COLUMNS
        if N_LABELS > 0:
            z_label = tl.load(row_ptr + first_label).to(tl.float32)
            s_label, _ = transformed_logits(z_label, scale, softcap, inv_temperature, SCALED, SOFTCAPPED)
            tl.store(out + K_LABEL_0, s_label)
        if N_LABELS > 1:
            z_label = tl.load(row_ptr + tl.load(labels_ptr + row * labels_stride + 1)).to(tl.float32)
            s_label, _ = transformed_logits(z_label, scale, softcap, inv_temperature, SCALED, SOFTCAPPED)
            tl.store(out + K_LABEL_1, s_label)


def _combine_partials(partials: torch.Tensor, stats: torch.Tensor, entropy: bool, sum_sq: bool, raw_sum: bool,
                      transformed_sum: bool, top1: bool) -> None:
    """Fold the (R, S, 7) per-split partials into the statistics columns (float32, in place)."""
    split_max = partials[..., P_MAX]
    row_max = split_max.amax(1)
    shift = split_max - row_max.unsqueeze(1)  # <= 0; LOWEST_MAX - max for an empty split
    weight = shift.exp()
    exp_sums = partials[..., P_EXP_SUM]
    exp_sum = (exp_sums * weight).sum(1)
    log_exp_sum = exp_sum.log()
    stats[:, LSE] = row_max + log_exp_sum
    if entropy:
        shifted = ((partials[..., P_SHIFTED_SUM] + shift * exp_sums) * weight).sum(1)
        stats[:, ENTROPY] = log_exp_sum - shifted / exp_sum
    if sum_sq:
        stats[:, LOG_SUM_SQ] = (partials[..., P_SQUARE_SUM] * weight * weight).sum(1).log() - 2 * log_exp_sum
    if raw_sum:
        stats[:, RAW_SUM] = partials[..., P_RAW_SUM].sum(1)
    if transformed_sum:
        stats[:, TRANSFORMED_SUM] = partials[..., P_TRANSFORMED_SUM].sum(1)
    if top1:
        stats[:, MAX_BEFORE_LABEL] = partials[..., P_MAX_BEFORE].amax(1)
        stats[:, ROW_MAX] = row_max


@triton.jit
def _logit_grad_kernel(z_ptr, z_stride, labels_ptr, labels_stride, stats_ptr, coefficients_ptr, n_cols, scale,
                       softcap, inv_temperature, N_LABELS: tl.constexpr, SCALED: tl.constexpr,
                       SOFTCAPPED: tl.constexpr, ENTROPY_GRAD: tl.constexpr, RAW_SUM_GRAD: tl.constexpr,
                       BLOCK: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    ptrs = z_ptr + row * z_stride + cols
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    s, slope = transformed_logits(z, scale, softcap, inv_temperature, SCALED, SOFTCAPPED)
    stats = stats_ptr + row * K_STAT_COLUMNS
    coefficients = coefficients_ptr + row * K_COEFFICIENT_COLUMNS
    log_p = s - tl.load(stats + K_LSE)
    p = tl.exp(log_p)
    grad_s = -tl.load(coefficients + K_C_TOTAL) * p
    if N_LABELS > 0:
        label = tl.load(labels_ptr + row * labels_stride)
        grad_s += tl.where(cols == label, tl.load(coefficients + K_C_LABEL_0), 0.0)
    if N_LABELS > 1:
        label = tl.load(labels_ptr + row * labels_stride + 1)
        grad_s += tl.where(cols == label, tl.load(coefficients + K_C_LABEL_1), 0.0)
    if ENTROPY_GRAD:
        # p log p -> 0 where p = 0 (a -inf logit), not 0 * -inf.
        entropy_term = tl.where(p > 0.0, p * (log_p + tl.load(stats + K_ENTROPY)), 0.0)
        grad_s -= tl.load(coefficients + K_C_ENTROPY) * entropy_term
    grad_z = grad_s * slope
    if RAW_SUM_GRAD:
        grad_z += tl.load(coefficients + K_C_RAW_SUM)
    grad_z = round_to_dtype(grad_z, z_ptr.dtype.element_ty, ROUND_BY_HAND)
    tl.store(ptrs, grad_z.to(z_ptr.dtype.element_ty), mask=mask)


def transform_flags(scale: float, softcap: float | None, prefix: str = "") -> dict:
    """The constexpr switches of :func:`transformed_logits` for a side's ``(scale, softcap)``."""
    return {f"{prefix}SCALED": scale != 1.0, f"{prefix}SOFTCAPPED": softcap is not None}


def check_logit_transform(scale: float, softcap: float | None, scale_name: str = "logit_scale",
                          softcap_name: str = "softcap") -> None:
    """A logit scale must be finite, a soft-cap a finite number > 0 or None."""
    if not math.isfinite(scale):
        raise ValueError(f"{scale_name} must be finite, got {scale!r}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"{softcap_name} must be a finite number > 0 or None, got {softcap!r}")


def transform_logits(z: torch.Tensor, scale: float, softcap: float | None, temperature: float) -> torch.Tensor:
    """``cap(z * scale) / temperature`` with torch ops (differentiable; what :func:`transformed_logits`
    computes in the kernels)."""
    s = z * scale if scale != 1.0 else z
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return s / temperature if temperature != 1.0 else s


def row_statistics(logits: torch.Tensor, labels: torch.Tensor | None, *, temperature: float = 1.0,
                   softcap: float | None = None, scale: float = 1.0, entropy: bool = False,
                   sum_sq: bool = False, raw_sum: bool = False, transformed_sum: bool = False,
                   top1: bool = False) -> torch.Tensor:
    """(R, 9) float32 statistics of the (R, V) ``logits`` (columns: see the module constants).

    ``labels`` (R, J) int64 with J <= 2 and entries in [0, V), or None. Columns not asked
    for hold garbage. ``logits`` (rows contiguous) is not modified. Each row is split into
    column ranges walked by separate programs (enough programs to keep every SM's memory
    pipeline busy however few the rows), whose partial statistics are then combined.
    """
    n_rows, n_cols = logits.shape
    stats = torch.empty((n_rows, STAT_COLUMNS), device=logits.device, dtype=torch.float32)
    if n_rows == 0:
        return stats
    n_labels = 0 if labels is None else labels.shape[1]
    labels_arg = labels if labels is not None else stats
    config = launch_config(HeadEpilogueConfig)
    block = min(config.statistics_block, next_power_of_2(n_cols))
    wanted = max(1, config.statistics_programs_per_sm * multiprocessor_count(logits.device) // n_rows)
    n_splits = min(wanted, cdiv(n_cols, block))
    span = cdiv(cdiv(n_cols, n_splits), block) * block
    n_splits = cdiv(n_cols, span)
    partials = torch.empty((n_rows, n_splits, PARTIAL_COLUMNS), device=logits.device, dtype=torch.float32)
    launch_kernel(_row_statistics_kernel, (n_rows, n_splits), logits, logits.stride(0), labels_arg,
                  labels.stride(0) if labels is not None else 0, stats, partials, n_cols, span, float(scale),
                  float(softcap or 1.0), 1.0 / temperature, N_LABELS=n_labels, **transform_flags(scale, softcap),
                  ENTROPY=entropy, SUM_SQ=sum_sq, RAW_SUM=raw_sum, TRANSFORMED_SUM=transformed_sum, TOP1=top1,
                  BLOCK=block, num_warps=config.statistics_warps)
    _combine_partials(partials, stats, entropy, sum_sq, raw_sum, transformed_sum, top1)
    return stats


def logit_grad_(logits: torch.Tensor, labels: torch.Tensor | None, stats: torch.Tensor, coefficients: torch.Tensor,
                *, temperature: float = 1.0, softcap: float | None = None, scale: float = 1.0,
                entropy_grad: bool = False, raw_sum_grad: bool = False) -> torch.Tensor:
    """Overwrite ``logits`` (R, V) with ``dL/dz`` (see the module docstring) and return it.

    ``stats`` from :func:`row_statistics` of the same logits (with ``entropy`` where
    ``entropy_grad``), ``coefficients`` (R, 5) float32: ``[sum_j c_j, c_0, c_1, c_H, c_raw]``.
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return logits
    n_labels = 0 if labels is None else labels.shape[1]
    config = launch_config(HeadEpilogueConfig)
    block = min(config.gradient_block, next_power_of_2(n_cols))
    launch_kernel(_logit_grad_kernel, (n_rows, cdiv(n_cols, block)), logits, logits.stride(0),
                  labels if labels is not None else stats, labels.stride(0) if labels is not None else 0, stats,
                  coefficients, n_cols, float(scale), float(softcap or 1.0), 1.0 / temperature,
                  N_LABELS=n_labels, **transform_flags(scale, softcap), ENTROPY_GRAD=entropy_grad,
                  RAW_SUM_GRAD=raw_sum_grad, BLOCK=block, ROUND_BY_HAND=is_interpreter(),
                  num_warps=config.gradient_warps)
    return logits


class LogitRowStatistics:
    """A ``token_fn`` of the chunked head engine with a closed-form gradient.

    Per logit row ``z`` (R, V) and labels ``y_0 .. y_{J-1}`` (each (R,), J <= 2), the float32
    columns (in this order, each optional one only when asked for)::

        logp_j = s[y_j] - lse(s)      (0 where y_j == ignore_index)
        H      = entropy of softmax(s)            (``entropy``; 0 where y_0 == ignore_index)
        Q      = log sum_v softmax(s)_v^2         (``log_sum_sq_probs``; no gradient flows)
        S_raw  = sum_v z_v                        (``row_sum``)
        mean   = sum_v s_v / V                    (``mean_logits``; no gradient flows)
        top1   = 1.0 where y_0 is the first argmax of s, else 0.0   (``is_top1``; no gradient)

    with ``s = cap(z * logit_scale) / temperature`` (module docstring). A label outside
    [0, V) that is not ``ignore_index`` reads token 0. :meth:`statistics` and
    :meth:`logit_grad_` are the engine's in-place path (Triton, on the chunk in its own dtype);
    calling the object computes the columns with differentiable torch ops.
    """

    def __init__(self, ignore_index: int | None = None, temperature: float = 1.0, softcap: float | None = None,
                 logit_scale: float = 1.0, entropy: bool = False, log_sum_sq_probs: bool = False,
                 row_sum: bool = False, mean_logits: bool = False, is_top1: bool = False):
        check_temperature(temperature)
        check_logit_transform(logit_scale, softcap)
        self.ignore_index = ignore_index
        self.temperature, self.softcap, self.logit_scale = float(temperature), softcap, float(logit_scale)
        self.entropy, self.log_sum_sq_probs, self.row_sum = entropy, log_sum_sq_probs, row_sum
        self.mean_logits, self.is_top1 = mean_logits, is_top1

    def column_names(self, n_labels: int) -> list[str]:
        names = [f"logp_{j}" for j in range(n_labels)]
        for name in ("entropy", "log_sum_sq_probs", "row_sum", "mean_logits", "is_top1"):
            if getattr(self, name):
                names.append(name)
        return names

    def _labels(self, labels, vocab: int):
        """Per label: (counted (R,) bool or None, index (R,) int64 in [0, V))."""
        for label in labels:
            label = label.reshape(-1).long()
            counted = label != self.ignore_index if self.ignore_index is not None else None
            inside = (label >= 0) & (label < vocab)
            keep = inside if counted is None else inside & counted
            yield counted, torch.where(keep, label, torch.zeros_like(label))

    def __call__(self, logits: torch.Tensor, *labels: torch.Tensor) -> torch.Tensor:
        s = transform_logits(logits, self.logit_scale, self.softcap, self.temperature)
        lse = torch.logsumexp(s, dim=-1)
        label_info = list(self._labels(labels, logits.shape[-1]))
        columns = []
        for counted, index in label_info:
            logp = s.gather(-1, index.unsqueeze(-1)).squeeze(-1) - lse
            columns.append(logp if counted is None else logp * counted)
        first_counted = label_info[0][0] if label_info else None
        if self.entropy:
            log_p = s - lse.unsqueeze(-1)
            h = -(log_p.exp() * log_p).sum(-1)
            columns.append(h if first_counted is None else h * first_counted)
        if self.log_sum_sq_probs:
            columns.append((torch.logsumexp(2 * s, dim=-1) - 2 * lse).detach())
        if self.row_sum:
            columns.append(logits.sum(-1))
        if self.mean_logits:
            columns.append(s.mean(-1).detach())
        if self.is_top1:
            index = label_info[0][1] if label_info else torch.zeros_like(lse, dtype=torch.long)
            columns.append((s.argmax(-1) == index).to(s.dtype).detach())
        return torch.stack(columns, dim=-1)

    def _label_matrix(self, labels, vocab: int):
        if not labels:
            return None, []
        if len(labels) > MAX_LABELS:
            raise ValueError(f"at most {MAX_LABELS} label tensors, got {len(labels)}")
        info = list(self._labels(labels, vocab))
        return torch.stack([index for _, index in info], dim=1).contiguous(), [counted for counted, _ in info]

    def _options(self) -> dict:
        return dict(temperature=self.temperature, softcap=self.softcap, scale=self.logit_scale)

    def statistics(self, logits: torch.Tensor, *labels: torch.Tensor):
        """``(q, state)``: the columns (R, K) float32 of ``logits`` (R, V), unmodified, and what
        :meth:`logit_grad_` needs (its first element the (R, 9) statistics of :func:`row_statistics`)."""
        label_matrix, counted = self._label_matrix(labels, logits.shape[1])
        stats = row_statistics(logits, label_matrix, entropy=self.entropy, sum_sq=self.log_sum_sq_probs,
                               raw_sum=self.row_sum, transformed_sum=self.mean_logits, top1=self.is_top1,
                               **self._options())
        return self._columns(stats, logits.shape[1], label_matrix, counted)

    def statistics_from(self, stats: torch.Tensor, n_cols: int, *labels: torch.Tensor):
        """:meth:`statistics` of logits whose (R, 9) statistics a pass computed before (with at
        least the columns this object asks for), without reading the logits again."""
        label_matrix, counted = self._label_matrix(labels, n_cols)
        return self._columns(stats, n_cols, label_matrix, counted)

    def _columns(self, stats: torch.Tensor, n_cols: int, label_matrix, counted):
        lse = stats[:, LSE]
        columns = []
        for j, mask in enumerate(counted):
            logp = stats[:, LABEL_0 + j] - lse
            columns.append(logp if mask is None else logp * mask)
        first_counted = counted[0] if counted else None
        if self.entropy:
            h = stats[:, ENTROPY]
            columns.append(h if first_counted is None else h * first_counted)
        if self.log_sum_sq_probs:
            columns.append(stats[:, LOG_SUM_SQ])
        if self.row_sum:
            columns.append(stats[:, RAW_SUM])
        if self.mean_logits:
            columns.append(stats[:, TRANSFORMED_SUM] / n_cols)
        if self.is_top1:
            if label_matrix is None:
                raise ValueError("is_top1 needs a label")
            s_label = stats[:, LABEL_0]
            columns.append(((s_label >= stats[:, ROW_MAX]) & (s_label > stats[:, MAX_BEFORE_LABEL])).float())
        return torch.stack(columns, dim=-1), (stats, label_matrix, counted)

    def logit_grad_(self, logits: torch.Tensor, state, grad_q: torch.Tensor, *labels: torch.Tensor) -> torch.Tensor:
        """``dL/dz`` for ``grad_q = dL/dq`` (R, K), written over ``logits`` (returned)."""
        stats, label_matrix, counted = state
        grad_q = grad_q.float()
        n_rows = logits.shape[0]
        coefficients = torch.zeros((n_rows, COEFFICIENT_COLUMNS), device=logits.device, dtype=torch.float32)
        column = 0
        for j, mask in enumerate(counted):
            c = grad_q[:, column] if mask is None else grad_q[:, column] * mask
            coefficients[:, C_LABEL_0 + j] = c
            column += 1
        coefficients[:, C_TOTAL] = coefficients[:, C_LABEL_0:C_LABEL_0 + len(counted)].sum(-1)
        if self.entropy:
            c = grad_q[:, column]
            coefficients[:, C_ENTROPY] = c if not counted or counted[0] is None else c * counted[0]
            column += 1
        column += int(self.log_sum_sq_probs)
        if self.row_sum:
            coefficients[:, C_RAW_SUM] = grad_q[:, column]
        return logit_grad_(logits, label_matrix, stats, coefficients, entropy_grad=self.entropy,
                           raw_sum_grad=self.row_sum, **self._options())



class SavedRowStatistics:
    """The engine's closed-form ``token_fn`` for logits whose statistics an earlier pass over the
    same logits kept: called by the engine as ``statistics(z, *labels, saved)`` with ``saved`` the
    chunk's rows of those (R, 9) statistics, it skips the statistics pass and hands ``rows``'s
    gradient pass the saved numbers. Used where a forward pass computed per-token outputs and its
    backward recomputes the same logits (same chunks, same GEMM) to form their gradient."""

    def __init__(self, rows: LogitRowStatistics):
        self.rows = rows

    def __call__(self, logits: torch.Tensor, *labels_and_saved: torch.Tensor) -> torch.Tensor:
        """The columns with differentiable torch ops (recomputed: the engine's path for an empty batch)."""
        return self.rows(logits, *labels_and_saved[:-1])

    def statistics(self, logits: torch.Tensor, *labels_and_saved: torch.Tensor):
        *labels, saved = labels_and_saved
        return self.rows.statistics_from(saved, logits.shape[1], *labels)

    def logit_grad_(self, logits: torch.Tensor, state, grad_q: torch.Tensor, *labels_and_saved: torch.Tensor):
        return self.rows.logit_grad_(logits, state, grad_q, *labels_and_saved[:-1])
