"""Functional API: thin, argument-checked entry points to every kernel.

Each function mirrors its PyTorch/HF counterpart; validation happens in the op so the
autograd Functions are equally safe to call directly.
"""

from liger_kernel.ops.loss_options import CrossEntropyOutput
from liger_kernel.transformers.cross_entropy import liger_cross_entropy
from liger_kernel.transformers.fused_linear_cross_entropy import liger_fused_linear_cross_entropy
from liger_kernel.transformers.fused_linear_jsd import liger_fused_linear_jsd
from liger_kernel.transformers.geglu import liger_geglu
from liger_kernel.transformers.jsd import liger_jsd
from liger_kernel.transformers.kl_div import liger_kl_div
from liger_kernel.transformers.layer_norm import liger_layer_norm
from liger_kernel.transformers.rms_norm import liger_rms_norm
from liger_kernel.transformers.rope import liger_rope, liger_rotary_pos_emb, liger_rotary_pos_emb_single
from liger_kernel.transformers.swiglu import liger_swiglu
from liger_kernel.transformers.tvd import liger_tvd

__all__ = [
    "CrossEntropyOutput",
    "liger_cross_entropy",
    "liger_fused_linear_cross_entropy",
    "liger_fused_linear_jsd",
    "liger_geglu",
    "liger_jsd",
    "liger_kl_div",
    "liger_layer_norm",
    "liger_rms_norm",
    "liger_rope",
    "liger_rotary_pos_emb",
    "liger_rotary_pos_emb_single",
    "liger_swiglu",
    "liger_tvd",
]
