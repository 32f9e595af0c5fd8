"""The options the cross-entropy losses (plain and fused with the LM head) share, and whether
the logits may be overwritten by their gradient. Their target and class-weight checks are
:mod:`liger_kernel.ops.loss_checks`, the mean's denominators and the reduction
:mod:`liger_kernel.ops.loss_reduction`.

The options are one frozen value, :class:`CrossEntropyOptions`, validated when it is built;
the modules keep one, the functions build one per call, and the autograd Functions receive
its fields. The class weight is a tensor that follows its module's device (a buffer), so it
travels beside the options and is checked against the vocabulary by
:func:`~liger_kernel.ops.loss_checks.check_class_weight`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from liger_kernel.ops.grad_ownership import counts_comparable_with_import

# Imported from here by fused_linear_cross_entropy.py until it imports them from their modules.
from liger_kernel.ops.launch import is_meta  # noqa: F401
from liger_kernel.ops.loss_checks import check_class_weight, start_target_check  # noqa: F401
from liger_kernel.ops.loss_reduction import mean_denominators, reduce_rows  # noqa: F401

REDUCTIONS = ("mean", "sum", "none")


class CrossEntropyOutput(NamedTuple):
    """What the cross-entropy losses return when ``return_z_loss`` or ``return_token_accuracy`` is set.

    ``loss`` is differentiable and already includes the z-loss. ``z_loss`` (the z-loss part
    of ``loss``, reduced like it) and ``token_accuracy`` are detached diagnostics, ``None``
    unless requested. ``token_accuracy`` is the fraction of counted (non-ignored) tokens
    whose arg-max logit (first index on ties, like ``torch.argmax``) equals the target, for
    ``"mean"`` and ``"sum"``; for ``"none"`` it is 1.0/0.0 per row (0 for ignored rows).
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None


def check_ignore_index(ignore_index: object) -> int:
    """``ignore_index`` as the kernel's integer: a Python (or NumPy) integer, or a 0-dim
    integer tensor. Anything else raises ``TypeError``: ``int()`` would truncate a float such
    as -100.5 to -100, silently changing which targets are ignored, and a bool is a flag
    given in the wrong place."""
    if isinstance(ignore_index, torch.Tensor):
        dtype = ignore_index.dtype
        integral = ignore_index.dim() == 0 and not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        described = f"a tensor of dtype {dtype} and shape {tuple(ignore_index.shape)}"
    else:
        integral = isinstance(ignore_index, numbers.Integral) and not isinstance(ignore_index, bool)
        described = f"{type(ignore_index).__name__} {ignore_index!r}"
    if not integral:
        raise TypeError(f"ignore_index must be an integer class index (an int or a 0-dim integer tensor), "
                        f"got {described}")
    return int(ignore_index)


@dataclasses.dataclass(frozen=True)
class CrossEntropyOptions:
    """The options of the cross-entropy losses, validated and normalised when built.

    * ``ignore_index``: targets equal to it contribute no loss and no gradient;
    * ``label_smoothing`` in [0, 1]; ``lse_square_scale``: the z-loss factor (finite);
    * ``softcap``: ``softcap * tanh(x / softcap)`` is applied to the logits first (positive
      and finite), ``None`` for no cap;
    * ``reduction``: ``"mean"``, ``"sum"`` or ``"none"``;
    * ``return_z_loss`` / ``return_token_accuracy``: return a :class:`CrossEntropyOutput`
      instead of the loss alone.

    Raises ``ValueError``/``TypeError`` naming the bad option.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float | None = None
    reduction: str = "mean"
    return_z_loss: bool = False
    return_token_accuracy: bool = False

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        label_smoothing, lse_square_scale = float(self.label_smoothing), float(self.lse_square_scale)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if not math.isfinite(lse_square_scale):
            raise ValueError(f"lse_square_scale must be finite, got {self.lse_square_scale}")
        softcap = self.softcap
        if softcap is not None:
            softcap = float(softcap)
            if not (softcap > 0.0 and math.isfinite(softcap)):
                raise ValueError(f"softcap must be a positive finite number or None, got {self.softcap}")
        normalised = {
            "ignore_index": check_ignore_index(self.ignore_index),
            "label_smoothing": label_smoothing,
            "lse_square_scale": lse_square_scale,
            "softcap": softcap,
            "return_z_loss": bool(self.return_z_loss),
            "return_token_accuracy": bool(self.return_token_accuracy),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def kernel_options(self) -> tuple[int, float, float, float]:
        """``(ignore_index, label_smoothing, lse_square_scale, softcap)`` as the kernel takes
        them (softcap 0 for none)."""
        return self.ignore_index, self.label_smoothing, self.lse_square_scale, self.softcap or 0.0

    def outputs(self, loss: torch.Tensor, z_loss: torch.Tensor, token_accuracy: torch.Tensor):
        """The loss alone, or a :class:`CrossEntropyOutput` with the requested diagnostics."""
        if not (self.return_z_loss or self.return_token_accuracy):
            return loss
        return CrossEntropyOutput(loss, z_loss if self.return_z_loss else None,
                                  token_accuracy if self.return_token_accuracy else None)

    def describe(self) -> str:
        """The options for a module's ``extra_repr``."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(CrossEntropyOptions))


