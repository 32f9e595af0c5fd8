"""ops.row_norm_geometry: the launch configuration and geometry of the row-normalisation kernels."""

import dataclasses

import pytest
import torch

from liger_kernel.ops import row_norm_geometry
from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.launch import MAX_FUSED_BLOCK, row_launch_settings
from liger_kernel.ops.row_norm_geometry import RowNormConfig, row_norm_launch
from tests.utils import DEVICE


def test_max_fused_block_override_walks_rows_in_blocks():
    """max_fused_block decides which rows are walked in column blocks; the override applies
    at once although the geometry is memoised, and ends with the block."""
    device = torch.device(DEVICE)
    assert row_norm_launch(4, 1000, device).fused
    with override_launch_config(RowNormConfig, max_fused_block=256):
        launch = row_norm_launch(4, 1000, device)
        assert not launch.fused and launch.block_cols == 256
        assert row_launch_settings(1000)[0] == min(1024, MAX_FUSED_BLOCK)  # other ops keep theirs
    assert row_norm_launch(4, 1000, device).fused


# The geometry the heuristic gives, as computed before the configuration became a value
# (SM count 132, as on an H100 SXM / H200; outside the interpreter): the defaults must not
# move the launches, which the benchmark figures were measured with.
# (n_rows, n_cols, center) -> (block_rows, backward_block_rows, block_cols, num_warps,
#                              backward_num_warps, fused, backward_programs, row_accumulator)
GPU_GEOMETRY = {
    (16384, 4096, False): (1, 2, 4096, 8, 16, True, 132, False),
    (16384, 4096, True): (1, 2, 4096, 4, 16, True, 132, False),
    (8192, 2048, False): (2, 2, 2048, 8, 8, True, 264, False),
    (8192, 2048, True): (2, 2, 2048, 4, 8, True, 264, False),
    (4096, 64, False): (64, 64, 64, 8, 8, True, 64, True),
    (4096, 64, True): (64, 64, 64, 4, 8, True, 64, True),
    (37, 123, True): (32, 32, 128, 4, 8, True, 2, True),
    (3, 65543, False): (1, 1, 8192, 16, 16, False, 3, False),
    (3, 65543, True): (1, 1, 8192, 16, 16, False, 3, False),
    (1, 1, False): (1, 1, 1, 1, 1, True, 1, False),
}


@pytest.mark.parametrize("shape", sorted(GPU_GEOMETRY))
def test_heuristic_geometry(shape, monkeypatch):
    monkeypatch.setattr(row_norm_geometry, "is_interpreter", lambda: False)
    monkeypatch.setattr("liger_kernel.ops.launch.is_interpreter", lambda: False)
    row_norm_geometry._row_norm_launch.cache_clear()
    try:
        n_rows, n_cols, center = shape
        config = RowNormConfig.heuristic(n_rows, n_cols, torch.device(DEVICE), center)
        launch = row_norm_geometry._row_norm_launch(n_rows, n_cols, 132, config)
        got = (launch.block_rows, launch.backward_block_rows, launch.block_cols, launch.num_warps,
               launch.backward_num_warps, launch.fused, launch.backward_programs, launch.backward_row_accumulator)
        assert got == GPU_GEOMETRY[shape]
    finally:
        row_norm_geometry._row_norm_launch.cache_clear()


def test_search_space_holds_valid_distinct_configs():
    space = list(RowNormConfig.search_space(16384, 4096, torch.device(DEVICE), center=False))
    assert len(space) == len(set(space)) > 1
    assert all(isinstance(c, RowNormConfig) for c in space)
    fields = {f.name for f in dataclasses.fields(RowNormConfig)}
    default = RowNormConfig.heuristic(16384, 4096, torch.device(DEVICE))
    varied = {name for c in space for name in fields if getattr(c, name) != getattr(default, name)}
    assert {"backward_tile_elements", "backward_prefetch", "tile_elements", "forward_elements_per_thread",
            "max_fused_block", "partials_sum_block_cols"} <= varied


def test_override_rejects_unknown_fields():
    with pytest.raises(TypeError, match="no field"):
        with override_launch_config(RowNormConfig, tile_elementz=1):
            pass
