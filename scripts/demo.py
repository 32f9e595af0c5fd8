"""The main job (``make demo``): train a small Llama twice with the HF Trainer, plain and with Liger.

Both runs start from the same weights (one model is built, the second is a deep copy made
before any training), see the same batches in the same order (same Trainer seed), and differ
only in ``TrainingArguments(use_liger_kernel=True)``, with which ``Trainer.train()`` patches the
model through ``liger_kernel.transformers._apply_liger_kernel_to_instance``.

Data: real text available offline - the Python standard library's own ``*.py`` sources
(sorted paths, read until a size cap), as byte-level tokens: ids 0-255 are bytes, 256 marks
a file boundary; ``--data-path`` takes any other text file or directory instead. Nothing
is downloaded: the model is built from a ``LlamaConfig``.

Printed and written to ``--out`` (default ``demo_out/``): both loss curves and whether they
agree (see ``EARLY_STEPS`` below for what that means once training amplifies rounding
differences), tokens/s and peak memory of each run, a held-out evaluation loss for each
(``prediction_loss_only``: the Liger model skips the logits), ``demo.png``,
``demo_losses.csv`` and ``demo_summary.csv``. The exit status is 0 only if they agree.

On a machine without CUDA the kernels run through the Triton interpreter with a tiny
model in fp32 (about 2 minutes on two cores). With CUDA a larger model trains in the
Trainer's bf16 mixed precision (``--precision`` picks fp32 or pure bf16 instead), and a
third, control run (plain HF with eager attention) measures HF's own rounding noise.
"""

import argparse
import contextlib
import copy
import csv
import math
import os
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

# Must precede the first import of triton (liger_kernel imports it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BYTE_VOCAB = 256
FILE_SEPARATOR_ID = 256  # between two source files
VOCAB_SIZE = 257  # deliberately not a multiple of 8: the kernels' masked tails get exercised

MODEL_SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=176),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=688),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048),
    "large": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                  intermediate_size=2816),
    # Llama-3.2-1B's decoder (hidden 2048, 16 layers, 32 / 8 heads) with the byte vocabulary
    "xl": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192),
}

# Defaults per device: on CPU every kernel runs in the Triton interpreter (Python loops over
# program ids, plus a fixed cost per launch), so the model, batches and run are tiny: a patched
# step of 4 x 32 tokens takes ~3.5 s on two shared cores, the whole demo about 2 minutes.
DEVICE_DEFAULTS = {
    "cpu": dict(model_size="tiny", steps=20, seq_len=32, batch_size=4, learning_rate=3e-3, eval_batches=2,
                precision="fp32", control=False),
    "cuda": dict(model_size=None, steps=200, seq_len=1024, batch_size=16, learning_rate=1e-3, eval_batches=8,
                 precision="bf16-mixed", control=True),
}

# The GPU default model: "large" (~0.2 B parameters; the control run peaks at ~44 GiB) where the
# GPU has room, else "base". At base size the patched step is host-bound on an H100 (its GPU
# draws 340-490 W against the plain step's ~515 W at full clock), so its tokens/s follow the
# host's speed (x1.01-x1.30 across machines); at large the GPU's work dominates
# (docs/performance.md).
LARGE_MODEL_MIN_GPU_GIB = 56


def gpu_default_model_size() -> str:
    total_gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    return "large" if total_gib >= LARGE_MODEL_MIN_GPU_GIB else "base"


# fp32: weights and compute in fp32. bf16: weights, activations and optimizer state in bf16
# (what the e2e benchmark trains). bf16-mixed: fp32 master weights with bf16 autocast, the
# HF Trainer's ``bf16=True`` (GPU only: the interpreter computes through numpy, which has no bf16).
PRECISIONS = ("fp32", "bf16", "bf16-mixed")

