"""Patching one model instance in place, every other instance and the classes left alone.

Every norm, MLP and attention module of the model is switched to a cached per-instance
subclass that defines the Liger method (:mod:`~liger_kernel.transformers.patching.binding`),
and the model gets the fused-loss forward (:func:`~liger_kernel.transformers.causal_lm.fused_loss_forward`)
- also a user subclass of the family's ``*ForCausalLM`` (found through the MRO), unless that
subclass defines its own ``forward``. Rotary embeddings are applied by a module-level
function the attention forward looks up in its globals, so each attention module gets a
copy of its own ``forward`` whose globals map the rotary name to the Liger kernel.
With the norm-output recompute, the consumer hooks it needs are installed here, when patching.
"""

from __future__ import annotations

import logging

from torch import nn

from liger_kernel.ops.module_attributes import child_module, set_attribute
from liger_kernel.transformers.causal_lm import FusedLossSpec, fused_loss_forward, liger_causal_lm_loss
from liger_kernel.transformers.families import ModelFamily
from liger_kernel.transformers.patching.binding import (
    bind_method,
    innermost,
    instance_patched,
    is_instance_class,
    with_global_overrides,
)
from liger_kernel.transformers.patching.options import PatchOptions
from liger_kernel.transformers.patching.replacements import (
    activation_supported,
    liger_apply_gate,
    liger_experts_forward,
    liger_mlp_base,
    modeling_module,
    warn_unsupported_activation,
)
from liger_kernel.transformers.patching.report import PatchReport
from liger_kernel.transformers.recompute import hook_norm_consumers

logger = logging.getLogger(__name__)


def fused_loss_spec(family: ModelFamily, options: PatchOptions) -> FusedLossSpec:
    """The fused-loss forward's spec for ``family`` patched with ``options``."""
    aux = f"{family.modeling_module}:{family.router_aux_loss_fn}" if family.router_aux_loss_fn else None
    return FusedLossSpec(logit_softcap_attr=family.logit_softcap_attr, router_aux_loss_fn=aux,
                         recompute_norm_outputs=options.recompute_norm_outputs)


def unwrap_peft(model: nn.Module) -> nn.Module:
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _patch_norm_instance(module: nn.Module, family: ModelFamily, options: PatchOptions,
                         in_place: bool = True) -> None:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    spec = family.norm
    set_attribute(module, "offset", spec.offset)
    set_attribute(module, "casting_mode", spec.casting_mode)
    set_attribute(module, "in_place", spec.in_place and options.in_place and in_place)
    bind_method(module, "forward", LigerRMSNorm.forward)
    bind_method(module, "extra_repr", LigerRMSNorm.extra_repr)


def _resolve(root: nn.Module, path: str) -> nn.Module | None:
    node: nn.Module | None = root
    for part in path.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def _decoder_layers(base_model: nn.Module) -> list[nn.Module]:
    layers = getattr(base_model, "layers", None)
    return list(layers) if layers is not None else []


def keep_final_norm_gradient(model: nn.Module, family: ModelFamily) -> None:
    """The final norm's output is handed out (the base model's last hidden state), so its
    gradient may be seen by the caller: its backward never writes over it. A decoder layer's
    norm outputs are intermediates nobody else receives."""
    final = _resolve(child_module(model, "base_model"), family.norm.final_attr)
    if final is not None and hasattr(final, "in_place"):
        set_attribute(final, "in_place", False)


def _patch_norms(model: nn.Module, family: ModelFamily, options: PatchOptions) -> int:
    spec = family.norm
    base_model = child_module(model, "base_model")
    final = _resolve(base_model, spec.final_attr)
    norms = [(final, False)]  # see keep_final_norm_gradient
    for layer in _decoder_layers(base_model):
        norms.extend((_resolve(layer, path), True) for path in spec.layer_attrs)
    done: set[int] = set()
    for norm, in_place in norms:
        if norm is not None and type(norm).__name__ == spec.class_name and id(norm) not in done:
            _patch_norm_instance(norm, family, options, in_place)
            done.add(id(norm))
    # The table lists where the norms sit; a norm it misses means the HF layout changed.
    for name, module in model.named_modules():
        if type(module).__name__ == spec.class_name and id(module) not in done:
            logger.warning("%s: norm %r is not listed in the family table; patching it anyway.",
                           family.model_type, name)
            _patch_norm_instance(module, family, options, in_place=False)
            done.add(id(module))
    return len(done)


