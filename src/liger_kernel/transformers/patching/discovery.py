"""Discovery: the Liger kernels any Hugging Face model can use, each proven equal before use.

For a ``PreTrainedModel`` (a causal LM, or the text decoder and LM head of an image-text-to-text
model) this finds, by structure, the candidates

* norms: leaf modules with a 1-D ``weight``, an epsilon and "Norm" in the class name, or
  ``torch.nn.LayerNorm``; RMSNorm as ``w * x_hat`` (Llama casting) or ``(1 + w) * x_hat`` in
  fp32 (Gemma), LayerNorm with or without bias; per-head q/k norms included;
* gated MLPs: ``gate_proj``/``up_proj``/``down_proj`` linears or one fused ``gate_up_proj`` (gate
  first) with an ``act_fn`` (or ``activation_fn``) that is SiLU (SwiGLU) or tanh-GELU (GeGLU),
  dense, shared or one expert of a list;
* fused experts: 3-D ``gate_up_proj``/``down_proj`` parameters behind HF's
  ``use_experts_implementation`` (only the activation ``act(gate) * up`` changes);
* rotary embeddings: the module-level ``apply_rotary_pos_emb`` an attention forward calls
  (rotate-half or interleaved pairs, cos/sin per channel or per pair, the rotation by -theta,
  full or partial rotary; ``fn(q, k, cos, sin)`` or per tensor ``fn(x, cos, sin)``);
* the head and loss (:mod:`~liger_kernel.transformers.patching.head_probe`),

and proves each candidate equal to its Liger replacement on a small random probe (once per
class and configuration: the results are cached). A candidate that fails its probe stays
HF's and the :class:`~liger_kernel.transformers.patching.report.PatchReport` says what was left
alone and why. Never a silent wrong patch.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from liger_kernel.ops.module_attributes import child_module, tensor_attribute
from liger_kernel.transformers.causal_lm import text_config_of

if TYPE_CHECKING:
    from liger_kernel.transformers.patching.replacements import FusedExperts

logger = logging.getLogger(__name__)

# Relative tolerance of a probe (max |liger - hf| / max |hf|) per dtype: rounding passes, a
# different formula (an offset, another activation, a missing scale) is off by O(1).
_PROBE_RTOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 5e-3}

_SILU = "silu"
_GELU_TANH = "gelu_tanh"


@dataclass(frozen=True)
class NormPlan:
    kind: str  # "rms_norm" or "layer_norm"
    offset: float = 0.0
    casting_mode: str = "llama"


def close_enough(result: torch.Tensor, reference: torch.Tensor) -> tuple[bool, float]:
    rtol = _PROBE_RTOL.get(reference.dtype, 2e-5)
    scale = reference.detach().abs().max().clamp_min(1e-6)
    error = float((result.detach().float() - reference.detach().float()).abs().max() / scale)
    return error <= rtol, error


def kernel_device(device: torch.device) -> torch.device:
    """Where the kernels can run a probe of a module on ``device``: the device itself, or, for a
    module still on the CPU while Triton compiles for CUDA (no interpreter), the current GPU:
    models are often patched before they are moved there."""
    from liger_kernel.ops.launch import is_interpreter

    if device.type == "cpu" and not is_interpreter() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def probe_device(module: nn.Module) -> torch.device | None:
    """The device a probe runs on (see :func:`kernel_device`), None when the module's parameters
    are not materialised."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.is_meta:
            return None
        return kernel_device(tensor.device)
    return kernel_device(torch.device("cpu"))


def on_probe_device(module: nn.Module, device: torch.device) -> nn.Module:
    """``module``, or a copy of it on ``device`` when its parameters live elsewhere."""
    tensors = list(module.parameters()) + list(module.buffers())
    if all(t.device == device for t in tensors):
        return module
    return copy.deepcopy(module).to(device)


