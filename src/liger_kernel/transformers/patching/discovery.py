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
  (rotate-half, full or partial rotary);
* the head and loss: a ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward that computes
  logits with its output embedding from the decoder's last hidden states and calls
  ``self.loss_function``, replaced by the one fused-loss forward (soft-cap and MoE router loss
  read from the forward and the config),

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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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


def _close(result: torch.Tensor, reference: torch.Tensor) -> tuple[bool, float]:
    rtol = _PROBE_RTOL.get(reference.dtype, 2e-5)
    scale = reference.detach().abs().max().clamp_min(1e-6)
    error = float((result.detach().float() - reference.detach().float()).abs().max() / scale)
    return error <= rtol, error


def _probe_device(module: nn.Module) -> torch.device | None:
    """The device a probe runs on (the module's), None when its parameters are not materialised."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.is_meta:
            return None
        return tensor.device
    return torch.device("cpu")


def _probe_dtype(module: nn.Module) -> torch.dtype:
    for tensor in module.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _single_input_forward(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes exactly one required argument."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    required = [p for p in parameters if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


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
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
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
    if plan.kind == "layer_norm":
        from liger_kernel.transformers.layer_norm import liger_layer_norm

        return liger_layer_norm(x, module.weight, getattr(module, "bias", None), eps, in_place=False)
    from liger_kernel.transformers.rms_norm import liger_rms_norm

    return liger_rms_norm(x, module.weight, eps, plan.offset, plan.casting_mode, in_place=False)


def _norm_candidates(module: nn.Module) -> list[NormPlan]:
    if isinstance(module, nn.LayerNorm) or "layernorm" in type(module).__name__.lower():
        first = [NormPlan("layer_norm")]
    else:
        first = []
    rms = [NormPlan("rms_norm", 0.0, "llama"), NormPlan("rms_norm", 1.0, "gemma")]
    layer = [] if first else [NormPlan("layer_norm")]
    return first + rms + layer


def _norm_key(module: nn.Module) -> tuple:
    return (type(module), tuple(module.weight.shape), norm_epsilon(module),
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
    device = _probe_device(module)
    if device is None:
        return "parameters not materialised (meta device)"
    dtype = _probe_dtype(module)
    probe = copy.deepcopy(module).float().train()  # training mode: any dropout inside is active
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in probe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + 0.3)
    hidden = module.weight.shape[0]
    x = (torch.randn(2, 5, hidden, generator=generator) * 2.0).to(device)
    errors = []
    with torch.no_grad():
        try:
            reference = probe(x)
        except Exception as error:  # noqa: BLE001 - any failure means: not a norm we understand
            return f"its forward failed on a (2, 5, {hidden}) probe: {type(error).__name__}"
        if not isinstance(reference, torch.Tensor) or reference.shape != x.shape:
            return "its forward does not return one tensor of the input's shape"
        for plan in _norm_candidates(probe):
            if plan.kind == "layer_norm" and getattr(probe, "bias", None) is None and \
                    not isinstance(probe, nn.LayerNorm) and False:
                continue
            equal, error = _close(_liger_norm_output(probe, plan, x), reference)
            errors.append(f"{plan.kind}(offset={plan.offset}) {error:.1e}")
            if equal:
                if dtype != torch.float32:
                    low = probe.to(dtype)
                    x_low = x.to(dtype)
                    equal, error = _close(_liger_norm_output(low, plan, x_low), low(x_low))
                    if not equal:
                        return f"matches {plan.kind} in fp32 but not in {dtype} (error {error:.1e})"
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
    except Exception:  # noqa: BLE001
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


def liger_mlp_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``down_proj(act(gate) * up)`` of a discovered gated MLP with the Liger gated kernel.

    ``self._liger_activation`` (set by the patch) names the activation its probe proved:
    ``"silu"`` or ``"gelu_tanh"``; a fused ``gate_up_proj`` holds the gate first.
    """
    from liger_kernel.ops.swiglu import GELU_TANH, SILU
    from liger_kernel.transformers.swiglu import gated_down_projection

    if self._liger_activation == _SILU:
        activation = SILU
    else:
        import liger_kernel.ops.geglu  # noqa: F401 - registers the tanh-GELU activation

        activation = GELU_TANH
    if "gate_up_proj" in self._modules:
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    else:
        gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
    return gated_down_projection(self.down_proj, gate, up, activation, getattr(self, "in_place", True))


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
    device = _probe_device(module)
    if device is None:
        return "parameters not materialised (meta device)"
    hidden = module.down_proj.weight.shape[0]
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
    except Exception as error:  # noqa: BLE001
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
        except Exception as error:  # noqa: BLE001
            return f"the Liger gated MLP failed on its probe: {type(error).__name__}: {error}"
    if not isinstance(reference, torch.Tensor):
        return "its forward does not return one tensor"
    equal, error = _close(result, reference)
    if not equal:
        return f"differs from {activation}(gate) * up through down_proj (relative error {error:.1e})"
    return MLPPlan(layout, activation)


