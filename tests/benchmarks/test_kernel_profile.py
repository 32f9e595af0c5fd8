"""``python -m benchmarks --profile``: kernels sorted by kind, busy and idle time, the run's files."""

from __future__ import annotations

import csv
import math
import random
import time

import pytest
from benchmarks.kernel_profile import KINDS, KernelSpan, cpu_op_kind, kernel_kind, sampled_while, summarise

from tests.benchmarks.test_benchmark_cli import _run_cli

# Kernel names as the CUDA profiler reports them (cuBLAS on Hopper, CUTLASS, Inductor, Triton, ATen).
NAMED_KINDS = [
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_kernel__5x_cublas",
     "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("_row_statistics_kernel", "triton"),
    ("chunked_logprob_fwd_kernel", "triton"),
    ("triton_poi_fused__to_copy_add_0", "inductor"),
    ("triton_red_fused__log_softmax_1", "inductor"),
    ("triton_per_fused_sum_2", "inductor"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
     "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)", "other"),
]
CPU_OP_KINDS = [("aten::addmm", "gemm"), ("aten::mm", "gemm"), ("aten::add_", "other"),
                ("CrossEntropyFunctionFromOptions", "other")]


@pytest.mark.parametrize("name, kind", NAMED_KINDS)
def test_kernel_kind(name, kind):
    assert kernel_kind(name) == kind


@pytest.mark.parametrize("name, kind", CPU_OP_KINDS)
def test_cpu_op_kind(name, kind):
    assert cpu_op_kind(name) == kind


def test_summarise_against_a_timeline():
    """Random kernels on a microsecond grid: busy time is the union of the intervals (checked
    against a per-microsecond occupancy count), kinds sum each kernel in full, the heaviest come first."""
    rng = random.Random()
    spans = []
    for _ in range(40):
        start = rng.randrange(0, 500)
        name, kind = rng.choice(NAMED_KINDS)
        spans.append(KernelSpan(name, kind, float(start), float(start + rng.randrange(1, 60))))
    b = summarise(spans, top=5)
    occupied = {t for s in spans for t in range(int(s.start_us), int(s.end_us))}
    first, last = min(s.start_us for s in spans), max(s.end_us for s in spans)
    assert b.busy_ms == pytest.approx(len(occupied) / 1e3)
    assert b.span_ms == pytest.approx((last - first) / 1e3)
    assert b.idle_ms == pytest.approx(b.span_ms - b.busy_ms)
    assert b.kernels == len(spans)
    for kind in KINDS:
        expected = sum(s.end_us - s.start_us for s in spans if s.kind == kind) / 1e3
        assert b.by_kind[kind] == pytest.approx(expected)
    totals = [ms for _, _, _, ms in b.top]
    assert totals == sorted(totals, reverse=True) and len(b.top) == min(5, len({s.name for s in spans}))
    assert sum(calls for _, _, calls, _ in b.top) <= len(spans)


def test_summarise_nothing():
    b = summarise([])
    assert (b.span_ms, b.busy_ms, b.kernels, b.top) == (0.0, 0.0, 0, [])


def test_cli_profile_writes_one_row_per_case(tmp_path):
    out = tmp_path / "bench"
    proc = _run_cli(["--quick", "--ops", "cross_entropy", "--providers", "liger,hf_eager", "--profile",
                     "--no-plots", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with (out / "kernel_profile.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["provider"], r["mode"]) for r in rows} == {
        (p, m) for p in ("liger", "hf_eager") for m in ("forward", "backward", "full")}
    for r in rows:
        assert r["op"] == "cross_entropy" and float(r["floor_ms"]) > 0
        assert 0 <= float(r["busy_ms"]) <= float(r["span_ms"]) + 1e-9
        assert float(r["idle_ms"]) == pytest.approx(float(r["span_ms"]) - float(r["busy_ms"]),
                                                 abs=1e-5 * float(r["span_ms"]) + 1e-6)  # 6 digits in the CSV
        assert r["sm_mhz"] == r["power_w"] == "nan"  # no GPU clocks to read on CPU
    report = (out / "kernel_profile.txt").read_text()
    assert report.count("## cross_entropy") == len(rows)


def test_clocks_sampled_while_the_work_runs():
    """The sampler reads while the work runs and averages what it read; a sampler that fails
    (no NVML) leaves nan and the work still runs."""
    readings = iter([(1980.0, 300.0), (1700.0, 700.0), (1760.0, 690.0)] + [(1760.0, 690.0)] * 1000)
    seen = []
    ran = []

    def sample():
        value = next(readings)
        seen.append(value)
        return value

    clocks = sampled_while(lambda: (time.sleep(0.05), ran.append(1)), sample, every_s=0.002)
    assert ran == [1] and clocks.samples == len(seen) >= 3
    assert clocks.sm_mhz == pytest.approx(sum(v[0] for v in seen) / len(seen))
    assert clocks.power_w == pytest.approx(sum(v[1] for v in seen) / len(seen))

    def broken():
        raise RuntimeError("NVML not available")

    clocks = sampled_while(lambda: ran.append(2), broken)
    assert ran == [1, 2] and clocks.samples == 0 and math.isnan(clocks.sm_mhz) and math.isnan(clocks.power_w)
