"""End-to-end training benchmark: unpatched Hugging Face models against the Liger-patched model.

Every variant trains the same model (a ``--model`` preset built from its ``transformers``
config class with random weights from one seed; bf16 parameters, sdpa attention, torch
AdamW; nothing is downloaded) on the same fixed random token batches, one variant after
the other in a single process:

* ``hf``: the unpatched model, eager;
* ``hf-compile``: ``torch.compile`` of the whole unpatched model;
* ``liger``: ``liger_kernel.transformers._apply_liger_kernel_to_instance(model=...)``, eager
  (generic: a model type the library does not patch yet is left with what it could patch,
  and ``patched`` says what that was);
* ``liger-compile``: ``torch.compile`` of the patched model;
* ``liger-upstream``: the upstream Liger-Kernel release patching the same model, run in a
  child process whose ``PYTHONPATH`` starts at ``--upstream-path`` (``benchmarks.peers``).

Unpatched variants run first (a patch may change classes as well as the instance).
Reported per variant: tokens/s over the timed steps (wall clock between two CUDA syncs),
peak memory (``torch.cuda.max_memory_allocated`` over warm-up and timed steps, statistics
reset after the model is built), every step's loss, the longest sequence that trains at
the batch size (``--max-seq-limit`` extends the search past 32768), and the step floor of
``benchmarks.step_floor`` (GEMM + attention kernel time of one profiled step with the LM
head's GEMMs at the measured cuBLAS rate) over the median step time.
``--grad-ckpt on|both`` trains with gradient checkpointing (``both``: every variant twice).
``--max-batch``: throughput where memory binds; each variant first finds the largest batch
that trains at ``--seq``, then is timed at that batch (losses are then not compared: the
batches differ).

The loss curves must agree to bf16 tolerance (see :data:`LOSS_RTOL`); the script exits with
status 1 when they do not.

Outputs in ``--out``: ``e2e.csv`` (one row per variant) and ``e2e.png`` (loss curves plus
bars of tokens/s and peak memory); presets other than ``llama-1b`` and ``--max-batch``
runs add a suffix (``e2e_qwen3-0.6b.csv``, ``e2e_llama-1b_max-batch.csv``).

Usage::

    python benchmarks/e2e_training.py                      # llama-1b, batch 4, seq 2048 (GPU)
    python benchmarks/e2e_training.py --model qwen3-0.6b --variants hf,hf-compile,liger,liger-compile
    python benchmarks/e2e_training.py --model llama-1b --seq 16384 --max-batch --skip-max-seq
    python benchmarks/e2e_training.py --model tiny --steps 3 --warmup 1 --skip-max-seq   # CPU smoke
    python benchmarks/e2e_training.py --objective dpo --variants hf-compile,liger,liger-upstream --skip-max-seq
"""

import argparse
import csv
import datetime
import functools
import gc
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# The Triton interpreter must be chosen before triton is first imported (liger imports it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(REPO_ROOT))
from benchmarks import step_floor  # noqa: E402
from benchmarks.harness import device_name, versions  # noqa: E402
from benchmarks.objectives import OBJECTIVES, Objective, build_objective, needs_reference, sft  # noqa: E402

# Agreement of the loss curves: each loss is an fp32 mean over B*T tokens of values
# computed from bf16 logits, and the variants differ only in bf16 rounding order (and in
# the weights drifting apart by those roundings through AdamW). One bf16 unit roundoff
# (2**-8) relative to the loss bounds that comfortably while catching any real error (a
# wrong gradient moves the loss by far more within a few steps).
LOSS_RTOL = 2.0**-8

# Sequence lengths tried (one training step each) when looking for the longest that fits.
MAX_SEQ_CANDIDATES = (4096, 8192, 16384, 32768)
# Wall-clock budget for the whole search, shared between the variants.
MAX_SEQ_BUDGET_S = 120.0
# Largest batch tried by --max-batch.
MAX_BATCH_LIMIT = 512

VARIANTS = ("hf", "hf-compile", "liger", "liger-compile", "liger-upstream")
DEFAULT_VARIANTS = ("hf", "liger")

MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}

GPU_DEFAULTS = dict(batch=4, seq=2048, steps=10, warmup=3)
TINY_DEFAULTS = dict(batch=2, seq=32, steps=3, warmup=1)
# Dimensions of every tiny-* preset (kept only where the full preset sets the key).
TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=500, max_position_embeddings=4096,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, query_pre_attn_scalar=16,
                 sliding_window=16)

LLAMA_1B = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)

