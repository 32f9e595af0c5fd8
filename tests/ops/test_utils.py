"""Shared helpers of ops/utils.py that are not covered through an op: the in-place gradient
scale and the column sum of the norm backward's partials."""

import pytest
import torch

from liger_kernel.ops.utils import scale_in_place, sum_partials
from tests.utils import DEVICE


def expected(x, scale):
    """fp32 product rounded once to x's dtype, as the kernel computes it."""
    return (x.float() * scale.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (7, 13), (3, 5000), (4097,), (2, 3, 5)])
def test_scalar_scale(shape, dtype):
    x = torch.randn(shape, device=DEVICE).to(dtype)
    scale = torch.tensor(0.37, device=DEVICE)
    want = expected(x, scale)
    scale_in_place(x, scale)
    assert torch.equal(x, want)


def test_unit_scale_leaves_tensor_untouched():
    # NaN and inf would change under any arithmetic: an exact 1 must skip the row entirely.
    x = torch.randn(6, 300, device=DEVICE)
    x[1, 7] = float("nan")
    x[4, 0] = float("inf")
    before = x.clone()
    scale_in_place(x, torch.ones((), device=DEVICE))
    assert torch.equal(x.isnan(), before.isnan())
    assert torch.equal(torch.nan_to_num(x), torch.nan_to_num(before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_scale(dtype):
    x = torch.randn(9, 1031, device=DEVICE).to(dtype)
    scale = torch.rand(9, device=DEVICE) + 0.5
    scale[[0, 4, 8]] = 1.0
    x[4, 3] = float("nan")  # a unit row is skipped, so its NaN stays a NaN and nothing else changes
    want = expected(x, scale[:, None])
    scale_in_place(x, scale)
    assert torch.equal(torch.nan_to_num(x), torch.nan_to_num(want))


def test_per_row_scale_expanded_and_strided():
    # Upstream gradients of a sum are expanded (stride 0); logits views may have padded rows.
    storage = torch.randn(5, 40, device=DEVICE)
    x = storage[:, :33]
    scale = torch.tensor(3.0, device=DEVICE).expand(5)
    want = expected(x, scale[:, None])
    scale_in_place(x, scale)
    assert torch.equal(x, want)
    assert torch.equal(storage[:, 33:], storage[:, 33:])


def test_non_contiguous_scalar_scale_falls_back():
    x = torch.randn(8, 6, device=DEVICE).t()
    want = expected(x, torch.tensor(2.5))
    scale_in_place(x, torch.tensor(2.5, device=DEVICE))
    assert torch.equal(x, want.to(DEVICE))


def test_empty_and_bad_shapes():
    scale_in_place(torch.empty(0, 5, device=DEVICE), torch.tensor(2.0, device=DEVICE))
    with pytest.raises(ValueError, match="per-row scale"):
        scale_in_place(torch.randn(4, 3, device=DEVICE), torch.ones(3, device=DEVICE))


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


def test_row_norm_launch_reads_max_fused_block_at_call_time(monkeypatch):
    """MAX_FUSED_BLOCK is a tunable: setting it changes which rows are walked in blocks."""
    import liger_kernel.ops.utils as ops_utils

    assert ops_utils.row_norm_launch(4, 1000, torch.device(DEVICE)).fused
    monkeypatch.setattr(ops_utils, "MAX_FUSED_BLOCK", 256)
    launch = ops_utils.row_norm_launch(4, 1000, torch.device(DEVICE))
    assert not launch.fused and launch.block_cols == 256
    assert ops_utils.row_launch_settings(1000)[0] == 256


def test_next_power_of_2_matches_triton():
    import triton

    from liger_kernel.ops.utils import next_power_of_2

    for n in [*range(0, 300), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(max(n, 1)), n


def test_gated_launch_geometry_reads_tunables_at_call_time(monkeypatch):
    """The memoised gated-MLP launch geometry is keyed on the tunables, so changing one
    (as ``benchmarks.tune`` does) takes effect at the next launch."""
    import liger_kernel.ops.swiglu as swiglu_ops

    default = swiglu_ops._launch_geometry(64, 4096)
    monkeypatch.setattr(swiglu_ops, "GATED_MAX_BLOCK_COLS", 256)
    narrow = swiglu_ops._launch_geometry(64, 4096)
    assert narrow[1] == 256 and narrow != default
    monkeypatch.setattr(swiglu_ops, "GATED_MAX_BLOCK_COLS", 1024)
    assert swiglu_ops._launch_geometry(64, 4096) == default