# When the curves must agree. Training amplifies any rounding difference: on an H200 (base
# model, lr 1e-3) plain HF against plain HF with eager instead of sdpa attention - the same
# math rounded differently - agree to 2.4e-7 over the first 20 steps in fp32 and then drift
# to 3.7e-2 apart by step 96. Past the first steps the distance between two curves is one
# sample of a chaotic process, so it cannot be held to a bound: over eleven bf16-mixed GPU
# runs of correct code the liger drift was 0.72-2.38 times the control's
# (docs/performance.md). The verdict is therefore two-part, both
# parts deterministic up to rounding:
# 1. Exactness, per step over the first EARLY_STEPS steps, before the drift (over every step
#    when there is no control run): |plain - liger| <= LOSS_RTOL * loss. fp32: rounding order
#    alone gives ~1e-6; 1e-4 leaves room for that while a wrong term in the math is orders of
#    magnitude larger. bf16: one bf16 unit roundoff (2**-8), as both runs round activations
#    and updates to bf16 in different orders.
# 2. Gradients at the trained weights (``gradient_check``): one held-out batch through the
#    plain run's final model three ways - HF as trained, HF patched as use_liger_kernel=True
#    patches it, and HF in float64 (the truth) - and, for the loss and for each group of
#    parameters, liger's relative error from the truth at most GRAD_ERROR_FACTOR times HF's
#    own (or GRAD_RTOL_FLOOR, where HF's error is smaller). This catches what the first steps
#    cannot show - a gradient term slightly wrong, an error that appears only once the weights
#    have moved from their initial values - without reading it off a chaotic trajectory.
# The control run's drift is still printed and plotted, as context for the curves.
EARLY_STEPS = 20
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2.0**-8, "bf16-mixed": 2.0**-8}
# Liger's gradient error may exceed HF's by this factor: the factor of the model tests' one-step
# check against float64 (tests/transformers/test_convergence.py). The kernel tests allow 1.25 per
# op; a model chains a dozen ops, each rounding at different points. On CPU, bf16-mixed through
# the interpreter (whose bf16 rounding is emulated), tiny and small models gave 1.00-1.44x per
# group; fp32 1.01-1.11x.
GRAD_ERROR_FACTOR = 2.0
# Below these relative errors a difference is rounding whatever HF's own error: fp32, ~100
# ulps (sums over ~1e4 terms in different orders); bf16, one unit roundoff.
GRAD_RTOL_FLOOR = {"fp32": 1e-5, "bf16": 2.0**-8, "bf16-mixed": 2.0**-8}
# Sequences in the gradient check's batch: float64 sdpa keeps every attention matrix.
GRAD_CHECK_MAX_BATCH = 4


# ----------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------
def stdlib_source_files() -> list[str]:
    """Every ``*.py`` of the standard library in sorted path order, third-party packages excluded."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(os.path.join(directory, n) for n in sorted(names) if n.endswith(".py"))
    return files


def text_files(path: str | None) -> list[str]:
    if path is None:
        return stdlib_source_files()
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        found = []
        for directory, subdirs, names in os.walk(path):
            subdirs.sort()
            found.extend(os.path.join(directory, n) for n in sorted(names))
        return found
    raise ValueError(f"--data-path {path!r} is neither a file nor a directory")


def byte_tokens(files: list[str], max_bytes: int) -> torch.Tensor:
    """Concatenated bytes of ``files`` (read in order until ``max_bytes``), separator between files."""
    chunks, total = [], 0
    for name in files:
        try:
            with open(name, "rb") as handle:
                data = handle.read(max_bytes - total)
        except OSError:
            continue
        if not data:
            continue
        chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).long())
        chunks.append(torch.tensor([FILE_SEPARATOR_ID]))
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise ValueError("no text found to train on")
    return torch.cat(chunks)


class TokenBlocks(torch.utils.data.Dataset):
    """Non-overlapping blocks of ``seq_len`` tokens; the labels are the inputs (the model shifts)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        n_blocks = tokens.numel() // seq_len
        self.blocks = tokens[: n_blocks * seq_len].view(n_blocks, seq_len)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block}


