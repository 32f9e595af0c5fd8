"""``python -m benchmarks.tune``: sweep the kernels' launch tunables at the target shapes.

Each op keeps its launch parameters as a frozen configuration (``LaunchConfig`` subclasses such
as ``ops.row_norm_geometry.RowNormConfig``, ``ops.cross_entropy.CrossEntropyConfig``,
``ops.rope.RopeConfig``), whose ``search_space`` lists the candidates. This script puts each
candidate in force in turn (``override_launch_config``), times the Liger op (forward + backward, median, L2 flushed) with the same
harness as ``python -m benchmarks``, records peak extra memory, and writes ``tune.csv``
with one row per (op, setting). The numbers decide the committed defaults; the tunables
change the schedule only, never the result (the test suite checks several of them).

It also times the components of one fused-linear-cross-entropy chunk (the three GEMMs and
the loss kernel) so the gap to the matmul floor can be attributed.

GPU only. Results are evidence for a default, not a test: nothing here gates CI.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import itertools
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import (
    bench_cross_entropy,
    bench_gated_mlp,
    bench_norms,
    bench_post_training,
    bench_rl_distillation,
    bench_rope,
)
from benchmarks.harness import (
    TimingConfig,
    measure_hardware,
    mode_callables,
    peak_extra_mib,
    restorers,
    time_ms,
)
from liger_kernel.ops.chunked_head import ChunkedHeadConfig
from liger_kernel.ops.config import LaunchConfig, override_launch_config
from liger_kernel.ops.head_chunking import HeadChunkConfig
from liger_kernel.ops.head_epilogue import HeadEpilogueConfig

# The losses through the LM head that share HeadChunkConfig's budget, and the budgets swept.
HEAD_OPS = ("fused_linear_cross_entropy", "grpo", "dpo", "fused_linear_logprobs", "fused_linear_jsd")
HEAD_BUDGET_FRACTIONS = (0.5, 0.75, 1.0, 1.25)


def _set(module: Any, values: dict[str, Any]) -> dict[str, Any]:
    old = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    return old


def _is_config(target: Any) -> bool:
    return isinstance(target, type) and issubclass(target, LaunchConfig)


@contextlib.contextmanager
def _applied(target: Any, values: dict[str, Any]) -> Iterator[None]:
    """``values`` in effect within the block: fields of a launch configuration class (through
    ``override_launch_config``) or module attributes (set, then restored)."""
    if _is_config(target):
        with override_launch_config(target, **values):
            yield
        return
    old = _set(target, values)
    try:
        yield
    finally:
        _set(target, old)


def _config_candidates(config_cls: type[LaunchConfig], *problem: int) -> list[dict[str, Any]]:
    """The fields of each configuration ``config_cls.search_space(*problem)`` proposes."""
    return [dataclasses.asdict(config) for config in config_cls.search_space(*problem)]



def _differences(candidates: Iterable[LaunchConfig], base: LaunchConfig) -> list[dict[str, Any]]:
    """Each candidate as the fields in which it differs from ``base`` (an empty dict: ``base``)."""
    return [{f.name: getattr(c, f.name) for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(base, f.name)}
            for c in candidates]


def _measure(spec, shape: dict[str, int], dtype: torch.dtype, device: torch.device,
             cfg: TimingConfig, mode: str = "full") -> tuple[float, float]:
    """(median ms, peak extra MiB) of the Liger op's ``mode`` ("full": forward + backward)."""
    inputs = spec.make_inputs(shape, dtype, device)
    fn = spec.liger()
    restore = restorers(inputs, spec.liger_mutates)[mode]
    call, setup = mode_callables(fn, inputs, mode, restore)
    call(setup() if setup else None)  # compile / warm up
    torch.cuda.synchronize(device)
    peak = peak_extra_mib(call, setup, device)
    ms = time_ms(call, setup, device, cfg).median_ms
    del inputs, fn, call, setup, restore
    torch.cuda.empty_cache()
    return ms, peak


