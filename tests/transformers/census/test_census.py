"""The model census: every causal-LM and image-text-to-text model type, patched and compared with HF.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` of the installed ``transformers``:

1. build a tiny random config from the config class defaults (:mod:`.tiny_configs`) and two
   models from one seed (fp32, eager attention, training mode, every dropout off), the second
   a state-dict copy of the first; the LM head is scaled so logits reach a few units (a final
   soft-cap of :data:`~.tiny_configs.SOFTCAP` then saturates, see ``_scale_head``);
2. patch the second through ``liger_kernel.transformers._apply_liger_kernel_to_instance`` (what
   the HF Trainer calls) and read what was patched from ``liger_patched_modules``;
3. run forward with labels and backward on one random batch (image-text-to-text models get
   text only where their forward allows it, else tiny random images too), and compare the loss
   and the gradient of every parameter.

Tolerance: both models compute the same fp32 math; the Liger kernels only reorder reductions
(norm statistics over ``hidden``, weight gradients over tokens, the loss over the vocabulary in
chunks). fp32 rounding is 2**-24 = 6e-8 per operation; through two layers, attention softmax
and a vocabulary of 256 the difference measured on the patched types is at most about 1e-6 of
each gradient's largest entry and 1e-7 of the loss. :data:`GRAD_RTOL` (per parameter, relative
to the largest HF gradient entry) and :data:`LOSS_RTOL` leave a 100x margin over that, and
still sit 100x or more below the error of a real deviation (a dropped Gemma ``1 + w`` offset, a
missing soft-cap, a wrong activation: 1e-2 to 1; ``test_census_detects_a_wrong_kernel`` sees
0.6 in the loss).

A patched model type whose loss or any gradient differs beyond that is a FAILURE. A model type
nothing was patched in is recorded as left alone, with the reason.

Which model types run: the default is the fixed, fast :data:`DEFAULT_SUBSET` (the CPU suite
budget); ``LIGER_CENSUS=full`` runs all of them, ``LIGER_CENSUS=llama,gpt2`` the named ones.
``python -m tests.transformers.census.test_census --write-docs docs/models.md [--jobs N]`` runs
the full census and writes the generated table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import logging
import os
import re
import sys
import time
import warnings
from collections import Counter
from typing import Any

import pytest
import torch

from tests.transformers.census.tiny_configs import SEQUENCE, reserved_token_ids, text_vocab_size, tiny_config
from tests.utils import DEVICE

CAUSAL_LM = "causal-lm"
IMAGE_TEXT = "image-text-to-text"
TASKS = (CAUSAL_LM, IMAGE_TEXT)

BATCH, SEQ = 2, SEQUENCE
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
HEAD_LOGIT_STD = 4.0  # logits' standard deviation after _scale_head: a cap of 2 saturates

# The default (CPU CI) run: every family the library names today and a fixed sample of the
# shapes discovery must handle (MoE, soft-caps, q/k norms, latent attention, linear-attention
# hybrid, LayerNorm, VLMs). A type not built or left alone costs well under a second.
DEFAULT_SUBSET = {
    CAUSAL_LM: ("llama", "mistral", "mixtral", "gemma", "gemma2", "qwen2", "qwen3", "phi3",
                "gemma3_text", "qwen3_moe", "qwen3_next", "gpt_oss", "smollm3", "olmo2", "granite",
                "deepseek_v3", "gpt2"),
    IMAGE_TEXT: ("qwen2_vl", "llava", "gemma3"),
}


def _mapping(task: str) -> dict[str, str]:
    from transformers.models.auto import modeling_auto

    if task == CAUSAL_LM:
        return dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return dict(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


@dataclasses.dataclass
class CensusResult:
    task: str
    model_type: str
    architecture: str
    status: str  # "equal", "MISMATCH", "left alone", "not built"
    patched: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> modules
    reason: str = ""
    detail: str = ""
    seconds: float = 0.0
    softcap_exercised: bool | None = None
    max_grad_error: float = 0.0
    loss_error: float = 0.0
    inputs: str = "text"


class _NotBuilt(Exception):
    pass


# ------------------------------------------------------------------------------------- building
def _missing_package(error: BaseException) -> str | None:
    match = re.search(r"requires the (\S+) librar", str(error))
    if match:
        return match.group(1)
    if isinstance(error, ModuleNotFoundError) and error.name:
        return error.name.split(".")[0]
    return None


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:160]}"


def _as_decoder(config: Any, task: str) -> Any:
    if task == CAUSAL_LM and "is_decoder" in config.to_dict():
        config.is_decoder = True  # encoder families run as decoders under a causal-LM head
    return config


def _defaults_build(model_cls: type, model_type: str, task: str) -> bool:
    """Whether the config class defaults build ``model_cls`` (on the meta device: no memory)."""
    from transformers import CONFIG_MAPPING

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model_cls._from_config(_as_decoder(_config_for(model_cls, CONFIG_MAPPING[model_type]()), task))
        return True
    except Exception:
        return False


def _config_for(model_cls: type, config: Any) -> Any:
    """``config`` itself, or the nested config of the class ``model_cls`` is built from
    (``Llama4ForCausalLM`` takes ``Llama4Config.text_config``)."""
    wanted = getattr(model_cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for value in vars(config).values():
        if isinstance(value, wanted):
            return value
    return config


def _build(model_cls: type, config: Any, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
        except (ValueError, TypeError) as error:
            if "attn_implementation" not in str(error) and "eager" not in str(error):
                raise
            model = model_cls._from_config(config, dtype=torch.float32)
    return model.to(DEVICE).train()


def _scale_head(model: torch.nn.Module) -> None:
    """Scale the LM head so logits have a standard deviation of about :data:`HEAD_LOGIT_STD`.

    A tiny random model's logits are ~0.1, where a final soft-cap is the identity and the loss
    is ``log(vocab)`` whatever the head does; scaled, the cap saturates and the loss depends on
    the head. The final norm output has unit RMS, so ``std(logit) ~ std(w) sqrt(hidden)``.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is None or weight.ndim != 2:
        return
    with torch.no_grad():
        weight.mul_(HEAD_LOGIT_STD / (weight.std().clamp_min(1e-12) * weight.shape[1] ** 0.5))


