"""LigerGELUMulFunction (``gelu_tanh(a) * b``) against float64.

GeGLU runs the same kernels as SwiGLU with ``ACTIVATION=GELU_TANH``; the layout, in-place
and error-path machinery is covered in test_swiglu.py, so this file checks the activation
math (forward and derivative, saturation), a strided case, in-place, the custom op and a
property test. Reference: torch's ``F.gelu(x, approximate="tanh")`` (= HF
``gelu_pytorch_tanh``) in float64; ``hf_geglu`` is GemmaMLP's ``act_fn(gate) * up`` in the
input dtype. Tolerances as in test_swiglu.py: fp32 at the default fp32 tolerance, bf16/fp16
at about two output ulps, and no further from float64 than HF's in-dtype computation.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from liger_kernel.ops.geglu import LigerGELUMulFunction
from tests.ops.test_swiglu import (
    KEEPERS,
    check_against_reference,
    check_in_place_leaves_user_tensor,
    check_kept_activation_survives,
    fused_halves,
    gated_reference,
    gated_run,
    make_inputs,
    record_gradient_memory,
    wrote_in_place,
)
from tests.utils import DEVICE, assert_close, shapes

SHAPES = shapes(
    small=[(1, 1), (3, 123), (37, 123), (2, 3, 37), (3, 1100)],
    full=[(rows, hidden) for rows in (1, 3, 1007) for hidden in (1, 123, 4231)] + [(4, 512, 14336)],
)


def exact_geglu(a, b):
    return F.gelu(a, approximate="tanh") * b


def hf_geglu(a, b):
    return F.gelu(a, approximate="tanh") * b  # GemmaMLP: act_fn(gate_proj(x)) * up_proj(x), in the input dtype


def test_reference_is_the_tanh_formula():
    # The float64 reference is the formula the issue names, 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))).
    x = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    formula = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    torch.testing.assert_close(F.gelu(x, approximate="tanh"), formula, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64(shape, dtype):
    check_against_reference(LigerGELUMulFunction, exact_geglu, hf_geglu, shape, dtype)


def test_fp16():
    check_against_reference(LigerGELUMulFunction, exact_geglu, hf_geglu, (37, 123), torch.float16)


def test_saturated_inputs_have_exact_limits():
    a = torch.tensor([-1e4, -100.0, -10.0, -3.0, 0.0, 3.0, 10.0, 100.0, 1e4], device=DEVICE)
    b = torch.full_like(a, -2.0)
    got = gated_run(LigerGELUMulFunction.apply, a, b, torch.ones_like(a))
    want = gated_reference(exact_geglu, a, b, torch.ones_like(a))
    for x, y in zip(got, want):
        assert torch.isfinite(x).all()
        assert_close(x, y, dtype=torch.float32)


def test_in_place_backward_into_fused_halves():
    fused_leaf, _ = fused_halves((3, 4), 21, torch.bfloat16, requires_grad=True)
    a, b = (fused_leaf * 1).chunk(2, dim=-1)
    records = record_gradient_memory(a, b)
    dh = torch.randn(3, 4, 21, device=DEVICE).bfloat16()
    h = LigerGELUMulFunction.apply(a, b, True)
    del a, b
    h.backward(dh)
    assert wrote_in_place(records) == [True, True]
    ref_leaf = fused_leaf.detach().double().requires_grad_(True)
    exact_geglu(*ref_leaf.chunk(2, dim=-1)).backward(dh.double())
    assert_close(fused_leaf.grad, ref_leaf.grad, dtype=torch.bfloat16)


@pytest.mark.parametrize("keep", list(KEEPERS))
def test_in_place_keeps_an_activation_someone_holds(keep):
    check_kept_activation_survives(LigerGELUMulFunction, exact_geglu, keep, fused=keep != "tensor")


def test_in_place_never_writes_into_views_of_a_leaf():
    check_in_place_leaves_user_tensor(LigerGELUMulFunction, exact_geglu, 3, 21, "slices")


def test_bad_arguments():
    a = torch.randn(2, 3, device=DEVICE)
    with pytest.raises(ValueError, match="same shape"):
        LigerGELUMulFunction.apply(a, a.t())
    with pytest.raises(TypeError, match="dtype"):
        LigerGELUMulFunction.apply(a.int(), a.int())


@settings(max_examples=12, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    hidden=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    scale=st.sampled_from([0.5, 3.0, 20.0]),
)
def test_property_random_shapes(lead, hidden, dtype, scale):
    a, b, dh = make_inputs((*lead, hidden), dtype, scale=scale)
    got = gated_run(LigerGELUMulFunction.apply, a, b, dh)
    want = gated_reference(exact_geglu, a, b, dh)
    for x, y in zip(got, want):
        assert_close(x, y, dtype=dtype)


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    a, b, dh = make_inputs((5, 37), torch.float32)

    def fn(a, b):
        return LigerGELUMulFunction.apply(a * 1, b * 1, True) * 2

    eager = gated_run(fn, a, b, dh)
    compiled = gated_run(torch.compile(fn, fullgraph=True), a, b, dh)
    for x, y in zip(compiled, eager):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
