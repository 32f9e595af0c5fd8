"""Where one benchmark call spends its device time, by kind of kernel (``python -m benchmarks --profile``).

After a case is timed, one more call (its setup outside the profile) runs under
``torch.profiler``; its kernels are sorted into kinds by name:

* ``gemm``: cuBLAS / cuBLASLt / CUTLASS matmuls (``nvjet_*``, ``*gemm*``, ``*xmma*``,
  ``cutlass*``) and Inductor's matmul templates (``triton_tem_*``);
* ``triton``: hand-written Triton kernels (a bare function name: ours, or a peer's);
* ``inductor``: kernels Inductor generated (``triton_poi_*``, ``triton_red_*``, ``triton_per_*``);
* ``copy``: memcpy and memset;
* ``other``: everything else (PyTorch's own elementwise and reduction kernels).

Per case the summary gives the call's span on the device (first kernel start to last kernel
end), the time some kernel was running (the union of their intervals), the idle rest, and the
time per kind; the heaviest kernels go to a text report. With the GEMM floor of the case
(``floor_ms`` of a flops-bound op) this says how much of the gap to the floor is the matmuls
running below the measured rate and how much is the work around them.

Each case also runs back to back for a moment (:data:`SUSTAINED_SECONDS`) while a thread reads the
GPU's SM clock and power draw through NVML (``torch.cuda.clock_rate`` / ``power_draw``): a
GEMM-heavy call long enough to hit the board's power cap runs below the clock at which the
matmul floor was measured, which the ``sm_mhz`` and ``power_w`` columns show next to the
kernel times.

On CPU (``--cpu-tiny``) there are no device kernels: the top-level CPU operators stand in
(``aten::mm`` and its kin count as ``gemm``, the rest, Triton's interpreted kernels included,
as ``other``), which exercises the bookkeeping, not the GPU.
"""

from __future__ import annotations

import csv
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

KINDS = ("gemm", "triton", "inductor", "copy", "other")

_COPY = re.compile(r"^(memcpy|memset)", re.IGNORECASE)
_GEMM = re.compile(r"nvjet|gemm|xmma|cutlass|^triton_tem_", re.IGNORECASE)
_CPU_GEMM = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$")
_INDUCTOR = re.compile(r"^triton_(poi|red|per)_")
_BARE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def kernel_kind(name: str) -> str:
    """The kind (one of :data:`KINDS`) of a device kernel, from its name."""
    if _COPY.search(name):
        return "copy"
    if _GEMM.search(name):
        return "gemm"
    if _INDUCTOR.search(name):
        return "inductor"
    if _BARE_NAME.match(name):
        return "triton"
    return "other"


def cpu_op_kind(name: str) -> str:
    """The kind of a top-level CPU operator, the stand-in for kernels on CPU: ``gemm`` or ``other``."""
    return "gemm" if _CPU_GEMM.match(name) else "other"


@dataclass(frozen=True)
class KernelSpan:
    name: str
    kind: str
    start_us: float
    end_us: float


@dataclass
class Breakdown:
    """Device time of one call: ``span_ms`` from the first kernel's start to the last one's end,
    ``busy_ms`` with at least one kernel running, ``by_kind`` the kernels' own times per kind
    (overlapping kernels each count in full, so the kinds may add up to more than ``busy_ms``),
    ``top`` the heaviest kernels as (name, kind, calls, total ms)."""

    span_ms: float
    busy_ms: float
    kernels: int
    by_kind: dict[str, float]
    top: list[tuple[str, str, int, float]] = field(default_factory=list)

    @property
    def idle_ms(self) -> float:
        return self.span_ms - self.busy_ms


def summarise(spans: Sequence[KernelSpan], top: int = 12) -> Breakdown:
    """Totals of ``spans`` (see :class:`Breakdown`)."""
    by_kind = dict.fromkeys(KINDS, 0.0)
    per_name: dict[tuple[str, str], list[float]] = {}
    for s in spans:
        duration = (s.end_us - s.start_us) / 1e3
        by_kind[s.kind] += duration
        entry = per_name.setdefault((s.name, s.kind), [0, 0.0])
        entry[0] += 1
        entry[1] += duration
    if not spans:
        return Breakdown(0.0, 0.0, 0, by_kind)
    busy, reach = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start_us):
        start = max(s.start_us, reach)
        if s.end_us > start:
            busy += s.end_us - start
        reach = max(reach, s.end_us)
    span = max(s.end_us for s in spans) - min(s.start_us for s in spans)
    heaviest = sorted(per_name.items(), key=lambda item: -item[1][1])[:top]
    return Breakdown(span / 1e3, busy / 1e3, len(spans), by_kind,
                     [(name, kind, int(calls), ms) for (name, kind), (calls, ms) in heaviest])