def is_experts_candidate(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and gate_up.dim() == 3 and isinstance(down, nn.Parameter)
            and down.dim() == 3 and callable(getattr(module, "_apply_gate", None))
            and callable(getattr(module, "act_fn", None)))


def liger_silu_apply_gate(self: nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused (..., 2I) gate-up projection (gate first), as the Liger kernel."""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    gate, up = gate_up_out.chunk(2, dim=-1)
    return LigerSiLUMulFunction.apply(gate, up)


_EXPERTS_PROBES: dict[tuple, str | None] = {}


def probe_experts(module: nn.Module) -> str | None:
    """None when ``module``'s forward equals the Liger-activation experts forward, else why not."""
    key = (type(module), tuple(module.gate_up_proj.shape), getattr(getattr(module, "config", None),
                                                                   "_experts_implementation", None))
    if key not in _EXPERTS_PROBES:
        _EXPERTS_PROBES[key] = _probe_experts_uncached(module)
    return _EXPERTS_PROBES[key]


def _probe_experts_uncached(module: nn.Module) -> str | None:
    from liger_kernel.transformers.patching.replacements import liger_experts_forward

    if activation_kind(module.act_fn) != _SILU:
        return f"its activation {type(module.act_fn).__name__} is not SiLU"
    device = _probe_device(module)
    if device is None:
        return "parameters not materialised (meta device)"
    experts, _, hidden = module.gate_up_proj.shape
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
            proxy.__dict__["_apply_gate"] = functools.partial(liger_silu_apply_gate, module)
            result = liger_experts_forward(proxy, x, index, weights)
        except Exception as error:  # noqa: BLE001
            return f"its forward failed on a probe: {type(error).__name__}: {error}"
        finally:
            module.train(was_training)
    equal, error = _close(result, reference)
    return None if equal else f"differs from silu(gate) * up experts (relative error {error:.1e})"


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


_ROPE_PROBES: dict[tuple, str | None] = {}


def probe_rope(fn: Callable, head_dim: int, rotary_dims: set[int], device: torch.device) -> str | None:
    """None when ``fn(q, k, cos, sin)`` equals the Liger RoPE kernel, else why not.

    Probed for each rotary dim R the model's rotary embeddings produce, with q/k of the head
    dim and, for attention that slices the rotated part off itself (partial rotary), of R;
    every shape ``fn`` accepts must match, and at least one must be accepted.
    """
    key = (fn, head_dim, tuple(sorted(rotary_dims)))
    if key not in _ROPE_PROBES:
        _ROPE_PROBES[key] = _probe_rope_dims(fn, head_dim, rotary_dims, device)
    return _ROPE_PROBES[key]


def _probe_rope_dims(fn: Callable, head_dim: int, rotary_dims: set[int], device: torch.device) -> str | None:
    accepted = 0
    for rotary_dim in sorted(rotary_dims):
        for width in sorted({head_dim, rotary_dim}):
            why = _probe_rope_uncached(fn, width, rotary_dim, device)
            if why == _REJECTED_SHAPE:
                continue
            if why is not None:
                return why
            accepted += 1
    return None if accepted else f"{ROTARY_NAME}(q, k, cos, sin) failed on every probe shape"


_REJECTED_SHAPE = "rejected shape"


def _probe_rope_uncached(fn: Callable, head_dim: int, rotary_dim: int, device: torch.device) -> str | None:
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    if rotary_dim % 2 or rotary_dim > head_dim:
        return f"rotary dim {rotary_dim} of head dim {head_dim} is not supported"
    generator = torch.Generator().manual_seed(3)
    seq = 5
    q = torch.randn(2, 4, seq, head_dim, generator=generator).to(device)
    k = torch.randn(2, 2, seq, head_dim, generator=generator).to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32) + 3.0, inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    cos = emb.cos()[None].expand(2, seq, rotary_dim).to(device)
    sin = emb.sin()[None].expand(2, seq, rotary_dim).to(device)
    with torch.no_grad():
        try:
            reference = fn(q, k, cos, sin)
        except Exception:  # noqa: BLE001 - HF's function does not take this shape
            return _REJECTED_SHAPE
        try:
            result = liger_rotary_pos_emb(q, k, cos, sin)
        except Exception as error:  # noqa: BLE001
            return f"the Liger RoPE kernel failed on a probe: {type(error).__name__}"
    if not (isinstance(reference, tuple) and len(reference) == 2):
        return f"{ROTARY_NAME} does not return (q, k)"
    for ours, theirs, name in zip(result, reference, "qk"):
        if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
            return f"{ROTARY_NAME} returns {name} of another shape"
        equal, error = _close(ours, theirs)
        if not equal:
            return f"{ROTARY_NAME} is not rotate-half RoPE (relative error {error:.1e} on {name})"
    return None


