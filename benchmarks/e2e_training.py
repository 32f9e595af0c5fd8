"""End-to-end training benchmark: unpatched Hugging Face Llama against the Liger-patched model.

Both variants train the same model (a Llama-3.2-1B-shaped ``LlamaConfig`` with random
weights from one seed, bf16 parameters, sdpa attention, torch AdamW) on the same fixed
random token batches, one after the other in a single process:

1. unpatched HF: build, train ``--warmup`` + ``--steps`` steps, optionally probe the
   longest sequence that still trains at this batch size, then free everything;
2. patched: the same initial weights, ``apply_liger_kernel_to_llama(model=instance)``, the
   same steps and probe.

Reported per variant: tokens/s over the timed steps (wall clock between two CUDA syncs),
peak memory (``torch.cuda.max_memory_allocated`` over warm-up and timed steps, statistics
reset after the model is built), every step's loss, and the longest sequence length found.
The two loss curves must agree to bf16 tolerance (see :data:`LOSS_RTOL`); the script exits
with status 1 when they do not.

Outputs in ``--out``: ``e2e.csv`` (one row per variant) and ``e2e.png`` (loss curves plus
bars of tokens/s and peak memory).

Usage::

    python benchmarks/e2e_training.py                      # llama-1b, batch 4, seq 2048 (GPU)
    python benchmarks/e2e_training.py --config tiny --steps 3 --warmup 1 --skip-max-seq   # CPU smoke
"""

import argparse
import csv
import datetime
import gc
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The Triton interpreter must be chosen before triton is first imported (liger imports it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import device_name, versions  # noqa: E402


def _liger_patched_modules(model: torch.nn.Module) -> list[str]:
    from liger_kernel.transformers import liger_patched_modules

    return liger_patched_modules(model)

# Agreement of the two loss curves: each loss is an fp32 mean over B*T tokens of values
# computed from bf16 logits, and the variants differ only in bf16 rounding order (and in
# the weights drifting apart by those roundings through AdamW). One bf16 unit roundoff
# (2**-8) relative to the loss bounds that comfortably while catching any real error (a
# wrong gradient moves the loss by far more within a few steps).
LOSS_RTOL = 2.0**-8

# Sequence lengths tried (one training step each) when looking for the longest that fits.
MAX_SEQ_CANDIDATES = (4096, 8192, 16384, 32768)
# Wall-clock budget for the whole search, shared between the two variants.
MAX_SEQ_BUDGET_S = 120.0


CONFIGS = {
    # Llama-3.2-1B shapes (random weights; nothing is downloaded).
    "llama-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        defaults=dict(batch=4, seq=2048, steps=10, warmup=3),
    ),
    # Small enough for the Triton interpreter on CPU: a smoke test of the whole pipeline.
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=176,
        vocab_size=500,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        defaults=dict(batch=2, seq=32, steps=3, warmup=1),
    ),
}


@dataclass
class VariantResult:
    """What one variant (``hf`` or ``liger``) measured."""

    variant: str
    tokens_per_s: float
    peak_gib: float
    median_step_ms: float
    losses: list[float]
    max_seq_len: int | None = None  # longest sequence that trained one step at this batch
    first_oom_seq_len: int | None = None  # shortest tried that ran out of memory
    search_s: float = 0.0  # seconds the longest-sequence search took
    patched_modules: int = 0  # modules whose forward the Liger patch replaced on the instance
    notes: list[str] = field(default_factory=list)


def build_config(name: str):
    from transformers import LlamaConfig

    spec = {k: v for k, v in CONFIGS[name].items() if k != "defaults"}
    rope_theta = spec.pop("rope_theta")
    return LlamaConfig(
        **spec,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        attn_implementation="sdpa",
        use_cache=False,
    )