def _probe_dtype(module: nn.Module) -> torch.dtype:
    for tensor in module.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _single_input_forward(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes exactly one argument and nothing else: a replacement
    with the signature ``forward(x)`` must accept every call the model makes (a gated norm's
    ``forward(x, gate=None)`` passes a one-argument probe but is called with the gate)."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and parameters[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                           inspect.Parameter.POSITIONAL_OR_KEYWORD)


# ----------------------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------------------
def norm_epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon", "layer_norm_eps"):
        value = getattr(module, name, None)
        if isinstance(value, (float, int)) and not isinstance(value, bool):
            return float(value)
    return None


def is_norm_candidate(module: nn.Module) -> bool:
    """Structure of a norm the kernels may replace: a leaf with a 1-D weight and an epsilon."""
    if any(True for _ in module.children()):
        return False
    weight = getattr(module, "weight", None)
    # A parameter: a "weight" buffer (a weightless norm's placeholder) need not match the width
    # the norm is applied to, and the replacement would multiply by it.
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return False
    if isinstance(module, nn.LayerNorm):
        return module.elementwise_affine and len(module.normalized_shape) == 1
    if "norm" not in type(module).__name__.lower() or norm_epsilon(module) is None:
        return False
    bias = getattr(module, "bias", None)
    return (bias is None or (isinstance(bias, torch.Tensor) and bias.shape == weight.shape)) and \
        _single_input_forward(module)


def _liger_norm_output(module: nn.Module, plan: NormPlan, x: torch.Tensor) -> torch.Tensor:
    eps = norm_epsilon(module)
    if eps is None:  # is_norm_candidate admits only norms with one
        raise ValueError(f"{type(module).__name__} has no epsilon")
    weight = tensor_attribute(module, "weight")
    if plan.kind == "layer_norm":
        from liger_kernel.transformers.layer_norm import liger_layer_norm

        return liger_layer_norm(x, weight, getattr(module, "bias", None), eps, in_place=False)
    from liger_kernel.transformers.rms_norm import liger_rms_norm

    return liger_rms_norm(x, weight, eps, plan.offset, plan.casting_mode, in_place=False)


def _norm_candidates(module: nn.Module) -> list[NormPlan]:
    if isinstance(module, nn.LayerNorm) or "layernorm" in type(module).__name__.lower():
        first = [NormPlan("layer_norm")]
    else:
        first = []
    rms = [NormPlan("rms_norm", 0.0, "llama"), NormPlan("rms_norm", 1.0, "gemma")]
    layer = [] if first else [NormPlan("layer_norm")]
    return first + rms + layer


def _norm_key(module: nn.Module) -> tuple:
    return (type(module), tuple(tensor_attribute(module, "weight").shape), norm_epsilon(module),
            getattr(module, "bias", None) is not None, _probe_dtype(module))


_NORM_PROBES: dict[tuple, NormPlan | str] = {}


def probe_norm(module: nn.Module) -> NormPlan | str:
    """The Liger norm equal to ``module`` (a :class:`NormPlan`), or why there is none.

    The probe runs a copy of the module with random weights (so ``w`` and ``1 + w`` differ)
    on a random (2, 5, H) input in fp32, then in the module's dtype when that is lower.
    """
    key = _norm_key(module)
    if key in _NORM_PROBES:
        return _NORM_PROBES[key]
    result = _probe_norm_uncached(module)
    _NORM_PROBES[key] = result
    return result


def _probe_norm_uncached(module: nn.Module) -> NormPlan | str:
    device = probe_device(module)
    if device is None:
        return "parameters not materialised (meta device)"
    dtype = _probe_dtype(module)
    probe = copy.deepcopy(module).float().train().to(device)  # training mode: any dropout inside is active
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in probe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + 0.3)
    hidden = tensor_attribute(module, "weight").shape[0]
    x = (torch.randn(2, 5, hidden, generator=generator) * 2.0).to(device)
    errors = []
    with torch.no_grad():
        try:
            reference = probe(x)
        except Exception as error:  # any failure means: not a norm we understand
            return f"its forward failed on a (2, 5, {hidden}) probe: {type(error).__name__}"
        if not isinstance(reference, torch.Tensor) or reference.shape != x.shape:
            return "its forward does not return one tensor of the input's shape"
        for plan in _norm_candidates(probe):
            equal, difference = close_enough(_liger_norm_output(probe, plan, x), reference)
            errors.append(f"{plan.kind}(offset={plan.offset}) {difference:.1e}")
            if equal:
                if dtype != torch.float32:
                    low = probe.to(dtype)
                    x_low = x.to(dtype)
                    equal, difference = close_enough(_liger_norm_output(low, plan, x_low), low(x_low))
                    if not equal:
                        return f"matches {plan.kind} in fp32 but not in {dtype} (error {difference:.1e})"
                return plan
    return "computes neither RMSNorm nor LayerNorm (relative errors: " + ", ".join(errors) + ")"