def rotary_dims(model: nn.Module) -> tuple[int, set[int]] | None:
    """(head_dim, the rotary dims of the text decoder's rotary embeddings, from their cos)."""
    config = model.config
    text_config = getattr(config, "get_text_config", lambda: config)()
    head_dim = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads)
    dims = set()
    for embedding in model.modules():
        if not type(embedding).__name__.endswith("RotaryEmbedding"):
            continue
        device = _probe_device(embedding) or torch.device("cpu")
        x = torch.zeros(1, 2, 1, device=device)
        positions = torch.arange(2, device=device)[None]
        for extra in [{}] + [{"layer_type": kind} for kind in getattr(embedding, "layer_types", ()) or ()]:
            try:
                with torch.no_grad():
                    cos, _ = embedding(x, positions, **extra)
            except Exception:  # noqa: BLE001 - another signature, or not materialised
                continue
            dims.add(int(cos.shape[-1]))
    return (int(head_dim), dims) if dims else None


# ----------------------------------------------------------------------------------------
# The head and loss
# ----------------------------------------------------------------------------------------
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"forward"}
_EXPERT_COUNT_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_SOFTCAP_ATTR = "final_logit_softcapping"


class _StubOutput(dict):
    """What the stub decoder returns: fields by name (missing ones are None), ``[i]`` over the
    fields that are set, like ``ModelOutput``."""

    __dataclass_fields__: dict = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            return [value for value in self.values() if value is not None][key]
        return dict.__getitem__(self, key)

    def to_tuple(self) -> tuple:
        return tuple(value for value in self.values() if value is not None)