def _final_softcap(config: Any) -> float | None:
    for cfg in (config, getattr(config, "text_config", None)):
        cap = getattr(cfg, "final_logit_softcapping", None) if cfg is not None else None
        if cap:
            return float(cap)
    return None


# ------------------------------------------------------------------------------------- patching
def _kind(name: str, module: torch.nn.Module) -> str:
    """What a module listed by ``liger_patched_modules`` is: loss, norm, rope, experts or mlp."""
    cls = type(module).__name__.lower()
    if name == "":
        return "loss"
    if "norm" in cls:
        return "norm"
    if "attention" in cls or "attn" in cls:
        return "rope"
    if "expert" in cls or "moe" in cls:
        return "experts"
    if "mlp" in cls or "feedforward" in cls or "ffn" in cls:
        return "mlp"
    return type(module).__name__


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _liger_log() -> Any:
    logger = logging.getLogger("liger_kernel")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


_STATE_SPACE_CONFIG = re.compile(r"mamba|ssm|state_size|d_state|linear_attn|linear_num|linear_conv|rwkv|xlstm|"
                                 r"conv_L_cache|full_attn_idxs")


def _config_keys(config: Any) -> set[str]:
    keys: set[str] = set()

    def walk(d: dict[str, Any]) -> None:
        for k, v in d.items():
            keys.add(str(k))
            if isinstance(v, dict):
                walk(v)

    walk(config.to_dict())
    return keys


def _structure(model: torch.nn.Module) -> str:
    """Why no kernel applied, read off the module classes and the config: the left-alone category."""
    names = {type(m).__name__ for m in model.modules()}
    joined = " ".join(names) + " " + " ".join(k for k in _config_keys(model.config) if _STATE_SPACE_CONFIG.search(k))
    attention = any(re.search(r"Attention|SelfAttn|Attn\b", n) and not re.search(r"Linear|Rwkv|Lightning", n)
                    for n in names)
    state_space = re.search(r"Mamba|Rwkv|xLSTM|mLSTM|Recurrent|RgLru|Ssm|SSM|ShortConv|GatedDeltaNet|"
                            r"LinearAttention|Lightning|DeltaNet|" + _STATE_SPACE_CONFIG.pattern, joined)
    rms = "RMSNorm" in joined or "RmsNorm" in joined
    layer_norm = any(isinstance(m, torch.nn.LayerNorm) for m in model.modules()) or "LayerNorm" in joined
    if state_space and not attention:
        return "state-space / recurrent (no attention)"
    if state_space:
        return "hybrid attention + state-space / linear attention"
    keys = _config_keys(model.config)
    if "type_vocab_size" in keys:
        return "encoder family run as a decoder (BERT style)"
    if getattr(model.config, "is_encoder_decoder", False) or "decoder_start_token_id" in keys:
        return "decoder of an encoder-decoder (BART / Whisper style)"
    if rms:
        return "RMSNorm decoder"
    if layer_norm:
        return "LayerNorm decoder (GPT-2 style)"
    return "other layout"


