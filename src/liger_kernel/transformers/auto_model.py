"""``AutoLigerKernelForCausalLM``: ``AutoModelForCausalLM`` that returns a Liger-patched model.

Liger options (the fields of :class:`~liger_kernel.transformers.patching.options.PatchOptions`:
``rope``, ``rms_norm``, ``swiglu``/``geglu``, ``cross_entropy``, ``fused_linear_cross_entropy``,
...) are taken out of the keyword arguments; the rest go to
Hugging Face unchanged. The loaded model is patched in place for its own
``config.model_type`` (no class-level side effect on other models); options the family does
not take are dropped with a warning, an unsupported model type is returned unpatched.
"""

from __future__ import annotations

from typing import Any

from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
from liger_kernel.transformers.patching.options import PatchOptions
from transformers import AutoModelForCausalLM

LIGER_OPTIONS = frozenset(PatchOptions.names())


def _split_liger_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    liger = {name: value for name, value in kwargs.items() if name in LIGER_OPTIONS}
    hf = {name: value for name, value in kwargs.items() if name not in LIGER_OPTIONS}
    return liger, hf


class AutoLigerKernelForCausalLM(AutoModelForCausalLM):
    """``AutoModelForCausalLM.from_pretrained`` / ``from_config`` plus Liger patching of the result."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any):
        liger_options, hf_kwargs = _split_liger_options(kwargs)
        model = super().from_pretrained(pretrained_model_name_or_path, *model_args, **hf_kwargs)
        _apply_liger_kernel_to_instance(model=model, **liger_options)
        return model

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any):
        liger_options, hf_kwargs = _split_liger_options(kwargs)
        model = super().from_config(config, **hf_kwargs)
        _apply_liger_kernel_to_instance(model=model, **liger_options)
        return model
