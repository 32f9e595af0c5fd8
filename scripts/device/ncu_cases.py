"""Launch one kernel case a few times, for Nsight Compute (``ncu``) to profile.

Each case is one of the library's own launchers at a benchmark target shape (bf16), with
optional module tunables set first, so that ncu's counters (achieved occupancy, DRAM
throughput, warp stall reasons, registers) can be compared between a kernel that meets its
target and one that does not. The launches follow one warm-up (compilation) and sit inside
one NVTX range named ``case``, for ``ncu --nvtx --nvtx-include "case/"``.

Usage (on a GPU machine)::

    ncu --clock-control none --nvtx --nvtx-include "case/" --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        python scripts/device/ncu_cases.py layer_norm_forward \\
            --set liger_kernel.ops.utils.ROW_NORM_CENTERED_FORWARD_ELEMENTS_PER_THREAD=128
"""

from __future__ import annotations

import argparse
import ast
import importlib
from typing import Callable

import torch


def _set(assignment: str) -> None:
    target, value = assignment.split("=", 1)
    module_name, attr = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise SystemExit(f"{module_name} has no attribute {attr}")
    setattr(module, attr, ast.literal_eval(value))


def _cases(device: torch.device) -> dict[str, Callable[[], Callable[[], object]]]:
    from liger_kernel.ops.layer_norm import layer_norm_forward
    from liger_kernel.ops.rms_norm import rms_norm_forward
    from liger_kernel.ops.swiglu import gated_activation_backward, gated_activation_forward

    bf16 = torch.bfloat16

    def rms_norm() -> Callable[[], object]:
        x = torch.randn(16384, 4096, device=device, dtype=bf16)
        w = torch.rand(4096, device=device, dtype=bf16) + 0.5
        return lambda: rms_norm_forward(x, w, 1e-6, 0.0, "llama")

    def layer_norm() -> Callable[[], object]:
        x = torch.randn(16384, 4096, device=device, dtype=bf16)
        w = torch.rand(4096, device=device, dtype=bf16) + 0.5
        b = torch.randn(4096, device=device, dtype=bf16)
        return lambda: layer_norm_forward(x, w, b, 1e-6)

    def swiglu_forward() -> Callable[[], object]:
        a = torch.randn(16384, 14336, device=device, dtype=bf16)
        b = torch.randn(16384, 14336, device=device, dtype=bf16)
        return lambda: gated_activation_forward(a, b, 0)

    def swiglu_backward() -> Callable[[], object]:
        a = torch.randn(16384, 14336, device=device, dtype=bf16)
        b = torch.randn(16384, 14336, device=device, dtype=bf16)
        dh = torch.randn(16384, 14336, device=device, dtype=bf16)
        da, db = torch.empty_like(a), torch.empty_like(b)
        return lambda: gated_activation_backward(dh, a, b, 0, da, db)

    return {"rms_norm_forward": rms_norm, "layer_norm_forward": layer_norm,
            "swiglu_forward": swiglu_forward, "swiglu_backward": swiglu_backward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case")
    parser.add_argument("--set", action="append", default=[], help="module.ATTR=value, applied first")
    parser.add_argument("--launches", type=int, default=2)
    args = parser.parse_args()
    for assignment in args.set:
        _set(assignment)
    device = torch.device("cuda")
    cases = _cases(device)
    if args.case not in cases:
        raise SystemExit(f"unknown case {args.case!r}; known: {', '.join(cases)}")
    fn = cases[args.case]()
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("case")
    for _ in range(args.launches):
        fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
