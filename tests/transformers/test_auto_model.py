"""``AutoLigerKernelForCausalLM``: HF loading plus Liger patching for the config's model type."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from liger_kernel.transformers import AutoLigerKernelForCausalLM, revert_liger_kernel  # noqa: E402
from liger_kernel.transformers.monkey_patch import _instance_patched  # noqa: E402
from tests.transformers.model_configs import VOCAB, build_model, random_batch, tiny_config  # noqa: E402
from tests.utils import DEVICE  # noqa: E402


@pytest.fixture(autouse=True)
def _revert_class_patches():
    yield
    revert_liger_kernel()


def test_is_an_auto_model_class():
    assert issubclass(AutoLigerKernelForCausalLM, transformers.AutoModelForCausalLM)


def test_from_config_patches_and_passes_hf_kwargs_through():
    config = tiny_config("qwen3")
    model = AutoLigerKernelForCausalLM.from_config(config, rope=False, swiglu=False, dtype=torch.float64)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float64  # the HF kwarg reached transformers
    assert _instance_patched(model) and _instance_patched(model.model.layers[0].self_attn.q_norm)
    assert not _instance_patched(model.model.layers[0].mlp)  # swiglu=False honoured
    assert not _instance_patched(model.model.layers[0].self_attn)  # rope=False honoured
    other = build_model("qwen3")
    assert not _instance_patched(other)  # no class-level side effect


def test_from_pretrained_round_trip(tmp_path):
    reference = build_model("mistral", seed=4)
    reference.save_pretrained(tmp_path)
    model = AutoLigerKernelForCausalLM.from_pretrained(tmp_path, geglu=True).to(DEVICE)  # geglu: not a mistral option
    assert _instance_patched(model) and _instance_patched(model.model.layers[1].mlp)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, atol=0, rtol=0, msg=name)
    batch = random_batch(VOCAB, seed=4)
    reference.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, atol=2e-5, rtol=1e-4)
