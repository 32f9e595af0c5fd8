"""Host time against GPU time per decoder layer in the e2e forward (GPU diagnostic, not a benchmark).

Run 9's steady-state profile showed the forward idle ~4 ms a step in gaps spread over every
decoder layer, which means the host issues a layer no faster than the GPU runs it. This
script measures both sides per layer, with the host kept from ever waiting on the GPU: a
forward pre-hook on the first decoder layer queues ``torch.cuda._sleep`` (a head start of
~0.1 s, after HF's mask code has synced), so the host's time per layer is its own Python and
launch cost, and CUDA events at every layer boundary give the GPU's time per layer.

Variants: ``hf`` (unpatched), ``liger`` (``apply_liger_kernel_to_llama``), ``liger-norecompute``
(the patch without ``recompute_norm_outputs``), ``liger-regionhooks`` (the recompute's
saved-tensor hooks over the whole decoder forward, the scope before 2026-12-05, instead of
only inside the projections), ``liger-tritonlaunch`` (every kernel through ``kernel[grid]``
instead of the cached launcher). Per variant: host and GPU ms per layer
(median over layers 1..15 of three forwards), and a cProfile of one forward's layers (own
time), to ``OUT/host_layers.txt``.

``--blas cublas|cublaslt`` sets ``torch.backends.cuda.preferred_blas_library`` first (process-wide,
for every variant): run 11's profiles put ~50 us of host time on each ``F.linear`` call.

Usage: ``python scripts/device/host_layers.py --out OUT [--variants hf,liger] [--blas cublas]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.e2e_training import build_config, build_model, make_optimizer, token_batches  # noqa: E402

HEAD_START_CYCLES = 200_000_000  # ~0.1 s at H200 clocks: longer than the host's whole forward


class LayerClock:
    def __init__(self, layers) -> None:
        self.layers = layers
        self.head_start = False
        self.profiler: cProfile.Profile | None = None
        self.host: list[float] = []
        self.events: list[torch.cuda.Event] = []
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._pre(i))
            layer.register_forward_hook(self._post(i))

    def _mark(self) -> None:
        self.host.append(time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    def _pre(self, i: int):
        def hook(module, args):
            if i == 0:
                self.host, self.events = [], []
                if self.head_start:
                    torch.cuda._sleep(HEAD_START_CYCLES)
                if self.profiler is not None:
                    self.profiler.enable()
                self._mark()

        return hook

    def _post(self, i: int):
        def hook(module, args, output):
            self._mark()
            if i == len(self.layers) - 1 and self.profiler is not None:
                self.profiler.disable()

        return hook

    def per_layer(self) -> tuple[list[float], list[float]]:
        torch.cuda.synchronize()
        host = [1e3 * (b - a) for a, b in zip(self.host, self.host[1:])]
        gpu = [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        return host, gpu


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="hf,liger,liger-regionhooks,liger-norecompute")
    p.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    print(f"# BLAS library: {torch.backends.cuda.preferred_blas_library()}", flush=True)
    config = build_config("llama-1b")
    torch.manual_seed(0)
    batches = token_batches(6, 4, 2048, config.vocab_size, 0, device)
    report = []
    for variant in args.variants.split(","):
        import liger_kernel.ops.utils as ops_utils
        import liger_kernel.transformers.causal_lm as causal_lm

        ops_utils.FAST_LAUNCH = variant != "liger-tritonlaunch"
        causal_lm.RECOMPUTE_SCOPE = "region" if variant == "liger-regionhooks" else "consumers"
        model = build_model(config, device, torch.bfloat16)
        if variant.startswith("liger"):
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(model=model, recompute_norm_outputs=variant != "liger-norecompute")
        optimizer = make_optimizer(model, device)
        clock = LayerClock(model.model.layers)
        for ids in batches[:2]:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        hosts, gpus = [], []
        clock.head_start = True
        for ids in batches[2:5]:
            torch.cuda.synchronize()
            loss = model(input_ids=ids, labels=ids).loss
            host, gpu = clock.per_layer()
            hosts += host[1:]
            gpus += gpu[1:]
            loss.backward()
            optimizer.zero_grad(set_to_none=True)
        clock.profiler = cProfile.Profile()
        torch.cuda.synchronize()
        loss = model(input_ids=batches[5], labels=batches[5]).loss
        clock.per_layer()
        profiler, clock.profiler = clock.profiler, None
        loss.backward()
        optimizer.zero_grad(set_to_none=True)
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(30)
        text = (f"# {variant}: per decoder layer (median of layers 1..15 x 3 forwards, host never waiting): "
                f"host {statistics.median(hosts):.3f} ms, GPU {statistics.median(gpus):.3f} ms "
                f"(host min {min(hosts):.3f} max {max(hosts):.3f}; GPU min {min(gpus):.3f} max {max(gpus):.3f})\n"
                f"{stream.getvalue()}")
        print(text.splitlines()[0], flush=True)
        report.append(text)
        del model, optimizer, clock, loss
        torch.cuda.empty_cache()
    name = "host_layers.txt" if args.blas == "default" else f"host_layers_{args.blas}.txt"
    (args.out / name).write_text("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
