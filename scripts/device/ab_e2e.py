"""A/B of library settings in the end-to-end step (GPU diagnostic, not a benchmark).

Same model, batches and optimizer as ``benchmarks/e2e_training.py`` (llama-1b, batch 4 x
2048), patched with ``apply_liger_kernel_to_llama`` under each named variant in turn,
alternating ``--rounds`` times so drift of the machine affects all alike: tokens/s over
``--steps`` timed steps and peak memory, one line per (round, variant) and a CSV.

Variants (``--variants``, comma list):
  base         the defaults
  norecompute  ``recompute_norm_outputs=False``
  nocheck      the fused loss skips its target-range check (the one host sync per forward);
               for measuring what that sync costs, never for training
  chunk256     ``FLCE_CHUNK_BUDGET_BYTES = 256 MiB``
  regionhooks  the norm-output recompute's saved-tensor hooks over the whole decoder forward
               (``causal_lm.RECOMPUTE_SCOPE = "region"``, the scope before 2026-12-05)

Usage: ``python scripts/device/ab_e2e.py [--variants base,nocheck] [--rounds 2] [--steps 10] [--csv F]``
"""

import argparse
import contextlib
import csv
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.e2e_training import build_config, build_model, make_optimizer, token_batches, train_step  # noqa: E402


@contextlib.contextmanager
def variant_settings(name: str):
    """Module attributes set for the variant (restored afterwards) and the patch kwargs."""
    import liger_kernel.ops.fused_linear_cross_entropy as flce_ops
    import liger_kernel.transformers.causal_lm as causal_lm

    overrides, patch_kwargs = [], {}
    if name == "norecompute":
        patch_kwargs["recompute_norm_outputs"] = False
    elif name == "nocheck":
        overrides.append((flce_ops, "check_target", lambda *args, **kwargs: None))
    elif name == "chunk256":
        overrides.append((flce_ops, "FLCE_CHUNK_BUDGET_BYTES", 256 * 2**20))
    elif name == "regionhooks":
        overrides.append((causal_lm, "RECOMPUTE_SCOPE", "region"))
    elif name != "base":
        raise SystemExit(f"unknown variant {name!r}")
    saved = [(module, key, getattr(module, key)) for module, key, _ in overrides]
    for module, key, value in overrides:
        setattr(module, key, value)
    try:
        yield patch_kwargs
    finally:
        for module, key, value in saved:
            setattr(module, key, value)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="base,norecompute")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--csv", type=Path, default=None)
    args = p.parse_args()
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    device = torch.device("cuda")
    config = build_config("llama-1b")
    torch.manual_seed(0)
    state = {k: v.detach().cpu() for k, v in build_model(config, device, torch.bfloat16).state_dict().items()}
    batches = token_batches(3 + args.steps, 4, 2048, config.vocab_size, 0, device)
    rows = []
    for round_index in range(args.rounds):
        for variant in args.variants.split(","):
            with variant_settings(variant) as patch_kwargs:
                model = build_model(config, device, torch.bfloat16, state_dict=state)
                apply_liger_kernel_to_llama(model=model, **patch_kwargs)
                optimizer = make_optimizer(model, device)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                for ids in batches[:3]:
                    train_step(model, optimizer, ids)
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                for ids in batches[3:]:
                    loss = train_step(model, optimizer, ids)
                torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - start
                tokens = sum(ids.numel() for ids in batches[3:])
                row = dict(round=round_index, variant=variant, tokens_per_s=round(tokens / elapsed, 1),
                           peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
                           last_loss=round(float(loss), 6))
                rows.append(row)
                print(f"round {row['round']} {variant:12s}: {row['tokens_per_s']:9,.0f} tokens/s, "
                      f"peak {row['peak_gib']:6.2f} GiB, last loss {row['last_loss']:.4f}", flush=True)
                del model, optimizer
                gc.collect()
    if args.csv is not None:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
