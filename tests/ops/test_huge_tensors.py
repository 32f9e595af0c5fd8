"""Index arithmetic past 2**31 elements (GPU only): rows far into a >2**31-element tensor.

Only the rows near the end are checked against the reference, since those are the ones
whose element offsets exceed int32; computing the reference on the whole tensor would
need tens of GB of float64.
"""

import pytest
import torch

from liger_kernel.transformers.functional import liger_rms_norm, liger_swiglu
from tests.utils import DEVICE, assert_close

pytestmark = pytest.mark.gpu_only

INT32_LIMIT = 2**31


def _needs_free_gib(gib: float) -> None:
    if DEVICE != "cuda":
        pytest.skip("needs a CUDA device")
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free GPU memory")


def test_rms_norm_past_int32_offsets():
    _needs_free_gib(24)
    hidden = 16384
    rows = INT32_LIMIT // hidden + 3
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = liger_rms_norm(x, w, 1e-6, 0.0, "llama", False)
    dy = torch.randn_like(y)
    y.backward(dy)
    tail = slice(rows - 5, rows)
    xt = x.detach()[tail].float()
    ref = w.detach().float() * (xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).float()
    assert_close(y[tail].float(), ref, dtype=torch.bfloat16)
    assert torch.isfinite(x.grad[tail].float()).all()
    assert x.grad[tail].abs().sum() > 0
    del x, y, dy
    torch.cuda.empty_cache()


def test_swiglu_past_int32_offsets():
    _needs_free_gib(40)
    cols = 14336
    rows = INT32_LIMIT // cols + 3
    a = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    h = liger_swiglu(a, b)
    tail = slice(rows - 4, rows)
    ref = torch.nn.functional.silu(a.detach()[tail].float()) * b.detach()[tail].float()
    assert_close(h[tail].float(), ref, dtype=torch.bfloat16)
    h.backward(torch.ones_like(h))
    assert torch.isfinite(a.grad[tail].float()).all() and a.grad[tail].abs().sum() > 0
    del a, b, h
    torch.cuda.empty_cache()
