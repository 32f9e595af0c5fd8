"""LigerSiLUMulFunction (and the gated-activation kernels it shares with GeGLU) against float64.

Reference: ``silu(a) * b`` in float64 on the same (rounded) inputs, differentiated by autograd;
``hf_swiglu`` is Hugging Face's ``act_fn(gate) * up`` computed in the input dtype.

Tolerances: fp32 outputs and gradients are one fp32 rounding (plus the kernel's ~1e-7
sigmoid error) from float64, so the default fp32 tolerance (1e-5) holds. In bf16/fp16 the
kernel rounds each output once (unit roundoff 2**-8 / 2**-11), so ``tolerance(dtype)`` (about
two output ulps) holds, and over many elements our norm-wise distance to float64 must not
exceed HF's own (which rounds the activation and the product separately).
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from liger_kernel.ops.swiglu import LigerSiLUMulFunction
from tests.utils import DEVICE, ReplayedDropout, assert_close, rel_error, shapes

# Full leading shapes (..., I): one row, a ragged number of rows, a 3-D input, a hidden size
# that spans two column tiles (GatedActivationConfig.MAX_BLOCK_COLS = 1024) with a ragged second one.
SHAPES = shapes(
    small=[(1, 1), (3, 1), (37, 1), (1, 123), (3, 123), (37, 123), (2, 3, 37), (3, 1100)],
    full=[(rows, hidden) for rows in (1, 3, 1007) for hidden in (1, 123, 4231)] + [(4, 512, 14336)],
)
LOW_PRECISION = [torch.bfloat16, torch.float16]


def exact_swiglu(a, b):
    return F.silu(a) * b


def hf_swiglu(a, b):
    return F.silu(a) * b  # LlamaMLP: self.act_fn(self.gate_proj(x)) * self.up_proj(x), in the input dtype


def gated_run(fn, a, b, dh, *args):
    """(h, da, db) of ``fn(a, b, *args)`` on leaf copies of a and b, upstream gradient dh."""
    a = a.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True)
    h = fn(a, b, *args)
    h.backward(dh)
    return h.detach(), a.grad, b.grad


def gated_reference(exact_fn, a, b, dh):
    """(h, da, db) in float64 on the given (already rounded) inputs."""
    return gated_run(exact_fn, a.double(), b.double(), dh.double())


def make_inputs(shape, dtype, scale=2.0):
    a = torch.randn(shape, device=DEVICE, dtype=torch.float32) * scale
    b = torch.randn(shape, device=DEVICE, dtype=torch.float32)
    dh = torch.randn(shape, device=DEVICE, dtype=torch.float32)
    return a.to(dtype), b.to(dtype), dh.to(dtype)


def check_against_reference(function, exact_fn, hf_fn, shape, dtype, in_place=False):
    a, b, dh = make_inputs(shape, dtype)
    got = gated_run(function.apply, a, b, dh, in_place)
    want = gated_reference(exact_fn, a, b, dh)
    for name, x, y in zip(("h", "da", "db"), got, want):
        assert x.dtype == dtype and x.shape == torch.Size(shape), name
        assert_close(x, y, dtype=dtype, msg=name)
    if dtype != torch.float32 and a.numel() >= 1000:
        hf = gated_run(hf_fn, a, b, dh)
        for name, x, h, y in zip(("h", "da", "db"), got, hf, want):
            assert rel_error(x, y) <= rel_error(h, y) * 1.05 + 1e-7, f"{name}: further from float64 than HF"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64(shape, dtype):
    check_against_reference(LigerSiLUMulFunction, exact_swiglu, hf_swiglu, shape, dtype)


@pytest.mark.parametrize("shape", shapes(small=[(37, 123)], full=[(1007, 4231)]))
def test_fp16(shape):
    check_against_reference(LigerSiLUMulFunction, exact_swiglu, hf_swiglu, shape, torch.float16)


def test_saturated_inputs_have_exact_limits():
    # silu(x) -> x for x -> +inf and -> 0 for x -> -inf; so do the gradients (1 and 0).
    a = torch.tensor([-1e4, -100.0, -30.0, 0.0, 30.0, 100.0, 1e4], device=DEVICE)
    b = torch.full_like(a, 3.0)
    got = gated_run(LigerSiLUMulFunction.apply, a, b, torch.ones_like(a))
    want = gated_reference(exact_swiglu, a, b, torch.ones_like(a))
    for x, y in zip(got, want):
        assert torch.isfinite(x).all()
        assert_close(x, y, dtype=torch.float32)


def fused_halves(lead, hidden, dtype, requires_grad=False):
    """The gate/up halves of a fused (…, 2I) projection output, as ``Phi3MLP`` chunks it."""
    fused = torch.randn(*lead, 2 * hidden, device=DEVICE, dtype=torch.float32).to(dtype)
    fused.requires_grad_(requires_grad)
    return fused, fused.chunk(2, dim=-1)


@pytest.mark.parametrize("lead,hidden", shapes(small=[((3,), 5), ((2, 7), 123)], full=[((4, 1007), 4231)]))
def test_strided_halves_of_a_fused_projection(lead, hidden):
    fused, (a, b) = fused_halves(lead, hidden, torch.bfloat16, requires_grad=True)
    assert not a.is_contiguous()
    h = LigerSiLUMulFunction.apply(a, b)
    dh = torch.randn_like(h)
    h.backward(dh)
    ref_fused = fused.detach().double().requires_grad_(True)
    ra, rb = ref_fused.chunk(2, dim=-1)
    ref = exact_swiglu(ra, rb)
    ref.backward(dh.double())
    assert_close(h, ref, dtype=torch.bfloat16)
    assert_close(fused.grad, ref_fused.grad, dtype=torch.bfloat16)


def _temporaries(shape, dtype):
    """Leaves x, y and non-leaf temporaries a = x * 1, b = y * 1 (like projection outputs)."""
    x = torch.randn(shape, device=DEVICE, dtype=torch.float32).to(dtype).requires_grad_(True)
    y = torch.randn(shape, device=DEVICE, dtype=torch.float32).to(dtype).requires_grad_(True)
    return x, y, x * 1, y * 1


def record_gradient_memory(*tensors):
    """For each non-leaf tensor: a dict that gets its data pointer now and, during backward, the
    data pointer of the gradient its producer receives for it. Keeps no reference to the tensors
    (holding one is what makes the in-place backward refuse), so ``grad_ptr == ptr`` shows that
    the gradient was written over the activation itself."""
    records = []
    for t in tensors:
        record = {"ptr": t.data_ptr()}
        index = t.output_nr

        def prehook(grad_outputs, record=record, index=index):
            record["grad_ptr"] = grad_outputs[index].data_ptr()

        t.grad_fn.register_prehook(prehook)
        records.append(record)
    return records


def wrote_in_place(records):
    return [r["grad_ptr"] == r["ptr"] for r in records]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_backward_writes_into_the_temporaries(dtype):
    shape = (3, 37)
    x, y, a, b = _temporaries(shape, dtype)
    dh = torch.randn(shape, device=DEVICE, dtype=dtype)
    records = record_gradient_memory(a, b)
    h = LigerSiLUMulFunction.apply(a, b, True)
    del a, b  # nobody but the graph holds them: the backward may write into them
    h.backward(dh)
    # The gradients live in a's and b's memory (no new buffers) ...
    assert wrote_in_place(records) == [True, True]
    # ... and are exact (same kernel as the fresh-output path).
    _, da, db = gated_run(LigerSiLUMulFunction.apply, x, y, dh, False)
    assert torch.equal(x.grad, da) and torch.equal(y.grad, db)


def test_in_place_backward_into_fused_halves():
    fused_leaf, _ = fused_halves((2, 5), 37, torch.float32, requires_grad=True)
    a, b = (fused_leaf * 1).chunk(2, dim=-1)
    records = record_gradient_memory(a, b)
    dh = torch.randn(2, 5, 37, device=DEVICE)
    h = LigerSiLUMulFunction.apply(a, b, True)
    del a, b
    h.backward(dh)
    assert wrote_in_place(records) == [True, True]  # both halves were overwritten in place
    ref_leaf = fused_leaf.detach().clone().requires_grad_(True)
    LigerSiLUMulFunction.apply(*ref_leaf.chunk(2, dim=-1)).backward(dh)
    assert torch.equal(fused_leaf.grad, ref_leaf.grad)


KEEPERS = {
    "tensor": lambda t: t,
    "detach": lambda t: t.detach(),
    "data": lambda t: t.data,
}


def check_kept_activation_survives(function, exact_fn, keep, fused):
    """A user who kept the gate (or the fused gate/up output), itself or a detached alias, and
    called the Function without ``in_place`` (the default: no promise that nothing else reads
    them) finds its values unchanged after backward (fresh gradients), and the gradients are right."""
    x = torch.randn(3, 2 * 37 if fused else 37, device=DEVICE, requires_grad=True)
    y = torch.randn(3, 37, device=DEVICE, requires_grad=True)
    dh = torch.randn(3, 37, device=DEVICE)
    if fused:
        whole = x * 1
        kept = KEEPERS[keep](whole)
        a, b = whole.chunk(2, dim=-1)
        del whole
    else:
        a, b = x * 1, y * 1
        kept = KEEPERS[keep](a)
    before = kept.detach().clone()
    records = record_gradient_memory(a, b)
    h = function.apply(a, b)
    del a, b
    h.backward(dh)
    assert torch.equal(kept, before)
    assert wrote_in_place(records) == [False, False]
    ref_x = x.detach().double().requires_grad_(True)
    ref_y = y.detach().double().requires_grad_(True)
    exact_fn(*(ref_x.chunk(2, dim=-1) if fused else (ref_x, ref_y))).backward(dh.double())
    assert_close(x.grad, ref_x.grad)
    if not fused:
        assert_close(y.grad, ref_y.grad)


@pytest.mark.parametrize("keep", list(KEEPERS))
@pytest.mark.parametrize("fused", [False, True])
def test_in_place_keeps_an_activation_someone_holds(keep, fused):
    check_kept_activation_survives(LigerSiLUMulFunction, exact_swiglu, keep, fused)


def test_in_place_falls_back_when_unsafe():
    shape = (4, 33)
    dh = torch.randn(shape, device=DEVICE)
    # Leaves (user tensors) are never overwritten.
    a = torch.randn(shape, device=DEVICE, requires_grad=True)
    b = torch.randn(shape, device=DEVICE, requires_grad=True)
    a0, b0 = a.detach().clone(), b.detach().clone()
    LigerSiLUMulFunction.apply(a, b, True).backward(dh)
    assert torch.equal(a.detach(), a0) and torch.equal(b.detach(), b0)
    want = gated_reference(exact_swiglu, a0, b0, dh)
    assert_close(a.grad, want[1])
    assert_close(b.grad, want[2])
    # One temporary used as both inputs: writing da and db over it would clobber it.
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    t = x * 1
    LigerSiLUMulFunction.apply(t, t, True).backward(dh)
    ref_x = x.detach().double().requires_grad_(True)
    exact_swiglu(ref_x, ref_x).backward(dh.double())
    assert_close(x.grad, ref_x.grad)
    # An expanded (self-overlapping) temporary.
    row = torch.randn(1, 33, device=DEVICE, requires_grad=True)
    e = (row * 1).expand(4, 33)
    y = torch.randn(shape, device=DEVICE, requires_grad=True)
    LigerSiLUMulFunction.apply(e, y * 1, True).backward(dh)
    ref_row = row.detach().double().requires_grad_(True)
    exact_swiglu(ref_row.expand(4, 33), y.detach().double()).backward(dh.double())
    assert_close(row.grad, ref_row.grad)


def halves_of_a_user_tensor(rows, inter, how, requires_grad=True):
    """A user's leaf x (rows, 2 * inter) and two views of it, a and b: not leaves themselves
    (when x requires grad), but writing into them writes into x."""
    x = torch.randn(rows, 2 * inter, device=DEVICE, requires_grad=requires_grad)
    if how == "slices":
        a, b = x[:, :inter], x[:, inter:]
    else:  # views of a view of x
        a, b = x.view(rows, 2, inter).unbind(1)
    return x, a, b


def check_in_place_leaves_user_tensor(function, exact, rows, inter, how):
    """a and b viewing a user's tensor x pass the leaf test themselves; with ``in_place=True``
    x must keep its values (da/db go to fresh buffers) and get the right gradient."""
    x, a, b = halves_of_a_user_tensor(rows, inter, how)
    assert not a.is_leaf and not b.is_leaf
    kept = x.detach().clone()
    dh = torch.randn(rows, inter, device=DEVICE)
    function.apply(a, b, True).backward(dh)
    assert torch.equal(x.detach(), kept)
    ref = kept.double().requires_grad_(True)
    exact(ref[:, :inter], ref[:, inter:]).backward(dh.double())
    assert_close(x.grad, ref.grad)


@pytest.mark.parametrize("how", ["slices", "unbind_of_view"])
def test_in_place_never_writes_into_views_of_a_leaf(how):
    check_in_place_leaves_user_tensor(LigerSiLUMulFunction, exact_swiglu, 4, 33, how)


def test_in_place_backward_twice_fails_loudly():
    _, _, a, b = _temporaries((3, 8), torch.float32)
    h = LigerSiLUMulFunction.apply(a, b, True)
    del a, b
    h.backward(torch.ones_like(h), retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.backward(torch.ones_like(h))


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 0, 7)])
def test_empty(shape):
    a = torch.randn(shape, device=DEVICE, requires_grad=True)
    b = torch.randn(shape, device=DEVICE, requires_grad=True)
    h = LigerSiLUMulFunction.apply(a, b)
    assert h.shape == torch.Size(shape)
    h.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


def test_bad_arguments():
    a = torch.randn(3, 4, device=DEVICE)
    with pytest.raises(ValueError, match="same shape"):
        LigerSiLUMulFunction.apply(a, torch.randn(3, 5, device=DEVICE))
    with pytest.raises(TypeError, match="same dtype"):
        LigerSiLUMulFunction.apply(a, a.half())
    with pytest.raises(TypeError, match="dtype"):
        LigerSiLUMulFunction.apply(a.long(), a.long())
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        LigerSiLUMulFunction.apply(a, [1.0])
    with pytest.raises(ValueError, match="device"):
        LigerSiLUMulFunction.apply(a, torch.randn(3, 4, device="meta"))
    with pytest.raises(TypeError, match="in_place"):
        LigerSiLUMulFunction.apply(a, a, "yes")


@settings(max_examples=12, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    hidden=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fused=st.booleans(),
    in_place=st.booleans(),
)
def test_property_random_shapes(lead, hidden, dtype, fused, in_place):
    shape = (*lead, hidden)
    if fused:
        leaf, _ = fused_halves(lead, hidden, dtype, requires_grad=True)
    else:
        leaf = torch.randn(2, *lead, hidden, device=DEVICE).to(dtype).requires_grad_(True)
    source = leaf * 1  # a temporary, so in_place may really write into it
    a, b = source.chunk(2, dim=-1) if fused else source.unbind(0)
    dh = torch.randn(shape, device=DEVICE).to(dtype)
    h = LigerSiLUMulFunction.apply(a, b, in_place)
    h.backward(dh)
    ref_leaf = leaf.detach().double().requires_grad_(True)
    ra, rb = ref_leaf.chunk(2, dim=-1) if fused else ref_leaf.unbind(0)
    exact_swiglu(ra, rb).backward(dh.double())
    assert_close(h, exact_swiglu(ra, rb), dtype=dtype)
    assert_close(leaf.grad, ref_leaf.grad, dtype=dtype)


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    a, b, dh = make_inputs((5, 37), torch.float32)

    def fn(a, b):
        return LigerSiLUMulFunction.apply(a * 1, b * 1, True) * 2

    eager = gated_run(fn, a, b, dh)
    compiled = gated_run(torch.compile(fn, fullgraph=True), a, b, dh)
    for x, y in zip(compiled, eager):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


# ---- LigerGatedDownProjFunction: activation and down projection without saving h ----

from liger_kernel.ops import geglu as _geglu_ops  # noqa: E402  (registers GELU_TANH)
from liger_kernel.ops.swiglu import GELU_TANH, SILU, LigerGatedDownProjFunction  # noqa: E402

_ACTIVATIONS = {SILU: F.silu, GELU_TANH: lambda x: F.gelu(x, approximate="tanh")}
_GATED_FUNCTIONS = {SILU: LigerSiLUMulFunction, GELU_TANH: _geglu_ops.LigerGELUMulFunction}


def _down_proj_leaves(lead, inter, out, dtype, bias):
    torch.manual_seed(len(lead) * 1000 + inter)
    a = (torch.randn(*lead, inter, device=DEVICE) * 2).to(dtype)
    b = torch.randn(*lead, inter, device=DEVICE).to(dtype)
    w = (torch.randn(out, inter, device=DEVICE) / inter**0.5).to(dtype)
    bb = torch.randn(out, device=DEVICE).to(dtype) if bias else None
    dy = torch.randn(*lead, out, device=DEVICE).to(dtype)
    return a, b, w, bb, dy


def _run_down_proj(fn, a, b, w, bb, dy):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (a, b, w, bb)]
    # a and b as non-leaf temporaries nobody else holds (as in an MLP), so the in-place path can engage.
    y = fn(leaves[0] * 1, leaves[1] * 1, leaves[2], leaves[3])
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("activation", [SILU, GELU_TANH])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead,inter,out", shapes(small=[((3,), 37, 5), ((2, 7), 123, 17)],
                                                 full=[((3,), 37, 5), ((2, 1007), 4231, 123)]))
def test_gated_down_proj_matches_unfused(activation, in_place, bias, lead, inter, out):
    """Same y and gradients as the gating Function followed by F.linear (which saves h):
    h is recomputed with the forward's own rounding, and the matmuls are the ones autograd
    runs. fp32, compared to float64 too: da/db (the kernel's) elementwise; y, dW, dbias
    (fp32 GEMMs and sums over up to 2014 rows, where entries near zero carry the cancellation
    of the whole reduction) norm-wise."""
    a, b, w, bb, dy = _down_proj_leaves(lead, inter, out, torch.float32, bias)
    gated = _GATED_FUNCTIONS[activation]
    fused = _run_down_proj(lambda a, b, w, bb: LigerGatedDownProjFunction.apply(a, b, w, bb, activation, in_place),
                           a, b, w, bb, dy)
    unfused = _run_down_proj(lambda a, b, w, bb: F.linear(gated.apply(a, b, in_place), w, bb), a, b, w, bb, dy)
    exact = _run_down_proj(lambda a, b, w, bb: F.linear(_ACTIVATIONS[activation](a) * b, w, bb),
                           *(t.double() if t is not None else None for t in (a, b, w, bb, dy)))
    for name, x, y, z in zip(("y", "da", "db", "dw", "dbias"), fused, unfused, exact):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=name)
        if name in ("da", "db"):
            assert_close(x, z.float(), dtype=torch.float32, msg=name)
        else:
            assert rel_error(x, z) <= 1e-5, f"{name}: norm-wise error {rel_error(x, z):.2e}"


@pytest.mark.parametrize("activation", [SILU, GELU_TANH])
def test_gated_down_proj_bf16_matches_unfused_exactly(activation):
    """bf16: the recomputed h is bitwise the forward's, so dW equals the unfused path's dW."""
    a, b, w, bb, dy = _down_proj_leaves((4, 33), 300, 64, torch.bfloat16, bias=True)
    gated = _GATED_FUNCTIONS[activation]
    fused = _run_down_proj(lambda a, b, w, bb: LigerGatedDownProjFunction.apply(a, b, w, bb, activation, True),
                           a, b, w, bb, dy)
    unfused = _run_down_proj(lambda a, b, w, bb: F.linear(gated.apply(a, b, True), w, bb), a, b, w, bb, dy)
    for name, x, y in zip(("y", "da", "db", "dw", "dbias"), fused, unfused):
        assert x.dtype == torch.bfloat16, name
        assert torch.equal(x, y), f"{name}: max diff {(x.float() - y.float()).abs().max()}"


def test_backward_recompute_writes_the_forward_h():
    a, b, _ = make_inputs((37, 300), torch.bfloat16)
    from liger_kernel.ops.swiglu import SWIGLU_OPS

    h = SWIGLU_OPS.forward(a, b)
    dh = torch.randn_like(h)
    da, db = SWIGLU_OPS.backward(dh, a, b)
    da2, db2 = SWIGLU_OPS.backward_recompute(dh, a, b)
    assert torch.equal(dh, h)
    assert torch.equal(da, da2) and torch.equal(db, db2)


def test_gated_down_proj_saves_only_a_b_and_the_weight():
    """The point of the Function: h (N, I) is not among the saved tensors."""
    a, b, w, _, _ = _down_proj_leaves((64,), 256, 32, torch.float32, bias=False)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    def unfused(a, b, w):
        return F.linear(LigerSiLUMulFunction.apply(a, b), w)

    def fused(a, b, w):
        return LigerGatedDownProjFunction.apply(a, b, w, None, SILU, False)

    sizes = {}
    for name, fn in (("unfused", unfused), ("fused", fused)):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(a * 1, b.clone().requires_grad_(True), w.clone().requires_grad_(True))
        sizes[name] = sum(saved)
    assert sizes["unfused"] - sizes["fused"] == a.numel()


def test_gated_down_proj_frozen_weight_and_autocast():
    a, b, w, bb, dy = _down_proj_leaves((5,), 40, 7, torch.float32, bias=True)
    a1 = a.clone().requires_grad_(True)
    w1 = w.clone()  # frozen: no weight gradient is computed
    y = LigerGatedDownProjFunction.apply(a1 * 1, b, w1, None, SILU, True)
    y.backward(dy)
    torch.testing.assert_close(a1.grad, _run_down_proj(
        lambda a, b, w, bb: F.linear(LigerSiLUMulFunction.apply(a, b), w), a, b, w, None, dy)[1])
    # Autocast (fp32 weights, low-precision compute) follows F.linear's casting both ways.
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    results = []
    for fn in (lambda a, b, w, bb: LigerGatedDownProjFunction.apply(a, b, w, bb, SILU, False),
               lambda a, b, w, bb: F.linear(LigerSiLUMulFunction.apply(a, b), w, bb)):
        wl, bl = w.clone().requires_grad_(True), bb.clone().requires_grad_(True)
        with torch.autocast(device_type, dtype=torch.bfloat16):
            y = fn(a16, b16, wl, bl)
        y.float().backward(dy)
        results.append((y, wl.grad, bl.grad))
    for name, x, ref in zip(("y", "dw", "dbias"), *results):
        assert x.dtype == ref.dtype, name
        torch.testing.assert_close(x, ref, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("how, requires_grad", [("slices", True), ("unbind_of_view", True), ("slices", False)])
def test_gated_down_proj_in_place_never_writes_into_views_of_a_leaf(how, requires_grad):
    """As for the gating alone; also with x not requiring grad (a and b are then leaves
    themselves, and only the weight's gradient is asked for)."""
    x, a, b = halves_of_a_user_tensor(4, 33, how, requires_grad)
    kept = x.detach().clone()
    w = torch.randn(5, 33, device=DEVICE, requires_grad=True)
    dy = torch.randn(4, 5, device=DEVICE)
    LigerGatedDownProjFunction.apply(a, b, w, None, SILU, True).backward(dy)
    assert torch.equal(x.detach(), kept)
    ref = kept.double().requires_grad_(requires_grad)
    ref_w = w.detach().double().requires_grad_(True)
    F.linear(F.silu(ref[:, :33]) * ref[:, 33:], ref_w).backward(dy.double())
    assert_close(w.grad, ref_w.grad)
    if requires_grad:
        assert_close(x.grad, ref.grad)


def test_gated_down_proj_bad_arguments():
    a, b, w, _, _ = _down_proj_leaves((3,), 8, 4, torch.float32, bias=False)
    with pytest.raises(ValueError, match="weight"):
        LigerGatedDownProjFunction.apply(a, b, w.t(), None, SILU, False)
    with pytest.raises(ValueError, match="bias"):
        LigerGatedDownProjFunction.apply(a, b, w, torch.zeros(5, device=DEVICE), SILU, False)
    with pytest.raises(ValueError, match="activation"):
        LigerGatedDownProjFunction.apply(a, b, w, None, 7, False)
    with pytest.raises(ValueError, match="shape"):
        LigerGatedDownProjFunction.apply(a, b[:, :4], w, None, SILU, False)


# ---- Outputs as ordinary tensors, meta inputs, launch configurations ----

from liger_kernel.ops.config import override_launch_config  # noqa: E402
from liger_kernel.ops.swiglu import GatedActivationConfig  # noqa: E402


@pytest.mark.parametrize("activation", [SILU, GELU_TANH])
@pytest.mark.parametrize("edit", ["mul_", "dropout"])
def test_output_may_be_edited_in_place(activation, edit):
    """h is an ordinary tensor, not a view of a private buffer: ``h.mul_(2)`` and
    ``F.dropout(h, inplace=True)`` work forward and backward with the reference's values."""
    a, b, dh = make_inputs((3, 2, 37), torch.float32)

    dropout = ReplayedDropout()  # F.dropout(inplace=True) on ours, its mask replayed on the reference

    def edited(fn):
        def run(a, b):
            h = fn(a, b)
            if edit == "mul_":
                return h.mul_(2.0)
            return dropout(h)

        return run

    got = gated_run(edited(_GATED_FUNCTIONS[activation].apply), a, b, dh)
    want = gated_run(edited(lambda a, b: _ACTIVATIONS[activation](a) * b), a.double(), b.double(), dh.double())
    for x, y in zip(got, want):
        assert_close(x, y.float(), dtype=torch.float32)


@pytest.mark.parametrize("activation", [SILU, GELU_TANH])
@pytest.mark.parametrize("fused_down", [False, True])
def test_meta_inputs_give_meta_outputs(activation, fused_down):
    a = torch.empty(2, 3, 37, device="meta", dtype=torch.bfloat16, requires_grad=True)
    b = torch.empty(2, 3, 37, device="meta", dtype=torch.bfloat16, requires_grad=True)
    if fused_down:
        w = torch.empty(5, 37, device="meta", dtype=torch.bfloat16, requires_grad=True)
        out = LigerGatedDownProjFunction.apply(a * 1, b * 1, w, None, activation, True)
        assert out.is_meta and out.shape == (2, 3, 5) and out.dtype == torch.bfloat16
    else:
        out = _GATED_FUNCTIONS[activation].apply(a * 1, b * 1, True)
        assert out.is_meta and out.shape == a.shape and out.dtype == torch.bfloat16
    out.sum().backward()
    assert a.grad.is_meta and a.grad.shape == a.shape and b.grad.shape == b.shape


def test_launch_config_override_changes_the_geometry_not_the_result():
    """An override of GatedActivationConfig reaches the launch (two column tiles instead of
    one) and the results are the heuristic's, bit for bit."""
    from liger_kernel.ops.swiglu import _launch_geometry

    default, _ = _launch_geometry(64, 1000)
    assert default == GatedActivationConfig.heuristic(64, 1000) and default.block_cols == 1024
    a, b, dh = make_inputs((6, 1000), torch.float32)
    want = gated_run(LigerSiLUMulFunction.apply, a, b, dh)
    with override_launch_config(GatedActivationConfig, block_cols=256, block_rows=2):
        narrow, n_tiles = _launch_geometry(64, 1000)
        assert (narrow.block_rows, narrow.block_cols, n_tiles) == (2, 256, 32 * 4)
        got = gated_run(LigerSiLUMulFunction.apply, a, b, dh)
    assert _launch_geometry(64, 1000)[0] == default  # the override ends with the block
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_gated_config_heuristic_and_search_space():
    # Tiles of 4096 elements with column blocks up to 1024: 4 rows of a 1000-wide problem.
    config = GatedActivationConfig.heuristic(4096, 1000)
    assert (config.block_rows, config.block_cols) == (4, 1024)
    assert GatedActivationConfig.heuristic(4096, 1000) is config  # memoised per shape
    assert GatedActivationConfig.heuristic(2, 14336).block_rows == 2  # never more rows than the problem
    space = GatedActivationConfig.search_space(4096, 14336)
    assert config in GatedActivationConfig.search_space(4096, 1000) and len(set(space)) == len(space) > 1
    with pytest.raises(ValueError, match="power of two"):
        GatedActivationConfig(3, 256, 4)


def _record_in_place_decisions(monkeypatch):
    """The in-place decisions of the gated backwards, in call order."""
    import liger_kernel.ops.swiglu as swiglu_ops

    decisions = []
    unpack = swiglu_ops._unpack_saved

    def recording(ctx):
        saved, in_place = unpack(ctx)
        decisions.append(in_place)
        return saved, in_place

    monkeypatch.setattr(swiglu_ops, "_unpack_saved", recording)
    return decisions


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_in_place_backward_under_activation_checkpointing(monkeypatch, use_reentrant):
    """Checkpointed layers (recomputed in backward) keep the saving: the recomputed activations
    are held by nobody else either."""
    from torch.utils.checkpoint import checkpoint

    decisions = _record_in_place_decisions(monkeypatch)
    x = torch.randn(4, 18, device=DEVICE, requires_grad=True)
    y = checkpoint(lambda x: LigerSiLUMulFunction.apply(*(x * 1).chunk(2, -1), True), x, use_reentrant=use_reentrant)
    y.sum().backward()
    assert decisions == [True]
    ref = x.detach().double().requires_grad_(True)
    exact_swiglu(*ref.chunk(2, -1)).sum().backward()
    assert_close(x.grad, ref.grad)
