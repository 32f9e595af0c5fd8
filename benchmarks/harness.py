"""The one place where kernels are timed, their memory measured and judged against floors.

What a benchmark case is
    An :class:`OpSpec` (one per op, defined in ``benchmarks/bench_*.py``) says how to build
    the inputs of one shape, what the Hugging Face eager reference computes, how to get the
    liger kernel, and the minimum work the op needs. Each *provider* (``liger``,
    ``hf_eager``, ``torch_compile`` of the HF code) runs in three *modes*:

    * ``forward``: the training forward (inputs require grad, so activations are saved);
    * ``backward``: the backward alone, a fresh forward run before each timed call;
    * ``full``: forward plus backward.

    Gradients are taken with ``torch.autograd.grad`` for the inputs that need them, so no
    ``.grad`` accumulation (and no copy ``AccumulateGrad`` may make) is timed or counted.

Timing
    On CUDA, ``triton.testing.do_bench(..., return_mode="median")`` (it flushes L2 before
    every call). Cases that need per-call preparation which must not be timed (a fresh
    forward before a backward; restoring a buffer the kernel overwrote, such as the logits
    of the in-place cross entropy) and slow cases (a call above ``slow_ms``, where
    do_bench's five estimation calls plus warm-up would dominate the run time) go through
    :func:`_event_median`: the same per-call CUDA events and L2 flush, at least three timed
    calls, the median. On CPU: wall-clock median of a few calls.

    That per-call time (``eager_ms``) includes whatever the host needs to issue the call:
    Python, autograd and kernel-launch overhead. For a fast op (a 0.1 ms norm) the host can
    be the bottleneck, and the number then measures the CPU of the machine, not the kernel
    (seen on the H200 VM: the same code timed 0.07 and 0.115 ms minutes apart). So
    ``median_ms`` for calls below ``slow_ms`` in the ``forward`` and ``full`` modes is the
    GPU time of the same call captured once in a CUDA graph and replayed (L2 flushed and
    buffers restored before every replay, untimed), as METHOD.md advises for small
    launches; every provider is timed the same way. ``timing`` says which method gave
    ``median_ms`` (``cuda_graph``, ``do_bench``, ``events``); where capture fails (an op
    that syncs with the host) it falls back to the per-call time. In a training step the
    host runs ahead of the GPU, so the graph time is what the kernel costs there.

Peak extra memory
    ``max_memory_allocated() - memory_allocated()`` around one call, inputs (and any
    pristine copies used for restoring) allocated before; what the call returns (outputs
    with their saved graph, or gradients) is still alive when the peak is read, so it
    counts. On CPU: nan.

Ceilings, floors, efficiency
    :func:`measure_hardware` measures, in the same run, device-to-device copy bandwidth
    (read + write bytes of a >= 4 GiB buffer) and the cuBLAS bf16 8192^3 matmul rate on
    random data. An op's floor is its minimum bytes moved / copy bandwidth (memory-bound
    ops) or its FLOPs / matmul rate (fused linear cross entropy); efficiency = floor /
    measured time, so 1.0 means "at the hardware limit" (a backward whose work was done in
    the forward can exceed 1).
"""

from __future__ import annotations

import csv
import datetime
import gc
import importlib.metadata
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from benchmarks.kernel_profile import ProfileLog, profile_call, sustained_clocks

MODES = ("forward", "backward", "full")
PROVIDERS = ("liger", "hf_eager", "torch_compile")
# Providers run in this order within a shape so liger's comparisons are ready when it ends.
RUN_ORDER = ("hf_eager", "torch_compile", "liger")
MIB = 2**20
NAN = float("nan")
# Optional providers (``benchmarks.peers`` registers them): name -> an object with ``ops``
# (the op names it covers), ``version``, ``unavailable`` (why it cannot run here, "" if it
# can; such cases are recorded as "skipped: <reason>") and ``build(spec) -> (fn, mutates)``.
EXTRA_PROVIDERS: dict[str, Any] = {}

COPY_BUFFER_BYTES = 4 * 2**30
MATMUL_SIZE = 8192


# --------------------------------------------------------------------------------------
# Timing and memory
# --------------------------------------------------------------------------------------


@dataclass
class TimingConfig:
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    slow_ms: float = 20.0  # above this per call, time with _event_median (>= 3 calls)
    min_reps: int = 3
    cpu_reps: int = 5
    cuda_graph: bool = True  # time fast forward/full calls as CUDA-graph replays (module docstring)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_L2_FLUSH: dict[torch.device, torch.Tensor] = {}


