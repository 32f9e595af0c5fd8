"""Launching Triton kernels: geometry heuristics and custom-op registration (the launch itself,
past Triton's per-call specialisation, is :mod:`liger_kernel.ops.cached_launch`).

* :func:`is_interpreter` - whether Triton runs kernels through its CPU interpreter
  (``TRITON_INTERPRET=1``), which is how the whole test suite runs without a GPU.
* :func:`row_launch_settings` - block size and warp count for a row-wise kernel from the
  row width; rows wider than :data:`MAX_FUSED_BLOCK` are processed in a loop over
  column blocks instead of one giant register tile (which would spill).
* :func:`num_programs_for_rows` - grid size for persistent row kernels.
* :func:`liger_custom_op` - registers a launcher as an opaque ``torch.library`` custom op.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

# Widest row handled as a single register tile. Above it kernels loop over column
# blocks of this width: a 64K-wide fp32 tile per program exhausts the register file
# and spills to local memory, which is several times slower than a second pass.
MAX_FUSED_BLOCK = 8192

# Largest block any kernel may allocate (Triton's per-tensor element limit is 2**20).
MAX_BLOCK = 65536


# Read at import: Triton itself decides when ``triton.jit`` decorates a kernel (at import), so a
# later change of the variable could not switch the kernels anyway. A constant rather than a
# cached function: Dynamo traces this on every patched forward, and warns about a cache wrapper.
_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_interpreter() -> bool:
    """True when Triton executes kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _INTERPRETER


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Number of SMs of ``device`` (a small constant under the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessor_count(index)


def row_launch_settings(n_cols: int, max_block: int | None = None) -> tuple[int, int]:
    """Return ``(BLOCK_SIZE, num_warps)`` for a kernel that walks a row of ``n_cols`` elements.

    ``BLOCK_SIZE`` is the next power of two of ``n_cols`` capped at ``max_block`` (default:
    :data:`MAX_FUSED_BLOCK`; the row norms pass their configuration's); a kernel
    whose block is smaller than the row loops over the row in ``BLOCK_SIZE`` chunks.
    ``num_warps`` grows with the block so each thread holds a handful of 16-byte vectors.
    """
    if max_block is None:
        max_block = MAX_FUSED_BLOCK
    if n_cols < 1:
        n_cols = 1
    block = min(next_power_of_2(n_cols), max_block)
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


def num_programs_for_rows(n_rows: int, device: torch.device, programs_per_sm: float = 4) -> int:
    """Grid size for a persistent kernel over ``n_rows`` rows: at most a few programs per SM
    (a fraction below 1 leaves SMs idle: fewer rows in flight, for cache experiments)."""
    return _persistent_grid(n_rows, multiprocessor_count(device), programs_per_sm)


def _persistent_grid(n_units: int, n_sms: int, programs_per_sm: float) -> int:
    return max(1, min(n_units, int(n_sms * programs_per_sm)))


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), for launch geometry on the host.

    Same values as ``triton.next_power_of_2``, which Triton >= 3.4 wraps as a constexpr
    function costing ~3 us a call: launchers run per layer per step, where host time
    shows up as GPU idle time.
    """
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tile_rows_and_warps(n_rows: int, row_elements: int, tile_elements: int) -> tuple[int, int]:
    """Rows per tile of a 2-D tiled kernel whose rows span ``row_elements`` (a power of two):
    about ``tile_elements`` per tile, at least one row and no more than ``n_rows`` rounded up
    to a power of two; and the warps for a tile of that many elements."""
    block_rows = min(max(1, tile_elements // row_elements), next_power_of_2(n_rows))
    _, num_warps = row_launch_settings(block_rows * row_elements, max_block=MAX_BLOCK)
    return block_rows, num_warps


# --------------------------------------------------------------------------------------
# Registration with PyTorch, so torch.compile sees each launcher as one opaque op.
# --------------------------------------------------------------------------------------


def has_no_data(t: torch.Tensor) -> bool:
    """Whether ``t`` only describes a tensor: on the meta device, or a fake tensor (of a
    caller's ``FakeTensorMode``, ``torch.export``, or ``torch.compile`` tracing) whatever
    device it claims. No kernel ever runs on such a tensor, so its device need not suit Triton.
    While torch.compile traces, its fake tensors stand for the real ones the graph will run
    on: they count as having data (and Dynamo could not trace ``is_fake``)."""
    return t.is_meta or (not torch.compiler.is_compiling() and is_fake(t))


def is_meta(*tensors: torch.Tensor | None) -> bool:
    """Whether any given tensor is on the meta device (shape inference: no kernel runs, a
    launcher gives its fake's outputs)."""
    return any(t is not None and t.device.type == "meta" for t in tensors)


def _any_meta(args: tuple) -> bool:
    """Whether a positional tensor argument has no data (:func:`has_no_data`). Launchers
    take tensors positionally."""
    return any(isinstance(arg, torch.Tensor) and has_no_data(arg) for arg in args)


def liger_custom_op(name: str, mutates_args: Sequence[str] = ()):
    """Register a kernel launcher as the custom op ``liger::<name>``.

    The returned callable runs the launcher directly in eager mode (no dispatcher
    overhead on the hot path) and goes through the registered op while
    ``torch.compile`` traces, so Dynamo never tries to trace into Triton and needs no
    graph break, and for meta tensors (shape inference, meta-device models), which the
    dispatcher hands to the fake implementation: meta in, meta out, no kernel launched
    (the same for fake tensors under a caller's ``FakeTensorMode``). Register the shape function with ``@<launcher>.register_fake``. The
    launcher's annotations define the op schema: use ``torch.Tensor``, ``int``,
    ``float``, ``bool``, ``str`` and ``Optional`` of those; return a tensor or a tuple
    of fresh tensors (never an input or a view of one), and list every argument the
    launcher writes in ``mutates_args``.
    """

    def decorator(fn):
        op = torch.library.custom_op(f"liger::{name}", fn, mutates_args=tuple(mutates_args))

        @functools.wraps(fn)
        def dispatch(*args, **kwargs):
            if torch.compiler.is_compiling() or _any_meta(args):
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        dispatch.op = op
        dispatch.register_fake = op.register_fake
        return dispatch

    return decorator