# ======================================================================================
# Whether the logits may be overwritten by their gradient.
#
# The cross entropy's gradient has the logits' shape; writing it over the logits saves an
# (N, V) buffer, but destroys values a caller may read again (a second loss, metrics, a
# hook that kept them). Only logits that nothing but the call itself can reach are
# overwritten: a temporary such as ``model(x).float().view(-1, V)`` or
# ``lm_head(h).view(-1, V)``. Like the norms' gradient check (grad_ownership.py), this is
# told by the Python references to the tensor and to the tensor it is a view of, and by the
# tensors sharing its storage (a ``.detach()`` alias, or the copy of an output that an op
# saved for backward); each compared with the counts of a temporary passed through the same
# entry point, measured at import. Where the counts cannot be taken (not CPython, a
# free-threaded build, no storage use count), nothing is overwritten.
# ======================================================================================


@dataclasses.dataclass(frozen=True)
class ReferenceLimits:
    """Counts of a temporary passed through one entry point: ``(references, references of
    its base, storage users)``, plain and as a view."""

    plain: tuple[int, int, int]
    view: tuple[int, int, int]


class _Probed(Exception):
    """Raised by :func:`logits_unshared` while calibrating, after recording the counts."""


_CALIBRATION_COUNTS: list[tuple[int, int, int]] | None = None


def _storage_users(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def logits_unshared(logits: torch.Tensor, limits: ReferenceLimits | None) -> bool:
    """Whether nothing but the current call can see ``logits``' memory (see the section
    comment). Call it first thing in the entry's innermost frame, before any other local
    refers to ``logits``. Never under ``torch.compile`` nor for meta tensors."""
    if limits is None and _CALIBRATION_COUNTS is None:
        return False
    if torch.compiler.is_compiling() or logits.device.type == "meta":
        return False
    base = logits._base
    counts = (sys.getrefcount(logits), 0 if base is None else sys.getrefcount(base), _storage_users(logits))
    if _CALIBRATION_COUNTS is not None:
        _CALIBRATION_COUNTS.append(counts)
        raise _Probed
    allowed = limits.plain if base is None else limits.view
    return counts_comparable_with_import() and all(count <= limit for count, limit in zip(counts, allowed))


def calibrate_entry(call: Callable[[Callable[[], torch.Tensor]], object]) -> ReferenceLimits | None:
    """The counts :func:`logits_unshared` sees for a temporary passed to an entry point.

    ``call(make)`` must call the entry with ``make()`` written in the argument list, as a
    user passes a temporary (``lambda make: entry(make(), target)``; binding it to a name
    first, or passing it through ``*args``, would add a reference and make the limits too
    lax). ``make`` gives a fresh (2, 3) tensor and then a (2, 3) view of a fresh (6,)
    tensor, both requiring grad. None where the counts cannot be measured."""
    global _CALIBRATION_COUNTS
    if sys.implementation.name != "cpython" or not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None
    leaf = torch.ones(6, requires_grad=True)
    _CALIBRATION_COUNTS = []
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for make in (lambda: (leaf[:6] * 1.0).view(2, 3) * 1.0, lambda: (leaf * 1.0).view(2, 3)):
                try:
                    call(make)
                except _Probed:
                    pass
        (plain, view) = _CALIBRATION_COUNTS
    except Exception:  # any surprise (no storage use count in this torch): never overwrite
        return None
    finally:
        _CALIBRATION_COUNTS = None
    if plain[1] != 0 or view[1] == 0:
        return None
    return ReferenceLimits(plain, view)
