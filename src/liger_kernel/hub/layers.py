"""Stateless layers of the Hub-kernel build, for ``kernels.kernelize`` and transformers' ``KernelConfig``.

``kernels`` binds a layer's ``forward`` onto the module it replaces, so every layer here reads
its state (``weight``, the epsilon, the projections) off that module and keeps none of its own:
no ``__init__``, no members besides ``has_backward`` and ``can_torch_compile`` (False: no
compile test covers them). The kernels are the ones :func:`liger_kernel.transformers.
_apply_liger_kernel_to_instance` installs, with the same numerics:

========================  ================================================  ==========================
layer                     replaces                                          kernel (liger_kernel.ops)
========================  ================================================  ==========================
``LigerRMSNorm``          hub name ``RMSNorm`` (``forward(hidden_states)``)  ``LigerRMSNormFunction``
``LigerRotaryPosEmb``     hub name ``rotary_pos_emb``                       ``LigerRopeFunction``
                          (``forward(q, k, cos, sin, unsqueeze_dim=1)``)
``LigerSwiGLUMLP``        ``LigerSwiGLUMLPLayout`` (``{Kernel}Layout``),      ``LigerGatedDownProjFunction``
                          e.g. for ``LlamaMLP`` / ``Qwen3MLP``              (SiLU)
``LigerFusedSwiGLUMLP``   ``LigerFusedSwiGLUMLPLayout``, e.g. for           the same (one fused
                          ``Phi3MLP`` (``gate_up_proj``, gate first)         ``gate_up_proj``)
``LigerGEGLUMLP``         ``LigerGEGLUMLPLayout``, e.g. for ``Gemma3MLP``     the same, tanh-GELU
``LigerGemmaRMSNorm``     ``LigerGemmaRMSNormLayout``, e.g. for             ``LigerRMSNormFunction``
                          ``Gemma3RMSNorm`` (``(1 + w) * x_hat`` in fp32)    (offset 1, "gemma")
``LigerSwiGLUExperts``    ``LigerSwiGLUExpertsLayout``, e.g. for            ``LigerSiLUMulFunction``
                          ``MixtralExperts`` / ``Qwen3MoeExperts`` (3-D
                          ``gate_up_proj``/``down_proj``, SiLU)
========================  ================================================  ==========================

The hub names cover classes of many models (133 ``RMSNorm`` classes, 118 rotary functions in
transformers 5.25), whose math is not all the same. As the patching does, each of these two
layers proves itself equal to the module it replaces before use: on the first call for a
class (and dtype, device and widths), it runs the module's own forward and the kernel on a
small random probe (random weight and input for a norm; random q, k and tables in [-1, 1] for
the rotary function, in every layout the kernel computes) and compares them with the
patching's probe tolerances. A class that matches none keeps its own forward (logged once).
The ``{Kernel}Layout`` classes are the modules themselves (transformers swaps the named HF class
for the layout), so their kernels need no probe.

Backward: the norms never write ``dx`` over the incoming gradient (``in_place=False``): a layer
here cannot see whether the norm output feeds a residual add directly, where that gradient is
shared. The gated MLPs let the backward write the gate/up gradients over the gate/up
activations, outputs of their own projections that they hand to nobody, at calls where no hook
can see those (:func:`liger_kernel.ops.grad_ownership.hooks_may_see`), as the patching does.

On a CPU the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from liger_kernel.ops.geglu import LigerGELUMulFunction
from liger_kernel.ops.grad_ownership import hooks_may_see
from liger_kernel.ops.module_attributes import child_module, tensor_attribute
from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from liger_kernel.ops.rope import TABLES, LigerRopeFunction, RopeLayout
from liger_kernel.ops.swiglu import (
    GELU_TANH,
    SILU,
    LigerGatedDownProjFunction,
    LigerSiLUMulFunction,
    eager_experts_forward,
)

logger = logging.getLogger(__name__)

# The interface version of the layers (the Hub branch ``v<LAYERS_VERSION>``): bump it with
# any change to ``__all__`` or to a layer's signature.
LAYERS_VERSION = 1

__all__ = [
    "LigerRMSNorm",
    "LigerRotaryPosEmb",
    "LigerSwiGLUMLP",
    "LigerSwiGLUMLPLayout",
    "LigerFusedSwiGLUMLP",
    "LigerFusedSwiGLUMLPLayout",
    "LigerGEGLUMLP",
    "LigerGEGLUMLPLayout",
    "LigerGemmaRMSNorm",
    "LigerGemmaRMSNormLayout",
    "LigerSwiGLUExperts",
    "LigerSwiGLUExpertsLayout",
]

# The patching's probe tolerances (liger_kernel.transformers.patching.discovery), repeated here
# because a kernel build may import nothing outside torch and the ops it bundles; a test keeps
# the two equal. Relative error max |liger - hf| / max |hf|: rounding passes, another formula
# is off by O(1).
PROBE_RTOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 5e-3}

# The activation names whose math the gated kernels compute (liger_kernel.transformers.families).
SILU_ACTIVATIONS = ("silu", "swish")
GELU_TANH_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new")

# Probe results per key (see _rms_norm_plan / _rope_layout); None: keep the module's forward.
_NORM_PLANS: dict[tuple, _NormPlan | None] = {}
_ROPE_PLANS: dict[tuple, RopeLayout | None] = {}


def _close_enough(result: torch.Tensor, reference: torch.Tensor) -> bool:
    if not isinstance(reference, torch.Tensor) or result.shape != reference.shape or result.dtype != reference.dtype:
        return False
    rtol = PROBE_RTOL.get(reference.dtype, 2e-5)
    scale = reference.detach().abs().max().clamp_min(1e-6)
    return float((result.detach().double() - reference.detach().double()).abs().max() / scale) <= rtol


# ------------------------------------------------------------------------------------------
# RMSNorm
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _NormPlan:
    offset: float
    casting_mode: str


# Llama (w * round(x_hat)), Gemma ((1 + w) * x_hat in fp32), and w * x_hat in fp32.
_NORM_CANDIDATES = (_NormPlan(0.0, "llama"), _NormPlan(1.0, "gemma"), _NormPlan(0.0, "gemma"))


def norm_epsilon(module: nn.Module) -> float | None:
    """The epsilon of an HF norm: ``variance_epsilon`` (Llama style) or ``eps`` (Gemma style)."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, (float, int)) and not isinstance(value, bool):
            return float(value)
    return None


