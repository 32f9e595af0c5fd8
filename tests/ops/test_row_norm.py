"""ops.row_norm: the launch configuration and geometry of the row-normalisation kernels, and the
column sum of the backward's partials (the kernels themselves are tested through RMSNorm and
LayerNorm)."""

import dataclasses

import pytest
import torch

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.launch import MAX_FUSED_BLOCK, row_launch_settings
from liger_kernel.ops.row_norm import RowNormConfig, row_norm_launch, sum_partials
from tests.utils import DEVICE


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("n_partials,n_cols", [(1, 1), (3, 65), (33, 200), (264, 4096 + 3)])
def test_sum_partials(n_partials, n_cols, dtypes):
    """Each slab summed over its rows in fp32, then rounded once to its own dtype; fresh tensors."""
    partials = torch.randn(len(dtypes), n_partials, n_cols, device=DEVICE)
    outs = sum_partials(partials, dtypes)
    assert len(outs) == len(dtypes)
    for k, (out, dtype) in enumerate(zip(outs, dtypes)):
        assert out.shape == (n_cols,) and out.dtype == dtype
        exact = partials[k].double().sum(dim=0)
        # fp32 summation of n_partials terms, then one rounding to the output dtype.
        bound = n_partials * 2.0**-24 * partials[k].double().abs().sum(dim=0) + exact.abs() * torch.finfo(dtype).eps
        assert bool(((out.double() - exact).abs() <= bound + 1e-30).all()), f"slab {k}"
    if len(outs) == 2:
        assert outs[0].data_ptr() != outs[1].data_ptr()


def test_sum_partials_is_deterministic():
    partials = torch.randn(2, 131, 777, device=DEVICE)
    first = sum_partials(partials, (torch.float32, torch.float32))
    second = sum_partials(partials, (torch.float32, torch.float32))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_sum_partials_rejects_bad_slab_count():
    with pytest.raises(ValueError, match="1 or 2 dtypes"):
        sum_partials(torch.zeros(3, 2, 4, device=DEVICE), (torch.float32,) * 3)


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
    import liger_kernel.ops.row_norm as row_norm

    monkeypatch.setattr(row_norm, "is_interpreter", lambda: False)
    monkeypatch.setattr("liger_kernel.ops.launch.is_interpreter", lambda: False)
    row_norm._row_norm_launch.cache_clear()
    try:
        n_rows, n_cols, center = shape
        config = RowNormConfig.heuristic(n_rows, n_cols, torch.device(DEVICE), center)
        launch = row_norm._row_norm_launch(n_rows, n_cols, 132, config)
        got = (launch.block_rows, launch.backward_block_rows, launch.block_cols, launch.num_warps,
               launch.backward_num_warps, launch.fused, launch.backward_programs, launch.backward_row_accumulator)
        assert got == GPU_GEOMETRY[shape]
    finally:
        row_norm._row_norm_launch.cache_clear()


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
