"""Launch-configuration overrides: scoped, and seen by backward passes started in their block."""

import dataclasses
import threading

import pytest
import torch

from liger_kernel.ops.config import LaunchConfig, launch_config, override_launch_config
from tests.utils import DEVICE


@dataclasses.dataclass(frozen=True)
class _Tiles(LaunchConfig):
    block: int

    @classmethod
    def heuristic(cls, n: int) -> "_Tiles":
        return cls(block=n)


class _RecordsItsBackwardConfig(torch.autograd.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        _RecordsItsBackwardConfig.seen.append(("forward", launch_config(_Tiles, 8).block))
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _RecordsItsBackwardConfig.seen.append(("backward", launch_config(_Tiles, 8).block))
        return grad * 2


def test_backward_in_the_block_runs_under_the_override():
    """On CUDA autograd runs a backward in its device thread, which a context variable does not
    reach: within the block it runs in the calling thread instead, so the override holds there."""
    seen = _RecordsItsBackwardConfig.seen
    seen.clear()
    x = torch.randn(5, device=DEVICE, requires_grad=True)
    with override_launch_config(_Tiles, block=64):
        assert not torch._C._is_multithreading_enabled()
        _RecordsItsBackwardConfig.apply(x).sum().backward()
    assert torch._C._is_multithreading_enabled()
    _RecordsItsBackwardConfig.apply(x).sum().backward()
    assert seen == [("forward", 64), ("backward", 64), ("forward", 8), ("backward", 8)]
    torch.testing.assert_close(x.grad, torch.full_like(x, 4.0))


def test_overrides_are_scoped_nested_and_per_thread():
    with override_launch_config(_Tiles, block=16):
        with override_launch_config(_Tiles, block=32):
            assert launch_config(_Tiles, 8).block == 32
        assert launch_config(_Tiles, 8).block == 16
        other = []
        thread = threading.Thread(target=lambda: other.append(launch_config(_Tiles, 8).block))
        thread.start()
        thread.join()
        assert other == [8]
    assert launch_config(_Tiles, 8).block == 8
    with pytest.raises(TypeError, match="no field"):
        with override_launch_config(_Tiles, blocks=4):
            pass
