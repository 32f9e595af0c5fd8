"""Compatibility shim: ``liger_kernel.ops.backends.registry.IMPL_REGISTRY``, read by axolotl 0.19.

Upstream Liger keeps a registry of alternative kernel sets (another device's kernels, or
another DSL), one selected by the ``LIGER_KERNEL_IMPL`` environment variable at the first
import of ``liger_kernel.ops``. This package has one implementation, the Triton kernels of
:mod:`liger_kernel.ops`, which are always used: the registry of alternatives is empty, so a
caller that asks which alternative was loaded (axolotl checks whether an entry's
``module_path`` is in ``sys.modules``) learns that none was, and a request for one through
``LIGER_KERNEL_IMPL`` has no effect here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IMPL_REGISTRY", "ImplInfo", "LIGER_KERNEL_IMPL_ENV"]

LIGER_KERNEL_IMPL_ENV = "LIGER_KERNEL_IMPL"


@dataclass(frozen=True)
class ImplInfo:
    """An alternative kernel set: its ``name`` (the ``LIGER_KERNEL_IMPL`` value), the device types
    it supports, those it is the default on, and the module its ops live in."""

    name: str
    devices: tuple[str, ...]
    default_devices: tuple[str, ...] = ()
    module_path: str = ""


# name -> ImplInfo of each alternative implementation; none exists in this package.
IMPL_REGISTRY: dict[str, ImplInfo] = {}