# Each preset: the transformers config class, its keyword arguments (shapes of the named
# public model; random weights), the default run shape, and what a tiny-* copy changes
# besides TINY_DIMS.
PRESETS = {
    # Llama-3.2-1B shapes.
    "llama-1b": dict(config_class="LlamaConfig", config=LLAMA_1B, defaults=GPU_DEFAULTS),
    # Llama-3-8B dimensions with 4 of its 32 layers, at the 8B model's training shape.
    "llama3-8b-4l": dict(config_class="LlamaConfig", config=dict(
        LLAMA_1B, hidden_size=4096, num_hidden_layers=4, head_dim=128, intermediate_size=14336,
        tie_word_embeddings=False), defaults=dict(GPU_DEFAULTS, batch=2, seq=4096)),
    # Qwen3-0.6B: a small body under a 151,936-token head (q/k RMSNorms per head).
    "qwen3-0.6b": dict(config_class="Qwen3Config", config=dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        defaults=GPU_DEFAULTS),
    # Gemma-3-1B text model: 262,144-token head, (1 + w) RMSNorms, tanh-GELU MLP, 5 sliding
    # (window 512) : 1 global attention layers.
    "gemma3-1b": dict(config_class="Gemma3TextConfig", config=dict(
        hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        intermediate_size=6912, vocab_size=262144, tie_word_embeddings=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=512,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
        defaults=GPU_DEFAULTS, tiny=dict(layer_types=["sliding_attention", "full_attention"])),
    # Qwen3-30B-A3B's layer (hidden 2048, 32/4 heads of 128, experts of 768, top-8 routing)
    # with 64 experts and 8 layers: ~3.2B parameters, ~26 GB of bf16 weights, gradients and
    # AdamW state, so batch 4 x 2048 fits an 80 GB card with room for activations.
    "qwen3-moe": dict(config_class="Qwen3MoeConfig", config=dict(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        defaults=GPU_DEFAULTS),
    # Qwen2.5-VL-3B's text decoder (multimodal rotary sections 16/24/24) under its
    # ForConditionalGeneration head, trained on text; a one-block vision tower stands in for
    # the real one (no images are fed). Batch 2: HF eager at batch 4 x 2048 is near 80 GB.
    "qwen2.5-vl-3b": dict(config_class="Qwen2_5_VLConfig", config=dict(
        text_config=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                         intermediate_size=11008, vocab_size=151936, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, use_cache=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=1, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=2048,
                           fullatt_block_indexes=[0]),
        tie_word_embeddings=True),
        defaults=dict(GPU_DEFAULTS, batch=2),
        tiny=dict(text_config=dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                    "mrope_section": [2, 3, 3]},
                                   bos_token_id=None, eos_token_id=None),
                  vision_config=dict(out_hidden_size=TINY_DIMS["hidden_size"]))),
}


