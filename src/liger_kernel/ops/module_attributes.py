"""Typed reads of the children and tensors registered on an ``nn.Module``.

torch types every attribute read through ``nn.Module.__getattr__`` as ``Tensor | Module``. Code
that knows which of the two a name holds (a projection, an expert weight) reads it here, so the
type checker learns it once instead of at every read. The reads are plain ``getattr``: a missing
name raises ``AttributeError`` as ``module.name`` would.
"""
from __future__ import annotations

from typing import cast

import torch
from torch import nn


def child_module(module: nn.Module, name: str) -> nn.Module:
    """``module.<name>``, a registered child module (a projection, a norm, a decoder)."""
    return cast(nn.Module, getattr(module, name))


def tensor_attribute(module: nn.Module, name: str) -> torch.Tensor:
    """``module.<name>``, a registered parameter or buffer (a weight, an expert bank)."""
    return cast(torch.Tensor, getattr(module, name))


def set_attribute(module: nn.Module, name: str, value: object) -> None:
    """``module.<name> = value`` for a value that is neither tensor nor module (a float, a bound
    method), which torch's annotation of ``nn.Module.__setattr__`` does not foresee."""
    setattr(module, name, value)
