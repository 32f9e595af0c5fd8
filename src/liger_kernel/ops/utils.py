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
* :func:`once_differentiable` - the decorator of every autograd Function's backward.

This module imports only torch and triton.
"""

from __future__ import annotations

import functools
import math
import os
import sys
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
    :data:`MAX_FUSED_BLOCK`, read at call time so that the tunable takes effect); a kernel
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


TORCH_TO_TRITON_DTYPE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}


# --------------------------------------------------------------------------------------
# Kernel launch with a cached specialisation.
#
# ``kernel[grid](*args)`` costs tens of microseconds of host time in Triton: it reads its
# knobs, specialises every argument, builds a string cache key and looks the compiled kernel
# up. A training step launches the same few kernels with the same argument properties
# hundreds of times, and when the GPU outpaces Python that host time shows as GPU idle time
# (H200, llama-1b: ~11 ms idle per step in the forward). ``launch_kernel`` does Triton's lookup once
# per distinct specialisation and afterwards calls the compiled kernel's launcher directly.
# --------------------------------------------------------------------------------------

_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1

# Environment switch (read once): LIGER_KERNEL_FAST_LAUNCH=0 sends every launch through
# ``kernel[grid]`` (for A/B measurements and as an escape hatch).
FAST_LAUNCH = os.environ.get("LIGER_KERNEL_FAST_LAUNCH", "1") not in ("0", "")


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
    if (not FAST_LAUNCH or is_interpreter() or not isinstance(kernel, triton.runtime.JITFunction)
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


# --------------------------------------------------------------------------------------
# Backward passes are differentiable once only.
#
# Every backward here runs Triton kernels (or writes into buffers) that autograd cannot see
# through, so the gradients it returns have no graph back to the inputs: differentiating
# them again (``create_graph=True``, then a second backward) must raise, never return a
# second derivative that silently lacks this op's part.
# --------------------------------------------------------------------------------------


class _SecondDerivativeRaises(torch.autograd.Function):
    """``apply(n, *tensors)``: aliases of the first ``n`` tensors (a once-differentiable
    backward's gradients); differentiating them raises. The other tensors (the Function's
    saved inputs) only connect this node to them, so that a second derivative with respect
    to them, ``torch.autograd.grad(.., inputs)`` included, runs into it."""

    @staticmethod
    def forward(ctx, n_grads: int, *tensors: torch.Tensor):
        # Aliases, not the inputs themselves: autograd attaches this node to outputs only.
        return tuple(t.detach() for t in tensors[:n_grads])

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError("trying to differentiate twice a liger_kernel op: its backward is once_differentiable "
                           "(double backward is not supported)")


def _warn_unanchored_second_derivative(function_name: str) -> None:
    # Python's default filter shows each distinct message once.
    import warnings

    warnings.warn(
        f"{function_name}'s backward ran with create_graph=True. It is once-differentiable and keeps "
        "none of its inputs: differentiating its gradients again raises through backward(), but "
        "torch.autograd.grad(.., inputs) of them silently leaves out this op's part of the second "
        "derivative. Use the PyTorch op where second derivatives are needed.",
        stacklevel=4,
    )


def once_differentiable(backward):
    """``torch.autograd.function.once_differentiable`` for an autograd Function's backward,
    closing the gaps through which a second derivative comes out silently wrong.

    torch's decorator runs the backward without grad and, under ``create_graph=True``, marks
    the gradients so that differentiating them raises, but only when an incoming gradient
    requires grad, and with a node connected to nothing: with incoming gradients that do
    not require grad (the gradient of ``y.sum()``) the results look constant in the inputs,
    and ``torch.autograd.grad(f(grad_x) + g(x), x)`` never reaches the marking node; either
    way the second derivative silently lacks this op's part. Here, under ``create_graph``,
    every gradient is marked by a node also connected to the saved inputs that require
    grad, which a second derivative with respect to them must pass. (A Function that saves
    none of its inputs, e.g. one that keeps only gradients computed in its forward, is
    marked unconnected, as by torch's decorator, and warns (once per Function): there
    ``torch.autograd.grad(.., inputs)`` of its gradients cannot be made to raise.) Without
    ``create_graph`` the backward's results are returned untouched.
    """
    checked = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():
            # No graph asked for (the usual backward, run with grad mode off): nothing to
            # mark, and no need for torch's no_grad context (host time on every call).
            return backward(ctx, *grads)
        if torch.compiler.is_compiling():
            return checked(ctx, *grads)
        # Unpacked before the backward runs: it may scale a saved buffer in place, which a
        # later unpack would report as a modified saved tensor.
        anchors = [t for t in ctx.saved_tensors if isinstance(t, torch.Tensor) and t.requires_grad]
        if not anchors and any(ctx.needs_input_grad):
            _warn_unanchored_second_derivative(type(ctx).__name__.removesuffix("Backward"))
        outputs = checked(ctx, *grads)
        single = not isinstance(outputs, tuple)
        results = [outputs] if single else list(outputs)
        positions = [i for i, r in enumerate(results) if isinstance(r, torch.Tensor)]
        if positions:
            # Detached leaves that require grad (as torch's decorator makes them), so that the
            # node is recorded even where no anchor requires grad.
            marked = _SecondDerivativeRaises.apply(
                len(positions), *(results[i].detach().requires_grad_() for i in positions), *anchors)
            for i, tensor in zip(positions, marked):
                results[i] = tensor
        return results[0] if single else tuple(results)

    return wrapper


# ======================================================================================
# Row normalisation (RMSNorm, LayerNorm): shared kernels and launch tunables.
#
# Both norms normalise each row by per-row statistics and then scale (and shift):
#     xhat = (x - mu) * rstd,   y = xhat * (w + offset) [+ b]
# with mu = 0, rstd = 1/sqrt(mean(x^2) + eps) for RMSNorm and mu = mean(x),
# rstd = 1/sqrt(var(x) + eps) for LayerNorm. One forward and one backward kernel serve
# both, specialised by constexpr flags (CENTER, HAS_BIAS, CASTING); the full math and the
# casting rules are in the docstrings of ops/rms_norm.py and ops/layer_norm.py.
# ======================================================================================

import dataclasses  # noqa: E402

import triton.language as tl  # noqa: E402

# How the normalised row meets the weight (the CASTING constexpr of the kernels below).
ROW_NORM_CAST_NONE = 0  # every step rounded to the input dtype, as torch would compute in that dtype
ROW_NORM_CAST_LLAMA = 1  # statistics in fp32, xhat rounded to the input dtype, then times the weight
ROW_NORM_CAST_FP32 = 2  # everything in fp32, rounded once on output (Gemma RMSNorm, LayerNorm)

# ---- Tunables (change these after GPU measurements; nothing else hard-codes them) ----
# Elements per program tile when a whole row fits one tile: rows narrower than this are
# packed ROW_NORM_TILE_ELEMENTS // width to a tile so small hidden sizes still move
# enough bytes per program.
ROW_NORM_TILE_ELEMENTS = 4096
ROW_NORM_MAX_ROWS_PER_TILE = 256
# Backward warps: the backward keeps ~6 fp32 values per element live (dy, x, w, g, xhat,
# the dW accumulator), so it gets fewer elements per thread than the forward: ptxas (sm_90)
# gives the fused RMSNorm backward ~110 registers at 16 elements/thread (4096 cols, 8 warps:
# only 2 programs = 16 warps fit an SM) and 64 at 8 elements/thread (16 warps, 2 programs =
# 32 warps per SM). Measured (sweep below), 16 per thread with 8192-element tiles (2 rows of
# 4096, 16 warps) is the fastest: more bytes in flight per program beat occupancy here.
ROW_NORM_BACKWARD_ELEMENTS_PER_THREAD = 16
# Backward persistent grid: programs per SM = ROW_NORM_WARPS_PER_SM // backward warps,
# clamped to [1, ROW_NORM_MAX_PROGRAMS_PER_SM]. Each program owns one fp32 row of the
# (P, H) partial dW buffer, so fewer programs also means a smaller final reduction.
# ptxas gives the 16-warp backward ~110 registers a thread, so only one such program is
# resident per SM anyway: 16 (one program per SM, P = #SMs) beats 32 (a second wave of
# programs and twice the partials). H200 run 6, 16384 x 4096 bf16 fwd+bwd: RMSNorm
# 0.1793 vs 0.1858 ms, LayerNorm 0.1851 vs 0.1951 ms.
ROW_NORM_WARPS_PER_SM = 16
ROW_NORM_MAX_PROGRAMS_PER_SM = 4
# Backward tile when a whole row fits one tile (the forward uses ROW_NORM_TILE_ELEMENTS):
# ROW_NORM_BACKWARD_TILE_ROWS rows, within [ROW_NORM_BACKWARD_MIN_TILE_ELEMENTS,
# ROW_NORM_BACKWARD_TILE_ELEMENTS] elements. H200 sweeps, fwd+bwd bf16, CUDA-graph timing:
# run 2 (RMSNorm 16384 x 4096) 8192-element tiles at 16 elements/thread 0.197 ms, 4096 at
# 8/thread 0.225 ms; run 6, at 16 elements/thread: 16384 x 4096 RMSNorm 0.1795 ms (8192)
# vs 0.2102 (4096), but 8192 x 2048 RMSNorm 0.0552 (4096) vs 0.0609 (8192), LayerNorm
# 0.0573 vs 0.0688: two rows a tile is the best at both widths.
ROW_NORM_BACKWARD_TILE_ELEMENTS = 8192
ROW_NORM_BACKWARD_MIN_TILE_ELEMENTS = 4096
ROW_NORM_BACKWARD_TILE_ROWS = 2
# Backward of fused rows: load the next tile while the current one is reduced and stored.
ROW_NORM_BACKWARD_PREFETCH = True
# Backward dW/dB accumulation of a multi-row tile: None picks per shape (a (rows, cols)
# register accumulator summed once at the end when a tile's rows lie in different warps,
# where a per-tile sum over rows is a shared-memory reduction; the per-tile sum when each
# thread holds whole columns). H200, llama-1b e2e (8192 x 2048, tiles of 4 x 2048 over
# 2 x 8 warps): 77.6 -> 41.1 us per backward with the accumulator. True/False force one.
ROW_NORM_BACKWARD_ROW_ACCUMULATOR = None
# Forward warps: None keeps row_launch_settings' choice for the tile (8 warps, 16 elements
# per thread, for a 4096-element tile); a number sets the elements each thread holds.
# LayerNorm (CENTER) has its own: its two dependent row reductions (mean, then the centred
# variance) each cross every warp of the row, so fewer warps per row pay off there. Only
# whole-row tiles use it (rows wider than MAX_FUSED_BLOCK keep the heuristic).
# H200, 16384 x 4096 bf16 forward (run 6): RMSNorm None 0.0703 ms, 32 0.0721; LayerNorm
# None 0.0775 ms, 32 0.0726.
ROW_NORM_FORWARD_ELEMENTS_PER_THREAD = None
ROW_NORM_CENTERED_FORWARD_ELEMENTS_PER_THREAD = 32
# The backward's (P, H) fp32 partials are summed by one Triton launch per backward
# (dW and dB together, rounded straight to the parameter dtype); False uses torch's
# ``partials.sum(0).to(dtype)``, two launches per parameter, for A/B measurements.
# H200 run 6 (16384 x 4096): RMSNorm fwd+bwd 0.1932 ms against torch's 0.1968; narrow
# column blocks spread the sum over more SMs: 16 columns 0.1822 ms, 64 columns 0.1857.
ROW_NORM_TRITON_PARTIALS_SUM = True
PARTIALS_SUM_BLOCK_ROWS = 64
PARTIALS_SUM_BLOCK_COLS = 16


@dataclasses.dataclass(frozen=True)
class RowNormLaunch:
    """Launch geometry shared by the forward and backward row-normalisation kernels."""

    block_rows: int  # rows per forward tile (power of two)
    backward_block_rows: int  # rows per backward tile (power of two)
    block_cols: int  # columns per tile (power of two); a row wider than this is looped over
    num_warps: int  # forward
    backward_num_warps: int
    fused: bool  # the whole row fits one tile (single pass over registers)
    n_tiles: int  # forward grid: one program per tile
    backward_programs: int  # backward grid: persistent programs striding over the tiles
    round_by_hand: bool  # interpreter only: see _row_norm_round
    backward_prefetch: bool
    backward_row_accumulator: bool  # dW/dB kept per tile row until the end (see the tunable)


def row_norm_launch(n_rows: int, n_cols: int, device: torch.device, center: bool = False) -> RowNormLaunch:
    """Tile shape, warps and grid sizes for normalising ``n_rows`` rows of ``n_cols``
    (``center``: LayerNorm, which subtracts the mean).

    Memoised (a training step asks for the same few shapes hundreds of times, and the
    host time of a launch shows as GPU idle time when the GPU outpaces Python); the key
    includes the tunables, so changing one (``benchmarks.tune``) takes effect at once.
    """
    tunables = (MAX_FUSED_BLOCK, MAX_BLOCK, ROW_NORM_TILE_ELEMENTS, ROW_NORM_MAX_ROWS_PER_TILE,
                ROW_NORM_BACKWARD_ELEMENTS_PER_THREAD, ROW_NORM_WARPS_PER_SM, ROW_NORM_MAX_PROGRAMS_PER_SM,
                ROW_NORM_BACKWARD_TILE_ELEMENTS, ROW_NORM_BACKWARD_MIN_TILE_ELEMENTS, ROW_NORM_BACKWARD_TILE_ROWS,
                ROW_NORM_BACKWARD_PREFETCH, ROW_NORM_BACKWARD_ROW_ACCUMULATOR, is_interpreter())
    forward_elements_per_thread = (ROW_NORM_CENTERED_FORWARD_ELEMENTS_PER_THREAD if center
                                   else ROW_NORM_FORWARD_ELEMENTS_PER_THREAD)
    return _row_norm_launch(n_rows, n_cols, multiprocessor_count(device), forward_elements_per_thread, tunables)


def backward_writes_into_grad(in_place: bool, grad_output: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a norm's in-place backward may write dx over ``grad_output``.

    Only where asked for (``in_place``) and grad_output is a buffer that autograd made for
    this backward and nobody reads afterwards:

    * contiguous, of x's dtype and without a zero stride: the backward of ``y.sum()`` hands
      over one scalar expanded to y's shape, one element behind all of them;
    * not part of a graph (``create_graph=True``), which may have saved it;
    * not the caller's tensor: autograd passes the very tensor given to ``y.backward(g)`` or
      ``torch.autograd.grad(y, x, g)`` into the backward (also through ops that pass a
      gradient on unchanged, such as an addition, or as a view of it through view ops), and
      the caller may read ``g`` again. No API tells autograd's own buffers from others;
      :func:`_grad_owned_by_autograd` tells them by their Python references and by the
      tensors sharing their storage.

    Never under torch.compile, where the backward must not mutate its input (it may be a
    view the traced graph created without grad; Inductor plans the buffers itself).

    Memory: where the write is refused the backward allocates dx, one more (N, H) buffer
    while it runs. In a model the norm's gradient comes from the projections it feeds, a
    fresh tensor that autograd owns, so training keeps the saving; a gradient passed in by
    the caller, or held by a hook (also as a detached alias), costs the buffer instead of
    being overwritten.
    """
    return (in_place and not torch.compiler.is_compiling() and grad_output.dtype == x.dtype
            and grad_output.is_contiguous() and 0 not in grad_output.stride() and not grad_output.requires_grad
            and _grad_owned_by_autograd(grad_output))