class _StubDecoder(nn.Module):
    """Stands in for a model's decoder in the head probe: returns fixed outputs, whatever the inputs."""

    def __init__(self, outputs: _StubOutput, vocab: int, hidden: int) -> None:
        super().__init__()
        self.outputs = outputs
        self.embed_tokens = nn.Embedding(vocab, hidden)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, *args: Any, **kwargs: Any) -> _StubOutput:
        return self.outputs


def base_class(model: nn.Module) -> type:
    """``type(model)`` without the per-instance subclasses of a patch."""
    from liger_kernel.transformers.patching.binding import is_instance_class

    cls = type(model)
    while is_instance_class(cls):
        cls = cls.__bases__[0]
    return cls


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    return next((name for name, child in model.named_children() if child is head), None)


_HEAD_PROBES: dict[tuple, Any] = {}


def probe_head(model: nn.Module) -> Any:
    """The :class:`~liger_kernel.transformers.causal_lm.FusedLossSpec` whose fused forward
    equals ``model``'s own forward (loss, gradients, logits), or why there is none.

    Structure first: an ``nn.Linear`` output embedding that is a direct child, a decoder under
    ``base_model_prefix``, and a forward that calls the head and ``self.loss_function``. Then a
    probe on a stand-in instance of the model's class whose decoder is a stub returning random
    hidden states and whose head is a small random linear scaled so logits reach a soft-cap's
    range: the model's own forward and the fused one must give the same loss and the same
    gradients of the hidden states and the head weight (and the same router loss for MoE).
    Cached per class and configuration.
    """
    cls = base_class(model)
    key = (cls, model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else id(model))
    if key not in _HEAD_PROBES:
        _HEAD_PROBES[key] = _probe_head_uncached(model, cls)
    return _HEAD_PROBES[key]


def _source(fn: Callable) -> str:
    from liger_kernel.transformers.patching.binding import innermost

    try:
        return inspect.getsource(innermost(fn))
    except (OSError, TypeError):
        return ""


def _probe_head_uncached(model: nn.Module, cls: type) -> Any:
    from liger_kernel.transformers.causal_lm import FusedLossSpec
    from liger_kernel.transformers.distributed import unwrapped_class

    head_name = _head_name(model)
    if head_name is None:
        return "no output embedding among its direct children"
    head = getattr(model, head_name)
    if unwrapped_class(head) is not nn.Linear:
        return f"its output embedding is a {type(head).__name__}, not an nn.Linear"
    source = _source(cls.forward)
    if "self.loss_function(" not in source or f"self.{head_name}(" not in source:
        return "its forward does not compute logits with its head and call self.loss_function"
    # The decoder: the one other child the forward calls (``self.model(...)``), else the
    # model's base_model_prefix.
    called = [name for name in model._modules if name != head_name and f"self.{name}(" in source]
    prefix = called[0] if len(called) == 1 else getattr(model, "base_model_prefix", "")
    if prefix not in model._modules:
        return f"no decoder among its children (base_model_prefix {getattr(model, 'base_model_prefix', '')!r})"
    text_config = _text_config(model.config)
    softcap = _SOFTCAP_ATTR if (_SOFTCAP_ATTR in source and getattr(text_config, _SOFTCAP_ATTR, None)) else None
    aux = None
    experts_attr = "num_local_experts"
    if "load_balancing_loss_func" in source:
        aux = f"{cls.__module__}:load_balancing_loss_func"
        count = getattr(model, "num_experts", None)
        present = [name for name in _EXPERT_COUNT_ATTRS if isinstance(getattr(text_config, name, None), int)]
        matching = [name for name in present if getattr(text_config, name) == count]
        if not (matching or present):
            return "a router loss whose expert count is not in the config"
        experts_attr = (matching or present)[0]
    spec = FusedLossSpec(logit_softcap_attr=softcap, router_aux_loss_fn=aux, num_experts_attr=experts_attr,
                         decoder_attr=prefix)
    try:
        output_class, error = _compare_heads(model, cls, head_name, prefix, spec, text_config)
    except Exception as failure:  # noqa: BLE001 - a forward we cannot run on the probe stays HF's
        return f"its forward failed on the head probe: {type(failure).__name__}: {str(failure)[:120]}"
    if error is not None:
        return error
    import dataclasses

    return dataclasses.replace(spec, output_class=f"{output_class.__module__}:{output_class.__qualname__}",
                               extra_parameters=_extra_parameters(cls))