def _device_spans(prof: torch.profiler.profile, device: torch.device) -> list[KernelSpan]:
    spans = []
    for event in prof.events():
        if device.type == "cuda":
            kind = kernel_kind(event.name) if event.device_type == torch.autograd.DeviceType.CUDA else None
        else:
            top_level = event.device_type == torch.autograd.DeviceType.CPU and event.cpu_parent is None
            kind = cpu_op_kind(event.name) if top_level else None
        if kind is not None:
            spans.append(KernelSpan(event.name, kind, float(event.time_range.start), float(event.time_range.end)))
    return spans


def profile_call(run: Callable[[Any], Any], setup: Callable[[], Any] | None, device: torch.device) -> Breakdown:
    """:func:`summarise` of one ``run(setup())``, the setup outside the profile."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    state = setup() if setup is not None else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        result = run(state)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    del result, state
    return summarise(_device_spans(prof, device))


# How long a case runs back to back while its clocks are sampled, and how often they are read.
SUSTAINED_SECONDS = 0.5
SAMPLE_SECONDS = 0.005


@dataclass(frozen=True)
class Clocks:
    """Mean SM clock (MHz) and board power (W) over a stretch of back-to-back calls (nan where
    not readable: no CUDA, or no NVML), and how many samples they average."""

    sm_mhz: float
    power_w: float
    samples: int


def _nvml_sample(device: torch.device) -> tuple[float, float]:
    return float(torch.cuda.clock_rate(device)), torch.cuda.power_draw(device) / 1e3


def sampled_while(work: Callable[[], None], sample: Callable[[], tuple[float, float]],
                  every_s: float = SAMPLE_SECONDS) -> Clocks:
    """Run ``work()`` while a thread calls ``sample() -> (MHz, W)`` every ``every_s`` seconds;
    the means of what it read (nan, 0 samples if the first read fails)."""
    readings: list[tuple[float, float]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                readings.append(sample())
            except Exception:  # NVML missing or refusing: no clock columns, the profile still runs
                return
            done.wait(every_s)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        work()
    finally:
        done.set()
        thread.join()
    if not readings:
        return Clocks(math.nan, math.nan, 0)
    return Clocks(sum(r[0] for r in readings) / len(readings), sum(r[1] for r in readings) / len(readings),
                  len(readings))


def sustained_clocks(run: Callable[[Any], Any], setup: Callable[[], Any] | None, device: torch.device,
                     seconds: float = SUSTAINED_SECONDS) -> Clocks:
    """:class:`Clocks` over ``run(setup())`` repeated back to back for about ``seconds`` (at
    least three calls); nan off CUDA."""
    if device.type != "cuda":
        return Clocks(math.nan, math.nan, 0)

    def work() -> None:
        calls, start = 0, time.perf_counter()
        while calls < 3 or time.perf_counter() - start < seconds:
            state = setup() if setup is not None else None
            result = run(state)
            del result, state
            calls += 1
        torch.cuda.synchronize(device)

    return sampled_while(work, lambda: _nvml_sample(device))


CSV_COLUMNS = ("op", "shape", "provider", "mode", "floor_ms", "span_ms", "busy_ms", "idle_ms", "kernels",
               *(f"{kind}_ms" for kind in KINDS), "sm_mhz", "power_w")


@dataclass
class ProfileLog:
    """Breakdowns of the cases of one run, written as they come: ``kernel_profile.csv`` (one row
    a case) and ``kernel_profile.txt`` (each case's heaviest kernels) in ``out``."""

    out: Path

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with self.csv_path.open("w", newline="") as f:
            csv.writer(f).writerow(CSV_COLUMNS)
        self.text_path.write_text("")

    @property
    def csv_path(self) -> Path:
        return self.out / "kernel_profile.csv"

    @property
    def text_path(self) -> Path:
        return self.out / "kernel_profile.txt"

    def add(self, case: dict[str, str], floor_ms: float, b: Breakdown, clocks: Clocks | None = None) -> None:
        clocks = clocks or Clocks(math.nan, math.nan, 0)
        values = [case["op"], case["shape"], case["provider"], case["mode"], floor_ms, b.span_ms, b.busy_ms,
                  b.idle_ms, b.kernels, *(b.by_kind[kind] for kind in KINDS), clocks.sm_mhz, clocks.power_w]
        with self.csv_path.open("a", newline="") as f:
            csv.writer(f).writerow([f"{v:.6g}" if isinstance(v, float) else v for v in values])
        kinds = ", ".join(f"{kind} {b.by_kind[kind]:.3f}" for kind in KINDS if b.by_kind[kind])
        sustained = f"; sustained {clocks.sm_mhz:.0f} MHz, {clocks.power_w:.0f} W" if clocks.samples else ""
        lines = [f"## {case['op']} {case['shape']} {case['provider']} {case['mode']}: span {b.span_ms:.3f} ms, "
                 f"busy {b.busy_ms:.3f}, idle {b.idle_ms:.3f}, floor {floor_ms:.3f}; {kinds}{sustained}"]
        lines += [f"  {ms:9.3f} ms {calls:5d}x {kind:8s} {name[:140]}" for name, kind, calls, ms in b.top]
        with self.text_path.open("a") as f:
            f.write("\n".join(lines) + "\n\n")
