"""A/B of ``recompute_norm_outputs`` in the end-to-end step (GPU diagnostic, not a benchmark).

Same model, batches and optimizer as ``benchmarks/e2e_training.py`` (llama-1b, batch 4 x
2048), patched with the option off and on, alternating ``--rounds`` times so drift of the
machine affects both alike: tokens/s over ``--steps`` timed steps and peak memory.

Usage: ``python scripts/device/ab_recompute.py [--rounds 2] [--steps 10]``
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.e2e_training import build_config, build_model, make_optimizer, token_batches, train_step  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    device = torch.device("cuda")
    config = build_config("llama-1b")
    torch.manual_seed(0)
    state = {k: v.detach().cpu() for k, v in build_model(config, device, torch.bfloat16).state_dict().items()}
    batches = token_batches(3 + args.steps, 4, 2048, config.vocab_size, 0, device)
    for round_index in range(args.rounds):
        for recompute in (False, True):
            model = build_model(config, device, torch.bfloat16, state_dict=state)
            apply_liger_kernel_to_llama(model=model, recompute_norm_outputs=recompute)
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
            print(f"round {round_index} recompute_norm_outputs={recompute!s:5}: {tokens / elapsed:9,.0f} tokens/s, "
                  f"peak {torch.cuda.max_memory_allocated(device) / 2**30:6.2f} GiB, last loss {float(loss):.4f}",
                  flush=True)
            del model, optimizer
    return 0


if __name__ == "__main__":
    sys.exit(main())
