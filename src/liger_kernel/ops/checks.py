"""Argument checks shared by the ops. Each raises with the argument's name so errors point at the caller."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from liger_kernel.ops.launch import has_no_data, is_interpreter

SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_temperature(temperature: object) -> float:
    """A softmax temperature: a finite number > 0 (not a bool), returned as a float."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def check_beta(beta: object) -> float:
    """A divergence's mixing weight: a number in [0, 1] (not a bool), returned as a float."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
    return float(beta)


def check_in_place(in_place: object) -> bool:
    """``in_place`` as given: a bool. It is the caller's promise that nothing else reads the
    buffer a backward writes over (``docs/api.md``, "Memory ownership"), so a truthy tensor or
    string is a mistake to report, not a promise."""
    if not isinstance(in_place, bool):
        raise TypeError(f"in_place must be a bool, got {type(in_place).__name__}")
    return in_place


def check_float_dtype(x: torch.Tensor, name: str, allowed: Sequence[torch.dtype] = SUPPORTED_FLOAT_DTYPES) -> None:
    check_tensor(x, name)
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are {names}")


def check_same_device(tensors: Iterable[tuple[str, torch.Tensor | None]]) -> torch.device:
    """All given tensors on one device, and that device usable by Triton.

    Triton kernels need CUDA tensors, except under the interpreter, which runs on CPU
    tensors. Tensors without data are accepted on any device when all of them are so:
    meta tensors, and fake tensors (a ``FakeTensorMode``, ``torch.export``), which only
    describe shapes; the ops give outputs of the same kind without launching anything,
    so a model can be traced on CPU fake tensors on a machine whose kernels run on CUDA.
    Returns the common device.
    """
    device = None
    first = None
    given = []
    for name, t in tensors:
        if t is None:
            continue
        check_tensor(t, name)
        given.append(t)
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {device}; all tensors must be on one device")
    if device is None:
        raise ValueError("no tensor given")
    if device.type != "cuda" and not is_interpreter() and not all(map(has_no_data, given)):
        raise ValueError(
            f"{first} is on {device}: liger_kernel kernels run on CUDA tensors "
            "(or on CPU tensors with TRITON_INTERPRET=1 set before triton is imported)"
        )
    return device


_HIDDEN_LAYOUTS = {2: "(rows, hidden)", 3: "(batch, seq_len, hidden)"}


def check_linear_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_name: str = "input",
                          weight_name: str = "weight", bias_name: str = "bias", *, x_dims: int = 2,
                          same_device: bool = True, autocast_casts: bool = False) -> None:
    """The operands of a linear head ``x @ weight^T + bias``: ``x`` (rows, D) or, with
    ``x_dims=3``, (B, T, D) hidden states, ``weight`` (V >= 1, D), ``bias`` (V,) or None, all
    of one floating dtype; with ``same_device`` also on ``x``'s device (a caller that checks
    its devices together with its other tensors passes False). ``autocast_casts``: the op
    casts its operands under ``torch.autocast``, which the dtype error then suggests."""
    check_float_dtype(x, x_name)
    check_float_dtype(weight, weight_name)
    if x.dim() != x_dims:
        raise ValueError(f"{x_name} must be {x_dims}-D {_HIDDEN_LAYOUTS[x_dims]}, got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"{weight_name} must be 2-D (vocab, hidden), got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{weight_name} has shape {tuple(weight.shape)}; its last dimension must equal "
                         f"{x_name}'s hidden size {x.shape[-1]}")
    if weight.shape[0] < 1:
        raise ValueError(f"{weight_name} must have at least one row (class)")
    if weight.dtype != x.dtype:
        hint = " (or run under torch.autocast, which casts both)" if autocast_casts else ""
        raise TypeError(f"{x_name} ({x.dtype}) and {weight_name} ({weight.dtype}) must have the same dtype{hint}")
    if same_device and weight.device != x.device:
        raise ValueError(f"{weight_name} is on {weight.device} but {x_name} is on {x.device}")
    if bias is not None:
        check_tensor(bias, bias_name)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{bias_name} must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"{bias_name} has dtype {bias.dtype}; it must match {x_name}'s {x.dtype}")
        if same_device and bias.device != x.device:
            raise TypeError(f"{bias_name} is on {bias.device} but {x_name} is on {x.device}")


def check_last_dim(x: torch.Tensor, size: int, x_name: str, size_name: str) -> None:
    if x.dim() == 0 or x.shape[-1] != size:
        raise ValueError(
            f"{x_name} has shape {tuple(x.shape)}; its last dimension must equal {size_name} = {size}"
        )


def ensure_contiguous_last_dim(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride in the last dimension; copies only when that is not already so."""
    if x.dim() == 0 or x.stride(-1) == 1 or x.shape[-1] == 1:
        return x
    return x.contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` of shape (..., H) as (N, H) with unit column stride, copying only if it must.

    N is the product of the leading sizes, given explicitly: a ``-1`` could not be inferred
    for an empty row (H == 0), and (N, 0) is what the norms' launchers expect there."""
    x = ensure_contiguous_last_dim(x)
    if x.dim() == 1:
        return x.unsqueeze(0)
    shape = (math.prod(x.shape[:-1]), x.shape[-1])
    try:
        return x.view(shape)
    except RuntimeError:
        return x.reshape(shape)
