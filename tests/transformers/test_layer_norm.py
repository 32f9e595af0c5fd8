"""LigerLayerNorm against ``torch.nn.LayerNorm`` (forward, dX, dW, dB) and its module API.

The comparison's reference is ``torch.nn.LayerNorm``'s math in float64 on the same inputs and
parameters: torch's own bf16 module on CPU sums dW and dB over the rows in bf16 (one element
of a 30-row dW lands at -0.125 where the float64 value is 0.0149), so it is no reference for
a kernel that accumulates in fp32. Tolerances: fp32 to fp32 tolerances (dx/dw/db scaled for
their reductions); bf16 to ~2 bf16 ulps. The kernel math is tested against float64 in tests/ops.
"""

import types

import pytest
import torch

from liger_kernel.transformers.layer_norm import LigerLayerNorm, liger_layer_norm
from tests.utils import (
    DEVICE,
    ReplayedDropout,
    assert_close,
    forward_backward_with_output_edit,
)

HIDDEN = 123


def forward_backward(module, x, dy):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad()
    y = module(x)
    # A copy: with in_place=True the backward writes dX over the incoming gradient.
    y.backward(dy.clone())
    bias_grad = module.bias.grad.clone() if module.bias is not None else None
    return y.detach(), x.grad, module.weight.grad.clone(), bias_grad


def paired(dtype, bias=True, eps=1e-5, hidden=HIDDEN):
    ref = torch.nn.LayerNorm(hidden, eps=eps, bias=bias).to(DEVICE, dtype)
    ours = LigerLayerNorm(hidden, eps=eps, bias=bias).to(DEVICE, dtype)
    with torch.no_grad():
        ref.weight.normal_(1.0, 0.5)
        ours.weight.copy_(ref.weight)
        if bias:
            ref.bias.normal_()
            ours.bias.copy_(ref.bias)
    return ours, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 7, HIDDEN), (3, 2, 5, 64)])
def test_matches_torch_layer_norm(dtype, bias, shape):
    ours, ref = paired(dtype, bias, hidden=shape[-1])
    x = torch.randn(shape, device=DEVICE, dtype=dtype) * 2 + 3
    dy = torch.randn(shape, device=DEVICE, dtype=dtype)
    got, in_dtype = forward_backward(ours, x, dy), forward_backward(ref, x, dy)
    expected = float64_forward_backward(ref, x, dy)
    n_rows = x.numel() // shape[-1]
    for name, a, t, e, scale in zip(("y", "dx", "dw", "db"), got, in_dtype, expected,
                                    (1, 4, n_rows ** 0.5, n_rows ** 0.5)):
        if e is None:
            assert a is None and t is None
            continue
        assert a.dtype == t.dtype == dtype
        assert_close(a, e.to(dtype), scale=max(scale, 1), msg=name)


def float64_forward_backward(module, x, dy):
    """``module``'s LayerNorm in float64 on ``x`` and ``dy``: (y, dx, dw, db), db None without bias."""
    x64 = x.detach().double().requires_grad_(True)
    weight = module.weight.detach().double().requires_grad_(True)
    bias = module.bias.detach().double().requires_grad_(True) if module.bias is not None else None
    y = torch.nn.functional.layer_norm(x64, module.normalized_shape, weight, bias, module.eps)
    y.backward(dy.double())
    return y.detach(), x64.grad, weight.grad, bias.grad if bias is not None else None


def test_module_attributes():
    norm = LigerLayerNorm(16, eps=1e-5)
    assert torch.equal(norm.weight, torch.ones(16)) and torch.equal(norm.bias, torch.zeros(16))
    assert norm.variance_epsilon == 1e-5 and norm.eps == 1e-5
    norm.eps = 1e-3
    assert norm.variance_epsilon == 1e-3
    assert "eps=0.001" in repr(norm)
    no_bias = LigerLayerNorm(16, bias=False)
    assert no_bias.bias is None and "bias=False" in repr(no_bias)
    assert [name for name, _ in no_bias.named_parameters()] == ["weight"]


