"""Rotary position embedding (RoPE) of q and k in one Triton pass each way.

Matches Hugging Face's ``apply_rotary_pos_emb`` in the rotate-half convention (Llama,
Mistral, Qwen, Gemma, Phi-3)::

    rotate_half(x) = cat(-x2, x1)          x1 = x[..., :R/2], x2 = x[..., R/2:R]
    q_embed = q * cos + rotate_half(q) * sin

and in the other layouts HF's models use (``RopeLayout``). Every layout rotates R/2 pairs of
channels (a_c, b_c), c < R/2, each by its own table entries:

* pairs: rotate-half (a_c, b_c) = (c, c + R/2); ``interleaved`` (GPT-J style, GLM, Cohere)
  (a_c, b_c) = (2c, 2c + 1), i.e. ``rotate_every_two(x) = stack(-x[1::2], x[::2]).flatten()``;
* table of width W (``table``): ``full`` W = R, channel j reads entry j (cos1_c = cos[a_c],
  cos2_c = cos[b_c]); ``pair`` W = R/2, both members read entry c (cos1_c = cos2_c = cos[c],
  gpt-oss's half-size tables, HF's ``cos.repeat_interleave(2)`` of GPT-J); ``first_half`` W = R,
  both members read entry c < R/2 (GLM's ``cos[..., :R/2].repeat_interleave(2)``);
* ``negate_sin``: the rotation by -theta, sin -> -sin (``rotate_half(x) = cat(x2, -x1)``).

Shapes. With ``unsqueeze_dim=1`` q is (B, Hq, T, D) and k is (B, Hk, T, D) (Hq != Hk for
grouped-query attention); with ``unsqueeze_dim=2`` they are (B, T, Hq, D) / (B, T, Hk, D).
``cos`` and ``sin`` are (Bc, Tc, W) with Bc in {1, B} and Tc in {1, T} (a (T, W) table
counts as Bc = 1), broadcast over the heads. q and k may have any strides with a unit-stride last dimension -
transposed views of (B, T, H, D) projections and slices of a fused qkv projection (Phi-3)
are read in place; all four strides go to the kernel. Only a q/k/cos/sin whose last
dimension is not unit-stride is copied first.

Partial rotary (``R < D``, Phi-3's ``partial_rotary_factor``, GLM): as HF's code, the first
R channels are rotated (pairs formed within those R channels, channel j of the block reading
table entry j) and channels R..D-1 are passed through unchanged; with ``rotate_last`` (DeepSeek
V4) the rotated block is the last R channels and channels 0..D-R-1 pass through. R must be even.

Forward, per position (b, t), every head h, pair c < R/2, in fp32, with x1 = x[a_c],
x2 = x[b_c] (sin1, sin2 negated first under ``negate_sin``)::

    y[a_c] = x1 * cos1 - x2 * sin1     (rotate-half, full table: cos1 = cos[..., :R/2], cos2 = cos[..., R/2:R])
    y[b_c] = x2 * cos2 + x1 * sin2
    y_pass = x_pass

Backward is the transpose of that linear map (for rotate-half, dx = dy * cos +
rotate_half^T(dy * sin) with rotate_half^T(z) = cat(z2, -z1)), pair by pair::

    dx[a_c] = dy1 * cos1 + dy2 * sin2
    dx[b_c] = dy2 * cos2 - dy1 * sin1
    dx_pass = dy_pass

which is the forward with ``(sin1, sin2)`` replaced by ``(-sin2, -sin1)``: one kernel with an
``INVERSE`` constexpr serves both directions, and ``INTERLEAVED`` / ``PAIR_TABLE`` /
``NEGATE_SIN`` / ``ROTATE_LAST`` constexprs select the layout. ``cos``/``sin`` get no gradient (HF computes
them under ``no_grad``); passing ones that require grad raises.

One program handles BLOCK_T consecutive positions of one batch row: it loads cos/sin for
those positions once and applies them to every q head and every k head. Math is fp32, each
output rounded once to its input's dtype. HF rounds each product and the sum to the input
dtype (HF's rotary modules return cos/sin in the activations' dtype, so the output dtypes
agree); with fp32 cos/sin and bf16 q HF's type promotion would return fp32, the kernel
still returns bf16.
Outputs and gradients are fresh tensors of the inputs' shapes, laid out like the
corresponding input (same order of dimensions in memory), so views/transposes around the
call stay free; they are not views of another tensor, so they may be edited in place.
``meta`` inputs give ``meta`` outputs of the right shapes (nothing is launched).
"""

