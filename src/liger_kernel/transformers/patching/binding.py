"""Per-instance method replacement that survives ``copy.deepcopy``, pickle and ``torch.save``.

:func:`bind_method` makes one module use another function as one of its methods by switching
the instance's class to a cached subclass that defines it. The subclass keeps the original's
``__name__``/``__qualname__``/``__module__`` (Hugging Face matches classes by name:
``_init_weights``, ``config.architectures``), so ``isinstance`` holds, other instances and the
original class are untouched, and gradient checkpointing and ``generate()`` work. Unlike a
bound method stored in the instance ``__dict__`` it makes no reference cycle (module ->
method -> module) that would keep a deleted model's memory alive until the next full
garbage-collector pass.

Functions built for a patch (a forward specialised on its options, a copy of an attention
forward whose globals see the Liger rotary kernel: :func:`with_global_overrides`) carry a
``_liger_recipe`` ``(builder, args)``: pickling stores the recipe, loading calls
``builder(*args)`` again, so a patched model saved whole loads, still patched, in a process
that has patched nothing.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from liger_kernel.ops.module_attributes import set_attribute

logger = logging.getLogger(__name__)

_RECIPE_ATTRIBUTE = "_liger_recipe"

# (original class, sorted method overrides) -> the subclass instances are switched to.
_INSTANCE_CLASSES: dict[tuple[type, tuple[tuple[str, Callable], ...]], type] = {}


def set_recipe(fn: Callable, builder: Callable, *args: Any) -> Callable:
    """Record on the built function ``fn`` that ``builder(*args)`` rebuilds it (for pickling);
    ``builder`` must be importable by name and ``args`` picklable. Returns ``fn``."""
    setattr(fn, _RECIPE_ATTRIBUTE, (builder, args))
    return fn


def recipe_of(fn: Callable) -> tuple[Callable, tuple[Any, ...]] | None:
    """The ``(builder, args)`` recorded by :func:`set_recipe`, or None for a plain function."""
    recipe = getattr(fn, _RECIPE_ATTRIBUTE, None)
    return recipe if isinstance(recipe, tuple) and len(recipe) == 2 else None


def _instance_class(base: type, overrides: dict[str, Callable]) -> type:
    """The cached subclass of ``base`` that defines the methods ``overrides``."""
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
    overrides - each a function pickle finds by name, or the recipe of a built one - and
    loading it rebuilds the subclass (the cached one when it exists, so ``deepcopy`` keeps
    the class).
    """
    # The class _instance_class made (a subclass of the module's class): the first holding overrides.
    owner = next(cls for cls in type(self).__mro__ if "_liger_overrides" in vars(cls) and issubclass(cls, nn.Module))
    reduced = super(owner, self).__reduce_ex__(protocol)
    # copyreg.__newobj__(cls, *args) (protocol >= 2) or copyreg._reconstructor(cls, ...); a
    # reduction that does not start with this class (a base's own __reduce__, or a further
    # subclass such as FSDP2's) is left alone.
    if not isinstance(reduced, tuple) or len(reduced) < 2 or not reduced[1] or reduced[1][0] is not owner:
        return reduced
    factory, args, *rest = reduced
    recipes = tuple((name, fn, recipe_of(fn)) for name, fn in sorted(owner._liger_overrides.items()))
    recipes = tuple((name, fn if recipe is None else None, recipe) for name, fn, recipe in recipes)
    return (_rebuild_instance_patched, (owner.__bases__[0], recipes, factory, args[1:]), *rest)


def _rebuild_instance_patched(
    base: type, recipes: tuple[tuple[str, Callable | None, tuple[Callable, tuple[Any, ...]] | None], ...],
    factory: Callable[..., Any], args: tuple[Any, ...],
) -> nn.Module:
    """Inverse of :func:`_reduce_instance_patched`: ``factory(<patched subclass of base>, *args)``."""
    overrides = {name: _rebuilt_override(fn, recipe) for name, fn, recipe in recipes}
    return factory(_instance_class(base, overrides), *args)


def _rebuilt_override(fn: Callable | None, recipe: tuple[Callable, tuple[Any, ...]] | None) -> Callable:
    """An override as :func:`_reduce_instance_patched` stored it: the function, or its recipe rebuilt."""
    if recipe is not None:
        return recipe[0](*recipe[1])
    if fn is None:
        raise TypeError("a pickled Liger-patched module names an override with neither a function nor a recipe")
    return fn


def bind_method(module: nn.Module, name: str, fn: Callable) -> None:
    """Make this one ``module`` use ``fn`` as its method ``name`` (see the module docstring)."""
    cls = type(module)
    own = cls.__dict__.get("_liger_overrides")
    base = cls.__bases__[0] if own is not None else cls
    module.__class__ = _instance_class(base, {**(own or {}), name: fn})
    if name in vars(module):
        if name == "forward" and "_old_forward" in vars(module) and getattr(module, "_hf_hook", None) is not None:
            # An accelerate hook (device_map dispatch, offload) calls module._old_forward
            # between its pre- and post-forward: route that call to the patched method. (The
            # hook's own partial already holds the module in a cycle.)
            set_attribute(module, "_old_forward", types.MethodType(fn, module))
        else:
            logger.warning("%s has an instance-level %r that shadows the Liger patch; it keeps that one",
                           base.__name__, name)


def instance_patched(module: nn.Module, name: str = "forward") -> bool:
    """Whether :func:`bind_method` gave this module its own ``name``."""
    return name in type(module).__dict__.get("_liger_overrides", {})


def is_instance_class(cls: type) -> bool:
    """Whether ``cls`` is one of the per-instance subclasses :func:`bind_method` switches to."""
    return "_liger_overrides" in vars(cls)


def innermost(fn: Callable) -> Callable:
    """``fn`` with every ``functools.wraps`` layer (``__wrapped__``) removed."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


_REBOUND: dict[tuple[Callable, tuple[tuple[str, Any], ...]], Callable] = {}


def with_global_overrides(fn: Callable, overrides: dict[str, Any] | tuple[tuple[str, Any], ...]) -> Callable:
    """A copy of ``fn`` whose global-name lookups see ``overrides`` (``fn`` itself is unchanged).

    ``functools.wraps`` decorator chains are followed through ``__wrapped__``: the innermost
    function is copied with a globals dict ``{**its module globals, **overrides}`` and each
    wrapper is copied with its closure cell pointing at the new inner function. Cached: the
    same ``(fn, overrides)`` gives the same copy.
    """
    items = tuple(sorted(dict(overrides).items()))
    key = (fn, items)
    if key in _REBOUND:
        return _REBOUND[key]
    inner = getattr(fn, "__wrapped__", None)
    closure = fn.__closure__
    fn_globals = fn.__globals__
    if inner is not None:
        new_inner = with_global_overrides(inner, items)
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
        fn_globals = {name: value for name, value in {**fn_globals, **dict(items)}.items() if name != "__name__"}
    new_fn = types.FunctionType(fn.__code__, fn_globals, fn.__name__, fn.__defaults__, closure)
    new_fn.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    wrapper = functools.update_wrapper(new_fn, fn)  # new_fn itself, typed with the __wrapped__ it set
    if inner is not None:
        wrapper.__wrapped__ = new_inner
    else:
        del wrapper.__wrapped__
    set_recipe(new_fn, with_global_overrides, fn, items)
    _REBOUND[key] = new_fn
    return new_fn


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None
