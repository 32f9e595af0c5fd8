"""Tiny random configs for any ``transformers`` model type, built from the config class defaults.

The census (:mod:`tests.transformers.census.test_census`) needs a model of every causal-LM and
image-text-to-text model type that trains on CPU in seconds. Writing 300 configs by hand is not
an option, so :func:`tiny_config` takes ``CONFIG_MAPPING[model_type]()`` (the defaults, often a
released checkpoint's sizes), turns it into a dict and rewrites it with the generic rules below,
recursing into every nested config dict (``text_config``, ``vision_config``, ``audio_config``, ...):

* **Widths.** Every hidden-size key (``hidden_size``, ``d_model``, ``n_embd``, ``embed_dim``, any
  ``*_hidden_size``...) becomes :data:`HIDDEN`; attention heads :data:`HEADS`, key/value heads
  :data:`KV_HEADS` (1 stays 1: multi-query; equal to the heads stays equal: multi-head),
  ``head_dim`` and its aliases :data:`HEAD_DIM`; latent-attention ranks ``2 * HEAD_DIM``, the
  ``qk_nope``/``qk_rope``/``v`` head dims :data:`HEAD_DIM` (``qk_head_dim`` their sum, and
  ``head_dim`` the rotary part or the whole query/key head, as in the defaults).
  Because every width key of every nested config gets the same value, widths that must agree
  across configs (a projector's ``text_hidden_size`` and the text config's ``hidden_size``)
  still agree; an integer ``*dim*``/``*size*`` key equal to one of the original hidden widths
  (``adapter_in_dim``) is a width under another name and follows. Products the model checks are
  kept: state-space heads tile ``expand * hidden`` (or ``d_ssm``), an attention width that is a
  multiple of ``hidden`` (Zamba's ``[hidden, embeddings]``) keeps the multiple. A ``head_dim``
  or key/value head count the defaults leave None gets the value the rules imply. Intermediate
  sizes become :data:`INTERMEDIATE` (:data:`EXPERT_INTERMEDIATE` for expert / shared-expert /
  MoE ones); other head counts (indexer, linear attention) at most :data:`KV_HEADS`.
* **Vocabulary and token ids.** ``vocab_size`` at most :data:`VOCAB`; every ``*_token_id`` /
  ``*_token_index`` that no longer fits is mapped to a distinct id at the top of the vocabulary.
  :func:`reserved_token_ids` lists them so the census draws its inputs from the other ids.
  Every other ``*vocab*`` size is at most :data:`VOCAB` too, state sizes at most 16.
* **Positions and windows.** Maximum positions :data:`MAX_POSITIONS`; sliding windows and
  attention chunks :data:`WINDOW` (shorter than the census sequence, so the window bites; a
  config with sliding layers and no window gets one); ``original_max_position_embeddings`` at
  most half the maximum.
* **Layers.** Two decoder layers *or one of each layer kind*, whichever is more: every list in
  the config as long as the layer count (``layer_types``, per-layer intermediate sizes,
  ``no_rope_layers``, ...) and every index list (``mlp_only_layers``, ...) together with
  ``first_k_dense_replace`` and ``decoder_sparse_step`` give each layer a signature; the first
  layer of each signature is kept, per-layer lists are subsampled and index lists remapped.
  Also part of the signature: per-layer config dicts keyed by layer index (shrunk like the
  config), ``num_dense_layers``, the last ``num_kv_shared_layers``, consecutive segments whose
  ``*_layers`` counts sum to the layer count, and per-layer K/V source lists (a kept layer keeps
  its source). Period/offset layouts (``attn_layer_period``, ``expert_layer_offset``) become
  period 2 so both kinds sit in two layers. Vision ``*feature_layer*`` indices count from the
  top of the (now 2-layer) tower.
* **Experts.** :data:`EXPERTS` routed experts, top-k at most 2 and never above the experts,
  shared experts at most 1, expert groups at most 2 with one group picked; the router's
  auxiliary loss is switched on (``output_router_logits``) so it is part of the compared loss.
* **Rotary.** Multimodal rotary sections (``mrope_section``) are rescaled to half the new
  rotary dimension (and set where the modeling code would fall back to the released model's
  sections); ``rotary_dim`` keeps its fraction of the head; the partial rotary factor stays.
* **Randomness off, no cache.** Every dropout, layer-drop and router jitter is 0, so a
  training-mode forward is deterministic; ``use_cache`` is off (a training step).
* **Soft-caps and logit scales.** A final-logit soft-cap (not the attention one) becomes
  :data:`SOFTCAP`: tiny random models have logits far below a real cap of 30, where ``tanh`` is
  the identity and a patch dropping the cap would pass (the census also scales the LM head).
  A logit scale of 1 (Granite's ``logits_scaling``) becomes :data:`LOGITS_SCALING`, for the
  same reason: a patch dropping the scale would pass.

:data:`OVERRIDES` holds the few per-type fixes where a generic rule cannot work, each with its
reason. Nothing here touches the network: configs come from classes, weights are random.

:func:`build_model` builds a model of a config on the test device (``tests.utils.DEVICE``) and
:func:`tiny_model` a tiny model of a model type with a batch, for tests beyond the census.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import torch

from tests.utils import DEVICE

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
EXPERT_INTERMEDIATE = 32
VOCAB = 256
MAX_POSITIONS = 128
WINDOW = 8
EXPERTS = 4
TOP_K = 2
SOFTCAP = 2.0
LOGITS_SCALING = 4.0
MIN_LAYERS = 2
SEQUENCE = 16  # the census's sequence length: longer than WINDOW; Reformer's override depends on it

_HIDDEN_KEYS = {
    "hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "embedding_dim", "embedding_size", "dim",
    "model_dim", "hidden_dim", "word_embed_proj_dim", "projection_dim", "d_embed", "emb_dim", "width",
    "hidden_channels", "text_embed_dim", "vision_embed_dim", "out_hidden_size", "projector_hidden_size",
    "mm_hidden_size", "encoder_hidden_size", "decoder_hidden_size", "proj_dim", "n_embd_in",
}
_HEAD_KEYS = {
    "num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
    "decoder_attention_heads", "attention_heads", "num_attention_heads_text", "heads",
}
_KV_HEAD_KEYS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv"}
_HEAD_DIM_KEYS = {"head_dim", "kv_channels", "attention_head_dim", "d_kv", "head_size", "d_head"}
_MLA_KEYS = {"qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank"}
_INTERMEDIATE_KEYS = {
    "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size", "d_ff", "intermediate_dim",
    "mlp_dim", "ffn_size", "moe_ffn_hidden_size", "dim_feedforward", "feed_forward_proj_dim",
}
_LAYER_KEYS = (  # the first one present decides which layers are kept; every one present is set to that count
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
    "num_decoder_layers", "num_encoder_layers", "depth", "num_blocks",
)
_POSITION_KEYS = {
    "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
    "max_target_positions", "max_source_positions", "max_seq_length",
}
_EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"}
_TOP_K_KEYS = {"num_experts_per_tok", "moe_topk", "top_k", "moe_k", "num_selected_experts", "experts_per_token",
               "moe_top_k", "num_experts_per_token"}
_SHARED_EXPERT_KEYS = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "num_shared_expert"}
_TOKEN_ID = re.compile(r".*_(token_id|token_index|token_ids)$|^(pad|bos|eos|sep|cls|mask|unk|decoder_start)_token_id$")
_RANDOMNESS = re.compile(r".*(dropout|pdrop|layerdrop|jitter|drop_rate|drop_path).*")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_config_dict(value: Any) -> bool:
    return isinstance(value, dict) and "model_type" in value


class _TokenIds:
    """Maps each token id that does not fit the tiny vocabulary to a distinct id at its top."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.mapping: dict[int, int] = {}

    def __call__(self, token_id: int) -> int:
        if token_id < self.vocab - 32:
            return token_id
        if token_id not in self.mapping:
            self.mapping[token_id] = self.vocab - 1 - len(self.mapping)
        return self.mapping[token_id]