def _rms_norm_plan(module: nn.Module, x: torch.Tensor) -> _NormPlan | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or norm_epsilon(module) is None:
        return None
    key = (type(module), x.dtype, weight.dtype, x.device.type, weight.shape[0])
    if key not in _NORM_PLANS:
        _NORM_PLANS[key] = _probe_rms_norm(module, weight, x)
        if _NORM_PLANS[key] is None:
            logger.warning("%s: no Liger RMSNorm mode equals its forward on a probe; keeping its own forward.",
                           type(module).__name__)
    return _NORM_PLANS[key]


def _probe_rms_norm(module: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> _NormPlan | None:
    if weight.is_meta or x.is_meta:
        return None
    generator = torch.Generator().manual_seed(0)
    width = weight.shape[0]
    probe_x = torch.randn(3, width, generator=generator).to(device=x.device, dtype=x.dtype)
    # A weight far from all ones and all zeros, so that the offset and the casting show.
    probe_w = (1 + 0.5 * torch.randn(width, generator=generator)).to(device=weight.device, dtype=weight.dtype)
    if "weight" not in module._parameters:
        return None
    # A shallow copy with its own parameter dict: the module's forward runs on the probe weight.
    clone = copy.copy(module)
    clone._parameters = {**module._parameters, "weight": nn.Parameter(probe_w, requires_grad=False)}
    eps = norm_epsilon(module)
    with torch.no_grad():
        try:
            reference = type(module).forward(clone, probe_x)
        except Exception:  # a forward that needs more than one tensor is not a plain norm
            return None
        for plan in _NORM_CANDIDATES:
            result = LigerRMSNormFunction.apply(probe_x, probe_w, eps, plan.offset, plan.casting_mode, False)
            if _close_enough(result, reference):
                return plan
    return None


class LigerRMSNorm(nn.Module):
    """For the hub name ``RMSNorm``: ``y = x / sqrt(mean(x^2) + eps) * w`` over the last dim.

    ``hidden_states`` (..., H); reads ``weight`` (H,) and ``variance_epsilon`` (or ``eps``) off
    the replaced module. Llama casting (normalise in fp32, round, times ``w``) unless the class
    computes Gemma's ``(1 + w)`` or ``w * x_hat`` in fp32, which the probe tells apart.
    """

    has_backward = True
    can_torch_compile = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        plan = _rms_norm_plan(self, hidden_states)
        if plan is None:
            return type(self).forward(self, hidden_states)
        return LigerRMSNormFunction.apply(hidden_states, self.weight, norm_epsilon(self), plan.offset,
                                          plan.casting_mode, False)


class LigerGemmaRMSNorm(nn.Module):
    """``y = round((x / sqrt(mean(x^2) + eps)) * (1 + w))``, all in fp32: Gemma's norm.

    ``x`` (..., H); reads ``weight`` (H,) and ``eps`` off the module (a
    :class:`LigerGemmaRMSNormLayout`, or any module with those attributes).
    """

    has_backward = True
    can_torch_compile = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LigerRMSNormFunction.apply(x, self.weight, norm_epsilon(self), 1.0, "gemma", False)


class LigerGemmaRMSNormLayout(nn.Module):
    """The module a ``KernelConfig`` puts in place of a Gemma-style norm class (``Gemma3RMSNorm``):
    built like it, ``(hidden_size, eps=1e-6)``, weight (H,) initialised to zeros, attribute ``eps``,
    and the same math in torch until ``kernelize`` binds :class:`LigerGemmaRMSNorm` onto it."""

    kernel_layer_name = "LigerGemmaRMSNorm"

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_hat = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_hat * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


# ------------------------------------------------------------------------------------------
# Rotary position embedding
# ------------------------------------------------------------------------------------------
def rope_layouts() -> list[RopeLayout]:
    """Every layout the kernel computes, rotate-half first (the common case)."""
    return [RopeLayout(interleaved, table, negate_sin, rotate_last)
            for rotate_last, negate_sin, interleaved, table in itertools.product((False, True), (False, True),
                                                                                  (False, True), TABLES)]


def _rope_layout(module: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int) -> RopeLayout | None:
    if q.dim() != 4 or k.dim() != 4 or cos.dim() not in (2, 3) or unsqueeze_dim not in (1, 2):
        return None
    key = (type(module), q.dtype, cos.dtype, q.device.type, q.shape[-1], k.shape[-1], cos.shape[-1], cos.dim(),
           unsqueeze_dim)
    if key not in _ROPE_PLANS:
        _ROPE_PLANS[key] = _probe_rope(module, q, k, cos, sin, unsqueeze_dim)
        if _ROPE_PLANS[key] is None:
            logger.warning("%s: no Liger RoPE layout equals it on a probe; keeping its own function.",
                           type(module).__name__)
    return _ROPE_PLANS[key]


def _probe_rope(module: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int) -> RopeLayout | None:
    if q.is_meta or cos.is_meta:
        return None
    generator = torch.Generator().manual_seed(0)
    seq_axis = 2 if unsqueeze_dim == 1 else 1
    seq = min(q.shape[seq_axis], 5)

    def like(x: torch.Tensor, table: bool = False) -> torch.Tensor:
        shape = list(x.shape)
        if table:  # (B, T, W) or (T, W): any batch broadcasts, so one row
            shape[-2] = seq
            if len(shape) == 3:
                shape[0] = 1
            values = torch.rand(shape, generator=generator) * 2 - 1  # unrelated across channels
        else:
            shape[0], shape[seq_axis] = 1, seq
            values = torch.randn(shape, generator=generator)
        return values.to(device=x.device, dtype=x.dtype)

    probe = (like(q), like(k), like(cos, True), like(sin, True))
    with torch.no_grad():
        try:
            reference = type(module).forward(module, *probe, unsqueeze_dim)
        except Exception:  # not the (q, k, cos, sin, unsqueeze_dim) function it claims to be
            return None
        if not (isinstance(reference, tuple) and len(reference) == 2):
            return None
        for layout in rope_layouts():
            rotated = layout.rotary_dim(cos.shape[-1])
            if rotated % 2 or rotated > min(q.shape[-1], k.shape[-1]):
                continue
            try:
                result = LigerRopeFunction.apply(*probe, None, unsqueeze_dim, layout)
            except ValueError:
                continue
            if all(_close_enough(ours, theirs) for ours, theirs in zip(result, reference)):
                return layout
    return None


class LigerRotaryPosEmb(nn.Module):
    """For the hub name ``rotary_pos_emb`` (transformers' ``apply_rotary_pos_emb``).

    ``q`` (B, Hq, T, D), ``k`` (B, Hk, T, D) ((B, T, H, D) with ``unsqueeze_dim=2``), ``cos``/``sin``
    (B or 1, T, W) -> ``(q_embed, k_embed)`` of q's and k's shapes; W < D rotates the first W
    channels (partial rotary). The layout (rotate-half or interleaved pairs, ...) is the one
    the probe proved equal to the replaced function.
    """

    has_backward = True
    can_torch_compile = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        layout = _rope_layout(self, q, k, cos, sin, unsqueeze_dim)
        if layout is None:
            return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)
        return LigerRopeFunction.apply(q, k, cos, sin, None, unsqueeze_dim, layout)