# ----------------------------------------------------------------------------------------
# Activations, gated MLPs, fused experts
# ----------------------------------------------------------------------------------------
def activation_kind(act: Any) -> str | None:
    """``"silu"`` or ``"gelu_tanh"`` when the callable ``act`` computes that, else None."""
    if not callable(act):
        return None
    t = torch.linspace(-6.0, 6.0, 97, dtype=torch.float32)
    try:
        with torch.no_grad():
            out = act(t)
    except Exception:
        return None
    if not isinstance(out, torch.Tensor) or out.shape != t.shape:
        return None
    for kind, reference in ((_SILU, F.silu(t)), (_GELU_TANH, F.gelu(t, approximate="tanh"))):
        if torch.allclose(out.float(), reference, atol=1e-6, rtol=1e-5):
            return kind
    return None


@dataclass(frozen=True)
class MLPPlan:
    layout: str  # "split" (gate_proj/up_proj/down_proj) or "fused" (gate_up_proj/down_proj)
    activation: str  # "silu" or "gelu_tanh"

    @property
    def option(self) -> str:
        return "swiglu" if self.activation == _SILU else "geglu"


def _linear(module: nn.Module, name: str) -> bool:
    return isinstance(getattr(module, name, None), nn.Linear)


_ACTIVATION_ATTRS = ("act_fn", "activation_fn")


def mlp_activation(module: nn.Module) -> Any:
    """The activation module a gated MLP applies to its gate (``act_fn`` or ``activation_fn``)."""
    return next((getattr(module, name) for name in _ACTIVATION_ATTRS if callable(getattr(module, name, None))), None)


def mlp_layout(module: nn.Module) -> str | None:
    if mlp_activation(module) is None or not _linear(module, "down_proj"):
        return None
    if _linear(module, "gate_proj") and _linear(module, "up_proj"):
        return "split"
    if _linear(module, "gate_up_proj"):
        return "fused"
    return None


class DiscoveredMLP(Protocol):
    """What :func:`liger_mlp_forward` reads off a discovered gated MLP (or the probe's proxy of
    one): ``gate_up_proj``, or ``gate_proj`` and ``up_proj``, whichever ``_modules`` holds."""

    _liger_activation: str
    _modules: dict[str, nn.Module | None]
    gate_up_proj: nn.Module
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module


def liger_mlp_forward(self: DiscoveredMLP, hidden_states: torch.Tensor) -> torch.Tensor:
    """``down_proj(act(gate) * up)`` of a discovered gated MLP with the Liger gated kernel.

    ``self._liger_activation`` (set by the patch) names the activation its probe proved:
    ``"silu"`` or ``"gelu_tanh"``; a fused ``gate_up_proj`` holds the gate first.
    """
    from liger_kernel.ops.swiglu import GELU_TANH, SILU
    from liger_kernel.transformers.swiglu import gated_down_projection, gated_in_place

    if self._liger_activation == _SILU:
        activation = SILU
    else:
        import liger_kernel.ops.geglu  # noqa: F401 - registers the tanh-GELU activation

        activation = GELU_TANH
    if "gate_up_proj" in self._modules:
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    else:
        gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
    return gated_down_projection(self.down_proj, gate, up, activation, gated_in_place(self))


