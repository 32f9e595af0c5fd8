"""One-line patching of Hugging Face models with the Liger kernels (the names users import).

``apply_liger_kernel_to_<model_type>(rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
rms_norm=True, swiglu=True, model=None, recompute_norm_outputs=True, in_place=True)``
(``geglu=True`` instead of ``swiglu`` for Gemma families) exists for every entry of
:data:`liger_kernel.transformers.families.FAMILIES`, and, with ``layer_norm`` and the gated-MLP
keyword of the default config's activation (``swiglu`` or ``geglu``; both when it is unknown),
for every other model type the installed transformers lists for causal
LM or image-text-to-text: those are patched by discovery
(:mod:`~liger_kernel.transformers.patching.discovery`: each module swapped only once a probe
proved it equal). The families' and the upstream-compatible names are written out in
:mod:`~liger_kernel.transformers.patching.apply_functions` (generated from data); the other
model types' functions are built from the same data and resolved by this module's
``__getattr__``. All of them run the same code:

* ``model=None`` (class level) replaces names in the family's modeling module, so models built
  afterwards use the kernels; :func:`revert_liger_kernel` / :func:`liger_kernel_patched` put the
  originals back (:mod:`~liger_kernel.transformers.patching.class_level`,
  :func:`~liger_kernel.transformers.patching.api.patch_classes`).
* ``model=<instance>`` patches that instance in place and leaves every other instance alone
  (:mod:`~liger_kernel.transformers.patching.instance`); the patched model survives
  ``copy.deepcopy``, pickle and ``torch.save`` (:mod:`~liger_kernel.transformers.patching.binding`).

The keyword options become one frozen :class:`~liger_kernel.transformers.patching.options.PatchOptions`.
Trainer integration: transformers calls ``_apply_liger_kernel_to_instance(model=..., **config)``.
This module re-exports the public names of :mod:`liger_kernel.transformers.patching`.
"""

from __future__ import annotations

from typing import Any

from liger_kernel.transformers.patching import replacements
from liger_kernel.transformers.patching.api import apply_function_name
from liger_kernel.transformers.patching.apply_functions import *  # noqa: F403 - the written-out apply functions
from liger_kernel.transformers.patching.apply_functions import __all__ as _WRITTEN
from liger_kernel.transformers.patching.binding import instance_patched as _instance_patched
from liger_kernel.transformers.patching.binding import with_global_overrides
from liger_kernel.transformers.patching.class_level import revert_liger_kernel
from liger_kernel.transformers.patching.instance import liger_patched_modules
from liger_kernel.transformers.patching.options import PatchOptions
from liger_kernel.transformers.patching.registry import (
    MODEL_TYPE_TO_APPLY_LIGER_FN,
    _apply_liger_kernel,
    _apply_liger_kernel_to_instance,
    liger_kernel_patched,
)
from liger_kernel.transformers.patching.report import PatchReport

__all__ = [
    "MODEL_TYPE_TO_APPLY_LIGER_FN",
    "PatchOptions",
    "PatchReport",
    "_apply_liger_kernel",
    "_apply_liger_kernel_to_instance",
    "_instance_patched",
    "liger_kernel_patched",
    "liger_patched_modules",
    "revert_liger_kernel",
    "with_global_overrides",
    *_WRITTEN,
]

# ``apply_liger_kernel_to_<model_type>`` of the model types not written out, by name.
_BUILT = {apply_function_name(mt): fn for mt, fn in MODEL_TYPE_TO_APPLY_LIGER_FN.items()}


def __getattr__(name: str) -> Any:
    if name in _BUILT:
        return _BUILT[name]
    # Liger classes a class-level patch built, pickled under this module's name by earlier releases.
    if name in replacements.LIGER_CLASS_BUILDERS:
        return getattr(replacements, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
