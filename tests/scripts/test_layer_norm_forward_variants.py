"""The LayerNorm prototypes of scripts/device/layer_norm_forward_variants.py compute what the library does.

The script is a GPU experiment; this keeps its kernels from rotting (interpreter on CPU,
compiled on a GPU).
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from liger_kernel.ops.layer_norm import layer_norm_forward
from tests.utils import DEVICE, assert_close

ROOT = Path(__file__).resolve().parents[2]


def _script():
    path = ROOT / "scripts" / "device" / "layer_norm_forward_variants.py"
    spec = importlib.util.spec_from_file_location("layer_norm_forward_variants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("variant", ["one_reduction", "resident"])
def test_prototypes_match_library(variant, has_bias, dtype):
    script = _script()
    n, d, eps = 7, 256, 1e-6
    # A large mean against a small spread: the centred variance must not cancel.
    x = (torch.randn(n, d, device=DEVICE, dtype=torch.float32) * 3 + 100).to(dtype)
    w = torch.rand(d, device=DEVICE, dtype=dtype) + 0.5
    b = torch.randn(d, device=DEVICE, dtype=dtype) if has_bias else None
    if variant == "one_reduction":
        y, mean, rstd = script.layer_norm_forward_one_reduction(x, w, b, eps, 4, 8)
    else:
        y, mean, rstd = script.layer_norm_forward_resident(x, w, b, eps, 4, 2)
    y_ref, mean_ref, rstd_ref = layer_norm_forward(x, w, b, eps)
    assert_close(mean, mean_ref, torch.float32, scale=4.0)
    assert_close(rstd, rstd_ref, torch.float32, scale=4.0)
    assert_close(y, y_ref, scale=4.0 if dtype == torch.float32 else 1.0)
