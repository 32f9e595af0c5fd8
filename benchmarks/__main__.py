"""``python -m benchmarks``: every kernel against HF eager and torch.compile, in one run.

Measures the hardware ceilings first (copy bandwidth, matmul rate), then for each op the
target shape from the issues and (without ``--quick``) a sweep of sizes: forward,
backward and full, median ms, peak extra memory, floor and efficiency. Writes
``bench.csv`` (row by row, so an interrupted run keeps what it measured) and ``bench.png``
(``benchmarks.plots``: per op, speed-up against HF eager and torch.compile, peak memory, and
time against size) into ``--out``, prints a table and,
last, each target with its measured value and PASS/FAIL.

Without CUDA (or with ``--cpu-tiny``) it runs tiny shapes on CPU through Triton's
interpreter, so CI exercises the whole pipeline; those numbers mean nothing for a GPU.

Exit status: 0 when every case ran (targets missed or not), 1 when a case raised
(a kernel error, a missing module); out-of-memory cases are recorded as ``oom``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import sys
import time
from pathlib import Path

from benchmarks.harness import MODES, PROVIDERS  # harness imports torch, not triton
from benchmarks.peers import PEER_NAMES, UPSTREAM
from benchmarks.specs import OPS, load_specs

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _csv_choice(allowed: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        if items == ("all",):
            return allowed
        unknown = [x for x in items if x not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown) or '(none given)'}; choose from {', '.join(allowed)} or all")
        return tuple(x for x in allowed if x in items)  # canonical order

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="only the target shape of each op")
    p.add_argument("--ops", type=_csv_choice(OPS, "op"), default=OPS, help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--modes", type=_csv_choice(MODES, "mode"), default=MODES, help="comma list of forward,backward,full")
    p.add_argument("--providers", type=_csv_choice(PROVIDERS, "provider"), default=PROVIDERS,
                   help="comma list of liger,hf_eager,torch_compile")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for bench.csv and bench.png (default benchmarks/results/<gpu kind>/)")
    p.add_argument("--cpu-tiny", action="store_true",
                   help="tiny shapes on CPU through the Triton interpreter (automatic without CUDA)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up per case, ms (default 25)")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench timing window per case, ms (default 100)")
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="stop starting new cases after this many seconds (recorded as skipped); 0 = no limit")
    p.add_argument("--compile-sweep", action="store_true",
                   help="torch.compile every sweep shape too (default: target shapes only; compiling is slow)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="time every call eagerly (host overhead included) instead of as CUDA-graph replays")
    p.add_argument("--no-plots", action="store_true", help="skip bench.png")
    p.add_argument("--profile", action="store_true",
                   help="after timing each case, profile one more call: device time by kind of kernel (GEMM, "
                        "Triton, Inductor, copies, other) and idle time, then the SM clock and power over "
                        "half a second of back-to-back calls, into kernel_profile.csv/.txt "
                        "(benchmarks/kernel_profile.py)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.ConfigClass.field=VALUE", dest="overrides",
                   help="override a launch-configuration field for this run, e.g. "
                        "liger_kernel.ops.cross_entropy.CrossEntropyConfig.prefetch=False "
                        "(repeatable; recorded in overrides.txt)")
    p.add_argument("--list", action="store_true", help="print the ops and their shapes, then exit")
    p.add_argument("--peers", type=_csv_choice(PEER_NAMES, "peer"), default=(),
                   help=f"optional providers (benchmarks.peers): comma list of {', '.join(PEER_NAMES)} or all")
    p.add_argument("--upstream-path", default=os.environ.get("LIGER_UPSTREAM_PATH", ""),
                   help="directory holding the upstream liger_kernel (peer liger_upstream; env LIGER_UPSTREAM_PATH)")
    return p.parse_args(argv)


def choose_device(cpu_tiny: bool) -> str:
    """``"cuda"`` or ``"cpu"``; for CPU, switch Triton to its interpreter before it is imported."""
    import torch  # importing torch does not import triton

    if not cpu_tiny and torch.cuda.is_available():
        return "cuda"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 could be set; "
                           "run `python -m benchmarks --cpu-tiny` in a fresh process")
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def apply_overrides(overrides: list[str], stack: contextlib.ExitStack) -> list[str]:
    """Put launch-configuration overrides (``package.module.ConfigClass.field=python-literal``) in
    force for the rest of the run, through ``override_launch_config`` entered on ``stack``;
    returns them as applied."""
    import ast
    import dataclasses
    import importlib

    from liger_kernel.ops.config import LaunchConfig, override_launch_config

    applied = []
    for item in overrides:
        target, sep, text = item.partition("=")
        class_path, _, field = target.strip().rpartition(".")
        module_name, _, class_name = class_path.rpartition(".")
        if not sep or not module_name:
            raise SystemExit(f"--set expects MODULE.ConfigClass.field=VALUE, got {item!r}")
        config_cls = getattr(importlib.import_module(module_name), class_name, None)
        if not (isinstance(config_cls, type) and issubclass(config_cls, LaunchConfig)):
            raise SystemExit(f"--set: {module_name}.{class_name} is not a launch configuration class")
        if field not in {f.name for f in dataclasses.fields(config_cls)}:
            raise SystemExit(f"--set: {class_name} has no field {field}")
        value = ast.literal_eval(text.strip())
        stack.enter_context(override_launch_config(config_cls, **{field: value}))
        applied.append(f"{module_name}.{class_name}.{field}={value!r}")
    return applied


def default_out_dir(device_label: str) -> Path:
    """``benchmarks/results/<gpu kind>/``, e.g. ``nvidia-h100`` for "NVIDIA H100 80GB HBM3": the
    folder that keeps the latest run per GPU kind, so a new run replaces the committed one."""
    label = device_label.lower()
    kind = re.match(r"(nvidia|amd)[^a-z0-9]+([a-z]+\d+[a-z]?)", label)
    slug = f"{kind[1]}-{kind[2]}" if kind else re.sub(r"[^a-z0-9]+", "-", label).strip("-")
    return RESULTS_DIR / slug


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device_type = choose_device(args.cpu_tiny)
    tiny = device_type == "cpu"

    import torch  # after the interpreter switch

    from benchmarks import harness
    from benchmarks.kernel_profile import ProfileLog

    specs = load_specs(args.ops)
    if args.list:
        for spec in specs:
            shapes = spec.tiny_shapes if tiny else spec.gpu_shapes
            print(f"{spec.name}: " + "; ".join(harness.shape_text(s) for s in (shapes[:1] if args.quick else shapes)))
        return 0

    device = torch.device(device_type)
    if tiny:
        # One thread: the tiny CPU ops gain nothing from more, and with other work on the
        # machine the thread pool's hand-offs add scheduler-sized stalls to the timings.
        torch.set_num_threads(1)
    label = "cpu-interpreter" if tiny else torch.cuda.get_device_name(device)
    out = args.out or default_out_dir(label)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    overrides_in_force = contextlib.ExitStack()
    applied = apply_overrides(args.overrides, overrides_in_force)
    if applied:
        (out / "overrides.txt").write_text("\n".join(applied) + "\n")
        print("tunables overridden for this run: " + ", ".join(applied), flush=True)
    from benchmarks import peers

    extra = tuple(peers.register(args.peers, device))
    if args.peers:
        print("peers: " + (peers.describe(extra) or "none in-process")
              + (f"; {UPSTREAM} from {args.upstream_path or '(no path)'}" if UPSTREAM in args.peers else ""), flush=True)
    timing = harness.TimingConfig(warmup_ms=args.warmup, rep_ms=args.rep, cuda_graph=not args.no_cuda_graph)
    cfg = harness.RunConfig(
        device=device, dtype=getattr(torch, DTYPES[args.dtype]), modes=args.modes, providers=args.providers + extra,
        quick=args.quick, tiny=tiny, compile_sweep=args.compile_sweep, max_seconds=args.max_seconds, timing=timing,
        profile=ProfileLog(out) if args.profile else None,
    )
    print(f"measuring hardware ceilings on {label} ...", file=sys.stderr, flush=True)
    hw = harness.measure_hardware(device, timing)
    print(hw.describe(), flush=True)
    csv_path = out / "bench.csv"
    runner = harness.Runner(cfg, hw, csv_path=csv_path)
    started = time.perf_counter()
    with overrides_in_force:
        rows = runner.run(specs)
    if UPSTREAM in args.peers:
        # The child gets the GPU this process no longer uses: without this, the memory cached by
        # the materialised peers' rows (tens of GiB) made the child's larger cases run out.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        left = max(30.0, args.max_seconds - (time.perf_counter() - started)) if args.max_seconds else 0.0
        rows += peers.run_upstream_ops(args.upstream_path, cfg, hw, [s.name for s in specs],
                                       log=lambda msg: print(msg, file=sys.stderr, flush=True), max_seconds=left)
        peers.merge_speedups(rows)
    rows = harness.sort_rows(rows, specs)
    harness.write_csv(rows, csv_path)  # the same rows, now sorted (it was written as they came)

    print(harness.format_table(rows))
    print(f"\nCSV: {csv_path}")
    if cfg.profile is not None:
        print(f"kernel profile: {cfg.profile.csv_path}, {cfg.profile.text_path}")
    if not args.no_plots:
        from benchmarks import plots

        png = plots.plot_rows([r.csv_dict() for r in rows], out / "bench.png")
        if png is not None:
            print(f"plot: {png}")
    print(hw.describe())
    print(harness.format_targets(rows, specs, tiny), flush=True)
    return 1 if runner.errors else 0


if __name__ == "__main__":
    sys.exit(main())
