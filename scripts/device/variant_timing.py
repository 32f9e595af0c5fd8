"""Shared driver of the kernel-variant experiments in scripts/device (GPU only, not a test).

Each experiment defines ``measure_shape(n, d, rounds, rows)``, which builds its variants
(callables, one of them named ``"copy"``: a torch copy of the same bytes), checks them
against the library and calls :func:`time_variants`; :func:`main` runs it over the shapes
and writes one CSV whose rows carry the GPU, the versions and the date.
"""

from __future__ import annotations

import argparse
import csv
import datetime
from collections.abc import Callable
from pathlib import Path

import torch
import triton

EPS = 1e-6


def norm_case(n: int, d: int, scale: float = 1.0, shift: float = 0.0):
    """bf16 inputs of the norm experiments and their baselines: ``(x, w, b, variants)`` with x
    (n, d) ~ scale * N(0, 1) + shift, weight in [0.5, 1.5), a normal bias, and ``variants``
    holding the same-size ``copy`` and the library's LayerNorm and RMSNorm ("llama") forwards."""
    from liger_kernel.ops.layer_norm import layer_norm_forward
    from liger_kernel.ops.rms_norm import rms_norm_forward

    device, bf16 = torch.device("cuda"), torch.bfloat16
    x = torch.randn(n, d, device=device, dtype=bf16) * scale + shift
    w = torch.rand(d, device=device, dtype=bf16) + 0.5
    b = torch.randn(d, device=device, dtype=bf16)
    copy_dst = torch.empty_like(x)
    variants = {
        "copy": lambda: copy_dst.copy_(x),
        "lib layer_norm": lambda: layer_norm_forward(x, w, b, EPS),
        "lib rms_norm": lambda: rms_norm_forward(x, w, EPS, 0.0, "llama"),
    }
    return x, w, b, variants


FIELDS = ["shape", "variant", "median_ms_per_round", "same_size_copy_ratio", "status"]


def time_variants(variants: dict[str, Callable[[], object]], shape: str, rounds: int, rows: list[dict]) -> None:
    """``triton.testing.do_bench`` medians, rounds alternating between the variants; appends
    one row per variant with every round's median and copy time / best time."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(triton.testing.do_bench(fn, warmup=50, rep=300))
    copy_ms = min(times["copy"])
    for name, ts in times.items():
        ratio = copy_ms / min(ts)
        print(f"{shape} {name:50s} {' '.join(f'{t:.4f}' for t in ts)} ms  vs copy {ratio:.3f}", flush=True)
        rows.append({"shape": shape, "variant": name, "median_ms_per_round": " ".join(f"{t:.5f}" for t in ts),
                     "same_size_copy_ratio": f"{ratio:.3f}", "status": "ok"})


def main(measure_shape: Callable[[int, int, int, list[dict]], None], csv_name: str, description: str,
         shapes: tuple[tuple[int, int], ...] = ((16384, 4096), (8192, 2048))) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for n, d in shapes:
        measure_shape(n, d, args.rounds, rows)
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat()}
    with open(args.out / csv_name, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*meta, *FIELDS])
        writer.writeheader()
        writer.writerows({**meta, **row} for row in rows)
