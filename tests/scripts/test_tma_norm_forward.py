"""The TMA prototype of scripts/device/tma_norm_forward.py computes what the library's norm forwards do.

The script is a GPU experiment; this keeps its kernel from rotting: on CPU it runs through
the interpreter (which supports tensor descriptors), on a Hopper GPU compiled.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from liger_kernel.ops.layer_norm import layer_norm_forward
from liger_kernel.ops.rms_norm import rms_norm_forward
from tests.utils import DEVICE, assert_close

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("tma_norm_forward", ROOT / "scripts" / "device" / "tma_norm_forward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA descriptors need sm_90 or newer")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seg,store_tma", [(128, False), (256, True)])
@pytest.mark.parametrize("center", [True, False], ids=["layer_norm", "rms_norm"])
def test_prototype_matches_library(center, seg, store_tma, dtype):
    n, d, eps = 3, 512, 1e-6
    x = torch.randn(n, d, device=DEVICE, dtype=dtype) * 2 + 0.5
    w = torch.rand(d, device=DEVICE, dtype=dtype) + 0.5
    b = torch.randn(d, device=DEVICE, dtype=dtype)
    got = _script().tma_norm_forward(x, w, b, eps, center, seg, 4, store_tma)
    expected = layer_norm_forward(x, w, b, eps)[0] if center else rms_norm_forward(x, w, eps, 0.0, "llama")[0]
    # Same math, another summation order: the statistics differ by fp32 ulps, the outputs by
    # at most about one output ulp.
    assert_close(got, expected, scale=4.0 if dtype == torch.float32 else 1.0)