def _extra_parameters(cls: type) -> tuple[str, ...]:
    """The named parameters of ``cls.forward`` the fused forward does not name itself."""
    from liger_kernel.transformers.causal_lm import fused_loss_forward

    try:
        theirs = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return ()
    ours = inspect.signature(fused_loss_forward()).parameters
    return tuple(name for name, p in theirs.items() if name not in ours and name != "self"
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _compare_heads(model: nn.Module, cls: type, head_name: str, prefix: str, spec: Any,
                   text_config: Any) -> tuple[type, str | None]:
    import dataclasses

    from liger_kernel.transformers.causal_lm import fused_loss_forward

    batch, seq, hidden, vocab = 2, 6, 16, 40
    generator = torch.Generator().manual_seed(4)
    stand_in = cls.__new__(cls)
    nn.Module.__init__(stand_in)
    for name, value in vars(model).items():
        if name not in _MODULE_INTERNALS:
            stand_in.__dict__[name] = value
    config = copy.deepcopy(model.config)
    for target in {id(config): config, id(_text_config(config)): _text_config(config)}.values():
        if hasattr(target, "vocab_size"):
            target.vocab_size = vocab
    stand_in.config = config
    if isinstance(getattr(stand_in, "vocab_size", None), int):
        stand_in.vocab_size = vocab
    softcap = getattr(_text_config(config), spec.logit_softcap_attr, None) if spec.logit_softcap_attr else None
    scale = 3.0 * (softcap or 10.0) / hidden ** 0.5
    head = nn.Linear(hidden, vocab, bias=getattr(model, head_name).bias is not None)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=generator) * scale / 3.0)
        if head.bias is not None:
            head.bias.copy_(torch.randn(vocab, generator=generator))
    stand_in._modules[head_name] = head
    hidden_states = torch.randn(batch, seq, hidden, generator=generator, requires_grad=True)
    fields = _StubOutput(last_hidden_state=hidden_states)
    if spec.is_moe:
        experts = getattr(_text_config(config), spec.num_experts_attr)
        fields["router_logits"] = tuple(torch.randn(batch * seq, experts, generator=generator) for _ in range(2))
    stand_in._modules[prefix] = _StubDecoder(fields, vocab, hidden)
    stand_in.train()
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels = input_ids.clone()
    labels[0, :2] = -100
    common = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    if spec.is_moe:
        common["output_router_logits"] = True
    fused = fused_loss_forward(dataclasses.replace(spec, output_class=None))
    weights = [hidden_states, head.weight]
    for extra in ({}, {"num_items_in_batch": torch.tensor(9)}):
        reference = cls.forward(stand_in, **common, **extra)
        reference_grads = torch.autograd.grad(reference.loss, weights)
        for skip_logits in (True, False):
            ours = fused(stand_in, **common, **extra, skip_logits=skip_logits)
            equal, error = _close(ours.loss, reference.loss)
            if not equal:
                return type(reference), f"the fused loss differs from its forward's (relative error {error:.1e})"
            for grad, reference_grad, name in zip(torch.autograd.grad(ours.loss, weights), reference_grads,
                                                  ("hidden states", "head weight")):
                equal, error = _close(grad, reference_grad)
                if not equal:
                    return type(reference), f"the fused loss's {name} gradient differs (relative error {error:.1e})"
            if not skip_logits:
                equal, error = _close(ours.logits, reference.logits)
                if not equal:
                    return type(reference), f"its logits differ from lm_head's (relative error {error:.1e})"
    return type(reference), None
