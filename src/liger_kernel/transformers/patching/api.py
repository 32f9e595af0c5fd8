"""The public patch API: ``apply_liger_kernel_to_<model_type>``, :data:`MODEL_TYPE_TO_APPLY_LIGER_FN`,
:func:`_apply_liger_kernel` (class level, by model type) and :func:`_apply_liger_kernel_to_instance`
(one model, by its own model type; what ``transformers.Trainer(use_liger_kernel=True)`` calls).

Every apply function is generated from the families table and turns its keyword arguments
into one :class:`~liger_kernel.transformers.patching.options.PatchOptions`, passed to the
class-level patch below or to the instance patch
(:func:`liger_kernel.transformers.patching.instance.patch_instance`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from liger_kernel.transformers.causal_lm import fused_loss_forward, liger_causal_lm_loss
from liger_kernel.transformers.families import FAMILIES, GELU_TANH_ACTIVATIONS, SILU_ACTIVATIONS, ModelFamily
from liger_kernel.transformers.patching import class_level
from liger_kernel.transformers.patching.generic import patch_discovered
from liger_kernel.transformers.patching.instance import fused_loss_spec, patch_instance, unwrap_peft
from liger_kernel.transformers.patching.options import GATED_OPTIONS, PatchOptions, check_option_names
from liger_kernel.transformers.patching.replacements import (
    liger_apply_gate,
    liger_experts_forward,
    liger_mlp_class,
    liger_norm_class,
    modeling_module,
)
from liger_kernel.transformers.patching.report import PatchReport
from liger_kernel.transformers.recompute import hook_norm_consumers

logger = logging.getLogger(__name__)


def _hooking_post_init(post_init: Callable, consumer_classes: tuple[str, ...]) -> Callable:
    """``post_init`` (the last step of every HF model's ``__init__``) followed by the
    installation of the norm-output recompute's consumer hooks on the new model."""

    @functools.wraps(post_init)
    def liger_post_init(self, *args: Any, **kwargs: Any) -> Any:
        result = post_init(self, *args, **kwargs)
        hook_norm_consumers(self, consumer_classes)
        return result

    return liger_post_init


def patch_classes(family: ModelFamily, options: PatchOptions) -> None:
    """Class-level patch of ``family``'s modeling module with ``options`` (recorded for revert).

    Models built afterwards use the kernels: the RMSNorm class, the MLP class (fused experts
    keep their class, whose ``forward``/``_apply_gate`` are replaced so that only the
    activation changes: HF's ``_init_weights`` tests ``isinstance`` against that class), the
    module-level rotary function, the ``*ForCausalLM.forward`` (fused linear cross entropy)
    with, for the norm-output recompute, a ``post_init`` that hooks the new model's norm
    consumers, and, with ``cross_entropy``, the class's loss function.
    """
    mt = family.model_type
    modeling = modeling_module(family)
    if options.rope:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        class_level.set_patched(mt, modeling, family.rotary_fn, liger_rotary_pos_emb)
    if options.rms_norm:
        class_level.set_patched(mt, modeling, family.norm.class_name, liger_norm_class(mt, options.in_place))
    gated = options.gated(family.mlp.option)
    if gated and family.mlp.kind == "experts":
        # Patched on the class itself, not by a subclass: HF's _init_weights tests
        # isinstance(module, <ExpertsClass>) against the module-level name.
        experts = getattr(modeling, family.mlp.class_name)
        class_level.set_patched(mt, experts, "forward", liger_experts_forward)
        class_level.set_patched(mt, experts, "_apply_gate", liger_apply_gate)
    elif gated:
        hf_class = class_level.original(mt, modeling, family.mlp.class_name)
        class_level.set_patched(mt, modeling, family.mlp.class_name, liger_mlp_class(mt, hf_class, options.in_place))
    causal_lm = getattr(modeling, family.causal_lm_class)
    if options.fused_linear_cross_entropy:
        class_level.set_patched(mt, causal_lm, "forward", fused_loss_forward(fused_loss_spec(family, options)))
        post_init = class_level.original(mt, causal_lm, "post_init")
        if options.recompute_norm_outputs:
            class_level.set_patched(mt, causal_lm, "post_init",
                                    _hooking_post_init(post_init, family.norm.consumer_classes))
        else:
            class_level.set_patched(mt, causal_lm, "post_init", post_init)
    if options.cross_entropy:
        # PreTrainedModel.loss_function returns self._loss_function when it exists.
        class_level.set_patched(mt, causal_lm, "_loss_function", staticmethod(liger_causal_lm_loss))


_APPLY_PARAMETERS = ("rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", "{gated}", "model",
                     "recompute_norm_outputs", "in_place")


class _ApplyFunction:
    """``apply_liger_kernel_to_<model_type>``: takes the options ``names()`` lists (and ``model``);
    their values become one :class:`PatchOptions`, given to ``on_instance(model, options)`` or,
    without a model, to ``on_classes(options)``.

    A callable object rather than a function so that its signature can be computed on first
    use (``names`` may read the model type's default config, which is not free for all 300
    model types at import). With a single gated-MLP keyword in the signature, its value is
    also the other gated option's: ``swiglu=False`` leaves no gated-MLP kernel.
    """

    def __init__(self, model_type: str, names: Callable[[], tuple[str, ...]],
                 on_classes: Callable[[PatchOptions], None],
                 on_instance: Callable[[nn.Module, PatchOptions], PatchReport]) -> None:
        self.__name__ = self.__qualname__ = f"apply_liger_kernel_to_{model_type.replace('-', '_')}"
        self.__module__ = "liger_kernel.transformers.monkey_patch"
        self._names = names
        self._on_classes = on_classes
        self._on_instance = on_instance

    @functools.cached_property
    def __signature__(self) -> inspect.Signature:
        defaults = PatchOptions()
        parameters = [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              default=None if name == "model" else getattr(defaults, name),
                              annotation="PreTrainedModel | None" if name == "model" else "bool")
            for name in self._names()
        ]
        return inspect.Signature(parameters, return_annotation="PatchReport | None")

    def __call__(self, *args: Any, **kwargs: Any) -> PatchReport | None:
        bound = self.__signature__.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        model = arguments.pop("model")
        gated = [name for name in GATED_OPTIONS if name in arguments]
        if len(gated) == 1:
            arguments.update(dict.fromkeys(GATED_OPTIONS, arguments[gated[0]]))
        options = PatchOptions(**arguments)
        if model is None:
            self._on_classes(options)
            return None
        return self._on_instance(model, options)

    def __repr__(self) -> str:
        return f"<function {self.__module__}.{self.__name__}>"

    def __reduce__(self) -> str:
        # Pickled (and deep-copied) by name, as a module-level function is.
        return self.__name__


