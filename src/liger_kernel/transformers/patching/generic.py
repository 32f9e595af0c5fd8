"""Patching a model the families table does not name, by :mod:`discovery`.

:func:`patch_discovered` walks the model once: every module whose structure makes it a
candidate (norm, gated MLP, fused experts, attention calling ``apply_rotary_pos_emb``) is
probed against its Liger replacement (cached per class and configuration) and, when equal
and its option is on, switched to the Liger method on this instance only
(:func:`~liger_kernel.transformers.patching.binding.bind_method`); the head and loss forward
is replaced by the fused-loss forward when its probe passes. Everything found and left
alone is in the returned :class:`~liger_kernel.transformers.patching.report.PatchReport`.
"""

from __future__ import annotations

import logging

from torch import nn

from liger_kernel.ops.module_attributes import set_attribute
from liger_kernel.transformers.causal_lm import FusedLossSpec, fused_loss_forward, liger_causal_lm_loss
from liger_kernel.transformers.patching import discovery, head_probe
from liger_kernel.transformers.patching.binding import bind_method, with_global_overrides
from liger_kernel.transformers.patching.options import PatchOptions
from liger_kernel.transformers.patching.report import PatchReport
from liger_kernel.transformers.recompute import hook_norm_consumers

logger = logging.getLogger(__name__)

# Module classes, besides nn.Linear, that receive a norm output and save it for backward
# (MoE routers computing F.linear on their own weight): the recompute hooks them too.
_CONSUMER_SUFFIXES = ("Router", "TopKRouter", "Gate")


def _patch_norm(module: nn.Module, plan: discovery.NormPlan, options: PatchOptions) -> None:
    from liger_kernel.transformers.layer_norm import LigerLayerNorm
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    eps = discovery.norm_epsilon(module)
    if getattr(module, "variance_epsilon", None) is None and getattr(module, "eps", None) is None:
        set_attribute(module, "variance_epsilon", eps)
    # Never in place: whether a discovered norm's output gradient is shared (a norm feeding a
    # residual add directly, as the post-norms of Gemma 3 and OLMo 2 do) is not known from
    # the probe, and the ownership check does not see every such sharing on every torch.
    set_attribute(module, "in_place", False)
    liger = LigerLayerNorm if plan.kind == "layer_norm" else LigerRMSNorm
    if plan.kind == "rms_norm":
        set_attribute(module, "offset", plan.offset)
        set_attribute(module, "casting_mode", plan.casting_mode)
    bind_method(module, "forward", liger.forward)
    bind_method(module, "extra_repr", liger.extra_repr)


