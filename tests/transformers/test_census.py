"""The census: every model type the installed transformers lists for causal LM and
image-text-to-text, patched by :func:`_apply_liger_kernel_to_instance` and compared with HF.

For each model type a tiny random model is built generically (:mod:`tests.transformers.tiny_models`),
copied, the copy patched; one training step on each (fp32, CPU or the test device) must give
the same loss and the same gradient for every parameter. What the patch replaced (norms,
MLPs / experts, rotary, loss) or why it replaced nothing comes from its
:class:`~liger_kernel.transformers.patching.report.PatchReport`. Models with a final-logit
soft-cap get a head scaled so their logits reach the cap's range (a cap that a tiny model's
logits never reach is the identity and would pass dropped).

The default run covers :data:`FAST` (a handful of model types, one per pattern); the whole
census runs with ``LIGER_CENSUS=full``, and ``python -m tests.transformers.test_census``
runs it and writes ``docs/models.md``.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("transformers")

from tests.transformers.tiny_models import model_types, tiny_model  # noqa: E402

# One model type per pattern: the table (llama), dense and MoE decoders found by discovery,
# Gemma-style norms with soft-cap, LayerNorm decoders, partial rotary, vision-language.
FAST = ("causal_lm:llama", "causal_lm:qwen3_moe", "causal_lm:gemma3_text", "causal_lm:olmo2", "causal_lm:gpt2",
        "causal_lm:phi", "causal_lm:granite", "causal_lm:mamba", "image_text_to_text:llava")
# Error allowed on the loss and each gradient, relative to the tensor's largest value (or to
# 1e-3 of the largest gradient of the model, for gradients that are zero in exact arithmetic,
# such as an attention key bias's): fp32 kernels differ from PyTorch's ops by rounding,
# accumulated over two layers.
RTOL = 2e-4


@dataclass
class CensusEntry:
    mapping: str
    model_type: str
    model_class: str = ""
    patched: dict = field(default_factory=dict)
    left_alone: list = field(default_factory=list)
    status: str = ""  # "equal", "mismatch", "not built", "nothing patched"
    detail: str = ""
    seconds: float = 0.0


def _relative_error(ours: torch.Tensor, reference: torch.Tensor, floor: float = 1e-6) -> float:
    scale = reference.detach().abs().max().clamp_min(floor)
    return float((ours.detach().float() - reference.detach().float()).abs().max() / scale)


def _scale_for_softcap(model: torch.nn.Module) -> None:
    text_config = model.config.get_text_config()
    cap = getattr(text_config, "final_logit_softcapping", None)
    head = model.get_output_embeddings()
    if cap and head is not None:
        with torch.no_grad():
            head.weight.mul_(2.0 * cap / 0.5)  # tiny models' logits are ~0.5: now around the cap


def _step(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def census_entry(mapping: str, model_type: str, device: str = "cpu") -> CensusEntry:
    """Build, patch, step and compare one model type."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    entry = CensusEntry(mapping, model_type)
    start = time.perf_counter()
    try:
        model, batch = tiny_model(model_type, mapping)
        _scale_for_softcap(model)
        model = model.to(device)
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        reference = copy.deepcopy(model)
        reference_loss, reference_grads = _step(reference, batch)
        again, _ = _step(reference, batch)
        if not torch.equal(again, reference_loss):
            raise RuntimeError("the unpatched training step is not deterministic")
    except Exception as error:  # noqa: BLE001 - the census records what it could not build
        entry.status, entry.detail = "not built", f"{type(error).__name__}: {str(error)[:160]}"
        return entry
    entry.model_class = type(model).__name__
    report = _apply_liger_kernel_to_instance(model)
    entry.patched = dict(report.patched)
    entry.left_alone = list(report.left_alone)
    if not entry.patched:
        entry.status = "nothing patched"
        entry.seconds = time.perf_counter() - start
        return entry
    try:
        loss, grads = _step(model, batch)
    except Exception as error:  # noqa: BLE001 - a patched model that fails is a mismatch
        entry.status, entry.detail = "mismatch", f"patched step failed: {type(error).__name__}: {str(error)[:200]}"
        return entry
    errors = {"loss": _relative_error(loss, reference_loss)}
    missing = sorted(set(reference_grads) ^ set(grads))
    if missing:
        entry.status, entry.detail = "mismatch", f"gradients of {missing[:3]} present on one side only"
        return entry
    floor = 1e-3 * max(float(g.abs().max()) for g in reference_grads.values())
    errors.update({name: _relative_error(grads[name], reference_grads[name], floor) for name in reference_grads})
    worst = max(errors, key=errors.get)
    entry.status = "equal" if errors[worst] <= RTOL else "mismatch"
    entry.detail = f"max relative error {errors[worst]:.1e} ({worst})"
    entry.seconds = time.perf_counter() - start
    return entry


def _selected() -> list[tuple[str, str]]:
    everything = model_types()
    if os.environ.get("LIGER_CENSUS", "") == "full":
        return everything
    listed = {f"{mapping}:{mt}" for mapping, mt in everything}
    return [tuple(item.split(":")) for item in FAST if item in listed]


