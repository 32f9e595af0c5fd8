"""Tiny random models of any model type the installed transformers lists, built generically.

:func:`tiny_config` takes the model type's default config and shrinks every size it knows
by name (hidden and intermediate sizes, heads, layers, experts, vocabulary, vision tower),
recursively through composite configs (``text_config``, ``vision_config``, ...). Layer-kind
lists (``layer_types``, ``mlp_layer_types``, ...) keep one layer of each kind, so a model
that alternates kinds (sliding/full attention, dense/MoE, linear/full attention) still runs
every kind. Sizes stay consistent: heads x head_dim = hidden, rotary dims halved with them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
INTERMEDIATE = 48
EXPERTS = 4
TOP_K = 2
VOCAB = 128
SEQ = 12
MAX_PARAMETERS = 20_000_000

# attribute name -> tiny value (applied when the config has the attribute and it is an int).
_SIZES = {
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "n_embed": HIDDEN, "dim": HIDDEN,
    "embed_dim": HIDDEN, "text_hidden_size": HIDDEN, "model_dim": HIDDEN, "emb_dim": HIDDEN,
    "intermediate_size": INTERMEDIATE, "ffn_dim": INTERMEDIATE, "n_inner": INTERMEDIATE,
    "ffn_hidden_size": INTERMEDIATE, "d_ff": INTERMEDIATE, "encoder_ffn_dim": INTERMEDIATE,
    "decoder_ffn_dim": INTERMEDIATE, "moe_intermediate_size": INTERMEDIATE // 2,
    "shared_expert_intermediate_size": INTERMEDIATE, "expert_intermediate_size": INTERMEDIATE // 2,
    "intermediate_size_mlp": INTERMEDIATE, "dense_intermediate_size": INTERMEDIATE,
    "num_attention_heads": HEADS, "n_head": HEADS, "num_heads": HEADS, "n_heads": HEADS,
    "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "n_kv_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "multi_query_group_num": KV_HEADS,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_dim": HEAD_DIM,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "num_local_experts": EXPERTS, "num_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "moe_topk": TOP_K, "top_k": TOP_K, "moe_k": TOP_K, "num_experts_per_token": TOP_K,
    "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "vocab_size": VOCAB, "max_position_embeddings": 64, "n_positions": 64, "max_seq_len": 64,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    "qk_head_dim": 8, "linear_num_value_heads": KV_HEADS, "linear_num_key_heads": KV_HEADS,
    "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM, "sliding_window": 8,
    "first_k_dense_replace": 1, "num_nextn_predict_layers": 0, "attention_chunk_size": 8,
    # vision towers
    "image_size": 28, "patch_size": 14, "num_channels": 3, "projection_dim": HIDDEN,
    "vision_feature_layer": -1, "mm_tokens_per_image": 4, "spatial_merge_size": 2, "temporal_patch_size": 1,
    "out_hidden_size": HIDDEN, "depth": 2, "image_token_index": VOCAB - 1, "image_token_id": VOCAB - 1,
    "rotary_dim": HEAD_DIM // 2,
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
_LAYER_KIND_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "attn_layer_types", "block_types",
                     "hybrid_override_pattern", "layer_block_types")
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "decoder", "encoder", "speech_config",
                "thinker_config", "vq_config", "perceiver_config")


def _one_of_each(kinds: list) -> list:
    """The shortest prefix-preserving list keeping one of each distinct kind (at least 2 long)."""
    kept, seen = [], set()
    for kind in kinds:
        key = repr(kind)
        if key not in seen:
            seen.add(key)
            kept.append(kind)
    while len(kept) < 2 and kinds:
        kept.append(kinds[len(kept) % len(kinds)])
    return kept


def shrink(config: Any) -> Any:
    """``config`` (a ``PretrainedConfig``) with tiny sizes, in place; returns it."""
    for name, value in _SIZES.items():
        if isinstance(getattr(config, name, None), int) and not isinstance(getattr(config, name), bool):
            try:
                setattr(config, name, value)
            except Exception:
                pass
    for name, value in (("head_dim", HEAD_DIM), ("num_key_value_heads", KV_HEADS)):
        if name in getattr(config, "__dict__", {}) and getattr(config, name) is None:
            _try_setattr(config, name, value)  # "derive it" defaults some modeling code reads as is
    n_layers = None
    for name in _LAYER_KIND_LISTS:
        kinds = getattr(config, name, None)
        if isinstance(kinds, (list, tuple)) and kinds:
            kept = _one_of_each(list(kinds))
            if _try_setattr(config, name, kept):
                n_layers = max(n_layers or 0, len(kept))
        elif isinstance(kinds, str) and kinds:
            kept = "".join(dict.fromkeys(kinds)) if len(set(kinds)) > 1 else kinds[:2]
            if _try_setattr(config, name, kept):
                n_layers = max(n_layers or 0, len(kept))
    if n_layers is not None:
        for name in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(getattr(config, name, None), int):
                setattr(config, name, n_layers)
        for name in _LAYER_KIND_LISTS:
            kinds = getattr(config, name, None)
            if isinstance(kinds, list) and len(kinds) < n_layers:
                _try_setattr(config, name, (kinds * n_layers)[:n_layers])
    for name in _TOKEN_IDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, name, min(value, VOCAB - 2))
    if isinstance(getattr(config, "qk_rope_head_dim", None), int) and hasattr(config, "head_dim"):
        config.head_dim = config.qk_rope_head_dim  # multi-head latent attention: rotary over the rope part
        if hasattr(config, "num_key_value_heads"):
            config.num_key_value_heads = config.num_attention_heads  # keys and values expanded per head
    if isinstance(getattr(config, "partial_rotary_factor", None), float) and config.partial_rotary_factor < 1:
        config.partial_rotary_factor = 0.5
    for name in ("initializer_range",):
        if hasattr(config, name):
            setattr(config, name, 0.1)
    for name, value in list(vars(config).items()):
        if ("dropout" in name or "pdrop" in name or "jitter" in name) and isinstance(value, float):
            _try_setattr(config, name, 0.0)  # deterministic steps: patched and unpatched compared
    if getattr(config, "tie_word_embeddings", None) is not None:
        config.tie_word_embeddings = False
    if getattr(config, "logits_scaling", None) == 1.0:
        config.logits_scaling = 4.0  # Granite: a scale of 1 would pass dropped
    if getattr(config, "output_router_logits", None) is not None:
        config.output_router_logits = True  # MoE: the router's auxiliary loss is part of the loss
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ()):
        rope.setdefault("mrope_section", [8, 12, 12])  # the modeling default, resized below
    for params in ([rope] + list(rope.values())) if isinstance(rope, dict) else ():
        if isinstance(params, dict) and "rope_type" in params and params.get("rope_theta") is None:
            params["rope_theta"] = 10000.0
        if isinstance(params, dict) and isinstance(params.get("mrope_section"), list):
            # multimodal rotary sections (temporal, height, width) cover half the rotary dims
            factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
            half = int(HEAD_DIM * factor) // 2
            count = len(params["mrope_section"])
            params["mrope_section"] = [half // count + (1 if i < half % count else 0) for i in range(count)]
    for name in _SUB_CONFIGS:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            shrink(sub)
    return config


def _try_setattr(config: Any, name: str, value: Any) -> bool:
    """``setattr``, False where the attribute is a read-only property derived from others."""
    try:
        setattr(config, name, value)
    except AttributeError:
        return False
    return True


def tiny_config(model_type: str) -> Any:
    from transformers import AutoConfig

    config = shrink(AutoConfig.for_model(model_type))
    config._attn_implementation = "eager"
    for name in _SUB_CONFIGS:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            sub._attn_implementation = "eager"
    return config


def model_types() -> list[tuple[str, str]]:
    """``(mapping, model_type)`` for every causal-LM and image-text-to-text model type."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    return ([("causal_lm", mt) for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
            + [("image_text_to_text", mt) for mt in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES])


def tiny_model(model_type: str, mapping: str = "causal_lm", seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """(a tiny fp32 model of ``model_type`` in train mode, a batch with labels) on CPU."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = tiny_config(model_type)
    auto = AutoModelForCausalLM if mapping == "causal_lm" else AutoModelForImageTextToText
    with torch.device("meta"):  # sizes the model before allocating it: a config not shrunk stays out
        parameters = sum(p.numel() for p in auto.from_config(config, attn_implementation="eager").parameters())
    if parameters > MAX_PARAMETERS:
        raise ValueError(f"the shrunk config still has {parameters / 1e6:.0f} M parameters")
    torch.manual_seed(seed)
    model = auto.from_config(config, attn_implementation="eager").float()
    model.train()
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else VOCAB
    generator = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(3, min(vocab, VOCAB) - 2, (2, SEQ), generator=generator)
    labels = input_ids.clone()
    labels[0, :3] = -100
    return model, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def clone(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)