def _per_layer_dicts(d: dict[str, Any], n: int) -> list[str]:
    """Keys of dicts keyed by layer index (``per_layer_config = {"05": {...}}``)."""
    return [k for k, v in d.items() if isinstance(v, dict) and v and k not in ("id2label", "label2id")
            and all(isinstance(x, str) and x.isdigit() and int(x) < n for x in v)]


def _segment_keys(d: dict[str, Any], layer_key: str, n: int) -> list[str]:
    """Integer ``*_layers`` keys that split the layers into consecutive segments (their sum is the count)."""
    keys = [k for k, v in d.items() if k != layer_key and k.endswith("_layers") and _is_int(v) and v > 0
            and k not in _LAYER_KEYS and not k.startswith("num_kv_shared")]
    return keys if len(keys) > 1 and sum(d[k] for k in keys) == n else []


def _is_layer_index_list(key: str, values: list, n: int) -> bool:
    return ("layer" in key or "idx" in key or "indices" in key) and all(_is_int(x) and 0 <= x < n for x in values)


def _layer_selection(d: dict[str, Any]) -> tuple[str, int, list[int]] | None:
    """``(layer-count key, original count, indices of the layers kept)`` of one config dict."""
    key = next((k for k in _LAYER_KEYS if _is_int(d.get(k)) and d[k] > 0), None)
    if key is None:
        return None
    n = d[key]
    signatures: list[tuple] = [() for _ in range(n)]

    def add(values: list) -> None:
        for i in range(n):
            signatures[i] += (repr(values[i]),)

    sources: list[list[int]] = []  # per-layer lists naming another layer (K/V sharing)
    for k, v in d.items():
        if k in ("id2label", "label2id") or not isinstance(v, list) or not v:
            continue
        if len(v) == n and n > 1:
            if _is_layer_index_list(k, v, n):
                sources.append(v)
                add([v[i] == i for i in range(n)])
            else:
                add(v)
        elif _is_layer_index_list(k, v, n):
            add([i in v for i in range(n)])
    for k in _per_layer_dicts(d, n):
        by_index = {int(x): v for x, v in d[k].items()}
        add([by_index.get(i) for i in range(n)])
    for k in ("first_k_dense_replace", "num_dense_layers"):
        if _is_int(d.get(k)):
            add([i < d[k] for i in range(n)])
    if _is_int(d.get("num_kv_shared_layers")) and d["num_kv_shared_layers"] > 0:
        add([i >= n - d["num_kv_shared_layers"] for i in range(n)])
    if _is_int(d.get("decoder_sparse_step")) and d["decoder_sparse_step"] > 1:
        add([(i + 1) % d["decoder_sparse_step"] == 0 for i in range(n)])
    bounds, start = [], 0
    for k in _segment_keys(d, key, n):
        bounds.append((start, start + d[k]))
        start += d[k]
    if bounds:
        add([next(j for j, (a, b) in enumerate(bounds) if a <= i < b) for i in range(n)])
    kept: list[int] = []
    seen: set[tuple] = set()
    for i, signature in enumerate(signatures):
        if signature not in seen:
            seen.add(signature)
            kept.append(i)
    for i in range(n):
        if len(kept) >= min(MIN_LAYERS, n):
            break
        if i not in kept:
            kept.append(i)
    for source in sources:  # a kept layer reading another layer's K/V keeps that layer too
        kept.extend(source[i] for i in list(kept))
    return key, n, sorted(set(kept))


