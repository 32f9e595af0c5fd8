"""What differs between the transformers versions the fused-loss forward supports (5.17 to 5.25+).

Each function answers one question the forward would otherwise answer with a version check:
the decoder's name for the KV cache argument, the output class's name for the cache field, and
how ``logits_to_keep`` selects positions. Lookups that import are made once, when a forward is
built (:func:`liger_kernel.transformers.causal_lm.fused_loss_forward`), never inside a forward:
an import is a graph break under ``torch.compile``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# A plain dict rather than ``functools.cache``: the fused forward reads it under torch.compile,
# where Dynamo warns about (and traces through) a cache wrapper at every compile.
_CACHE_KWARG_NAMES: dict[type, str] = {}


def cache_kwarg_name(base_model_class: type[torch.nn.Module]) -> str:
    """The decoder's name for the KV cache argument: transformers 5.24 renamed
    ``past_key_values`` to ``cache`` (5.17 still uses ``past_key_values``)."""
    name = _CACHE_KWARG_NAMES.get(base_model_class)
    if name is None:
        params = inspect.signature(base_model_class.forward).parameters
        name = _CACHE_KWARG_NAMES[base_model_class] = "cache" if "cache" in params else "past_key_values"
    return name


def output_cache_field(output_class: Any) -> str:
    """The cache field of a model output class (``cache`` from 5.24 on, else ``past_key_values``)."""
    # ``__dataclass_fields__`` rather than ``dataclasses.fields()``: Dynamo cannot trace the
    # latter on a class (a graph break under torch.compile), but reads a class attribute.
    return "cache" if "cache" in output_class.__dataclass_fields__ else "past_key_values"


# ``[transformers.modeling_utils.slice_logits_to_keep or None]`` once looked up. The lookup is
# an import, which Dynamo cannot trace (transformers is a lazy module: a graph break under
# torch.compile), so patching makes it before any forward can run compiled.
_HF_SLICE_LOGITS_TO_KEEP: list = []


def hf_slice_logits_to_keep():
    """``transformers.modeling_utils.slice_logits_to_keep`` (5.25, which also takes 2-D tensors),
    or None (5.17 indexes ``hidden_states`` inline)."""
    if not _HF_SLICE_LOGITS_TO_KEEP:
        from transformers import modeling_utils

        _HF_SLICE_LOGITS_TO_KEEP.append(getattr(modeling_utils, "slice_logits_to_keep", None))
    return _HF_SLICE_LOGITS_TO_KEEP[0]


def positions_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """(B, T, H) -> the hidden states whose logits are wanted, exactly as the installed HF
    ``*ForCausalLM.forward`` selects them.

    Every version takes an int ``k`` (the last ``k`` positions, 0 = all) and a 1-D tensor of
    positions, giving (B, kept, H). Where HF has ``slice_logits_to_keep`` it is used as is,
    which adds a 2-D integer tensor (B, kept) of positions per row, giving (B, kept, H), and
    a 2-D boolean mask (B, T), giving the (num_true, H) selected rows. Older HF documents
    only the int and 1-D forms (its inline ``hidden_states[:, t, :]`` turns a 2-D tensor into
    a cross-batch gather or an ``IndexError``), so a 2-D tensor raises ``ValueError`` there.
    """
    hf_slice = hf_slice_logits_to_keep()
    if hf_slice is not None:
        return hf_slice(hidden_states, logits_to_keep)
    if isinstance(logits_to_keep, int):
        # 0 keeps everything: slice(-0, None) == slice(0, None).
        return hidden_states[:, -logits_to_keep:, :]
    if logits_to_keep.dim() > 1:
        import transformers

        raise ValueError(
            f"logits_to_keep of shape {tuple(logits_to_keep.shape)}: transformers {transformers.__version__} "
            "takes an int or a 1-D tensor of positions (2-D tensors need a version with "
            "transformers.modeling_utils.slice_logits_to_keep)"
        )
    return hidden_states[:, logits_to_keep, :]