def build_model(config, device: torch.device, dtype: torch.dtype, state_dict=None):
    """A ``LlamaForCausalLM`` built directly on ``device`` in ``dtype``.

    Parameters are created under ``dtype`` as the default dtype (as ``from_config`` does),
    so fp32 buffers such as the rotary ``inv_freq`` stay fp32.
    """
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    model.train()
    return model


def make_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    fused = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=fused)


def token_batches(n: int, batch: int, seq: int, vocab: int, seed: int, device: torch.device):
    """``n`` fixed batches of uniform random tokens; batch ``i`` depends only on (seed, i)."""
    batches = []
    for i in range(n):
        generator = torch.Generator().manual_seed(seed * 100003 + i)
        batches.append(torch.randint(0, vocab, (batch, seq), generator=generator).to(device))
    return batches


def train_step(model, optimizer, input_ids: torch.Tensor) -> torch.Tensor:
    """One optimisation step; returns the detached loss (no host sync)."""
    # Keep only the loss: holding the output object would keep HF's logits alive through
    # backward, which a normal training loop does not do.
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    # cuBLAS and some allocator paths report OOM as a plain RuntimeError.
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def find_max_seq(model, optimizer, batch: int, start_seq: int, vocab: int, device: torch.device,
                 budget_s: float) -> tuple[int, int | None, list[str]]:
    """Longest sequence length (at ``batch``) that trains one step without running out of memory.

    Doubling from ``start_seq`` through :data:`MAX_SEQ_CANDIDATES`, then one bisection step
    between the last length that fit and the first that did not (rounded to 1024). Stops
    early once ``budget_s`` seconds have passed (a step already started is finished).
    Returns ``(longest that fit, first that did not or None, notes)``.
    """
    deadline = time.perf_counter() + budget_s
    notes: list[str] = []
    fits, fails = start_seq, None

    def try_seq(seq: int) -> bool:
        free_memory(device)
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        try:
            train_step(model, optimizer, ids)
            synchronize(device)
            return True
        except Exception as error:  # noqa: BLE001 - only out-of-memory is expected here
            if not is_out_of_memory(error):
                raise
            return False
        finally:
            del ids
            optimizer.zero_grad(set_to_none=True)
            free_memory(device)

    for seq in (s for s in MAX_SEQ_CANDIDATES if s > start_seq):
        if time.perf_counter() > deadline:
            notes.append(f"search stopped at the time budget before seq {seq}")
            return fits, fails, notes
        if try_seq(seq):
            fits = seq
        else:
            fails = seq
            break
    else:
        notes.append(f"every candidate up to {MAX_SEQ_CANDIDATES[-1]} fit (search cap)")
        return fits, fails, notes

    middle = (fits + fails) // 2 // 1024 * 1024
    if fits < middle < fails:
        if time.perf_counter() > deadline:
            notes.append("bisection skipped at the time budget")
        elif try_seq(middle):
            fits = middle
        else:
            fails = middle
    return fits, fails, notes


