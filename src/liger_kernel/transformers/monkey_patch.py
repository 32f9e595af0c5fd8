"""One-line patching of Hugging Face models with the Liger kernels.

``apply_liger_kernel_to_<family>(rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
rms_norm=True, swiglu=True, model=None)`` (``geglu=True`` instead of ``swiglu`` for Gemma
families) exists for every entry of :data:`liger_kernel.transformers.families.FAMILIES`; all
of them are generated from that table and run the same code below.

Two modes:

* ``model=None`` (class level) replaces names in the family's modeling module, so models
  built afterwards use the kernels: the RMSNorm class, the MLP class (fused experts keep their
  class, whose ``forward``/``_apply_gate`` are replaced so that only the activation changes:
  HF's ``_init_weights`` tests ``isinstance`` against that class), the module-level rotary function, the
  ``*ForCausalLM.forward`` (fused linear cross entropy, :mod:`causal_lm`) and, with
  ``cross_entropy=True``, the class's ``loss_function``. Everything replaced is recorded and
  :func:`revert_liger_kernel` / :func:`liger_kernel_patched` put the originals back.
* ``model=<instance>`` patches that instance in place and leaves every other instance alone:
  every norm and MLP of the model is switched to a cached subclass of its own class that
  defines the Liger ``forward`` (same class name, so HF's name-based checks still hold; it
  survives ``copy.deepcopy``, pickle and ``torch.save``/``torch.load`` and works with
  gradient checkpointing and ``generate()``, and, unlike a method stored in the instance
  ``__dict__``, makes no reference cycle that would keep a deleted model's memory alive), the
  model gets the fused-loss forward - also a user subclass of the family's ``*ForCausalLM``
  (found through the MRO), unless that subclass defines its own ``forward``. Rotary embeddings
  are applied by a module-level function the attention forward looks up in its globals, so
  for an instance each attention module gets a copy of its own ``forward`` whose globals map
  the rotary name to the Liger kernel (decorators such as ``deprecate_kwarg`` are rebuilt
  around the copy) - the class, the module and other instances are untouched.

Pickling: the Liger classes the class-level patch builds (``LigerLlamaRMSNorm``, ...) are
resolved by this module's ``__getattr__``, and the instance-level subclasses reduce to their
base class plus the patched methods, so a patched model saved whole loads, still patched, in a
process that has not patched anything (a class-level ``forward`` or rotary patch is a property
of the process, not of the model: patch the loading process the same way for those).

Trainer integration: transformers calls ``_apply_liger_kernel_to_instance(model=..., **config)``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from liger_kernel.transformers.causal_lm import (
    _hf_slice_logits_to_keep,
    liger_causal_lm_forward,
    liger_causal_lm_loss,
)
from liger_kernel.transformers.families import FAMILIES, ModelFamily, NormSpec

logger = logging.getLogger(__name__)

__all__ = [
    "MODEL_TYPE_TO_APPLY_LIGER_FN",
    "_apply_liger_kernel",
    "_apply_liger_kernel_to_instance",
    "liger_kernel_patched",
    "liger_patched_modules",
    "revert_liger_kernel",
] + [f"apply_liger_kernel_to_{model_type}" for model_type in FAMILIES]


# ----------------------------------------------------------------------------------------
# Record of class-level patches: model_type -> {(id(owner), attribute): (owner, attribute,
# original value, whether the attribute existed in owner.__dict__)}. Only the first patch of
# an attribute is recorded, so the record always holds the true original.
# ----------------------------------------------------------------------------------------
_MISSING = object()
_PATCHED: dict[str, dict[tuple[int, str], tuple[Any, str, Any]]] = {}


def _set_patched(model_type: str, owner: Any, name: str, value: Any) -> None:
    record = _PATCHED.setdefault(model_type, {})
    key = (id(owner), name)
    if key not in record:
        record[key] = (owner, name, vars(owner).get(name, _MISSING))
    setattr(owner, name, value)


def _restore(owner: Any, name: str, value: Any) -> None:
    if value is _MISSING:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, value)


def _original(model_type: str, owner: Any, name: str) -> Any:
    """``owner.name`` as it was before any Liger patch."""
    saved = _PATCHED.get(model_type, {}).get((id(owner), name))
    if saved is not None and saved[2] is not _MISSING:
        return saved[2]
    return getattr(owner, name)


def revert_liger_kernel(model_type: str | None = None) -> None:
    """Undo the class-level patches of ``model_type`` (all families when None).

    Models built while patched keep their Liger modules; instance-level patches are not
    recorded and stay (build a fresh model to get the original).
    """
    model_types = list(_PATCHED) if model_type is None else [model_type]
    for mt in model_types:
        for owner, name, value in reversed(list(_PATCHED.pop(mt, {}).values())):
            _restore(owner, name, value)


@contextlib.contextmanager
def liger_kernel_patched(model_type: str, **kwargs: Any) -> Iterator[None]:
    """Context manager: class-level patch of ``model_type`` for the ``with`` block only.

    ``kwargs`` are the options of ``apply_liger_kernel_to_<model_type>`` (``model`` excluded).
    On exit every attribute is put back to what it was on entry, so an enclosing patch of
    the same family survives.
    """
    if "model" in kwargs:
        raise TypeError("liger_kernel_patched patches classes; use _apply_liger_kernel_to_instance for a model")
    before = {key: (owner, name, vars(owner).get(name, _MISSING))
              for key, (owner, name, _) in _PATCHED.get(model_type, {}).items()}
    _apply_liger_kernel(model_type, **kwargs)
    try:
        yield
    finally:
        record = _PATCHED.get(model_type, {})
        for key in reversed(list(record)):
            owner, name, original = record[key]
            if key in before:
                _restore(owner, name, before[key][2])
            else:
                _restore(owner, name, original)
                del record[key]
        if not record:
            _PATCHED.pop(model_type, None)


# ----------------------------------------------------------------------------------------
# Liger replacements built from the table.
# ----------------------------------------------------------------------------------------
def _modeling(family: ModelFamily) -> types.ModuleType:
    return importlib.import_module(family.modeling_module)


def _activation_supported(config: Any, family: ModelFamily) -> bool:
    return getattr(config, family.mlp.activation_attr, None) in family.mlp.activations


def _warn_unsupported_activation(config: Any, family: ModelFamily) -> None:
    spec = family.mlp
    logger.warning(
        "%s: %s=%r is not one of %s, which the Liger %s kernel reproduces; keeping the HF MLP.",
        family.model_type, spec.activation_attr, getattr(config, spec.activation_attr, None),
        spec.activations, spec.option,
    )


@functools.cache
def _liger_norm_class(model_type: str) -> type:
    """A :class:`LigerRMSNorm` subclass built like the family's norm: ``cls(hidden_size, eps)``.

    Its name keeps ``RMSNorm`` in it, which is how HF's ``_init_weights`` recognises norms.
    """
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    spec: NormSpec = FAMILIES[model_type].norm

    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs: Any) -> None:
        LigerRMSNorm.__init__(
            self, hidden_size, eps=eps, offset=spec.offset, casting_mode=spec.casting_mode,
            init_fn=spec.init_fn, in_place=spec.in_place, **kwargs,
        )

    name = f"Liger{spec.class_name}"
    return type(name, (LigerRMSNorm,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})


def _liger_mlp_base(family: ModelFamily) -> type:
    spec = family.mlp
    module = importlib.import_module(f"liger_kernel.transformers.{spec.liger_module}")
    return getattr(module, spec.liger_class)


def liger_apply_gate(self: nn.Module, gate_up_out: Any) -> Any:
    """``act(gate) * up`` of a fused (..., 2I) gate-up projection (gate first).

    Replaces HF's ``_apply_gate`` of fused-expert modules (``use_experts_implementation``):
    with a SiLU activation the product runs as the Liger SiLU-mul kernel, any other
    activation keeps HF's formula (the class-level patch cannot see the config beforehand).
    """
    gate, up = gate_up_out.chunk(2, dim=-1)
    family = FAMILIES.get(getattr(self.config, "model_type", None))
    if family is None or not _activation_supported(self.config, family):
        return self.act_fn(gate) * up
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(gate, up)


def _eager_experts_forward(self: nn.Module, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """HF's eager fused-experts loop, with the gate applied through ``self._apply_gate``.

    ``hidden_states`` (S, H), ``top_k_index``/``top_k_weights`` (S, K). The same steps as
    ``MixtralExperts.forward`` (transformers 5.17-5.24): an index equal to ``num_experts``
    marks a token routed to another (expert-parallel) rank and is skipped; 5.17 never emits it.
    """
    import torch
    import torch.nn.functional as F

    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        gated = self._apply_gate(F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]))
        expert_out = F.linear(gated, self.down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, expert_out.to(final_hidden_states.dtype))
    return final_hidden_states


def liger_experts_forward(self: nn.Module, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """Fused-experts forward dispatching like HF's ``use_experts_implementation``.

    ``config._experts_implementation`` picks HF's grouped/batched matmul kernels (which call
    ``self._apply_gate``, here the Liger activation) or, for ``"eager"``, the loop above.
    """
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    implementation = getattr(self.config, "_experts_implementation", None)
    forward = ALL_EXPERTS_FUNCTIONS.get_interface(implementation, _eager_experts_forward)
    return forward(self, hidden_states, top_k_index, top_k_weights)


@functools.cache
def _liger_mlp_class(model_type: str, hf_class: type) -> type:
    """The class replacing the family's MLP class in its modeling module.

    Built from ``config`` like the HF class. For a config whose activation the kernel does not
    reproduce, construction returns the HF class instead (``__new__``), so patching never
    changes the math of such a model.
    """
    family = FAMILIES[model_type]

    def __new__(cls, config: Any = None, *args: Any, **kwargs: Any):
        # copy.deepcopy / pickle call cls.__new__(cls) without arguments.
        if config is not None and not _activation_supported(config, family):
            _warn_unsupported_activation(config, family)
            return hf_class(config, *args, **kwargs)
        return nn.Module.__new__(cls)

    name = f"Liger{family.mlp.class_name}"
    namespace = {"__new__": __new__, "__module__": __name__, "__qualname__": name}
    return type(name, (_liger_mlp_base(family),), namespace)


def _liger_class_builders() -> dict[str, Callable[[], type]]:
    builders: dict[str, Callable[[], type]] = {}

    def add(name: str, build: Callable[[], type]) -> None:
        if name in builders:
            raise ValueError(f"two families' Liger classes would both be named {name!r}")
        builders[name] = build

    for model_type, family in FAMILIES.items():
        add(f"Liger{family.norm.class_name}", functools.partial(_liger_norm_class, model_type))
        if family.mlp.kind != "experts":
            add(f"Liger{family.mlp.class_name}", functools.partial(_build_liger_mlp_class, model_type))
    return builders


def _build_liger_mlp_class(model_type: str) -> type:
    family = FAMILIES[model_type]
    return _liger_mlp_class(model_type, _original(model_type, _modeling(family), family.mlp.class_name))


# Qualified name -> builder of each class above. Pickle (and torch.save) stores a class as
# module + qualified name and loads it with getattr on the module; these classes exist only
# once a patch built them, so the module's __getattr__ builds them on demand - the same
# (cached) class in this process, a fresh one in a process that has patched nothing yet.
_LIGER_CLASS_BUILDERS = _liger_class_builders()


def __getattr__(name: str) -> type:
    build = _LIGER_CLASS_BUILDERS.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return build()


# ----------------------------------------------------------------------------------------
# Instance patching.
# ----------------------------------------------------------------------------------------
# (original class, sorted method overrides) -> the subclass instances are switched to.
_INSTANCE_CLASSES: dict[tuple[type, tuple[tuple[str, Callable], ...]], type] = {}


def _instance_class(base: type, overrides: dict[str, Callable]) -> type:
    """The cached subclass of ``base`` that defines the methods ``overrides`` (see :func:`_bind`)."""
    if any(_innermost(fn) is liger_causal_lm_forward for fn in overrides.values()):
        # Looked up now (binding or unpickling), not in the forward: torch.compile cannot trace it there.
        _hf_slice_logits_to_keep()
    key = (base, tuple(sorted(overrides.items(), key=lambda item: item[0])))
    patched = _INSTANCE_CLASSES.get(key)
    if patched is None:
        namespace = {**overrides, "_liger_overrides": dict(overrides), "__reduce_ex__": _reduce_instance_patched,
                     "__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__}
        patched = type(base.__name__, (base,), namespace)
        _INSTANCE_CLASSES[key] = patched
    return patched


def _reduce_instance_patched(self: nn.Module, protocol: int) -> Any:
    """``__reduce_ex__`` of the classes :func:`_instance_class` makes (pickle, ``torch.save``,
    ``copy.deepcopy``).

    Pickle stores a class as its module and qualified name, which for these classes name the
    base class (HF needs the names): the instance's own reduction would fail with "not the
    same object". The reduction is therefore rewritten to name the base class and the
    overrides - each a function pickle finds by name, or for a RoPE-patched forward the
    original function and the globals it sees (:func:`with_global_overrides`) - and loading
    it rebuilds the subclass (the cached one when it exists, so ``deepcopy`` keeps the class).
    """
    owner = next(cls for cls in type(self).__mro__ if "_liger_overrides" in vars(cls))
    reduced = super(owner, self).__reduce_ex__(protocol)
    # copyreg.__newobj__(cls, *args) (protocol >= 2) or copyreg._reconstructor(cls, ...); a
    # reduction that does not start with this class (a base's own __reduce__, or a further
    # subclass such as FSDP2's) is left alone.
    if not isinstance(reduced, tuple) or len(reduced) < 2 or not reduced[1] or reduced[1][0] is not owner:
        return reduced
    factory, args, *rest = reduced
    recipe = tuple((name, *_function_recipe(fn)) for name, fn in sorted(owner._liger_overrides.items()))
    return (_rebuild_instance_patched, (owner.__bases__[0], recipe, factory, args[1:]), *rest)


def _function_recipe(fn: Callable) -> tuple[Callable, tuple[tuple[str, Any], ...] | None]:
    """``(function pickle finds by name, its global overrides or None)`` rebuilding ``fn``."""
    source = _REBOUND_SOURCES.get(fn)
    return source if source is not None else (fn, None)


def _rebuild_instance_patched(
    base: type, recipe: tuple[tuple[str, Callable, tuple[tuple[str, Any], ...] | None], ...],
    factory: Callable[..., Any], args: tuple[Any, ...],
) -> nn.Module:
    """Inverse of :func:`_reduce_instance_patched`: ``factory(<patched subclass of base>, *args)``."""
    overrides = {name: fn if global_overrides is None else with_global_overrides(fn, dict(global_overrides))
                 for name, fn, global_overrides in recipe}
    return factory(_instance_class(base, overrides), *args)


def _bind(module: nn.Module, name: str, fn: Callable) -> None:
    """Make this one ``module`` use ``fn`` as its method ``name``.

    The instance's class is switched to a cached subclass that defines the method and keeps
    the original's ``__name__``/``__qualname__``/``__module__`` (HF matches classes by name:
    ``_init_weights``, ``config.architectures``), so ``isinstance`` holds, other instances
    and the original class are untouched, and ``copy.deepcopy``, pickle and ``torch.save``
    keep the patch (:func:`_reduce_instance_patched`). A bound method stored in the instance
    ``__dict__`` would instead form a reference cycle (module -> method -> module): a patched
    model would then outlive ``del model`` until the garbage collector's next full pass,
    holding its GPU memory.
    """
    cls = type(module)
    own = cls.__dict__.get("_liger_overrides")
    base = cls.__bases__[0] if own is not None else cls
    module.__class__ = _instance_class(base, {**(own or {}), name: fn})
    if name in vars(module):
        if name == "forward" and "_old_forward" in vars(module) and getattr(module, "_hf_hook", None) is not None:
            # An accelerate hook (device_map dispatch, offload) calls module._old_forward
            # between its pre- and post-forward: route that call to the patched method. (The
            # hook's own partial already holds the module in a cycle.)
            module._old_forward = types.MethodType(fn, module)
        else:
            logger.warning("%s has an instance-level %r that shadows the Liger patch; it keeps that one",
                           base.__name__, name)


def _instance_patched(module: nn.Module, name: str = "forward") -> bool:
    """Whether ``_bind`` gave this module its own ``name``."""
    return name in type(module).__dict__.get("_liger_overrides", {})


def liger_patched_modules(model: nn.Module) -> list[str]:
    """Names of ``model``'s submodules (``""`` for the model itself) whose ``forward`` is Liger
    code: patched on the instance, built from a Liger class, or of a class whose ``forward`` a
    class-level patch replaced. (A class-level RoPE patch swaps the modeling module's rotary
    function, not a forward: attention modules are listed only when patched on the instance.)"""
    class_level = (liger_causal_lm_forward, liger_experts_forward)
    return [name for name, module in model.named_modules()
            if _instance_patched(module) or type(module).__name__.startswith("Liger")
            or getattr(type(module), "forward", None) in class_level]


def _patch_norm_instance(module: nn.Module, spec: NormSpec) -> None:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    module.offset = spec.offset
    module.casting_mode = spec.casting_mode
    module.in_place = spec.in_place
    _bind(module, "forward", LigerRMSNorm.forward)
    _bind(module, "extra_repr", LigerRMSNorm.extra_repr)
    module._liger_patched = True


def _resolve(root: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def _decoder_layers(base_model: nn.Module) -> list[nn.Module]:
    layers = getattr(base_model, "layers", None)
    return list(layers) if layers is not None else []


def _patch_norms(model: nn.Module, family: ModelFamily) -> int:
    spec = family.norm
    base_model = model.base_model
    norms = [_resolve(base_model, spec.final_attr)]
    for layer in _decoder_layers(base_model):
        norms.extend(_resolve(layer, path) for path in spec.layer_attrs)
    patched = 0
    for norm in norms:
        if norm is not None and type(norm).__name__ == spec.class_name:
            _patch_norm_instance(norm, spec)
            patched += 1
    # The table lists where the norms sit; a norm it misses means the HF layout changed.
    for name, module in model.named_modules():
        if type(module).__name__ == spec.class_name and not getattr(module, "_liger_patched", False):
            logger.warning("%s: norm %r is not listed in the family table; patching it anyway.",
                           family.model_type, name)
            _patch_norm_instance(module, spec)
            patched += 1
    return patched


def _patch_mlps(model: nn.Module, family: ModelFamily) -> int:
    spec = family.mlp
    if not _activation_supported(model.config, family):
        _warn_unsupported_activation(model.config, family)
        return 0
    patched = 0
    for layer in _decoder_layers(model.base_model):
        block = getattr(layer, spec.layer_attr, None)
        if spec.kind == "experts":
            target = getattr(block, spec.experts_attr, None)
            if target is None or type(target).__name__ != spec.class_name:
                continue
            _bind(target, "forward", liger_experts_forward)
            _bind(target, "_apply_gate", liger_apply_gate)
        else:
            if block is None or type(block).__name__ != spec.class_name:
                continue
            _bind(block, "forward", _liger_mlp_base(family).forward)
        patched += 1
    return patched


def _innermost(fn: Callable) -> Callable:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


_REBOUND: dict[tuple[Callable, tuple[tuple[str, Any], ...]], Callable] = {}
# The inverse, for pickling: rebound function -> (the function it copies, its overrides).
_REBOUND_SOURCES: dict[Callable, tuple[Callable, tuple[tuple[str, Any], ...]]] = {}


def with_global_overrides(fn: Callable, overrides: dict[str, Any]) -> Callable:
    """A copy of ``fn`` whose global-name lookups see ``overrides`` (``fn`` itself is unchanged).

    ``functools.wraps`` decorator chains are followed through ``__wrapped__``: the innermost
    function is copied with a globals dict ``{**its module globals, **overrides}`` and each
    wrapper is copied with its closure cell pointing at the new inner function.
    """
    key = (fn, tuple(sorted(overrides.items())))
    if key in _REBOUND:
        return _REBOUND[key]
    inner = getattr(fn, "__wrapped__", None)
    closure = fn.__closure__
    fn_globals = fn.__globals__
    if inner is not None:
        new_inner = with_global_overrides(inner, overrides)
        cells = list(closure or ())
        holds_inner = [i for i, cell in enumerate(cells) if _cell_value(cell) is inner]
        if not holds_inner:
            raise TypeError(f"cannot rebuild decorator {fn.__qualname__}: its closure does not hold the wrapped function")
        for i in holds_inner:
            cells[i] = types.CellType(new_inner)
        closure = tuple(cells)
    else:
        # Without ``__name__``: torch.compile (Dynamo) resolves the globals of a function whose
        # globals name a module through that module (sys.modules[__name__]), i.e. it would
        # read HF's rotary function and guard on it. A nameless dict is used as the dict it is.
        fn_globals = {name: value for name, value in {**fn_globals, **overrides}.items() if name != "__name__"}
    new_fn = types.FunctionType(fn.__code__, fn_globals, fn.__name__, fn.__defaults__, closure)
    new_fn.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    functools.update_wrapper(new_fn, fn)
    if inner is not None:
        new_fn.__wrapped__ = new_inner
    else:
        del new_fn.__wrapped__
    _REBOUND[key] = new_fn
    _REBOUND_SOURCES[new_fn] = (fn, key[1])
    return new_fn


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


def _patch_rope_instances(model: nn.Module, family: ModelFamily) -> int:
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    modeling = _modeling(family)
    overrides = {family.rotary_fn: liger_rotary_pos_emb}
    patched = 0
    for module in model.modules():
        forward = type(module).forward
        inner = _innermost(forward)
        uses_rotary = (
            getattr(inner, "__globals__", None) is vars(modeling)
            and family.rotary_fn in getattr(getattr(inner, "__code__", None), "co_names", ())
        )
        if uses_rotary:
            _bind(module, "forward", with_global_overrides(forward, overrides))
            patched += 1
    return patched


def _causal_lm_in_mro(model: nn.Module, family: ModelFamily) -> tuple[type | None, type | None]:
    """``(the family's *ForCausalLM class, a subclass below it that defines forward)`` in
    ``type(model)``'s MRO, each None when absent.

    Matched by name, like every HF class here, and through the MRO so that a user subclass
    (``class MyLlama(LlamaForCausalLM): ...``) is patched too. A subclass with its own
    ``forward`` keeps it: binding the fused-loss forward would silently drop that code.
    """
    mro = type(model).__mro__
    for index, cls in enumerate(mro):
        if cls.__name__ == family.causal_lm_class and "_liger_overrides" not in vars(cls):
            below = [c for c in mro[:index] if "forward" in vars(c) and "_liger_overrides" not in vars(c)]
            return cls, (below[0] if below else None)
    return None, None


def _patch_instance(
    family: ModelFamily, model: nn.Module, rope: bool, cross_entropy: bool, fused_linear_cross_entropy: bool,
    rms_norm: bool, gated_mlp: bool, recompute_norm_outputs: bool = True,
) -> None:
    model = _unwrap_peft(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type != family.model_type:
        raise ValueError(
            f"apply_liger_kernel_to_{family.model_type} got a model of model_type {model_type!r}; "
            "use _apply_liger_kernel_to_instance to dispatch on the model's own type"
        )
    counts = {}
    if rms_norm:
        counts["rms_norm"] = _patch_norms(model, family)
    if gated_mlp:
        counts[family.mlp.option] = _patch_mlps(model, family)
    if rope:
        counts["rope"] = _patch_rope_instances(model, family)
    causal_lm, overriding = _causal_lm_in_mro(model, family)
    is_causal_lm = causal_lm is not None
    if fused_linear_cross_entropy and is_causal_lm and overriding is not None:
        logger.warning("%s defines its own forward, which the Liger fused-loss forward would replace; "
                       "keeping it (the loss is not fused).", overriding.__qualname__)
    elif fused_linear_cross_entropy and is_causal_lm:
        _bind(model, "forward", liger_causal_lm_forward)
        model._liger_recompute_norm_outputs = bool(recompute_norm_outputs)
        counts["fused_linear_cross_entropy"] = 1
    if cross_entropy and is_causal_lm:
        model.loss_function = liger_causal_lm_loss
        counts["cross_entropy"] = 1
    logger.info("Liger kernels applied to a %s instance: %s", family.model_type, counts)


def _patch_classes(
    family: ModelFamily, rope: bool, cross_entropy: bool, fused_linear_cross_entropy: bool, rms_norm: bool,
    gated_mlp: bool, recompute_norm_outputs: bool = True,
) -> None:
    mt = family.model_type
    modeling = _modeling(family)
    if rope:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        _set_patched(mt, modeling, family.rotary_fn, liger_rotary_pos_emb)
    if rms_norm:
        _set_patched(mt, modeling, family.norm.class_name, _liger_norm_class(mt))
    if gated_mlp and family.mlp.kind == "experts":
        # Patched on the class itself, not by a subclass: HF's _init_weights tests
        # isinstance(module, <ExpertsClass>) against the module-level name.
        experts = getattr(modeling, family.mlp.class_name)
        _set_patched(mt, experts, "forward", liger_experts_forward)
        _set_patched(mt, experts, "_apply_gate", liger_apply_gate)
    elif gated_mlp:
        hf_class = _original(mt, modeling, family.mlp.class_name)
        _set_patched(mt, modeling, family.mlp.class_name, _liger_mlp_class(mt, hf_class))
    causal_lm = getattr(modeling, family.causal_lm_class)
    if fused_linear_cross_entropy:
        _hf_slice_logits_to_keep()  # looked up now, not in the forward: torch.compile cannot trace it there
        _set_patched(mt, causal_lm, "forward", liger_causal_lm_forward)
        _set_patched(mt, causal_lm, "_liger_recompute_norm_outputs", bool(recompute_norm_outputs))
    if cross_entropy:
        # PreTrainedModel.loss_function returns self._loss_function when it exists.
        _set_patched(mt, causal_lm, "_loss_function", staticmethod(liger_causal_lm_loss))


def _unwrap_peft(model: nn.Module) -> nn.Module:
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


# ----------------------------------------------------------------------------------------
# The public apply functions, one per family, generated from the table.
# ----------------------------------------------------------------------------------------
def _make_apply_fn(family: ModelFamily) -> Callable[..., None]:
    option = family.mlp.option
    parameters = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)
        for name, default, annotation in (
            ("rope", True, "bool"),
            ("cross_entropy", False, "bool"),
            ("fused_linear_cross_entropy", True, "bool"),
            ("rms_norm", True, "bool"),
            (option, True, "bool"),
            ("model", None, "PreTrainedModel | None"),
            ("recompute_norm_outputs", True, "bool"),
        )
    ]
    signature = inspect.Signature(parameters, return_annotation="None")

    def apply(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        if options["cross_entropy"] and options["fused_linear_cross_entropy"]:
            raise ValueError("cross_entropy and fused_linear_cross_entropy cannot both be True.")
        model = options.pop("model")
        gated_mlp = options.pop(option)
        if model is None:
            _patch_classes(family, gated_mlp=gated_mlp, **options)
        else:
            _patch_instance(family, model, gated_mlp=gated_mlp, **options)

    apply.__name__ = apply.__qualname__ = f"apply_liger_kernel_to_{family.model_type}"
    apply.__module__ = __name__
    apply.__signature__ = signature
    apply.__doc__ = f"""Patch {family.model_type} models ({family.causal_lm_class}) with Liger kernels.

    Args:
        rope: rotary embedding kernel for ``{family.rotary_fn}``.
        cross_entropy: Liger cross entropy as the model's loss function (logits materialised).
        fused_linear_cross_entropy: fused lm-head + cross-entropy forward (no logits in training).
            Mutually exclusive with ``cross_entropy``.
        rms_norm: Liger RMSNorm for ``{family.norm.class_name}`` (offset {family.norm.offset},
            casting {family.norm.casting_mode!r}).
        {option}: Liger {option} kernel in ``{family.mlp.class_name}``.
        model: an instance to patch in place; None patches the modeling module (class level,
            undone by ``revert_liger_kernel({family.model_type!r})``).
        recompute_norm_outputs: with the fused forward, the norm outputs that the projections
            save for backward are recomputed there instead of kept (bitwise the same values;
            2 x tokens x hidden elements less memory per layer). Not entered under autocast
            that casts the residual stream (Trainer ``bf16=True`` over fp32 weights), where the
            projections save casts instead. See :mod:`liger_kernel.transformers.recompute`.
    """
    return apply


MODEL_TYPE_TO_APPLY_LIGER_FN: dict[str, Callable[..., None]] = {
    model_type: _make_apply_fn(family) for model_type, family in FAMILIES.items()
}
globals().update({fn.__name__: fn for fn in MODEL_TYPE_TO_APPLY_LIGER_FN.values()})


def _accepted_kwargs(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    accepted = set(inspect.signature(fn).parameters)
    dropped = sorted(set(kwargs) - accepted)
    if dropped:
        logger.warning("%s does not take %s; ignoring them.", fn.__name__, ", ".join(dropped))
    return {name: value for name, value in kwargs.items() if name in accepted}


def _apply_liger_kernel(model_type: str, **kwargs: Any) -> None:
    """Class-level patch of ``model_type`` (``config.model_type``) with the options it accepts.

    Options an apply function does not take (e.g. ``swiglu`` for Gemma) are dropped with a
    warning; an unsupported ``model_type`` logs a warning and patches nothing.
    """
    kwargs.pop("model", None)
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply_fn is None:
        logger.warning("No Liger kernels for model_type %r; supported: %s.", model_type,
                       ", ".join(MODEL_TYPE_TO_APPLY_LIGER_FN))
        return
    apply_fn(**_accepted_kwargs(apply_fn, kwargs))


def _apply_liger_kernel_to_instance(model: nn.Module, **kwargs: Any) -> None:
    """Patch ``model`` (a ``PreTrainedModel`` or a PEFT wrapper of one) in place for its own model type."""
    model = _unwrap_peft(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply_fn is None:
        logger.warning("No Liger kernels for model_type %r; the model is left as is.", model_type)
        return
    kwargs.pop("model", None)
    apply_fn(model=model, **_accepted_kwargs(apply_fn, kwargs))