# What _grad_owned_by_autograd counts for a gradient that autograd made itself, when a norm's
# backward asks backward_writes_into_grad: Python references to the gradient, to the tensor it
# is a view of (if any), and users of its storage, without and with such a base. None: unknown,
# so nothing is written in place. Measured at import by _calibrate_owned_grad_references.
_OWNED_GRAD_REFERENCES: tuple[int, int, int, int] | None = None
# Set while calibrating: _grad_owned_by_autograd records its counts here instead of deciding.
_CALIBRATION_COUNTS: list[tuple[int, int, int]] | None = None


def _storage_users(tensor: torch.Tensor) -> int:
    """How many tensors (and storage handles) share ``tensor``'s storage, as c10 counts them."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _grad_owned_by_autograd(grad: torch.Tensor) -> bool:
    """Whether nothing but the backward that received ``grad`` can see its memory: then
    autograd made it for that backward alone.

    Two counts, each compared with the same count for a gradient autograd made, measured at
    import through the same call chain (an autograd Function whose decorated backward calls
    backward_writes_into_grad as the norms' do):

    * Python references (CPython's ``sys.getrefcount``) to ``grad`` and to the tensor it is a
      view of. A gradient computed inside autograd's engine reaches a Python backward with only
      the references of the call chain; one the caller passed to ``backward()`` or
      ``autograd.grad``, or that a hook keeps, has the caller's too, and a view of it (through
      view ops of the graph) has it as ``_base``.
    * Users of its storage (c10's use count): every tensor sharing the memory holds one, so a
      hook that keeps ``grad.detach()`` or ``grad.data`` (activation-gradient caches), or a
      module backward hook that keeps a detached alias of the norm consumer's ``grad_input``,
      shows as one user more - something Python references cannot see.

    Without CPython reference counts (another interpreter, a free-threaded build) or without
    torch's storage use count, nothing counts as owned. A gradient autograd hands to two
    branches of the graph as one tensor (the norm's output added to a residual stream) is seen
    on torch 2.11 (CUDA) and 2.13 (CPU), whose engines keep the Python object referenced
    meanwhile (``tests/ops/test_utils.py``); other versions were not checked, so there that case
    stays the caller's to avoid with ``in_place=False`` as the norms' docstrings say.
    """
    limits = _OWNED_GRAD_REFERENCES
    if limits is None and _CALIBRATION_COUNTS is None:
        return False  # unknown (or not countable in this torch): never written in place
    base = grad._base
    counts = (sys.getrefcount(grad), 0 if base is None else sys.getrefcount(base), _storage_users(grad))
    if _CALIBRATION_COUNTS is not None:
        _CALIBRATION_COUNTS.append(counts)
        return False
    max_refs, max_base_refs, max_users, max_users_of_a_view = limits
    return (counts[0] <= max_refs and counts[1] <= max_base_refs
            and counts[2] <= (max_users if base is None else max_users_of_a_view))


class _GradOwnershipProbe(torch.autograd.Function):
    """Calibration of _OWNED_GRAD_REFERENCES: ``y = 2x`` whose backward reaches
    backward_writes_into_grad exactly as the norms' backward does."""

    @staticmethod
    def forward(ctx, X: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(X)
        ctx.in_place = True
        return X * 2.0

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        (X,) = ctx.saved_tensors
        write_into_grad = backward_writes_into_grad(ctx.in_place, grad_output, X)
        return grad_output * 2.0 if not write_into_grad else grad_output


def _calibrate_owned_grad_references(device: str = "cpu") -> tuple[int, int, int, int] | None:
    """Counts of :func:`_grad_owned_by_autograd` for gradients autograd made: one plain, one a
    view of another (None where they cannot be measured)."""
    global _CALIBRATION_COUNTS
    if sys.implementation.name != "cpython" or not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None
    _CALIBRATION_COUNTS = []
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(2, 4, device=device, requires_grad=True)
            (_GradOwnershipProbe.apply(x) * 2.0).sum().backward()  # a fresh (2, 4) gradient
            (_GradOwnershipProbe.apply(x).view(-1) * 2.0).sum().backward()  # a (2, 4) view of a fresh (8,)
        (plain, plain_base, plain_users), (viewed, base, viewed_users) = _CALIBRATION_COUNTS
    except Exception:  # any surprise here (no storage use count in this torch) only means: never write in place
        return None
    finally:
        _CALIBRATION_COUNTS = None
    if plain_base != 0 or base == 0 or viewed_users <= plain_users:
        return None  # the probes did not see the gradients they were built for
    return min(plain, viewed), base, plain_users, viewed_users


_OWNED_GRAD_REFERENCES = _calibrate_owned_grad_references()


def row_norm_grad_buffers(grad_output: torch.Tensor, x: torch.Tensor,
                          in_place: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dy_rows, dx_rows, grad_x)`` for a norm backward launch over x's rows.

    In place, dx is written over dy and ``grad_x`` is an empty placeholder (a custom op may
    not return an alias of its input; the caller returns grad_output); otherwise dx is a
    fresh buffer and ``grad_x`` its view in x's shape.
    """
    n_rows, n_cols = as_rows(x).shape
    if in_place:
        dy_rows = grad_output.view(n_rows, n_cols)
        return dy_rows, dy_rows, x.new_empty((0,))
    dx_rows = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    return as_rows(grad_output), dx_rows, dx_rows.view(x.shape)


@functools.lru_cache(maxsize=1024)
def _row_norm_launch(n_rows: int, n_cols: int, n_sms: int, forward_elements_per_thread: int | None,
                     tunables: tuple) -> RowNormLaunch:
    block_cols, _ = row_launch_settings(n_cols)
    fused = block_cols >= n_cols

    def rows_per_tile(tile_elements: int) -> int:
        if not fused:
            return 1
        return min(max(1, tile_elements // block_cols), ROW_NORM_MAX_ROWS_PER_TILE,
                   next_power_of_2(n_rows))

    block_rows = rows_per_tile(ROW_NORM_TILE_ELEMENTS)
    backward_block_rows = rows_per_tile(min(ROW_NORM_BACKWARD_TILE_ELEMENTS, max(
        ROW_NORM_BACKWARD_MIN_TILE_ELEMENTS, ROW_NORM_BACKWARD_TILE_ROWS * block_cols)))
    _, num_warps = row_launch_settings(block_rows * block_cols, max_block=MAX_BLOCK)
    if forward_elements_per_thread is not None and fused and not is_interpreter():
        num_warps = _warps_for(block_rows * block_cols, forward_elements_per_thread)
    backward_num_warps = _warps_for(backward_block_rows * block_cols, ROW_NORM_BACKWARD_ELEMENTS_PER_THREAD)
    if is_interpreter():
        backward_num_warps = num_warps  # ignored by the interpreter, but it sizes the grid below
    n_tiles = cdiv(n_rows, block_rows)
    programs_per_sm = max(1, min(ROW_NORM_MAX_PROGRAMS_PER_SM, ROW_NORM_WARPS_PER_SM // backward_num_warps))
    programs = _persistent_grid(cdiv(n_rows, backward_block_rows), n_sms, programs_per_sm)
    # Triton's default layout gives each warp 32 threads x 8 contiguous columns; a tile row
    # narrower than all warps together puts the tile's rows into different warps.
    row_accumulator = ROW_NORM_BACKWARD_ROW_ACCUMULATOR
    if row_accumulator is None:
        row_accumulator = backward_block_rows > 1 and block_cols < 256 * backward_num_warps
    return RowNormLaunch(block_rows, backward_block_rows, block_cols, num_warps, backward_num_warps, fused, n_tiles,
                         programs, is_interpreter(), ROW_NORM_BACKWARD_PREFETCH, bool(row_accumulator))


def _warps_for(tile_elements: int, elements_per_thread: int) -> int:
    """Warps (a power of two in [1, 32]) giving each thread about ``elements_per_thread``."""
    return next_power_of_2(max(1, min(32, tile_elements // (32 * elements_per_thread))))


@triton.jit
def _div(total, count):
    """``total / count`` correctly rounded: Triton's ``/`` on fp32 is an approximate division
    on the GPU, and a mean that misses by an ulp (a constant row whose mean is not exactly
    its value) is amplified by rstd up to 1/sqrt(eps)."""
    return tl.math.div_rn(total, count * 1.0)


@triton.jit
def _row_norm_round(x, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (nearest even) and returned as fp32.

    Triton's interpreter converts fp32 -> bf16 by truncation, unlike the GPU; with BY_HAND
    (set only under the interpreter) the bf16 rounding is done on the bit pattern so CPU
    runs round exactly as the GPU does. Values rounded this way store exactly.
    """
    if BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _row_norm_square(x, dtype: tl.constexpr, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """x**2 for the mean of squares; rounded to the input dtype in CASTING 0, as ``x.pow(2)`` is there."""
    if CASTING == 0:
        return _row_norm_round(x * x, dtype, ROUND_BY_HAND)
    else:
        return x * x


@triton.jit
def _row_norm_rstd(sum_sq, n_cols, eps, dtype: tl.constexpr, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """1/sqrt(mean + eps) from the row's sum of squares (accumulated in fp32).

    CASTING 0 rounds as torch does computing ``rsqrt(x.pow(2).mean() + eps)`` in the input
    dtype: the mean, the sum with eps and the rsqrt each rounded to it. Without that, rstd
    can differ from torch's by an ulp of the dtype, which shows as up to 3 ulps in y.
    """
    mean_sq = _div(sum_sq, n_cols)
    if CASTING == 0:
        mean_sq = _row_norm_round(mean_sq, dtype, ROUND_BY_HAND)
        return _row_norm_round(tl.rsqrt(_row_norm_round(mean_sq + eps, dtype, ROUND_BY_HAND)), dtype, ROUND_BY_HAND)
    else:
        return tl.rsqrt(mean_sq + eps)


@triton.jit
def _row_norm_scale_store(Y_ptrs, X, W, B, cols, col_mask, mask, xc, rstd, offset,
                          HAS_BIAS: tl.constexpr, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """y = xhat * (w + offset) [+ b] for one tile, rounded as CASTING says, stored to Y_ptrs."""
    in_dtype = X.dtype.element_ty
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    if CASTING == 0:
        # Emulates computing in the input dtype: each product rounded to it.
        rstd_in = _row_norm_round(rstd, in_dtype, ROUND_BY_HAND)
        xhat = _row_norm_round(xc * rstd_in[:, None], in_dtype, ROUND_BY_HAND)
        w = _row_norm_round(w, in_dtype, ROUND_BY_HAND)
    elif CASTING == 1:
        xhat = _row_norm_round(xc * rstd[:, None], in_dtype, ROUND_BY_HAND)
    else:
        xhat = xc * rstd[:, None]
    y = xhat * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_dtype = Y_ptrs.dtype.element_ty
    if ROUND_BY_HAND:
        y = _row_norm_round(y, out_dtype, ROUND_BY_HAND)
    tl.store(Y_ptrs, y.to(out_dtype), mask=mask)


@triton.jit
def row_norm_forward_kernel(
    X, W, B, Y, MEAN, RSTD,
    n_rows, n_cols, x_row_stride, y_row_stride,
    eps, offset,
    CENTER: tl.constexpr, HAS_BIAS: tl.constexpr, CASTING: tl.constexpr,
    FUSED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
):
    """One program per tile of BLOCK_ROWS rows: statistics, then y; stores rstd (and mean)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    x_rows = X + rows64[:, None] * x_row_stride
    y_rows = Y + rows64[:, None] * y_row_stride
    mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    if FUSED:
        cols = tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        xc = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if CENTER:
            mean = _div(tl.sum(xc, axis=1), n_cols)
            xc = tl.where(mask, xc - mean[:, None], 0.0)
        rstd = _row_norm_rstd(tl.sum(_row_norm_square(xc, X.dtype.element_ty, CASTING, ROUND_BY_HAND), axis=1),
                              n_cols, eps, X.dtype.element_ty, CASTING, ROUND_BY_HAND)
        _row_norm_scale_store(y_rows + cols[None, :], X, W, B, cols, col_mask, mask, xc, rstd, offset,
                              HAS_BIAS, CASTING, ROUND_BY_HAND)
    else:
        # Pass 1: statistics over column blocks. LayerNorm merges per-block (mean, M2)
        # pairs (Chan et al.), which avoids the cancellation of E[x^2] - E[x]^2.
        m2 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        sum_sq = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if CENTER:
                seen = start * 1.0
                block_n = tl.minimum(n_cols - start, BLOCK_COLS) * 1.0
                block_mean = _div(tl.sum(x, axis=1), block_n)
                d = tl.where(mask, x - block_mean[:, None], 0.0)
                delta = block_mean - mean
                total = seen + block_n
                mean += delta * (block_n / total)
                m2 += tl.sum(d * d, axis=1) + delta * delta * (seen * block_n / total)
            else:
                sum_sq += _row_norm_square(x, X.dtype.element_ty, CASTING, ROUND_BY_HAND)
        if CENTER:
            rstd = tl.rsqrt(_div(m2, n_cols) + eps)
        else:
            rstd = _row_norm_rstd(tl.sum(sum_sq, axis=1), n_cols, eps, X.dtype.element_ty, CASTING, ROUND_BY_HAND)
        # Pass 2: normalise and store (the row is re-read, mostly from L2).
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            xc = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if CENTER:
                xc = tl.where(mask, xc - mean[:, None], 0.0)
            _row_norm_scale_store(y_rows + cols[None, :], X, W, B, cols, col_mask, mask, xc, rstd, offset,
                                  HAS_BIAS, CASTING, ROUND_BY_HAND)
    tl.store(RSTD + rows64, rstd, mask=row_mask)
    if CENTER:
        tl.store(MEAN + rows64, mean, mask=row_mask)


@triton.jit
def _row_norm_grad_weight(W, X, cols, col_mask, offset, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """(w + offset) in fp32 for one column block, rounded as the forward used it."""
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    if CASTING == 0:
        w = _row_norm_round(w, X.dtype.element_ty, ROUND_BY_HAND)
    return w


@triton.jit
def _row_norm_grad_terms(dy_raw, x_raw, X, w, mask, mean, rstd,
                         CENTER: tl.constexpr, CASTING: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """From one loaded tile: (dy, xhat, g = dy * w, xhat as the forward multiplied it by w), fp32."""
    in_dtype = X.dtype.element_ty
    dy = dy_raw.to(tl.float32)
    xc = x_raw.to(tl.float32)
    if CENTER:
        xc = tl.where(mask, xc - mean[:, None], 0.0)
    xhat = xc * rstd[:, None]
    g = dy * w[None, :]
    if CASTING == 0:
        g = _row_norm_round(g, in_dtype, ROUND_BY_HAND)
        xhat_w = _row_norm_round(xc * _row_norm_round(rstd, in_dtype, ROUND_BY_HAND)[:, None], in_dtype,
                                 ROUND_BY_HAND)
    elif CASTING == 1:
        # Autograd through HF's `.to(input_dtype)` rounds dL/dxhat to the input dtype.
        g = _row_norm_round(g, in_dtype, ROUND_BY_HAND)
        xhat_w = _row_norm_round(xhat, in_dtype, ROUND_BY_HAND)
    else:
        xhat_w = xhat
    return dy, xhat, g, xhat_w


@triton.jit
def row_norm_backward_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    n_rows, n_cols, dy_row_stride, x_row_stride, dx_row_stride, offset,
    CENTER: tl.constexpr, HAS_BIAS: tl.constexpr, CASTING: tl.constexpr,
    FUSED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
    PREFETCH: tl.constexpr, ROW_ACCUMULATOR: tl.constexpr,
):
    """Persistent programs: program p handles tiles p, p + P, ... and writes its fp32 partial
    dW (and dB) to row p of DW_PARTIAL (DB_PARTIAL), so the final sum over P is fixed-order.

    DX may alias DY (in-place backward): every element of DY is read before the same
    program overwrites it, and no other program touches those rows.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_ROWS)
    partial_row = pid.to(tl.int64) * n_cols
    if FUSED:
        cols = tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        w = _row_norm_grad_weight(W, X, cols, col_mask, offset, CASTING, ROUND_BY_HAND)  # once per program
        # ROW_ACCUMULATOR: accumulated per tile row and summed over rows once at the end,
        # for tiles whose rows lie in different warps (e.g. 4 x 2048 at 16 warps: 2 x 8),
        # where a per-tile sum over rows costs a cross-warp (shared memory) reduction.
        if ROW_ACCUMULATOR:
            dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        else:
            dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        # Software prefetch: the loads of this program's next tile are issued before the
        # current tile's reductions and stores, so a persistent program keeps memory busy
        # instead of alternating load latency and compute (the loop carries the raw tiles).
        # The row statistics travel with the tile: a load of rstd (and mean) issued only when
        # the tile is processed would expose a full memory latency once per tile.
        if PREFETCH:
            rows64 = (pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
            mask = (rows64 < n_rows)[:, None] & col_mask[None, :]
            next_dy = tl.load(DY + rows64[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
            next_x = tl.load(X + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
            next_rstd = tl.load(RSTD + rows64, mask=rows64 < n_rows, other=0.0)
            next_mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            if CENTER:
                next_mean = tl.load(MEAN + rows64, mask=rows64 < n_rows, other=0.0)
        for tile in tl.range(pid, n_tiles, n_programs):
            rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            if PREFETCH:
                dy_raw = next_dy
                x_raw = next_x
                rstd = next_rstd
                mean = next_mean
                ahead = rows64 + n_programs * BLOCK_ROWS
                ahead_rows = ahead < n_rows
                ahead_mask = ahead_rows[:, None] & col_mask[None, :]
                next_dy = tl.load(DY + ahead[:, None] * dy_row_stride + cols[None, :], mask=ahead_mask, other=0.0)
                next_x = tl.load(X + ahead[:, None] * x_row_stride + cols[None, :], mask=ahead_mask, other=0.0)
                next_rstd = tl.load(RSTD + ahead, mask=ahead_rows, other=0.0)
                if CENTER:
                    next_mean = tl.load(MEAN + ahead, mask=ahead_rows, other=0.0)
            else:
                dy_raw = tl.load(DY + rows64[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
                x_raw = tl.load(X + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
                rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
                mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                if CENTER:
                    mean = tl.load(MEAN + rows64, mask=row_mask, other=0.0)
            dy, xhat, g, xhat_w = _row_norm_grad_terms(
                dy_raw, x_raw, X, w, mask, mean, rstd, CENTER, CASTING, ROUND_BY_HAND)
            if CENTER:
                dx = (g - xhat * _div(tl.sum(g * xhat, axis=1), n_cols)[:, None]
                      - _div(tl.sum(g, axis=1), n_cols)[:, None])
            else:
                dx = g - xhat * _div(tl.sum(g * xhat, axis=1), n_cols)[:, None]
            dx = dx * rstd[:, None]
            if ROUND_BY_HAND:
                dx = _row_norm_round(dx, DX.dtype.element_ty, ROUND_BY_HAND)
            tl.store(DX + rows64[:, None] * dx_row_stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if ROW_ACCUMULATOR:
                dw_acc += dy * xhat_w
                if HAS_BIAS:
                    db_acc += dy
            else:
                dw_acc += tl.sum(dy * xhat_w, axis=0)
                if HAS_BIAS:
                    db_acc += tl.sum(dy, axis=0)
        if ROW_ACCUMULATOR:
            dw_total = tl.sum(dw_acc, axis=0)
            db_total = tl.sum(db_acc, axis=0)
        else:
            dw_total = dw_acc
            db_total = db_acc
        tl.store(DW_PARTIAL + partial_row + cols, dw_total, mask=col_mask)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + partial_row + cols, db_total, mask=col_mask)
    else:
        for tile in tl.range(pid, n_tiles, n_programs):
            rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            dy_rows = DY + rows64[:, None] * dy_row_stride
            x_rows = X + rows64[:, None] * x_row_stride
            dx_rows = DX + rows64[:, None] * dx_row_stride
            rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
            mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            if CENTER:
                mean = tl.load(MEAN + rows64, mask=row_mask, other=0.0)
            # Pass 1: the row sums the gradient needs, sum(g * xhat) and sum(g).
            proj_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            g_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                w = _row_norm_grad_weight(W, X, cols, col_mask, offset, CASTING, ROUND_BY_HAND)
                dy, xhat, g, xhat_w = _row_norm_grad_terms(
                    tl.load(dy_rows + cols[None, :], mask=mask, other=0.0),
                    tl.load(x_rows + cols[None, :], mask=mask, other=0.0),
                    X, w, mask, mean, rstd, CENTER, CASTING, ROUND_BY_HAND)
                proj_acc += g * xhat
                if CENTER:
                    g_acc += g
            proj = _div(tl.sum(proj_acc, axis=1), n_cols)
            g_mean = _div(tl.sum(g_acc, axis=1), n_cols)
            # Pass 2: dx, and this program's partial dW/dB (its own buffer row, so the
            # read-modify-write needs no atomics; the first tile overwrites garbage).
            first = tile == pid
            for start in range(0, n_cols, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                w = _row_norm_grad_weight(W, X, cols, col_mask, offset, CASTING, ROUND_BY_HAND)
                dy, xhat, g, xhat_w = _row_norm_grad_terms(
                    tl.load(dy_rows + cols[None, :], mask=mask, other=0.0),
                    tl.load(x_rows + cols[None, :], mask=mask, other=0.0),
                    X, w, mask, mean, rstd, CENTER, CASTING, ROUND_BY_HAND)
                dx = g - xhat * proj[:, None]
                if CENTER:
                    dx -= g_mean[:, None]
                dx = dx * rstd[:, None]
                if ROUND_BY_HAND:
                    dx = _row_norm_round(dx, DX.dtype.element_ty, ROUND_BY_HAND)
                tl.store(dx_rows + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                dw_ptrs = DW_PARTIAL + partial_row + cols
                dw_prev = tl.where(first, 0.0, tl.load(dw_ptrs, mask=col_mask, other=0.0))
                tl.store(dw_ptrs, dw_prev + tl.sum(dy * xhat_w, axis=0), mask=col_mask)
                if HAS_BIAS:
                    db_ptrs = DB_PARTIAL + partial_row + cols
                    db_prev = tl.where(first, 0.0, tl.load(db_ptrs, mask=col_mask, other=0.0))
                    tl.store(db_ptrs, db_prev + tl.sum(dy, axis=0), mask=col_mask)


@triton.jit
def _sum_partials_kernel(PARTIALS, OUT_FIRST, OUT_SECOND, n_partials, n_cols,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """``OUT[c] = sum_p PARTIALS[k, p, c]`` for a column block; program axis 1 picks k
    (0: OUT_FIRST, 1: OUT_SECOND). The order of the sum is fixed by the tile shape alone, so
    the result does not depend on scheduling."""
    which = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    base = PARTIALS + which.to(tl.int64) * n_partials * n_cols
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(base + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        total = _row_norm_round(total, OUT_FIRST.dtype.element_ty, ROUND_BY_HAND)
        tl.store(OUT_FIRST + cols, total.to(OUT_FIRST.dtype.element_ty), mask=col_mask)
    else:
        total = _row_norm_round(total, OUT_SECOND.dtype.element_ty, ROUND_BY_HAND)
        tl.store(OUT_SECOND + cols, total.to(OUT_SECOND.dtype.element_ty), mask=col_mask)


def sum_partials(partials: torch.Tensor, dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Column sums of a norm backward's per-program partials, one new (H,) tensor per slab.

    ``partials`` is (K, P, H) fp32 with K = len(dtypes) in {1, 2} (dW, and dB for
    LayerNorm); slab k is summed over its P rows in fp32 and rounded once to ``dtypes[k]``.
    The outputs never share storage (a custom op's returns must not alias).
    """
    n_slabs, n_partials, n_cols = partials.shape
    if n_slabs != len(dtypes) or n_slabs not in (1, 2):
        raise ValueError(f"partials of shape {tuple(partials.shape)} need 1 or 2 dtypes, got {len(dtypes)}")
    if not ROW_NORM_TRITON_PARTIALS_SUM:
        return [partials[k].sum(dim=0).to(dtypes[k]) for k in range(n_slabs)]
    outs = [torch.empty(n_cols, dtype=dtype, device=partials.device) for dtype in dtypes]
    grid = (cdiv(n_cols, PARTIALS_SUM_BLOCK_COLS), n_slabs)
    launch_kernel(_sum_partials_kernel, grid, partials, outs[0], outs[-1], n_partials, n_cols,
                  BLOCK_ROWS=PARTIALS_SUM_BLOCK_ROWS, BLOCK_COLS=PARTIALS_SUM_BLOCK_COLS,
                  ROUND_BY_HAND=is_interpreter(), num_warps=4)
    return outs


# ======================================================================================
# Scaling a stored gradient by the upstream gradient (the losses' backward).
#
# The losses compute their input gradients during the forward pass; backward only scales
# them by dL_total/dloss. That factor is very often exactly 1 (loss.backward() on the loss
# itself), and checking it on the host would need a device sync. The kernel reads the
# factor on the device and leaves the tensor untouched where it is 1, so the common case
# costs one launch instead of a full read and write of a vocabulary-sized buffer.
# ======================================================================================

SCALE_BLOCK = 4096
SCALE_PROGRAMS_PER_SM = 4


@triton.jit
def _scale_in_place_kernel(X, SCALE, n_rows, n_cols, row_stride, PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
                           ROUND_BY_HAND: tl.constexpr):
    """``X[i, :] *= s`` in fp32 and rounded back, for rows i of an (n_rows, n_cols) view.

    ``s`` is ``SCALE[0]`` or, with PER_ROW, ``SCALE[i]``. Rows whose factor is exactly 1
    are neither read nor written. Persistent programs stride over rows.
    """
    offsets = tl.arange(0, BLOCK)
    if not PER_ROW:
        scale = tl.load(SCALE).to(tl.float32)
    for row in tl.range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        if PER_ROW:
            scale = tl.load(SCALE + row).to(tl.float32)
        if scale != 1.0:
            for start in range(0, n_cols, BLOCK):
                cols = start + offsets
                mask = cols < n_cols
                ptrs = X + row * row_stride + cols
                x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                y = _row_norm_round(x * scale, X.dtype.element_ty, ROUND_BY_HAND)
                tl.store(ptrs, y.to(X.dtype.element_ty), mask=mask)


def _scale_rows_in_place(x: torch.Tensor, scale: torch.Tensor) -> None:
    """Launcher: ``x`` (R, C) with unit column stride, ``scale`` 0-d/(1,) or (R,)."""
    n_rows, n_cols = x.shape
    if n_rows == 0 or n_cols == 0:
        return
    per_row = scale.numel() != 1
    block, num_warps = row_launch_settings(n_cols, SCALE_BLOCK)
    grid = (num_programs_for_rows(n_rows, x.device, SCALE_PROGRAMS_PER_SM),)
    launch_kernel(_scale_in_place_kernel, grid, x, scale, n_rows, n_cols, x.stride(0), PER_ROW=per_row,
                  BLOCK=block, ROUND_BY_HAND=is_interpreter(), num_warps=num_warps)


@liger_custom_op("scale_in_place", mutates_args=("x",))
def scale_in_place(x: torch.Tensor, scale: torch.Tensor) -> None:
    """``x *= scale`` in place, skipping the work (on the device, no sync) where the factor is 1.

    ``scale`` is a single value (0-d or one element) or, for a 2-D ``x`` (R, C), one value
    per row (R,). The product is formed in fp32 and rounded once to ``x``'s dtype. A
    contiguous ``x`` is processed as rows of :data:`SCALE_BLOCK` elements whatever its shape;
    other layouts fall back to ``torch.mul_``. ``x``'s autograd version is bumped even where
    nothing changed, so a saved tensor scaled here cannot be silently reused by a second
    backward.
    """
    if x.numel() == 0:
        return
    torch.autograd.graph.increment_version(x)
    if scale.numel() != 1:
        if x.dim() != 2 or scale.numel() != x.shape[0]:
            raise ValueError(f"a per-row scale needs x (R, C) and scale (R,), got {tuple(x.shape)} and "
                             f"{tuple(scale.shape)}")
        if x.stride(1) == 1 or x.shape[1] == 1:
            _scale_rows_in_place(x, scale.reshape(-1).contiguous())
        else:
            x.mul_(scale.reshape(-1, 1))
        return
    if x.is_contiguous():
        flat = x.view(-1)
        width = min(SCALE_BLOCK, flat.numel())
        full_rows = flat.numel() // width
        _scale_rows_in_place(flat[: full_rows * width].view(full_rows, width), scale.reshape(1))
        if full_rows * width < flat.numel():
            _scale_rows_in_place(flat[full_rows * width:].view(1, -1), scale.reshape(1))
    elif x.dim() == 2 and x.stride(1) == 1:
        _scale_rows_in_place(x, scale.reshape(1))
    else:
        x.mul_(scale.reshape(()))


def scale_gradient(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` for a loss's backward: in place (see :func:`scale_in_place`) in eager
    mode, out of place while ``torch.compile`` traces (a traced backward must not mutate a
    saved tensor; Inductor fuses the multiply and plans the memory itself)."""
    if torch.compiler.is_compiling():
        if scale.numel() != 1:
            return x * scale.reshape(-1, 1)
        return x * scale.reshape(())
    scale_in_place(x, scale)
    return x