# ------------------------------------------------------------------------------------------
# Gated MLPs
# ------------------------------------------------------------------------------------------
def _plain_linear(module: nn.Module) -> bool:
    """Whether ``module(x)`` is exactly ``F.linear(x, module.weight, module.bias)`` (no hooks, no
    wrapped forward, plain tensor parameters), so the down projection can fuse with the gate."""
    if type(module) is not nn.Linear or module._forward_hooks or module._forward_pre_hooks:
        return False
    if "forward" in module.__dict__:
        return False
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return False
    plain = (torch.Tensor, nn.Parameter)
    return type(module.weight) in plain and (module.bias is None or type(module.bias) in plain)


def gated_mlp(module: nn.Module, x: torch.Tensor, activation: int) -> torch.Tensor:
    """``down_proj(act(gate) * up)`` with the Liger gated kernel (``activation``: ``ops.swiglu.SILU``
    or ``GELU_TANH``), ``gate, up = gate_proj(x), up_proj(x)`` or ``gate_up_proj(x).chunk(2, -1)``
    (gate first), fused with a plain ``nn.Linear`` down projection as
    :func:`liger_kernel.transformers.swiglu.gated_down_projection` does."""
    projections: tuple[nn.Module, ...]
    if "gate_up_proj" in module._modules:
        gate_up_proj = child_module(module, "gate_up_proj")
        projections = (gate_up_proj,)
        gate, up = gate_up_proj(x).chunk(2, dim=-1)
    else:
        gate_proj, up_proj = child_module(module, "gate_proj"), child_module(module, "up_proj")
        projections = (gate_proj, up_proj)
        gate, up = gate_proj(x), up_proj(x)
    # The activations are this module's own projection outputs: private unless a hook sees them.
    in_place = not any(hooks_may_see(projection) for projection in projections)
    down = child_module(module, "down_proj")
    if _plain_linear(down):
        weight, bias = tensor_attribute(down, "weight"), down.bias
        if weight.device == gate.device:
            return LigerGatedDownProjFunction.apply(gate, up, weight, bias, activation, in_place)
    function = LigerSiLUMulFunction if activation == SILU else LigerGELUMulFunction
    return down(function.apply(gate, up, in_place))


class LigerSwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; reads the three projections off the module."""

    has_backward = True
    can_torch_compile = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self, x, SILU)


class LigerFusedSwiGLUMLP(LigerSwiGLUMLP):
    """:class:`LigerSwiGLUMLP` under the name whose layout has one fused ``gate_up_proj``."""


class LigerGEGLUMLP(nn.Module):
    """``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``; reads the three projections off the module."""

    has_backward = True
    can_torch_compile = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self, x, GELU_TANH)


def config_activation(config) -> tuple[str, object]:
    """``(attribute, value)`` of the config's MLP activation: ``hidden_activation`` if set
    (Gemma 2 and 3), else ``hidden_act``."""
    if getattr(config, "hidden_activation", None) is not None:
        return "hidden_activation", config.hidden_activation
    return "hidden_act", getattr(config, "hidden_act", None)


def check_activation(layout: nn.Module, config, accepted: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless the config's MLP activation is one the layout's kernel computes."""
    attribute, activation = config_activation(config)
    if activation not in accepted:
        raise ValueError(f"{type(layout).__name__} computes one of {accepted}; "
                         f"config.{attribute}={activation!r} is not one of them")


class _GatedMLPLayout(nn.Module):
    """A gated MLP built like HF's (``cls(config, intermediate_size=None)``): ``config``,
    ``hidden_size``, ``intermediate_size`` and the ``gate_proj``/``up_proj``/``down_proj`` linears
    (biases when ``config.mlp_bias``), so HF checkpoints load unchanged. Raises ``ValueError``
    for a config activation the kernel does not compute."""

    activations: tuple[str, ...] = ()

    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        check_activation(self, config, self.activations)
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size or config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)