# ----------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------
class PeakRSS:
    """Peak resident set size of this process while the context is open (sampled every 20 ms).

    CPU only: the process-wide ``ru_maxrss`` never goes down, so it cannot tell the second
    run's peak from the first's; sampling ``/proc/self/statm`` can.
    """

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()

    @staticmethod
    def current_bytes() -> int:
        try:
            with open("/proc/self/statm") as handle:
                return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            import resource  # no /proc (macOS): fall back to the lifetime peak

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.current_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self.peak_bytes = self.current_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes())


@dataclass
class RunResult:
    name: str
    losses: dict[int, float]  # global step -> training loss logged at that step
    tokens_per_s: float
    peak_gib: float
    eval_loss: float
    seconds: float
    patched_modules: int


def make_callbacks(device: torch.device):
    from transformers.trainer_callback import ProgressCallback

    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        """Each step's logged loss and the wall time at the end of each step."""

        def __init__(self):
            self.losses: dict[int, float] = {}
            self.step_end_times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.step_end_times.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = float(logs["loss"])

    class LossInProgressBar(ProgressCallback):
        """Trainer's tqdm bar, with the loss in the bar instead of a printed dict per step."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
                self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}", refresh=False)

    return StepRecorder(), LossInProgressBar


def count_liger_patched_modules(model: torch.nn.Module) -> int:
    """Modules whose ``forward`` was replaced on the instance or whose class is a Liger one."""
    from liger_kernel.transformers import liger_patched_modules

    return len(liger_patched_modules(model))


def train_once(name: str, model, train_set, eval_set, args, device: torch.device, use_liger: bool) -> RunResult:
    from transformers.trainer_callback import ProgressCallback

    from transformers import Trainer, TrainingArguments

    recorder, progress_class = make_callbacks(device)
    with tempfile.TemporaryDirectory(prefix="liger_demo_") as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.steps // 10),
            weight_decay=0.0,
            max_grad_norm=1.0,
            logging_steps=1,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            use_cpu=device.type != "cuda",
            seed=args.seed,
            data_seed=args.seed,
            dataloader_drop_last=True,
            dataloader_num_workers=0,
            prediction_loss_only=True,
            use_liger_kernel=use_liger,
            bf16=args.precision == "bf16-mixed",
            disable_tqdm=False,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set,
                          callbacks=[recorder])
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(progress_class())

        print(f"\n[{name}] training {args.steps} steps" + (" with use_liger_kernel=True" if use_liger else ""),
              flush=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with PeakRSS() as rss:
            trainer.train()
            eval_loss = trainer.evaluate()["eval_loss"]
        seconds = time.perf_counter() - start
        peak_gib = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss.peak_bytes) / 2**30

    times = recorder.step_end_times
    tokens_per_step = args.batch_size * args.seq_len
    # The first step carries one-off costs (kernel compilation, allocator warm-up): time the rest.
    if len(times) >= 2:
        tokens_per_s = tokens_per_step * (len(times) - 1) / (times[-1] - times[0])
    else:
        tokens_per_s = tokens_per_step * len(times) / seconds
    return RunResult(name, recorder.losses, tokens_per_s, peak_gib, float(eval_loss), seconds,
                     count_liger_patched_modules(model))


@dataclass
class CurveComparison:
    n_steps: int
    complete: bool  # both runs logged a loss at every step
    max_diff: float
    max_step: int
    early_max_diff: float  # over the first ``early_steps`` logged steps
    early_max_rel_diff: float  # the same, each step's difference relative to the reference's loss
    mean_diff: float
    eval_diff: float


def compare_curves(reference: RunResult, other: RunResult, early_steps: int) -> CurveComparison:
    common = sorted(set(reference.losses) & set(other.losses))
    if not common:
        return CurveComparison(0, False, math.inf, -1, math.inf, math.inf, abs(reference.eval_loss - other.eval_loss))
    diffs = {s: abs(reference.losses[s] - other.losses[s]) for s in common}
    max_step = max(diffs, key=diffs.get)
    return CurveComparison(
        n_steps=len(common),
        complete=len(common) == len(reference.losses) == len(other.losses),
        max_diff=diffs[max_step],
        max_step=max_step,
        early_max_diff=max(diffs[s] for s in common[:early_steps]),
        early_max_rel_diff=max(diffs[s] / abs(reference.losses[s]) for s in common[:early_steps]),
        mean_diff=sum(diffs.values()) / len(diffs),
        eval_diff=abs(reference.eval_loss - other.eval_loss),
    )


def parameter_group(name: str) -> str:
    """The group a Llama parameter's gradient is judged in (embed_tokens is tied to lm_head)."""
    for key, group in (("norm", "norms"), ("self_attn", "attention"), ("mlp", "mlp")):
        if key in name:
            return group
    return "embedding"


