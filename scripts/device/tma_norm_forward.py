"""Would Hopper's bulk tensor copies (TMA) lift the norm forwards? (GPU experiment, not a test.)

Run 9 found both norm forwards pressing against L2 throughput (87-92% of its peak) with
DRAM at 76-81%, and the LayerNorm forward 2% short of its 0.90 target. A TMA load moves a
whole row tile from L2 to shared memory in one bulk request instead of one request per
sector from every thread, which may lower L2's request load for the same bytes.

This script times, at the benchmark shapes (bf16), the library's own forwards against a
prototype that loads (and optionally stores) each row through a host-side
``TensorDescriptor``: the row of ``n_cols`` elements is viewed as ``n_cols / SEG`` rows of
``SEG`` (TMA boxes are at most 256 elements a side), reduced over both axes. The
prototype computes exactly what the library does for LayerNorm (statistics and output in
fp32, rounded once) and for RMSNorm in "llama" casting (xhat rounded to the input dtype,
then times the weight); each variant's output is compared with the library's first.

Timing: ``triton.testing.do_bench`` medians, rounds alternating between variants, plus a
device-to-device copy of the same bytes: ``same_size_copy_ratio`` = copy time / kernel time
(not the benchmark's efficiency, whose bandwidth comes from a 4 GiB copy).

Usage: ``python scripts/device/tma_norm_forward.py --out OUT [--rounds 3]``
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import variant_timing  # noqa: E402


@triton.jit
def _tma_norm_forward_kernel(x_desc, y_desc, Y, W, B, MEAN, RSTD, n_cols, eps,
                             CENTER: tl.constexpr, SEG: tl.constexpr, SEGS: tl.constexpr,
                             STORE_TMA: tl.constexpr):
    row = tl.program_id(0)
    x = x_desc.load([row * SEGS, 0]).to(tl.float32)  # [SEGS, SEG]: the whole row
    offs = tl.arange(0, SEGS)[:, None] * SEG + tl.arange(0, SEG)[None, :]
    w = tl.load(W + offs).to(tl.float32)
    if CENTER:
        mean = tl.sum(tl.sum(x, axis=1), axis=0) / n_cols
        xc = x - mean
        rstd = tl.rsqrt(tl.sum(tl.sum(xc * xc, axis=1), axis=0) / n_cols + eps)
        y = xc * rstd * w + tl.load(B + offs).to(tl.float32)
        tl.store(MEAN + row, mean)
    else:
        rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / n_cols + eps)
        y = (x * rstd).to(Y.dtype.element_ty).to(tl.float32) * w
    tl.store(RSTD + row, rstd)
    if STORE_TMA:
        y_desc.store([row * SEGS, 0], y.to(Y.dtype.element_ty))
    else:
        tl.store(Y + row.to(tl.int64) * n_cols + offs, y.to(Y.dtype.element_ty))


def tma_norm_forward(x, w, b, eps, center: bool, seg: int, warps: int, store_tma: bool):
    n, d = x.shape
    segs = d // seg
    y = torch.empty_like(x)
    x_desc = TensorDescriptor.from_tensor(x.view(n * segs, seg), [segs, seg])
    y_desc = TensorDescriptor.from_tensor(y.view(n * segs, seg), [segs, seg])
    mean = torch.empty(n, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _tma_norm_forward_kernel[(n,)](x_desc, y_desc, y, w, b if b is not None else w, mean, rstd, d, eps,
                                   CENTER=center, SEG=seg, SEGS=segs, STORE_TMA=store_tma,
                                   num_warps=warps)
    return y


def measure_shape(n: int, d: int, rounds: int, rows: list[dict]) -> None:
    """Check and time every variant at one (rows, hidden) shape; append CSV rows."""
    from liger_kernel.ops.layer_norm import layer_norm_forward
    from liger_kernel.ops.rms_norm import rms_norm_forward

    eps = variant_timing.EPS
    x, w, b, variants = variant_timing.norm_case(n, d)
    expected = {True: layer_norm_forward(x, w, b, eps)[0], False: rms_norm_forward(x, w, eps, 0.0, "llama")[0]}
    for center, seg, warps, store_tma in itertools.product((True, False), (128, 256), (4, 8), (False, True)):
        name = (f"tma {'layer_norm' if center else 'rms_norm'} seg={seg} warps={warps} "
                f"store={'tma' if store_tma else 'plain'}")

        def fn(center=center, seg=seg, warps=warps, store_tma=store_tma):
            return tma_norm_forward(x, w, b, eps, center, seg, warps, store_tma)

        try:
            diff = (fn().float() - expected[center].float()).abs().max().item()
        except Exception as exc:  # a variant that does not compile: record it, go on
            print(f"{n}x{d} {name}: error {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            rows.append({"shape": f"{n}x{d}", "variant": name, "status": f"error: {type(exc).__name__}"})
            continue
        variants[name] = fn
        print(f"{n}x{d} {name}: max |diff| vs library {diff:.3g}", flush=True)
        rows.append({"shape": f"{n}x{d}", "variant": name + " check", "status": f"max|diff| {diff:.3g}"})
    variant_timing.time_variants(variants, f"{n}x{d}", rounds, rows)


if __name__ == "__main__":
    variant_timing.main(measure_shape, "tma_norm_forward.csv", __doc__.split("\n\n")[0])
