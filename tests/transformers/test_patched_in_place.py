"""In-place backwards of patched models: the patched modules write gradients over buffers they made
(a decoder-layer norm's output gradient, the gated MLP's activations) only while no hook can see
those buffers; with a hook the gradients, and what the hook kept, are HF's."""

from __future__ import annotations

import pytest
import torch

from tests.transformers.model_configs import build_model, loss_and_grads, random_batch

pytest.importorskip("transformers")

FP32_TOL = {"atol": 2e-5, "rtol": 1e-4}  # the patching tests' tolerance (2-layer fp32 model)


def _norm_decisions(monkeypatch) -> list[bool]:
    """Whether each RMSNorm backward wrote dx over dy, in call order (told to the launcher)."""
    import liger_kernel.ops.rms_norm as rms_norm_ops

    decided = []
    backward = rms_norm_ops.rms_norm_backward

    def recording(*args):
        decided.append(args[-1])
        return backward(*args)

    monkeypatch.setattr(rms_norm_ops, "rms_norm_backward", recording)
    return decided


def _keep_output_grad(model, kept: list, how: str) -> list:
    """Hooks that keep what layer 0's input norm sees of its output's gradient."""
    norm = model.model.layers[0].input_layernorm
    if how == "tensor_hook":
        # Registered by the norm's own forward hook, as activation-gradient caches do.
        return [norm.register_forward_hook(
            lambda m, args, out: out.register_hook(lambda g: kept.append(g.detach())) and None)]
    if how == "module_backward_hook":
        return [norm.register_full_backward_hook(lambda m, grad_in, grad_out: kept.append(grad_out[0].detach()))]
    raise ValueError(how)


@pytest.mark.parametrize("how", ["tensor_hook", "module_backward_hook"])
def test_norm_with_a_hook_keeps_its_output_gradient(how, monkeypatch):
    """A hook on a patched norm that keeps its output's gradient still holds HF's dy after
    backward (the norm allocates dx instead of writing over dy); every gradient is HF's; the
    other decoder-layer norms keep writing in place."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    batch = random_batch(1024, seed=5)
    hf = build_model("llama", seed=0)
    kept_hf = []
    _keep_output_grad(hf, kept_hf, how)
    hf_loss, hf_grads = loss_and_grads(hf, batch)

    model = build_model("llama", seed=0)
    _apply_liger_kernel_to_instance(model)
    kept = []
    _keep_output_grad(model, kept, how)
    decided = _norm_decisions(monkeypatch)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(kept[0], kept_hf[0], **FP32_TOL)
    torch.testing.assert_close(loss, hf_loss, **FP32_TOL)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(grads[name], grad, **FP32_TOL, msg=name)
    # 2 layers x 2 norms + the final norm, backward in reverse: final, layer 1 (2), layer 0 (2).
    assert decided == [False, True, True, True, False]


def test_global_module_hook_turns_every_in_place_write_off(monkeypatch):
    """A global module hook sees every module's inputs and outputs: while one is registered no
    patched norm or MLP writes in place, and the gradients are HF's."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from tests.ops.test_swiglu import _record_in_place_decisions

    batch = random_batch(1024, seed=6)
    hf_loss, hf_grads = loss_and_grads(build_model("llama", seed=0), batch)
    model = build_model("llama", seed=0)
    _apply_liger_kernel_to_instance(model)
    decided = _norm_decisions(monkeypatch)
    mlp_decided = _record_in_place_decisions(monkeypatch)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m)) and None)
    try:
        loss, grads = loss_and_grads(model, batch)
    finally:
        handle.remove()
    assert seen and decided == [False] * 5 and mlp_decided == [False, False]
    torch.testing.assert_close(loss, hf_loss, **FP32_TOL)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(grads[name], grad, **FP32_TOL, msg=name)
    decided.clear()
    mlp_decided.clear()
    loss_and_grads(model, batch)  # hook removed: the in-place writes are back
    assert decided == [False, True, True, True, True] and mlp_decided == [True, True]


@pytest.mark.parametrize("class_level", [False, True], ids=["instance", "class_level"])
def test_final_norm_never_writes_over_its_output_gradient(class_level):
    """The final norm's output is the model's last hidden state, handed to the caller: both
    patches leave its gradient alone, and promise it for every decoder-layer norm."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance, liger_kernel_patched

    if class_level:
        with liger_kernel_patched("llama"):
            model = build_model("llama", seed=0)
    else:
        model = build_model("llama", seed=0)
        _apply_liger_kernel_to_instance(model)
    assert model.model.norm.in_place is False
    layer_norms = [norm for layer in model.model.layers for norm in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm)]
    assert [norm.in_place for norm in layer_norms] == [True] * len(layer_norms)
