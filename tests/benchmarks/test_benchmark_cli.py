"""CPU smoke test of ``python -m benchmarks`` plus unit checks of the harness arithmetic.

The CLI runs as a subprocess with ``--cpu-tiny`` (tiny shapes, Triton interpreter), even on
a GPU machine, so this stays a fast check of the pipeline: every op, mode and provider
produces a CSV row, the PNG is written and the targets summary is printed. The floors are
checked against the numbers the issues derive from the H200 ceilings (copy 4.27 TB/s,
bf16 matmul 687 TFLOP/s), so a wrong byte or FLOP count shows up here, not on the GPU.
"""

from __future__ import annotations

import csv
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import __main__ as cli
from benchmarks import harness
from tests.utils import cpu_interpreter_problem

REPO = Path(__file__).resolve().parents[2]
H200 = harness.Hardware(device="cuda", name="H200 (issue numbers)", copy_bytes_per_s=4.27e12,
                        copy_buffer_bytes=4 * 2**30, matmul_flops_per_s=687e12, matmul_size=8192,
                        matmul_dtype="bfloat16")


def _run_cli(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    problem = cpu_interpreter_problem() if torch.cuda.is_available() else None
    if problem:
        pytest.skip(f"--cpu-tiny: {problem}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "benchmarks", "--cpu-tiny", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_cli_every_op_liger_and_eager(tmp_path):
    out = tmp_path / "bench"
    proc = _run_cli(["--quick", "--ops", ",".join(cli.OPS), "--providers", "liger,hf_eager", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _read_rows(out / "bench.csv")
    seen = {(r["op"], r["mode"], r["provider"]) for r in rows}
    expected = {(op, mode, p) for op in cli.OPS for mode in harness.MODES for p in ("liger", "hf_eager")}
    assert seen == expected
    assert len(rows) == len(expected)
    for r in rows:
        assert r["status"] == "ok", r
        assert float(r["median_ms"]) > 0 and float(r["floor_ms"]) > 0
        assert float(r["efficiency"]) == pytest.approx(float(r["floor_ms"]) / float(r["median_ms"]), rel=1e-3)
        assert r["peak_extra_mib"] == ""  # not measured on CPU
        assert r["gpu_name"] and r["torch"] == torch.__version__ and r["triton"] and r["date"]
        assert r["is_target_shape"] == "True"
        if r["provider"] == "liger":
            assert "peak<=hf_eager" in r["target"]
            assert r["speedup_vs_hf"] != ""
    # shape parameters land in their own columns
    rope = next(r for r in rows if r["op"] == "rope")
    assert all(rope[k] for k in ("B", "T", "Hq", "Hk", "D")) and rope["N"] == ""
    png = out / "bench.png"
    assert png.exists() and png.stat().st_size > 10_000
    assert "=== targets" in proc.stdout and "targets met:" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("targets met:")
    assert "[1/" in proc.stderr  # progress counter


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU (inductor) needs a C++ compiler")
def test_cli_torch_compile_provider_and_sweep(tmp_path):
    # One compiled case (CPU inductor compiles take tens of seconds) plus the sweep shape.
    out = tmp_path / "bench"
    proc = _run_cli(["--ops", "rms_norm", "--modes", "full", "--providers", "torch_compile,liger", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _read_rows(out / "bench.csv")
    compiled = [r for r in rows if r["provider"] == "torch_compile"]
    assert len(compiled) == 1 and compiled[0]["status"] == "ok" and compiled[0]["is_target_shape"] == "True"
    liger = [r for r in rows if r["provider"] == "liger"]
    assert len(liger) == 2 and {r["is_target_shape"] for r in liger} == {"True", "False"}


def test_cli_rejects_unknown_names():
    with pytest.raises(SystemExit):
        cli.parse_args(["--ops", "rms_norm,softmax"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--providers", "cuda_graphs"])
    args = cli.parse_args(["--ops", "rope,rms_norm", "--modes", "full"])
    assert args.ops == ("rms_norm", "rope") and args.modes == ("full",)


# The floors the issues state for an H200 (ms at 4.27 TB/s or 687 TFLOP/s), to their precision.
ISSUE_FLOORS = [
    ("rms_norm", "full", 0.157, 0.002),
    ("rms_norm", "forward", 0.063, 0.001),
    ("rope", "full", 0.157, 0.002),
    ("swiglu", "full", 0.88, 0.01),
    ("cross_entropy", "full", 0.98, 0.01),
    ("fused_linear_cross_entropy", "full", 37.6, 0.1),
]


@pytest.mark.parametrize("op,mode,floor_ms,tol", ISSUE_FLOORS)
def test_floors_match_the_issues(op, mode, floor_ms, tol):
    (spec,) = cli.load_specs((op,))
    target_shape = spec.gpu_shapes[0]
    assert spec.floor(target_shape, torch.bfloat16, mode).ms(H200) == pytest.approx(floor_ms, abs=tol)


def test_flce_memory_floor_is_dw_plus_dx():
    (spec,) = cli.load_specs(("fused_linear_cross_entropy",))
    mib = spec.floor_peak_bytes(spec.gpu_shapes[0], torch.bfloat16, "full") / 2**20
    assert mib == pytest.approx(1066, abs=1)


def test_target_shapes_and_sweeps():
    specs = {s.name: s for s in cli.load_specs(cli.OPS)}
    assert specs["rms_norm"].gpu_shapes[0] == {"N": 16384, "H": 4096}
    assert specs["rope"].gpu_shapes[0] == {"B": 4, "T": 4096, "Hq": 32, "Hk": 8, "D": 128}
    assert specs["swiglu"].gpu_shapes[0] == {"N": 16384, "H": 14336}
    ce, flce = specs["cross_entropy"], specs["fused_linear_cross_entropy"]
    assert ce.gpu_shapes[0] == {"N": 8192, "V": 128256} and len(ce.gpu_shapes) == 9
    assert flce.gpu_shapes[0] == {"N": 8192, "D": 4096, "V": 128256} and len(flce.gpu_shapes) == 18
    assert len({harness.shape_text(s) for s in flce.gpu_shapes}) == 18


# --------------------------------------------------------------------------------------
# The runner's bookkeeping, in-process on a toy op (no kernels involved)
# --------------------------------------------------------------------------------------


def _toy_spec(liger, mutates=()) -> harness.OpSpec:
    def make_inputs(shape, dtype, device):
        x = torch.randn(shape["N"], device=device, dtype=dtype, requires_grad=True)
        return harness.Inputs(args=(x,), grad_args=(0,), grad_output=torch.randn(shape["N"], dtype=dtype))

    return harness.OpSpec(
        name="toy", shape_keys=("N",), gpu_shapes=[{"N": 8}], tiny_shapes=[{"N": 8}, {"N": 16}],
        make_inputs=make_inputs, reference=lambda x: x * 2, liger=liger,
        floor=lambda shape, dtype, mode: harness.Floor(bytes=shape["N"] * 4),
        floor_peak_bytes=lambda shape, dtype, mode: 0.0, size=lambda s: s["N"], size_label="N",
        targets=(harness.Target("full", "efficiency", 0.5),), liger_mutates=mutates,
    )


def _run_toy(spec, tmp_path, **kw):
    cfg = harness.RunConfig(device=torch.device("cpu"), dtype=torch.float32, tiny=True,
                            providers=("liger", "hf_eager"), timing=harness.TimingConfig(cpu_reps=2), **kw)
    hw = harness.Hardware("cpu", "cpu", 1e10, 1, 1e10, 1, "float32")
    runner = harness.Runner(cfg, hw, csv_path=tmp_path / "toy.csv", log=lambda msg: None)
    return runner, runner.run([spec])


def test_runner_records_errors_and_oom_and_keeps_going(tmp_path):
    def missing():
        raise ImportError("No module named 'liger_kernel.ops.toy'")

    runner, rows = _run_toy(_toy_spec(missing), tmp_path, quick=True)
    assert runner.errors == 3
    assert {r.status for r in rows if r.provider == "liger"} == {"error: ImportError: No module named "
                                                                 "'liger_kernel.ops.toy'"}
    assert {r.status for r in rows if r.provider == "hf_eager"} == {"ok"}

    def oom_provider():
        def fn(x):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return fn

    runner, rows = _run_toy(_toy_spec(oom_provider), tmp_path, quick=True)
    assert runner.errors == 0
    assert {r.status for r in rows if r.provider == "liger"} == {"oom"}
    assert len(_read_rows(tmp_path / "toy.csv")) == 6
    text = harness.format_targets(rows, [_toy_spec(oom_provider)], tiny=True)
    assert "FAIL" in text and "1 oom" not in text and "3 oom" in text


def test_runner_restores_mutated_inputs_before_every_call(tmp_path):
    seen = []

    def overwriting():
        def fn(x):
            seen.append(x.detach().clone())
            with torch.no_grad():
                x.fill_(float("nan"))  # stands in for a kernel writing its gradient over the input
            return x * 1.0
        return fn

    _, rows = _run_toy(_toy_spec(overwriting, mutates=(0,)), tmp_path, quick=True)
    assert all(r.status == "ok" for r in rows)
    assert len(seen) > 3 and all(torch.equal(s, seen[0]) for s in seen) and not seen[0].isnan().any()


def test_target_checks():
    def row(provider, ms, peak, floor_ms=1.0):
        return harness.Row(op="toy", mode="full", provider=provider, shape="N=1", dtype="bfloat16",
                           is_target_shape=True, status="ok", median_ms=ms, peak_extra_mib=peak,
                           floor_ms=floor_ms, floor_kind="bytes", floor_peak_mib=100.0, efficiency=floor_ms / ms)

    liger, hf, compiled = row("liger", 1.25, 105.0), row("hf_eager", 3.0, 900.0), row("torch_compile", 1.2, 300.0)
    others = {"liger": liger, "hf_eager": hf, "torch_compile": compiled}
    T = harness.Target
    assert T("full", "efficiency", 0.75).check(liger, others)[1] is True
    assert T("full", "efficiency", 0.85).check(liger, others)[1] is False
    assert T("full", "time_over_floor", 1.08).check(liger, others)[1] is False
    assert T("full", "time_vs", "torch_compile").check(liger, others)[1] is False
    assert T("full", "peak_vs", "hf_eager").check(liger, others)[1] is True
    assert T("full", "peak_over_floor", 1.10).check(liger, others)[1] is True
    assert T("full", "peak_mib", 1.0).check(liger, others)[1] is False
    nan_row = row("liger", 1.0, math.nan)
    assert T("full", "peak_vs", "hf_eager").check(nan_row, others)[1] is None
    assert T("full", "time_vs", "torch_compile").check(liger, {"liger": liger})[1] is None


@pytest.mark.parametrize("label, folder", [("NVIDIA H100 80GB HBM3", "nvidia-h100"), ("NVIDIA H200", "nvidia-h200"),
                                           ("NVIDIA A100-SXM4-80GB", "nvidia-a100"),
                                           ("cpu-interpreter", "cpu-interpreter")])
def test_default_out_dir_is_one_folder_per_gpu_kind(label, folder):
    """A run replaces the committed latest run of its GPU kind (benchmarks/results/<kind>/)."""
    assert cli.default_out_dir(label) == REPO / "benchmarks" / "results" / folder


def test_set_overrides_a_launch_configuration_for_the_run_only():
    import contextlib

    from benchmarks.__main__ import apply_overrides

    from liger_kernel.ops.config import launch_config
    from liger_kernel.ops.cross_entropy import CrossEntropyConfig

    default = launch_config(CrossEntropyConfig)
    with contextlib.ExitStack() as stack:
        applied = apply_overrides(["liger_kernel.ops.cross_entropy.CrossEntropyConfig.prefetch="
                                   f"{not default.prefetch}"], stack)
        assert applied == [f"liger_kernel.ops.cross_entropy.CrossEntropyConfig.prefetch={not default.prefetch!r}"]
        assert launch_config(CrossEntropyConfig).prefetch is (not default.prefetch)
    assert launch_config(CrossEntropyConfig) == default
    for bad in ("liger_kernel.ops.cross_entropy.CrossEntropyConfig.no_such_field=1",
                "liger_kernel.ops.cross_entropy.CE_PREFETCH=False", "prefetch=False"):
        with contextlib.ExitStack() as stack, pytest.raises(SystemExit):
            apply_overrides([bad], stack)
