"""The head engine's shared GEMM helpers against float64."""

import pytest
import torch

from liger_kernel.ops.head_chunking import FP32_REDUCTION_SLICE, balanced_ranges, grad_input_rows
from tests.utils import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [FP32_REDUCTION_SLICE - 1, 2 * FP32_REDUCTION_SLICE + 3])
def test_grad_input_rows_matches_float64(dtype, vocab):
    grad = torch.randn(3, vocab, device=DEVICE).to(dtype)
    weight = torch.randn(vocab, 5, device=DEVICE).to(dtype)
    expected = grad.double() @ weight.double()
    out = torch.empty(3, 5, device=DEVICE, dtype=dtype)
    got = grad_input_rows(grad, weight, out=out)
    assert got.data_ptr() == out.data_ptr()
    # float32: the split reduction's roundings; bf16: one output rounding of an fp32 sum.
    scale = float((grad.double().abs() @ weight.double().abs()).max())
    atol = 1e-6 * scale if dtype == torch.float32 else 2**-8 * float(expected.abs().max()) + 1e-5 * scale
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("n_items, most, expected", [
    (10, 3, [(0, 3), (3, 6), (6, 8), (8, 10)]),
    (8, 3, [(0, 3), (3, 6), (6, 8)]),
    (5, 9, [(0, 5)]),
    (0, 4, []),
    (7, 1, [(i, i + 1) for i in range(7)]),
])
def test_balanced_ranges(n_items, most, expected):
    assert balanced_ranges(n_items, most) == expected