class _Walk:
    """One pass over a model: candidates probed, patched or recorded as left alone."""

    def __init__(self, model: nn.Module, options: PatchOptions, report: PatchReport) -> None:
        self.model = model
        self.options = options
        self.report = report
        self._left: set[tuple[str, str]] = set()
        self._rope_dims: tuple[int, set[int]] | None = None  # (head dim, rotary widths), once read
        self._rope_dims_read = False

    def leave(self, module: nn.Module, why: str) -> None:
        entry = (type(module).__name__, why)
        if entry not in self._left:
            self._left.add(entry)
            self.report.leave(entry[0], why)

    def norm(self, module: nn.Module) -> None:
        plan = discovery.probe_norm(module)
        if isinstance(plan, str):
            self.leave(module, plan)
        elif getattr(self.options, plan.kind):
            _patch_norm(module, plan, self.options)
            self.report.count(plan.kind, 1)

    def mlp(self, module: nn.Module) -> None:
        plan = discovery.probe_mlp(module)
        if isinstance(plan, str):
            self.leave(module, plan)
        elif self.options.gated(plan.option):
            set_attribute(module, "_liger_activation", plan.activation)
            set_attribute(module, "in_place", self.options.in_place)
            bind_method(module, "forward", discovery.liger_mlp_forward)
            self.report.count(plan.option, 1)

    def experts(self, module: nn.Module) -> None:
        from liger_kernel.transformers.patching.replacements import liger_experts_forward

        why = discovery.probe_experts(module)
        if why is not None:
            self.leave(module, why)
        elif self.options.swiglu:
            bind_method(module, "forward", liger_experts_forward)
            bind_method(module, "_apply_gate", discovery.liger_silu_apply_gate)
            self.report.count("swiglu", 1)

    def rope(self, module: nn.Module, forward, fn) -> None:
        if not self._rope_dims_read:
            self._rope_dims = discovery.rotary_dims(self.model)
            self._rope_dims_read = True
        if self._rope_dims is None:
            self.leave(module, "no rotary embedding module whose cos gives the rotary dims")
            return
        head_dim, rotary_widths = self._rope_dims
        device = discovery.probe_device(module) or next((p.device for p in self.model.parameters()), None)
        plan = discovery.probe_rope(fn, head_dim, rotary_widths, device=device)
        if isinstance(plan, str):
            self.leave(module, plan)
            return
        bind_method(module, "forward", with_global_overrides(forward, {discovery.ROTARY_NAME: plan.replacement}))
        self.report.count("rope", 1)

    def run(self) -> None:
        for module in self.model.modules():
            if module is self.model:
                continue
            # A model discovery does not understand keeps the module as HF's: a patch must never
            # be what breaks a user's training.
            try:
                self.visit(module)
            except Exception as error:
                self.leave(module, f"discovery failed on it: {type(error).__name__}: {error}")

    def visit(self, module: nn.Module) -> None:
        options = self.options
        if (options.rms_norm or options.layer_norm) and discovery.is_norm_candidate(module):
            self.norm(module)
        elif (options.swiglu or options.geglu) and discovery.mlp_layout(module) is not None:
            self.mlp(module)
        elif options.swiglu and discovery.is_experts_candidate(module):
            self.experts(module)
        if options.rope:
            found = discovery.rotary_function(module)
            if found is not None:
                self.rope(module, *found)


def _probed_head(model: nn.Module) -> tuple[nn.Module, FusedLossSpec | str]:
    """(the module whose forward gets the fused loss, its spec or why not): ``model`` itself, or
    the nested language model its forward hands the labels to when ``model``'s own probe fails."""
    try:
        spec = head_probe.probe_head(model)
        nested = head_probe.labelled_language_model(model) if isinstance(spec, str) else None
        if nested is not None:
            nested_spec = head_probe.probe_head(getattr(model, nested))
            if not isinstance(nested_spec, str):
                return getattr(model, nested), nested_spec
            spec = f"{spec}; its language model {nested}: {nested_spec}"
    except Exception as error:  # as for the modules: a failed probe keeps HF's forward
        spec = f"its head probe failed: {type(error).__name__}: {error}"
    return model, spec


def patch_head(model: nn.Module, options: PatchOptions, report: PatchReport) -> None:
    """The fused-loss forward (or the Liger cross-entropy loss function) on ``model``, or on the
    nested language model computing its loss, when its head probe passes; the recompute's
    consumer hooks installed with it."""
    if not (options.fused_linear_cross_entropy or options.cross_entropy):
        return
    cls = head_probe.base_class(model)
    model, spec = _probed_head(model)
    if isinstance(spec, str):
        report.leave(cls.__name__ + " (loss)", spec)
        return
    if options.cross_entropy:
        set_attribute(model, "loss_function", liger_causal_lm_loss)
        report.count("cross_entropy", 1)
        return
    import dataclasses

    spec = dataclasses.replace(spec, recompute_norm_outputs=options.recompute_norm_outputs)
    bind_method(model, "forward", fused_loss_forward(spec))
    report.count("fused_linear_cross_entropy", 1)
    if options.recompute_norm_outputs:
        consumers = tuple({type(m).__name__ for m in model.modules() if type(m).__name__.endswith(_CONSUMER_SUFFIXES)})
        hook_norm_consumers(model, consumers)


def patch_discovered(model: nn.Module, options: PatchOptions) -> PatchReport:
    """Patch ``model`` in place with every kernel discovery proves equal (see the module docstring)."""
    report = PatchReport(getattr(model.config, "model_type", None), options)
    _Walk(model, options, report).run()
    patch_head(model, options, report)
    logger.info("Liger kernels discovered in a %s instance: %s; left alone: %s", report.model_type,
                report.patched, report.left_alone)
    return report