def _sweep(name: str, module: Any, grid: dict[str, Iterable[Any]] | list[dict[str, Any]], spec, shape: dict[str, int],
           dtype: torch.dtype, device: torch.device, cfg: TimingConfig,
           writer: csv.DictWriter, deadline: float, mode: str = "full") -> dict[str, Any] | None:
    """Time every combination of ``grid``; returns the fastest setting (None if none ran)."""
    if isinstance(grid, dict):
        keys = list(grid)
        settings = [dict(zip(keys, values)) for values in itertools.product(*(list(grid[k]) for k in keys))]
    else:
        settings = list(grid)  # explicit settings
    best: tuple[float, dict[str, Any]] | None = None
    for setting in settings:
        if time.perf_counter() > deadline:
            print(f"{name}: time limit reached, rest skipped", flush=True)
            break
        try:
            with _applied(module, setting):
                ms, peak = _measure(spec, shape, dtype, device, cfg, mode)
            status = "ok"
        except torch.OutOfMemoryError:
            ms, peak, status = float("nan"), float("nan"), "oom"
        except Exception as exc:  # a setting may exceed a resource limit; record, go on
            ms, peak, status = float("nan"), float("nan"), f"error: {type(exc).__name__}: {str(exc)[:120]}"
        text = " ".join(f"{k}={v}" for k, v in setting.items()) or "(heuristic)"
        if mode != "full":
            text = f"[{mode}] {text}"
        print(f"{name} {text}: {ms:.4f} ms, peak {peak:.1f} MiB ({status})", flush=True)
        writer.writerow({"op": name, "setting": text, "median_ms": f"{ms:.5f}", "peak_extra_mib": f"{peak:.2f}",
                         "status": status})
        if status == "ok" and (best is None or ms < best[0]):
            best = (ms, setting)
    prefix = f"{module.__module__}.{module.__name__}" if _is_config(module) else module.__name__
    return None if best is None else {f"{prefix}.{k}": v for k, v in best[1].items()}


def _time_component(fn: Callable[[], Any], device: torch.device, cfg: TimingConfig) -> float:
    fn()
    torch.cuda.synchronize(device)
    return time_ms(lambda _: fn(), None, device, cfg).median_ms