def run_variant(variant: str, config, initial_state, args, device: torch.device, dtype: torch.dtype,
                batches: list[torch.Tensor], max_seq_budget_s: float | None) -> VariantResult:
    model = build_model(config, device, dtype, state_dict=initial_state)
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    optimizer = make_optimizer(model, device)

    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    losses = [train_step(model, optimizer, ids) for ids in batches[: args.warmup]]
    synchronize(device)

    timed = batches[args.warmup:]
    events = []
    start = time.perf_counter()
    for ids in timed:
        if device.type == "cuda":
            begin_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin_event.record()
            losses.append(train_step(model, optimizer, ids))
            end_event.record()
            events.append((begin_event, end_event))
        else:
            step_start = time.perf_counter()
            losses.append(train_step(model, optimizer, ids))
            events.append(time.perf_counter() - step_start)
    synchronize(device)
    elapsed = time.perf_counter() - start

    if device.type == "cuda":
        step_ms = [b.elapsed_time(e) for b, e in events]
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        step_ms = [1e3 * s for s in events]
        peak_gib = math.nan  # no allocator statistics on CPU
    tokens = sum(ids.numel() for ids in timed)
    result = VariantResult(
        patched_modules=len(_liger_patched_modules(model)),
        variant=variant,
        tokens_per_s=tokens / elapsed,
        peak_gib=peak_gib,
        median_step_ms=sorted(step_ms)[len(step_ms) // 2],
        losses=[float(x) for x in torch.stack(losses).float().cpu()],
    )
    if max_seq_budget_s is not None:
        search_start = time.perf_counter()
        result.max_seq_len, result.first_oom_seq_len, result.notes = find_max_seq(
            model, optimizer, args.batch, args.seq, config.vocab_size, device, max_seq_budget_s
        )
        result.search_s = time.perf_counter() - search_start

    del model, optimizer, losses
    free_memory(device)
    return result


def environment(device: torch.device) -> dict:
    import liger_kernel

    return {
        "gpu": device_name(device),
        **versions(),
        "liger_kernel": liger_kernel.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def write_csv(path: str, results: list[VariantResult], env: dict, args) -> None:
    n_losses = max(len(r.losses) for r in results)
    header = ["variant", "tokens_per_s", "peak_gib", "median_step_ms", "max_seq_len", "first_oom_seq_len",
              "patched_modules"]
    header += [f"loss_{i}" for i in range(n_losses)]
    header += ["config", "batch", "seq", "warmup", "steps", *env, "notes"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for r in results:
            row = [r.variant, f"{r.tokens_per_s:.1f}", f"{r.peak_gib:.3f}", f"{r.median_step_ms:.2f}",
                   r.max_seq_len if r.max_seq_len is not None else "",
                   r.first_oom_seq_len if r.first_oom_seq_len is not None else "", r.patched_modules]
            row += [f"{x:.6f}" for x in r.losses] + [""] * (n_losses - len(r.losses))
            row += [args.config, args.batch, args.seq, args.warmup, args.steps, *env.values(), "; ".join(r.notes)]
            writer.writerow(row)


def write_plot(path: str, results: list[VariantResult], env: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"hf": "HF (unpatched)", "liger": "Liger (patched)"}
    colors = {"hf": "tab:gray", "liger": "tab:blue"}
    fig, (ax_loss, ax_tps, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        ax_loss.plot(range(len(r.losses)), r.losses, marker="o", ms=3, label=labels[r.variant],
                     color=colors[r.variant], linestyle="-" if r.variant == "hf" else "--")
    ax_loss.axvline(args.warmup - 0.5, color="k", lw=0.5, ls=":")
    ax_loss.set(xlabel="step (dotted line: end of warm-up)", ylabel="training loss", title="Loss (same data)")
    ax_loss.legend()
    names = [labels[r.variant] for r in results]
    bar_colors = [colors[r.variant] for r in results]
    ax_tps.bar(names, [r.tokens_per_s for r in results], color=bar_colors)
    ax_tps.set(ylabel="tokens / s", title="Throughput")
    peaks = [0.0 if math.isnan(r.peak_gib) else r.peak_gib for r in results]
    ax_mem.bar(names, peaks, color=bar_colors)
    ax_mem.set(ylabel="GiB", title="Peak memory (max_memory_allocated)" + (" - n/a on CPU" if all(math.isnan(r.peak_gib) for r in results) else ""))
    for ax, values, fmt in ((ax_tps, [r.tokens_per_s for r in results], "{:,.0f}"),
                            (ax_mem, [r.peak_gib for r in results], "{:.1f}")):
        for i, v in enumerate(values):
            ax.text(i, 0.0 if math.isnan(v) else v, "n/a" if math.isnan(v) else fmt.format(v), ha="center", va="bottom")
    fig.suptitle(f"{args.config}, batch {args.batch} x seq {args.seq}, {env['gpu']}; torch {env['torch']}, "
                 f"triton {env['triton']}, transformers {env['transformers']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="llama-1b")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (llama-1b: 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (llama-1b: 3)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (llama-1b: 4)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (llama-1b: 2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results", help="directory for e2e.csv and e2e.png")
    parser.add_argument("--skip-max-seq", action="store_true", help="skip the longest-sequence search")
    args = parser.parse_args(argv)
    for key, value in CONFIGS[args.config]["defaults"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 2:
        parser.error("--steps >= 1, --warmup >= 0, --batch >= 1 and --seq >= 2 are required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # bf16 parameters on the GPU as in real training; fp32 on CPU, where the interpreter
    # (numpy underneath) has no native bf16 and this is only a smoke test.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = build_config(args.config)
    env = environment(device)
    print(f"e2e training: {args.config} ({dtype}), batch {args.batch} x seq {args.seq}, "
          f"{args.warmup} warm-up + {args.steps} timed steps on {env['gpu']}", flush=True)

    torch.manual_seed(args.seed)
    initial_state = {k: v.detach().to("cpu", copy=True)
                     for k, v in build_model(config, device, dtype).state_dict().items()}
    free_memory(device)
    batches = token_batches(args.warmup + args.steps, args.batch, args.seq, config.vocab_size, args.seed, device)

    results = []
    for variant in ("hf", "liger"):
        budget = None
        if not args.skip_max_seq:
            # One budget for both searches: HF gets at most half, Liger whatever HF left.
            spent = sum(r.search_s for r in results)
            budget = MAX_SEQ_BUDGET_S / 2 if variant == "hf" else max(0.0, MAX_SEQ_BUDGET_S - spent)
        t0 = time.perf_counter()
        result = run_variant(variant, config, initial_state, args, device, dtype, batches, budget)
        results.append(result)
        seq_info = "" if result.max_seq_len is None else (
            f", longest seq at batch {args.batch}: {result.max_seq_len}"
            + (f" (OOM at {result.first_oom_seq_len})" if result.first_oom_seq_len else ""))
        print(f"  {variant:5s}: {result.tokens_per_s:12,.0f} tokens/s, peak {result.peak_gib:7.2f} GiB, "
              f"median step {result.median_step_ms:8.1f} ms, {result.patched_modules} modules patched{seq_info}  "
              f"[{time.perf_counter() - t0:.0f} s]", flush=True)
        for note in result.notes:
            print(f"         note: {note}")

    hf, liger = results
    diffs = [abs(a - b) for a, b in zip(hf.losses, liger.losses)]
    max_diff = max(diffs)
    allowed = LOSS_RTOL * max(abs(x) for x in hf.losses)
    losses_match = all(math.isfinite(x) for x in hf.losses + liger.losses) and max_diff <= allowed
    print(f"  losses hf    : {' '.join(f'{x:.4f}' for x in hf.losses)}")
    print(f"  losses liger : {' '.join(f'{x:.4f}' for x in liger.losses)}")
    print(f"  max |loss diff| = {max_diff:.3e} (allowed {allowed:.3e}): {'match' if losses_match else 'MISMATCH'}")
    speedup = liger.tokens_per_s / hf.tokens_per_s
    print(f"  liger / hf: tokens/s x{speedup:.3f}", end="")
    if device.type == "cuda":
        print(f", peak memory x{liger.peak_gib / hf.peak_gib:.3f}")
    else:
        print(" (CPU interpreter: throughput is not meaningful; no peak-memory statistic)")

    os.makedirs(args.out, exist_ok=True)
    csv_path, png_path = os.path.join(args.out, "e2e.csv"), os.path.join(args.out, "e2e.png")
    write_csv(csv_path, results, env, args)
    write_plot(png_path, results, env, args)
    print(f"  wrote {csv_path} and {png_path}")
    if liger.patched_modules == 0 or hf.patched_modules != 0:
        print("  ERROR: the Liger patch did not replace any module forward (or the HF model was patched)")
        return 1
    return 0 if losses_match else 1


if __name__ == "__main__":
    sys.exit(main())
