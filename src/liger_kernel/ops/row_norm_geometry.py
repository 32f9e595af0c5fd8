"""Launch configuration and geometry of the row-normalisation kernels (ops/row_norm.py):
the knobs (:class:`RowNormConfig`, tuned by ``python -m benchmarks.tune``) and what one
problem's launch derives from them (:func:`row_norm_launch` -> :class:`RowNormLaunch`: tile
shape, warps, grids). Every choice changes the schedule only, never the math.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator

import torch

from liger_kernel.ops.config import LaunchConfig, launch_config
from liger_kernel.ops.launch import (
    MAX_BLOCK,
    MAX_FUSED_BLOCK,
    _persistent_grid,
    cdiv,
    is_interpreter,
    multiprocessor_count,
    next_power_of_2,
    row_launch_settings,
)


@dataclasses.dataclass(frozen=True)
class RowNormConfig(LaunchConfig):
    """Launch parameters of the row-normalisation kernels (RMSNorm, LayerNorm).

    The fields are the knobs; :func:`row_norm_launch` turns them into the tile shape, warps
    and grids of one problem (:class:`RowNormLaunch`). Every choice changes the schedule only:
    the results agree to the summation order (the tests run several of them).
    """

    # Widest row held as one register tile; wider rows are walked in column blocks of this
    # width (two passes, the second mostly from L2). Walking rows of 4096 in blocks of
    # 1024-2048 is slower for both norms: the register-resident row stays.
    max_fused_block: int = MAX_FUSED_BLOCK
    # Forward elements per tile when a whole row fits one tile: rows narrower than this are
    # packed tile_elements // width to a tile, so small hidden sizes still move enough bytes
    # per program; at most max_rows_per_tile rows.
    tile_elements: int = 4096
    max_rows_per_tile: int = 256
    # Forward elements per thread, which sets the forward's warps for whole-row tiles. None
    # keeps row_launch_settings' choice (8 warps, 16 elements a thread, for a 4096-element
    # tile), which is the fastest for RMSNorm. LayerNorm's two dependent row reductions
    # (mean, then the centred variance) each cross every warp of the row, so it is faster
    # with fewer warps: the heuristic gives it 32 elements a thread (4 warps at 4096).
    forward_elements_per_thread: int | None = None
    # Backward tile when a whole row fits one tile: backward_tile_rows rows, within
    # [backward_min_tile_elements, backward_tile_elements] elements. Two rows a tile is the
    # fastest at widths 2048 and 4096.
    backward_tile_elements: int = 8192
    backward_min_tile_elements: int = 4096
    backward_tile_rows: int = 2
    # The backward keeps ~6 fp32 values per element live (dy, x, w, g, xhat, the dW
    # accumulator); at 16 elements a thread ptxas (sm_90) gives the fused backward ~110
    # registers, so one 16-warp program fits an SM. More bytes in flight per program beat
    # occupancy here: 16 a thread with 8192-element tiles is faster than 8 with 4096.
    backward_elements_per_thread: int = 16
    # Backward persistent grid: programs per SM = backward_warps_per_sm // backward warps,
    # clamped to [1, max_programs_per_sm]. Each program owns one fp32 row of the (P, H)
    # partial dW buffer; one 16-warp program per SM (P = #SMs) beats two (a second wave of
    # programs and twice the partials).
    backward_warps_per_sm: int = 16
    max_programs_per_sm: int = 4
    # Backward of fused rows: load the next tile while the current one is reduced and stored.
    backward_prefetch: bool = True
    # dW/dB accumulation of a multi-row backward tile. None picks per shape: a (rows, cols)
    # register accumulator summed once at the end when a tile's rows lie in different warps
    # (where a per-tile sum over rows is a shared-memory reduction), the per-tile sum when
    # each thread holds whole columns. True/False force one.
    backward_row_accumulator: bool | None = None
    # Tile of the launch that sums the (P, H) partials over P: narrow column blocks spread
    # the sum over more SMs.
    partials_sum_block_rows: int = 64
    partials_sum_block_cols: int = 16

    def __post_init__(self) -> None:
        # The geometry memo hashes the configuration on every launch: hash the fields once.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))

    def __hash__(self) -> int:
        # Set in __post_init__, not a dataclass field (it would join the fields and the search space).
        return self._hash  # type: ignore[attr-defined]

    @classmethod
    def heuristic(cls, n_rows: int, n_cols: int, device: torch.device | None = None,
                  center: bool = False) -> RowNormConfig:
        """The default for normalising ``n_rows`` rows of ``n_cols`` (``center``: LayerNorm).

        The knobs depend on the norm only; the shape enters through :func:`row_norm_launch`.
        """
        return _CENTERED_DEFAULT if center else _DEFAULT

    @classmethod
    def search_space(cls, n_rows: int, n_cols: int, device: torch.device | None = None,
                     center: bool = False) -> Iterator[RowNormConfig]:
        """What ``python -m benchmarks.tune`` times, each group around the heuristic's values
        of the other fields: the backward (tile, elements per thread, resident warps,
        prefetch), the forward (tile, elements per thread), the column-block width, the dW
        accumulation and the partials-sum tile."""
        base = cls.heuristic(n_rows, n_cols, device, center)
        candidates = [
            *(dataclasses.replace(base, backward_prefetch=prefetch, backward_tile_elements=tile,
                                  backward_elements_per_thread=per_thread, backward_warps_per_sm=warps)
              for prefetch, tile, per_thread, warps in itertools.product(
                  (True, False), (4096, 8192, 16384), (8, 16, 32), (16, 32))),
            *(dataclasses.replace(base, tile_elements=tile, forward_elements_per_thread=per_thread)
              for tile, per_thread in itertools.product((2048, 4096, 8192, 16384), (None, 8, 16, 32, 64, 128))),
            *(dataclasses.replace(base, max_fused_block=block) for block in (1024, 2048)),
            *(dataclasses.replace(base, backward_row_accumulator=accumulator) for accumulator in (True, False)),
            *(dataclasses.replace(base, partials_sum_block_rows=rows, partials_sum_block_cols=cols)
              for rows, cols in itertools.product((16, 64), (16, 32, 64))),
        ]
        return iter(dict.fromkeys(candidates))  # each once, in order


_DEFAULT = RowNormConfig()
_CENTERED_DEFAULT = RowNormConfig(forward_elements_per_thread=32)


@dataclasses.dataclass(frozen=True)
class RowNormLaunch:
    """Launch geometry of one row-normalisation problem, derived from a :class:`RowNormConfig`."""

    block_rows: int  # rows per forward tile (power of two)
    backward_block_rows: int  # rows per backward tile (power of two)
    block_cols: int  # columns per tile (power of two); a row wider than this is looped over
    num_warps: int  # forward
    backward_num_warps: int
    fused: bool  # the whole row fits one tile (single pass over registers)
    n_tiles: int  # forward grid: one program per tile
    backward_programs: int  # backward grid: persistent programs striding over the tiles
    round_by_hand: bool  # interpreter only: see round_to_dtype
    backward_prefetch: bool
    backward_row_accumulator: bool  # dW/dB kept per tile row until the end (see the config)
    partials_sum_block_rows: int
    partials_sum_block_cols: int

    def kernel_args(self, backward: bool) -> dict:
        """The geometry arguments (constexprs and ``num_warps``) of
        :func:`row_norm_forward_kernel`, or of :func:`row_norm_backward_kernel` (``backward``)."""
        args = dict(FUSED=self.fused, BLOCK_ROWS=self.backward_block_rows if backward else self.block_rows,
                    BLOCK_COLS=self.block_cols, ROUND_BY_HAND=self.round_by_hand,
                    num_warps=self.backward_num_warps if backward else self.num_warps)
        if backward:
            args.update(PREFETCH=self.backward_prefetch, ROW_ACCUMULATOR=self.backward_row_accumulator)
        return args


def row_norm_launch(n_rows: int, n_cols: int, device: torch.device, center: bool = False) -> RowNormLaunch:
    """Tile shape, warps and grid sizes for normalising ``n_rows`` rows of ``n_cols``
    (``center``: LayerNorm, which subtracts the mean), from ``launch_config(RowNormConfig, ...)``.

    Memoised per (shape, SM count, configuration): a training step asks for the same few
    shapes hundreds of times, and the host time of a launch shows as GPU idle time when the
    GPU outpaces Python. An active ``override_launch_config(RowNormConfig, ...)`` changes the
    configuration, hence the key, so it applies at once.
    """
    config = launch_config(RowNormConfig, n_rows, n_cols, device, center)
    return _row_norm_launch(n_rows, n_cols, multiprocessor_count(device), config)


@functools.lru_cache(maxsize=1024)
def _row_norm_launch(n_rows: int, n_cols: int, n_sms: int, config: RowNormConfig) -> RowNormLaunch:
    block_cols, _ = row_launch_settings(n_cols, max_block=config.max_fused_block)
    fused = block_cols >= n_cols

    def rows_per_tile(tile_elements: int) -> int:
        if not fused:
            return 1
        return min(max(1, tile_elements // block_cols), config.max_rows_per_tile, next_power_of_2(n_rows))

    block_rows = rows_per_tile(config.tile_elements)
    backward_block_rows = rows_per_tile(min(config.backward_tile_elements, max(
        config.backward_min_tile_elements, config.backward_tile_rows * block_cols)))
    _, num_warps = row_launch_settings(block_rows * block_cols, max_block=MAX_BLOCK)
    if config.forward_elements_per_thread is not None and fused and not is_interpreter():
        num_warps = _warps_for(block_rows * block_cols, config.forward_elements_per_thread)
    backward_num_warps = _warps_for(backward_block_rows * block_cols, config.backward_elements_per_thread)
    if is_interpreter():
        backward_num_warps = num_warps  # ignored by the interpreter, but it sizes the grid below
    n_tiles = cdiv(n_rows, block_rows)
    programs_per_sm = max(1, min(config.max_programs_per_sm, config.backward_warps_per_sm // backward_num_warps))
    programs = _persistent_grid(cdiv(n_rows, backward_block_rows), n_sms, programs_per_sm)
    # Triton's default layout gives each warp 32 threads x 8 contiguous columns; a tile row
    # narrower than all warps together puts the tile's rows into different warps.
    row_accumulator = config.backward_row_accumulator
    if row_accumulator is None:
        row_accumulator = backward_block_rows > 1 and block_cols < 256 * backward_num_warps
    return RowNormLaunch(block_rows, backward_block_rows, block_cols, num_warps, backward_num_warps, fused, n_tiles,
                         programs, is_interpreter(), config.backward_prefetch, bool(row_accumulator),
                         config.partials_sum_block_rows, config.partials_sum_block_cols)


def _warps_for(tile_elements: int, elements_per_thread: int) -> int:
    """Warps (a power of two in [1, 32]) giving each thread about ``elements_per_thread``."""
    return next_power_of_2(max(1, min(32, tile_elements // (32 * elements_per_thread))))
