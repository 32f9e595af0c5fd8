"""Shared launch heuristics and argument helpers for every op in :mod:`liger_kernel.ops`.

Everything an op needs besides its own kernel lives here once:

* :func:`is_interpreter` - whether Triton runs kernels through its CPU interpreter
  (``TRITON_INTERPRET=1``), which is how the whole test suite runs without a GPU.
* :func:`row_launch_settings` - block size and warp count for a row-wise kernel from the
  row width; rows wider than :data:`MAX_FUSED_BLOCK` are processed in a loop over
  column blocks instead of one giant register tile (which would spill).
* :func:`num_programs_for_rows` - grid size for persistent row kernels.
* argument checks that raise clear ``TypeError``/``ValueError`` naming the argument.
* :func:`ensure_contiguous_last_dim` - makes the last dimension unit-stride without
  copying when it already is.

This module imports only torch and triton.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence

import torch
import triton

# Widest row handled as a single register tile. Above it kernels loop over column
# blocks of this width: a 64K-wide fp32 tile per program exhausts the register file
# and spills to local memory, which is several times slower than a second pass.
MAX_FUSED_BLOCK = 8192

# Largest block any kernel may allocate (Triton's per-tensor element limit is 2**20).
MAX_BLOCK = 65536

SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_interpreter() -> bool:
    """True when Triton executes kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Number of SMs of ``device`` (a small constant under the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessor_count(index)


def row_launch_settings(n_cols: int, max_block: int = MAX_FUSED_BLOCK) -> tuple[int, int]:
    """Return ``(BLOCK_SIZE, num_warps)`` for a kernel that walks a row of ``n_cols`` elements.

    ``BLOCK_SIZE`` is the next power of two of ``n_cols`` capped at ``max_block``; a kernel
    whose block is smaller than the row loops over the row in ``BLOCK_SIZE`` chunks.
    ``num_warps`` grows with the block so each thread holds a handful of 16-byte vectors.
    """
    if n_cols < 1:
        n_cols = 1
    block = min(triton.next_power_of_2(n_cols), max_block)
    if block >= 32768:
        warps = 32
    elif block >= 8192:
        warps = 16
    elif block >= 2048:
        warps = 8
    elif block >= 512:
        warps = 4
    else:
        warps = 2 if block >= 128 else 1
    if is_interpreter():
        warps = 1  # ignored by the interpreter; keeps launches uniform
    return block, warps


def num_programs_for_rows(n_rows: int, device: torch.device, programs_per_sm: int = 4) -> int:
    """Grid size for a persistent kernel over ``n_rows`` rows: at most a few programs per SM."""
    return max(1, min(n_rows, multiprocessor_count(device) * programs_per_sm))


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# --------------------------------------------------------------------------------------
# Argument checks. Each raises with the argument's name so errors point at the caller.
# --------------------------------------------------------------------------------------


def check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_float_dtype(x: torch.Tensor, name: str, allowed: Sequence[torch.dtype] = SUPPORTED_FLOAT_DTYPES) -> None:
    check_tensor(x, name)
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are {names}")


def check_same_device(tensors: Iterable[tuple[str, torch.Tensor | None]]) -> torch.device:
    """All given tensors on one device, and that device usable by Triton.

    Triton kernels need CUDA tensors, except under the interpreter, which runs on CPU
    tensors. Returns the common device.
    """
    device = None
    first = None
    for name, t in tensors:
        if t is None:
            continue
        check_tensor(t, name)
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {device}; all tensors must be on one device")
    if device is None:
        raise ValueError("no tensor given")
    if device.type != "cuda" and not is_interpreter():
        raise ValueError(
            f"{first} is on {device}: liger_kernel kernels run on CUDA tensors "
            "(or on CPU tensors with TRITON_INTERPRET=1 set before triton is imported)"
        )
    return device


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
    """View ``x`` of shape (..., H) as (N, H) with unit column stride, copying only if it must."""
    x = ensure_contiguous_last_dim(x)
    if x.dim() == 1:
        return x.unsqueeze(0)
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


TORCH_TO_TRITON_DTYPE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}


# --------------------------------------------------------------------------------------
# Registration with PyTorch, so torch.compile sees each launcher as one opaque op.
# --------------------------------------------------------------------------------------


def liger_custom_op(name: str, mutates_args: Sequence[str] = ()):
    """Register a kernel launcher as the custom op ``liger::<name>``.

    The returned callable runs the launcher directly in eager mode (no dispatcher
    overhead on the hot path) and goes through the registered op while
    ``torch.compile`` traces, so Dynamo never tries to trace into Triton and needs no
    graph break. Register the shape function with ``@<launcher>.register_fake``. The
    launcher's annotations define the op schema: use ``torch.Tensor``, ``int``,
    ``float``, ``bool``, ``str`` and ``Optional`` of those; return a tensor or a tuple
    of fresh tensors (never an input or a view of one), and list every argument the
    launcher writes in ``mutates_args``.
    """

    def decorator(fn):
        op = torch.library.custom_op(f"liger::{name}", fn, mutates_args=tuple(mutates_args))

        @functools.wraps(fn)
        def dispatch(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        dispatch.op = op
        dispatch.register_fake = op.register_fake
        return dispatch

    return decorator