def _make_apply_fn(family: ModelFamily) -> Callable[..., PatchReport | None]:
    option = family.mlp.option
    names = tuple(name.format(gated=option) for name in _APPLY_PARAMETERS)
    apply = _ApplyFunction(family.model_type, lambda: names, functools.partial(patch_classes, family),
                           functools.partial(patch_instance, family))
    apply.__doc__ = f"""Patch {family.model_type} models ({family.causal_lm_class}) with Liger kernels.

    Args:
        rope: rotary embedding kernel for ``{family.rotary_fn}``.
        cross_entropy: Liger cross entropy as the model's loss function (logits materialised).
            Mutually exclusive with ``fused_linear_cross_entropy``.
        fused_linear_cross_entropy: fused lm-head + cross-entropy forward (no logits in training).
        rms_norm: Liger RMSNorm for ``{family.norm.class_name}`` (offset {family.norm.offset},
            casting {family.norm.casting_mode!r}).
        {option}: Liger {option} kernel in ``{family.mlp.class_name}``.
        model: an instance to patch in place (returns a :class:`PatchReport`); None patches the
            modeling module (class level, undone by ``revert_liger_kernel({family.model_type!r})``).
        recompute_norm_outputs: with the fused forward, the norm outputs that the projections
            save for backward are recomputed there instead of kept (bitwise the same values;
            2 x tokens x hidden elements less memory per layer). Not entered under autocast
            that casts the residual stream (Trainer ``bf16=True`` over fp32 weights), where the
            projections save casts instead. See :mod:`liger_kernel.transformers.recompute`.
        in_place: let the norm and MLP backwards write gradients over buffers nothing else
            reads (False: always out of place).
    """
    return apply


def _hf_model_classes(model_type: str) -> list[type]:
    """The causal-LM and image-text-to-text classes transformers maps ``model_type`` to."""
    import transformers

    classes = []
    for mapping in _hf_mappings():
        name = mapping.get(model_type)
        for class_name in (name,) if isinstance(name, str) else (name or ()):
            cls = getattr(transformers, class_name, None)
            if cls is not None and cls not in classes:
                classes.append(cls)
    return classes


