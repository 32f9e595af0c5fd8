"""The model census: every causal-LM and image-text-to-text model type, patched and compared with HF.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` of the installed ``transformers``:

1. build a tiny random config from the config class defaults (:mod:`.tiny_configs`) and two
   models from one seed (fp32, eager attention, training mode, every dropout off), the second
   a state-dict copy of the first; the LM head is scaled so logits reach a few units (a final
   soft-cap of :data:`~.tiny_configs.SOFTCAP` then saturates, see ``_scale_head``);
2. patch the second through ``liger_kernel.transformers._apply_liger_kernel_to_instance`` (what
   the HF Trainer calls) and record from its
   :class:`~liger_kernel.transformers.patching.report.PatchReport` what was patched (kernel ->
   modules) and every module left as HF's with the reason the patch gives;
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
0.6 in the loss). A gradient that is zero in exact arithmetic (an attention key bias: softmax
ignores a shift shared by all keys; a router that only ever sees a constant) is round-off of
cancelling terms in both models, so its scale is at least :data:`GRAD_FLOOR` of the model's
largest gradient entry.

A patched model type whose loss or any gradient differs beyond that is a FAILURE. A model type
nothing was patched in is recorded as left alone, with its layout (state-space, encoder run as
a decoder, ...) and the patch's reasons.

Both models run on the test device (``tests.utils.DEVICE``): on a GPU machine the kernels only
run on CUDA tensors.

Which model types run: the default is the fixed, fast :data:`DEFAULT_SUBSET`, one model type
per pattern (the CPU suite budget); ``LIGER_CENSUS=full`` runs all of them,
``LIGER_CENSUS=llama,gpt2`` the named ones.
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

from tests.transformers.census.tiny_configs import (
    CAUSAL_LM,
    IMAGE_TEXT,
    SEQUENCE,
    TASKS,
    architectures,
    as_decoder,
    build_model,
    config_for,
    tiny_config,
    token_batch,
)
from tests.utils import DEVICE

BATCH, SEQ = 2, SEQUENCE
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
GRAD_FLOOR = 1e-3
HEAD_LOGIT_STD = 4.0  # logits' standard deviation after _scale_head: a cap of 2 saturates

CASE_TIMEOUT_S = int(os.environ.get("LIGER_CENSUS_TIMEOUT", "600"))  # one model type, in the full census

# The default (CPU CI) run: one model type per pattern, each must patch the fused loss and at
# least one kernel and equal HF. Every other type runs with LIGER_CENSUS=full.
DEFAULT_SUBSET = {
    CAUSAL_LM: (
        "llama",  # a families-table entry
        "olmo2",  # a dense decoder found by discovery (q/k norms, post-norms)
        "qwen3_moe",  # a mixture-of-experts decoder found by discovery (router auxiliary loss)
        "gemma2",  # Gemma norms (1 + w) and a final-logit soft-cap that the tiny model reaches
        "gpt2",  # a LayerNorm decoder
        "phi",  # partial rotary
    ),
    IMAGE_TEXT: ("llava",),  # a vision-language model's text decoder and head
}
_mapping = architectures


@dataclasses.dataclass
class CensusResult:
    task: str
    model_type: str
    architecture: str
    status: str  # "equal", "MISMATCH", "left alone", "not built"
    patched: dict[str, int] = dataclasses.field(default_factory=dict)  # kernel -> modules, from the PatchReport
    left_alone: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (what, why), from the PatchReport
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


def _defaults_build(model_cls: type, model_type: str, task: str) -> bool:
    """Whether the config class defaults build ``model_cls`` (on the meta device: no memory)."""
    from transformers import CONFIG_MAPPING

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model_cls._from_config(as_decoder(config_for(model_cls, CONFIG_MAPPING[model_type]()), task))
        return True
    except Exception:
        return False


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
    largest = max((float(p.grad.abs().max()) for p in reference.parameters() if p.grad is not None), default=0.0)
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
        scale = param.grad.abs().max().clamp_min(GRAD_FLOOR * largest)
        error = (other.grad - param.grad).abs().max()
        relative = float(error / scale) if scale > 0 else float(error)
        worst = max(worst, relative)
        if not relative <= GRAD_RTOL:
            problems.append(f"{name}: max |dgrad| {float(error):.3e} = {relative:.2e} of its scale {float(scale):.3e}")
    return problems, loss_error, worst


def run_case(task: str, model_type: str, seed: int = 0, corrupt: Any = None) -> CensusResult:
    """The census of one model type (``corrupt(model)``, tests only, alters the patched model)."""
    import transformers
    from liger_kernel.transformers import PatchReport, _apply_liger_kernel_to_instance, liger_patched_modules

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
            config = as_decoder(config_for(model_cls, tiny_config(model_type)), task)
            reference = build_model(model_cls, config, seed)
        except Exception as error:
            package = _missing_package(error)
            if package:
                raise _NotBuilt(f"needs {package}") from error
            if not _defaults_build(model_cls, model_type, task):
                raise _NotBuilt(f"HF config defaults do not build the model either ({_short(error)})") from error
            raise _NotBuilt(f"tiny config rejected: {_short(error)}") from error
        _scale_head(reference)
        patched = build_model(model_cls, config, seed)
        patched.load_state_dict(reference.state_dict())

        ids, labels = token_batch(config, BATCH, SEQ, torch.Generator().manual_seed(seed))
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
            try:
                report = _apply_liger_kernel_to_instance(model=patched)
            except Exception as error:  # a patch that crashes a user's training: a failure
                result.status = "MISMATCH"
                result.detail = f"the patch raised {_short(error)}"
                return result
        if isinstance(report, PatchReport):
            result.patched = dict(report.patched)
            result.left_alone = [(str(what), str(why)) for what, why in report.left_alone]
        elif liger_patched_modules(patched):  # an apply function that reports nothing: count what it marked
            result.patched = {"modules": len(liger_patched_modules(patched))}
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
    if model_type in DEFAULT_SUBSET[task]:  # each stands for a pattern the patch must cover
        assert result.status == "equal", f"{model_type}: {result.status} {result.reason} {result.left_alone}"
        assert "fused_linear_cross_entropy" in result.patched and len(result.patched) > 1, result
    if model_type == "gemma2":
        assert result.softcap_exercised, "gemma2 is the default run's soft-capped model"


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


def test_census_detects_a_dropped_softcap() -> None:
    """The comparison fails when the patched loss drops the final-logit soft-cap: the head is
    scaled so the tiny model's logits reach the cap, where ``tanh`` is no longer the identity."""

    def corrupt(model: torch.nn.Module) -> None:
        config = model.config.get_text_config()
        assert config.final_logit_softcapping, "gemma2 has no soft-cap: the mutation would test nothing"
        config.final_logit_softcapping = None  # the fused loss reads the cap from the config

    result = run_case(CAUSAL_LM, "gemma2", corrupt=corrupt)
    assert result.softcap_exercised, result
    assert result.status == "MISMATCH", result
    assert result.detail.startswith("loss"), result.detail


