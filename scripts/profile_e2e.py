"""Where the end-to-end step spends its time and memory (GPU diagnostic, not a benchmark).

Builds the ``benchmarks/e2e_training.py`` model (llama-1b shapes, bf16, fused AdamW), for
each variant given (``hf``, ``liger``): a few warm-up steps, then

* memory by phase: peak and live memory after forward, after backward, after the
  optimizer step (``max_memory_allocated`` reset between phases);
* one step under ``torch.profiler``: the CUDA kernels sorted by total time (top rows),
  written to ``OUT/profile_<variant>.txt``, and the idle time between kernels on the GPU
  (the step's span minus kernel time: host overhead and syncs), with the largest gaps
  and the kernels around them.

With ``--host``: instead, the host (Python) time of three forward passes under cProfile,
the functions with the most own and cumulative time, to ``OUT/host_<variant>.txt``.

With ``--steady N``: instead, N training steps run back to back as in the benchmark (no
host sync between them, so the host may run ahead) under the CUDA-only profiler, with a
marker kernel at each phase boundary; reports each phase's GPU span, kernel time and idle
time (mean over the steps after the first), to ``OUT/steady_<variant>.txt``.

Usage: ``python scripts/profile_e2e.py --out OUT [--variants hf,liger] [--host]``
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e_training import build_config, build_model, make_optimizer, token_batches

GIB = 2**30


def memory_phases(model, optimizer, ids) -> str:
    lines = []
    device = ids.device
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = model(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize(device)
    lines.append(f"forward : peak {torch.cuda.max_memory_allocated(device) / GIB:7.3f} GiB, "
                 f"live after {torch.cuda.memory_allocated(device) / GIB:7.3f} GiB (start {start / GIB:.3f})")
    torch.cuda.reset_peak_memory_stats(device)
    loss.backward()
    torch.cuda.synchronize(device)
    lines.append(f"backward: peak {torch.cuda.max_memory_allocated(device) / GIB:7.3f} GiB, "
                 f"live after {torch.cuda.memory_allocated(device) / GIB:7.3f} GiB")
    torch.cuda.reset_peak_memory_stats(device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    lines.append(f"step    : peak {torch.cuda.max_memory_allocated(device) / GIB:7.3f} GiB, "
                 f"live after {torch.cuda.memory_allocated(device) / GIB:7.3f} GiB")
    return "\n".join(lines)


def idle_report(prof, top: int = 25) -> str:
    """GPU idle time between consecutive device activities of the profiled step."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]
    if not events:
        return "no device events"
    events.sort(key=lambda e: e.start_ns())
    busy_end = events[0].start_ns()
    gaps = []
    previous = events[0]
    for e in events:
        if e.start_ns() > busy_end:
            gaps.append((e.start_ns() - busy_end, previous.name(), e.name()))
        if e.start_ns() + e.duration_ns() > busy_end:
            busy_end = e.start_ns() + e.duration_ns()
            previous = e
    span = busy_end - events[0].start_ns()
    idle = sum(g for g, _, _ in gaps)
    lines = [f"span {span / 1e6:.3f} ms, idle {idle / 1e6:.3f} ms ({100 * idle / span:.1f}%) in {len(gaps)} gaps; "
             f"gaps > 20 us: {sum(1 for g, _, _ in gaps if g > 20e3)} totalling "
             f"{sum(g for g, _, _ in gaps if g > 20e3) / 1e6:.3f} ms"]
    by_next: dict[str, list[float]] = {}
    for g, _, nxt in gaps:
        by_next.setdefault(nxt[:70], [0.0, 0])
        by_next[nxt[:70]][0] += g
        by_next[nxt[:70]][1] += 1
    lines.append("idle before each kernel kind (top):")
    for name, (g, n) in sorted(by_next.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {g / 1e3:9.1f} us in {n:4d} gaps  before {name}")
    lines.append("largest gaps:")
    for g, before, after in sorted(gaps, key=lambda t: -t[0])[:top]:
        lines.append(f"  {g / 1e3:9.1f} us  after {before[:60]}  ->  {after[:60]}")
    return "\n".join(lines)


PHASES = ("forward", "backward", "optimizer")


def _marker() -> None:
    torch.cuda._sleep(1)  # a distinctive, negligible kernel that bounds a phase on the GPU timeline


def steady_report(model, optimizer, batches: list[torch.Tensor]) -> str:
    """Per-phase GPU busy and idle time over back-to-back steps (see the module docstring)."""
    device = batches[0].device
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for ids in batches:
            _marker()
            loss = model(input_ids=ids, labels=ids).loss
            _marker()
            loss.backward()
            _marker()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _marker()
        torch.cuda.synchronize(device)
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0),
                    key=lambda e: e.start_ns())
    marks = [e.start_ns() for e in events if "sleep" in e.name().lower() or "spin" in e.name().lower()]
    expected = 3 * len(batches) + 1
    if len(marks) != expected:
        return f"found {len(marks)} marker kernels, expected {expected}: kernel names {sorted({e.name()[:40] for e in events})[:20]}"
    totals = {phase: [0.0, 0.0, 0.0, 0] for phase in PHASES}  # span, busy, largest gap, steps
    gaps: dict[str, list[tuple[float, str, str]]] = {phase: [] for phase in PHASES}
    kernel_ns: dict[str, dict[str, float]] = {phase: {} for phase in PHASES}
    for step in range(1, len(batches)):  # the first step starts from an empty queue
        for k, phase in enumerate(PHASES):
            begin, end = marks[3 * step + k], marks[3 * step + k + 1]
            inside = [e for e in events if begin <= e.start_ns() < end]
            busy, cursor, largest = 0.0, begin, 0.0
            previous = "marker"
            for e in inside:
                start, stop = max(e.start_ns(), cursor), e.start_ns() + e.duration_ns()
                largest = max(largest, start - cursor)
                if start - cursor > 0:
                    gaps[phase].append((start - cursor, previous[:50], e.name()[:50]))
                kernel_ns[phase][e.name()[:70]] = kernel_ns[phase].get(e.name()[:70], 0.0) + e.duration_ns()
                previous = e.name()
                if stop > start:
                    busy += stop - start
                    cursor = stop
            entry = totals[phase]
            entry[0] += end - begin
            entry[1] += busy
            entry[2] = max(entry[2], largest)
            entry[3] += 1
    lines = [f"{len(batches)} back-to-back steps, means over steps 2..{len(batches)} (ms)",
             f"{'phase':10s} {'span':>8s} {'kernels':>8s} {'idle':>8s} {'largest gap':>12s}"]
    for phase, (span, busy, largest, n) in totals.items():
        lines.append(f"{phase:10s} {span / n / 1e6:8.3f} {busy / n / 1e6:8.3f} {(span - busy) / n / 1e6:8.3f} "
                     f"{largest / 1e6:12.3f}")
    span = sum(t[0] for t in totals.values()) / max(1, len(batches) - 1)
    busy = sum(t[1] for t in totals.values()) / max(1, len(batches) - 1)
    lines.append(f"{'step':10s} {span / 1e6:8.3f} {busy / 1e6:8.3f} {(span - busy) / 1e6:8.3f}")
    steps = max(1, len(batches) - 1)
    for phase in PHASES:
        lines.append(f"\n{phase}: kernel time per step by kernel (top 15, ms)")
        for name, ns in sorted(kernel_ns[phase].items(), key=lambda kv: -kv[1])[:15]:
            lines.append(f"  {ns / steps / 1e6:8.3f}  {name}")
        by_pair: dict[tuple[str, str], list[float]] = {}
        for g, before, after in gaps[phase]:
            entry = by_pair.setdefault((before, after), [0.0, 0])
            entry[0] += g
            entry[1] += 1
        lines.append(f"{phase}: idle per step by (previous kernel -> next kernel) (top 15, us, gaps per step)")
        for (before, after), (g, n) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:15]:
            lines.append(f"  {g / steps / 1e3:8.1f} {n / steps:6.1f}  {before} -> {after}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="hf,liger")
    p.add_argument("--rows", type=int, default=45)
    p.add_argument("--host", action="store_true")
    p.add_argument("--steady", type=int, default=0, help="profile this many back-to-back steps by phase")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    config = build_config("llama-1b")
    torch.manual_seed(0)
    batches = token_batches(max(4, args.steady + 2), 4, 2048, config.vocab_size, 0, device)
    for variant in args.variants.split(","):
        model = build_model(config, device, torch.bfloat16)
        if variant.startswith("liger"):
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            # liger-norecompute: the patch without recompute_norm_outputs (host-time A/B).
            apply_liger_kernel_to_llama(model=model, recompute_norm_outputs=variant != "liger-norecompute")
        optimizer = make_optimizer(model, device)
        for ids in batches[:2]:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if args.steady:
            text = f"# {variant}\n{steady_report(model, optimizer, batches[2:2 + args.steady])}\n"
            (args.out / f"steady_{variant}.txt").write_text(text)
            print(text, flush=True)
            del model, optimizer
            torch.cuda.empty_cache()
            continue
        if args.host:
            import cProfile
            import io
            import pstats
            import time

            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for ids in batches[:3]:
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            plain = (time.perf_counter() - start) / 3
            # Host time of the forward alone: the GPU runs behind, so no sync inside.
            forward_host = []
            for ids in batches[:3]:
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                loss = model(input_ids=ids, labels=ids).loss
                forward_host.append(time.perf_counter() - t0)
                torch.cuda.synchronize(device)
                forward_gpu = time.perf_counter() - t0
                loss.backward()
                optimizer.zero_grad(set_to_none=True)
            profiler = cProfile.Profile()
            profiler.enable()
            for ids in batches[:3]:
                loss = model(input_ids=ids, labels=ids).loss
            profiler.disable()
            torch.cuda.synchronize(device)
            del loss
            stream = io.StringIO()
            stats = pstats.Stats(profiler, stream=stream)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(60)
            text = (f"# {variant}: forward+backward {1e3 * plain:.1f} ms per step (synced); forward host time "
                    f"{', '.join(f'{1e3 * t:.1f}' for t in forward_host)} ms, forward to GPU done "
                    f"{1e3 * forward_gpu:.1f} ms\n{stream.getvalue()}")
            (args.out / f"host_{variant}.txt").write_text(text)
            print(text[:3000], flush=True)
            del model, optimizer
            torch.cuda.empty_cache()
            continue
        phases = memory_phases(model, optimizer, batches[2])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(input_ids=batches[3], labels=batches[3]).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90)
        text = f"# {variant}\n{phases}\n\n{idle_report(prof)}\n\n{table}\n"
        (args.out / f"profile_{variant}.txt").write_text(text)
        print(text, flush=True)
        del model, optimizer, prof
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
