"""Launch configurations as frozen values, and the one way to override them.

Every op that has launch parameters (block sizes, warps, programs per SM, chunk budgets)
declares them as a frozen dataclass deriving from :class:`LaunchConfig`:

* ``heuristic(...)`` builds the default for a problem (shape, dtype, device). Launchers call
  :func:`launch_config`, never the constructor, so that overrides apply;
* ``search_space(...)`` (optional) yields the candidates that ``python -m benchmarks.tune``
  times at the target shapes; the measured winner is what the heuristic encodes.

A configuration changes the schedule only, never the result: the test suite runs the ops
under several overrides and compares against the same references.

Overriding, for tests, tuning and users who know their shapes::

    from liger_kernel.ops.config import override_launch_config
    from liger_kernel.ops.row_norm_geometry import RowNormConfig

    with override_launch_config(RowNormConfig, backward_tile_elements=4096):
        y = rms_norm(x)

The override is scoped (a context variable, so threads and tasks do not see each other's)
and nests; fields it does not name keep the heuristic's value. Unknown field names raise.
A backward pass started within the block runs in the calling thread (autograd's
multithreading is off there; on CUDA it would otherwise run in a device thread, which does
not see the context variable), so it runs under the override too; one started after the
block does not. Ops whose backward must repeat its forward's choices (the per-token head
ops' chunks) keep them in their autograd context instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

C = TypeVar("C", bound="LaunchConfig")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Base class of the ops' launch configurations (frozen dataclasses)."""

    @classmethod
    def heuristic(cls: type[C], *args: Any, **kwargs: Any) -> C:
        """The default configuration for a problem; subclasses define the arguments."""
        raise NotImplementedError(f"{cls.__name__} defines no heuristic")

    @classmethod
    def search_space(cls: type[C], *args: Any, **kwargs: Any) -> Iterable[C]:
        """Candidates for ``python -m benchmarks.tune``; empty where nothing is tuned."""
        return ()

    def check_powers_of_two(self, *names: str) -> None:
        """Raise ``ValueError`` unless each named field is a positive power of two (block sizes,
        warp counts: Triton's ``tl.arange`` and launch geometry need them)."""
        for name in names:
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1 and value & (value - 1) == 0):
                raise ValueError(f"{type(self).__name__}.{name} must be a power of two, got {value!r}")


@dataclasses.dataclass(frozen=True)
class FixedLaunchConfig(LaunchConfig):
    """A configuration that does not depend on the problem: the heuristic is the field defaults
    (one instance per class)."""

    @classmethod
    @functools.cache
    def heuristic(cls: type[C]) -> C:
        return cls()


_NO_OVERRIDES: Mapping[type, Mapping[str, Any]] = types.MappingProxyType({})
_OVERRIDES: contextvars.ContextVar[Mapping[type, Mapping[str, Any]]] = contextvars.ContextVar(
    "liger_kernel_launch_config_overrides", default=_NO_OVERRIDES
)


def _field_names(config_cls: type) -> set[str]:
    return {field.name for field in dataclasses.fields(config_cls)}


@contextlib.contextmanager
def override_launch_config(config_cls: type[LaunchConfig], **fields: Any) -> Iterator[None]:
    """Within the block, every ``config_cls`` the ops build has ``fields`` replaced.

    Raises ``TypeError`` for a class that is not a :class:`LaunchConfig` dataclass or a field
    it does not have.
    """
    if not (isinstance(config_cls, type) and issubclass(config_cls, LaunchConfig)
            and dataclasses.is_dataclass(config_cls)):
        raise TypeError(f"override_launch_config needs a LaunchConfig dataclass, got {config_cls!r}")
    unknown = set(fields) - _field_names(config_cls)
    if unknown:
        raise TypeError(f"{config_cls.__name__} has no field(s) {sorted(unknown)}; "
                        f"fields: {sorted(_field_names(config_cls))}")
    current = _OVERRIDES.get()
    merged = dict(current)
    merged[config_cls] = {**current.get(config_cls, {}), **fields}
    token = _OVERRIDES.set(merged)
    try:
        with torch.autograd.set_multithreading_enabled(False):
            yield
    finally:
        _OVERRIDES.reset(token)


def apply_overrides(config: C) -> C:
    """``config`` with the fields of any active :func:`override_launch_config` for its class."""
    fields = _OVERRIDES.get().get(type(config))
    return dataclasses.replace(config, **fields) if fields else config


def launch_config(config_cls: type[C], *args: Any, **kwargs: Any) -> C:
    """The configuration a launcher uses: ``config_cls.heuristic(*args, **kwargs)`` plus overrides."""
    return apply_overrides(config_cls.heuristic(*args, **kwargs))
