"""The model-type registry and the entry points that dispatch on a model type:
:data:`MODEL_TYPE_TO_APPLY_LIGER_FN`, :func:`_apply_liger_kernel` (class level),
:func:`_apply_liger_kernel_to_instance` (one model, by its own model type; what
``transformers.Trainer(use_liger_kernel=True)`` calls) and :func:`liger_kernel_patched`.

The registry holds, for the table's families and every model type the installed transformers
lists for causal LM or image-text-to-text, the written-out function of
:mod:`~liger_kernel.transformers.patching.apply_functions` or, where there is none, a function
built here from the same data (:func:`~liger_kernel.transformers.patching.api.apply_parameters`,
:func:`~liger_kernel.transformers.patching.api.apply_docstring`) with the same body.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from liger_kernel.transformers.families import FAMILIES, ModelFamily
from liger_kernel.transformers.patching import apply_functions, class_level
from liger_kernel.transformers.patching.api import (
    _hf_mappings,
    apply_docstring,
    apply_function_name,
    apply_parameters,
    apply_to_model_type,
)
from liger_kernel.transformers.patching.generic import patch_discovered
from liger_kernel.transformers.patching.instance import unwrap_peft
from liger_kernel.transformers.patching.options import PatchOptions, check_option_names
from liger_kernel.transformers.patching.report import PatchReport

logger = logging.getLogger(__name__)


class _BuiltApplyFunction:
    """``apply_liger_kernel_to_<model_type>`` for a model type not written out in
    :mod:`~liger_kernel.transformers.patching.apply_functions`: the same signature, docstring and
    body as a written one would have. A callable object rather than a function so that the
    signature and docstring are computed on first use (they read the model type's default
    config, which is not free for the ~300 model types registered at import)."""

    def __init__(self, model_type: str) -> None:
        self.__name__ = self.__qualname__ = apply_function_name(model_type)
        self.__module__ = "liger_kernel.transformers.monkey_patch"
        self._model_type = model_type

    @functools.cached_property
    def __signature__(self) -> inspect.Signature:
        defaults = PatchOptions()
        parameters = [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              default=None if name == "model" else getattr(defaults, name),
                              annotation="PreTrainedModel | None" if name == "model" else "bool")
            for name in apply_parameters(self._model_type)
        ]
        return inspect.Signature(parameters, return_annotation="PatchReport | None")

    @property
    def __doc__(self) -> str:  # type: ignore[override]
        return apply_docstring(self._model_type)

    def __call__(self, *args: Any, **kwargs: Any) -> PatchReport | None:
        bound = self.__signature__.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        return apply_to_model_type(self._model_type, arguments.pop("model"), **arguments)

    def __repr__(self) -> str:
        return f"<function {self.__module__}.{self.__name__}>"

    def __reduce__(self) -> str:
        # Pickled (and deep-copied) by name, as a module-level function is.
        return self.__name__


def _registry() -> dict[str, Callable[..., Any]]:
    """The table's families, then every model type transformers lists for causal LM or
    image-text-to-text: its written-out function where there is one, else one built here. (A
    written-out name transformers does not list stays importable, but is not registered.)"""
    def apply_function(model_type: str) -> Callable[..., Any]:
        written = getattr(apply_functions, apply_function_name(model_type), None)
        return written if written is not None else _BuiltApplyFunction(model_type)

    registry: dict[str, Callable[..., Any]] = {model_type: apply_function(model_type) for model_type in FAMILIES}
    for mapping in _hf_mappings():
        for model_type in mapping:
            if model_type not in registry:
                registry[model_type] = apply_function(model_type)
    return registry


MODEL_TYPE_TO_APPLY_LIGER_FN: dict[str, Callable[..., Any]] = _registry()
_TABLE_APPLY_FNS = {mt: MODEL_TYPE_TO_APPLY_LIGER_FN[mt] for mt in FAMILIES}


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
    returns (a :class:`PatchReport` for the library's own ones).
    """
    model = unwrap_peft(model)
    kwargs.pop("model", None)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model_type, str):
        model_type = ""  # no model type: nothing registered, discovery decides
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


@contextlib.contextmanager
def liger_kernel_patched(model_type: str, **kwargs: Any) -> Iterator[None]:
    """Context manager: class-level patch of ``model_type`` for the ``with`` block only.

    ``kwargs`` are the options of ``apply_liger_kernel_to_<model_type>`` (``model`` excluded).
    On exit every attribute is put back to what it was on entry, so an enclosing patch of
    the same model type survives.
    """
    if "model" in kwargs:
        raise TypeError("liger_kernel_patched patches classes; use _apply_liger_kernel_to_instance for a model")
    with class_level.undone_on_exit(model_type):
        _apply_liger_kernel(model_type, **kwargs)
        yield