def _flush_l2(device: torch.device) -> None:
    # 256 MiB of writes evicts the whole L2 (50 MiB on H100/H200), as do_bench does.
    buf = _L2_FLUSH.get(device)
    if buf is None:
        buf = _L2_FLUSH[device] = torch.empty(256 * MIB // 4, dtype=torch.int32, device=device)
    buf.zero_()


def _one_call_ms(fn: Callable[[Any], Any], setup: Callable[[], Any] | None, device: torch.device) -> float:
    state = setup() if setup is not None else None
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(state)
        end.record()
        torch.cuda.synchronize(device)
        ms = start.elapsed_time(end)
    else:
        t0 = time.perf_counter()
        result = fn(state)
        ms = (time.perf_counter() - t0) * 1e3
    del result, state
    return ms


def _event_median(fn: Callable[[Any], Any], setup: Callable[[], Any] | None, device: torch.device,
                  estimate_ms: float, cfg: TimingConfig) -> float:
    """Median of per-call CUDA event timings; ``setup`` runs before each call, untimed."""
    estimate_ms = max(estimate_ms, 1e-3)
    n_warmup = min(int(cfg.warmup_ms / estimate_ms), 1000)
    n_reps = max(cfg.min_reps, min(int(cfg.rep_ms / estimate_ms), 1000))
    for _ in range(n_warmup):
        state = setup() if setup is not None else None
        result = fn(state)
        del result, state
    events = []
    for _ in range(n_reps):
        state = setup() if setup is not None else None
        _flush_l2(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(state)
        end.record()
        events.append((start, end))
        del result, state
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _end_generator_capture(device: torch.device) -> None:
    """Leave the CUDA random generator usable after a capture that failed inside
    ``capture_end``: the generator still counts itself as capturing, and every later random
    draw on the device raises "Offset increment outside graph capture". A capture that
    begins and ends cleanly resets it."""
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
        torch.cuda.synchronize(device)
    except Exception:  # nothing more to restore; later cases report their own errors
        pass


def _graph_median(fn: Callable[[Any], Any], setup: Callable[[], Any] | None, device: torch.device,
                  estimate_ms: float, cfg: TimingConfig) -> float | None:
    """Median GPU time of ``fn(None)`` captured in a CUDA graph and replayed; None if capture fails.

    ``setup`` (restoring overwritten inputs; it must return None) runs before every replay,
    untimed, followed by an L2 flush, exactly as for the per-call timings.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    static = None
    try:
        # Capture needs the allocator and cuBLAS warmed up on the capturing stream.
        with torch.cuda.stream(side):
            for _ in range(2):
                if setup is not None:
                    setup()
                result = fn(None)
                del result
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        if setup is not None:
            setup()
        with torch.cuda.graph(graph):
            static = fn(None)
        torch.cuda.synchronize(device)
    except Exception:
        del graph, static
        torch.cuda.synchronize(device)
        _end_generator_capture(device)
        return None
    estimate_ms = max(estimate_ms, 1e-3)
    n_warmup = min(int(cfg.warmup_ms / estimate_ms), 200)
    n_reps = max(cfg.min_reps, min(int(cfg.rep_ms / estimate_ms), 1000))
    for _ in range(n_warmup):
        graph.replay()
    events = []
    for _ in range(n_reps):
        if setup is not None:
            setup()
        _flush_l2(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    ms = statistics.median(s.elapsed_time(e) for s, e in events)
    del static, graph
    return ms


@dataclass
class Timing:
    median_ms: float  # the number efficiencies use (see the module docstring)
    eager_ms: float  # per-call time including host overhead (== median_ms where no graph was used)
    method: str  # "cuda_graph", "do_bench", "events" or "wall" (CPU)
    # Mean of a plain back-to-back loop between two CUDA events (no L2 flush, no graph): the
    # cross-check of how a user would time the call (CUDA only).
    plain_loop_ms: float = NAN


PLAIN_LOOP_CALLS = 5


def plain_loop_ms(fn: Callable[[Any], Any], setup: Callable[[], Any] | None, device: torch.device) -> float:
    """Mean milliseconds of ``PLAIN_LOOP_CALLS`` calls timed by two events around the loop (one
    pair per call where ``setup`` must run between calls, untimed)."""
    if device.type != "cuda":
        return NAN
    if setup is not None:
        return statistics.mean(_one_call_ms(fn, setup, device) for _ in range(PLAIN_LOOP_CALLS))
    _sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(PLAIN_LOOP_CALLS):
        result = fn(None)
        del result
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / PLAIN_LOOP_CALLS


def time_ms(fn: Callable[[Any], Any], setup: Callable[[], Any] | None, device: torch.device,
            cfg: TimingConfig, graph_ok: bool = True) -> Timing:
    """Median milliseconds of ``fn(setup())``; ``setup`` (may be None) is never timed.

    ``graph_ok``: the call may be captured in a CUDA graph (``setup`` returns None and the
    call's inputs are fixed buffers). Call after a warm-up call (compilation, autotuning) has run.
    """
    if device.type != "cuda":
        times = [_one_call_ms(fn, setup, device) for _ in range(cfg.cpu_reps)]
        ms = statistics.median(times)
        return Timing(ms, ms, "wall")
    estimate = _one_call_ms(fn, setup, device)
    if setup is None and estimate < cfg.slow_ms:
        import triton.testing

        eager = float(triton.testing.do_bench(lambda: fn(None), warmup=cfg.warmup_ms, rep=cfg.rep_ms,
                                              return_mode="median"))
        method = "do_bench"
    else:
        eager = _event_median(fn, setup, device, estimate, cfg)
        method = "events"
    plain = plain_loop_ms(fn, setup, device)
    if graph_ok and cfg.cuda_graph and estimate < cfg.slow_ms:
        graphed = _graph_median(fn, setup, device, eager, cfg)
        if graphed is not None:
            return Timing(graphed, eager, "cuda_graph", plain)
    return Timing(eager, eager, method, plain)


def peak_extra_mib(fn: Callable[[Any], Any], setup: Callable[[], Any] | None, device: torch.device) -> float:
    """Peak memory (MiB) that one call of ``fn(setup())`` allocates above what existed before it."""
    if device.type != "cuda":
        return NAN
    state = setup() if setup is not None else None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn(state)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del result, state
    return peak / MIB


# --------------------------------------------------------------------------------------
# Hardware ceilings, measured in the same run
# --------------------------------------------------------------------------------------


@dataclass
class Hardware:
    device: str
    name: str
    copy_bytes_per_s: float
    copy_buffer_bytes: int
    matmul_flops_per_s: float
    matmul_size: int
    matmul_dtype: str

    def describe(self) -> str:
        return (f"{self.name}: device-to-device copy {self.copy_bytes_per_s / 1e12:.4g} TB/s "
                f"(read+write, {self.copy_buffer_bytes / 2**30:.2f} GiB buffer); "
                f"{self.matmul_dtype} {self.matmul_size}^3 matmul {self.matmul_flops_per_s / 1e12:.4g} TFLOP/s")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"


def measure_hardware(device: torch.device, cfg: TimingConfig) -> Hardware:
    """Copy bandwidth and matmul rate of ``device``, measured now.

    CUDA: ``dst.copy_(src)`` of a 4 GiB buffer (less if free memory is short), counting
    read + write bytes; bf16 8192^3 ``torch.mm`` on random normal data. CPU: the same on a
    64 MiB buffer and a 512^3 fp32 matmul (only so that the pipeline runs; CPU efficiencies
    say nothing about the GPU).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = COPY_BUFFER_BYTES
        if 2.5 * nbytes > free:
            nbytes = int(free / 2.5) // MIB * MIB
        matmul_size, matmul_dtype = MATMUL_SIZE, torch.bfloat16
    else:
        nbytes, matmul_size, matmul_dtype = 64 * MIB, 512, torch.float32

    copy_ms = _copy_ms(nbytes, device, cfg)
    mm_ms = _matmul_ms(matmul_size, matmul_dtype, device, cfg)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Hardware(
        device=str(device),
        name=device_name(device),
        copy_bytes_per_s=2 * nbytes / (copy_ms * 1e-3),
        copy_buffer_bytes=nbytes,
        matmul_flops_per_s=2 * matmul_size**3 / (mm_ms * 1e-3),
        matmul_size=matmul_size,
        matmul_dtype=str(matmul_dtype).replace("torch.", ""),
    )


def _copy_ms(nbytes: int, device: torch.device, cfg: TimingConfig) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _bench_simple(lambda: dst.copy_(src), device, cfg)


def _matmul_ms(n: int, dtype: torch.dtype, device: torch.device, cfg: TimingConfig) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty_like(a)
    return _bench_simple(lambda: torch.mm(a, b, out=c), device, cfg)


def _bench_simple(fn: Callable[[], Any], device: torch.device, cfg: TimingConfig) -> float:
    fn()
    _sync(device)
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# --------------------------------------------------------------------------------------
# What an op benchmark declares
# --------------------------------------------------------------------------------------


@dataclass
class Inputs:
    """Arguments shared by every provider of one case.

    ``args`` are passed positionally to each provider; ``grad_args`` are the positions of
    the args that receive gradients; ``grad_output`` is the upstream gradient (None for a
    scalar loss; a tensor, or a tuple for ops with several outputs).
    """

    args: tuple
    grad_args: tuple[int, ...]
    grad_output: Any = None


@dataclass
class Floor:
    """Minimum work of one call: ``bytes`` moved (memory-bound) or ``flops`` (compute-bound)."""

    bytes: float = 0.0
    flops: float = 0.0

    def ms(self, hw: Hardware) -> float:
        if self.flops:
            return self.flops / hw.matmul_flops_per_s * 1e3
        return self.bytes / hw.copy_bytes_per_s * 1e3

    @property
    def kind(self) -> str:
        return "flops" if self.flops else "bytes"


@dataclass(frozen=True)
class Target:
    """A goal from the issues for the liger provider in ``mode`` at the op's target shape.

    ``metric``:
      * ``efficiency``: floor_ms / median_ms >= bound
      * ``time_over_floor``: median_ms / floor_ms <= bound
      * ``peak_mib``: peak_extra_mib <= bound
      * ``peak_over_floor``: peak_extra_mib / floor_peak_mib <= bound
      * ``time_vs``: median_ms <= that of provider ``bound``
      * ``peak_vs``: peak_extra_mib <= that of provider ``bound``
    """

    mode: str
    metric: str
    bound: float | str

    def label(self) -> str:
        return {
            "efficiency": f"efficiency>={self.bound}",
            "time_over_floor": f"time<={self.bound}x floor",
            "peak_mib": f"peak<={self.bound} MiB",
            "peak_over_floor": f"peak<={self.bound}x floor",
            "time_vs": f"time<={self.bound}",
            "peak_vs": f"peak<={self.bound}",
        }[self.metric]

    def check(self, row: Row, others: dict[str, Row]) -> tuple[str, bool | None]:
        """(measured value as text, passed); passed is None when it cannot be judged."""
        if row.status != "ok":
            return row.status, False
        m = self.metric
        if m == "efficiency":
            return f"{row.efficiency:.3f}", row.efficiency >= self.bound
        if m == "time_over_floor":
            ratio = row.median_ms / row.floor_ms
            return f"{ratio:.3f}x floor", ratio <= self.bound
        if m in ("peak_mib", "peak_over_floor"):
            if math.isnan(row.peak_extra_mib):
                return "n/a", None
            if m == "peak_mib":
                return f"{row.peak_extra_mib:.2f} MiB", row.peak_extra_mib <= self.bound
            ratio = row.peak_extra_mib / row.floor_peak_mib
            return f"{ratio:.3f}x floor ({row.peak_extra_mib:.0f} MiB)", ratio <= self.bound
        other = others.get(str(self.bound))
        if other is None or other.status != "ok":
            return f"{self.bound} {other.status if other else 'not run'}", None
        if m == "time_vs":
            return f"{row.median_ms:.3f} vs {other.median_ms:.3f} ms", row.median_ms <= other.median_ms
        if math.isnan(row.peak_extra_mib) or math.isnan(other.peak_extra_mib):
            return "n/a", None
        # 1 MiB of slack: allocator granularity (512 B blocks, 2 MiB segments) and tiny buffers.
        return (f"{row.peak_extra_mib:.1f} vs {other.peak_extra_mib:.1f} MiB",
                row.peak_extra_mib <= other.peak_extra_mib + 1.0)


# Holds for every liger row of every op and shape.
PEAK_NOT_ABOVE_HF = "peak_vs"

# Every loss through the LM head (fused linear CE, preference, RL, distillation, log-probs): at
# most 1.15x its GEMM floor, faster and leaner than the materialised loss under torch.compile,
# and at most 2x the bytes of the gradients it must produce.
HEAD_TARGETS = (
    Target("full", "time_over_floor", 1.15),
    Target("full", "time_vs", "torch_compile"),
    Target("full", "peak_over_floor", 2.0),
    Target("full", "peak_vs", "torch_compile"),
)


@dataclass
class OpSpec:
    """Everything the harness needs to benchmark one op.

    ``gpu_shapes[0]`` and ``tiny_shapes[0]`` are the target shapes (``--quick`` runs only
    those); the rest form the sweep. ``liger`` imports the kernel and returns the provider
    function (an ImportError there marks the case as an error). ``liger_mutates`` lists the
    arg positions (or ``"grad_output"``) the liger provider overwrites; the harness restores
    them from a pristine copy before every call, untimed.
    """

    name: str
    shape_keys: tuple[str, ...]
    gpu_shapes: list[dict[str, int]]
    tiny_shapes: list[dict[str, int]]
    make_inputs: Callable[[dict[str, int], torch.dtype, torch.device], Inputs]
    reference: Callable[..., Any]
    liger: Callable[[], Callable[..., Any]]
    floor: Callable[[dict[str, int], torch.dtype, str], Floor]
    floor_peak_bytes: Callable[[dict[str, int], torch.dtype, str], float]
    size: Callable[[dict[str, int]], float]
    size_label: str
    targets: tuple[Target, ...] = ()
    liger_mutates: tuple[int | str, ...] = ()
    notes: str = ""


def shape_text(shape: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------------------
# Result rows, CSV
# --------------------------------------------------------------------------------------

SHAPE_COLUMNS = ("B", "T", "Hq", "Hk", "N", "D", "H", "V")


@dataclass
class Row:
    op: str
    mode: str
    provider: str
    shape: str
    dtype: str
    is_target_shape: bool
    status: str
    median_ms: float
    peak_extra_mib: float
    floor_ms: float
    floor_kind: str
    floor_peak_mib: float
    efficiency: float
    eager_ms: float = NAN  # per-call time with host overhead (see the module docstring)
    timing: str = ""  # how median_ms was taken: cuda_graph, do_bench, events, wall
    plain_loop_ms: float = NAN  # the same call timed by a plain event loop (Timing.plain_loop_ms)
    speedup_vs_hf: float = NAN
    target: str = ""
    meets_target: str = ""
    target_detail: str = ""
    size: float = NAN
    copy_tb_s: float = NAN
    matmul_tflop_s: float = NAN
    device: str = ""
    gpu_name: str = ""
    torch: str = ""
    triton: str = ""
    transformers: str = ""
    python: str = ""
    date: str = ""
    provider_version: str = ""  # the provider's package and version (peers: benchmarks.peers)
    dims: dict[str, int] = field(default_factory=dict)
    # (target label, measured value, passed or None when it cannot be judged); not a CSV column
    checks: list[tuple[str, str, bool | None]] = field(default_factory=list)

    def csv_dict(self) -> dict[str, Any]:
        d = asdict(self)
        dims = d.pop("dims")
        d.pop("checks")
        for key in SHAPE_COLUMNS:
            d[key] = dims.get(key, "")
        return {k: _fmt(v) for k, v in d.items()}


def csv_columns() -> list[str]:
    names = [f.name for f in fields(Row) if f.name not in ("dims", "checks")]
    at = names.index("shape") + 1
    return names[:at] + list(SHAPE_COLUMNS) + names[at:]


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return f"{v:.6g}"
    return v


def write_csv(rows: Sequence[Row], path: Path, append: bool = False) -> None:
    new = not append or not path.exists()
    with path.open("a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=csv_columns())
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow(row.csv_dict())


def _dist(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# The distribution whose code each built-in provider runs (its version goes in the rows).
BUILTIN_DISTRIBUTIONS = {"liger": "liger-kernel", "hf_eager": "torch", "torch_compile": "torch"}


def versions() -> dict[str, str]:
    dist = _dist

    import triton

    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": dist("transformers"),  # not imported: the benchmarks do not need it
        "python": platform.python_version(),
    }


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    device: torch.device
    dtype: torch.dtype
    modes: tuple[str, ...] = MODES
    providers: tuple[str, ...] = PROVIDERS
    quick: bool = False
    tiny: bool = False
    compile_sweep: bool = False  # torch.compile every sweep shape, not only the target shape
    max_seconds: float = 0.0  # 0: no limit; else later cases are recorded as skipped
    timing: TimingConfig = field(default_factory=TimingConfig)
    profile: ProfileLog | None = None  # --profile: one more call per case under torch.profiler


@dataclass
class _Unit:
    spec: OpSpec
    shape: dict[str, int]
    is_target: bool
    providers: tuple[str, ...]


class Runner:
    """Runs every (op, shape, provider, mode) case, writing the CSV as it goes."""

    def __init__(self, cfg: RunConfig, hardware: Hardware, csv_path: Path | None = None,
                 log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.hw = hardware
        self.csv_path = csv_path
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.meta = versions()
        self.date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        self.errors = 0
        self._t0 = 0.0

    def plan(self, specs: Sequence[OpSpec]) -> list[_Unit]:
        """Target shapes of every op first, then the sweeps (so a time limit cuts sweeps)."""
        first, rest = [], []
        for spec in specs:
            shapes = spec.tiny_shapes if self.cfg.tiny else spec.gpu_shapes
            if self.cfg.quick:
                shapes = shapes[:1]
            for i, shape in enumerate(shapes):
                providers = tuple(p for p in RUN_ORDER if p in self.cfg.providers) + tuple(
                    p for p, peer in EXTRA_PROVIDERS.items() if p in self.cfg.providers and spec.name in peer.ops)
                if i > 0 and not self.cfg.compile_sweep:
                    # Compiling costs tens of seconds per shape; the sweeps compare with eager.
                    providers = tuple(p for p in providers if p != "torch_compile")
                (first if i == 0 else rest).append(_Unit(spec, shape, i == 0, providers))
        return first + rest

    def run(self, specs: Sequence[OpSpec]) -> list[Row]:
        units = self.plan(specs)
        total = sum(len(u.providers) for u in units)
        done = 0
        rows: list[Row] = []
        self._t0 = time.perf_counter()
        if self.csv_path is not None:
            write_csv([], self.csv_path)
        for unit in units:
            group: dict[str, list[Row]] = {}
            for provider in unit.providers:
                done += 1
                t_case = time.perf_counter()
                group[provider] = self._run_provider(unit, provider)
                summary = ", ".join(f"{r.mode} {_short(r)}" for r in group[provider])
                self.log(f"[{done}/{total}] {unit.spec.name} {shape_text(unit.shape)} {provider}: {summary} "
                         f"({time.perf_counter() - t_case:.1f} s, total {time.perf_counter() - self._t0:.0f} s)")
            unit_rows = self._judge(unit, group)
            rows.extend(unit_rows)
            if self.csv_path is not None:
                write_csv(unit_rows, self.csv_path, append=True)
        return rows

    # -- one provider over the requested modes -----------------------------------------

    def _run_provider(self, unit: _Unit, provider: str) -> list[Row]:
        cfg = self.cfg
        if cfg.max_seconds and time.perf_counter() - self._t0 > cfg.max_seconds:
            return [self._row(unit, provider, m, "skipped: time limit") for m in cfg.modes]
        results: dict[str, tuple[str, Timing | None, float]] = {}
        peer = EXTRA_PROVIDERS.get(provider)
        if peer is not None and peer.unavailable:
            return [self._row(unit, provider, m, f"skipped: {peer.unavailable}") for m in cfg.modes]
        try:
            fn, mutates = self._build(unit.spec, provider)
        except Exception as exc:  # a missing or broken kernel module must not stop the run
            status = _error_status(exc)
            self.log(traceback.format_exc())
            return [self._row(unit, provider, m, status) for m in cfg.modes]
        inputs = restore = None
        try:
            inputs = unit.spec.make_inputs(unit.shape, cfg.dtype, cfg.device)
            restore = restorers(inputs, mutates)
            for mode in cfg.modes:
                results[mode] = self._measure_mode(fn, inputs, mode, restore[mode], unit, provider)
                if results[mode][0] == "oom":
                    _free_memory(cfg.device)
        except torch.cuda.OutOfMemoryError:
            pending = ("oom", None, NAN)
        except Exception as exc:
            self.log(traceback.format_exc())
            pending = (_error_status(exc), None, NAN)
        else:
            pending = None
        finally:
            del inputs, restore, fn  # before empty_cache, so the memory really returns
            _free_memory(cfg.device)
        for mode in cfg.modes:
            results.setdefault(mode, pending)
        return [self._row(unit, provider, m, *results[m]) for m in cfg.modes]

    def _build(self, spec: OpSpec, provider: str) -> tuple[Callable[..., Any], tuple]:
        if provider in EXTRA_PROVIDERS:
            return EXTRA_PROVIDERS[provider].build(spec)
        if provider == "liger":
            return spec.liger(), spec.liger_mutates
        if provider == "hf_eager":
            return spec.reference, ()
        if provider == "torch_compile":
            # A fresh Dynamo cache per shape keeps recompile limits out of the picture.
            torch._dynamo.reset()
            return torch.compile(spec.reference, dynamic=False), ()
        raise ValueError(f"unknown provider {provider!r}")

    def _measure_mode(self, fn, inputs: Inputs, mode: str, restore, unit: _Unit,
                      provider: str) -> tuple[str, Timing | None, float]:
        device = self.cfg.device
        run, setup = mode_callables(fn, inputs, mode, restore)
        try:
            # The first call compiles / autotunes; it is neither timed nor measured.
            warm = setup() if setup is not None else None
            result = run(warm)
            del result, warm
            _sync(device)
            peak = peak_extra_mib(run, setup, device)
            # backward mode's setup builds a fresh forward graph per call: not replayable.
            timing = time_ms(run, setup, device, self.cfg.timing, graph_ok=mode != "backward")
            if self.cfg.profile is not None:
                case = {"op": unit.spec.name, "shape": shape_text(unit.shape), "provider": provider, "mode": mode}
                floor_ms = unit.spec.floor(unit.shape, self.cfg.dtype, mode).ms(self.hw)
                self.cfg.profile.add(case, floor_ms, profile_call(run, setup, device),
                                     sustained_clocks(run, setup, device))
            return "ok", timing, peak
        except torch.cuda.OutOfMemoryError:
            return "oom", None, NAN
        except Exception as exc:
            self.log(traceback.format_exc())
            return _error_status(exc), None, NAN

    # -- rows and targets --------------------------------------------------------------

    def _row(self, unit: _Unit, provider: str, mode: str, status: str, timing: Timing | None = None,
             peak: float = NAN) -> Row:
        spec, hw = unit.spec, self.hw
        ms = timing.median_ms if timing is not None else NAN
        if status.startswith("error"):
            self.errors += 1
        floor = spec.floor(unit.shape, self.cfg.dtype, mode)
        floor_ms = floor.ms(hw)
        return Row(
            op=spec.name, mode=mode, provider=provider, shape=shape_text(unit.shape),
            dtype=str(self.cfg.dtype).replace("torch.", ""), is_target_shape=unit.is_target,
            status=status, median_ms=ms, peak_extra_mib=peak,
            eager_ms=timing.eager_ms if timing is not None else NAN,
            timing=timing.method if timing is not None else "",
            plain_loop_ms=timing.plain_loop_ms if timing is not None else NAN,
            floor_ms=floor_ms, floor_kind=floor.kind,
            floor_peak_mib=spec.floor_peak_bytes(unit.shape, self.cfg.dtype, mode) / MIB,
            efficiency=floor_ms / ms if status == "ok" else NAN,
            size=spec.size(unit.shape), copy_tb_s=hw.copy_bytes_per_s / 1e12,
            matmul_tflop_s=hw.matmul_flops_per_s / 1e12, device=hw.device, gpu_name=hw.name,
            date=self.date, dims=dict(unit.shape), **self.meta,
            provider_version=getattr(EXTRA_PROVIDERS.get(provider), "version", "") or (
                f"{BUILTIN_DISTRIBUTIONS[provider]} {_dist(BUILTIN_DISTRIBUTIONS[provider])}"
                if provider in BUILTIN_DISTRIBUTIONS else ""),
        )

    def _judge(self, unit: _Unit, group: dict[str, list[Row]]) -> list[Row]:
        by_mode: dict[str, dict[str, Row]] = {}
        for provider_rows in group.values():
            for r in provider_rows:
                by_mode.setdefault(r.mode, {})[r.provider] = r
        for mode, others in by_mode.items():
            hf = others.get("hf_eager")
            for r in others.values():
                if r.provider != "hf_eager" and hf is not None and r.status == "ok" and hf.status == "ok":
                    r.speedup_vs_hf = hf.median_ms / r.median_ms
            row = others.get("liger")
            if row is None:
                continue
            checks = [Target(mode, PEAK_NOT_ABOVE_HF, "hf_eager")] if "hf_eager" in others else []
            if unit.is_target:
                checks += [t for t in unit.spec.targets if t.mode == mode]
            row.checks = [(t.label(), *t.check(row, others)) for t in checks]
            row.target = "; ".join(label for label, _, _ in row.checks)
            row.target_detail = "; ".join(f"{label}: {value} {_verdict(ok)}" for label, value, ok in row.checks)
            verdicts = [ok for _, _, ok in row.checks]
            if not verdicts:
                row.meets_target = ""
            elif any(ok is False for ok in verdicts):
                row.meets_target = "False"
            elif any(ok is None for ok in verdicts):
                row.meets_target = "n/a"
            else:
                row.meets_target = "True"
        return [r for rows in group.values() for r in rows]


def mode_callables(fn: Callable[..., Any], inputs: Inputs, mode: str,
                   restore: Callable[[], None] | None) -> tuple[Callable[[Any], Any], Callable[[], Any] | None]:
    """``(run, setup)`` for one mode: the timed part is ``run(setup())``."""
    args = inputs.args
    wrt = tuple(args[i] for i in inputs.grad_args)

    def grads(out):
        return torch.autograd.grad(out, wrt, grad_outputs=inputs.grad_output)

    if mode == "forward":
        return (lambda _: fn(*args)), restore
    if mode == "backward":
        def setup():
            if restore is not None:
                restore()
            return fn(*args)

        return grads, setup
    if mode == "full":
        return (lambda _: grads(fn(*args))), restore
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def restorers(inputs: Inputs, mutates: Sequence[int | str]) -> dict[str, Callable[[], None] | None]:
    """Per mode, a function copying overwritten buffers back from pristine copies made now.

    An overwritten upstream gradient matters only to modes with a backward.
    """
    pairs = []
    for what in mutates:
        t = inputs.grad_output if what == "grad_output" else inputs.args[what]
        for part in (t if isinstance(t, (tuple, list)) else (t,)):
            pairs.append((what, part, part.detach().clone()))

    def make(with_grad_output: bool) -> Callable[[], None] | None:
        chosen = [(dst, src) for what, dst, src in pairs if with_grad_output or what != "grad_output"]
        if not chosen:
            return None

        def restore() -> None:
            with torch.no_grad():
                for dst, src in chosen:
                    dst.copy_(src)

        return restore

    return {"forward": make(False), "backward": make(True), "full": make(True)}


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error_status(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())[:160]
    return f"error: {type(exc).__name__}: {msg}"


def _verdict(ok: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "n/a"}[ok]


def _short(r: Row) -> str:
    if r.status != "ok":
        return r.status.split(":")[0]
    return f"{r.median_ms:.3g} ms"


# --------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------


def sort_rows(rows: Sequence[Row], specs: Sequence[OpSpec]) -> list[Row]:
    """Rows by op (in ``specs`` order), input size, mode and provider (the run order differs:
    target shapes of all ops come first there)."""
    op_rank = {s.name: i for i, s in enumerate(specs)}
    ranks = {p: i for i, p in enumerate((*PROVIDERS, *EXTRA_PROVIDERS))}
    return sorted(rows, key=lambda r: (op_rank.get(r.op, len(op_rank)), r.size, r.shape, MODES.index(r.mode),
                                       ranks.get(r.provider, len(ranks)), r.provider))


def format_table(rows: Sequence[Row]) -> str:
    """All rows, one line each, grouped by op and shape."""
    header = ("op", "shape", "mode", "provider", "median_ms", "eager_ms", "peak_MiB", "floor_ms", "eff", "vs_hf",
              "target")
    lines = [header]
    for r in rows:
        if r.status == "ok":
            tail = ", ".join(f"{label} {_verdict(ok)}" for label, _, ok in r.checks)
            cells = (f"{r.median_ms:.4g}", f"{r.eager_ms:.4g}", _num(r.peak_extra_mib, "{:.1f}"), f"{r.floor_ms:.4g}",
                     f"{r.efficiency:.3f}", _num(r.speedup_vs_hf, "{:.2f}x"), tail or "")
        else:
            cells = ("", "", "", f"{r.floor_ms:.4g}", "", "", r.status)
        lines.append((r.op, r.shape, r.mode, r.provider) + cells)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header) - 1)]
    out = []
    for line in lines:
        out.append("  ".join(str(c).ljust(w) for c, w in zip(line[:-1], widths)) + "  " + str(line[-1]))
    return "\n".join(out)


def format_targets(rows: Sequence[Row], specs: Sequence[OpSpec], tiny: bool) -> str:
    """Each target from the issues: measured value and PASS/FAIL; then the memory rule."""
    index = {(r.op, r.mode, r.provider): r for r in rows if r.is_target_shape}
    out = ["=== targets (liger, target shape) ==="]
    if tiny:
        out.append("(CPU interpreter run: tiny shapes; these numbers say nothing about GPU targets)")
    n_pass = n_total = 0
    for spec in specs:
        for t in spec.targets:
            row = index.get((spec.name, t.mode, "liger"))
            if row is None:
                continue
            others = {p: r for (op, mode, p), r in index.items() if op == spec.name and mode == t.mode}
            value, ok = t.check(row, others)
            n_total += 1
            n_pass += ok is True
            out.append(f"{_verdict(ok):4}  {spec.name:27} {t.mode:8} {row.shape:28} {t.label():22} measured {value}"
                       + (f"  (efficiency {row.efficiency:.3f}, {row.median_ms:.4g} ms [{row.timing}] vs floor "
                          f"{row.floor_ms:.4g} ms; per-call with host overhead {row.eager_ms:.4g} ms)"
                          if row.status == "ok" and t.metric in ("efficiency", "time_over_floor") else ""))
    peak_label = Target("full", PEAK_NOT_ABOVE_HF, "hf_eager").label()
    peak_checks = [(r, value, ok) for r in rows for label, value, ok in r.checks if label == peak_label]
    judged = [c for c in peak_checks if c[2] is not None]
    bad = [c for c in judged if c[2] is False]
    out.append(f"peak extra memory <= hf_eager: {len(judged) - len(bad)} of {len(judged)} liger cases hold"
               + ("" if judged else " (not measured on CPU)"))
    for r, value, _ in bad[:10]:
        out.append(f"  FAIL {r.op} {r.mode} {r.shape}: {value}")
    errors = [r for r in rows if r.status.startswith("error")]
    ooms = [r for r in rows if r.status == "oom"]
    out.append(f"targets met: {n_pass} of {n_total}; cases: {len(rows)} rows, {len(ooms)} oom, {len(errors)} errors"
               " (benchmarks never gate: exit status reflects crashes only)")
    for r in errors[:10]:
        out.append(f"  ERROR {r.op} {r.mode} {r.provider} {r.shape}: {r.status}")
    return "\n".join(out)


def _num(v: float, fmt: str) -> str:
    return "" if math.isnan(v) else fmt.format(v)
