"""Checks of ``benchmarks/peers.py``: availability probing, registration into the harness, the
upstream child process (ops and end-to-end), and the rows of peers that cannot run.

No peer package is installed on the CPU machine, and the peers need CUDA, so the in-process
peers are checked for their ``skipped`` rows. The upstream child is exercised for real with
this checkout's ``src`` standing in for the upstream install directory: it has the same
public functions, and the child must import ``liger_kernel`` from the directory it is given.
"""

from __future__ import annotations

import csv
import importlib.metadata
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from benchmarks.e2e_training import VariantResult

from benchmarks import e2e_training, harness, peers
from tests.utils import cpu_interpreter_problem

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
CPU_HW = harness.Hardware(device="cpu", name="cpu", copy_bytes_per_s=1e9, copy_buffer_bytes=2**20,
                          matmul_flops_per_s=1e10, matmul_size=512, matmul_dtype="float32")


def test_probe_reasons():
    cce = peers.in_process_peers()["cut_cross_entropy"].probe(torch.device("cpu"))
    assert cce.unavailable == "cut-cross-entropy needs CUDA" and not cce.version
    missing = peers.Peer("nope", "no_such_module_for_peers", "no-such-dist", {}, needs_cuda=False)
    missing.probe(torch.device("cpu"))
    assert missing.unavailable.startswith("no-such-dist not importable: ModuleNotFoundError")
    here = peers.Peer("torch", "torch", "torch", {}, needs_cuda=False, note="x").probe(torch.device("cpu"))
    assert here.unavailable == "" and here.version == f"torch {importlib.metadata.version('torch')} (x)"


def test_registered_peers_cover_only_their_ops(monkeypatch):
    monkeypatch.setattr(harness, "EXTRA_PROVIDERS", {})
    names = peers.register(["quack", "cut_cross_entropy", peers.UPSTREAM], torch.device("cpu"))
    assert names == ["quack", "cut_cross_entropy"]  # the upstream release never runs in-process
    from benchmarks import __main__ as cli

    specs = cli.load_specs(("rms_norm", "rope", "fused_linear_cross_entropy"))
    cfg = harness.RunConfig(device=torch.device("cpu"), dtype=torch.float32, providers=("hf_eager", *names),
                            quick=True, tiny=True)
    plan = {u.spec.name: u.providers for u in harness.Runner(cfg, CPU_HW, log=lambda m: None).plan(specs)}
    assert plan == {"rms_norm": ("hf_eager", "quack"), "rope": ("hf_eager",),
                    "fused_linear_cross_entropy": ("hf_eager", "quack", "cut_cross_entropy")}


def test_cli_records_unavailable_peers_and_runs_the_upstream_child(tmp_path):
    out = tmp_path / "bench"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--cpu-tiny", "--quick", "--ops", "rms_norm,fused_linear_cross_entropy",
         "--modes", "full", "--providers", "hf_eager", "--peers", "all", "--upstream-path", str(SRC),
         "--no-plots", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with (out / "bench.csv").open() as f:
        rows = {(r["op"], r["provider"]): r for r in csv.DictReader(f)}
    assert set(rows) == {("rms_norm", p) for p in ("hf_eager", "quack", peers.UPSTREAM)} | {
        ("fused_linear_cross_entropy", p) for p in ("hf_eager", "quack", "cut_cross_entropy", peers.UPSTREAM)}
    assert rows[("rms_norm", "hf_eager")]["provider_version"] == f"torch {importlib.metadata.version('torch')}"
    assert rows[("rms_norm", "quack")]["status"] == "skipped: quack-kernels needs CUDA"
    assert rows[("fused_linear_cross_entropy", "cut_cross_entropy")]["status"] == "skipped: cut-cross-entropy needs CUDA"
    problem = cpu_interpreter_problem() if torch.cuda.is_available() else None
    if problem:
        # The child times the upstream kernels on CPU through the interpreter (--cpu-tiny).
        pytest.skip(f"the upstream child's rows: {problem}")
    for op in ("rms_norm", "fused_linear_cross_entropy"):
        up, hf = rows[(op, peers.UPSTREAM)], rows[(op, "hf_eager")]
        assert up["status"] == "ok" and float(up["median_ms"]) > 0
        assert float(up["speedup_vs_hf"]) == pytest.approx(float(hf["median_ms"]) / float(up["median_ms"]), rel=1e-3)
        assert up["provider_version"].startswith("liger-kernel")
        for key in ("gpu_name", "torch", "triton", "date"):
            assert up[key], key


def test_upstream_without_a_directory_gives_skipped_rows(monkeypatch):
    monkeypatch.setattr(harness, "EXTRA_PROVIDERS", {})
    cfg = harness.RunConfig(device=torch.device("cpu"), dtype=torch.float32, modes=("forward", "full"),
                            quick=True, tiny=True)
    rows = peers.run_upstream_ops("", cfg, CPU_HW, ["swiglu", "cross_entropy"], log=lambda m: None)
    assert {(r.op, r.mode) for r in rows} == {(op, m) for op in ("swiglu", "cross_entropy") for m in ("forward", "full")}
    assert all(r.provider == peers.UPSTREAM and r.status.startswith("skipped: no upstream") for r in rows)
    assert harness.EXTRA_PROVIDERS == {}


def test_check_upstream_import_rejects_another_liger_kernel(tmp_path):
    import liger_kernel

    with pytest.raises(RuntimeError, match="not from the upstream path"):
        peers.check_upstream_import(str(tmp_path))
    assert peers.check_upstream_import(str(Path(liger_kernel.__file__).parents[1])).startswith("liger-kernel")


def test_merge_speedups():
    def row(provider, ms, status="ok"):
        return SimpleNamespace(op="rope", shape="B=1", mode="full", provider=provider, median_ms=ms, status=status,
                               speedup_vs_hf=math.nan)

    rows = [row("hf_eager", 3.0), row(peers.UPSTREAM, 1.5), row("quack", 1.0)]
    peers.merge_speedups(rows)
    assert rows[1].speedup_vs_hf == 2.0 and math.isnan(rows[2].speedup_vs_hf)


def _e2e_args(path: str) -> SimpleNamespace:
    return SimpleNamespace(upstream_path=path, model="tiny", steps=1, warmup=1, batch=2, seq=16, seed=0,
                           floor="off", compile_backend="inductor", max_seq_limit=32768, max_batch=False,
                           max_batch_limit=8, max_batch_budget=10.0, objective="sft")


def test_upstream_e2e_variant(monkeypatch):
    missing = e2e_training.run_upstream_e2e(_e2e_args(""), grad_ckpt=False, max_seq_budget_s=None)
    assert missing.variant == "liger-upstream" and not missing.losses and "skipped" in missing.notes[0]
    result = e2e_training.run_upstream_e2e(_e2e_args(str(SRC)), grad_ckpt=True, max_seq_budget_s=None)
    assert isinstance(result, VariantResult), result
    assert result.variant == "liger-upstream+ckpt" and len(result.losses) == 2, result.notes
    assert result.patched_modules > 0 and "LlamaRMSNorm" in result.patched
    assert any(str(SRC) in note for note in result.notes)