# ------------------------------------------------------------------------------------- docs
_KERNEL_NAMES = {"fused_linear_cross_entropy": "fused loss", "cross_entropy": "cross-entropy", "rms_norm": "RMSNorm",
                 "layer_norm": "LayerNorm", "swiglu": "SwiGLU", "geglu": "GeGLU", "rope": "RoPE"}


def _patched_text(result: CensusResult) -> str:
    order = list(_KERNEL_NAMES)
    kinds = sorted(result.patched, key=lambda k: (order.index(k) if k in order else len(order), k))
    return ", ".join(_KERNEL_NAMES.get(k, k) + ("" if k == "fused_linear_cross_entropy" else f" ({result.patched[k]})")
                     for k in kinds)


def _with_kernel(result: CensusResult) -> bool:
    """Patched with the fused loss plus at least one kernel."""
    return "fused_linear_cross_entropy" in result.patched and len(result.patched) > 1


def _general(why: str) -> str:
    """A reason without its measured numbers and shapes, so that equal reasons group."""
    why = re.sub(r" \((relative error|max ).*$", "", why)  # the measured errors close the reason
    why = re.sub(r"\(\d[\d, ]*\)", "(shape)", why)
    return re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", why).strip()


def _counts(results: list[CensusResult]) -> list[str]:
    equal = [r for r in results if r.status == "equal"]
    mismatched = [r for r in results if r.status == "MISMATCH"]
    lines = [
        f"- model types listed: {len(results)}",
        f"- patched, loss and every gradient equal to HF: **{len(equal)}**",
        f"  - of those, with the fused loss plus at least one kernel: **{sum(_with_kernel(r) for r in equal)}**",
        f"- MISMATCH (patched and not equal, or the patch raised: a failure): **{len(mismatched)}**"
        + (f" ({', '.join(r.model_type for r in mismatched)})" if mismatched else ""),
    ]
    for status in ("left alone", "not built"):
        group = Counter(re.sub(r" \(.*|: .*", "", r.reason) if status == "not built" else r.reason
                        for r in results if r.status == status)
        lines.append(f"- {status}: {sum(group.values())}")
        lines.extend(f"  - {reason}: {n}" for reason, n in group.most_common())
    kept = Counter(_general(why) for r in equal for why in {why for _, why in r.left_alone})
    if kept:
        lines.append("- modules kept as HF's inside patched models, by the patch's reason (model types):")
        lines.extend(f"  - {why}: {n}" for why, n in kept.most_common())
    return lines


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def write_docs(results: list[CensusResult], path: str) -> None:
    import transformers

    by_task = {task: [r for r in results if r.task == task] for task in TASKS}
    summary = {
        "model types listed": lambda r: True,
        "patched, loss and every gradient equal to HF": lambda r: r.status == "equal",
        "... of those, with the fused loss plus at least one kernel": lambda r: r.status == "equal" and _with_kernel(r),
        "MISMATCH (a failure)": lambda r: r.status == "MISMATCH",
        "left alone (nothing applies)": lambda r: r.status == "left alone",
        "tiny random model not built": lambda r: r.status == "not built",
    }
    out = [
        "# Model census",
        "",
        f"| | {' | '.join(TASKS)} |",
        "|---|" + "---|" * len(TASKS),
        *(f"| {label} | " + " | ".join(str(sum(map(keep, by_task[t]))) for t in TASKS) + " |"
          for label, keep in summary.items()),
        "",
        "Reasons (left alone, not built, modules kept as HF's inside patched models) per task below.",
        "",
        "Generated by `python -m tests.transformers.census.test_census --write-docs docs/models.md`",
        "(do not edit by hand). Every causal-LM and image-text-to-text model type of the installed",
        f"transformers ({transformers.__version__}) is built tiny and random from its config class",
        "defaults (`tests/transformers/census/tiny_configs.py`), patched with",
        "`_apply_liger_kernel_to_instance` and trained one step next to the unpatched model: fp32,",
        f"{DEVICE}, eager attention; loss and every parameter gradient compared (relative",
        f"tolerance {LOSS_RTOL:g} for the loss, {GRAD_RTOL:g} of each gradient's largest entry, or of",
        f"{GRAD_FLOOR:g} of the model's largest gradient entry where that is more: round-off of a",
        "gradient that is zero in exact arithmetic, such as an attention key bias's).",
        "Image-text-to-text models run text-only where their forward allows it, else with tiny",
        "random images (`inputs` column). What was patched (kernel and number of modules) and what",
        "was kept as HF's, with the reason, come from the patch's `PatchReport`; a module is swapped",
        "only after a probe proved it equal to its replacement. A patched model type that is not",
        "equal is a failure of the census test.",
        "",
    ]
    for task in TASKS:
        rows = sorted((r for r in results if r.task == task), key=lambda r: r.model_type)
        if not rows:
            continue
        out += [f"## {task}", "", *_counts(rows), "",
                "| model type | architecture | inputs | patched | equal to HF | kept as HF's (why) / left alone or not "
                "built because |",
                "|---|---|---|---|---|---|"]
        for r in rows:
            equal = {"equal": "yes", "MISMATCH": f"**NO**: {r.detail}"}.get(r.status, "")
            why = "; ".join(filter(None, [r.reason] + [f"{what}: {reason}" for what, reason in r.left_alone[:4]]
                                   + ([f"... {len(r.left_alone) - 4} more"] if len(r.left_alone) > 4 else [])))
            inputs = r.inputs if r.status != "not built" else ""
            out.append(f"| {r.model_type} | {r.architecture} | {inputs} | {_patched_text(r)} | "
                       f"{_cell(equal)} | {_cell(why)} |")
        out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out))


class _Timeout(BaseException):  # not an Exception: run_case's handlers must not catch it
    pass


def _run_one(args: tuple[str, str]) -> CensusResult:
    """:func:`run_case`, recorded as not built when it fails in the harness or takes longer
    than :data:`CASE_TIMEOUT_S`."""
    import signal

    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    def expire(signum: int, frame: Any) -> None:
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        return run_case(*args)
    except _Timeout:
        return CensusResult(args[0], args[1], _mapping(args[0])[args[1]], "not built",
                            reason=f"took over {CASE_TIMEOUT_S} s")
    except Exception as error:  # a harness failure is reported, not hidden: it counts as not built
        return CensusResult(args[0], args[1], _mapping(args[0])[args[1]], "not built",
                            reason=f"census harness error: {_short(error)}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


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
