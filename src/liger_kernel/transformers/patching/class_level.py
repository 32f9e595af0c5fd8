"""The record of class-level patches, and how they are undone.

A class-level patch (``apply_liger_kernel_to_<model_type>()`` without ``model``) replaces
names in a modeling module and attributes of its classes. Every replacement goes through
:func:`set_patched`, which records the original the first time an attribute is patched, so
:func:`revert_liger_kernel` and :func:`undone_on_exit` can always put the true original back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_MISSING = object()
# model_type -> {(id(owner), attribute): (owner, attribute, original value or _MISSING when
# the attribute was not in owner.__dict__)}.
_PATCHED: dict[str, dict[tuple[int, str], tuple[Any, str, Any]]] = {}


def set_patched(model_type: str, owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)``, recorded under ``model_type`` for reverting."""
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


def original(model_type: str, owner: Any, name: str) -> Any:
    """``owner.name`` as it was before any Liger patch of ``model_type``."""
    saved = _PATCHED.get(model_type, {}).get((id(owner), name))
    if saved is not None and saved[2] is not _MISSING:
        return saved[2]
    return getattr(owner, name)


def revert_liger_kernel(model_type: str | None = None) -> None:
    """Undo the class-level patches of ``model_type`` (all model types when None).

    Models built while patched keep their Liger modules; instance-level patches are not
    recorded and stay (build a fresh model to get the original).
    """
    model_types = list(_PATCHED) if model_type is None else [model_type]
    for mt in model_types:
        for owner, name, value in reversed(list(_PATCHED.pop(mt, {}).values())):
            _restore(owner, name, value)


@contextlib.contextmanager
def undone_on_exit(model_type: str) -> Iterator[None]:
    """Context manager: every class-level patch of ``model_type`` made inside the block is put
    back on exit to what it was on entry, so an enclosing patch of the same model type survives
    (:func:`liger_kernel.transformers.patching.registry.liger_kernel_patched` wraps it)."""
    before = {key: (owner, name, vars(owner).get(name, _MISSING))
              for key, (owner, name, _) in _PATCHED.get(model_type, {}).items()}
    try:
        yield
    finally:
        record = _PATCHED.get(model_type, {})
        for key in reversed(list(record)):
            owner, name, first = record[key]
            if key in before:
                _restore(owner, name, before[key][2])
            else:
                _restore(owner, name, first)
                del record[key]
        if not record:
            _PATCHED.pop(model_type, None)
