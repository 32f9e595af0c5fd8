"""Gradient checkpointing of patched models: the same loss and gradients as without it.

``model.gradient_checkpointing_enable()`` (``activation_checkpointing_enable()`` in newer
transformers) makes every decoder layer drop its activations and recompute them in the
backward, so each patched kernel in a layer (RMSNorm, RoPE, SwiGLU/GEGLU) runs its forward
twice and its backward once on the recomputed tensors. A kernel whose backward relied on
state left by a previous forward, or that wrote into a tensor autograd saved (the in-place
RMSNorm backward), would give different gradients. From the same initialisation and batch
we train one step of a tiny model of each family three ways - unpatched, patched, patched
with checkpointing - for both checkpoint implementations (reentrant and not).

Tolerances (fp32): the patched model with checkpointing repeats exactly the computation of
the patched model without it (same kernels, same inputs, deterministic reductions), so we
ask for 1e-6 relative; against the unpatched HF model the kernels round differently from
HF's composite fp32 ops, observed ~1e-7 relative, and we allow 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.transformers.model_configs import MODEL_TYPES, build_model, random_batch
from tests.utils import DEVICE, rel_error, shapes

pytest.importorskip("transformers")

# CPU: two families (~the two norm layouts), the GPU run: all of them.
FAMILIES = shapes(small=["llama", "qwen3"], full=[m for m in MODEL_TYPES if m not in ("llama", "qwen3")])


def _enable_checkpointing(model, use_reentrant: bool) -> None:
    """Checkpoint every decoder layer; ``activation_checkpointing_enable`` is the name from
    transformers 5.2x on, where ``gradient_checkpointing_enable`` became a deprecated alias
    (the only name on 5.17)."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        assert model.is_activation_checkpointing
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert model.is_gradient_checkpointing


def _loss_and_grads(model_type: str, patched: bool, checkpointing: bool, use_reentrant: bool, batch: dict):
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    model = build_model(model_type, seed=0, use_cache=False).to(DEVICE)
    if patched:
        _apply_liger_kernel_to_instance(model=model)
    if checkpointing:
        _enable_checkpointing(model, use_reentrant)
    model.train()
    loss = model(**batch).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_same_gradients(model_type: str, use_reentrant: bool) -> None:
    batch = random_batch(1024, batch=2, seq=12, device=DEVICE)
    hf_loss, hf_grads = _loss_and_grads(model_type, False, False, use_reentrant, batch)
    loss, grads = _loss_and_grads(model_type, True, False, use_reentrant, batch)
    ckpt_loss, ckpt_grads = _loss_and_grads(model_type, True, True, use_reentrant, batch)

    assert ckpt_grads.keys() == grads.keys() == hf_grads.keys(), "a parameter lost its gradient"
    torch.testing.assert_close(ckpt_loss, loss, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(ckpt_loss, hf_loss, rtol=1e-5, atol=0.0)
    for name, hf_grad in hf_grads.items():
        assert hf_grad.abs().sum() > 0, name
        err_ckpt = rel_error(ckpt_grads[name], grads[name])
        assert err_ckpt <= 1e-6, f"{name}: checkpointed patched gradient off by {err_ckpt:.2e} from patched"
        err_hf = rel_error(ckpt_grads[name], hf_grad)
        assert err_hf <= 1e-5, f"{name}: checkpointed patched gradient off by {err_hf:.2e} from HF"
