"""GeGLU MLP: a drop-in for Hugging Face ``GemmaMLP`` / ``Gemma2MLP``.

``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`` with the gating in one Triton kernel
(:class:`liger_kernel.ops.geglu.LigerGELUMulFunction`). ``gelu_tanh`` is torch's
``F.gelu(x, approximate="tanh")``, i.e. HF's ``gelu_pytorch_tanh``.

Accepted activations (``config.hidden_activation`` when the config has it - Gemma 2 - else
``config.hidden_act``): "gelu_pytorch_tanh", "gelu_python_tanh" and "gelu_new", which are
all ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``. Plain "gelu" is HF's exact erf
GELU and is rejected; Gemma's own config already rewrites a legacy ``hidden_act="gelu"`` to
"gelu_pytorch_tanh" when it is built (transformers 5.x ``GemmaConfig.__post_init__``), so
real Gemma checkpoints arrive here with the tanh name. Needs only torch and triton.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from liger_kernel.ops.geglu import LigerGELUMulFunction
from liger_kernel.ops.swiglu import GELU_TANH
from liger_kernel.transformers.families import GELU_TANH_ACTIVATIONS
from liger_kernel.transformers.swiglu import gated_down_projection, gated_in_place, set_mlp_sizes


def liger_geglu(a: torch.Tensor, b: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``gelu_tanh(a) * b`` for ``a``, ``b`` of one shape (..., I) and dtype.

    ``in_place=True`` (the caller's promise that nothing else reads them afterwards) lets the
    backward overwrite ``a`` and ``b`` with their gradients where their layout allows (see
    :mod:`liger_kernel.ops.swiglu`).
    """
    return LigerGELUMulFunction.apply(a, b, in_place)


def config_activation(config: Any) -> tuple[str, Any]:
    """``(attribute, value)`` of the config's MLP activation: ``hidden_activation`` if set, else ``hidden_act``."""
    if getattr(config, "hidden_activation", None) is not None:
        return "hidden_activation", config.hidden_activation
    return "hidden_act", getattr(config, "hidden_act", None)


class LigerGEGLUMLP(nn.Module):
    """``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``, a drop-in for HF's ``GemmaMLP``.

    Args:
        config: any config with ``hidden_size``, ``intermediate_size`` and a tanh-GELU
            activation (see the module docstring); other activations raise ``ValueError``.
        in_place: let the backward write the gate/up gradients over the gate/up activations
            (at calls where no hook can see them, :func:`~liger_kernel.transformers.swiglu.gated_in_place`).

    Attributes match ``GemmaMLP``: ``config``, ``hidden_size``, ``intermediate_size`` and the
    bias-free ``gate_proj``, ``up_proj``, ``down_proj``.
    """

    # Set from the config by set_mlp_sizes, as HF's MLPs keep them.
    hidden_size: int
    intermediate_size: int

    def __init__(self, config: Any, in_place: bool = True) -> None:
        super().__init__()
        attr, activation = config_activation(config)
        if activation not in GELU_TANH_ACTIVATIONS:
            raise ValueError(
                f"{type(self).__name__} computes gelu_tanh(gate) * up; config.{attr}={activation!r} is not one of "
                f"{GELU_TANH_ACTIVATIONS} (plain 'gelu' is the exact erf GELU)"
            )
        set_mlp_sizes(self, config)
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Attributes are read off ``self`` only, so this forward can be bound onto an HF MLP.
        return gated_down_projection(self.down_proj, self.gate_proj(x), self.up_proj(x), GELU_TANH,
                                     gated_in_place(self))
