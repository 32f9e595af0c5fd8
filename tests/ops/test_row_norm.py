"""ops.row_norm: the column sum of the backward's partials (the kernels themselves are tested
through RMSNorm and LayerNorm; their launch geometry in test_row_norm_geometry.py)."""

import pytest
import torch

from liger_kernel.ops.row_norm import sum_partials
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