def _patch_mlps(model: nn.Module, family: ModelFamily, options: PatchOptions, report: PatchReport) -> int:
    spec = family.mlp
    if not activation_supported(model.config, family):
        warn_unsupported_activation(model.config, family)
        report.leave(spec.class_name, f"{spec.activation_attr}={getattr(model.config, spec.activation_attr, None)!r}"
                     f" is not one the {spec.option} kernel reproduces")
        return 0
    patched = 0
    for layer in _decoder_layers(child_module(model, "base_model")):
        block = getattr(layer, spec.layer_attr, None)
        if spec.kind == "experts":
            target = getattr(block, spec.experts_attr, None)
            if target is None or type(target).__name__ != spec.class_name:
                continue
            bind_method(target, "forward", liger_experts_forward)
            bind_method(target, "_apply_gate", liger_apply_gate)
        else:
            if block is None or type(block).__name__ != spec.class_name:
                continue
            block.in_place = options.in_place
            bind_method(block, "forward", liger_mlp_base(family).forward)
        patched += 1
    return patched


def _patch_rope_instances(model: nn.Module, family: ModelFamily) -> int:
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    modeling = modeling_module(family)
    overrides = {family.rotary_fn: liger_rotary_pos_emb}
    patched = 0
    for module in model.modules():
        forward = type(module).forward
        inner = innermost(forward)
        uses_rotary = (
            getattr(inner, "__globals__", None) is vars(modeling)
            and family.rotary_fn in getattr(getattr(inner, "__code__", None), "co_names", ())
        )
        if uses_rotary:
            bind_method(module, "forward", with_global_overrides(forward, overrides))
            patched += 1
    return patched


def _causal_lm_in_mro(model: nn.Module, class_name: str) -> tuple[type | None, type | None]:
    """``(the *ForCausalLM class named class_name, a subclass below it that defines forward)``
    in ``type(model)``'s MRO, each None when absent.

    Matched by name, like every HF class here, and through the MRO so that a user subclass
    (``class MyLlama(LlamaForCausalLM): ...``) is patched too. A subclass with its own
    ``forward`` keeps it: binding the fused-loss forward would silently drop that code.
    """
    mro = type(model).__mro__
    for index, cls in enumerate(mro):
        if cls.__name__ == class_name and not is_instance_class(cls):
            below = [c for c in mro[:index] if "forward" in vars(c) and not is_instance_class(c)]
            return cls, (below[0] if below else None)
    return None, None


def patch_instance(family: ModelFamily, model: nn.Module, options: PatchOptions) -> PatchReport:
    """Patch ``model`` (a ``family`` model, or a PEFT wrapper of one) in place with ``options``."""
    model = unwrap_peft(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type != family.model_type:
        raise ValueError(
            f"apply_liger_kernel_to_{family.model_type} got a model of model_type {model_type!r}; "
            "use _apply_liger_kernel_to_instance to dispatch on the model's own type"
        )
    report = PatchReport(model_type, options)
    if options.rms_norm:
        report.count("rms_norm", _patch_norms(model, family, options))
    if options.gated(family.mlp.option):
        report.count(family.mlp.option, _patch_mlps(model, family, options, report))
    if options.rope:
        report.count("rope", _patch_rope_instances(model, family))
    causal_lm, overriding = _causal_lm_in_mro(model, family.causal_lm_class)
    if causal_lm is None:
        report.leave("loss", f"not a {family.causal_lm_class}")
    elif options.fused_linear_cross_entropy and overriding is not None:
        logger.warning("%s defines its own forward, which the Liger fused-loss forward would replace; "
                       "keeping it (the loss is not fused).", overriding.__qualname__)
        report.leave("loss", f"{overriding.__qualname__} defines its own forward")
    elif options.fused_linear_cross_entropy:
        bind_method(model, "forward", fused_loss_forward(fused_loss_spec(family, options)))
        report.count("fused_linear_cross_entropy", 1)
        if options.recompute_norm_outputs:
            hook_norm_consumers(model, family.norm.consumer_classes)
    if options.cross_entropy and causal_lm is not None:
        set_attribute(model, "loss_function", liger_causal_lm_loss)
        report.count("cross_entropy", 1)
    logger.info("Liger kernels applied to a %s instance: %s", family.model_type, report.patched)
    return report


def liger_patched_modules(model: nn.Module) -> list[str]:
    """Names of ``model``'s submodules (``""`` for the model itself) whose ``forward`` is Liger
    code: patched on the instance, built from a Liger class, or of a class whose ``forward`` a
    class-level patch replaced. (A class-level RoPE patch swaps the modeling module's rotary
    function, not a forward: attention modules are listed only when patched on the instance.)"""
    from liger_kernel.transformers.causal_lm import is_fused_loss_forward

    def class_level(module: nn.Module) -> bool:
        forward = getattr(type(module), "forward", None)
        return forward is liger_experts_forward or is_fused_loss_forward(forward)

    return [name for name, module in model.named_modules()
            if instance_patched(module) or type(module).__name__.startswith("Liger") or class_level(module)]