def loss_and_gradients(model, input_ids: torch.Tensor, precision: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The causal-LM loss of ``input_ids`` and every parameter's gradient (float64 copies).

    ``precision`` "float64" computes the loss from the logits here: HF's own loss function
    upcasts logits to fp32 only, which would round the truth to fp32.
    """
    model.zero_grad(set_to_none=True)
    autocast = (torch.autocast(input_ids.device.type, dtype=torch.bfloat16) if precision == "bf16-mixed"
                else contextlib.nullcontext())
    with autocast:
        if precision == "float64":
            logits = model(input_ids=input_ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
        else:
            loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    grads = {name: p.grad.detach().double() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


@dataclass
class GradientCheck:
    errors: dict[str, tuple[float, float]]  # "loss" or a parameter group -> (HF, liger) relative error
    allowed: dict[str, float]

    @property
    def ok(self) -> bool:
        return all(self.errors[k][1] <= self.allowed[k] for k in self.errors)


def gradient_check(trained_model, input_ids: torch.Tensor, precision: str, liger_options=None) -> GradientCheck:
    """Loss and gradients of liger and of HF against the float64 truth, at ``trained_model``'s weights.

    ``trained_model`` is left as it was; the check works on three copies of it: HF as is, HF
    patched by ``_apply_liger_kernel_to_instance`` (what ``use_liger_kernel=True`` runs) and HF
    in float64. Each relative error is ``||g - g_truth|| / ||g_truth||`` over a group's
    gradients, and liger's may be at most ``GRAD_ERROR_FACTOR * max(HF's, GRAD_RTOL_FLOOR)``.
    """
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    truth_model = copy.deepcopy(trained_model).double()
    truth_loss, truth_grads = loss_and_gradients(truth_model, input_ids, "float64")
    del truth_model
    results = {}
    for name in ("hf", "liger"):
        model = copy.deepcopy(trained_model)
        if name == "liger":
            _apply_liger_kernel_to_instance(model=model, **(liger_options or {}))
        results[name] = loss_and_gradients(model, input_ids, precision)
        del model
    for name, (_, grads) in results.items():
        if set(grads) != set(truth_grads):
            raise RuntimeError(f"{name}: gradients for {sorted(set(grads) ^ set(truth_grads))} differ from the truth's")

    def relative_errors(loss: float, grads: dict[str, torch.Tensor]) -> dict[str, float]:
        squares: dict[str, list[float]] = {}
        for key, truth in truth_grads.items():
            sums = squares.setdefault(parameter_group(key), [0.0, 0.0])
            sums[0] += float((grads[key] - truth).square().sum())
            sums[1] += float(truth.square().sum())
        errors = {"loss": abs(loss - truth_loss) / abs(truth_loss)}
        errors.update({group: math.sqrt(err / max(ref, 1e-300)) for group, (err, ref) in sorted(squares.items())})
        return errors

    hf_errors, liger_errors = relative_errors(*results["hf"]), relative_errors(*results["liger"])
    floor = GRAD_RTOL_FLOOR[precision]
    return GradientCheck(
        errors={k: (hf_errors[k], liger_errors[k]) for k in hf_errors},
        allowed={k: GRAD_ERROR_FACTOR * max(hf_errors[k], floor) for k in hf_errors},
    )


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------
RUN_STYLES = {  # name -> (legend label, colour, line style)
    "plain": ("HF Trainer", "tab:gray", "-"),
    "liger": ("HF Trainer + use_liger_kernel", "tab:blue", "--"),
    "control": ("HF Trainer, eager attention (rounding control)", "tab:orange", ":"),
}


def write_outputs(out_dir: str, runs: list[RunResult], memory_label: str, title: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    plain = runs[0]
    others = runs[1:]
    steps = sorted(plain.losses)
    losses_path = os.path.join(out_dir, "demo_losses.csv")
    with open(losses_path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step"] + [f"loss_{r.name}" for r in runs] + ["abs_diff"]
                        + [f"abs_diff_{r.name}" for r in others[1:]])
        for s in steps:
            values = [r.losses.get(s, math.nan) for r in runs]
            writer.writerow([s] + [f"{v:.6f}" for v in values] + [f"{abs(values[0] - v):.3e}" for v in values[1:]])
    summary_path = os.path.join(out_dir, "demo_summary.csv")
    with open(summary_path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", "tokens_per_s", "peak_gib", "memory_kind", "final_loss", "eval_loss", "seconds"])
        for r in runs:
            writer.writerow([r.name, f"{r.tokens_per_s:.1f}", f"{r.peak_gib:.4f}", memory_label,
                             f"{r.losses[max(r.losses)]:.6f}", f"{r.eval_loss:.6f}", f"{r.seconds:.1f}"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff, ax_tps, ax_mem) = plt.subplots(
        1, 4, figsize=(19, 4.2), gridspec_kw={"width_ratios": [2, 1.5, 1, 1]})
    for r in runs:
        label, color, style = RUN_STYLES[r.name]
        ax_loss.plot(steps, [r.losses.get(s, math.nan) for s in steps], label=label, color=color, ls=style,
                     lw=2 if r is plain else 1.2)
    ax_loss.set(xlabel="step", ylabel="training loss (bytes, nats/token)", title="Loss curves")
    ax_loss.legend()
    for r in others:
        label, color, style = RUN_STYLES[r.name]
        ax_diff.plot(steps, [abs(plain.losses[s] - r.losses.get(s, math.nan)) for s in steps], color=color,
                     ls=style, label=f"|plain - {r.name}|")
    ax_diff.set(xlabel="step", ylabel="absolute loss difference", title="Difference from the plain run",
                yscale="log")
    ax_diff.legend()
    names = [r.name for r in runs]
    colors = [RUN_STYLES[r.name][1] for r in runs]
    for ax, values, label, fmt in ((ax_tps, [r.tokens_per_s for r in runs], "tokens / s", "{:,.0f}"),
                                   (ax_mem, [r.peak_gib for r in runs], "GiB", "{:.3f}")):
        ax.bar(names, values, color=colors)
        ax.set(ylabel=label)
        for i, v in enumerate(values):
            ax.text(i, v, fmt.format(v), ha="center", va="bottom")
    ax_tps.set_title("Throughput")
    ax_mem.set_title("Peak memory\n" + ("(torch.cuda.max_memory_allocated)" if memory_label.startswith("torch")
                                         else "(CPU: peak process RSS, sampled)"), fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    png_path = os.path.join(out_dir, "demo.png")
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return [losses_path, summary_path, png_path]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default=None,
                        help="tiny on CPU; on a GPU large, or base below 56 GiB of GPU memory")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (CPU 20, GPU 200)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (CPU 32, GPU 1024)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (CPU 4, GPU 16)")
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--data-path", default=None,
                        help="text file or directory to train on (default: the standard library's *.py files)")
    parser.add_argument("--max-data-mb", type=float, default=8.0, help="read at most this much text")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="fp32 on CPU, bf16 on GPU by default; bf16-mixed is the Trainer's bf16=True")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=None,
                        help="add a third run, plain HF with eager instead of sdpa attention: the same math "
                             "rounded differently, whose distance from the plain run is HF's own rounding noise "
                             "(default: on with a GPU, off on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="demo_out", help="directory for demo.png and the CSVs")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, value in DEVICE_DEFAULTS[device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.model_size is None:
        args.model_size = gpu_default_model_size()
    if args.steps < 1 or args.seq_len < 2 or args.batch_size < 1:
        parser.error("--steps >= 1, --seq-len >= 2 and --batch-size >= 1 are required")
    if device == "cpu" and args.precision != "fp32":
        parser.error("on CPU only --precision fp32 runs (the Triton interpreter has no bf16)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()

    files = text_files(args.data_path)
    tokens = byte_tokens(files, int(args.max_data_mb * 2**20))
    n_eval = args.eval_batches * args.batch_size * args.seq_len
    if tokens.numel() < n_eval + args.batch_size * args.seq_len:
        raise ValueError(f"not enough text: {tokens.numel()} tokens for batch {args.batch_size} x seq {args.seq_len}")
    train_set = TokenBlocks(tokens[:-n_eval], args.seq_len)
    eval_set = TokenBlocks(tokens[-n_eval:], args.seq_len)
    source = args.data_path or f"{sysconfig.get_paths()['stdlib']}/**/*.py"
    print(f"data: {len(files)} files from {source}, {tokens.numel():,} byte tokens "
          f"-> {len(train_set)} training and {len(eval_set)} held-out blocks of {args.seq_len}")

    config = LlamaConfig(
        **MODEL_SIZES[args.model_size],
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=max(2048, args.seq_len),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        use_cache=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(args.seed)
    # Build under ``dtype`` as the default dtype (as ``from_config(dtype=...)`` does) rather
    # than casting afterwards, which would also round the fp32 rotary frequencies.
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            plain_model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous_dtype)
    # Identical initial weights for every run: copies made before any training.
    liger_model = copy.deepcopy(plain_model)
    control_model = None
    if args.control:
        control_model = copy.deepcopy(plain_model)
        control_model.set_attn_implementation("eager")
    n_params = sum(p.numel() for p in plain_model.parameters())
    print(f"model: Llama-style '{args.model_size}' ({n_params / 1e6:.2f} M parameters, {args.precision}) on {device}"
          + (" - kernels run through the Triton interpreter" if device.type != "cuda" else ""))

    runs = [
        train_once("plain", plain_model, train_set, eval_set, args, device, use_liger=False),
        train_once("liger", liger_model, train_set, eval_set, args, device, use_liger=True),
    ]
    if control_model is not None:
        runs.append(train_once("control", control_model, train_set, eval_set, args, device, use_liger=False))
    plain, liger = runs[:2]

    memory_label = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                    else "peak process RSS during the run, sampled (CPU; includes Python/interpreter overhead)")
    # Without a control run (the CPU default: a tiny fp32 model, 20 steps, whose curves stay
    # within LOSS_RTOL throughout) every step must be exact; a run that trains long enough to
    # drift runs the control, whose own drift shows why only the first steps are held to it.
    early_steps = EARLY_STEPS if control_model is not None else args.steps
    comparisons = {r.name: compare_curves(plain, r, early_steps) for r in runs[1:]}
    liger_vs_plain = comparisons["liger"]
    rtol = LOSS_RTOL[args.precision]
    early_agree = liger_vs_plain.complete and liger_vs_plain.early_max_rel_diff <= rtol
    control = comparisons.get("control")

    n_check = min(len(eval_set), args.batch_size, GRAD_CHECK_MAX_BATCH)
    check_ids = torch.stack([eval_set[i]["input_ids"] for i in range(n_check)]).to(device)
    print(f"\n[gradient check] {n_check} held-out sequences through the trained plain model: HF, liger, float64",
          flush=True)
    grad_check = gradient_check(plain_model, check_ids, args.precision)
    agree = early_agree and grad_check.ok

    print("\n=== results ===")
    print(f"{'run':8s} {'tokens/s':>12s} {'peak GiB':>10s} {'first loss':>11s} {'final loss':>11s} {'eval loss':>10s}")
    for r in runs:
        print(f"{r.name:8s} {r.tokens_per_s:12,.0f} {r.peak_gib:10.3f} {r.losses[min(r.losses)]:11.4f} "
              f"{r.losses[max(r.losses)]:11.4f} {r.eval_loss:10.4f}")
    print(f"peak memory is {memory_label}")
    print(f"liger: forward replaced on {liger.patched_modules} modules by use_liger_kernel=True "
          f"(plain: {plain.patched_modules})")
    for name, c in comparisons.items():
        print(f"|plain - {name}|: max {c.max_diff:.3e} (step {c.max_step}), first {min(early_steps, c.n_steps)} steps max "
              f"{c.early_max_diff:.3e}, mean {c.mean_diff:.3e}; eval loss diff {c.eval_diff:.3e}")
    n_early = min(early_steps, liger_vs_plain.n_steps)
    print(f"exactness, first {n_early} steps: max |plain - liger| / loss = {liger_vs_plain.early_max_rel_diff:.2e} "
          f"(allowed {rtol:.2e}): {'ok' if early_agree else 'FAIL'}")
    print(f"gradients at the trained weights, relative error from float64 (liger allowed "
          f"{GRAD_ERROR_FACTOR:g} x max(HF's, {GRAD_RTOL_FLOOR[args.precision]:.1e})):")
    for key, (hf_error, liger_error) in grad_check.errors.items():
        verdict = "ok" if liger_error <= grad_check.allowed[key] else "FAIL"
        print(f"  {key:10s} HF {hf_error:.2e}  liger {liger_error:.2e}  allowed {grad_check.allowed[key]:.2e}: {verdict}")
    if control is not None:
        print(f"drift, all {liger_vs_plain.n_steps} steps (context, not a criterion): mean |plain - liger| = "
              f"{liger_vs_plain.mean_diff:.3e}, {liger_vs_plain.mean_diff / max(control.mean_diff, 1e-30):.2f} x "
              f"mean |plain - control| = {control.mean_diff:.3e} (HF's own rounding, amplified by training)")
    print(f"liger vs plain: {'AGREE' if agree else 'DISAGREE'} (exactness {'ok' if early_agree else 'FAIL'}, "
          f"gradients {'ok' if grad_check.ok else 'FAIL'}; max |plain - liger| {liger_vs_plain.max_diff:.3e} "
          f"over {liger_vs_plain.n_steps} steps)")
    print(f"liger / plain: tokens/s x{liger.tokens_per_s / plain.tokens_per_s:.2f}, "
          f"peak memory x{liger.peak_gib / plain.peak_gib:.2f}"
          + ("  (CPU interpreter timings say nothing about GPU speed)" if device.type != "cuda" else ""))

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    title = (f"Llama '{args.model_size}' on stdlib bytes, {args.precision}, batch {args.batch_size} x {args.seq_len}, "
             f"{device_name}: max loss diff {liger_vs_plain.max_diff:.1e}")
    for path in write_outputs(args.out, runs, memory_label, title):
        print(f"wrote {path}")
    return 0 if agree and plain.patched_modules == 0 < liger.patched_modules else 1


if __name__ == "__main__":
    sys.exit(main())
