"""``PatchReport``: what one patch of a model replaced and what it left alone, and why."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from liger_kernel.transformers.patching.options import PatchOptions


@dataclass
class PatchReport:
    """The outcome of patching one model instance.

    Attributes:
        model_type: the model's ``config.model_type``.
        options: the options the patch ran with.
        patched: kernel name (``"rms_norm"``, ``"swiglu"``, ``"rope"``,
            ``"fused_linear_cross_entropy"``, ...) -> number of modules it now runs in.
        left_alone: ``(what, why)`` for everything the patch found and kept as HF's.
    """

    model_type: str | None
    options: PatchOptions
    patched: dict[str, int] = field(default_factory=dict)
    left_alone: list[tuple[str, str]] = field(default_factory=list)

    def count(self, kernel: str, n: int) -> None:
        if n:
            self.patched[kernel] = self.patched.get(kernel, 0) + n

    def leave(self, what: str, why: str) -> None:
        self.left_alone.append((what, why))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