# ------------------------------------------------------------------------------------- one case
def _inputs(config: Any, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = text_vocab_size(config)
    reserved = reserved_token_ids(config)
    allowed = torch.tensor([t for t in range(3, vocab) if t not in reserved])
    ids = allowed[torch.randint(len(allowed), (BATCH, SEQ), generator=generator)]
    labels = ids.clone()
    labels[0, :5] = -100  # some ignored targets in one row, none in the other
    return ids.to(DEVICE), labels.to(DEVICE)


def _pixel_inputs(model: torch.nn.Module, config: Any, ids: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Tiny random images (and Q-Former ids) for a model whose forward requires them."""
    vision = next((getattr(config, k) for k in ("vision_config", "encoder", "visual_config")
                   if getattr(config, k, None) is not None), config)
    size = getattr(vision, "image_size", 32)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    channels = getattr(vision, "num_channels", 3)
    generator = torch.Generator().manual_seed(seed + 1)
    extra = {"pixel_values": torch.randn(BATCH, channels, height, width, generator=generator).to(DEVICE)}
    if "qformer_input_ids" in inspect.signature(model.forward).parameters:
        extra["qformer_input_ids"] = ids
    return extra


def _loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, seed: int,
          extra: dict[str, torch.Tensor] | None = None) -> Any:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, **(extra or {}))


def _compare(reference: torch.nn.Module, patched: torch.nn.Module, ref_loss: torch.Tensor,
             liger_loss: torch.Tensor) -> tuple[list[str], float, float]:
    """Mismatches (``[]`` when equal), the relative loss error and the largest relative gradient error."""
    problems = []
    loss_error = float((liger_loss.detach() - ref_loss.detach()).abs() / ref_loss.detach().abs().clamp_min(1.0))
    if not loss_error <= LOSS_RTOL:
        problems.append(f"loss {float(liger_loss.detach()):.7g} vs HF {float(ref_loss.detach()):.7g} "
                        f"(rel {loss_error:.2e})")
    worst = 0.0
    liger_params = dict(patched.named_parameters())
    for name, param in reference.named_parameters():
        other = liger_params.get(name)
        if other is None:
            problems.append(f"{name}: missing in the patched model")
            continue
        if (param.grad is None) != (other.grad is None):
            problems.append(f"{name}: gradient {'missing' if other.grad is None else 'extra'} in the patched model")
            continue
        if param.grad is None:
            continue
        scale = param.grad.abs().max()
        error = (other.grad - param.grad).abs().max()
        relative = float(error / scale) if scale > 0 else float(error)
        worst = max(worst, relative)
        if not relative <= GRAD_RTOL:
            problems.append(f"{name}: max |dgrad| {float(error):.3e} = {relative:.2e} of max |grad| {float(scale):.3e}")
    return problems, loss_error, worst


def run_case(task: str, model_type: str, seed: int = 0, corrupt: Any = None) -> CensusResult:
    """The census of one model type (``corrupt(model)``, tests only, alters the patched model)."""
    import transformers
    from liger_kernel.transformers import _apply_liger_kernel_to_instance, liger_patched_modules

    started = time.perf_counter()
    architecture = _mapping(task)[model_type]
    result = CensusResult(task, model_type, architecture, "not built")
    try:
        try:
            model_cls = getattr(transformers, architecture)
        except Exception as error:
            package = _missing_package(error)
            raise _NotBuilt(f"needs {package}" if package else f"class not importable: {_short(error)}") from error
        try:
            config = _as_decoder(_config_for(model_cls, tiny_config(model_type)), task)
            reference = _build(model_cls, config, seed)
        except Exception as error:
            package = _missing_package(error)
            if package:
                raise _NotBuilt(f"needs {package}") from error
            if not _defaults_build(model_cls, model_type, task):
                raise _NotBuilt(f"HF config defaults do not build the model either ({_short(error)})") from error
            raise _NotBuilt(f"tiny config rejected: {_short(error)}") from error
        _scale_head(reference)
        patched = _build(model_cls, config, seed)
        patched.load_state_dict(reference.state_dict())

        ids, labels = _inputs(config, torch.Generator().manual_seed(seed))
        extra: dict[str, torch.Tensor] = {}
        try:
            ref_out = _loss(reference, ids, labels, seed)
        except Exception as error:
            if "pixel_values" not in inspect.signature(reference.forward).parameters:
                raise _NotBuilt(f"forward with labels fails in HF: {_short(error)}") from error
            try:  # the text decoder cannot run alone: tiny random images
                extra = _pixel_inputs(reference, config, ids, seed)
                ref_out = _loss(reference, ids, labels, seed, extra)
                result.inputs = "text + tiny images"
            except Exception as pixel_error:
                raise _NotBuilt(f"forward with labels fails in HF, text-only ({_short(error)}) and with images "
                                f"({_short(pixel_error)})") from pixel_error
        ref_loss = getattr(ref_out, "loss", None)
        if ref_loss is None or ref_loss.ndim != 0:
            raise _NotBuilt("HF forward computes no loss from labels")
        ref_loss.backward()
        cap = _final_softcap(config)
        logits = getattr(ref_out, "logits", None)
        if cap and logits is not None:
            result.softcap_exercised = bool(logits.detach().abs().max() > 0.75 * cap)
        del ref_out

        with _liger_log() as messages:
            _apply_liger_kernel_to_instance(model=patched)
        for name in liger_patched_modules(patched):
            kind = _kind(name, patched.get_submodule(name))
            result.patched[kind] = result.patched.get(kind, 0) + 1
        if "loss" not in result.patched and type(patched).forward is not model_cls.forward:
            result.patched["loss"] = 1  # the model's own forward was replaced
        if corrupt is not None:
            corrupt(patched)
        try:
            liger_loss = _loss(patched, ids, labels, seed, extra).loss
            liger_loss.backward()
        except Exception as error:
            result.status = "MISMATCH"
            result.detail = f"patched forward/backward raised {_short(error)}"
            return result
        problems, result.loss_error, result.max_grad_error = _compare(reference, patched, ref_loss, liger_loss)
        if problems:
            result.status = "MISMATCH"
            result.detail = "; ".join(problems[:6]) + (f"; ... {len(problems) - 6} more" if len(problems) > 6 else "")
        elif result.patched:
            result.status = "equal"
        else:
            result.status = "left alone"
            said = next((m for m in messages if "left as is" in m or "No Liger" in m), None)
            result.reason = f"{'no Liger entry' if said else 'nothing matched'}: {_structure(reference)}"
    except _NotBuilt as error:
        result.reason = str(error)
    finally:
        result.seconds = time.perf_counter() - started
    return result


# ------------------------------------------------------------------------------------- pytest
def _selected(task: str) -> list[str]:
    choice = os.environ.get("LIGER_CENSUS", "").strip()
    available = _mapping(task)
    if choice == "full":
        return list(available)
    if choice:
        return [mt for mt in choice.split(",") if mt in available]
    return [mt for mt in DEFAULT_SUBSET[task] if mt in available]


CASES = [pytest.param(task, mt, id=f"{task}/{mt}") for task in TASKS for mt in _selected(task)]


@pytest.mark.parametrize("task, model_type", CASES)
def test_census(task: str, model_type: str, _fresh_seed: int) -> None:
    result = run_case(task, model_type, seed=_fresh_seed % 2**31)
    print(f"{task}/{model_type}: {result.status} {result.patched} {result.reason} {result.detail} "
          f"({result.seconds:.1f} s, max grad error {result.max_grad_error:.1e})")
    assert result.status != "MISMATCH", f"{task}/{model_type} patched but not equal to HF: {result.detail}"
    if result.status == "equal" and result.softcap_exercised is not None:
        assert result.softcap_exercised, "the final soft-cap was not reached: the comparison cannot see it"


def test_census_detects_a_wrong_kernel() -> None:
    """The comparison fails when a patched kernel computes something else: the Liger norms of a
    Gemma model lose their ``1 + w`` offset (weights and inputs stay the same in both models)."""

    def corrupt(model: torch.nn.Module) -> None:
        norms = [m for m in model.modules() if "Norm" in type(m).__name__ and getattr(m, "offset", None) == 1.0]
        assert norms, "no patched Gemma norm found: the mutation would test nothing"
        for module in norms:
            module.offset = 0.0

    result = run_case(CAUSAL_LM, "gemma", corrupt=corrupt)
    assert result.status == "MISMATCH", result
    assert result.detail.startswith("loss"), result.detail


# ------------------------------------------------------------------------------------- docs
def _patched_text(result: CensusResult) -> str:
    order = ("loss", "norm", "mlp", "experts", "rope")
    kinds = sorted(result.patched, key=lambda k: (order.index(k) if k in order else len(order), k))
    return ", ".join(f"{k} ({result.patched[k]})" if k != "loss" else "fused loss" for k in kinds)


def _counts(results: list[CensusResult]) -> list[str]:
    built = [r for r in results if r.status != "not built"]
    patched = [r for r in results if r.status in ("equal", "MISMATCH")]
    lines = [
        f"- model types: {len(results)}; built and run: {len(built)}",
        f"- patched: {len(patched)}; equal to HF: {sum(r.status == 'equal' for r in results)}; "
        f"MISMATCH: {sum(r.status == 'MISMATCH' for r in results)}",
    ]
    for status in ("left alone", "not built"):
        group = Counter(re.sub(r" \(.*|: .*", "", r.reason) if status == "not built" else r.reason
                        for r in results if r.status == status)
        lines.append(f"- {status}: {sum(group.values())}")
        lines.extend(f"  - {reason}: {n}" for reason, n in group.most_common())
    return lines


def write_docs(results: list[CensusResult], path: str) -> None:
    import transformers

    out = [
        "# Model census",
        "",
        "Generated by `python -m tests.transformers.census.test_census --write-docs docs/models.md`",
        "(do not edit by hand). Every causal-LM and image-text-to-text model type of the installed",
        f"transformers ({transformers.__version__}) is built tiny and random from its config class",
        "defaults (`tests/transformers/census/tiny_configs.py`), patched with",
        "`_apply_liger_kernel_to_instance` and trained one step next to the unpatched model: fp32,",
        f"{DEVICE}, eager attention; loss and every parameter gradient compared (relative",
        f"tolerance {LOSS_RTOL:g} for the loss, {GRAD_RTOL:g} of each gradient's largest entry).",
        "Image-text-to-text models run text-only where their forward allows it, else with tiny",
        "random images (`inputs` column). A patched model type that is not equal is a failure of",
        "the census test.",
        "",
    ]
    for task in TASKS:
        rows = sorted((r for r in results if r.task == task), key=lambda r: r.model_type)
        if not rows:
            continue
        out += [f"## {task}", "", *_counts(rows), "",
                "| model type | architecture | inputs | patched | equal to HF | left alone / not built because |",
                "|---|---|---|---|---|---|"]
        for r in rows:
            equal = {"equal": "yes", "MISMATCH": f"**NO**: {r.detail}"}.get(r.status, "")
            cell = r.reason.replace("|", "\\|")
            inputs = r.inputs if r.status != "not built" else ""
            out.append(f"| {r.model_type} | {r.architecture} | {inputs} | {_patched_text(r)} | "
                       f"{equal.replace('|', '/')} | {cell} |")
        out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out))


def _run_one(args: tuple[str, str]) -> CensusResult:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    try:
        return run_case(*args)
    except Exception as error:  # a harness failure is reported, not hidden: it counts as not built
        return CensusResult(args[0], args[1], _mapping(args[0])[args[1]], "not built",
                            reason=f"census harness error: {_short(error)}")


def _print(result: CensusResult) -> None:
    error = (f", loss error {result.loss_error:.1e}, max grad error {result.max_grad_error:.1e}"
             if result.patched else "")
    print(f"{result.task}/{result.model_type}: {result.status} {_patched_text(result)} "
          f"{result.reason}{result.detail} ({result.seconds:.1f} s{error})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", metavar="PATH", help="write the generated table (e.g. docs/models.md)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    args = parser.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    cases = [(task, mt) for task in TASKS for mt in _mapping(task) if not only or mt in only]
    started = time.perf_counter()
    results = []
    if args.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: a forked worker would inherit the parent's CUDA state on a GPU machine
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for result in pool.map(_run_one, cases, chunksize=1):
                results.append(result)
                _print(result)
    else:
        for case in cases:
            result = _run_one(case)
            results.append(result)
            _print(result)
    seconds = time.perf_counter() - started
    print(f"census: {len(results)} cases in {seconds:.0f} s with {args.jobs} worker(s), "
          f"{sum(r.seconds for r in results) / max(len(results), 1):.2f} s per case")
    for task in TASKS:
        print(f"== {task}")
        print("\n".join(_counts([r for r in results if r.task == task])))
    if args.write_docs:
        write_docs(results, args.write_docs)
    return 1 if any(r.status == "MISMATCH" for r in results) else 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest.py does this under pytest
    sys.exit(main())
