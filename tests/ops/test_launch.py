"""ops.cached_launch.launch_kernel: the cached-specialisation launch gives what ``kernel[grid]`` gives.

On the GPU the second launch with the same argument properties skips Triton's lookup; these
tests check that it still launches the right specialisation when alignment, integer
properties, dtypes or constexprs change, that defaults of trailing constexprs are honoured,
and that profiler hooks and the environment switch send launches back through Triton. Under
the interpreter every launch goes through Triton, and the same tests check the results.
"""

import pytest
import torch
import triton
import triton.language as tl

from liger_kernel.ops import cached_launch
from liger_kernel.ops.cached_launch import KernelLaunchConfig, _argument_key, launch_kernel
from liger_kernel.ops.config import launch_config, override_launch_config
from liger_kernel.ops.launch import is_interpreter
from tests.utils import DEVICE

FAST = not is_interpreter() and launch_config(KernelLaunchConfig).cached


@triton.jit
def _axpy_kernel(X, Y, OUT, n, alpha, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + offsets, mask=mask, other=0.0).to(tl.float32)
    out = alpha * x + y
    if NEGATE:
        out = -out
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)


def _axpy(x, y, alpha=0.5, block=128, **constexprs):
    out = torch.empty_like(x)
    n = x.numel()
    launch_kernel(_axpy_kernel, (triton.cdiv(n, block),), x, y, out, n, alpha, BLOCK=block, num_warps=1,
                  **constexprs)
    return out


def _reference(x, y, alpha=0.5, negate=False):
    out = (alpha * x.float() + y.float()).to(x.dtype)
    return -out if negate else out


