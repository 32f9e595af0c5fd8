"""Is the demo's patched step host-bound? Host against GPU time per training step (GPU diagnostic).

Session 16 and 17 measured `make demo` (base model, 16 x 1024 tokens, bf16-mixed) at x1.01,
x1.17 and x1.03 tokens/s on H100s where session 15 measured x1.30, with the plain run steady
(224-247k tokens/s) and the GPU at full clock: the patched run's power drew 340-490 W where
the plain run drew ~515 W, i.e. its GPU sat partly idle. This script measures, per demo
model size (scripts/demo.py) and variant, one training step as the demo's Trainer runs it (bf16 autocast over fp32
weights, fused AdamW, gradient clipping, one loss ``.item()`` a step for the logged curve):

- ``synced``: wall time of a step that ends with ``loss.item()`` (what the demo times);
- ``gpu``: CUDA-event time of one step queued behind a ``torch.cuda._sleep`` head start, so
  that the GPU never waits for the host inside it.

A step is host-bound where ``synced`` exceeds ``gpu``. (A host-time column was dropped: a
step queues more kernels than CUDA's launch queue holds, so the host waited out the head
start; run 17 call 3 printed ~250 ms for every variant.)

Usage: ``python scripts/device/demo_step_timing.py [--shapes base,large,xl] [--steps 12]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from demo import MODEL_SIZES, VOCAB_SIZE  # noqa: E402

HEAD_START_CYCLES = 400_000_000


def build(shape: str, variant: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL_SIZES[shape], vocab_size=VOCAB_SIZE, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                         attn_implementation="sdpa", use_cache=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    if variant != "hf":
        import liger_kernel.transformers.causal_lm as causal_lm
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from liger_kernel.transformers.recompute import autocast_recasts

        # liger-forced: the recompute context entered under autocast too (the code before 7e933ca)
        causal_lm.autocast_recasts = (lambda device_type, dtype: False) if variant == "liger-forced" else autocast_recasts
        apply_liger_kernel_to_llama(model=model, recompute_norm_outputs=variant in ("liger", "liger-forced"))
    return model


def measure(model: torch.nn.Module, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Per-step ms: synced wall times and GPU times (see the module docstring)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, VOCAB_SIZE, (args.batch, args.seq), device="cuda")

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(3):
        step().item()
    synced = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step().item()
        synced.append(1e3 * (time.perf_counter() - t0))
    gpu = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        torch.cuda._sleep(HEAD_START_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return synced, gpu


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="base,large,xl")
    p.add_argument("--variants", default="hf,liger,liger-norecompute",
                   help="comma-separated, repeats allowed (interleave to see order effects): hf, liger, "
                        "liger-norecompute, liger-forced")
    p.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast over fp32 weights (the demo); --no-autocast: bf16 weights")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args()
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; batch {args.batch} x {args.seq}, "
          + ("bf16 autocast over fp32 weights" if args.autocast else "bf16 weights, no autocast")
          + ", fused AdamW, clip 1.0; ms per step, medians", flush=True)
    print(f"{'shape':7s} {'variant':17s} {'synced':>8s} {'gpu':>8s} {'tokens/s synced':>16s}", flush=True)
    for shape in args.shapes.split(","):
        for variant in args.variants.split(","):
            model = build(shape, variant, device, torch.float32 if args.autocast else torch.bfloat16)
            synced, gpu = measure(model, args)
            s = statistics.median(synced)
            print(f"{shape:7s} {variant:17s} {s:8.2f} {statistics.median(gpu):8.2f} "
                  f"{args.batch * args.seq / s * 1e3:16,.0f}", flush=True)
            del model
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