def _chunk_parts(rows: int, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                 grad_weight: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The per-chunk work of the fused linear cross entropy, one callable per step."""
    from liger_kernel.ops.cross_entropy import launch_cross_entropy_kernel
    from liger_kernel.ops.loss_reduction import mean_denominators

    v, d = weight.shape
    logits = torch.empty(rows, v, device=x.device, dtype=x.dtype)
    grad_x = torch.empty(rows, d, device=x.device, dtype=x.dtype)
    x_chunk, target_chunk = x[:rows], target[:rows]
    loss = torch.empty(rows, device=x.device)
    z_loss, correct = torch.empty_like(loss), torch.empty_like(loss)
    ce_den, z_den, _ = mean_denominators(target, None, -100, v)

    def logits_gemm() -> None:
        torch.matmul(x_chunk, weight.t(), out=logits)

    def logits_gemm_and_loss() -> None:
        logits_gemm()  # fresh logits each call: the loss kernel overwrites them with G
        launch_cross_entropy_kernel(logits, logits, target_chunk, None, None, loss, z_loss, correct, ce_den, z_den,
                                    -100, 0.0, 0.0, 0.0, True, True, False)

    return {
        "logits_gemm": logits_gemm,
        "logits_gemm+ce_kernel": logits_gemm_and_loss,
        "grad_x_gemm": lambda: torch.matmul(logits, weight, out=grad_x),
        "grad_w_addmm": lambda: grad_weight.addmm_(logits.t(), x_chunk),
    }


def flce_chunk_breakdown(chunk_rows: Iterable[int], device: torch.device, cfg: TimingConfig,
                         writer: csv.DictWriter) -> None:
    """Per-chunk GEMM and loss-kernel times at N 8192, D 4096, V 128256 bf16, per chunk size."""
    n, d, v = 8192, 4096, 128256
    x = torch.randn(n, d, device=device, dtype=torch.bfloat16)
    weight = (0.02 * torch.randn(v, d, device=device)).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device=device)
    grad_weight = torch.empty_like(weight)
    for rows in chunk_rows:
        parts = _chunk_parts(rows, x, weight, target, grad_weight)
        flops = 2 * rows * d * v
        chunks = -(-n // rows)
        for part, fn in parts.items():
            ms = _time_component(fn, device, cfg)
            tflops = flops / ms / 1e9 if part != "logits_gemm+ce_kernel" else float("nan")
            print(f"flce chunk {rows}: {part} {ms:.4f} ms ({tflops:.0f} TFLOP/s), x{chunks} chunks = "
                  f"{ms * chunks:.2f} ms", flush=True)
            writer.writerow({"op": "flce_chunk_breakdown", "setting": f"rows={rows} part={part}",
                             "median_ms": f"{ms:.5f}", "peak_extra_mib": "", "status": f"{tflops:.1f} TFLOP/s"})
        del parts
        torch.cuda.empty_cache()


def flce_chunk_loss_kernel(settings: list[dict[str, Any]], device: torch.device, cfg: TimingConfig,
                           writer: csv.DictWriter, deadline: float) -> None:
    """The loss kernel alone on one fused-linear-cross-entropy chunk (384 x 128256 bf16,
    N 8192's chunk at the 96 MiB budget) and on a whole N 8192 batch, per CE setting: the
    chunk has fewer rows than the GPU holds programs, so its best launch may differ."""
    from liger_kernel.ops import cross_entropy as ce_ops
    from liger_kernel.ops.loss_reduction import mean_denominators

    v = 128256
    for rows in (384, 8192):
        logits = torch.randn(rows, v, device=device, dtype=torch.bfloat16)
        grad = torch.empty_like(logits)  # out of place: every timed call sees the same logits
        target = torch.randint(0, v, (rows,), device=device)
        loss, z_loss, correct = (torch.empty(rows, device=device) for _ in range(3))
        ce_den, z_den, _ = mean_denominators(target, None, -100, v)
        floor_ms = 3 * logits.numel() * logits.element_size() / 4.27e9  # read twice, write once
        for setting in settings:
            if time.perf_counter() > deadline:
                print("flce_chunk_loss_kernel: time limit reached, rest skipped", flush=True)
                return
            try:
                with override_launch_config(ce_ops.CrossEntropyConfig, **setting):
                    ms = _time_component(functools.partial(
                        ce_ops.launch_cross_entropy_kernel, logits, grad, target, None, None, loss, z_loss, correct,
                        ce_den, z_den, -100, 0.0, 0.0, 0.0, True, True, False), device, cfg)
                status = f"ok; 3-pass floor at 4.27 TB/s {floor_ms:.4f} ms"
            except Exception as exc:  # a setting may exceed a resource limit; record, go on
                ms, status = float("nan"), f"error: {type(exc).__name__}: {str(exc)[:120]}"
            text = f"rows={rows} " + " ".join(f"{k}={val}" for k, val in setting.items())
            print(f"flce_chunk_loss_kernel {text}: {ms:.4f} ms ({status})", flush=True)
            writer.writerow({"op": "flce_chunk_loss_kernel", "setting": text, "median_ms": f"{ms:.5f}",
                             "peak_extra_mib": "", "status": status})
        torch.cuda.empty_cache()


def _grad_weight_forms(d: int, v: int, rows: int, device: torch.device) -> dict[str, Callable[[], Any]]:
    g = torch.randn(rows, v, device=device, dtype=torch.bfloat16)
    x = torch.randn(rows, d, device=device, dtype=torch.bfloat16)
    dw = torch.zeros(v, d, device=device, dtype=torch.bfloat16)
    half = v // 2
    return {
        "addmm_(G^T, X)": lambda: dw.addmm_(g.t(), x),
        "dW^T.addmm_(X^T, G)": lambda: dw.t().addmm_(x.t(), g),
        "two vocabulary halves": lambda: (dw[:half].addmm_(g[:, :half].t(), x),
                                          dw[half:].addmm_(g[:, half:].t(), x)),
    }


def flce_grad_weight_forms(device: torch.device, cfg: TimingConfig, writer: csv.DictWriter) -> None:
    """The chunk's dW update ``dW += G^T X`` (V 128256, 384 rows, bf16) written three ways that
    cuBLAS may serve with different kernels: as is, as the transposed product into dW's
    transposed view, and in two vocabulary halves."""
    v, rows = 128256, 384
    for d in (2048, 4096):
        flops = 2 * rows * d * v
        for name, fn in _grad_weight_forms(d, v, rows, device).items():
            ms = _time_component(fn, device, cfg)
            print(f"flce_grad_weight_forms D={d} {name}: {ms:.4f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
            writer.writerow({"op": "flce_grad_weight_forms", "setting": f"D={d} rows={rows} {name}",
                             "median_ms": f"{ms:.5f}", "peak_extra_mib": "", "status": f"{flops / ms / 1e9:.1f} TFLOP/s"})
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", default="", help="comma list of cross_entropy,cross_entropy_grid,flce,"
                                              "flce_breakdown,flce_loss_kernel,flce_grad_weight_forms,rms_norm,layer_norm,"
                                              "rope,swiglu,geglu,head_chunks,head_epilogue "
                                              "(default: all)")
    p.add_argument("--max-seconds", type=float, default=400.0)
    p.add_argument("--emit-best", type=Path, default=None,
                   help="write the fastest cross-entropy and RMSNorm configurations as "
                        "MODULE.ConfigClass.field=VALUE lines, for `python -m benchmarks --set`")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.tune needs a CUDA GPU", file=sys.stderr)
        return 2
    import liger_kernel.ops.cross_entropy as ce_ops
    from liger_kernel.ops.rope import RopeConfig
    from liger_kernel.ops.row_norm_geometry import RowNormConfig
    from liger_kernel.ops.swiglu import GatedActivationConfig

    device = torch.device("cuda")
    dtype = torch.bfloat16
    cfg = TimingConfig(warmup_ms=10.0, rep_ms=60.0)
    hw = measure_hardware(device, cfg)
    print(hw.describe(), flush=True)
    only = {s for s in args.only.split(",") if s}
    specs = {s.name: s for m in (bench_norms, bench_rope, bench_gated_mlp, bench_cross_entropy, bench_post_training,
                                 bench_rl_distillation) for s in m.SPECS}
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.max_seconds
    with open(args.out / "tune.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["op", "setting", "median_ms", "peak_extra_mib", "status"])
        writer.writeheader()
        writer.writerow({"op": "hardware", "setting": hw.describe(), "median_ms": "", "peak_extra_mib": "",
                         "status": torch.cuda.get_device_name(device)})

        bests: dict[str, dict[str, Any] | None] = {}

        def want(name: str) -> bool:
            return not only or name in only

        for op in ("rms_norm", "layer_norm"):
            # The row-norm launch configuration's search space (backward tile, elements per
            # thread, resident warps, prefetch; forward tile and warps; column-block width;
            # dW accumulation; partials-sum tile), at the target and the llama-1b e2e shapes.
            if not want(op):
                continue
            spec = specs[op]
            for i, shape in enumerate(spec.gpu_shapes[:2]):
                n_rows, n_cols = shape["N"], shape["H"]
                center = op == "layer_norm"
                base = RowNormConfig.heuristic(n_rows, n_cols, device, center)
                best = _sweep(f"{op} N={n_rows} H={n_cols}", RowNormConfig,
                              _differences(RowNormConfig.search_space(n_rows, n_cols, device, center), base),
                              spec, shape, dtype, device, cfg, writer, deadline)
                if i == 0:
                    bests[op] = best
        if want("cross_entropy_grid"):
            # Fewer rows in flight than one per SM: does pass 2's re-read start hitting L2?
            spec = specs["cross_entropy"]
            _sweep("cross_entropy", ce_ops.CrossEntropyConfig, [
                {"max_block": b, "programs_per_sm": p} for b in (16384, 32768) for p in (0.25, 0.5, 0.75, 1)
            ], spec, spec.gpu_shapes[0], dtype, device, cfg, writer, deadline)
        if want("cross_entropy"):
            spec = specs["cross_entropy"]
            bests["cross_entropy"] = _sweep("cross_entropy", ce_ops.CrossEntropyConfig, [
                {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
                for c in ce_ops.CrossEntropyConfig.search_space()
            ], spec, spec.gpu_shapes[0], dtype, device, cfg, writer, deadline)
        if want("rope"):
            spec = specs["rope"]
            shape = spec.gpu_shapes[0]
            candidates = _config_candidates(RopeConfig, shape["T"], shape["Hq"], shape["Hk"], shape["D"] // 2)
            bests["rope"] = _sweep("rope", RopeConfig, candidates, spec, shape, dtype, device, cfg, writer, deadline)
        for op in ("swiglu", "geglu"):
            if want(op):
                spec = specs[op]
                shape = spec.gpu_shapes[0]
                candidates = _config_candidates(GatedActivationConfig, shape["N"], shape["H"])
                bests[op] = _sweep(op, GatedActivationConfig, candidates, spec, shape, dtype, device, cfg, writer,
                                   deadline)
        if want("flce_loss_kernel"):
            flce_chunk_loss_kernel([
                {"max_block": b, "programs_per_sm": p} for b in (8192, 16384, 32768) for p in (1, 2, 4, 8)
            ], device, cfg, writer, deadline)
        if want("flce_grad_weight_forms"):
            flce_grad_weight_forms(device, cfg, writer)
        if want("flce_breakdown"):
            flce_chunk_breakdown((256, 384, 512, 1024, 2048), device, cfg, writer)
        if want("head_chunks"):
            # Every head-bound loss at its target shape under each chunk budget: fewer, larger
            # chunks re-read dW less often and run fuller GEMMs, at a higher peak.
            for op in HEAD_OPS:
                spec = specs[op]
                _sweep(op, HeadChunkConfig, [{"budget_fraction": f} for f in HEAD_BUDGET_FRACTIONS],
                       spec, spec.gpu_shapes[0], dtype, device, cfg, writer, deadline)
            # Whole pairs a chunk: the count nearest the budget (two at DPO's target shape) or
            # only as many as fit under it (one).
            spec = specs["dpo"]
            _sweep("dpo", ChunkedHeadConfig, [{"unit_overshoot": 1.0}, {"unit_overshoot": 4 / 3}], spec,
                   spec.gpu_shapes[0], dtype, device, cfg, writer, deadline)
            # Log-probs, whose backward recomputes: the leading chunk's logits kept from forward
            # to backward (one GEMM less a kept chunk) against every chunk recomputed.
            spec = specs["fused_linear_logprobs"]
            _sweep("fused_linear_logprobs", ChunkedHeadConfig, [{"keep_forward_logits": k} for k in (True, False)],
                   spec, spec.gpu_shapes[0], dtype, device, cfg, writer, deadline)
        if want("head_epilogue"):
            # The epilogue kernels' column tiles and warps, on the losses whose chunks they walk.
            for op in ("grpo", "fused_linear_logprobs"):
                spec = specs[op]
                _sweep(op, HeadEpilogueConfig, _config_candidates(HeadEpilogueConfig), spec, spec.gpu_shapes[0],
                       dtype, device, cfg, writer, deadline)
        if want("flce"):
            spec = specs["fused_linear_cross_entropy"]
            _sweep("fused_linear_cross_entropy", HeadChunkConfig, [
                {"budget_fraction": c.budget_fraction} for c in HeadChunkConfig.search_space()
            ], spec, spec.gpu_shapes[0], dtype, device, cfg, writer, deadline)
    print(f"CSV: {args.out / 'tune.csv'}")
    if args.emit_best is not None:
        # Configuration fields as `python -m benchmarks --set` lines.
        lines = {}
        # Per-shape geometries (RoPE, gated activations) and LayerNorm's share of RowNormConfig
        # are printed, not emitted: they belong in the heuristics.
        for op in ("cross_entropy", "rms_norm"):
            lines.update(bests.get(op) or {})
        args.emit_best.write_text("".join(f"{k}={v!r}\n" for k, v in lines.items()))
        print("best: " + ", ".join(f"{k}={v!r}" for k, v in lines.items()))
        for op in ("rms_norm", "layer_norm"):
            if bests.get(op) is not None:
                print(f"best {op} configuration: " + (", ".join(f"{k}={v!r}" for k, v in bests[op].items())
                                                      or "the heuristic"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
