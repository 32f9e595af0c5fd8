"""Registers, spills and shared memory of a kernel compiled for the H200, on a machine without a GPU.

Occupancy questions ("how many rows of this norm fit an SM?") need ptxas' register count,
which ncu reports only on the GPU. Triton compiles for any target without a device:
``triton.compile`` of the kernel's source with the launch's signature, its constexprs and
the 16-byte divisibility Triton's launcher would specialise on (without it the loads are
not vectorised and the counts double), then the ptxas Triton bundles, with ``-v``. With the
GPU image's Triton (3.6) importable, the counts equal ncu's on the H200 (LayerNorm forward
64 registers at 4 warps, 44 at 8; RMSNorm 34 at 8). A newer local Triton emits a PTX version
its bundled ptxas may not accept; the script then lowers the declared version.

Usage (CPU-only; TRITON_INTERPRET must be unset)::

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:src python scripts/kernel_registers.py layer_norm_forward --warps 4 8 \\
        [--set BLOCK_COLS=2048] [--cols 4096]
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile

# Tensors and ints Triton's launcher would mark divisible by 16 for a bf16 row of 4096.
_POINTER = "*bf16"


def _cases(cols: int) -> dict[str, tuple]:
    """case -> (kernel, signature, constexprs, names of args divisible by 16)."""
    from liger_kernel.ops import row_norm, row_norm_geometry, swiglu

    norm_signature = {"X": _POINTER, "W": _POINTER, "B": _POINTER, "Y": _POINTER, "MEAN": "*fp32",
                      "RSTD": "*fp32", "n_rows": "i32", "n_cols": "i32", "x_row_stride": "i32",
                      "y_row_stride": "i32", "eps": "fp32", "offset": "fp32"}
    norm_divisible = ("X", "W", "B", "Y", "MEAN", "RSTD", "n_cols", "x_row_stride", "y_row_stride")

    # Tile shapes from the library's own launch heuristics for 16384 rows on the H200's 132 SMs
    # (the warps are the --warps asked for).
    norm_launch = row_norm_geometry._row_norm_launch(16384, cols, 132,
                                                     row_norm_geometry.RowNormConfig.heuristic(16384, cols))

    def norm(center: bool) -> dict:
        return {"CENTER": center, "HAS_BIAS": center, "CASTING": 2 if center else 1, "FUSED": norm_launch.fused,
                "BLOCK_ROWS": norm_launch.block_rows, "BLOCK_COLS": norm_launch.block_cols, "ROUND_BY_HAND": False}

    gated_signature = {"A": _POINTER, "B": _POINTER, "H": _POINTER, "n_rows": "i32", "n_cols": "i32",
                       "a_row_stride": "i32", "b_row_stride": "i32", "h_row_stride": "i32"}
    gated_launch = swiglu.GatedActivationConfig.heuristic(16384, cols)
    gated = {"ACTIVATION": 0, "BLOCK_ROWS": gated_launch.block_rows, "BLOCK_COLS": gated_launch.block_cols,
             "ROUND_BY_HAND": False}
    return {
        "rms_norm_forward": (row_norm.row_norm_forward_kernel, norm_signature, norm(False), norm_divisible),
        "layer_norm_forward": (row_norm.row_norm_forward_kernel, norm_signature, norm(True), norm_divisible),
        "swiglu_forward": (swiglu.gated_activation_forward_kernel, gated_signature, gated,
                           ("A", "B", "H", "n_cols", "a_row_stride", "b_row_stride", "h_row_stride")),
    }


def _ptxas_report(ptx: str) -> str:
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for attempt in range(2):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
        os.unlink(f.name)
        unsupported = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", out.stderr)
        if unsupported and attempt == 0:
            ptx = re.sub(r"^\.version [\d.]+", f".version {unsupported.group(1)}", ptx, count=1, flags=re.M)
            continue
        lines = [line.split("info    :")[-1].strip() for line in out.stderr.splitlines()
                 if "registers" in line or "spill" in line]
        return "; ".join(lines) if lines else out.stderr.strip()
    return "ptxas failed"


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels this script compiles", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("case")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--cols", type=int, default=4096, help="row width the case's tile is sized for")
    p.add_argument("--set", action="append", default=[], help="CONSTEXPR=value, overriding the case's")
    args = p.parse_args()

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cases = _cases(args.cols)
    if args.case not in cases:
        print(f"unknown case {args.case!r}; known: {', '.join(cases)}", file=sys.stderr)
        return 2
    kernel, signature, constexprs, divisible = cases[args.case]
    constexprs = dict(constexprs)
    for assignment in args.set:
        name, value = assignment.split("=", 1)
        constexprs[name] = ast.literal_eval(value)
    full_signature = {**signature, **{name: "constexpr" for name in constexprs}}
    names = list(full_signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    print(f"triton {triton.__version__}, sm_90a, {args.case} {constexprs}")
    for warps in args.warps:
        compiled = triton.compile(ASTSource(fn=kernel, signature=full_signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        print(f"  {warps:2d} warps: {_ptxas_report(compiled.asm['ptx'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
