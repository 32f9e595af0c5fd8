"""Launching Triton kernels: geometry heuristics, cached launches and custom-op registration.

* :func:`is_interpreter` - whether Triton runs kernels through its CPU interpreter
  (``TRITON_INTERPRET=1``), which is how the whole test suite runs without a GPU.
* :func:`row_launch_settings` - block size and warp count for a row-wise kernel from the
  row width; rows wider than :data:`MAX_FUSED_BLOCK` are processed in a loop over
  column blocks instead of one giant register tile (which would spill).
* :func:`num_programs_for_rows` - grid size for persistent row kernels.
* :func:`launch_kernel` - ``kernel[grid](...)`` with Triton's specialisation looked up once.
* :func:`liger_custom_op` - registers a launcher as an opaque ``torch.library`` custom op.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import torch
import triton
from torch._subclasses.fake_tensor import is_fake

from liger_kernel.ops.config import LaunchConfig, launch_config

# Widest row handled as a single register tile. Above it kernels loop over column
# blocks of this width: a 64K-wide fp32 tile per program exhausts the register file
# and spills to local memory, which is several times slower than a second pass.
MAX_FUSED_BLOCK = 8192

# Largest block any kernel may allocate (Triton's per-tensor element limit is 2**20).
MAX_BLOCK = 65536

@functools.cache
def is_interpreter() -> bool:
    """True when Triton executes kernels with its CPU interpreter (``TRITON_INTERPRET=1``).

    Read once: Triton itself decides when ``triton.jit`` decorates a kernel (at import), so
    a later change of the variable could not switch the kernels anyway."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
# Kernel launch with a cached specialisation.
#
# ``kernel[grid](*args)`` costs tens of microseconds of host time in Triton: it reads its
# knobs, specialises every argument, builds a string cache key and looks the compiled kernel
# up. A training step launches the same few kernels with the same argument properties
# hundreds of times, and when the GPU outpaces Python that host time shows as GPU idle time
# (docs/performance.md has the figure). ``launch_kernel`` does Triton's lookup once per distinct
# specialisation and afterwards calls the compiled kernel's launcher directly.
# --------------------------------------------------------------------------------------

_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1



@dataclasses.dataclass(frozen=True)
class KernelLaunchConfig(LaunchConfig):
    """How :func:`launch_kernel` starts a kernel.

    ``cached``: reuse Triton's specialisation after the first launch (the default). The
    environment variable ``LIGER_KERNEL_FAST_LAUNCH=0``, read once at import, makes the
    default False (every launch through ``kernel[grid]``: for A/B measurements of host time
    and as an escape hatch); ``override_launch_config(KernelLaunchConfig, cached=...)``
    switches it within a block.
    """

    cached: bool = True

    @classmethod
    def heuristic(cls) -> KernelLaunchConfig:
        return _DEFAULT_KERNEL_LAUNCH


_DEFAULT_KERNEL_LAUNCH = KernelLaunchConfig(
    cached=os.environ.get("LIGER_KERNEL_FAST_LAUNCH", "1") not in ("0", ""))


def _argument_key(arg: object) -> object:
    """Everything Triton specialises a runtime argument on, or a superset of it.

    Tensors: dtype and 16-byte alignment of the data pointer. Integers: whether the value
    is 1, divisible by 16, and which integer type holds it. Floats and bools are not
    specialised on value; None is a constant. Returns ``NotImplemented`` for anything else
    (that launch takes Triton's own path).
    """
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() & 15 == 0)
    kind = type(arg)
    if kind is int:
        width = 32 if _I32_MIN <= arg <= _I32_MAX else (64 if _I32_MIN <= arg <= _I64_MAX else 65)
        return (width, arg == 1, arg & 15 == 0)
    if kind is float or kind is bool or arg is None:
        return kind
    return NotImplemented


class _CachedLaunch:
    """A compiled kernel and where each of its parameters comes from in a call."""

    __slots__ = ("compiled", "keyword_names", "defaults")

    def __init__(self, kernel, compiled, n_positional: int) -> None:
        self.compiled = compiled
        names = list(kernel.arg_names)
        # Parameters after the positional ones, in signature order: taken from the call's
        # keywords or, if absent there, the signature default.
        self.keyword_names = tuple(names[n_positional:])
        parameters = kernel.signature.parameters
        self.defaults = {name: parameters[name].default for name in self.keyword_names}


_LAUNCH_CACHE: dict[tuple, _CachedLaunch] = {}


def _hook_installed(hook: object) -> bool:
    # Triton <= 3.5 keeps None or a callable here; 3.6 an always-present chain of hooks.
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return True  # an older Triton without knobs: keep its own launch path
    return _hook_installed(runtime.launch_enter_hook) or _hook_installed(runtime.launch_exit_hook)


def launch_kernel(kernel, grid: tuple[int, ...], *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` with Triton's per-call specialisation cached.

    ``args`` are the kernel's leading runtime parameters in order; ``kwargs`` its constexpr
    parameters (by name) and launch options (``num_warps``, ``num_stages``, ...). The first
    call with a given kernel, device, option set and argument properties (see
    :func:`_argument_key`) goes through Triton, which compiles or finds the kernel; later
    calls with the same properties launch that compiled kernel directly on the current
    stream. Under the interpreter, with launch hooks installed (profilers), for arguments
    of other kinds or with ``LIGER_KERNEL_FAST_LAUNCH=0``, every call goes through Triton.
    Returns what Triton returns for the launch (the compiled kernel; None under the
    interpreter).
    """
    if (is_interpreter() or not launch_config(KernelLaunchConfig).cached or not isinstance(kernel, triton.runtime.JITFunction)
            or type(grid) is not tuple):
        return kernel[grid](*args, **kwargs)
    arg_keys = tuple(map(_argument_key, args))
    if NotImplemented in arg_keys:
        return kernel[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    try:
        key = (kernel, device, arg_keys, tuple(kwargs.items()))
        cached = _LAUNCH_CACHE.get(key)
    except TypeError:  # an unhashable keyword value
        return kernel[grid](*args, **kwargs)
    if cached is None or _launch_hooks_set():
        compiled = kernel[grid](*args, **kwargs)
        if cached is None and hasattr(compiled, "result"):
            compiled = compiled.result()
        if cached is None and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            _LAUNCH_CACHE[key] = _CachedLaunch(kernel, compiled, len(args))
        return compiled
    defaults = cached.defaults
    tail = [kwargs[name] if name in kwargs else defaults[name] for name in cached.keyword_names]
    compiled = cached.compiled
    n = len(grid)
    compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                 torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *tail)
    return compiled


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
