"""nn.Modules, the functional API, model patching and Trainer integration.

The modules and the functional API need only torch and triton; the patching functions
need ``transformers`` (``pip install liger-kernel[transformers]``). Names load lazily so
``import liger_kernel.transformers`` works without ``transformers`` installed.
"""

_EXPORTS = {
    # modules
    "LigerRMSNorm": "rms_norm",
    "LigerLayerNorm": "layer_norm",
    "liger_rotary_pos_emb": "rope",
    "LigerSwiGLUMLP": "swiglu",
    "LigerPhi3SwiGLUMLP": "swiglu",
    "LigerGEGLUMLP": "geglu",
    "LigerCrossEntropyLoss": "cross_entropy",
    "LigerFusedLinearCrossEntropyLoss": "fused_linear_cross_entropy",
    "LigerFusedLinearJSD": "fused_linear_jsd",
    "liger_fused_linear_jsd": "fused_linear_jsd",
    # patching (needs transformers)
    "apply_liger_kernel_to_llama": "monkey_patch",
    "apply_liger_kernel_to_mistral": "monkey_patch",
    "apply_liger_kernel_to_mixtral": "monkey_patch",
    "apply_liger_kernel_to_gemma": "monkey_patch",
    "apply_liger_kernel_to_gemma2": "monkey_patch",
    "apply_liger_kernel_to_qwen2": "monkey_patch",
    "apply_liger_kernel_to_qwen3": "monkey_patch",
    "apply_liger_kernel_to_phi3": "monkey_patch",
    "revert_liger_kernel": "monkey_patch",
    "liger_kernel_patched": "monkey_patch",
    "liger_patched_modules": "monkey_patch",
    "_apply_liger_kernel": "monkey_patch",
    "_apply_liger_kernel_to_instance": "monkey_patch",
    "MODEL_TYPE_TO_APPLY_LIGER_FN": "monkey_patch",
    "AutoLigerKernelForCausalLM": "auto_model",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
