"""Tiny configs for the eight patchable families, shared by the transformers tests.

Sized so the Triton interpreter can train them on CPU: 2 layers, hidden 32, 4 query heads
over 2 key/value heads (GQA), head_dim 8, vocab 1024 (big enough that the fused loss chunks
over a real vocabulary). On a GPU run (``FULL_SHAPES``) the convergence tests widen them.
Every family keeps the feature that makes it special: Gemma 2's soft-caps and four norms,
Qwen3's q/k norms, Qwen2's attention biases, Phi-3's fused projections with partial rotary,
Mixtral's 4 experts (top 2).
"""

from __future__ import annotations

import importlib

import torch

from tests.utils import DEVICE, FULL_SHAPES

MODEL_TYPES = ("llama", "mistral", "mixtral", "gemma", "gemma2", "qwen2", "qwen3", "phi3")

_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "mixtral": "MixtralConfig",
    "gemma": "GemmaConfig",
    "gemma2": "Gemma2Config",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "phi3": "Phi3Config",
}

VOCAB = 1024


def tiny_config(model_type: str, hidden: int = 32, layers: int = 2, vocab: int = VOCAB, **overrides):
    """A ``transformers`` config of ``model_type`` with small sizes and eager attention."""
    import transformers

    heads, kv_heads = 4, 2
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        attn_implementation="eager",
        use_cache=True,
    )
    specific = {
        "gemma": dict(hidden_act="gelu_pytorch_tanh"),
        "gemma2": dict(
            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=hidden // heads,
            sliding_window=64, final_logit_softcapping=3.0, attn_logit_softcapping=50.0,
        ),
        "qwen2": dict(use_sliding_window=False),
        "qwen3": dict(use_sliding_window=False),
        "phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02),
    }
    kwargs = {**common, **specific.get(model_type, {}), **overrides}
    return getattr(transformers, _CONFIG_CLASSES[model_type])(**kwargs)


def convergence_config(model_type: str, **overrides):
    """The config trained by the convergence test: tiny on CPU, wider on the GPU run.

    At the GPU sizes Mixtral routes every token to all of its experts: with top-2 routing a
    token whose two best router scores are within rounding noise switches experts, and
    after ~10 steps HF fp32 and HF float64 alone have diverged by routing flips (1e-2 in the
    loss), so a trajectory comparison measures HF's own chaos, not the kernels. Routing to
    all experts keeps the expert loop, the gate kernel in every expert and the auxiliary
    loss, with a continuous routing function. Top-2 routing is compared step by step
    (fixed weights, no trajectory) by ``test_one_step_matches_float64``.
    """
    if FULL_SHAPES:
        if model_type == "mixtral":
            overrides = {"num_experts_per_tok": 4, **overrides}
        return tiny_config(model_type, hidden=128, layers=4, vocab=4096, **overrides)
    return tiny_config(model_type, **overrides)


def causal_lm_class(model_type: str) -> type:
    from liger_kernel.transformers.families import FAMILIES

    family = FAMILIES[model_type]
    return getattr(importlib.import_module(family.modeling_module), family.causal_lm_class)


def build_model(model_type: str, seed: int = 0, config=None, dtype: torch.dtype = torch.float32, **overrides):
    """A freshly initialised ``*ForCausalLM`` (HF init, fixed seed), in ``dtype``, on the test device."""
    config = config if config is not None else tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = causal_lm_class(model_type)(config)
    return model.to(device=DEVICE, dtype=dtype)


def random_batch(vocab: int, batch: int = 2, seq: int = 16, seed: int | None = None, device: str = DEVICE):
    """``input_ids`` (B, T) avoiding the special ids 0-2, an all-ones mask with one padded row tail,
    and labels = input_ids with the padding set to -100."""
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1 and seq > 4:
        attention_mask[-1, -3:] = 0  # right padding on the last row
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "labels": labels.to(device),
    }


def loss_and_grads(model, batch: dict):
    """One training-mode forward/backward from cleared gradients: ``(loss, {name: grad})``, detached copies."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
