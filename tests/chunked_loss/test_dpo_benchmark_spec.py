"""The DPO benchmark compares like with like: its materialised-logits reference and the fused
loss agree at the tiny shape, and its floor is 8 M D V FLOPs (two heads forward, dX and dW) at the target shape."""

import pytest
import torch

from benchmarks import bench_post_training as bench
from tests.utils import DEVICE


def test_reference_and_liger_agree():
    (spec,) = bench.SPECS
    inputs = spec.make_inputs(spec.tiny_shapes[0], torch.float32, torch.device(DEVICE))
    wrt = [inputs.args[i] for i in inputs.grad_args]
    expected = spec.reference(*inputs.args)
    expected_grads = torch.autograd.grad(expected, wrt)
    got = spec.liger()(*inputs.args)
    got_grads = torch.autograd.grad(got, wrt)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, atol=1e-6 * float(b.abs().max()), rtol=1e-4)


def test_target_shape_and_floor():
    (spec,) = bench.SPECS
    shape = spec.gpu_shapes[0]
    assert shape == {"P": 8, "T": 1024, "D": 4096, "V": 128256}
    assert spec.floor(shape, torch.bfloat16, "full").flops / 1e12 == pytest.approx(68.86, abs=0.01)
    mib = spec.floor_peak_bytes(shape, torch.bfloat16, "full") / 2**20
    assert mib == pytest.approx((16 * 1024 + 128256) * 4096 * 2 / 2**20)
