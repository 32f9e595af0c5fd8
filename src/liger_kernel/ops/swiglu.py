"""Gated activations ``h = act(a) * b`` (SwiGLU, GeGLU): one elementwise kernel pair.

Shapes: ``a`` (gate) and ``b`` (up) have the same shape (..., I) with any number of leading
dimensions and any strides whose last dimension is unit-stride (e.g. the two halves of a
fused ``gate_up_proj`` output, ``gate_up.chunk(2, dim=-1)``, are read in place, without a
copy). ``h`` is a fresh contiguous tensor of that shape and of the inputs' dtype.

The ``ACTIVATION`` constexpr of the kernels picks ``act``:

* ``SILU`` (SwiGLU, this module's :class:`LigerSiLUMulFunction`)::

      silu(a)  = a * s,                s = sigmoid(a)
      silu'(a) = s * (1 + a * (1 - s))

* ``GELU_TANH`` (GeGLU, :mod:`liger_kernel.ops.geglu`), torch's ``gelu(approximate="tanh")``::

      gelu(a)  = 0.5 * a * (1 + tanh(u)),  u = sqrt(2/pi) * (a + 0.044715 * a^3)
               = a * s,                    s = sigmoid(2u)        (since 1 + tanh(u) = 2 sigmoid(2u))
      gelu'(a) = s + 2 a s (1 - s) * sqrt(2/pi) * (1 + 3 * 0.044715 * a^2)

  Writing ``1 + tanh(u)`` as ``2 sigmoid(2u)`` is an identity, not an approximation; it
  avoids a tanh (absent from some Triton versions) and the cancellation of ``1 - tanh^2``.

Forward (all math in fp32, one rounding to the input dtype)::

    h = act(a) * b

Backward, recomputing ``act(a)`` from the saved inputs (only ``a`` and ``b`` are saved,
never ``act(a)`` or ``h``)::

    da = dh * b * act'(a)
    db = dh * act(a)

Precision: Hugging Face computes ``act_fn(gate) * up`` in the input dtype, i.e. rounds
``act(a)`` to bf16/fp16 and then rounds the product again; the kernel rounds once, so it is
at least as close to the exact value and differs from HF by at most about one output ulp.
For fp32 inputs both are fp32 throughout.

In-place backward (``in_place=True``, opt-in): ``da`` is written over ``a``'s storage and
``db`` over ``b``'s, so the backward allocates nothing. That is only correct when nothing
else will read ``a`` or ``b`` again, which only the caller can know: ``in_place=True`` is its
promise, made by the gated MLP modules for the two projection outputs they create themselves
and hand to nobody (``liger_kernel.transformers.swiglu``; see ``docs/api.md``, "Memory
ownership"). The Function still falls back to fresh outputs where the layout makes the write
wrong: ``a`` or ``b`` is a leaf (a user tensor) or a view of one (e.g. the halves
``x[:, :I]``, ``x[:, I:]`` of a user's ``x``), the two may overlap in memory (e.g. ``a is b``),
a tensor overlaps itself (an expanded view), or the backward is being traced by
``torch.compile`` (whose functionalisation would copy anyway). A fallback costs two fresh
(N, I) gradients while the backward runs. After writing, the version counters of ``a`` and
``b`` are bumped, so a second backward through the same graph (``retain_graph=True``), or any
op that saved them, fails loudly in autograd instead of reading the overwritten values.

Outputs and gradients are ordinary tensors (not views of internal buffers), so they may be
edited in place (``h.mul_(2)``, ``F.dropout(h, inplace=True)``) as any torch result.
Empty inputs give empty outputs and gradients; ``meta`` inputs give ``meta`` outputs of the
right shape and dtype (nothing is launched).
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import ClassVar, Tuple

import torch
import triton
import triton.language as tl

from liger_kernel.ops.autograd import InputGradients, strictly_once_differentiable
from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.checks import (
    as_rows,
    check_float_dtype,
    check_in_place,
    check_same_device,
    check_tensor,
)
from liger_kernel.ops.config import LaunchConfig, launch_config
from liger_kernel.ops.launch import (
    MAX_BLOCK,
    cdiv,
    is_interpreter,
    liger_custom_op,
    row_launch_settings,
    tile_rows_and_warps,
)
from liger_kernel.ops.numerics import round_to_dtype

# Values of the ACTIVATION constexpr.
SILU = 0
GELU_TANH = 1
_SILU = tl.constexpr(SILU)  # for the kernels (a @triton.jit function reads only constexpr globals)

@triton.jit
def _gated_activation(a, ACTIVATION: tl.constexpr):
    """``(act(a), act'(a))`` in fp32 (the derivative is dead code where unused)."""
    if ACTIVATION == _SILU:
        s = tl.sigmoid(a)
        act = a * s
        grad = s * (1.0 + a * (1.0 - s))
    else:
        # Literals: 2 sqrt(2/pi) = 1.5957691216057308 (torch's 2 kBeta), kKappa = 0.044715.
        a_sq = a * a
        s = tl.sigmoid(1.5957691216057308 * a * (1.0 + 0.044715 * a_sq))
        act = a * s
        ds = s * (1.0 - s)
        # ds == 0 where the sigmoid saturates; the guard keeps 0 * inf (|a| > ~1e19) out of
        # the gradient, whose exact value there is s.
        grad = s + tl.where(ds > 0.0, 1.5957691216057308 * a * ds * (1.0 + 0.134145 * a_sq), 0.0)
    return act, grad


@triton.jit
def _round_for_store(x, dtype: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    # The interpreter truncates fp32 -> bf16; round to nearest even as the GPU does.
    if ROUND_BY_HAND:
        x = round_to_dtype(x, dtype, True)
    return x.to(dtype)


@triton.jit
def _tile(pid, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Rows (int64), columns and mask of tile ``pid``; column tiles vary fastest."""
    n_col_tiles = tl.cdiv(n_cols, BLOCK_COLS)
    rows = (pid // n_col_tiles) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = (pid % n_col_tiles) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def gated_activation_forward_kernel(
    A, B, H,
    n_rows, n_cols, a_row_stride, b_row_stride, h_row_stride,
    ACTIVATION: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
):
    """One program per (BLOCK_ROWS, BLOCK_COLS) tile: h = act(a) * b."""
    rows, cols, mask = _tile(tl.program_id(0), n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    a = tl.load(A + rows * a_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + rows * b_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _gated_activation(a, ACTIVATION)
    tl.store(H + rows * h_row_stride + cols, _round_for_store(act * b, H.dtype.element_ty, ROUND_BY_HAND),
             mask=mask)


@triton.jit
def gated_activation_backward_kernel(
    DH, A, B, DA, DB,
    n_rows, n_cols, dh_row_stride, a_row_stride, b_row_stride, da_row_stride, db_row_stride,
    ACTIVATION: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
    STORE_H: tl.constexpr,
):
    """One program per tile: da = dh * b * act'(a), db = dh * act(a), act recomputed.

    DA may alias A and DB may alias B (in-place backward): each element is loaded before
    the program that loaded it overwrites it, and tiles are disjoint. With STORE_H the
    recomputed h = act(a) * b (rounded exactly as the forward kernel rounds it) is also
    written over DH, for the down projection's weight gradient.
    """
    rows, cols, mask = _tile(tl.program_id(0), n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    dh = tl.load(DH + rows * dh_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + rows * a_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + rows * b_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act, act_grad = _gated_activation(a, ACTIVATION)
    tl.store(DA + rows * da_row_stride + cols,
             _round_for_store(dh * b * act_grad, DA.dtype.element_ty, ROUND_BY_HAND), mask=mask)
    tl.store(DB + rows * db_row_stride + cols,
             _round_for_store(dh * act, DB.dtype.element_ty, ROUND_BY_HAND), mask=mask)
    if STORE_H:
        tl.store(DH + rows * dh_row_stride + cols, _round_for_store(act * b, DH.dtype.element_ty, ROUND_BY_HAND),
                 mask=mask)


@dataclasses.dataclass(frozen=True)
class GatedActivationConfig(LaunchConfig):
    """Launch geometry of the gated-activation kernels (forward and backward share it).

    One program per (block_rows, block_cols) tile of the (N, I) problem; rows narrower than
    the widest column block are packed several to a tile, so every program moves about the
    same number of bytes. Fields must be powers of two.
    """

    block_rows: int
    block_cols: int
    num_warps: int

    # Elements per program tile (each program reads two such tiles, three in backward) and
    # the widest column block; what ``python -m benchmarks.tune`` varies.
    TILE_ELEMENTS: ClassVar[int] = 4096
    MAX_BLOCK_COLS: ClassVar[int] = 1024

    def __post_init__(self) -> None:
        self.check_powers_of_two("block_rows", "block_cols", "num_warps")
        if self.block_rows * self.block_cols > MAX_BLOCK:
            raise ValueError(f"GatedActivationConfig: a tile of {self.block_rows} x {self.block_cols} elements "
                             f"exceeds Triton's {MAX_BLOCK}")

    @classmethod
    def heuristic(cls, n_rows: int, n_cols: int) -> "GatedActivationConfig":
        """The geometry for an (n_rows, n_cols) problem, memoised per shape (a training step asks
        for the same few shapes every layer; host time here shows as GPU idle time)."""
        return _gated_geometry(n_rows, n_cols, cls.TILE_ELEMENTS, cls.MAX_BLOCK_COLS, is_interpreter())

    @classmethod
    def search_space(cls, n_rows: int, n_cols: int) -> Tuple["GatedActivationConfig", ...]:
        """Distinct geometries of tiles of 2K-16K elements with column blocks of 256-4096."""
        candidates = (_gated_geometry(n_rows, n_cols, tile, cols, is_interpreter())
                      for tile in (2048, 4096, 8192, 16384) for cols in (256, 1024, 4096))
        return tuple(dict.fromkeys(candidates))


@functools.lru_cache(maxsize=1024)
def _gated_geometry(n_rows: int, n_cols: int, tile_elements: int, max_block_cols: int,
                    interpreter: bool) -> GatedActivationConfig:
    # ``interpreter`` only keys the cache: row_launch_settings' warps depend on it.
    block_cols, _ = row_launch_settings(n_cols, max_block=max_block_cols)
    block_rows, num_warps = tile_rows_and_warps(n_rows, block_cols, tile_elements)
    return GatedActivationConfig(block_rows, block_cols, num_warps)


def _launch_geometry(n_rows: int, n_cols: int) -> Tuple[GatedActivationConfig, int]:
    """The configuration in force for an (n_rows, n_cols) problem and its number of tiles."""
    config = launch_config(GatedActivationConfig, n_rows, n_cols)
    return config, cdiv(n_rows, config.block_rows) * cdiv(n_cols, config.block_cols)


def check_gated_args(a: torch.Tensor, b: torch.Tensor) -> None:
    """Raise ``TypeError``/``ValueError`` naming the offending argument."""
    check_tensor(a, "a")
    check_tensor(b, "b")
    check_float_dtype(a, "a")
    check_float_dtype(b, "b")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got a: {a.dtype}, b: {b.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got a: {tuple(a.shape)}, b: {tuple(b.shape)}")
    if a.dim() == 0:
        raise ValueError("a and b must have at least one dimension (the intermediate size)")
    check_same_device([("a", a), ("b", b)])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (N, I) rows with unit column stride (a view unless x cannot be flattened)."""
    if x.numel() == 0:
        # Nothing to read or write; as_rows cannot infer N when I == 0.
        return x.new_empty((math.prod(x.shape[:-1]), x.shape[-1]))
    return as_rows(x)


def _self_disjoint(rows: torch.Tensor) -> bool:
    """No two elements of the (N, I) view share memory (false e.g. for expanded views)."""
    n_rows, n_cols = rows.shape
    return n_rows <= 1 or rows.stride(0) >= n_cols


def _mutually_disjoint(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Conservative test that the (N, I) views ``x`` and ``y`` share no element.

    Different storages, or disjoint address ranges in one storage, never overlap. Within
    interleaved ranges we recognise views with equal row stride S whose rows sit at
    different column offsets of each period of S, which covers the two halves of a fused
    ``gate_up`` projection; anything else counts as overlapping.
    """
    if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return True
    n_rows, n_cols = x.shape

    # Only called outside compiled code, where storage offsets are plain ints.
    x_offset, y_offset = int(x.storage_offset()), int(y.storage_offset())

    def extent(v: torch.Tensor, start: int) -> tuple[int, int]:
        return start, start + (n_rows - 1) * v.stride(0) + n_cols

    (x_start, x_end), (y_start, y_end) = extent(x, x_offset), extent(y, y_offset)
    if x_end <= y_start or y_end <= x_start:
        return True
    shift = y_offset - x_offset
    if n_rows <= 1:
        return abs(shift) >= n_cols
    period = x.stride(0)
    if y.stride(0) != period:
        return False
    phase = shift % period
    return n_cols <= phase <= period - n_cols


def _launches(x: torch.Tensor, n_rows: int, n_cols: int) -> bool:
    # Meta tensors (shape inference, meta-device init) have shapes but no memory to run on.
    return n_rows > 0 and n_cols > 0 and not x.is_meta


def gated_activation_forward(a: torch.Tensor, b: torch.Tensor, activation: int) -> torch.Tensor:
    """Launch the forward kernel; returns ``h = act(a) * b``, a fresh contiguous tensor of a's shape."""
    a_rows, b_rows = _rows(a), _rows(b)
    n_rows, n_cols = a_rows.shape
    h = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if _launches(a, n_rows, n_cols):
        config, n_tiles = _launch_geometry(n_rows, n_cols)
        h_rows = h.view(n_rows, n_cols)
        launch_kernel(gated_activation_forward_kernel, (n_tiles,),
            a_rows, b_rows, h_rows,
            n_rows, n_cols, a_rows.stride(0), b_rows.stride(0), h_rows.stride(0),
            ACTIVATION=activation, BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols,
            ROUND_BY_HAND=is_interpreter(), num_warps=config.num_warps,
        )
    return h


def gated_activation_backward(grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, activation: int,
                              da: torch.Tensor | None = None, db: torch.Tensor | None = None,
                              store_h: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; returns ``(da, db)`` of a's shape.

    ``da``/``db`` are the destinations (a and b themselves for the in-place backward, which
    has checked that their rows are views of their memory); fresh contiguous tensors are
    allocated where they are None. With ``store_h``, ``grad_h`` is overwritten by the
    recomputed ``h = act(a) * b`` (it must be a flattenable view, so that the kernel writes
    into its storage).
    """
    a_rows, b_rows = _rows(a), _rows(b)
    n_rows, n_cols = a_rows.shape
    dh_rows = _rows(grad_h)
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device) if da is None else da
    db = torch.empty(b.shape, dtype=b.dtype, device=b.device) if db is None else db
    if _launches(a, n_rows, n_cols):
        config, n_tiles = _launch_geometry(n_rows, n_cols)
        da_rows, db_rows = _rows(da), _rows(db)
        launch_kernel(gated_activation_backward_kernel, (n_tiles,),
            dh_rows, a_rows, b_rows, da_rows, db_rows,
            n_rows, n_cols, dh_rows.stride(0), a_rows.stride(0), b_rows.stride(0),
            da_rows.stride(0), db_rows.stride(0),
            ACTIVATION=activation, BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols,
            ROUND_BY_HAND=is_interpreter(), STORE_H=store_h, num_warps=config.num_warps,
        )
    return da, db


def make_gated_ops(name: str, activation: int) -> SimpleNamespace:
    """Register the custom ops ``liger::<name>_forward``, ``_backward`` and ``_backward_inplace``.

    All three run the shared kernels above with ``ACTIVATION=activation``; distinct op
    names per activation keep compiled graphs readable. Returns them as a namespace with
    attributes ``forward``, ``backward``, ``backward_inplace``.
    """

    @liger_custom_op(f"{name}_forward")
    def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return gated_activation_forward(a, b, activation)

    @forward.register_fake
    def _forward_fake(a, b):
        return torch.empty(a.shape, dtype=a.dtype, device=a.device)

    @liger_custom_op(f"{name}_backward")
    def backward(grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return gated_activation_backward(grad_h, a, b, activation)

    @backward.register_fake
    def _backward_fake(grad_h, a, b):
        return (torch.empty(a.shape, dtype=a.dtype, device=a.device),
                torch.empty(b.shape, dtype=b.dtype, device=b.device))

    @liger_custom_op(f"{name}_backward_inplace", mutates_args=("a", "b"))
    def backward_inplace(grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write da over a and db over b; the caller has checked that is safe."""
        gated_activation_backward(grad_h, a, b, activation, da=a, db=b)

    @backward_inplace.register_fake
    def _backward_inplace_fake(grad_h, a, b):
        return None

    @liger_custom_op(f"{name}_backward_recompute", mutates_args=("grad_h",))
    def backward_recompute(grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(da, db)`` as ``backward``, and ``h = act(a) * b`` written over ``grad_h`` (contiguous)."""
        return gated_activation_backward(grad_h, a, b, activation, store_h=True)

    @backward_recompute.register_fake
    def _backward_recompute_fake(grad_h, a, b):
        return _backward_fake(grad_h, a, b)

    @liger_custom_op(f"{name}_backward_recompute_inplace", mutates_args=("grad_h", "a", "b"))
    def backward_recompute_inplace(grad_h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """da over a, db over b and h over ``grad_h`` (contiguous); the caller has checked a/b."""
        gated_activation_backward(grad_h, a, b, activation, da=a, db=b, store_h=True)

    @backward_recompute_inplace.register_fake
    def _backward_recompute_inplace_fake(grad_h, a, b):
        return None

    return SimpleNamespace(forward=forward, backward=backward, backward_inplace=backward_inplace,
                           backward_recompute=backward_recompute, backward_recompute_inplace=backward_recompute_inplace,
                           activation=activation)


def _is_or_views_a_leaf(x: torch.Tensor) -> bool:
    """Whether ``x`` is a leaf or a view of one (its storage is then the caller's tensor).

    A slice of a user's tensor (``x[:, :I]`` of an ``x`` that requires grad) is not a leaf
    itself, but writing into it writes into ``x``, whose bumped version counter nobody
    checks. Views of non-leaves need no such test: a tensor autograd saved is checked
    against its version when unpacked, so overwriting it raises rather than going unseen.
    """
    while x._base is not None:  # _base is the root of the view chain; the loop is defensive
        x = x._base
    return x.is_leaf


def _in_place_is_safe(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether da/db may be written over a/b (see the module docstring)."""
    if _is_or_views_a_leaf(a) or _is_or_views_a_leaf(b):
        return False
    if (a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()):
        return True  # the common case (two projections' outputs): no aliasing at all
    a_rows, b_rows = _rows(a), _rows(b)
    # as_rows copies a view it cannot flatten; writing into such a copy would not alias a.
    if a_rows.data_ptr() != a.data_ptr() or b_rows.data_ptr() != b.data_ptr():
        return False
    if not (a_rows.stride(-1) == 1 and b_rows.stride(-1) == 1):
        return False
    return _self_disjoint(a_rows) and _self_disjoint(b_rows) and _mutually_disjoint(a_rows, b_rows)


def gated_function_forward(ctx, ops: SimpleNamespace, a: torch.Tensor, b: torch.Tensor,
                           in_place: bool) -> torch.Tensor:
    """Shared body of the gated-activation autograd Functions' forward."""
    check_gated_args(a, b)
    check_in_place(in_place)
    # Evaluated here, on the forward's inputs, because leaf-ness is lost in the saved tensors.
    ctx.in_place = in_place and not torch.compiler.is_compiling() and not a.is_meta and _in_place_is_safe(a, b)
    ctx.save_for_backward(a, b)
    return ops.forward(a, b)


def _unpack_saved(ctx) -> Tuple[Tuple[torch.Tensor, ...], bool]:
    """``(ctx.saved_tensors, in_place)``: whether the backward writes da/db over the saved
    ``a``/``b`` (asked for and safe in layout, decided in the forward)."""
    return ctx.saved_tensors, ctx.in_place and not torch.compiler.is_compiling()


def _mark_overwritten(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    # Readers of the old values (a second backward with retain_graph) now fail loudly.
    torch.autograd.graph.increment_version(a)
    torch.autograd.graph.increment_version(b)
    return a.detach(), b.detach()


def gated_function_backward(ctx, ops: SimpleNamespace, grad_h: torch.Tensor):
    """Shared body of the backward: ``(da, db)``, written over a and b where :func:`_unpack_saved` allows."""
    (a, b), in_place = _unpack_saved(ctx)
    if in_place:
        ops.backward_inplace(grad_h, a, b)
        return _mark_overwritten(a, b)
    return ops.backward(grad_h, a, b)


SWIGLU_OPS = make_gated_ops("swiglu", SILU)

# The registered ops per ACTIVATION value (GeGLU's are added by liger_kernel.ops.geglu).
GATED_OPS = {SILU: SWIGLU_OPS}


def gated_mul_function(ops: SimpleNamespace) -> type:
    """Base of the autograd Function of ``h = act(a) * b`` on the registered ``ops``:
    ``apply(a, b, in_place=False)``; see the module docstring for the math and in-place rule.
    (Static methods closing over ``ops``, which ``torch.compile`` traces, not a class attribute
    read by a classmethod, which it does not.)"""

    class GatedMulFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a: torch.Tensor, b: torch.Tensor, in_place: bool = False) -> torch.Tensor:
            return gated_function_forward(ctx, ops, a, b, in_place)

        @staticmethod
        @strictly_once_differentiable
        def backward(ctx, grad_h: torch.Tensor):
            da, db = gated_function_backward(ctx, ops, grad_h)
            return grads(a=da, b=db)

    grads = InputGradients(GatedMulFunction.forward)
    return GatedMulFunction


class LigerSiLUMulFunction(gated_mul_function(SWIGLU_OPS)):  # type: ignore[misc]  # a base built per ops
    """``h = silu(a) * b`` (SwiGLU's gating); see the module docstring for math and in-place.

    ``apply(a, b, in_place=False)``: ``a`` (gate) and ``b`` (up) of one shape (..., I) and
    dtype (fp32/bf16/fp16), any unit-last-stride layout. Returns ``h`` of that shape and
    dtype. Gradients flow to ``a`` and ``b``.
    """


def _linear_weight_for(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Under autocast the forward's F.linear multiplied by a copy of the weight in the compute
    # dtype; the backward does the same, as autograd's recorded cast would.
    return weight if weight.dtype == dtype else weight.to(dtype)


class LigerGatedDownProjFunction(torch.autograd.Function):
    """``y = (act(a) * b) @ W^T + bias``: a gated MLP's activation and down projection,
    without saving the activation ``h = act(a) * b``.

    ``apply(a, b, weight, bias, activation, in_place)``: ``a``, ``b`` (..., I) as for
    :class:`LigerSiLUMulFunction`, ``weight`` (H, I), ``bias`` (H,) or None, ``activation``
    one of ``SILU`` / ``GELU_TANH`` (the latter after importing :mod:`liger_kernel.ops.geglu`).
    Returns y (..., H), as ``F.linear(h, weight, bias)`` (autocast applies as it does there).

    An MLP built from ``act_mul`` and an ``nn.Linear`` saves ``a``, ``b`` *and* ``h`` (the
    linear's input), three (N, I) tensors per layer. This Function saves only ``a`` and
    ``b``; the backward gets ``h`` back from the gradient kernel, which already computes
    ``act(a)``, for one extra (N, I) write::

        dh    = dy @ W                                (N, I), then overwritten by h
        da, db, h = gated_backward(dh, a, b)          one kernel: da = dh b act'(a),
                                                      db = dh act(a), h = act(a) b
        dW    = dy^T @ h,   dbias = sum_rows(dy)

    ``h`` is recomputed by the same code and rounding as the forward, so the results equal
    the unfused MLP's. ``in_place`` writes da/db over a/b where safe (module docstring).
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                activation: int = SILU, in_place: bool = False) -> torch.Tensor:
        check_gated_args(a, b)
        check_tensor(weight, "weight")
        if weight.dim() != 2 or weight.shape[1] != a.shape[-1]:
            raise ValueError(f"weight must be (out_features, {a.shape[-1]}) for a of shape {tuple(a.shape)}, "
                             f"got {tuple(weight.shape)}")
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
            raise ValueError(f"bias must be a tensor of shape ({weight.shape[0]},)")
        if activation not in GATED_OPS:
            raise ValueError(f"unknown activation {activation!r}; import liger_kernel.ops.geglu for GELU_TANH")
        check_same_device([("a", a), ("weight", weight), ("bias", bias)])
        ops = GATED_OPS[activation]
        ctx.activation = activation
        ctx.in_place = in_place and not torch.compiler.is_compiling() and not a.is_meta and _in_place_is_safe(a, b)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(a, b, weight, bias)
        h = ops.forward(a, b)
        return torch.nn.functional.linear(h, weight, bias)

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_y: torch.Tensor):
        (a, b, weight, bias), in_place = _unpack_saved(ctx)
        ops = GATED_OPS[ctx.activation]
        n_out = weight.shape[0]
        dy = grad_y.reshape(-1, n_out)
        # dh is a fresh contiguous (N, I) product: the kernel may overwrite it with h.
        dh = dy @ _linear_weight_for(weight, dy.dtype)
        if in_place:
            ops.backward_recompute_inplace(dh, a, b)
            da, db = _mark_overwritten(a, b)
        else:
            da, db = ops.backward_recompute(dh, a, b)
        h = dh
        grad_weight = (dy.t() @ h).to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = dy.sum(0).to(bias.dtype)  # as autograd's linear: summed in dy's dtype
        return _GATED_DOWN_PROJ_GRADS(a=da, b=db, weight=grad_weight, bias=grad_bias)


_GATED_DOWN_PROJ_GRADS = InputGradients(LigerGatedDownProjFunction.forward)


def eager_experts_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up_proj: torch.Tensor, down_proj: torch.Tensor, num_experts: int,
                          apply_gate: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """HF's eager fused-experts loop (``MixtralExperts.forward``, transformers 5.17-5.25).

    ``hidden_states`` (S, H), ``top_k_index``/``top_k_weights`` (S, K) -> (S, H), with
    ``gate_up_proj`` (E, 2I, H; gate first) and ``down_proj`` (E, H, I). ``apply_gate`` maps an
    expert's (tokens, 2I) gate-up projection to its (tokens, I) activation (``act(gate) * up``).
    An index equal to ``num_experts`` marks a token routed to another (expert-parallel) rank and
    is skipped; transformers 5.17 never emits it.
    """
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        gated = apply_gate(torch.nn.functional.linear(hidden_states[token_idx], gate_up_proj[expert_idx]))
        expert_out = torch.nn.functional.linear(gated, down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, expert_out.to(final_hidden_states.dtype))
    return final_hidden_states
