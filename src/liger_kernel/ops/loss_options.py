"""What the cross-entropy losses (plain and fused with the LM head) share: their options, the
checks of their arguments, the target check, the mean's denominators, and whether the logits
may be overwritten by their gradient.

The options are one frozen value, :class:`CrossEntropyOptions`, validated when it is built;
the modules keep one, the functions build one per call, and the autograd Functions receive
its fields. The class weight is a tensor that follows its module's device (a buffer), so it
travels beside the options and is checked against the vocabulary by :func:`check_class_weight`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from liger_kernel.ops.checks import check_float_dtype, check_tensor
from liger_kernel.ops.grad_ownership import counts_comparable_with_import

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


def check_class_weight(class_weight: torch.Tensor | None, n_cols: int, name: str = "weight") -> torch.Tensor | None:
    """Validate the class weights; returns them as the kernel reads them, with unit stride
    (it addresses ``class_weight_ptr + c``: a strided view such as ``w[::2]`` would be read
    wrong, silently). Copies only a non-contiguous ``class_weight``."""
    if class_weight is None:
        return None
    check_float_dtype(class_weight, name)
    if class_weight.dim() != 1 or class_weight.shape[0] != n_cols:
        raise ValueError(
            f"{name} (class weights) must have shape ({n_cols},), one per class, got {tuple(class_weight.shape)}"
        )
    return class_weight.contiguous()


def is_meta(*tensors: torch.Tensor | None) -> bool:
    """Whether any of ``tensors`` is on the meta device (shape inference: no kernel runs)."""
    return any(t is not None and t.device.type == "meta" for t in tensors)


# ======================================================================================
# The target's value range.
# ======================================================================================


class PendingTargetCheck:
    """The value-range check of a target, started on the device; :meth:`wait` raises.

    Waiting right after starting is a host sync that drains the GPU's queue, so the GPU
    idles while the host launches the next kernels. A caller that launches its kernels
    first (they never address memory with a bad target) and waits afterwards keeps the GPU
    busy: by then the check's result is usually long computed.
    """

    __slots__ = ("_bad", "_flag", "_event", "_target", "_n_cols", "_ignore_index", "_name")

    def __init__(self, target: torch.Tensor | None, n_cols: int = 0, ignore_index: int = -100,
                 name: str = "target") -> None:
        self._target, self._n_cols, self._ignore_index, self._name = target, n_cols, ignore_index, name
        self._bad = self._flag = self._event = None
        if target is None:
            return
        self._bad = ((target != ignore_index) & ((target < 0) | (target >= n_cols))).any()
        if target.is_cuda:
            # Copy the verdict into pinned host memory behind the work queued so far.
            self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._flag.copy_(self._bad, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """Block until the check has run; raise ``ValueError`` naming a bad class index."""
        if self._bad is None:
            return
        if self._event is not None:
            self._event.synchronize()
            bad = bool(self._flag)
        else:
            bad = bool(self._bad)
        if bad:
            target = self._target
            outside = (target != self._ignore_index) & ((target < 0) | (target >= self._n_cols))
            first = int(target[outside][0])
            raise ValueError(
                f"{self._name} contains class index {first} outside [0, {self._n_cols}) that is not "
                f"ignore_index={self._ignore_index}"
            )


def start_target_check(
    target: torch.Tensor, n_rows: int, n_cols: int, ignore_index: int, name: str = "target"
) -> PendingTargetCheck:
    """Shape/dtype checks for class-index targets (raised at once) and the value-range check,
    started on the device and returned unfinished: call ``.wait()`` to raise on a bad value.

    Skipped (a check that passes) while ``torch.compile`` traces, a CUDA graph is being
    captured (a host sync would break either) or the target is a meta tensor.
    """
    check_tensor(target, name)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold class indices as int64 (or int32), got dtype {target.dtype}")
    if target.dim() != 1:
        raise ValueError(f"{name} must be 1-D (N,), got shape {tuple(target.shape)}")
    if target.shape[0] != n_rows:
        raise ValueError(f"{name} has {target.shape[0]} entries but the input has {n_rows} rows")
    if torch.compiler.is_compiling() or n_rows == 0 or target.device.type == "meta":
        return PendingTargetCheck(None)
    if target.is_cuda and torch.cuda.is_current_stream_capturing():
        return PendingTargetCheck(None)
    return PendingTargetCheck(target, n_cols, ignore_index, name)


def mean_denominators(
    target: torch.Tensor, class_weight: torch.Tensor | None, ignore_index: int, n_cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device scalars ``(D_ce, D_z, n_counted)`` for the mean, computed without a host sync.

    ``D_ce`` is the sum of the class weights of the counted targets (their count without
    weights), ``D_z`` the count. Both are set to 1 when nothing is counted, so an all-ignored
    batch gives loss 0 rather than 0/0.
    """
    counted = target != ignore_index
    n_counted = counted.sum(dtype=torch.float32)
    nothing_counted = n_counted == 0
    z_denominator = torch.where(nothing_counted, 1.0, n_counted)
    if class_weight is None:
        ce_denominator = z_denominator
    else:
        # Clamping keeps the gather in bounds for bad targets; those rows are masked out
        # here, and the host check (or the kernel's NaN) reports them.
        safe_target = target.clamp(0, n_cols - 1).long()
        target_weights = class_weight.float().gather(0, safe_target) * counted
        ce_denominator = torch.where(nothing_counted, 1.0, target_weights.sum())
    return ce_denominator.reshape(1), z_denominator.reshape(1), n_counted


def reduce_rows(loss_rows: torch.Tensor, z_rows: torch.Tensor, correct_rows: torch.Tensor,
                n_counted: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (loss, z-loss, correct) reduced: kept for ``"none"``, else summed (the mean's
    division already happened in the kernel) with the accuracy averaged over counted rows."""
    if reduction == "none":
        return loss_rows, z_rows, correct_rows
    return loss_rows.sum(), z_rows.sum(), correct_rows.sum() / n_counted.clamp_min(1.0)


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