_MLP_PROBES: dict[tuple, MLPPlan | str] = {}


def probe_mlp(module: nn.Module, in_place: bool = False) -> MLPPlan | str:
    """The Liger gated MLP equal to ``module``, or why there is none (cached per class and shapes)."""
    layout = mlp_layout(module)
    if layout is None:
        return "not a gated MLP"
    linears = tuple((name, tuple(child.weight.shape), child.bias is not None)
                    for name, child in module.named_children() if isinstance(child, nn.Linear))
    act = mlp_activation(module)
    key = (type(module), layout, type(act), getattr(act, "approximate", None), linears, _probe_dtype(module))
    if key not in _MLP_PROBES:
        _MLP_PROBES[key] = _probe_mlp_uncached(module, layout)
    return _MLP_PROBES[key]


class _Proxy:
    """Attribute access falls through to ``target`` except for the names given."""

    def __init__(self, target: Any, **overrides: Any) -> None:
        self.__dict__["_target"] = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_target"], name)


def _probe_mlp_uncached(module: nn.Module, layout: str) -> MLPPlan | str:
    activation = activation_kind(mlp_activation(module))
    if activation is None:
        return f"its activation {type(mlp_activation(module)).__name__} is neither SiLU nor tanh-GELU"
    device = probe_device(module)
    if device is None:
        return "parameters not materialised (meta device)"
    module = on_probe_device(module, device)
    hidden = tensor_attribute(child_module(module, "down_proj"), "weight").shape[0]
    dtype = _probe_dtype(module)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, hidden, generator=generator).to(device=device, dtype=dtype)
    # Probed in training mode (restored after): a forward with active dropout must not pass
    # because the model happened to be in eval mode when patched.
    was_training = module.training
    module.train()
    try:
        with torch.no_grad():
            reference = type(module).forward(module, x)
            again = type(module).forward(module, x)
    except Exception as error:
        return f"its forward failed on a probe: {type(error).__name__}"
    finally:
        module.train(was_training)
    if isinstance(reference, torch.Tensor) and not torch.equal(reference, again):
        return "its forward is not deterministic in training (dropout)"
    with torch.no_grad():
        proxy = _Proxy(module, _liger_activation=activation, in_place=False)
        proxy.__dict__["_modules"] = module._modules
        try:
            result = liger_mlp_forward(proxy, x)
        except Exception as error:
            return f"the Liger gated MLP failed on its probe: {type(error).__name__}: {error}"
    if not isinstance(reference, torch.Tensor):
        return "its forward does not return one tensor"
    equal, difference = close_enough(result, reference)
    if not equal:
        return f"differs from {activation}(gate) * up through down_proj (relative error {difference:.1e})"
    return MLPPlan(layout, activation)


def is_experts_candidate(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and gate_up.dim() == 3 and isinstance(down, nn.Parameter)
            and down.dim() == 3 and callable(getattr(module, "_apply_gate", None))
            and callable(getattr(module, "act_fn", None)))