def test_forward_bound_onto_torch_layer_norm():
    ref = torch.nn.LayerNorm(HIDDEN, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    x = torch.randn(4, HIDDEN, device=DEVICE)
    dy = torch.randn(4, HIDDEN, device=DEVICE)
    expected = forward_backward(ref, x, dy)
    ref.forward = types.MethodType(LigerLayerNorm.forward, ref)
    got = forward_backward(ref, x, dy)
    for name, a, e in zip(("y", "dx", "dw", "db"), got, expected):
        assert_close(a, e, scale=4, msg=name)


def test_functional_matches_module():
    ours, _ = paired(torch.float32)
    x = torch.randn(5, HIDDEN, device=DEVICE)
    assert torch.equal(liger_layer_norm(x, ours.weight, ours.bias, 1e-5), ours(x))


def test_torch_compile_fullgraph():
    ours, _ = paired(torch.float32, hidden=64)
    scale = torch.randn(2, 5, 64, device=DEVICE)

    def loss_fn(x):
        return (ours(x * 2.0) * scale).sum()

    x = torch.randn(2, 5, 64, device=DEVICE, requires_grad=True)
    params = [x, ours.weight, ours.bias]
    eager = loss_fn(x)
    eager_grads = torch.autograd.grad(eager, params)
    compiled = torch.compile(loss_fn, fullgraph=True)(x)
    compiled_grads = torch.autograd.grad(compiled, params)
    # Inductor reorders the surrounding fp32 sum; the norm itself is the same kernel.
    assert_close(compiled, eager, scale=10, msg="loss")
    for name, a, e in zip(("dx", "dw", "db"), compiled_grads, eager_grads):
        assert_close(a, e, scale=4, msg=name)


@pytest.mark.parametrize("in_place", [True, False])
def test_in_place_option(in_place):
    ours, ref = paired(torch.float32)
    ours.in_place = in_place
    x = torch.randn(5, HIDDEN, device=DEVICE, requires_grad=True)
    dy = torch.randn(5, HIDDEN, device=DEVICE)
    kept = dy.clone()
    seen = {}
    x.register_hook(lambda g: seen.update(dx=g.data_ptr()))
    y = ours(x)
    y.register_hook(lambda g: seen.update(dy=g.data_ptr()))
    # in_place=True reuses the storage of the gradient autograd hands the norm for dX (here the
    # one y * 1's backward makes, which nobody else reads: the promise holds).
    (y * 1).backward(dy)
    assert (seen["dx"] == seen["dy"]) == in_place
    assert torch.equal(dy, kept)
    assert not LigerLayerNorm(8).in_place and LigerLayerNorm(8, in_place=True).in_place


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("edit", ["hook", "dropout"])
def test_output_edited_in_place_like_torch(edit, in_place):
    """A forward hook that edits the norm's output in place (activation steering), or an
    in-place dropout after it: works forward and backward as with torch's module."""
    ours, ref = paired(torch.float32)
    ours.in_place = in_place
    steer = torch.randn(HIDDEN, device=DEVICE)
    x = torch.randn(2, 7, HIDDEN, device=DEVICE)
    dy = torch.randn(2, 7, HIDDEN, device=DEVICE)
    dropout = ReplayedDropout()
    results = [(*forward_backward_with_output_edit(m, x, dy, edit, steer, dropout), m.weight.grad, m.bias.grad)
               for m in (ours, ref)]
    for name, a, e in zip(("y", "dx", "dw", "db"), *results):
        assert_close(a, e, scale=4, msg=name)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_device_module(dtype, bias):
    """A module built on the meta device gives meta outputs and gradients of torch's shapes and dtypes."""
    with torch.device("meta"):
        ours = LigerLayerNorm(HIDDEN, bias=bias).to(dtype)
        ref = torch.nn.LayerNorm(HIDDEN, bias=bias).to(dtype)
    x = torch.empty(2, 5, HIDDEN, device="meta", dtype=dtype, requires_grad=True)
    y, y_ref = ours(x), ref(x)
    assert y.device.type == "meta" and y.shape == y_ref.shape and y.dtype == y_ref.dtype
    y.sum().backward()
    assert x.grad.device.type == "meta" and x.grad.shape == x.shape and x.grad.dtype == dtype
    for p in ours.parameters():
        assert p.grad.shape == p.shape and p.grad.dtype == dtype
