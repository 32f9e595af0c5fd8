"""Where a training step synchronises the host with the GPU (GPU diagnostic, not a benchmark).

Builds the ``benchmarks/e2e_training.py`` model (llama-1b shapes, bf16) for each variant
(``hf``, ``liger``), runs two warm-up steps, then one step under
``torch.cuda.set_sync_debug_mode("warn")`` and prints every synchronising call with the
Python stack that made it. A sync drains the GPU's queue: the host must then get ahead
again, and wherever it cannot, the GPU idles (``profile_e2e.py --steady`` shows where).

Usage: ``python scripts/sync_points.py [--variants hf,liger]``
"""

import argparse
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e_training import build_config, build_model, make_optimizer, token_batches, train_step


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="hf,liger")
    args = p.parse_args()
    device = torch.device("cuda")
    config = build_config("llama-1b")
    batches = token_batches(3, 4, 2048, config.vocab_size, 0, device)
    for variant in args.variants.split(","):
        model = build_model(config, device, torch.bfloat16)
        if variant == "liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(model=model)
        optimizer = make_optimizer(model, device)
        for ids in batches[:2]:
            train_step(model, optimizer, ids)
        torch.cuda.synchronize(device)
        seen: list[str] = []

        def show(message, category, filename, lineno, file=None, line=None, seen=seen):
            stack = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
            frames = [f"    {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in stack[-14:]]
            seen.append(f"  {str(message)[:100]}\n" + "\n".join(frames))

        old_show = warnings.showwarning
        warnings.showwarning = show
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(model, optimizer, batches[2])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old_show
        torch.cuda.synchronize(device)
        print(f"# {variant}: {len(seen)} synchronising calls in one step")
        for entry in seen:
            print(entry)
        del model, optimizer
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
