"""``torch.compile(fullgraph=True)`` of whole patched models: one graph, same loss and gradients.

Every kernel launcher is a ``torch.library`` custom op (``liger::*``), so Dynamo records each
launch as one opaque node and never traces into Triton; the autograd Functions around them,
the fused-loss ``*ForCausalLM.forward`` and the instance patches (bound forwards, the attention
forward re-bound to the Liger rotary function) must all be traceable without a graph break.

Two checks per family:

* ``test_traces_as_one_graph``: Dynamo alone (``fullgraph=True`` with a backend that records
  the graph and runs it as traced: no code generation, cheap) traces the training forward
  into exactly one graph with no break, the graph calls the Liger ops - proof that the
  compiled model runs the kernels rather than a fallback - and the traced step gives the
  eager loss and gradients; Dynamo warns about none of our code while tracing (a user compiling
  a patched model would see each warning). Instance-patched models of each family, and one
  class-level patched model.
* ``test_compiled_matches_eager``: the Inductor build of the same model (``fullgraph=True``,
  which raises on any graph break) gives the eager patched model's loss and gradients. On
  CPU Inductor generates C++ for the non-Liger parts (attention, matmuls, residuals) while the
  Liger ops run through the Triton interpreter; each build costs ~30 s of CPU, so the CPU
  suite compiles Llama only and the GPU run every other family too.

Tolerance (fp32): Inductor fuses and reorders the surrounding fp32 elementwise ops and
reductions (softmax, residual adds), which changes roundings only, observed ~1e-7 relative; we
allow 1e-5 relative on the loss and norm-wise on every gradient.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch

import liger_kernel
from tests.transformers.model_configs import MODEL_TYPES, build_model, random_batch
from tests.utils import DEVICE, rel_error, shapes

pytest.importorskip("transformers")

TRACE_FAMILIES = shapes(small=["llama", "gemma2"], full=[m for m in MODEL_TYPES if m not in ("llama", "gemma2")])
# Inductor builds are the expensive part: the CPU suite builds Llama, the GPU run every family.
COMPILE_FAMILIES = shapes(small=["llama"], full=[m for m in MODEL_TYPES if m != "llama"])

# Liger ops each patched training step must call: norm, rotary, gated MLP, fused loss.
EXPECTED_OPS = {
    "rms_norm": "liger::rms_norm",
    "rope": "liger::rope",
    "mlp": ("liger::swiglu", "liger::geglu"),
    "fused_linear_cross_entropy": "liger::fused_linear_cross_entropy",
}


def _patched_model(model_type: str, class_level: bool = False, **overrides):
    """A patched tiny model: the instance patch, or built while the classes are patched."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance, liger_kernel_patched

    if class_level:
        with liger_kernel_patched(model_type):
            model = build_model(model_type, seed=0, use_cache=False, **overrides).to(DEVICE)
    else:
        model = build_model(model_type, seed=0, use_cache=False, **overrides).to(DEVICE)
        _apply_liger_kernel_to_instance(model=model)
    model.train()
    return model


def _batch(device: str = DEVICE) -> dict:
    return random_batch(1024, batch=2, seq=12, device=device)


def _graph_code(gm: torch.fx.GraphModule) -> str:
    # Nested subgraphs (autograd.Function bodies) are printed too.
    return gm.print_readable(print_output=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _trace_cases() -> list:
    # The class-level patch replaces module globals, the instance patch rebinds forwards
    # (the attention forward gets its own globals): both must trace.
    return [pytest.param(m, False, id=f"{m}-instance") for m in TRACE_FAMILIES] + [
        pytest.param("llama", True, id="llama-class")
    ]


def _assert_same_step(model, reference, loss, reference_loss, label: str) -> None:
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=0.0, msg=lambda m: f"{label} loss\n{m}")
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected = reference_params[name].grad
        assert expected is not None and param.grad is not None, f"{label}: {name} has no gradient"
        err = rel_error(param.grad, expected)
        assert err <= 1e-5, f"{label}: compiled gradient of {name} off by {err:.2e} (relative)"