def _hf_mappings() -> tuple[dict, ...]:
    from transformers.models.auto import modeling_auto

    return (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _discovering_post_init(post_init: Callable, options: PatchOptions) -> Callable:
    """``post_init`` followed by discovery on the new model (when its weights exist: a model
    built on the meta device inside ``from_pretrained`` is patched after loading instead)."""

    @functools.wraps(post_init)
    def liger_post_init(self, *args: Any, **kwargs: Any) -> Any:
        result = post_init(self, *args, **kwargs)
        if not any(p.is_meta for p in self.parameters()):
            patch_discovered(self, options)
        return result

    return liger_post_init


def _discovering_from_pretrained(from_pretrained: Callable, options: PatchOptions) -> classmethod:
    """``from_pretrained`` followed by discovery on the loaded model."""
    function = from_pretrained.__func__

    @functools.wraps(function)
    def liger_from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        model = function(cls, *args, **kwargs)
        patch_discovered(model, options)
        return model

    return classmethod(liger_from_pretrained)


def patch_discovered_classes(model_type: str, options: PatchOptions) -> None:
    """Class-level patch of a model type the table does not name: every model of its classes
    built afterwards (constructed, ``from_config`` or ``from_pretrained``) is patched by
    discovery. Recorded for :func:`revert_liger_kernel`."""
    classes = _hf_model_classes(model_type)
    if not classes:
        raise ValueError(f"transformers lists no causal-LM or image-text-to-text class for model_type {model_type!r}")
    for cls in classes:
        class_level.set_patched(model_type, cls, "post_init",
                                _discovering_post_init(class_level.original(model_type, cls, "post_init"), options))
        class_level.set_patched(model_type, cls, "from_pretrained", _discovering_from_pretrained(
            class_level.original(model_type, cls, "from_pretrained"), options))


_DISCOVERED_PARAMETERS = ("rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", "layer_norm", "{gated}",
                          "model", "recompute_norm_outputs", "in_place")


def default_activation(model_type: str) -> str | None:
    """The MLP activation (``hidden_act``, else ``hidden_activation``) of ``model_type``'s default
    config, or of its text config for a vision-language model; None when it has none or the
    config cannot be built without arguments."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # default configs warn about their own placeholder ids
    try:
        config = CONFIG_MAPPING[model_type]()
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
    except Exception:  # noqa: BLE001 - any failure means: unknown
        return None
    finally:
        hf_logging.set_verbosity(verbosity)
    for attr in ("hidden_act", "hidden_activation"):
        value = getattr(config, attr, None)
        if isinstance(value, str):
            return value
    return None


def gated_options_for(activation: str | None) -> tuple[str, ...]:
    """The gated-MLP keywords of an apply function for a model whose MLP uses ``activation``:
    the one kernel that reproduces it, none when neither does, both when it is unknown."""
    if activation is None:
        return GATED_OPTIONS
    if activation in SILU_ACTIVATIONS:
        return ("swiglu",)
    if activation in GELU_TANH_ACTIVATIONS:
        return ("geglu",)
    return ()


def _discovered_parameters(model_type: str) -> tuple[str, ...]:
    gated = gated_options_for(default_activation(model_type))
    names = []
    for name in _DISCOVERED_PARAMETERS:
        names.extend(gated if name == "{gated}" else (name,))
    return tuple(names)


def _make_discovered_apply_fn(model_type: str) -> Callable[..., PatchReport | None]:
    apply = _ApplyFunction(model_type, functools.partial(_discovered_parameters, model_type),
                           functools.partial(patch_discovered_classes, model_type),
                           lambda model, options: patch_discovered(unwrap_peft(model), options))
    apply.__doc__ = f"""Patch {model_type} models with every Liger kernel discovery proves equal.

    The modules of the model (norms, gated MLPs and experts, the rotary function its attention
    calls, the head and loss) are found by structure and each is checked against its Liger
    replacement on a small probe before it is swapped; what fails stays Hugging Face's and the
    returned :class:`PatchReport` says why (see :mod:`liger_kernel.transformers.patching.discovery`).
    Options are those of :class:`~liger_kernel.transformers.patching.options.PatchOptions`; of the
    gated-MLP keywords only the one whose kernel reproduces the activation of the model type's
    default config is taken (``swiglu`` for SiLU, ``geglu`` for tanh-GELU, neither for another
    activation, both when the config does not say), and it switches every gated-MLP kernel.
    ``model=None`` patches every {model_type} model built afterwards (undone by
    ``revert_liger_kernel({model_type!r})``).
    """
    return apply


def _registry() -> dict[str, Callable[..., Any]]:
    """Every model type transformers lists for causal LM or image-text-to-text, the table's
    families first (their entries win over discovery)."""
    registry: dict[str, Callable[..., Any]] = {mt: _make_apply_fn(family) for mt, family in FAMILIES.items()}
    for mapping in _hf_mappings():
        for model_type in mapping:
            if model_type not in registry:
                registry[model_type] = _make_discovered_apply_fn(model_type)
    return registry


MODEL_TYPE_TO_APPLY_LIGER_FN: dict[str, Callable[..., Any]] = _registry()
_TABLE_APPLY_FNS = {mt: MODEL_TYPE_TO_APPLY_LIGER_FN[mt] for mt in FAMILIES}
# The names users import: ``apply_liger_kernel_to_<model_type>`` ("-" in a model type read as "_").
APPLY_FUNCTIONS = {f"apply_liger_kernel_to_{model_type.replace('-', '_')}": fn
                   for model_type, fn in MODEL_TYPE_TO_APPLY_LIGER_FN.items()}


def _callable_name(fn: Any) -> str:
    """A readable name for any callable (a ``Mock`` or a ``functools.partial`` has no ``__name__``)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else repr(fn)


def _accepted_kwargs(fn: Callable, kwargs: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """``kwargs`` restricted to the options ``fn`` takes; the rest dropped with a warning naming them.

    ``strict``: a keyword that is no patch option at all raises ``TypeError`` (else it is
    dropped like the others). A callable whose signature cannot be read, or that takes
    ``**kwargs``, gets everything.
    """
    if strict:
        check_option_names(kwargs)
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    return _dropping(kwargs, set(parameters), _callable_name(fn))


def _dropping(kwargs: dict[str, Any], accepted: set[str], taker: str) -> dict[str, Any]:
    dropped = sorted(set(kwargs) - accepted)
    if dropped:
        logger.warning("%s does not take %s; ignoring them.", taker, ", ".join(dropped))
    return {name: value for name, value in kwargs.items() if name in accepted}


def _apply_liger_kernel(model_type: str, **kwargs: Any) -> None:
    """Class-level patch of ``model_type`` (``config.model_type``) with the options it accepts.

    Options its apply function does not take (e.g. ``swiglu`` for Gemma) are dropped with a
    warning, a keyword that is no option raises ``TypeError``; an unsupported ``model_type``
    logs a warning and patches nothing.
    """
    kwargs.pop("model", None)
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply_fn is None:
        check_option_names(kwargs)
        logger.warning("No Liger kernels for model_type %r; supported: %s.", model_type,
                       ", ".join(MODEL_TYPE_TO_APPLY_LIGER_FN))
        return
    apply_fn(**_accepted_kwargs(apply_fn, kwargs))


def _apply_liger_kernel_to_instance(model: nn.Module, **kwargs: Any) -> PatchReport | None:
    """Patch ``model`` (a ``PreTrainedModel`` or a PEFT wrapper of one) in place for its own model type.

    Keywords the model type's apply function does not take are dropped with a warning that
    names them, as upstream Liger does (callers such as the HF Trainer and verl pass one set
    of options, e.g. ``swiglu=True``, for every model type). Returns what the apply function
    returns (a :class:`PatchReport` for the generated ones).
    """
    model = unwrap_peft(model)
    kwargs.pop("model", None)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    family = FAMILIES.get(model_type)
    if apply_fn is None or (family is not None and apply_fn is _TABLE_APPLY_FNS.get(model_type)
                            and not _is_family_model(model, family)):
        # A model type transformers does not list, or a table model type whose config builds
        # another family's classes: discovery decides from the modules themselves.
        options = _dropping(kwargs, set(PatchOptions.names()), "the Liger patch")
        return patch_discovered(model, PatchOptions.from_kwargs(**options))
    return apply_fn(model=model, **_accepted_kwargs(apply_fn, kwargs, strict=False))


def _is_family_model(model: nn.Module, family: ModelFamily) -> bool:
    return any(cls.__name__ == family.causal_lm_class for cls in type(model).__mro__)