def liger_silu_apply_gate(self: FusedExperts, gate_up_out: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused (..., 2I) gate-up projection (gate first), as the Liger kernel:
    :func:`~liger_kernel.transformers.patching.replacements.liger_apply_gate` for a module whose
    SiLU activation :func:`probe_experts` checked."""
    from liger_kernel.transformers.patching.replacements import liger_apply_gate

    return liger_apply_gate(self, gate_up_out, check_activation=False)


_EXPERTS_PROBES: dict[tuple, str | None] = {}


def probe_experts(module: nn.Module) -> str | None:
    """None when ``module``'s forward equals the Liger-activation experts forward, else why not."""
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    key = (type(module), tuple(tensor_attribute(module, "gate_up_proj").shape), implementation)
    if key not in _EXPERTS_PROBES:
        _EXPERTS_PROBES[key] = _probe_experts_uncached(module)
    return _EXPERTS_PROBES[key]


def _probe_experts_uncached(module: nn.Module) -> str | None:
    from liger_kernel.transformers.patching.replacements import liger_experts_forward

    if activation_kind(module.act_fn) != _SILU:
        return f"its activation {type(module.act_fn).__name__} is not SiLU"
    device = probe_device(module)
    if device is None:
        return "parameters not materialised (meta device)"
    module = on_probe_device(module, device)
    experts, _, hidden = tensor_attribute(module, "gate_up_proj").shape
    generator = torch.Generator().manual_seed(2)
    tokens, top_k = 6, min(2, experts)
    x = torch.randn(tokens, hidden, generator=generator).to(device=device, dtype=_probe_dtype(module))
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).to(device)
    weights = torch.rand(tokens, top_k, generator=generator).to(device=device, dtype=x.dtype)
    was_training = module.training
    module.train()
    with torch.no_grad():
        try:
            reference = module(x, index, weights)
            proxy = _Proxy(module)
            proxy.__dict__["_apply_gate"] = functools.partial(liger_silu_apply_gate, proxy)
            result = liger_experts_forward(proxy, x, index, weights)
        except Exception as error:
            return f"its forward failed on a probe: {type(error).__name__}: {error}"
        finally:
            module.train(was_training)
    equal, difference = close_enough(result, reference)
    return None if equal else f"differs from silu(gate) * up experts (relative error {difference:.1e})"


# ----------------------------------------------------------------------------------------
# Rotary embeddings
# ----------------------------------------------------------------------------------------
ROTARY_NAME = "apply_rotary_pos_emb"


def rotary_function(module: nn.Module) -> tuple[Callable, Callable] | None:
    """``(the class forward, the module-level rotary function it calls)`` or None."""
    from liger_kernel.transformers.patching.binding import innermost

    forward = type(module).forward
    inner = innermost(forward)
    names = getattr(getattr(inner, "__code__", None), "co_names", ())
    fn_globals = getattr(inner, "__globals__", None)
    if ROTARY_NAME not in names or not isinstance(fn_globals, dict):
        return None
    fn = fn_globals.get(ROTARY_NAME)
    return (forward, fn) if callable(fn) else None


@dataclass(frozen=True)
class RopePlan:
    """How a model's rotary function is computed and called: the kernel layout and the signature.

    ``per_tensor``: ``fn(x, cos, sin, unsqueeze_dim=1) -> x_embed`` (Gemma 3n, Gemma 4) instead of
    ``fn(q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed)``. ``sin_first``: the tables come
    as ``(sin, cos)`` (GPT-J, CodeGen). ``heads_dim``: the dim of q/k holding the heads when the
    caller passes no ``unsqueeze_dim`` (2 for GPT-J's (B, T, H, D) ``sin[:, :, None, :]``).
    """

    layout: Any  # liger_kernel.ops.rope.RopeLayout
    per_tensor: bool = False
    sin_first: bool = False
    heads_dim: int = 1

    @property
    def replacement(self) -> Callable:
        """The Liger function installed in place of the model's ``apply_rotary_pos_emb``."""
        return _rope_replacement(self)


@functools.cache
def _rope_replacement(plan: RopePlan) -> Callable:
    # One object per plan: the rebound attention forwards are cached by their overrides.
    from liger_kernel.ops.rope import ROTATE_HALF
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    if plan == RopePlan(ROTATE_HALF):
        return liger_rotary_pos_emb
    return functools.partial(liger_rope_as_planned, plan)