import dataclasses
import functools
import itertools
from typing import ClassVar, NamedTuple, Tuple

import torch
import triton
import triton.language as tl

from liger_kernel.ops.autograd import InputGradients, strictly_once_differentiable
from liger_kernel.ops.cached_launch import launch_kernel
from liger_kernel.ops.checks import (
    check_float_dtype,
    check_same_device,
    check_tensor,
    ensure_contiguous_last_dim,
)
from liger_kernel.ops.config import LaunchConfig, launch_config
from liger_kernel.ops.launch import (
    cdiv,
    is_interpreter,
    liger_custom_op,
    next_power_of_2,
    tile_rows_and_warps,
)
from liger_kernel.ops.numerics import round_to_dtype


@dataclasses.dataclass(frozen=True)
class RopeConfig(LaunchConfig):
    """Launch geometry of the RoPE kernel (forward and backward share it).

    One program handles ``block_t`` positions of one batch row and walks the q heads in blocks
    of ``block_hq`` and the k heads in blocks of ``block_hk``. Fields must be powers of two.
    """

    block_t: int
    block_hq: int
    block_hk: int
    num_warps: int

    # Elements of one half-tile (positions x heads x R/2) per step, and the widest head block;
    # what ``python -m benchmarks.tune`` varies. (2048, 8) is the fastest fwd+bwd setting on
    # H200 at B4 T4096 Hq32 Hk8 D128 bf16 (docs/performance.md).
    TILE_ELEMENTS: ClassVar[int] = 2048
    MAX_BLOCK_HEADS: ClassVar[int] = 8

    def __post_init__(self) -> None:
        self.check_powers_of_two("block_t", "block_hq", "block_hk", "num_warps")

    @classmethod
    def heuristic(cls, seq_len: int, n_q_heads: int, n_k_heads: int, rot_half: int) -> "RopeConfig":
        """The geometry for one problem, memoised per shape (launchers run per layer per step)."""
        return _rope_geometry(seq_len, n_q_heads, n_k_heads, rot_half, cls.TILE_ELEMENTS, cls.MAX_BLOCK_HEADS,
                              is_interpreter())

    @classmethod
    def search_space(cls, seq_len: int, n_q_heads: int, n_k_heads: int, rot_half: int) -> Tuple["RopeConfig", ...]:
        """Distinct geometries of half-tiles of 2K-16K elements with head blocks of 8-64."""
        candidates = (_rope_geometry(seq_len, n_q_heads, n_k_heads, rot_half, tile, heads, is_interpreter())
                      for tile in (2048, 4096, 8192, 16384) for heads in (8, 32, 64))
        return tuple(dict.fromkeys(candidates))


@functools.lru_cache(maxsize=1024)
def _rope_geometry(seq_len: int, n_q_heads: int, n_k_heads: int, rot_half: int, tile_elements: int,
                   max_block_heads: int, interpreter: bool) -> RopeConfig:
    # ``interpreter`` only keys the cache: row_launch_settings' warps depend on it.
    block_hq = min(next_power_of_2(max(n_q_heads, 1)), max_block_heads)
    block_hk = min(next_power_of_2(max(n_k_heads, 1)), max_block_heads)
    per_position = max(block_hq, block_hk) * next_power_of_2(rot_half)
    block_t, num_warps = tile_rows_and_warps(seq_len, per_position, tile_elements)
    return RopeConfig(block_t, block_hq, block_hk, num_warps)


