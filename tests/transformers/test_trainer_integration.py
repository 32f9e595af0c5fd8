"""``TrainingArguments(use_liger_kernel=True)`` through transformers' own code path.

``Trainer.train()`` calls ``transformers.integrations.liger.apply_liger_kernel``, which imports
``_apply_liger_kernel_to_instance`` from this package (after checking
``is_liger_kernel_available()``: importable, version >= 0.3.0) and patches the model - the
PEFT base model for a LoRA model. Trained on CPU for a few steps on a tiny in-memory dataset;
the patched run's losses must equal an unpatched run's from the same weights (fp32, same
tolerance reasoning as the convergence test, over 3 SGD-like steps: 1e-4).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from liger_kernel.transformers import trainer_integration  # noqa: E402
from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance, _instance_patched  # noqa: E402
from tests.transformers.model_configs import VOCAB, build_model, random_batch  # noqa: E402
from tests.utils import DEVICE  # noqa: E402

STEPS = 3


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 8, seq: int = 12, vocab: int = VOCAB):
        self.rows = [
            {k: v[0] for k, v in random_batch(vocab, batch=1, seq=seq, seed=50 + i, device="cpu").items()} for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _args(tmp_path, **kwargs):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=DEVICE == "cpu",  # on a GPU machine the Trainer trains on the GPU
        max_steps=STEPS,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **kwargs,
    )


def _train(model, tmp_path, vocab: int = VOCAB, **kwargs):
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, **kwargs), train_dataset=_Rows(vocab=vocab),
                                   eval_dataset=_Rows(4, vocab=vocab))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


def test_reexports_and_availability():
    from transformers.utils import is_liger_kernel_available

    assert is_liger_kernel_available()
    assert trainer_integration._apply_liger_kernel_to_instance is _apply_liger_kernel_to_instance
    assert set(trainer_integration.MODEL_TYPE_TO_APPLY_LIGER_FN) >= {"llama", "gemma2", "mixtral"}


def test_use_liger_kernel_patches_and_trains_like_unpatched(tmp_path):
    reference = build_model("llama", seed=0)
    model = copy.deepcopy(reference)
    _, ref_losses = _train(reference, tmp_path / "ref")
    trainer, losses = _train(model, tmp_path / "liger", use_liger_kernel=True)
    assert _instance_patched(model) and _instance_patched(model.model.norm)
    assert not _instance_patched(reference)
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-4)

    # Evaluation with prediction_loss_only passes skip_logits=True to the patched forward.
    seen = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("skip_logits"))
        return forward(*args, **kwargs)

    model.forward = spy
    metrics = trainer.evaluate()
    assert seen and all(flag is True for flag in seen)
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))


def test_liger_kernel_config_is_passed_through(tmp_path):
    model = build_model("gemma", seed=0)
    _train(model, tmp_path, use_liger_kernel=True,
           liger_kernel_config={"rope": False, "geglu": False, "swiglu": True})  # swiglu: dropped for gemma
    assert _instance_patched(model.model.norm)
    assert not _instance_patched(model.model.layers[0].mlp)
    assert not _instance_patched(model.model.layers[0].self_attn)


def test_peft_lora_model(tmp_path):
    peft = pytest.importorskip("peft")
    base = build_model("qwen2", seed=0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(base, config)
    reference = copy.deepcopy(lora)  # the same LoRA initialisation
    _, ref_losses = _train(reference, tmp_path / "ref")
    _, losses = _train(lora, tmp_path / "liger", use_liger_kernel=True)
    inner = lora.get_base_model()
    assert _instance_patched(inner) and _instance_patched(inner.model.layers[0].mlp)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["olmo2", "qwen3_moe"])
def test_use_liger_kernel_patches_a_discovered_model_type(model_type, tmp_path):
    """A model type the families table does not name is patched by discovery through the
    Trainer flag and trains like the unpatched model."""
    from tests.transformers.census.tiny_configs import text_vocab_size, tiny_model

    reference, _ = tiny_model(model_type)
    model = copy.deepcopy(reference)
    vocab = text_vocab_size(reference.config)
    _, ref_losses = _train(reference, tmp_path / "ref", vocab=vocab)
    _, losses = _train(model, tmp_path / "liger", vocab=vocab, use_liger_kernel=True)
    assert _instance_patched(model) and _instance_patched(model.model.norm)
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-4)
