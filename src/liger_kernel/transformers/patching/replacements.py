"""The Liger modules and methods that replace a family's HF ones, built from the families table.

* :func:`liger_norm_class`: a :class:`~liger_kernel.transformers.rms_norm.LigerRMSNorm`
  subclass constructed like the family's RMSNorm (``cls(hidden_size, eps)``);
* :func:`liger_mlp_class`: a subclass of the Liger gated MLP constructed like the family's MLP
  (``cls(config)``), which falls back to the HF class for an activation the kernel does not
  reproduce;
* :func:`liger_experts_forward` / :func:`liger_apply_gate`: the fused-experts forward of HF's
  ``use_experts_implementation`` with the Liger gated activation.

The classes exist only once a patch built them; pickle (and ``torch.save``) finds them by
module and qualified name, so this module's ``__getattr__`` builds them on demand: the same
(cached) class in this process, a fresh one in a process that has patched nothing yet.
"""

from __future__ import annotations

import functools
import importlib
import logging
import types
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from liger_kernel.transformers.families import FAMILIES, ModelFamily
from liger_kernel.transformers.patching import class_level

logger = logging.getLogger(__name__)

# Suffix of the classes built for ``in_place=False`` (the default builds keep the plain name).
_OUT_OF_PLACE = "OutOfPlace"


def modeling_module(family: ModelFamily) -> types.ModuleType:
    return importlib.import_module(family.modeling_module)


def activation_supported(config: Any, family: ModelFamily) -> bool:
    """Whether ``config``'s MLP activation is one the family's Liger gated kernel reproduces."""
    return getattr(config, family.mlp.activation_attr, None) in family.mlp.activations


def warn_unsupported_activation(config: Any, family: ModelFamily) -> None:
    spec = family.mlp
    logger.warning(
        "%s: %s=%r is not one of %s, which the Liger %s kernel reproduces; keeping the HF MLP.",
        family.model_type, spec.activation_attr, getattr(config, spec.activation_attr, None),
        spec.activations, spec.option,
    )


def _class_name(base_name: str, in_place: bool) -> str:
    return f"Liger{base_name}" + ("" if in_place else _OUT_OF_PLACE)


@functools.cache
def liger_norm_class(model_type: str, in_place: bool = True) -> type:
    """A :class:`LigerRMSNorm` subclass built like the family's norm: ``cls(hidden_size, eps)``.

    Its name keeps ``RMSNorm`` in it, which is how HF's ``_init_weights`` recognises norms.
    ``in_place=False`` forbids the in-place backward even where the family allows it.
    """
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    spec = FAMILIES[model_type].norm

    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs: Any) -> None:
        LigerRMSNorm.__init__(
            self, hidden_size, eps=eps, offset=spec.offset, casting_mode=spec.casting_mode,
            init_fn=spec.init_fn, in_place=spec.in_place and in_place, **kwargs,
        )

    name = _class_name(spec.class_name, in_place)
    return type(name, (LigerRMSNorm,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})


def liger_mlp_base(family: ModelFamily) -> type[nn.Module]:
    """The Liger gated-MLP module (``LigerSwiGLUMLP``, ...) the table names for ``family``."""
    spec = family.mlp
    module = importlib.import_module(f"liger_kernel.transformers.{spec.liger_module}")
    return getattr(module, spec.liger_class)


@functools.cache
def liger_mlp_class(model_type: str, hf_class: type, in_place: bool = True) -> type:
    """The class replacing the family's MLP class in its modeling module.

    Built from ``config`` like the HF class. For a config whose activation the kernel does not
    reproduce, construction returns the HF class instead (``__new__``), so patching never
    changes the math of such a model.
    """
    family = FAMILIES[model_type]
    base = liger_mlp_base(family)

    def __new__(cls, config: Any = None, *args: Any, **kwargs: Any):
        # copy.deepcopy / pickle call cls.__new__(cls) without arguments.
        if config is not None and not activation_supported(config, family):
            warn_unsupported_activation(config, family)
            return hf_class(config, *args, **kwargs)
        return nn.Module.__new__(cls)

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, config, in_place=in_place)

    name = _class_name(family.mlp.class_name, in_place)
    namespace = {"__new__": __new__, "__init__": __init__, "__module__": __name__, "__qualname__": name}
    return type(name, (base,), namespace)


class FusedExperts(Protocol):
    """What the fused-experts methods below read off HF's experts module (``MixtralExperts``, ...)."""

    config: Any
    num_experts: int
    gate_up_proj: torch.Tensor  # (E, 2I, H), gate first
    down_proj: torch.Tensor  # (E, H, I)
    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor: ...


def liger_apply_gate(self: FusedExperts, gate_up_out: Any, check_activation: bool = True) -> Any:
    """``act(gate) * up`` of a fused (..., 2I) gate-up projection (gate first).

    Replaces HF's ``_apply_gate`` of fused-expert modules (``use_experts_implementation``):
    with a SiLU activation the product runs as the Liger SiLU-mul kernel, any other
    activation keeps HF's formula (the class-level patch cannot see the config beforehand).
    ``check_activation=False``: the activation is known to be SiLU (a discovery probe
    checked it), the kernel always runs.
    """
    gate, up = gate_up_out.chunk(2, dim=-1)
    if check_activation:
        family = FAMILIES.get(getattr(self.config, "model_type", ""))
        if family is None or not activation_supported(self.config, family):
            return self.act_fn(gate) * up
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(gate, up)


def _eager_experts_forward(self: FusedExperts, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """HF's eager fused-experts loop (:func:`liger_kernel.ops.swiglu.eager_experts_forward`), with
    the gate applied through ``self._apply_gate``."""
    from liger_kernel.ops.swiglu import eager_experts_forward

    return eager_experts_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                 self.num_experts, self._apply_gate)


def liger_experts_forward(self: FusedExperts, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """Fused-experts forward dispatching like HF's ``use_experts_implementation``.

    ``config._experts_implementation`` picks HF's grouped/batched matmul kernels (which call
    ``self._apply_gate``, here the Liger activation) or, for ``"eager"``, the loop above.
    """
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    implementation = getattr(self.config, "_experts_implementation", None)
    # get_interface handles None (a standalone experts module) though transformers annotates str.
    forward = ALL_EXPERTS_FUNCTIONS.get_interface(implementation, _eager_experts_forward)  # type: ignore[arg-type]
    return forward(self, hidden_states, top_k_index, top_k_weights)


def _build_liger_mlp_class(model_type: str, in_place: bool) -> type:
    family = FAMILIES[model_type]
    hf_class = class_level.original(model_type, modeling_module(family), family.mlp.class_name)
    return liger_mlp_class(model_type, hf_class, in_place)


def _liger_class_builders() -> dict[str, Callable[[], type]]:
    builders: dict[str, Callable[[], type]] = {}

    def add(name: str, build: Callable[[], type]) -> None:
        if name in builders:
            raise ValueError(f"two families' Liger classes would both be named {name!r}")
        builders[name] = build

    for model_type, family in FAMILIES.items():
        for in_place in (True, False):
            add(_class_name(family.norm.class_name, in_place), functools.partial(liger_norm_class, model_type, in_place))
            if family.mlp.kind != "experts":
                add(_class_name(family.mlp.class_name, in_place),
                    functools.partial(_build_liger_mlp_class, model_type, in_place))
    return builders


# Qualified name -> builder of each class above (see the module docstring).
LIGER_CLASS_BUILDERS = _liger_class_builders()


def __getattr__(name: str) -> type:
    build = LIGER_CLASS_BUILDERS.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return build()
