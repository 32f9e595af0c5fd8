"""The options the cross-entropy losses (plain and fused with the LM head) share. Their target
and class-weight checks are :mod:`liger_kernel.ops.loss_checks`, the mean's denominators and the
reduction :mod:`liger_kernel.ops.loss_reduction`.

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
from typing import NamedTuple

import torch

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
        if ignore_index.dim() == 0 and not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
            return int(ignore_index)
        described = f"a tensor of dtype {dtype} and shape {tuple(ignore_index.shape)}"
    elif isinstance(ignore_index, numbers.Integral) and not isinstance(ignore_index, bool):
        return int(ignore_index)
    else:
        described = f"{type(ignore_index).__name__} {ignore_index!r}"
    raise TypeError(f"ignore_index must be an integer class index (an int or a 0-dim integer tensor), "
                    f"got {described}")


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
