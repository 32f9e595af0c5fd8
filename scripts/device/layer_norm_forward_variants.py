"""LayerNorm forward variants against the library's (GPU experiment, not a test).

The LayerNorm forward runs at 0.88 of its floor (target 0.90), RMSNorm's at 0.90-0.91. Two
prototypes, each computing what the library computes (centred variance, fp32, rounded once):

* **one reduction**: each thread reduces its own VEC contiguous elements in registers (mean
  and centred M2), and the (mean, M2, count) triples are merged across the block in one
  ``tl.reduce`` with Chan et al.'s pairwise update (``delta = mean_b - mean_a``;
  ``mean = mean_a + delta n_b / n``; ``M2 = M2_a + M2_b + delta^2 n_a n_b / n``) instead of two
  dependent block reductions; also without its bias, to time what the bias load costs.
* **resident parameters**: persistent programs (PROGRAMS_PER_SM of them per SM) that load the
  weight and bias once into registers and walk rows P apart, each row's load issued one row
  ahead; the row statistics as the library computes them (mean, then centred sum of squares).

Outputs are compared with the library's first; times are ``triton.testing.do_bench`` medians
in alternating rounds, with a torch copy of the same bytes for scale
(``same_size_copy_ratio`` = copy time / kernel time).

Usage: ``python scripts/device/layer_norm_forward_variants.py --out OUT [--rounds 3]``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import variant_timing  # noqa: E402


@triton.jit
def _chan_merge(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    n = n_a + n_b
    share_b = n_b / n
    delta = mean_b - mean_a
    return mean_a + delta * share_b, m2_a + m2_b + delta * delta * n_a * share_b, n


@triton.jit
def _layer_norm_forward_one_reduction(X, W, B, Y, MEAN, RSTD, n_cols, eps,
                                      BLOCK: tl.constexpr, VEC: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * n_cols + cols).to(tl.float32)
    groups = tl.reshape(x, [BLOCK // VEC, VEC])
    local_mean = tl.sum(groups, axis=1) / VEC
    local_d = groups - local_mean[:, None]
    local_m2 = tl.sum(local_d * local_d, axis=1)
    count = tl.full([BLOCK // VEC], VEC, tl.float32)
    mean, m2, _ = tl.reduce((local_mean, local_m2, count), 0, _chan_merge)
    rstd = tl.rsqrt(m2 / n_cols + eps)
    w = tl.load(W + cols).to(tl.float32)
    y = (x - mean) * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols).to(tl.float32)
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty))
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_forward_resident(X, W, B, Y, MEAN, RSTD, n_rows, n_cols, eps,
                                 BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    w = tl.load(W + cols).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols).to(tl.float32)
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    lane_zero = tl.zeros([BLOCK], dtype=tl.int32)  # row indices as vectors: the interpreter masks need them
    next_x = tl.load(X + (lane_zero + pid).to(tl.int64) * n_cols + cols, mask=(lane_zero + pid) < n_rows, other=0.0)
    for row in tl.range(pid, n_rows, step):
        x = next_x.to(tl.float32)
        ahead = row + step
        next_x = tl.load(X + (lane_zero + ahead).to(tl.int64) * n_cols + cols, mask=(lane_zero + ahead) < n_rows,
                         other=0.0)
        mean = tl.sum(x, axis=0) / n_cols
        xc = x - mean
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
        y = xc * rstd * w
        if HAS_BIAS:
            y += b
        tl.store(Y + (lane_zero + row).to(tl.int64) * n_cols + cols, y.to(Y.dtype.element_ty))
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)


def layer_norm_forward_resident(x, w, b, eps, warps: int, programs_per_sm: int):
    """(y, mean, rstd) of the resident-parameter prototype; ``b=None``: no bias."""
    n, d = x.shape
    assert d == triton.next_power_of_2(d), "prototype: power-of-two rows only"
    y = torch.empty_like(x)
    mean = torch.empty(n, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    if x.device.type == "cuda":
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    else:
        sms = 2
    grid = (min(n, sms * programs_per_sm),)
    _layer_norm_forward_resident[grid](x, w, b if b is not None else w, y, mean, rstd, n, d, eps, BLOCK=d,
                                       HAS_BIAS=b is not None, num_warps=warps)
    return y, mean, rstd


def layer_norm_forward_one_reduction(x, w, b, eps, warps: int, vec: int = 8):
    """(y, mean, rstd) of the prototype; ``b=None``: no bias (times the bias load costs)."""
    n, d = x.shape
    assert d == triton.next_power_of_2(d), "prototype: power-of-two rows only"
    y = torch.empty_like(x)
    mean = torch.empty(n, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _layer_norm_forward_one_reduction[(n,)](x, w, b if b is not None else w, y, mean, rstd, d, eps, BLOCK=d, VEC=vec,
                                            HAS_BIAS=b is not None, num_warps=warps)
    return y, mean, rstd


def measure_shape(n: int, d: int, rounds: int, rows: list[dict]) -> None:
    from liger_kernel.ops.layer_norm import layer_norm_forward

    eps = variant_timing.EPS
    x, w, b, variants = variant_timing.norm_case(n, d, scale=3.0, shift=1.0)
    variants["lib layer_norm no bias"] = lambda: layer_norm_forward(x, w, None, eps)
    y_ref, mean_ref, rstd_ref = layer_norm_forward(x, w, b, eps)

    def check(name: str, fn) -> None:
        """Compare fn's (y, mean, rstd) with the library's, record it, add fn to the variants."""
        y, mean, rstd = fn()
        status = (f"max|dy| {(y.float() - y_ref.float()).abs().max().item():.3g}, "
                  f"max rel drstd {((rstd - rstd_ref).abs() / rstd_ref).max().item():.3g}, "
                  f"max|dmean| {(mean - mean_ref).abs().max().item():.3g}")
        print(f"{n}x{d} {name}: {status}", flush=True)
        rows.append({"shape": f"{n}x{d}", "variant": name + " check", "status": status})
        variants[name] = fn
    for warps in (4, 8, 16):
        for vec in (8, 16):
            name = f"one-reduction layer_norm warps={warps} vec={vec}"

            def fn(warps=warps, vec=vec):
                return layer_norm_forward_one_reduction(x, w, b, eps, warps, vec)

            check(name, fn)
    for warps in (4, 8):
        variants[f"one-reduction layer_norm warps={warps} vec=8 no bias"] = (
            lambda warps=warps: layer_norm_forward_one_reduction(x, w, None, eps, warps, 8))
    for warps, per_sm in ((4, 4), (4, 6), (4, 8), (8, 2), (8, 3), (8, 4), (16, 1), (16, 2)):
        name = f"resident layer_norm warps={warps} programs/SM={per_sm}"

        def fn(warps=warps, per_sm=per_sm):
            return layer_norm_forward_resident(x, w, b, eps, warps, per_sm)

        check(name, fn)
    variant_timing.time_variants(variants, f"{n}x{d}", rounds, rows)


if __name__ == "__main__":
    variant_timing.main(measure_shape, "layer_norm_forward_variants.csv", __doc__.split("\n\n")[0])