@triton.jit
def _rope_store(ptrs, y, mask, ROUND_BY_HAND: tl.constexpr):
    dtype = ptrs.dtype.element_ty
    if ROUND_BY_HAND:  # the interpreter truncates fp32 -> bf16; round as the GPU does
        y = round_to_dtype(y, dtype, True)
    tl.store(ptrs, y.to(dtype), mask=mask)


@triton.jit
def _pair_channels(half, ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Channels of the two members of pair ``half``: (c, c + R/2), or (2c, 2c + 1) interleaved."""
    if INTERLEAVED:
        return 2 * half, 2 * half + 1
    return half, half + ROT_HALF


@triton.jit
def _rope_heads(X, Y, b, t, t_mask, n_heads, x_sb, x_sh, x_st, y_sb, y_sh, y_st,
                cos1, cos2, sin1, sin2,
                HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, ROTATE_LAST: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """Rotate every head of X at positions (b, t) into Y; cos/sin are (BLOCK_T, BLOCK_HALF) fp32."""
    half = tl.arange(0, BLOCK_HALF)[None, None, :]
    half_mask = half < ROT_HALF
    first, second = _pair_channels(half, ROT_HALF, INTERLEAVED)
    # The rotated block is channels [0, R), or [D - R, D) with ROTATE_LAST; the rest pass through.
    if ROTATE_LAST:
        rot_start = HEAD_DIM - 2 * ROT_HALF
        pass_start = 0
    else:
        rot_start = 0
        pass_start = 2 * ROT_HALF
    first += rot_start
    second += rot_start
    x_bt = X + b * x_sb + t[:, None, None] * x_st
    y_bt = Y + b * y_sb + t[:, None, None] * y_st
    c1 = cos1[:, None, :]
    c2 = cos2[:, None, :]
    s1 = sin1[:, None, :]
    s2 = sin2[:, None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h64 = h.to(tl.int64)[None, :, None]
        row_mask = t_mask[:, None, None] & (h < n_heads)[None, :, None]
        mask = row_mask & half_mask
        x_h = x_bt + h64 * x_sh
        y_h = y_bt + h64 * y_sh
        x1 = tl.load(x_h + first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_h + second, mask=mask, other=0.0).to(tl.float32)
        _rope_store(y_h + first, x1 * c1 - x2 * s1, mask, ROUND_BY_HAND)
        _rope_store(y_h + second, x2 * c2 + x1 * s2, mask, ROUND_BY_HAND)
        if HEAD_DIM > 2 * ROT_HALF:
            # Partial rotary: the channels outside the rotated block are copied through unchanged.
            rest = pass_start + tl.arange(0, BLOCK_PASS)[None, None, :]
            rest_mask = row_mask & (rest < pass_start + HEAD_DIM - 2 * ROT_HALF)
            x_rest = tl.load(x_bt + h64 * x_sh + rest, mask=rest_mask, other=0.0)
            tl.store(y_bt + h64 * y_sh + rest, x_rest.to(Y.dtype.element_ty), mask=rest_mask)


@triton.jit
def rope_kernel(
    Q, K, Q_OUT, K_OUT, COS, SIN,
    seq_len, n_q_heads, n_k_heads,
    q_sb, q_sh, q_st, k_sb, k_sh, k_st,
    qo_sb, qo_sh, qo_st, ko_sb, ko_sh, ko_st,
    cos_sb, cos_st, sin_sb, sin_st,
    HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, INVERSE: tl.constexpr,
    INTERLEAVED: tl.constexpr, PAIR_TABLE: tl.constexpr, NEGATE_SIN: tl.constexpr, ROTATE_LAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
):
    """One program per (batch row, block of BLOCK_T positions): q heads then k heads.

    Strides are in elements, (batch, head, position); the last dimension is unit-stride.
    A cos/sin stride of 0 broadcasts (Bc == 1 or a single position).
    """
    pid = tl.program_id(0)
    n_t_blocks = tl.cdiv(seq_len, BLOCK_T)
    b = (pid // n_t_blocks).to(tl.int64)
    t = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < seq_len
    t = t.to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)[None, :]
    cs_mask = t_mask[:, None] & (half < ROT_HALF)
    cos_ptrs = COS + b * cos_sb + t[:, None] * cos_st
    sin_ptrs = SIN + b * sin_sb + t[:, None] * sin_st
    if PAIR_TABLE:
        # One table entry per pair: a (.., R/2) table read for both members.
        cos1 = tl.load(cos_ptrs + half, mask=cs_mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptrs + half, mask=cs_mask, other=0.0).to(tl.float32)
        cos2 = cos1
        sin2 = sin1
    else:
        # One entry per channel: the table column of each member of the pair.
        first, second = _pair_channels(half, ROT_HALF, INTERLEAVED)
        cos1 = tl.load(cos_ptrs + first, mask=cs_mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptrs + second, mask=cs_mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptrs + first, mask=cs_mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptrs + second, mask=cs_mask, other=0.0).to(tl.float32)
    if NEGATE_SIN:
        # rotate_half written as cat(x2, -x1): the rotation by -theta.
        sin1, sin2 = -sin1, -sin2
    if INVERSE:
        # The transposed rotation: (sin1, sin2) -> (-sin2, -sin1); see the module docstring.
        sin1, sin2 = -sin2, -sin1
    _rope_heads(Q, Q_OUT, b, t, t_mask, n_q_heads, q_sb, q_sh, q_st, qo_sb, qo_sh, qo_st,
                cos1, cos2, sin1, sin2, HEAD_DIM, ROT_HALF, INTERLEAVED, ROTATE_LAST, BLOCK_HQ, BLOCK_HALF,
                BLOCK_PASS, ROUND_BY_HAND)
    _rope_heads(K, K_OUT, b, t, t_mask, n_k_heads, k_sb, k_sh, k_st, ko_sb, ko_sh, ko_st,
                cos1, cos2, sin1, sin2, HEAD_DIM, ROT_HALF, INTERLEAVED, ROTATE_LAST, BLOCK_HK, BLOCK_HALF,
                BLOCK_PASS, ROUND_BY_HAND)


# --------------------------------------------------------------------------------------
# Rotation layouts.
# --------------------------------------------------------------------------------------

# How a cos/sin table of width W feeds the pairs (see the module docstring).
TABLE_FULL = "full"  # one entry per channel, W = R
TABLE_PAIR = "pair"  # one entry per pair, W = R/2
TABLE_FIRST_HALF = "first_half"  # one entry per pair, read from the first half of a W = R table
TABLES = (TABLE_FULL, TABLE_PAIR, TABLE_FIRST_HALF)


class KernelFlags(NamedTuple):
    """The layout constexprs of ``rope_kernel``."""

    interleaved: bool
    pair_table: bool
    negate_sin: bool
    rotate_last: bool


@dataclasses.dataclass(frozen=True)
class RopeLayout:
    """Which channels form the rotated pairs and which cos/sin entries rotate them.

    ``interleaved``: pairs (2c, 2c + 1) (GPT-J style) instead of (c, c + R/2) (rotate-half).
    ``table``: ``"full"`` (cos/sin have R entries, one per channel), ``"pair"`` (R/2 entries,
    one per pair) or ``"first_half"`` (R entries of which the first R/2 are used, one per pair).
    ``negate_sin``: the rotation by -theta (``rotate_half`` written ``cat(x2, -x1)``).
    ``rotate_last``: the rotated channels are the last R of the head (DeepSeek V4), not the first.
    """

    interleaved: bool = False
    table: str = TABLE_FULL
    negate_sin: bool = False
    rotate_last: bool = False

    def __post_init__(self) -> None:
        if self.table not in TABLES:
            raise ValueError(f"table must be one of {TABLES}, got {self.table!r}")

    @property
    def flags(self) -> KernelFlags:
        return KernelFlags(self.interleaved, self.table != TABLE_FULL, self.negate_sin, self.rotate_last)

    def rotary_dim(self, table_width: int) -> int:
        """R, the number of rotated channels, for a cos/sin table of ``table_width`` entries."""
        return 2 * table_width if self.table == TABLE_PAIR else table_width

    def describe(self) -> str:
        pairs = "interleaved pairs" if self.interleaved else "rotate-half pairs"
        table = {TABLE_FULL: "cos/sin per channel", TABLE_PAIR: "cos/sin per pair",
                 TABLE_FIRST_HALF: "cos/sin per pair from the table's first half"}[self.table]
        return (f"{pairs}, {table}" + (", rotation by -theta" if self.negate_sin else "")
                + (", last channels rotated" if self.rotate_last else ""))


ROTATE_HALF = RopeLayout()


# --------------------------------------------------------------------------------------
# Layout helpers. Tensors reaching the launchers are in the canonical (B, H, T, D) view.
# --------------------------------------------------------------------------------------

# Orders of the (B, H, T) dims in memory, outermost first; D is always innermost.
_DIM_ORDERS = tuple(itertools.permutations(range(3)))


def memory_order(x: torch.Tensor) -> int:
    """Index into ``_DIM_ORDERS`` of the order of x's first three dims by decreasing stride.

    Size-1 dims (whose strides are arbitrary and do not affect the layout) go innermost.
    """
    strides = x.stride()
    order = tuple(sorted(range(3), key=lambda d: (-strides[d] if x.shape[d] > 1 else 1, d)))
    return _DIM_ORDERS.index(order)


def empty_in_order(shape: Tuple[int, ...], order: int, dtype: torch.dtype, device: torch.device,
                   transposed: bool = False) -> torch.Tensor:
    """A fresh dense tensor for a (B, H, T, D) ``shape`` whose first three dims sit in memory as
    ``order``; with ``transposed`` it is returned as (B, T, H, D) (the same memory, dims 1 and 2
    swapped). Never a view: callers may hand it out as an ordinary result."""
    strides = [0, 0, 0, 0]
    step = 1
    for d in reversed(list(_DIM_ORDERS[order]) + [3]):
        strides[d] = step
        step *= max(shape[d], 1)
    sizes = list(shape)
    if transposed:
        sizes[1], sizes[2] = sizes[2], sizes[1]
        strides[1], strides[2] = strides[2], strides[1]
    return torch.empty_strided(sizes, strides, dtype=dtype, device=device)


def _table_strides(table: torch.Tensor) -> Tuple[int, int]:
    """(batch, position) strides of a (Bc, Tc, R) cos/sin table, 0 where it broadcasts."""
    return (table.stride(0) if table.shape[0] > 1 else 0, table.stride(1) if table.shape[1] > 1 else 0)


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
            k_out: torch.Tensor, inverse: bool, flags: KernelFlags) -> None:
    batch, n_q_heads, seq_len, head_dim = q.shape
    n_k_heads = k.shape[1]
    rot_half = cos.shape[-1] if flags.pair_table else cos.shape[-1] // 2
    if batch == 0 or seq_len == 0 or head_dim == 0 or (n_q_heads == 0 and n_k_heads == 0) or q.is_meta:
        return  # nothing to rotate; meta tensors (shape inference) have no memory to run on
    block_half = next_power_of_2(rot_half)
    block_pass = next_power_of_2(max(head_dim - 2 * rot_half, 1))
    config = launch_config(RopeConfig, seq_len, n_q_heads, n_k_heads, rot_half)
    cos_sb, cos_st = _table_strides(cos)
    sin_sb, sin_st = _table_strides(sin)
    grid = (batch * cdiv(seq_len, config.block_t),)
    launch_kernel(rope_kernel, grid,
        q, k, q_out, k_out, cos, sin,
        seq_len, n_q_heads, n_k_heads,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos_sb, cos_st, sin_sb, sin_st,
        HEAD_DIM=head_dim, ROT_HALF=rot_half, INVERSE=inverse,
        INTERLEAVED=flags.interleaved, PAIR_TABLE=flags.pair_table, NEGATE_SIN=flags.negate_sin,
        ROTATE_LAST=flags.rotate_last,
        BLOCK_T=config.block_t, BLOCK_HQ=config.block_hq, BLOCK_HK=config.block_hk,
        BLOCK_HALF=block_half, BLOCK_PASS=block_pass, ROUND_BY_HAND=is_interpreter(),
        num_warps=config.num_warps,
    )


def _rope_launcher(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_order: int,
                   k_order: int, transposed: bool, inverse: bool,
                   flags: KernelFlags) -> Tuple[torch.Tensor, torch.Tensor]:
    q, k = ensure_contiguous_last_dim(q), ensure_contiguous_last_dim(k)
    cos, sin = ensure_contiguous_last_dim(cos), ensure_contiguous_last_dim(sin)
    q_out, k_out = _empty_outputs(q, k, q_order, k_order, transposed)
    if transposed:
        _launch(q, k, cos, sin, q_out.transpose(1, 2), k_out.transpose(1, 2), inverse, flags)
    else:
        _launch(q, k, cos, sin, q_out, k_out, inverse, flags)
    return q_out, k_out


def _empty_outputs(q: torch.Tensor, k: torch.Tensor, q_order: int, k_order: int,
                   transposed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return (empty_in_order(tuple(q.shape), q_order, q.dtype, q.device, transposed),
            empty_in_order(tuple(k.shape), k_order, k.dtype, k.device, transposed))


@liger_custom_op("rope_rotate")
def rope_rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_order: int,
                k_order: int, transposed: bool, inverse: bool, interleaved: bool, pair_table: bool, negate_sin: bool,
                rotate_last: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate canonical (B, H, T, D) q and k by (Bc, Tc, R) cos/sin ((Bc, Tc, R/2) with
    ``pair_table``), or with ``inverse`` apply the transpose (the gradients of q and k from those
    of the outputs); outputs laid out by the orders, returned as (B, T, H, D) where ``transposed``."""
    return _rope_launcher(q, k, cos, sin, q_order, k_order, transposed, inverse,
                          KernelFlags(interleaved, pair_table, negate_sin, rotate_last))


@rope_rotate.register_fake
def _rope_rotate_fake(q, k, cos, sin, q_order, k_order, transposed, inverse, interleaved, pair_table, negate_sin,
                      rotate_last):
    return _empty_outputs(q, k, q_order, k_order, transposed)


# --------------------------------------------------------------------------------------
# Argument checks and canonicalisation.
# --------------------------------------------------------------------------------------


def _as_table(x: torch.Tensor, name: str, position_ids: torch.Tensor | None) -> torch.Tensor:
    if x.dim() == 2:
        # A (max_positions, R) table: gathered by position_ids when given, else (T, R).
        if position_ids is not None and position_ids.dtype not in (torch.int64, torch.int32):
            # Indexing would raise a bare IndexError for floats, and read a uint8/bool
            # tensor as a mask rather than as positions.
            raise TypeError(f"position_ids must hold integer positions (int64 or int32) to index the 2-D {name} "
                            f"table, got dtype {position_ids.dtype}")
        x = x[position_ids] if position_ids is not None else x.unsqueeze(0)
    if x.dim() != 3:
        raise ValueError(f"{name} must have shape (T, R), (1, T, R) or (B, T, R), got {tuple(x.shape)}")
    return x


def canonicalize_rope_args(q: object, k: object, cos: object, sin: object, position_ids: object,
                           unsqueeze_dim: object, layout: RopeLayout = ROTATE_HALF,
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the arguments; return q, k as (B, H, T, D) views and cos, sin as the (Bc, Tc, W)
    tables the kernel reads (W = R, or R/2 for a per-pair table; a first-half table is sliced).

    Raises ``TypeError``/``ValueError`` naming the offending argument.
    """
    q, k, cos, sin = (check_tensor(x, name) for x, name in ((q, "q"), (k, "k"), (cos, "cos"), (sin, "sin")))
    for name, x in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float_dtype(x, name)
    if position_ids is not None:
        position_ids = check_tensor(position_ids, "position_ids")
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 (q/k as (B, H, T, D)) or 2 (as (B, T, H, D)), got {unsqueeze_dim!r}")
    if q.dim() != 4 or k.dim() != 4:
        dims = "(B, H, T, D)" if unsqueeze_dim == 1 else "(B, T, H, D)"
        raise ValueError(f"q and k must be 4-D {dims}, got q: {tuple(q.shape)}, k: {tuple(k.shape)}")
    check_same_device([("q", q), ("k", k), ("cos", cos), ("sin", sin), ("position_ids", position_ids)])
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    batch, _, seq_len, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(f"q and k must agree in batch, sequence length and head dim, got q: {tuple(q.shape)}, "
                         f"k: {tuple(k.shape)} (as (B, H, T, D))")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got cos: {tuple(cos.shape)}, sin: {tuple(sin.shape)}")
    if not isinstance(layout, RopeLayout):
        raise TypeError(f"layout must be a RopeLayout, got {type(layout).__name__}")
    cos, sin = _as_table(cos, "cos", position_ids), _as_table(sin, "sin", position_ids)
    rot_dim = layout.rotary_dim(cos.shape[-1])
    if (cos.shape[0] not in (1, batch) or cos.shape[1] not in (1, seq_len) or rot_dim % 2 != 0
            or not 2 <= rot_dim <= head_dim):
        width = "R/2" if layout.table == TABLE_PAIR else "R"
        raise ValueError(
            f"cos/sin of shape {tuple(cos.shape)} do not broadcast to q/k of (B, H, T, D) = {tuple(q.shape)} "
            f"({layout.describe()}): need (1 or B={batch}, 1 or T={seq_len}, {width}) with R even and "
            f"2 <= R <= D={head_dim}"
        )
    if layout.table == TABLE_FIRST_HALF:
        cos, sin = cos[..., : rot_dim // 2], sin[..., : rot_dim // 2]
    return q, k, cos, sin


class LigerRopeFunction(torch.autograd.Function):
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` or another ``layout``;
    see the module docstring.

    ``apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, layout=ROTATE_HALF)``: q (B, Hq, T, D),
    k (B, Hk, T, D) (or (B, T, H, D) with ``unsqueeze_dim=2``; Hk may be 0), cos/sin (Bc, T, W)
    with W = R (R/2 for a ``pair`` table) and R <= D even. A 3-D
    cos/sin is used as given and ``position_ids`` ignored (as HF's deprecated argument); a 2-D
    (max_positions, R) table is gathered with ``position_ids`` (B, T) when they are given.
    Returns ``(q_embed, k_embed)`` with q's and k's shapes and dtypes. Gradients flow to q and k.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1,
                layout: RopeLayout = ROTATE_HALF) -> Tuple[torch.Tensor, torch.Tensor]:
        q_c, k_c, cos_c, sin_c = canonicalize_rope_args(q, k, cos, sin, position_ids, unsqueeze_dim, layout)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            raise ValueError("cos and sin must not require grad: the Liger RoPE kernel treats them as constants")
        q_order, k_order = memory_order(q_c), memory_order(k_c)
        transposed = unsqueeze_dim == 2
        # Outputs in q's and k's own shapes and memory orders, not views of another tensor,
        # so that callers may edit them in place (``q_embed *= scale``) as HF's.
        q_embed, k_embed = rope_rotate(q_c, k_c, cos_c, sin_c, q_order, k_order, transposed, False, *layout.flags)
        ctx.save_for_backward(cos_c, sin_c)
        ctx.orders = (q_order, k_order)
        ctx.transposed = transposed
        ctx.flags = layout.flags
        return q_embed, k_embed

    @staticmethod
    @strictly_once_differentiable
    def backward(ctx, grad_q_embed: torch.Tensor, grad_k_embed: torch.Tensor):
        cos, sin = ctx.saved_tensors
        if ctx.transposed:
            grad_q_embed, grad_k_embed = grad_q_embed.transpose(1, 2), grad_k_embed.transpose(1, 2)
        grad_q, grad_k = rope_rotate(grad_q_embed, grad_k_embed, cos, sin, *ctx.orders, ctx.transposed, True,
                                     *ctx.flags)
        return _ROPE_GRADS(q=grad_q, k=grad_k)


_ROPE_GRADS = InputGradients(LigerRopeFunction.forward)