def liger_rope_as_planned(plan: RopePlan, *args: Any, **kwargs: Any) -> Any:
    """The Liger RoPE taking the arguments of the function ``plan`` was proven equal to."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb, liger_rotary_pos_emb_single

    tables = 1 if plan.per_tensor else 2  # index of the first table argument
    positional = list(args)
    if plan.sin_first and len(positional) >= tables + 2:
        positional[tables], positional[tables + 1] = positional[tables + 1], positional[tables]
    # unsqueeze_dim follows position_ids in the two-tensor signature.
    if len(positional) <= tables + (2 if plan.per_tensor else 3):
        kwargs.setdefault("unsqueeze_dim", plan.heads_dim)
    # Called with the arguments the model's own function took, whatever their number.
    fn: Callable[..., Any] = liger_rotary_pos_emb_single if plan.per_tensor else liger_rotary_pos_emb
    return fn(*positional, layout=plan.layout, **kwargs)


def _rope_layouts() -> list:
    """Every layout the kernel computes, rotate-half first (the common case)."""
    from liger_kernel.ops.rope import TABLES, RopeLayout

    return [RopeLayout(interleaved, table, negate_sin, rotate_last) for rotate_last in (False, True)
            for negate_sin in (False, True) for interleaved in (False, True) for table in TABLES]


_ROPE_PROBES: dict[tuple, RopePlan | str] = {}


def probe_rope(fn: Callable, head_dim: int, rotary_dims: set[int], device: torch.device | None) -> RopePlan | str:
    """The :class:`RopePlan` whose Liger function equals ``fn`` on every probe, or why there is none.

    ``fn`` is called with random q/k and random cos/sin tables (entries in [-1, 1], unrelated
    across channels, so a layout reading other entries than ``fn`` fails) of each width W the
    model's rotary embeddings produce, q/k of the head dim, of W and of 2W (for attention that
    slices the rotated part off itself), as (B, H, T, D) and (B, T, H, D) without
    ``unsqueeze_dim``, and with ``unsqueeze_dim=2`` when ``fn`` has that parameter. For each
    signature (two-tensor first, then per tensor; tables as (cos, sin), then (sin, cos)) the
    calls ``fn`` accepts (at least one) must all match one plan: the heads dim and the layout,
    tried in turn.
    """
    key = (fn, head_dim, tuple(sorted(rotary_dims)))
    if key not in _ROPE_PROBES:
        _ROPE_PROBES[key] = _probe_rope_dims(fn, head_dim, rotary_dims, device)
    return _ROPE_PROBES[key]


@dataclass
class _RopeCase:
    """One probe call: the arguments, HF's result and the call form."""

    inputs: tuple[torch.Tensor, torch.Tensor]  # q, k (each rotated alone by a per-tensor function)
    tables: tuple[torch.Tensor, torch.Tensor]  # in the order fn takes them
    heads_dim: int  # where the heads of q/k are
    unsqueeze_dim: int | None  # passed by keyword when not None
    reference: tuple[torch.Tensor, ...]


def _probe_rope_dims(fn: Callable, head_dim: int, rotary_dims: set[int], device: torch.device | None) -> RopePlan | str:
    try:
        takes_unsqueeze_dim = "unsqueeze_dim" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_unsqueeze_dim = False
    errors = []
    for per_tensor in (False, True):
        for sin_first in (False, True):
            cases = _rope_cases(fn, head_dim, rotary_dims, device, per_tensor, sin_first, takes_unsqueeze_dim)
            if isinstance(cases, str):
                return cases
            if not cases:
                continue
            for heads_dim in (1, 2):
                for layout in _rope_layouts():
                    plan = RopePlan(layout, per_tensor, sin_first, heads_dim)
                    why = _rope_plan_differs(plan, cases)
                    if why is None:
                        return plan
                    errors.append((why, layout))
    if not errors:
        return f"{ROTARY_NAME}(q, k, cos, sin) failed on every probe shape"
    (error, name), layout = min(errors, key=lambda item: item[0][0])
    return (f"{ROTARY_NAME} is none of the kernel's RoPE layouts (relative error {error:.1e} on {name} "
            f"for the closest, {layout.describe()})")


