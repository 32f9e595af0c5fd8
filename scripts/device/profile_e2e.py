"""Where the end-to-end step spends its time and memory (GPU diagnostic, not a benchmark).

Builds the ``benchmarks/e2e_training.py`` model (llama-1b shapes, bf16, fused AdamW), for
each variant given (``hf``, ``liger``): a few warm-up steps, then

* memory by phase: peak and live memory after forward, after backward, after the
  optimizer step (``max_memory_allocated`` reset between phases);
* one step under ``torch.profiler``: the CUDA kernels sorted by total time (top rows),
  written to ``OUT/profile_<variant>.txt``.

Usage: ``python scripts/device/profile_e2e.py --out OUT [--variants hf,liger]``
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.e2e_training import build_config, build_model, make_optimizer, token_batches  # noqa: E402

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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="hf,liger")
    p.add_argument("--rows", type=int, default=45)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    config = build_config("llama-1b")
    torch.manual_seed(0)
    batches = token_batches(4, 4, 2048, config.vocab_size, 0, device)
    for variant in args.variants.split(","):
        model = build_model(config, device, torch.bfloat16)
        if variant == "liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(model=model)
        optimizer = make_optimizer(model, device)
        for ids in batches[:2]:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        phases = memory_phases(model, optimizer, batches[2])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(input_ids=batches[3], labels=batches[3]).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90)
        text = f"# {variant}\n{phases}\n\n{table}\n"
        (args.out / f"profile_{variant}.txt").write_text(text)
        print(text, flush=True)
        del model, optimizer, prof
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