def _tiny(config: dict, extra: dict) -> dict:
    """``config`` with TINY_DIMS applied where it sets a key (nested configs too), then ``extra``."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and key.endswith("_config"):
            out[key] = {**_tiny(value, {}), **extra.get(key, {})}
        else:
            out[key] = TINY_DIMS.get(key, value)
    out.update({k: v for k, v in extra.items() if not k.endswith("_config")})
    return out


# Small enough for the Triton interpreter on CPU: smoke tests of the whole pipeline.
PRESETS["tiny"] = dict(config_class="LlamaConfig", config=dict(
    LLAMA_1B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=176, vocab_size=500, max_position_embeddings=4096), defaults=TINY_DEFAULTS)
for _name in [n for n in PRESETS if n != "tiny"]:
    _preset = PRESETS[_name]
    PRESETS[f"tiny-{_name}"] = dict(config_class=_preset["config_class"],
                                    config=_tiny(_preset["config"], _preset.get("tiny", {})),
                                    defaults=TINY_DEFAULTS)


@dataclass
class VariantResult:
    """What one variant measured."""

    variant: str  # "hf", "liger-compile", ...; "+ckpt" when trained with gradient checkpointing
    tokens_per_s: float
    peak_gib: float
    median_step_ms: float
    losses: list[float]
    batch: int = 0
    seq: int = 0
    max_seq_len: int | None = None  # longest sequence that trained one step at this batch
    first_oom_seq_len: int | None = None  # shortest tried that ran out of memory
    search_s: float = 0.0  # seconds the longest-sequence search took
    first_oom_batch: int | None = None  # --max-batch: smallest batch tried that did not fit
    patched_modules: int = 0  # modules whose forward the Liger patch replaced on the instance
    patched: str = ""  # those modules by class, e.g. "Qwen3RMSNorm x113; Qwen3MLP x28"
    floor: step_floor.StepFloor | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def floor_over_step(self) -> float:
        return self.floor.floor_ms / self.median_step_ms if self.floor is not None else math.nan


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def build_config(name: str):
    """The ``transformers`` config of preset ``name`` (sdpa attention, no KV cache)."""
    import transformers

    preset = PRESETS[name]
    config = getattr(transformers, preset["config_class"])(**preset["config"], attn_implementation="sdpa")
    config.use_cache = False
    text_config(config).use_cache = False
    return config


def data_vocab(config) -> int:
    """Token ids for the random batches: the text vocabulary below any multimodal special id."""
    ids = [getattr(config, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id")]
    return min([text_config(config).vocab_size] + [i for i in ids if isinstance(i, int) and i > 0])


def build_model(config, device: torch.device, dtype: torch.dtype, state_dict=None):
    """The preset's model class (``MODEL_CLASSES``) built directly on ``device`` in ``dtype``.

    Parameters are created under ``dtype`` as the default dtype (as ``from_config`` does),
    so fp32 buffers such as the rotary ``inv_freq`` stay fp32.
    """
    import transformers

    model_class = getattr(transformers, MODEL_CLASSES[config.model_type])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)
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


def train_step(model, optimizer, input_ids: torch.Tensor, objective: Objective = sft) -> torch.Tensor:
    """One optimisation step of ``objective`` (:mod:`benchmarks.objectives`); returns the detached
    loss (no host sync)."""
    # Keep only the loss: holding the output object would keep HF's logits alive through
    # backward, which a normal training loop does not do.
    loss = objective(model, input_ids)
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


def seq_candidates(limit: int) -> tuple[int, ...]:
    """MAX_SEQ_CANDIDATES, doubled on past 32768 up to ``limit``."""
    out = [s for s in MAX_SEQ_CANDIDATES if s <= limit]
    while out and out[-1] * 2 <= limit:
        out.append(out[-1] * 2)
    return tuple(out)


def search_largest(fits, start: int, candidates, quantum: int, deadline: float, bisections: int,
                   what: str) -> tuple[int, int | None, list[str]]:
    """Largest value that ``fits(value)``, ``start`` assumed to fit.

    Tries the ``candidates`` above ``start`` in order until one fails, then bisects
    (``bisections`` steps, rounded down to ``quantum``) between the last that fit and the
    first that did not. Stops once ``deadline`` (``time.perf_counter``) has passed.
    Returns ``(largest that fit, smallest that did not or None, notes)``.
    """
    notes: list[str] = []
    good, bad = start, None
    for value in (c for c in candidates if c > start):
        if time.perf_counter() > deadline:
            notes.append(f"search stopped at the time budget before {what} {value}")
            return good, bad, notes
        if fits(value):
            good = value
        else:
            bad = value
            break
    else:
        notes.append(f"every candidate up to {candidates[-1]} fit (search cap)")
        return good, bad, notes
    for _ in range(bisections):
        middle = (good + bad) // 2 // quantum * quantum
        if not good < middle < bad:
            break
        if time.perf_counter() > deadline:
            notes.append("bisection skipped at the time budget")
            break
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good, bad, notes


def _step_fits(model, optimizer, batch: int, seq: int, vocab: int, device: torch.device,
               objective: Objective = sft) -> bool:
    """One training step at ``(batch, seq)``; False when it runs out of memory."""
    free_memory(device)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    try:
        train_step(model, optimizer, ids, objective)
        synchronize(device)
        return True
    except Exception as error:  # only out-of-memory is expected here
        if not is_out_of_memory(error):
            raise
        return False
    finally:
        del ids
        optimizer.zero_grad(set_to_none=True)
        free_memory(device)


def find_max_seq(model, optimizer, batch: int, start_seq: int, vocab: int, device: torch.device,
                 budget_s: float, candidates=MAX_SEQ_CANDIDATES,
                 objective: Objective = sft) -> tuple[int, int | None, list[str]]:
    """Longest sequence length (at ``batch``) that trains one step without running out of memory.

    Doubling from ``start_seq`` through ``candidates``, then one bisection step between the
    last length that fit and the first that did not (rounded to 1024). Stops early once
    ``budget_s`` seconds have passed (a step already started is finished).
    """
    return search_largest(lambda seq: _step_fits(model, optimizer, batch, seq, vocab, device, objective), start_seq,
                          candidates, quantum=1024, deadline=time.perf_counter() + budget_s, bisections=1,
                          what="seq")


def find_max_batch(model, optimizer, seq: int, vocab: int, device: torch.device, budget_s: float,
                   limit: int = MAX_BATCH_LIMIT, objective: Objective = sft) -> tuple[int, int | None, list[str]]:
    """Largest batch that trains one step at ``seq``: doubling from 1, then three bisection steps.

    Returns ``(0, 1, notes)`` when not even batch 1 fits.
    """
    def fits(batch: int) -> bool:
        return _step_fits(model, optimizer, batch, seq, vocab, device, objective)

    if not fits(1):
        return 0, 1, [f"batch 1 does not fit at seq {seq}"]
    doubling = tuple(2**k for k in range(1, limit.bit_length()) if 2**k <= limit)
    return search_largest(fits, 1, doubling or (1,), quantum=1, deadline=time.perf_counter() + budget_s,
                          bisections=3, what="batch")


def _patched_summary(names: list[str], model: torch.nn.Module) -> str:
    modules = dict(model.named_modules())
    counts = Counter(type(modules[n]).__name__ for n in names if n in modules)
    return "; ".join(f"{cls} x{n}" for cls, n in counts.most_common())


def patched_modules(model: torch.nn.Module) -> list[str]:
    """Names of the modules a Liger patch replaced (``liger_patched_modules`` where the
    installed liger_kernel has it, else modules of a ``Liger*`` class or with a forward
    bound on the instance)."""
    try:
        from liger_kernel.transformers import liger_patched_modules
    except ImportError:
        return [n for n, m in model.named_modules()
                if type(m).__name__.startswith("Liger")
                or getattr(getattr(m.forward, "__func__", m.forward), "__module__", "").startswith("liger_kernel")]
    return liger_patched_modules(model)


def apply_liger(model: torch.nn.Module) -> None:
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)


def revert_liger() -> None:
    """Undo class-level patches, where the installed liger_kernel can."""
    try:
        from liger_kernel.transformers import revert_liger_kernel
    except ImportError:
        return
    revert_liger_kernel()


def timed_steps(model, optimizer, batches, warmup: int, device: torch.device, objective: Objective = sft):
    """Warm-up then timed steps; (losses, per-step ms, wall seconds of the timed part)."""
    losses = [train_step(model, optimizer, ids, objective) for ids in batches[:warmup]]
    synchronize(device)
    events = []
    start = time.perf_counter()
    for ids in batches[warmup:]:
        if device.type == "cuda":
            begin_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin_event.record()
            losses.append(train_step(model, optimizer, ids, objective))
            end_event.record()
            events.append((begin_event, end_event))
        else:
            step_start = time.perf_counter()
            losses.append(train_step(model, optimizer, ids, objective))
            events.append(time.perf_counter() - step_start)
    synchronize(device)
    elapsed = time.perf_counter() - start
    step_ms = [b.elapsed_time(e) for b, e in events] if device.type == "cuda" else [1e3 * s for s in events]
    return losses, step_ms, elapsed


def run_upstream_e2e(args, grad_ckpt: bool, max_seq_budget_s: float | None):
    """The ``liger-upstream`` variant of ``benchmarks/e2e_training.py``: the script itself
    run with ``--variants liger`` in a child importing the upstream package."""
    from benchmarks import peers

    variant = "liger-upstream" + ("+ckpt" if grad_ckpt else "")
    path = args.upstream_path
    if not path or not Path(path).is_dir():
        return VariantResult(variant=variant, tokens_per_s=float("nan"), peak_gib=float("nan"),
                             median_step_ms=float("nan"), losses=[],
                             notes=[f"skipped: no upstream liger_kernel directory ({path or 'unset'})"])
    command = [sys.executable, str(Path(__file__).resolve()), "--model", args.model,
               "--variants", "liger", "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch", str(args.batch), "--seq", str(args.seq), "--seed", str(args.seed),
               "--grad-ckpt", "on" if grad_ckpt else "off", "--floor", args.floor,
               "--compile-backend", args.compile_backend, "--max-seq-limit", str(args.max_seq_limit),
               "--objective", args.objective]
    if max_seq_budget_s is None:
        command.append("--skip-max-seq")
    else:
        command += ["--max-seq-budget", str(max_seq_budget_s)]
    if args.max_batch:
        command += ["--max-batch", "--max-batch-limit", str(args.max_batch_limit),
                    "--max-batch-budget", str(args.max_batch_budget)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run([*command, "--json-out", str(out), "--out", tmp], cwd=REPO_ROOT,
                              env=peers.upstream_env(path), capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return VariantResult(variant=variant, tokens_per_s=float("nan"), peak_gib=float("nan"),
                                 median_step_ms=float("nan"), losses=[],
                                 notes=[f"upstream child failed (exit {proc.returncode}): {tail[0][:200]}"])
        (data,) = json.loads(out.read_text())
    floor = data.pop("floor")
    result = VariantResult(**data)
    result.floor = step_floor.StepFloor(**floor) if floor else None
    result.variant = variant
    result.notes.append(f"upstream {_upstream_version(path)} from {path}")
    return result


def _upstream_version(path: str) -> str:
    for dist in importlib.metadata.distributions(path=[str(Path(path).resolve())]):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") == "liger-kernel":
            return dist.version
    return "(version unknown)"


def run_variant(variant: str, config, initial_state, args, device: torch.device, dtype: torch.dtype,
                batches: list[torch.Tensor], max_seq_budget_s: float | None, grad_ckpt: bool = False,
                head_rate: float | None = None) -> VariantResult:
    """Train ``variant`` (see the module docstring) and measure it; ``head_rate``: the LM
    head GEMMs' FLOP/s for the step floor (None: no profile)."""
    model = build_model(config, device, dtype, state_dict=initial_state)
    if variant.startswith("liger"):
        apply_liger(model)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = variant.endswith("-compile")
    if compiled:
        torch._dynamo.reset()
        model.compile(backend=args.compile_backend)
        if args.objective != "sft":  # these objectives call the decoder and the loss themselves
            model.get_decoder().compile(backend=args.compile_backend)
    reference = None
    if needs_reference(args.objective):  # a frozen copy of the initial policy, patched like it
        reference = build_model(config, device, dtype, state_dict=initial_state).requires_grad_(False)
        if variant.startswith("liger"):
            apply_liger(reference)
    objective = build_objective(args.objective, fused=variant.startswith("liger"),
                                compile_backend=args.compile_backend if compiled else None, reference=reference)
    optimizer = make_optimizer(model, device)
    vocab = data_vocab(config)
    names = patched_modules(model)
    notes = []

    batch, seq = batches[0].shape
    first_oom_batch = None
    if args.max_batch:
        budget = args.max_batch_budget
        batch, first_oom_batch, notes = find_max_batch(model, optimizer, seq, vocab, device, budget,
                                                       args.max_batch_limit, objective)
        if batch == 0:
            summary = _patched_summary(names, model)
            del model, optimizer, reference, objective
            free_memory(device)
            return VariantResult(variant=variant + ("+ckpt" if grad_ckpt else ""), tokens_per_s=math.nan,
                                 peak_gib=math.nan, median_step_ms=math.nan, losses=[], batch=0, seq=seq,
                                 first_oom_batch=1, patched_modules=len(names), patched=summary, notes=notes)
        batches = token_batches(len(batches), batch, seq, vocab, args.seed + 1, device)

    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, step_ms, elapsed = timed_steps(model, optimizer, batches, args.warmup, device, objective)
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    timed = batches[args.warmup:]
    result = VariantResult(
        variant=variant + ("+ckpt" if grad_ckpt else ""),
        tokens_per_s=sum(ids.numel() for ids in timed) / elapsed,
        peak_gib=peak_gib,
        median_step_ms=sorted(step_ms)[len(step_ms) // 2],
        losses=[float(x) for x in torch.stack(losses).float().cpu()],
        batch=batch, seq=seq, first_oom_batch=first_oom_batch,
        patched_modules=len(names), patched=_patched_summary(names, model), notes=notes,
    )
    if head_rate is not None:
        tc = text_config(config)
        head_floor_ms = 6.0 * batch * seq * tc.hidden_size * tc.vocab_size / head_rate * 1e3
        result.floor = step_floor.profile_step(functools.partial(train_step, model, optimizer, timed[-1], objective),
                                               device, tc.vocab_size, head_floor_ms)
    if max_seq_budget_s is not None:
        search_start = time.perf_counter()
        result.max_seq_len, result.first_oom_seq_len, seq_notes = find_max_seq(
            model, optimizer, batch, seq, vocab, device, max_seq_budget_s, seq_candidates(args.max_seq_limit),
            objective)
        result.notes += seq_notes
        result.search_s = time.perf_counter() - search_start

    del model, optimizer, losses, reference, objective
    if variant.startswith("liger"):
        revert_liger()
    free_memory(device)
    return result


def environment(device: torch.device) -> dict:
    import importlib.metadata

    import liger_kernel

    version = getattr(liger_kernel, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("liger-kernel")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    return {
        "gpu": device_name(device),
        **versions(),
        "liger_kernel": version,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


FLOOR_COLUMNS = ("floor_ms", "floor_over_step", "gemm_ms", "attention_ms", "head_gemm_ms", "head_floor_ms",
                 "profiled_kernel_ms")


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return fmt.format(value)


def write_csv(path: str, results: list[VariantResult], env: dict, args) -> None:
    n_losses = max(len(r.losses) for r in results)
    header = ["variant", "tokens_per_s", "peak_gib", "median_step_ms", "max_seq_len", "first_oom_seq_len",
              "patched_modules"]
    header += [f"loss_{i}" for i in range(n_losses)]
    header += ["config", "batch", "seq", "warmup", "steps", *env, "notes"]
    header += ["grad_ckpt", "max_batch_mode", "first_oom_batch", *FLOOR_COLUMNS, "patched"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for r in results:
            row = [r.variant, _cell(r.tokens_per_s, "{:.1f}"), _cell(r.peak_gib, "{:.3f}"),
                   _cell(r.median_step_ms, "{:.2f}"), _cell(r.max_seq_len, "{}"), _cell(r.first_oom_seq_len, "{}"),
                   r.patched_modules]
            row += [f"{x:.6f}" for x in r.losses] + [""] * (n_losses - len(r.losses))
            row += [args.model, r.batch, r.seq, args.warmup, args.steps, *env.values(), "; ".join(r.notes)]
            f = r.floor
            row += ["+ckpt" in r.variant, args.max_batch, _cell(r.first_oom_batch, "{}")]
            row += [_cell(f and f.floor_ms, "{:.3f}"), _cell(r.floor_over_step, "{:.5g}"),
                    _cell(f and f.gemm_ms, "{:.3f}"), _cell(f and f.attention_ms, "{:.3f}"),
                    _cell(f and f.head_gemm_ms, "{:.3f}"), _cell(f and f.head_floor_ms, "{:.3f}"),
                    _cell(f and f.kernel_ms, "{:.3f}"), r.patched]
            writer.writerow(row)


COLORS = {"hf": "tab:gray", "hf-compile": "tab:green", "liger": "tab:blue", "liger-compile": "tab:purple",
          "liger-upstream": "tab:orange"}


def write_plot(path: str, results: list[VariantResult], env: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def color(r: VariantResult) -> str:
        return COLORS.get(r.variant.split("+")[0], "tab:red")

    fig, (ax_loss, ax_tps, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        ax_loss.plot(range(len(r.losses)), r.losses, marker="o", ms=3, label=r.variant, color=color(r),
                     linestyle="-" if r.variant.startswith("hf") else "--")
    ax_loss.axvline(args.warmup - 0.5, color="k", lw=0.5, ls=":")
    ax_loss.set(xlabel="step (dotted line: end of warm-up)", ylabel="training loss",
                title="Loss" + (" (batch per variant)" if args.max_batch else " (same data)"))
    ax_loss.legend()
    names = [r.variant + (f"\nB{r.batch}" if args.max_batch else "") for r in results]
    bar_colors = [color(r) for r in results]
    tps = [0.0 if math.isnan(r.tokens_per_s) else r.tokens_per_s for r in results]
    ax_tps.bar(names, tps, color=bar_colors)
    ax_tps.set(ylabel="tokens / s", title="Throughput")
    peaks = [0.0 if math.isnan(r.peak_gib) else r.peak_gib for r in results]
    ax_mem.bar(names, peaks, color=bar_colors)
    ax_mem.set(ylabel="GiB", title="Peak memory (max_memory_allocated)"
               + (" - n/a on CPU" if all(math.isnan(r.peak_gib) for r in results) else ""))
    for ax, values, fmt in ((ax_tps, [r.tokens_per_s for r in results], "{:,.0f}"),
                            (ax_mem, [r.peak_gib for r in results], "{:.1f}")):
        for i, v in enumerate(values):
            ax.text(i, 0.0 if math.isnan(v) else v, "n/a" if math.isnan(v) else fmt.format(v), ha="center", va="bottom")
    for ax in (ax_tps, ax_mem):
        ax.tick_params(axis="x", labelsize=8)
    shape = f"seq {args.seq}, largest batch per variant" if args.max_batch else f"batch {args.batch} x seq {args.seq}"
    fig.suptitle(f"{args.model}, {shape}, {env['gpu']}; torch {env['torch']}, triton {env['triton']}, "
                 f"transformers {env['transformers']}, liger_kernel {env['liger_kernel']}, {env['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _variant_list(text: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if items == ("all",):
        return VARIANTS[:4]
    unknown = [x for x in items if x not in VARIANTS]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"unknown variant {', '.join(unknown) or '(none)'}; "
                                         f"choose from {', '.join(VARIANTS)} or all")
    return tuple(v for v in VARIANTS if v in items)  # unpatched first: a patch may touch classes


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--config", dest="model", choices=sorted(PRESETS), default="llama-1b",
                        help="model preset (tiny-*: the same config class shrunk for CPU)")
    parser.add_argument("--variants", type=_variant_list, default=DEFAULT_VARIANTS,
                        help=f"comma list of {', '.join(VARIANTS)}, or all (the first four)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (GPU presets: 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (GPU presets: 3)")
    parser.add_argument("--objective", choices=OBJECTIVES, default="sft",
                        help="the step trained: sft (the model's loss), dpo or grpo (benchmarks/objectives.py)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (GPU presets: 4)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (GPU presets: 2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results", help="directory for the CSV and PNG")
    parser.add_argument("--skip-max-seq", action="store_true", help="skip the longest-sequence search")
    parser.add_argument("--max-seq-limit", type=int, default=MAX_SEQ_CANDIDATES[-1],
                        help="longest sequence the search tries (doubling past 32768)")
    parser.add_argument("--max-seq-budget", type=float, default=MAX_SEQ_BUDGET_S,
                        help="seconds for all longest-sequence searches together")
    parser.add_argument("--grad-ckpt", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                        help="gradient checkpointing (both: every variant without and with)")
    parser.add_argument("--max-batch", action="store_true",
                        help="time each variant at the largest batch that fits at --seq")
    parser.add_argument("--max-batch-limit", type=int, default=MAX_BATCH_LIMIT)
    parser.add_argument("--max-batch-budget", type=float, default=120.0, help="seconds per variant's batch search")
    parser.add_argument("--floor", choices=("auto", "on", "off"), default="auto",
                        help="profile one step for the step floor (auto: on CUDA only)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the *-compile variants")
    parser.add_argument("--upstream-path", default=os.environ.get("LIGER_UPSTREAM_PATH", ""),
                        help="directory holding the upstream liger_kernel (liger-upstream variant)")
    parser.add_argument("--tag", default=None, help="suffix of the output files (default: preset, mode)")
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)  # child process of liger-upstream
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.model]["defaults"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 2:
        parser.error("--steps >= 1, --warmup >= 0, --batch >= 1 and --seq >= 2 are required")
    if args.warmup < 1 and any(v.endswith("-compile") for v in args.variants):
        parser.error("the *-compile variants need --warmup >= 1 (the first step compiles)")
    if args.tag is None:
        parts = ([] if args.model == "llama-1b" else [args.model]) + (["max-batch"] if args.max_batch else [])
        args.tag = "_".join(parts)
    return args


def compare_losses(results: list[VariantResult]) -> tuple[bool, list[str]]:
    """Every variant's losses against the first variant's (same data): (all match, report lines).

    A variant without losses (a peer that could not run; its notes say why) is listed, not judged.
    """
    ran = [r for r in results if r.losses]
    lines, ok = [], True
    for r in results:
        lines.append(f"  losses {r.variant:20s}: {' '.join(f'{x:.4f}' for x in r.losses) or 'none (not run)'}")
    if not ran:
        return False, lines
    reference = ran[0]
    allowed = LOSS_RTOL * max(abs(x) for x in reference.losses)
    for r in ran[1:]:
        if len(r.losses) != len(reference.losses):
            ok = False
            lines.append(f"  {r.variant}: {len(r.losses)} losses, {reference.variant}: {len(reference.losses)}")
            continue
        diff = max(abs(a - b) for a, b in zip(reference.losses, r.losses))
        match = all(math.isfinite(x) for x in r.losses) and diff <= allowed
        ok &= match
        lines.append(f"  max |loss diff| {r.variant} vs {reference.variant} = {diff:.3e} (allowed {allowed:.3e}): "
                     f"{'match' if match else 'MISMATCH'}")
    return ok and all(math.isfinite(x) for x in reference.losses), lines


def describe(r: VariantResult, args) -> str:
    text = (f"  {r.variant:20s}: {r.tokens_per_s:12,.0f} tokens/s, peak {r.peak_gib:7.2f} GiB, "
            f"median step {r.median_step_ms:8.1f} ms, {r.patched_modules} modules patched")
    if args.max_batch:
        text += f", largest batch {r.batch}" + (f" (OOM at {r.first_oom_batch})" if r.first_oom_batch else "")
    if r.max_seq_len is not None:
        text += f", longest seq at batch {r.batch}: {r.max_seq_len}"
        text += f" (OOM at {r.first_oom_seq_len})" if r.first_oom_seq_len else ""
    if r.floor is not None:
        f = r.floor
        text += (f"\n  {'':20s}  floor {f.floor_ms:.2f} ms = GEMM {f.gemm_ms:.2f} - head GEMM {f.head_gemm_ms:.2f}"
                 f" + attention {f.attention_ms:.2f} + head floor {f.head_floor_ms:.2f}; "
                 f"floor / step {r.floor_over_step:.3f} (profiled kernels {f.kernel_ms:.2f} ms)")
    if r.patched:
        text += f"\n  {'':20s}  patched: {r.patched}"
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # bf16 parameters on the GPU as in real training; fp32 on CPU, where the interpreter
    # (numpy underneath) has no native bf16 and this is only a smoke test.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = build_config(args.model)
    env = environment(device)
    if os.environ.get("LIGER_UPSTREAM_PATH") and args.json_out is not None:
        from benchmarks import peers

        peers.check_upstream_import(os.environ["LIGER_UPSTREAM_PATH"])
    if args.json_out is None:
        print(f"e2e training: {args.model} ({config.model_type}, {dtype}), batch {args.batch} x seq {args.seq}, "
              f"{args.warmup} warm-up + {args.steps} timed steps on {env['gpu']}; variants "
              f"{', '.join(args.variants)}; grad ckpt {args.grad_ckpt}" + (", max-batch mode" if args.max_batch else ""),
              flush=True)

    torch.manual_seed(args.seed)
    initial_state = {k: v.detach().to("cpu", copy=True)
                     for k, v in build_model(config, device, dtype).state_dict().items()}
    free_memory(device)
    vocab = data_vocab(config)
    batches = token_batches(args.warmup + args.steps, args.batch, args.seq, vocab, args.seed, device)

    profile = args.floor == "on" or (args.floor == "auto" and device.type == "cuda")
    head_rate = None
    if profile:
        tc = text_config(config)
        head_rate = step_floor.head_gemm_rate(args.batch * args.seq, tc.hidden_size, tc.vocab_size, dtype, device)
        free_memory(device)
        if device.type != "cuda":
            print("  note: CPU run: the step floor comes from CPU op times and says nothing about a GPU")
    elif device.type != "cuda":
        print("  note: step floor skipped on CPU (--floor on profiles CPU ops instead)")

    ckpt_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.grad_ckpt]
    runs = [(v, c) for c in ckpt_modes for v in args.variants]
    results = []
    for i, (variant, ckpt) in enumerate(runs):
        budget = None
        if not args.skip_max_seq:
            spent = sum(r.search_s for r in results)
            budget = max(0.0, args.max_seq_budget - spent) / (len(runs) - i)
        t0 = time.perf_counter()
        if variant == "liger-upstream":
            result = run_upstream_e2e(args, ckpt, budget)
        else:
            result = run_variant(variant, config, initial_state, args, device, dtype, batches, budget, ckpt,
                                 head_rate)
        results.append(result)
        if args.json_out is None:
            print(describe(result, args) + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
            for note in result.notes:
                print(f"  {'':20s}  note: {note}")

    if args.json_out is not None:  # child of liger-upstream: hand the results back
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in results]))
        return 0

    status = 0
    if args.max_batch:
        print("  (max-batch mode: each variant trained its own batch size; losses are not compared)")
    else:
        losses_match, lines = compare_losses(results)
        print("\n".join(lines))
        status = 0 if losses_match else 1
    base = next((r for r in results if r.variant.split("+")[0] == "hf"), results[0])
    for r in results:
        if r is not base and base.tokens_per_s > 0:
            mem = f", peak memory x{r.peak_gib / base.peak_gib:.3f}" if device.type == "cuda" else ""
            print(f"  {r.variant} / {base.variant}: tokens/s x{r.tokens_per_s / base.tokens_per_s:.3f}{mem}")
    if device.type != "cuda":
        print("  (CPU interpreter: throughput is not meaningful; no peak-memory statistic)")

    os.makedirs(args.out, exist_ok=True)
    stem = "e2e" + (f"_{args.tag}" if args.tag else "") + (f"_{args.objective}" if args.objective != "sft" else "")
    csv_path, png_path = os.path.join(args.out, f"{stem}.csv"), os.path.join(args.out, f"{stem}.png")
    write_csv(csv_path, results, env, args)
    write_plot(png_path, results, env, args)
    print(f"  wrote {csv_path} and {png_path}")

    from liger_kernel.transformers import MODEL_TYPE_TO_APPLY_LIGER_FN

    for r in results:
        kind = r.variant.split("+")[0]
        if kind.startswith("hf") and r.patched_modules:
            print(f"  ERROR: {r.variant} has {r.patched_modules} patched modules: the HF model was patched")
            status = 1
        if kind in ("liger", "liger-compile") and not r.patched_modules:
            if config.model_type in MODEL_TYPE_TO_APPLY_LIGER_FN:
                print(f"  ERROR: the Liger patch replaced no module of {r.variant}")
                status = 1
            else:
                print(f"  note: liger_kernel patches nothing of model type {config.model_type!r} yet")
    return status


if __name__ == "__main__":
    sys.exit(main())