class _CountTritonCalls:
    """Counts launches that went through ``JITFunction.run`` (Triton's own path)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = _axpy_kernel.run

        def counting_run(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(_axpy_kernel, "run", counting_run)


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(cached_launch, "_LAUNCH_CACHE", {})
    return cached_launch


def test_repeated_launches_match_and_skip_triton(monkeypatch, fresh_cache):
    counter = _CountTritonCalls(monkeypatch)
    for _ in range(3):
        x, y = torch.randn(1000, device=DEVICE), torch.randn(1000, device=DEVICE)
        torch.testing.assert_close(_axpy(x, y), _reference(x, y), rtol=1e-6, atol=1e-6)
    assert counter.calls == (1 if FAST else 3)
    assert len(fresh_cache._LAUNCH_CACHE) == (1 if FAST else 0)


def test_misaligned_view_gets_its_own_specialisation(fresh_cache):
    # A kernel specialised on 16-byte aligned pointers may vectorise its loads; a view
    # starting one element in must not reuse it.
    base_x, base_y = torch.randn(1001, device=DEVICE), torch.randn(1001, device=DEVICE)
    _axpy(base_x[:1000], base_y[:1000])
    x, y = base_x[1:], base_y[1:]
    torch.testing.assert_close(_axpy(x, y), _reference(x, y), rtol=1e-6, atol=1e-6)
    if FAST:
        assert len(fresh_cache._LAUNCH_CACHE) == 2


@pytest.mark.parametrize("n", [1, 16, 17, 4096, 4099])
def test_integer_specialisations(n, fresh_cache):
    # n == 1 is a constant and multiples of 16 are a divisibility hint in Triton: each
    # property change must select a kernel compiled for it, in any order.
    for size in (n, 33, n):
        x, y = torch.randn(size, device=DEVICE), torch.randn(size, device=DEVICE)
        torch.testing.assert_close(_axpy(x, y), _reference(x, y), rtol=1e-6, atol=1e-6)


def test_dtypes_constexprs_and_defaults(fresh_cache):
    x32, y32 = torch.randn(300, device=DEVICE), torch.randn(300, device=DEVICE)
    x16, y16 = x32.half(), y32.half()  # fp16: the interpreter rounds it as the GPU does
    for _ in range(2):
        torch.testing.assert_close(_axpy(x32, y32), _reference(x32, y32), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(_axpy(x16, y16), _reference(x16, y16), rtol=0, atol=0)
        torch.testing.assert_close(_axpy(x32, y32, NEGATE=True), _reference(x32, y32, negate=True),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(_axpy(x32, y32, alpha=-3.0, block=64), _reference(x32, y32, -3.0),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not FAST, reason="the cached path exists only for compiled kernels")
def test_launch_hooks_go_through_triton(monkeypatch, fresh_cache):
    knobs = triton.knobs.runtime
    seen = []

    def hook(metadata):
        seen.append(metadata)

    x, y = torch.randn(100, device=DEVICE), torch.randn(100, device=DEVICE)
    _axpy(x, y)  # cached now
    hook_chain = knobs.launch_enter_hook
    if hasattr(hook_chain, "add"):
        hook_chain.add(hook)
        try:
            _axpy(x, y)
        finally:
            hook_chain.remove(hook)
    else:
        monkeypatch.setattr(knobs, "launch_enter_hook", hook)
        _axpy(x, y)
    assert len(seen) == 1


@pytest.mark.skipif(not FAST, reason="the cached path exists only for compiled kernels")
def test_switch_off_uses_triton_every_time(monkeypatch, fresh_cache):
    counter = _CountTritonCalls(monkeypatch)
    x, y = torch.randn(100, device=DEVICE), torch.randn(100, device=DEVICE)
    with override_launch_config(KernelLaunchConfig, cached=False):
        for _ in range(2):
            torch.testing.assert_close(_axpy(x, y), _reference(x, y), rtol=1e-6, atol=1e-6)
    assert counter.calls == 2 and not fresh_cache._LAUNCH_CACHE


def test_callable_grid_falls_back(fresh_cache):
    x, y = torch.randn(500, device=DEVICE), torch.randn(500, device=DEVICE)
    out = torch.empty_like(x)
    for _ in range(2):
        launch_kernel(_axpy_kernel, lambda meta: (triton.cdiv(500, meta["BLOCK"]),), x, y, out, 500, 2.0,
                      BLOCK=128, num_warps=1)
        torch.testing.assert_close(out, _reference(x, y, 2.0), rtol=1e-6, atol=1e-6)
    assert not fresh_cache._LAUNCH_CACHE


def test_argument_keys():
    assert _argument_key(1) != _argument_key(2) != _argument_key(32)
    assert _argument_key(32) == _argument_key(48)
    assert _argument_key(2**31 - 1) != _argument_key(2**31)  # i32 -> i64
    assert _argument_key(2**63) != _argument_key(2**62)  # i64 -> u64
    assert _argument_key(0.5) == _argument_key(3.0)
    assert _argument_key(None) is type(None)
    t = torch.zeros(8)
    assert _argument_key(t) == (torch.float32, t.data_ptr() % 16 == 0)
    assert _argument_key(t[1:]) != _argument_key(t) or t.data_ptr() % 16 != 0
    assert _argument_key(t.bfloat16())[0] == torch.bfloat16
    assert _argument_key("a string") is NotImplemented


# ---- The cached path's bookkeeping, on any machine: a real JITFunction whose Triton launch is
# replaced by a stand-in compiled kernel that records what the direct launches pass.


def _plain_kernel(X, n, alpha, BLOCK: tl.constexpr, FLAG: tl.constexpr = 7):
    pass


class _StandInCompiled:
    function = "function-handle"
    packed_metadata = "packed-metadata"

    def __init__(self):
        self.direct_calls = []

    def run(self, *launch_args):
        self.direct_calls.append(launch_args)


@pytest.fixture
def stand_in(monkeypatch):
    kernel = triton.runtime.JITFunction(_plain_kernel)
    compiled = _StandInCompiled()
    triton_calls = []

    def triton_run(*args, grid, warmup, **kwargs):
        triton_calls.append((grid, args, kwargs))
        return compiled

    monkeypatch.setattr(kernel, "run", triton_run)
    monkeypatch.setattr(cached_launch, "is_interpreter", lambda: False)
    monkeypatch.setattr(cached_launch, "_LAUNCH_CACHE", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    with override_launch_config(KernelLaunchConfig, cached=True):
        yield kernel, compiled, triton_calls


def test_cached_launch_passes_arguments_in_signature_order(stand_in):
    kernel, compiled, triton_calls = stand_in
    x = torch.zeros(64)
    launch_kernel(kernel, (3,), x, 100, 0.5, BLOCK=32, num_warps=4)
    assert len(triton_calls) == 1 and not compiled.direct_calls
    launch_kernel(kernel, (5, 2), x, 100, 0.25, BLOCK=32, num_warps=4)
    assert len(triton_calls) == 1
    (call,) = compiled.direct_calls
    # grid padded to 3-D, the current stream, the handles, no launch metadata or hooks, then
    # every parameter in signature order, constexprs included (FLAG from its default).
    assert call[:9] == (5, 2, 1, 1234, "function-handle", "packed-metadata", None, None, None)
    assert call[9] is x and call[10:] == (100, 0.25, 32, 7)


def test_cached_launch_keys(stand_in):
    kernel, compiled, triton_calls = stand_in
    x = torch.zeros(64)
    launch_kernel(kernel, (1,), x, 96, 0.5, BLOCK=32, num_warps=4)
    launch_kernel(kernel, (1,), x, 96, 0.5, BLOCK=64, num_warps=4)  # another constexpr
    launch_kernel(kernel, (1,), x, 96, 0.5, BLOCK=32, num_warps=8)  # another option
    launch_kernel(kernel, (1,), x, 100, 0.5, BLOCK=32, num_warps=4)  # 100 is not a multiple of 16
    launch_kernel(kernel, (1,), x[1:], 96, 0.5, BLOCK=32, num_warps=4)  # misaligned pointer
    launch_kernel(kernel, (1,), x.double(), 100, 0.5, BLOCK=32, num_warps=4)  # another dtype
    assert len(triton_calls) == 6 and not compiled.direct_calls
    launch_kernel(kernel, (1,), x, 112, -1.0, BLOCK=32, num_warps=4)  # same properties as the first
    assert len(triton_calls) == 6 and len(compiled.direct_calls) == 1
    launch_kernel(kernel, (1,), x, 112, -1.0, BLOCK=32, num_warps=4, FLAG=7)  # explicit default: own key
    assert len(triton_calls) == 7


def test_cached_launch_defers_to_triton(stand_in, monkeypatch):
    kernel, compiled, triton_calls = stand_in
    x = torch.zeros(64)
    launch_kernel(kernel, (1,), x, 96, 0.5, BLOCK=32)
    monkeypatch.setattr(cached_launch, "_launch_hooks_set", lambda: True)  # a profiler hook installed
    launch_kernel(kernel, (1,), x, 96, 0.5, BLOCK=32)
    assert len(triton_calls) == 2 and not compiled.direct_calls
    monkeypatch.setattr(cached_launch, "_launch_hooks_set", lambda: False)
    for _ in range(2):  # an argument kind without a key (a string) is never cached
        launch_kernel(kernel, (1,), x, "text", 0.5, BLOCK=32)
    launch_kernel(kernel, (1,), x, 96, 0.5, BLOCK=32)
    assert len(triton_calls) == 4 and len(compiled.direct_calls) == 1


def test_next_power_of_2_matches_triton():
    import triton

    from liger_kernel.ops.launch import next_power_of_2

    for n in [*range(0, 300), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(max(n, 1)), n


_FAKE_CPU_TENSORS_WITHOUT_INTERPRETER = """
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from liger_kernel.ops.launch import is_interpreter
from liger_kernel.ops.layer_norm import LigerLayerNormFunction
from liger_kernel.ops.rms_norm import LigerRMSNormFunction

assert not is_interpreter() and not torch.cuda.is_available()
with FakeTensorMode():
    x = torch.empty(4, 7, 33, dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.empty(33, requires_grad=True), torch.empty(33, requires_grad=True)
    for y in (LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", True),
              LigerLayerNormFunction.apply(x, w, b, 1e-6, True)):
        y.sum().backward()
        assert isinstance(y, FakeTensor) and y.device.type == "cpu" and y.shape == x.shape
try:
    LigerRMSNormFunction.apply(torch.randn(2, 33), torch.randn(33), 1e-6, 0.0, "llama", True)
except ValueError as error:
    assert "X is on cpu" in str(error), error
else:
    raise AssertionError("a real CPU tensor was accepted without the interpreter")
"""


def test_fake_tensors_of_any_device_trace_where_kernels_need_cuda():
    """Where the kernels are compiled for CUDA (no interpreter), fake tensors a caller made on
    CPU (``FakeTensorMode``, ``torch.export``) still trace: they only describe shapes and
    never reach a kernel. Real CPU tensors are still refused. Run in a subprocess without
    ``TRITON_INTERPRET`` and without CUDA, as on a GPU machine."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _FAKE_CPU_TENSORS_WITHOUT_INTERPRETER], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