def _shrink_layer_overrides(overrides: Any) -> Any:
    """One layer's entry of a per-layer config (``{"num_attention_heads": 64, ...}``), shrunk like the config."""
    if not isinstance(overrides, dict):
        return overrides
    heads = overrides.get("num_attention_heads")
    return {k: _shrink_int(k, v, heads if _is_int(heads) else None) if _is_int(v) else v for k, v in overrides.items()}


def _shrink_rope(rope: dict[str, Any], new_rotary_half: int) -> dict[str, Any]:
    rope = dict(rope)
    if all(isinstance(v, dict) for v in rope.values()) and rope:  # per layer kind (Gemma 3n, ...)
        return {k: _shrink_rope(v, new_rotary_half) for k, v in rope.items()}
    section = rope.get("mrope_section")
    if isinstance(section, list) and section and all(_is_int(x) for x in section):
        total = sum(section)
        scaled = [max(1, round(x * new_rotary_half / total)) for x in section]
        scaled[int(max(range(len(scaled)), key=lambda i: scaled[i]))] += new_rotary_half - sum(scaled)
        rope["mrope_section"] = scaled
    orig = rope.get("original_max_position_embeddings")
    if _is_int(orig):
        rope["original_max_position_embeddings"] = min(orig, MAX_POSITIONS // 2)
    return rope


def _shrink(d: dict[str, Any], token_ids: _TokenIds, widths: frozenset[int] = frozenset()) -> dict[str, Any]:
    """One config dict shrunk by the generic rules (nested config dicts recursively)."""
    original = d
    d = dict(d)
    selection = _layer_selection(d)
    if selection is not None:
        layer_key, n, kept = selection
        new_index = {old: new for new, old in enumerate(kept)}
        for k, v in list(d.items()):
            if not isinstance(v, list) or not v or k in ("id2label", "label2id"):
                continue
            if len(v) == n and n > 1:
                d[k] = [new_index[v[i]] if _is_layer_index_list(k, v, n) else v[i] for i in kept]
            elif _is_layer_index_list(k, v, n):
                d[k] = [new_index[old] for old in v if old in new_index]
        for k in _per_layer_dicts(d, n):
            width = len(next(iter(d[k])))
            d[k] = {f"{new_index[int(x)]:0{width}d}": _shrink_layer_overrides(v) for x, v in d[k].items()
                    if int(x) in new_index}
        segments, start = _segment_keys(d, layer_key, n), 0
        for k in segments:
            size = d[k]
            d[k] = sum(1 for i in kept if start <= i < start + size)
            start += size
        d[layer_key] = len(kept)
        for k in _LAYER_KEYS:
            if _is_int(d.get(k)) and d[k] > 0:
                d[k] = len(kept)
        for k in ("first_k_dense_replace", "num_dense_layers"):
            if _is_int(d.get(k)):
                d[k] = sum(1 for i in kept if i < d[k])
        if _is_int(d.get("num_kv_shared_layers")) and d["num_kv_shared_layers"] > 0:
            d["num_kv_shared_layers"] = sum(1 for i in kept if i >= n - d["num_kv_shared_layers"])
        step = d.get("decoder_sparse_step")
        if _is_int(step) and step > 1:  # MoE every step-th layer: the same layout as an explicit dense list
            dense = [new for new, old in enumerate(kept) if (old + 1) % step]
            d["mlp_only_layers"] = sorted(set(d.get("mlp_only_layers") or []) | set(dense))
            d["decoder_sparse_step"] = 1
        for k in list(d):
            if k.endswith("_period") and _is_int(d[k]) and d[k] > 2:
                d[k] = 2
                offset = k[: -len("_period")] + "_offset"
                if _is_int(d.get(offset)):
                    d[offset] = d[offset] % 2

    old_head_dim = d.get("head_dim") if _is_int(d.get("head_dim")) else None
    if old_head_dim is None:
        hidden = next((d[k] for k in ("hidden_size", "d_model", "n_embd") if _is_int(d.get(k))), None)
        heads = next((d[k] for k in _HEAD_KEYS if _is_int(d.get(k)) and d[k] > 0), None)
        if hidden and heads:
            old_head_dim = hidden // heads
    old_heads = next((d[k] for k in _HEAD_KEYS if _is_int(d.get(k)) and d[k] > 0), None)

    for k, v in list(d.items()):
        if _is_config_dict(v):
            d[k] = _shrink(v, token_ids, widths)
        elif isinstance(v, list) and v and all(_is_config_dict(x) for x in v):
            d[k] = [_shrink(x, token_ids, widths) for x in v]
        elif _RANDOMNESS.match(k) and isinstance(v, (int, float)) and not isinstance(v, bool):
            d[k] = type(v)(0)
        elif "softcap" in k.replace("_", "") and "attn" not in k and "attention" not in k and isinstance(v, (int, float)) \
                and not isinstance(v, bool) and v > 0:
            d[k] = SOFTCAP
        elif "feature_layer" in k and (_is_int(v) or (isinstance(v, list) and v and all(_is_int(x) for x in v))):
            # vision layers picked as image features (24, [-2, -5, ...]): the vision tower now has
            # MIN_LAYERS layers, so count from its top, distinct where a list needs it
            d[k] = -1 if _is_int(v) else [i - len(v) for i in range(len(v))] if any(x < 0 for x in v) \
                else [max(0, MIN_LAYERS - 1 - i) for i in range(len(v))]
        elif _TOKEN_ID.match(k):
            if _is_int(v):
                d[k] = token_ids(v)
            elif isinstance(v, list) and all(_is_int(x) for x in v):
                d[k] = [token_ids(x) for x in v]
        elif not (_is_int(v) or (isinstance(v, list) and v and all(_is_int(x) for x in v))):
            continue
        elif isinstance(v, list) and len(v) > 1 and _is_int(original.get("hidden_size")) \
                and sum(v) == original["hidden_size"] and "dim" in k:
            # a partition of the hidden width (Reformer's axial position embeddings): same shares
            d[k] = [x * HIDDEN // original["hidden_size"] for x in v[:-1]]
            d[k].append(HIDDEN - sum(d[k]))
        else:
            d[k] = _shrink_int(k, v, old_heads)
            if d[k] == v and _is_int(v) and v in widths and ("dim" in k or "size" in k):
                d[k] = HIDDEN  # a hidden width under another name (adapter_in_dim, ...)

    _keep_state_space_product(d, original)
    _keep_widened_attention(d, original)
    if d.get("head_dim", 0) is None and any(_is_int(d.get(k)) for k in _HEAD_KEYS):
        d["head_dim"] = HEAD_DIM  # the class default derives it from widths the rules above changed
    if "num_key_value_heads" in d and d["num_key_value_heads"] is None and _is_int(d.get("num_attention_heads")):
        d["num_key_value_heads"] = d["num_attention_heads"]  # None means multi-head attention
    if _is_int(d.get("qk_nope_head_dim")) and _is_int(d.get("qk_rope_head_dim")):
        # head_dim of a latent-attention config is the rotary part (DeepSeek) or the whole
        # query/key head (Dots): keep whichever relation the defaults had.
        nope, rope = original["qk_nope_head_dim"], original["qk_rope_head_dim"]
        if _is_int(original.get("head_dim")) and original["head_dim"] in (rope, nope + rope):
            whole = original["head_dim"] == nope + rope and original["head_dim"] != rope
            d["head_dim"] = d["qk_rope_head_dim"] + (d["qk_nope_head_dim"] if whole else 0)
        if "qk_head_dim" in d:
            d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    if d.get("logits_scaling") == 1.0:
        d["logits_scaling"] = LOGITS_SCALING
    if d.get("output_router_logits") is False:
        d["output_router_logits"] = True
    if d.get("use_cache") is True:
        d["use_cache"] = False  # a training step: no KV cache
    if any(_is_int(d.get(k)) for k in _EXPERT_KEYS):
        for k in _TOP_K_KEYS:
            if k in d and d[k] is None:
                d[k] = TOP_K
    if d.get("sliding_window", 0) is None and "sliding_attention" in (d.get("layer_types") or ()):
        d["sliding_window"] = WINDOW
    for k in ("n_groups", "mamba_n_groups", "ngroups", "mamba_ngroups"):
        if _is_int(d.get(k)) and d[k] > 1:
            d[k] = 1  # state-space groups must divide the (now 4) heads
    for k in ("rotary_dim", "rotary_emb_dim"):
        if _is_int(d.get(k)) and old_head_dim and _is_int(d.get("head_dim") or HEAD_DIM):
            d[k] = max(2, d[k] * (d.get("head_dim") or HEAD_DIM) // old_head_dim // 2 * 2)
    for k in ("n_group", "num_expert_group"):
        if _is_int(d.get(k)) and d[k] > 1:
            d[k] = 2
    if _is_int(d.get("topk_group")):
        d["topk_group"] = 1
    new_head_dim = d.get("head_dim") if _is_int(d.get("head_dim")) else HEAD_DIM
    if isinstance(d.get("rope_parameters"), dict) and _declares_mrope(d.get("model_type")):
        rope = d["rope_parameters"]
        if "mrope_section" not in rope and not all(isinstance(v, dict) for v in rope.values()):
            # The modeling code falls back to the released model's sections (sum 64, ...) when
            # the config names none: give the tiny head_dim its own.
            factor = rope.get("partial_rotary_factor", 1.0) or 1.0
            half = max(1, int(new_head_dim * factor) // 2)
            third = (half + 1) // 3
            d["rope_parameters"] = {**rope, "mrope_section": [third, third, half - 2 * third]}
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(key), dict):
            factor = d[key].get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
            d[key] = _shrink_rope(d[key], max(1, int(new_head_dim * factor) // 2))
    return d


def _keep_state_space_product(d: dict[str, Any], original: dict[str, Any]) -> None:
    """State-space heads tile the inner width (``heads * head_dim == expand * hidden``, or
    ``== d_ssm`` where the config names it): keep that with :data:`HEADS` heads."""
    hidden = original.get("hidden_size")
    if not _is_int(hidden):
        return
    heads_key = next((k for k in ("mamba_n_heads", "n_mamba_heads", "mamba_num_heads", "ssm_num_heads", "num_heads")
                      if _is_int(original.get(k))), None)
    dim_key = next((k for k in ("mamba_d_head", "mamba_headdim", "mamba_head_dim", "ssm_head_dim", "head_dim")
                    if _is_int(original.get(k))), None)
    expand = next((original[k] for k in ("mamba_expand", "expand", "ssm_expand") if _is_int(original.get(k))), None)
    if not (heads_key and dim_key and expand):
        return
    tiled = original[heads_key] * original[dim_key]
    width_key = next((k for k in ("mamba_d_ssm", "d_ssm") if original.get(k) == tiled), None)
    if width_key is None and tiled != expand * hidden:
        return
    width = expand * d["hidden_size"]
    if width_key:
        d[width_key] = width
    d[heads_key] = HEADS
    d[dim_key] = width // HEADS


def _keep_widened_attention(d: dict[str, Any], original: dict[str, Any]) -> None:
    """An attention width that is a multiple of ``hidden_size`` (Zamba attends over
    ``[hidden, embeddings]``) keeps the multiple, and its head_dim tiles it."""
    hidden = original.get("hidden_size")
    heads = original.get("num_attention_heads")
    if not (_is_int(hidden) and _is_int(heads)):
        return
    for key in ("attention_hidden_size",):
        if _is_int(original.get(key)) and original[key] % hidden == 0 and original[key] != hidden:
            d[key] = original[key] // hidden * d["hidden_size"]
            for dim_key in ("attention_head_dim", "head_dim"):
                if _is_int(original.get(dim_key)) and original[dim_key] * heads == original[key]:
                    d[dim_key] = d[key] // d["num_attention_heads"]


@functools.cache
def _declares_mrope(model_type: Any) -> bool:
    """Whether ``model_type``'s config class or modeling code uses multimodal rotary sections."""
    import importlib.util

    from transformers import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        return False
    if "mrope_section" in (getattr(cls, "ignore_keys_at_rope_validation", None) or ()):
        return True
    spec = importlib.util.find_spec(cls.__module__.replace(".configuration_", ".modeling_"))
    if spec is None or not spec.origin:
        return False
    with open(spec.origin) as f:
        return '"mrope_section"' in f.read()


def _shrink_int(key: str, value: Any, old_heads: int | None) -> Any:
    """An integer (or list of integers) shrunk by what its key names."""
    if isinstance(value, list):
        return [_shrink_int(key, x, old_heads) for x in value]
    lower = key.lower()
    if key in _HIDDEN_KEYS or lower.endswith("_hidden_size") or lower.endswith("hidden_dim"):
        return min(value, HIDDEN)
    if key in _HEAD_KEYS:
        return min(value, HEADS)
    if key in _KV_HEAD_KEYS:
        if value == 1 or old_heads is None:
            return min(value, KV_HEADS) if old_heads is None else 1
        return HEADS if value >= old_heads else min(value, KV_HEADS)
    if key in _HEAD_DIM_KEYS:
        return min(value, HEAD_DIM)
    if key in _MLA_KEYS:
        return min(value, 2 * HEAD_DIM if "lora" in key else HEAD_DIM)
    if "intermediate_size" in lower or key in _INTERMEDIATE_KEYS:
        small = EXPERT_INTERMEDIATE if ("moe" in lower or "expert" in lower) else INTERMEDIATE
        return min(value, small)
    if "vocab" in lower:
        return min(value, VOCAB)
    if lower.endswith("heads") and "shared" not in lower:  # indexer / linear-attention / other head counts
        return min(value, KV_HEADS)
    if key in ("state_size", "ssm_state_size", "mamba_d_state", "d_state"):
        return min(value, 16)
    if key == "original_max_position_embeddings":
        return min(value, MAX_POSITIONS // 2)
    if key in _POSITION_KEYS:
        return min(value, MAX_POSITIONS)
    if key in ("sliding_window", "attention_chunk_size", "attention_window"):
        return min(value, WINDOW)
    if key in _EXPERT_KEYS:
        return min(value, EXPERTS)
    if key in _TOP_K_KEYS:
        return min(value, TOP_K)
    if key in _SHARED_EXPERT_KEYS:
        return min(value, 1)
    return value


# Per-type fixes where no generic rule works: model_type -> (config-dict overrides, reason).
# Applied to the top-level dict after the generic rules; keys of nested configs as "text_config.key".
OVERRIDES: dict[str, tuple[dict[str, Any], str]] = {
    "dory": ({"layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"],
              "num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2},
             "to_dict stores each layer as an attention and an mlp block with every count doubled"),
    "zamba": ({"num_hidden_layers": 3, "attn_layer_period": 2, "attn_layer_offset": 0,
               "layers_block_type": ["hybrid", "mamba", "hybrid"]},
              "the shared transformer block is tied across hybrid layers: HF's tie check needs two of them"),
    "bamba": ({"attn_layer_indices": [1]}, "the defaults have no attention layer, and the forward needs one"),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
                 "the defaults leave layer_types None, which the model indexes"),
    "dots3_note": ({"text_config.head_dim": 2 * HEAD_DIM},
                   "its sliding-window layers need head_dim = qk_nope_head_dim + qk_rope_head_dim, its other "
                   "layers take head_dim from per_layer_config"),
    "dots3_note_text": ({"head_dim": 2 * HEAD_DIM}, "as dots3_note"),
    "reformer": ({"axial_pos_shape": [4, SEQUENCE // 4], "lsh_attn_chunk_length": WINDOW,
                  "local_attn_chunk_length": WINDOW},
                 "in training its axial position shape must multiply to the sequence length, which the "
                 "attention chunks must divide"),
    "dbrx": ({"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
             "the default attention config has no rope_theta, and its clip_qkv None reaches torch.clamp"),
    "apertus1p5": ({"vision_config.codebook_size": 16, "audio_config.codebook_size": 16,
                    "image_token_offset": VOCAB - 64, "audio_token_offset": VOCAB - 48},
                   "its visual and audio code ranges (offset + codebook size) must fit the vocabulary, one after "
                   "the other, below the special token ids"),
    "cohere_compass_text": ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
                            "the default rope_parameters are empty"),
}


def _set_path(d: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        d = d[part]
    d[last] = value


def _hidden_widths(d: dict[str, Any]) -> set[int]:
    """Every hidden width in the (nested) config, at least 256 wide so a coincidence is unlikely."""
    found = {v for k, v in d.items() if (k in _HIDDEN_KEYS or k.endswith("_hidden_size")) and _is_int(v) and v >= 256}
    for v in d.values():
        if _is_config_dict(v):
            found |= _hidden_widths(v)
    return found


def tiny_config_dict(model_type: str) -> dict[str, Any]:
    """The shrunk config of ``model_type`` as a dict (see the module docstring)."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]().to_dict()
    vocab = min(defaults.get("vocab_size") or VOCAB, VOCAB)
    d = _shrink(defaults, _TokenIds(vocab), frozenset(_hidden_widths(defaults)))
    for path, value in OVERRIDES.get(model_type, ({}, ""))[0].items():
        _set_path(d, path, value)
    for k in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(k, None)
    return d


def tiny_config(model_type: str):
    """A tiny config object of ``model_type`` built from its class defaults by the generic rules."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**tiny_config_dict(model_type))


def reserved_token_ids(config: Any) -> set[int]:
    """Every special token id named anywhere in ``config`` (nested configs included)."""
    found: set[int] = set()

    def walk(d: dict[str, Any]) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif _TOKEN_ID.match(str(k)):
                found.update(x for x in (v if isinstance(v, list) else [v]) if _is_int(x))

    walk(config.to_dict())
    return found


def text_vocab_size(config: Any) -> int:
    """The vocabulary the language-model head predicts over (text config first)."""
    for sub in ("text_config", "decoder", "language_config", "llm_config"):
        inner = getattr(config, sub, None)
        if inner is not None and _is_int(getattr(inner, "vocab_size", None)):
            return inner.vocab_size
    vocab = getattr(config, "vocab_size", None)
    return vocab if _is_int(vocab) else VOCAB


# ------------------------------------------------------------------------------------- models
CAUSAL_LM = "causal-lm"
IMAGE_TEXT = "image-text-to-text"
TASKS = (CAUSAL_LM, IMAGE_TEXT)


def architectures(task: str) -> dict[str, str]:
    """``model_type -> class name`` of every model type the installed transformers lists for ``task``."""
    from transformers.models.auto import modeling_auto

    if task == CAUSAL_LM:
        return dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if task == IMAGE_TEXT:
        return dict(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def as_decoder(config: Any, task: str) -> Any:
    if task == CAUSAL_LM and "is_decoder" in config.to_dict():
        config.is_decoder = True  # encoder families run as decoders under a causal-LM head
    return config


def config_for(model_cls: type, config: Any) -> Any:
    """``config`` itself, or the nested config of the class ``model_cls`` is built from
    (``Llama4ForCausalLM`` takes ``Llama4Config.text_config``)."""
    wanted = getattr(model_cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for value in vars(config).values():
        if isinstance(value, wanted):
            return value
    return config


def build_model(model_cls: type, config: Any, seed: int) -> torch.nn.Module:
    """A ``model_cls`` of ``config`` with seeded random weights: fp32, eager attention, on
    ``DEVICE``, in training mode."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
        except (ValueError, TypeError) as error:
            if "attn_implementation" not in str(error) and "eager" not in str(error):
                raise
            model = model_cls._from_config(config, dtype=torch.float32)
    return model.to(DEVICE).train()


def token_batch(config: Any, batch: int, sequence: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(input_ids, labels)`` of shape ``(batch, sequence)`` on ``DEVICE``, drawn apart from
    the ids that are no special token; the first row has its first 5 targets ignored, the other none.

    The labels are not the inputs: a decoder taking unshifted labels (BART's ``*ForCausalLM``)
    with its head tied to its input embedding would predict its own input, a saturated loss
    whose gradients are round-off."""
    vocab = text_vocab_size(config)
    reserved = reserved_token_ids(config)
    allowed = torch.tensor([t for t in range(3, vocab) if t not in reserved])
    ids = allowed[torch.randint(len(allowed), (batch, sequence), generator=generator)]
    labels = allowed[torch.randint(len(allowed), (batch, sequence), generator=generator)]
    labels[0, :5] = -100
    return ids.to(DEVICE), labels.to(DEVICE)


def tiny_model(model_type: str, task: str = CAUSAL_LM, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(a tiny random model of ``model_type`` for ``task``, a batch of ``input_ids``,
    ``attention_mask`` and ``labels`` for it), both on ``DEVICE``; see :func:`build_model`."""
    import transformers

    model_cls = getattr(transformers, architectures(task)[model_type])
    config = as_decoder(config_for(model_cls, tiny_config(model_type)), task)
    model = build_model(model_cls, config, seed)
    ids, labels = token_batch(config, 2, SEQUENCE, torch.Generator().manual_seed(seed + 1))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