class LigerSwiGLUMLPLayout(_GatedMLPLayout):
    """The module a ``KernelConfig`` puts in place of a SwiGLU MLP class (``LlamaMLP``, ``Qwen3MLP``,
    ``MistralMLP``, ...); torch math until ``kernelize`` binds :class:`LigerSwiGLUMLP` onto it."""

    kernel_layer_name = "LigerSwiGLUMLP"
    activations = SILU_ACTIVATIONS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LigerFusedSwiGLUMLPLayout(nn.Module):
    """The module a ``KernelConfig`` puts in place of a SwiGLU MLP with one fused projection
    (``Phi3MLP``): built like it from ``config``, ``gate_up_proj`` (hidden -> 2 * intermediate, gate
    first) and ``down_proj``, no biases; torch math until ``kernelize`` binds
    :class:`LigerFusedSwiGLUMLP` onto it."""

    kernel_layer_name = "LigerFusedSwiGLUMLP"

    def __init__(self, config) -> None:
        super().__init__()
        check_activation(self, config, SILU_ACTIVATIONS)
        self.config = config
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LigerGEGLUMLPLayout(_GatedMLPLayout):
    """The module a ``KernelConfig`` puts in place of a tanh-GELU gated MLP class (``GemmaMLP``,
    ``Gemma3MLP``, ...); torch math until ``kernelize`` binds :class:`LigerGEGLUMLP` onto it."""

    kernel_layer_name = "LigerGEGLUMLP"
    activations = GELU_TANH_ACTIVATIONS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


# ------------------------------------------------------------------------------------------
# Fused MoE experts
# ------------------------------------------------------------------------------------------
def experts_loop(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, use_kernel: bool) -> torch.Tensor:
    """HF's eager fused-experts loop (:func:`liger_kernel.ops.swiglu.eager_experts_forward`) over
    ``module.gate_up_proj`` (E, 2I, H; gate first) and ``module.down_proj`` (E, H, I).
    ``use_kernel``: ``silu(gate) * up`` by the Liger kernel (as the patching's ``_apply_gate``),
    else by torch.
    """
    def apply_gate(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return LigerSiLUMulFunction.apply(gate, up, False) if use_kernel else F.silu(gate) * up

    gate_up_proj = tensor_attribute(module, "gate_up_proj")
    return eager_experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj,
                                 tensor_attribute(module, "down_proj"), gate_up_proj.shape[0], apply_gate)


class LigerSwiGLUExperts(nn.Module):
    """Fused SwiGLU experts: for each expert e and its tokens,
    ``down_proj[e] @ (silu(gate) * up) * routing weight``, ``gate, up = gate_up_proj[e] @ x``
    (gate first), summed per token. Reads ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I)
    off the module; the eager loop of HF, whatever ``config._experts_implementation`` says."""

    has_backward = True
    can_torch_compile = False

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return experts_loop(self, hidden_states, top_k_index, top_k_weights, use_kernel=True)


class LigerSwiGLUExpertsLayout(nn.Module):
    """The module a ``KernelConfig`` puts in place of a fused-experts class (``MixtralExperts``,
    ``Qwen3MoeExperts``): built from ``config`` like them (``num_local_experts`` or ``num_experts``
    experts, ``moe_intermediate_size`` or ``intermediate_size``), with the same parameters
    ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I), no biases. Raises ``ValueError`` for an
    activation other than SiLU. Torch math until ``kernelize`` binds :class:`LigerSwiGLUExperts`."""

    kernel_layer_name = "LigerSwiGLUExperts"

    def __init__(self, config) -> None:
        super().__init__()
        check_activation(self, config, SILU_ACTIVATIONS)
        self.config = config
        self.num_experts = getattr(config, "num_local_experts", None) or config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        std = getattr(config, "initializer_range", 0.02)
        self.gate_up_proj = nn.Parameter(torch.randn(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim) * std)
        self.down_proj = nn.Parameter(torch.randn(self.num_experts, self.hidden_dim, self.intermediate_dim) * std)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return experts_loop(self, hidden_states, top_k_index, top_k_weights, use_kernel=False)
