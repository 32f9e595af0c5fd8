"""``torch.compile(fullgraph=True)`` of whole patched models: one graph, same loss and gradients.

Every kernel launcher is a ``torch.library`` custom op (``liger::*``), so Dynamo records each
launch as one opaque node and never traces into Triton; the autograd Functions around them,
the fused-loss ``*ForCausalLM.forward`` and the instance patches (bound forwards, the attention
forward re-bound to the Liger rotary function) must all be traceable without a graph break.

Two checks per family:

* ``test_traces_as_one_graph``: Dynamo alone (``torch._dynamo.explain``, no code generation,
  cheap) traces the training forward into exactly one graph with no break, and the graph
  calls the Liger ops - proof that the compiled model runs the kernels rather than a
  fallback.
* ``test_compiled_matches_eager``: the Inductor build of the same model (``fullgraph=True``,
  which raises on any graph break) gives the eager patched model's loss and gradients. On
  CPU Inductor generates C++ for the non-Liger parts (attention, matmuls, residuals) while the
  Liger ops run through the Triton interpreter; each build costs ~30 s of CPU, so the CPU
  suite compiles Llama only and the GPU run every family.

Tolerance (fp32): Inductor fuses and reorders the surrounding fp32 elementwise ops and
reductions (softmax, residual adds), which changes roundings only, observed ~1e-7 relative; we
allow 1e-5 relative on the loss and norm-wise on every gradient.
"""

from __future__ import annotations

import pytest
import torch

from tests.transformers.model_configs import MODEL_TYPES, build_model, random_batch
from tests.utils import DEVICE, rel_error, shapes

pytest.importorskip("transformers")

TRACE_FAMILIES = shapes(small=["llama", "gemma2"], full=[m for m in MODEL_TYPES if m not in ("llama", "gemma2")])
COMPILE_FAMILIES = shapes(small=["llama"], full=[m for m in MODEL_TYPES if m != "llama"])

# Liger ops each patched training step must call: norm, rotary, gated MLP, fused loss.
EXPECTED_OPS = {
    "rms_norm": "liger::rms_norm",
    "rope": "liger::rope",
    "mlp": ("liger::swiglu", "liger::geglu"),
    "fused_linear_cross_entropy": "liger::fused_linear_cross_entropy",
}


def _patched_model(model_type: str):
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    model = build_model(model_type, seed=0, use_cache=False).to(DEVICE)
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


@pytest.mark.parametrize("model_type", TRACE_FAMILIES)
def test_traces_as_one_graph(model_type: str) -> None:
    model = _patched_model(model_type)
    explanation = torch._dynamo.explain(model)(**_batch())
    assert explanation.graph_break_count == 0, [str(reason) for reason in explanation.break_reasons]
    assert explanation.graph_count == 1
    code = "\n".join(_graph_code(gm) for gm in explanation.graphs)
    for kernel, names in EXPECTED_OPS.items():
        names = (names,) if isinstance(names, str) else names
        assert any(name.replace("::", ".") in code or name in code for name in names), (
            f"{model_type}: the traced graph does not call the Liger {kernel} op ({names})"
        )


@pytest.mark.parametrize("model_type", COMPILE_FAMILIES)
def test_compiled_matches_eager(model_type: str) -> None:
    batch = _batch()
    eager = _patched_model(model_type)
    compiled_model = _patched_model(model_type)
    compiled = torch.compile(compiled_model, fullgraph=True)

    eager_loss = eager(**batch).loss
    eager_loss.backward()
    loss = compiled(**batch).loss
    loss.backward()

    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0.0)
    eager_grads = dict(eager.named_parameters())
    for name, param in compiled_model.named_parameters():
        expected = eager_grads[name].grad
        assert expected is not None and param.grad is not None, f"{name} has no gradient"
        err = rel_error(param.grad, expected)
        assert err <= 1e-5, f"{model_type}: compiled gradient of {name} off by {err:.2e} (relative)"