@pytest.mark.parametrize("mapping, model_type", _selected(), ids=[f"{m}:{t}" for m, t in _selected()])
def test_patched_model_matches_hf(mapping, model_type):
    from tests.utils import DEVICE

    entry = census_entry(mapping, model_type, DEVICE)
    if entry.status == "not built":
        pytest.skip(f"tiny {model_type} config does not build: {entry.detail}")
    assert entry.status != "mismatch", f"{model_type}: {entry.detail}; patched {entry.patched}"
    if f"{mapping}:{model_type}" in FAST:
        assert entry.status == "equal", f"{model_type} patched nothing: {entry.left_alone}"
        assert "fused_linear_cross_entropy" in entry.patched, entry.left_alone


def _kernels(entry: CensusEntry) -> str:
    names = {"rms_norm": "RMSNorm", "layer_norm": "LayerNorm", "swiglu": "SwiGLU", "geglu": "GeGLU", "rope": "RoPE",
             "fused_linear_cross_entropy": "fused loss", "cross_entropy": "CE"}
    return ", ".join(f"{names.get(k, k)} x{v}" for k, v in entry.patched.items())


def _reason(why: str) -> str:
    """A left-alone reason without its measured numbers and probe shapes, to group equal reasons."""
    import re

    return re.sub(r" \([0-9, ]+\)", "", why.split(" (relative error")[0]).strip()


def write_models_md(entries: list[CensusEntry], path: str) -> None:
    import collections

    import transformers

    equal = [e for e in entries if e.status == "equal"]
    lines = [
        "# Supported models",
        "",
        f"Generated by `python -m tests.transformers.test_census` against transformers {transformers.__version__}: "
        "every model type it lists for causal LM and image-text-to-text, built tiny and random, patched with "
        "`_apply_liger_kernel_to_instance` and compared with the unpatched model (loss and every parameter "
        f"gradient in fp32, relative error at most {RTOL:g}). Each module is swapped only after a probe proved it "
        "equal to its Liger replacement; what was left alone is listed with the reason.",
        "",
        "| | causal LM | image-text-to-text |",
        "|---|---|---|",
    ]
    rows = {
        "model types listed": lambda e: True,
        "patched, loss and gradients equal": lambda e: e.status == "equal",
        "... with the fused loss and at least one kernel": lambda e: e.status == "equal"
        and "fused_linear_cross_entropy" in e.patched and len(e.patched) > 1,
        "mismatch (a failure)": lambda e: e.status == "mismatch",
        "nothing to patch": lambda e: e.status == "nothing patched",
        "tiny random config not built": lambda e: e.status == "not built",
    }
    for label, keep in rows.items():
        counts = [sum(1 for e in entries if e.mapping == m and keep(e)) for m in ("causal_lm", "image_text_to_text")]
        lines.append(f"| {label} | {counts[0]} | {counts[1]} |")
    reasons = collections.Counter(_reason(why) for e in equal for _, why in e.left_alone)
    lines += ["", "Modules left alone in patched models, by reason (number of model types):", ""]
    lines += [f"- {count}: {reason}" for reason, count in reasons.most_common()]
    lines += ["", "| mapping | model type | class | status | kernels | left alone (why) |", "|---|---|---|---|---|---|"]
    for e in entries:
        left = "; ".join(f"{what}: {why}" for what, why in e.left_alone[:4]).replace("|", "/")
        detail = e.detail.replace("|", "/").replace("\n", " ") if e.status in ("not built", "mismatch") else ""
        lines.append(f"| {e.mapping} | {e.model_type} | {e.model_class} | {e.status} | {_kernels(e)} | "
                     f"{'; '.join(filter(None, (detail, left)))} |")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")


class _Timeout(BaseException):  # not caught by the census's own "except Exception"
    pass


def _census_entry_within(mapping: str, model_type: str, seconds: int) -> CensusEntry:
    """:func:`census_entry`, recorded as not built when it takes longer than ``seconds``."""
    import signal

    def expire(signum, frame):
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        return census_entry(mapping, model_type)
    except _Timeout:
        return CensusEntry(mapping, model_type, status="not built", detail=f"took over {seconds} s on this machine")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main(argv: list[str]) -> int:
    """``python -m tests.transformers.test_census [OUT.md] [--results R.json] [--only a,b]``:
    run the census (only the listed model types with ``--only``, the others' entries kept from
    the results file) and write the table."""
    import argparse
    import dataclasses
    import json
    import logging
    import warnings

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out", nargs="?", default="docs/models.md")
    parser.add_argument("--results", default=None, help="JSON file of entries, read and updated")
    parser.add_argument("--only", default="", help="comma-separated model types to (re)run")
    args = parser.parse_args(argv[1:])
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    known: dict[str, CensusEntry] = {}
    if args.results and os.path.exists(args.results):
        with open(args.results) as handle:
            for item in json.load(handle):
                entry = CensusEntry(**item)
                known[f"{entry.mapping}:{entry.model_type}"] = entry
    only = set(filter(None, args.only.split(",")))
    entries = []
    for mapping, model_type in model_types():
        key = f"{mapping}:{model_type}"
        if key in known and only and model_type not in only:
            entries.append(known[key])
            continue
        entry = _census_entry_within(mapping, model_type, int(os.environ.get("LIGER_CENSUS_TIMEOUT", "240")))
        entries.append(entry)
        print(f"{entry.status:16s} {mapping:18s} {model_type:28s} {_kernels(entry)} {entry.detail}", flush=True)
        if args.results:
            with open(args.results, "w") as handle:
                json.dump([dataclasses.asdict(e) for e in entries], handle)
    if args.results:
        with open(args.results, "w") as handle:
            json.dump([dataclasses.asdict(e) for e in entries], handle)
    write_models_md(entries, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
