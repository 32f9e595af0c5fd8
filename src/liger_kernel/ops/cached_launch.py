"""``kernel[grid](...)`` with Triton's per-call specialisation looked up once per distinct
specialisation (:func:`launch_kernel`), then the compiled kernel's launcher called directly.

``kernel[grid](*args)`` costs tens of microseconds of host time in Triton: it reads its
knobs, specialises every argument, builds a string cache key and looks the compiled kernel
up. A training step launches the same few kernels with the same argument properties
hundreds of times, and when the GPU outpaces Python that host time shows as GPU idle time
(docs/performance.md has the figure).

This is the one place that reaches past Triton's public launch API: the compiled kernel's
``run``, ``function`` and ``packed_metadata`` and ``torch._C._cuda_getCurrentRawStream``. A
Triton without them (or with launch hooks installed, under the interpreter, or with
``LIGER_KERNEL_FAST_LAUNCH=0``) gets every launch through ``kernel[grid]``.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton

from liger_kernel.ops.config import LaunchConfig, launch_config
from liger_kernel.ops.launch import is_interpreter

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
    if isinstance(arg, int) and kind is int:  # not a bool or another int subclass
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
