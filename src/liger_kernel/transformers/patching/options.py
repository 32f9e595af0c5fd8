"""``PatchOptions``: the one owner of the options every patch entry point takes.

``apply_liger_kernel_to_<model_type>(...)``, ``_apply_liger_kernel(...)``,
``_apply_liger_kernel_to_instance(...)`` and ``AutoLigerKernelForCausalLM`` turn their
keyword arguments into one frozen :class:`PatchOptions` (:meth:`PatchOptions.from_kwargs`),
which is then passed to whatever needs it: the norm and MLP replacements (which kernels,
``in_place``), the rotary patch, the fused-loss forward and the norm-output recompute (whose
hooks are installed when patching). Nothing reads an option back from a model or a class.

This module imports neither ``torch`` nor ``transformers``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# The keyword of each gated-MLP kernel, by the activation it computes.
GATED_OPTIONS = ("swiglu", "geglu")


@dataclass(frozen=True)
class PatchOptions:
    """Which Liger kernels a patch installs and how.

    Attributes:
        rope: the rotary-embedding kernel in the attention's ``apply_rotary_pos_emb``.
        cross_entropy: the Liger cross entropy as the model's ``loss_function`` (logits are
            materialised). Exclusive with ``fused_linear_cross_entropy``.
        fused_linear_cross_entropy: the fused lm-head + cross-entropy forward (no logits in
            training, :mod:`liger_kernel.transformers.causal_lm`).
        rms_norm: the RMSNorm kernel for the model's RMSNorm modules.
        layer_norm: the LayerNorm kernel for the model's LayerNorm modules.
        swiglu: the SiLU-gated MLP kernel (``silu(gate) * up``).
        geglu: the tanh-GELU-gated MLP kernel (``gelu_tanh(gate) * up``).
        recompute_norm_outputs: with the fused forward, the norm outputs the projections save
            for backward are recomputed there instead of kept
            (:mod:`liger_kernel.transformers.recompute`).
        in_place: the promise that nothing outside the patched layers reads the gradient of a
            decoder-layer norm's output nor the gated MLP's gate/up activations, so their
            backwards write over them (a family's table entry can still forbid it for its
            norms; the final norm and any module a hook can see at a call never write). See
            ``docs/api.md``, "Memory ownership".
    """

    rope: bool = True
    cross_entropy: bool = False
    fused_linear_cross_entropy: bool = True
    rms_norm: bool = True
    layer_norm: bool = True
    swiglu: bool = True
    geglu: bool = True
    recompute_norm_outputs: bool = True
    in_place: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (bool, int)) or isinstance(value, float):
                raise TypeError(f"Liger patch option {field.name!r} takes a bool, got {value!r}")
            object.__setattr__(self, field.name, bool(value))
        if self.cross_entropy and self.fused_linear_cross_entropy:
            raise ValueError(
                "cross_entropy and fused_linear_cross_entropy cannot both be True: the fused forward "
                "computes the loss without logits, the cross-entropy loss function from logits."
            )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's keyword, in declaration order."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> PatchOptions:
        """The options named in ``kwargs``, defaults for the rest.

        Raises ``TypeError`` naming any keyword that is not an option (a typo must not
        silently patch with defaults) and ``ValueError`` for conflicting options.
        """
        check_option_names(kwargs)
        return cls(**kwargs)

    def gated(self, option: str) -> bool:
        """Whether the gated-MLP kernel named ``option`` ("swiglu" or "geglu") is on."""
        if option not in GATED_OPTIONS:
            raise ValueError(f"gated-MLP option must be one of {GATED_OPTIONS}, got {option!r}")
        return getattr(self, option)


def check_option_names(kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` when ``kwargs`` holds a keyword that no patch takes."""
    unknown = sorted(set(kwargs) - set(PatchOptions.names()))
    if unknown:
        raise TypeError(
            f"unknown Liger patch option(s) {', '.join(map(repr, unknown))}; "
            f"the options are {', '.join(PatchOptions.names())}"
        )
