"""ops.scaling.scale_in_place: the in-place gradient scale used by the losses."""

import pytest
import torch

from liger_kernel.ops.scaling import scale_in_place
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