def _dynamo_warnings_about_liger(caught: list[warnings.WarningMessage]) -> list[str]:
    """Dynamo's warnings that name a liger_kernel source file (``... at 'causal_lm.py:389'``):
    every user compiling a patched model would see them."""
    ours = {path.name for path in Path(liger_kernel.__file__).parent.rglob("*.py")}
    found = []
    for w in caught:
        message = str(w.message)
        if "Dynamo" in message and any(f"'{name}:" in message for name in ours):
            found.append(message.split(".")[0])
    return found


@pytest.mark.parametrize("model_type, class_level", _trace_cases())
def test_traces_as_one_graph(model_type: str, class_level: bool) -> None:
    from liger_kernel.transformers import liger_kernel_patched

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs) -> object:
        # Dynamo only: record the graph and run it as traced (no code generation).
        graphs.append(gm)
        return gm.forward

    batch = _batch()
    eager = _patched_model(model_type, class_level)
    model = _patched_model(model_type, class_level)
    # The class-level patch is looked up in the module globals at call time: keep it active.
    context = liger_kernel_patched(model_type) if class_level else contextlib.nullcontext()
    with context:
        eager_loss = eager(**batch).loss
        eager_loss.backward()
        # fullgraph=True raises torch._dynamo.exc.Unsupported at the first graph break.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = torch.compile(model, fullgraph=True, backend=capture)(**batch).loss
        loss.backward()

    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    ours = _dynamo_warnings_about_liger(caught)
    assert not ours, f"Dynamo warned about liger_kernel code while tracing: {ours}"
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    code = _graph_code(graphs[0])
    for kernel, names in EXPECTED_OPS.items():
        names = (names,) if isinstance(names, str) else names
        assert any(name.replace("::", ".") in code for name in names), (
            f"{model_type}: the traced graph does not call the Liger {kernel} op ({names})"
        )
    _assert_same_step(model, eager, loss, eager_loss, f"{model_type} traced")


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_traces_after_an_eager_step(model_type: str) -> None:
    """The patch hooks the norm consumers (the recompute's module hooks: every ``nn.Linear``,
    Mixtral's router) and an eager training step uses them; compiling the same model
    afterwards must still trace as one graph (the hooks return at once there) with the eager
    step's results."""
    batch = _batch()
    model = _patched_model(model_type)
    assert model.lm_head._forward_pre_hooks
    eager_loss = model(**batch).loss
    eager_loss.backward()
    eager_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    def capture(gm: torch.fx.GraphModule, example_inputs) -> object:
        return gm.forward

    loss = torch.compile(model, fullgraph=True, backend=capture)(**batch).loss
    loss.backward()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0.0)
    for name, param in model.named_parameters():
        assert rel_error(param.grad, eager_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("model_type", COMPILE_FAMILIES)
def test_compiled_matches_eager(model_type: str) -> None:
    overrides = {}
    if model_type == "mixtral" and DEVICE == "cuda":
        # On CUDA HF defaults to its grouped_mm experts, whose fp32 fallback backward
        # (transformers.integrations.moe._grouped_mm_fallback_backward) guards on a
        # data-dependent size that Inductor cannot compile (GuardOnDataDependentSymNode, the
        # unpatched HF model too, transformers 5.17). The batched_mm experts have static shapes
        # and call the same patched gate (``_apply_gate``).
        overrides["experts_implementation"] = "batched_mm"
    batch = _batch()
    eager = _patched_model(model_type, **overrides)
    if overrides and eager.config._experts_implementation != overrides["experts_implementation"]:
        pytest.skip("batched_mm experts are not available in this transformers")
    compiled_model = _patched_model(model_type, **overrides)
    compiled = torch.compile(compiled_model, fullgraph=True)

    eager_loss = eager(**batch).loss
    eager_loss.backward()
    loss = compiled(**batch).loss
    loss.backward()

    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    _assert_same_step(compiled_model, eager, loss, eager_loss, f"{model_type} inductor")