def _rope_cases(fn: Callable, head_dim: int, rotary_dims: set[int], device: torch.device | None, per_tensor: bool,
                sin_first: bool, takes_unsqueeze_dim: bool) -> list[_RopeCase] | str:
    """The probe calls ``fn`` accepts in the given signature (an error message when it accepts
    one but does not return what that signature returns)."""
    generator = torch.Generator().manual_seed(3)
    batch, seq = 2, 5
    cases = []
    for width in sorted(rotary_dims):
        for q_width in sorted({head_dim, width, 2 * width}):
            cos = (torch.rand(batch, seq, width, generator=generator) * 2 - 1).to(device)
            sin = (torch.rand(batch, seq, width, generator=generator) * 2 - 1).to(device)
            tables = (sin, cos) if sin_first else (cos, sin)
            q = torch.randn(batch, 4, seq, q_width, generator=generator).to(device)
            k = torch.randn(batch, 2, seq, q_width, generator=generator).to(device)
            q_t, k_t = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
            forms = [(1, None, (q, k)), (2, None, (q_t, k_t))] + ([(2, 2, (q_t, k_t))] if takes_unsqueeze_dim else [])
            for heads, unsqueeze_dim, inputs in forms:
                try:
                    reference = _call_rope(fn, per_tensor, inputs, tables, unsqueeze_dim)
                except Exception:  # HF's function does not take this shape or signature
                    continue
                if not per_tensor and not (isinstance(reference, tuple) and len(reference) == 2):
                    # Not the two-tensor signature; the per-tensor one is tried next.
                    continue
                if any(not isinstance(r, torch.Tensor) or r.shape != x.shape for r, x in zip(reference, inputs)):
                    return f"{ROTARY_NAME} returns tensors of other shapes than its inputs"
                cases.append(_RopeCase(inputs, tables, heads, unsqueeze_dim, tuple(reference)))
    return cases


def _call_rope(fn: Callable, per_tensor: bool, inputs: tuple[torch.Tensor, torch.Tensor],
               tables: tuple[torch.Tensor, torch.Tensor], unsqueeze_dim: int | None) -> tuple:
    extra = {} if unsqueeze_dim is None else {"unsqueeze_dim": unsqueeze_dim}
    with torch.no_grad():
        if per_tensor:
            return tuple(fn(x, *tables, **extra) for x in inputs)
        return fn(*inputs, *tables, **extra)


def _rope_plan_differs(plan: RopePlan, cases: list[_RopeCase]) -> tuple[float, str] | None:
    """None when the plan's replacement equals HF's result on every case, else (error, what)."""
    for case in cases:
        head_dim = case.inputs[0].shape[-1]
        rotated = plan.layout.rotary_dim(case.tables[0].shape[-1])
        if rotated % 2 or rotated > head_dim:
            return float("inf"), f"q: the layout rotates {rotated} channels of {head_dim}"
        if (case.unsqueeze_dim or plan.heads_dim) != case.heads_dim:
            return float("inf"), f"q: its heads are dim {case.heads_dim}, not {plan.heads_dim}"
        result = _call_rope(plan.replacement, plan.per_tensor, case.inputs, case.tables, case.unsqueeze_dim)
        for ours, theirs, name in zip(result, case.reference, "qk"):
            equal, error = close_enough(ours, theirs)
            if not equal:
                return error, name
    return None


def rotary_dims(model: nn.Module) -> tuple[int, set[int]] | None:
    """(head_dim, the rotary dims of the text decoder's rotary embeddings, from their cos)."""
    config = model.config
    text_config = text_config_of(config)
    head_dim = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads)
    dims = set()
    for embedding in model.modules():
        if not type(embedding).__name__.endswith("RotaryEmbedding"):
            continue
        device = probe_device(embedding) or torch.device("cpu")
        x = torch.zeros(1, 2, 1, device=device)
        positions = torch.arange(2, device=device)[None]
        layer_types = getattr(embedding, "layer_types", ()) or ()
        extras: list[dict[str, Any]] = [{}, *({"layer_type": kind} for kind in layer_types)]
        for extra in extras:
            try:
                with torch.no_grad():
                    cos, _ = embedding(x, positions, **extra)
            except Exception:  # another signature, or not materialised
                continue
            dims.add(int(cos.shape[-1]))
    return (int(head_dim), dims) if dims else None
