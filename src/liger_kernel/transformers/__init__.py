"""nn.Modules, the functional API, model patching and Trainer integration.

The modules and the functional API need only torch and triton; the patching functions
need ``transformers`` (``pip install liger-kernel[transformers]``). Names load lazily so
``import liger_kernel.transformers`` works without ``transformers`` installed (and takes
milliseconds instead of the seconds torch and transformers take).

The ``apply_liger_kernel_to_<model_type>`` functions of the families and the upstream-compatible
names are imported from :mod:`liger_kernel.transformers.patching.apply_functions`, which loads
the patching code on the first call; any other model type's function is resolved from the
registry by name (:mod:`liger_kernel.transformers.monkey_patch`).
"""

from liger_kernel.transformers.patching.apply_functions import *  # noqa: F403 - the written-out apply functions
from liger_kernel.transformers.patching.apply_functions import __all__ as _WRITTEN

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
    "LigerJSD": "jsd",
    "liger_jsd": "jsd",
    "LigerKLDIVLoss": "kl_div",
    "liger_kl_div": "kl_div",
    "LigerTVDLoss": "tvd",
    "liger_tvd": "tvd",
    "triton_grpo_loss": "grpo_loss",
    "LigerFusedLinearJSD": "fused_linear_jsd",
    "liger_fused_linear_jsd": "fused_linear_jsd",
    # patching (needs transformers)
    "revert_liger_kernel": "monkey_patch",
    "liger_kernel_patched": "monkey_patch",
    "liger_patched_modules": "monkey_patch",
    "_apply_liger_kernel": "monkey_patch",
    "_apply_liger_kernel_to_instance": "monkey_patch",
    "MODEL_TYPE_TO_APPLY_LIGER_FN": "monkey_patch",
    "PatchOptions": "monkey_patch",
    "PatchReport": "monkey_patch",
    "AutoLigerKernelForCausalLM": "auto_model",
    # TRL >= 1.13's fused LM head (needs trl only when installed)
    "use_liger_fused_head": "trl_fused_head",
    "LigerChunkedLogProbFunction": "trl_fused_head",
    "LigerChunkedDivergenceFunction": "trl_fused_head",
}

__all__ = [*_EXPORTS, *_WRITTEN]


def __getattr__(name):
    module_name = _EXPORTS.get(name)
    if module_name is None and name.startswith("apply_liger_kernel_to_"):
        module_name = "monkey_patch"  # a model type discovery patches, not written out
    if module_name is not None:
        import importlib

        module = importlib.import_module(f"{__name__}.{module_name}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
