"""LigerLayerNormFunction against ``torch.nn.functional.layer_norm``.

fp32 inputs are compared with F.layer_norm in float64 (the truth) at fp32 tolerances,
and rows with a large common offset (mean 1000 * std), which would break a single-pass
E[x^2] - E[x]^2 variance, are held to torch's own fp32 accuracy. For bf16/fp16 the output is compared with
F.layer_norm in that dtype at ~2 output ulps, and our distance to the float64 truth
(output and all three gradients) must not exceed torch's own by more than 25%.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.layer_norm import LigerLayerNormFunction
from liger_kernel.ops.row_norm_geometry import RowNormConfig
from tests.utils import DEVICE, TOLERANCES, ReplayedDropout, assert_close, rel_error, shapes

# A row wider than the widest register tile, so the column-block loop runs on the CPU too.
WIDE = RowNormConfig().max_fused_block + 8
SHAPES = shapes(
    small=[(1, 1), (3, 1), (37, 1), (1, 123), (3, 123), (37, 123), (1, 1027), (3, 1027), (37, 1027),
           (2, WIDE)],
    full=[(1007, 1), (1, 4231), (3, 4231), (1007, 123), (1007, 4231), (64, 4096), (4, 65536), (3, 65536 + 7)],
)
EPS = 1e-5
ERROR_FACTOR = 1.25


def torch_layer_norm(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def liger(x, w, b, eps):
    return LigerLayerNormFunction.apply(x, w, b, eps)


def liger_out_of_place(x, w, b, eps):
    return LigerLayerNormFunction.apply(x, w, b, eps, False)


def run(fn, x, w, b, dy, eps=EPS):
    """(y, dx, dw, db) of ``fn(x, w, b, eps)`` with upstream gradient ``dy`` (db None without bias)."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True) if b is not None else None
    y = fn(x, w, b, eps)
    # Through an exact op (* 1), so the gradient reaching the norm is a buffer autograd
    # owns, as in a model, and the in-place backward does write into it (a tensor the
    # caller passes to backward() itself is never overwritten).
    (y * 1).backward(dy.to(y.dtype, copy=True))
    return y.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def make_inputs(n_rows, hidden, dtype, bias=True, shift=0.0):
    x = (torch.randn(n_rows, hidden, device=DEVICE) + shift).to(dtype)
    w = (torch.randn(hidden, device=DEVICE) * 0.5 + 1.0).to(dtype)
    b = torch.randn(hidden, device=DEVICE).to(dtype) if bias else None
    dy = torch.randn(n_rows, hidden, device=DEVICE)
    return x, w, b, dy


def double(t):
    return t.double() if t is not None else None


def check_fp32(ours, truth, n_rows, shift_scale=1.0, rstd_max=1.0, allowances=None):
    """fp32 results against float64 truth. ``allowances`` (one tensor or None per output,
    shaped like it) widen the bound per element, for rows whose conditioning no fp32 kernel
    can beat (see test_property)."""
    names = ("y", "dx", "dw", "db")
    # dx sums over a row, dw/db over all rows: fp32 error grows with the reduction length.
    # dx = r * (g - mean(g) - xhat * mean(g * xhat)) cancels O(|g|) terms, so its fp32 error
    # is ~ulp * r * |g|: rows with a tiny spread (large rstd r) get a proportionally wider bound.
    scales = [s * shift_scale for s in (1, 4 * max(1.0, rstd_max), max(4, n_rows ** 0.5), max(4, n_rows ** 0.5))]
    for name, a, t, scale, extra in zip(names, ours, truth, scales, allowances or (None,) * 4):
        if t is None:
            assert a is None
            continue
        if extra is not None:
            atol, rtol = (v * scale for v in TOLERANCES[torch.float32])
            excess = (a.double() - t).abs() - (atol + rtol * t.abs() + extra.double())
            assert bool((excess <= 0).all()), f"{name}: {int((excess > 0).sum())} elements off by up to {excess.max():.3e}"
            continue
        assert_close(a, t, dtype=torch.float32, scale=scale, msg=name)


@pytest.mark.parametrize("n_rows,hidden", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fn", [liger, liger_out_of_place], ids=["in_place", "out_of_place"])
def test_fp32_matches_float64(n_rows, hidden, bias, fn):
    x, w, b, dy = make_inputs(n_rows, hidden, torch.float32, bias)
    ours = run(fn, x, w, b, dy)
    truth = run(torch_layer_norm, x.double(), w.double(), double(b), dy.double())
    assert ours[0].dtype == torch.float32
    check_fp32(ours, truth, n_rows)


@pytest.mark.parametrize("n_rows,hidden", shapes(small=[(5, 123), (2, WIDE)],
                                                  full=[(64, 4231), (4, 65536)]))
def test_large_mean_is_stable(n_rows, hidden):
    """Rows with mean 1000x their spread: the variance must come from centred values.

    fp32 cannot represent the row mean to better than ~ulp(1000) = 6e-5, so even an ideal
    fp32 kernel is off by ~1e-5 relative here (torch's fp32 layer_norm is); a variance from
    E[x^2] - E[x]^2 would be off by ~3e-2. We ask for torch's fp32 accuracy (within 2x,
    the summation orders differ) or 1e-4, whichever is larger.
    """
    x, w, b, dy = make_inputs(n_rows, hidden, torch.float32, shift=1000.0)
    ours = run(liger, x, w, b, dy)
    ref = run(torch_layer_norm, x, w, b, dy)
    truth = run(torch_layer_norm, x.double(), w.double(), double(b), dy.double())
    for name, a, r, t in zip(("y", "dx", "dw", "db"), ours, ref, truth):
        ours_err, ref_err = rel_error(a, t), rel_error(r, t)
        assert ours_err <= max(2 * ref_err, 1e-4), f"{name}: error {ours_err:.3g} vs torch fp32's {ref_err:.3g}"


@pytest.mark.parametrize("n_rows,hidden", shapes(small=[(37, 123), (3, 1027), (2, WIDE)],
                                                  full=[(1007, 4231), (64, 4096)]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_low_precision_matches_torch(n_rows, hidden, dtype, bias):
    x, w, b, dy = make_inputs(n_rows, hidden, dtype, bias)
    ours = run(liger, x, w, b, dy)
    ref = run(torch_layer_norm, x, w, b, dy)
    truth = run(torch_layer_norm, x.double(), w.double(), double(b), dy.double())
    assert ours[0].dtype == dtype and ours[1].dtype == dtype and ours[2].dtype == dtype
    assert_close(ours[0], ref[0], dtype=dtype, msg="y vs torch")
    for name, a, r, t in zip(("y", "dx", "dw", "db"), ours, ref, truth):
        if t is None:
            continue
        ours_err, ref_err = rel_error(a, t), rel_error(r, t)
        assert ours_err <= ERROR_FACTOR * ref_err + 1e-6, f"{name}: error {ours_err:.3g} vs torch's {ref_err:.3g}"


def test_mixed_dtypes():
    """bf16 activations with fp32 weight and bias: output and dx in bf16, dw/db in fp32."""
    x, w, b, dy = make_inputs(7, 123, torch.float32)
    x = x.bfloat16()
    ours = run(liger, x, w, b, dy)
    truth = run(torch_layer_norm, x.double(), w.double(), b.double(), dy.bfloat16().double())
    assert [t.dtype for t in ours] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    assert_close(ours[0], truth[0], dtype=torch.bfloat16, msg="y")
    assert_close(ours[1], truth[1], dtype=torch.bfloat16, scale=2, msg="dx")
    # dw/db: fp32 sums of bf16-exact products; the inputs' own bf16 rounding cancels out here.
    assert_close(ours[2], truth[2], dtype=torch.float32, scale=4, msg="dw")
    assert_close(ours[3], truth[3], dtype=torch.float32, scale=4, msg="db")


@pytest.mark.parametrize("bias", [True, False])
def test_4d_non_contiguous(bias):
    b_, t, heads, head_dim = 2, 5, 3, 64
    x = torch.randn(b_, heads, t, head_dim, device=DEVICE).transpose(1, 2)
    assert not x.is_contiguous()
    w = torch.randn(head_dim, device=DEVICE)
    b = torch.randn(head_dim, device=DEVICE) if bias else None
    dy = torch.randn(b_, heads, t, head_dim, device=DEVICE).transpose(1, 2)
    ours = run(liger, x, w, b, dy)
    truth = run(torch_layer_norm, x.double(), w.double(), double(b), dy.double())
    assert ours[0].shape == x.shape and ours[1].shape == x.shape
    check_fp32(ours, truth, 30)


@pytest.mark.parametrize("n_rows,hidden", shapes(small=[(37, 123), (3, WIDE)],
                                                  full=[(4097, 4231), (33, 65536)]))
def test_grads_deterministic(n_rows, hidden):
    x, w, b, dy = make_inputs(n_rows, hidden, torch.bfloat16)
    first = run(liger, x, w, b, dy)
    second = run(liger, x, w, b, dy)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


@pytest.mark.parametrize("hidden", [1, 123, WIDE])
def test_constant_rows_are_finite(hidden):
    """Zero variance: rstd = 1/sqrt(eps), y = b, dx = (g - mean(g)) / sqrt(eps), dw = 0."""
    x = torch.full((3, hidden), 2.5, device=DEVICE)
    w = torch.randn(hidden, device=DEVICE)
    b = torch.randn(hidden, device=DEVICE)
    dy = torch.randn(3, hidden, device=DEVICE)
    y, dx, dw, db = run(liger, x, w, b, dy)
    assert_close(y, b.expand_as(y), msg="y")
    g = dy * w
    assert_close(dx, (g - g.mean(-1, keepdim=True)) / EPS ** 0.5, scale=4, msg="dx")
    assert torch.all(dw == 0)
    assert_close(db, dy.sum(0), msg="db")


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (0, WIDE)])
@pytest.mark.parametrize("bias", [True, False])
def test_empty_input(shape, bias):
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    w = torch.randn(shape[-1], device=DEVICE, requires_grad=True)
    b = torch.randn(shape[-1], device=DEVICE, requires_grad=True) if bias else None
    y = liger(x, w, b, EPS)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w))
    if bias:
        assert torch.equal(b.grad, torch.zeros_like(b))


X_OK = torch.randn(2, 8, device=DEVICE)
W_OK = torch.ones(8, device=DEVICE)
B_OK = torch.zeros(8, device=DEVICE)


@pytest.mark.parametrize("args,error,match", [
    ((X_OK, torch.ones(7, device=DEVICE), None, EPS), ValueError, "last dimension"),
    ((X_OK, W_OK, torch.zeros(7, device=DEVICE), EPS), ValueError, "B has shape"),
    ((X_OK, torch.ones(1, 8, device=DEVICE), B_OK, EPS), ValueError, "W must be 1-D"),
    ((X_OK.double(), W_OK, B_OK, EPS), TypeError, "X has dtype"),
    ((X_OK, W_OK, B_OK.int(), EPS), TypeError, "B has dtype"),
    ((X_OK, W_OK.half().int(), B_OK, EPS), TypeError, "W has dtype"),
    ((X_OK, "w", B_OK, EPS), TypeError, "W must be a torch.Tensor"),
    ((X_OK, W_OK, 0.0, EPS), TypeError, "B must be a torch.Tensor"),
    ((X_OK, W_OK, B_OK, None), TypeError, "eps"),
    ((X_OK, W_OK, B_OK, float("nan")), ValueError, "eps"),
])
def test_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        LigerLayerNormFunction.apply(*args)


def test_different_devices():
    if DEVICE != "cuda":
        pytest.skip("needs a CUDA device to put B elsewhere")
    with pytest.raises(ValueError, match="device"):
        LigerLayerNormFunction.apply(X_OK, W_OK, B_OK.cpu(), EPS)


@settings(max_examples=15, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    hidden=st.integers(2, 300),
    bias=st.booleans(),
    shift=st.sampled_from([0.0, 10.0, -100.0]),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_property(lead, hidden, bias, shift, eps, dtype):
    x = (torch.randn(*lead, hidden, device=DEVICE) + shift).to(dtype)
    w = torch.randn(hidden, device=DEVICE).to(dtype)
    b = torch.randn(hidden, device=DEVICE).to(dtype) if bias else None
    dy = torch.randn(*lead, hidden, device=DEVICE).to(dtype)
    ours = run(liger, x, w, b, dy, eps)
    truth = run(torch_layer_norm, x.double(), w.double(), double(b), dy.double(), eps)
    assert ours[0].shape == x.shape
    n_rows = x.numel() // hidden
    if dtype == torch.float32:
        # The fp32 row mean is only good to ~ulp(shift), which limits x - mean (see above).
        rstd_max = float((x.double().var(-1, unbiased=False) + eps).rsqrt().max())
        # The same ~ulp(|x|) error of x - mean is multiplied by rstd in xhat: a row whose
        # spread is near sqrt(eps) (two nearly equal values at hidden 2, say) has y, dx and dw
        # off by ~1e-4 to 1e-3 in any fp32 kernel, torch's included. Each output may also err
        # up to twice torch's fp32 error, element by element.
        torch_fp32 = run(torch_layer_norm, x, w, b, dy, eps)
        allowances = [None if r is None else 2 * (r.double() - t).abs() for r, t in zip(torch_fp32, truth)]
        check_fp32(ours, truth, n_rows, shift_scale=1 + abs(shift) / 10, rstd_max=rstd_max, allowances=allowances)
        return
    # Low precision: one rounding of y and dx (fp32 inside), dw/db rounded after an fp32 sum.
    for name, a, t, scale in zip(("y", "dx", "dw", "db"), ours, truth, (1, 2, 2, 2)):
        if t is not None:
            assert_close(a, t, dtype=dtype, scale=scale, msg=name)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("backward_tile", [1, 4096])
@pytest.mark.parametrize("n_rows,hidden", [(37, 123), (5, 1027), (3, WIDE)])
def test_backward_launch_variants(n_rows, hidden, prefetch, backward_tile):
    """Backward prefetch and multi-row backward tiles change the schedule only, not the result."""
    x, w, b, dy = make_inputs(n_rows, hidden, torch.float32, bias=True)
    with override_launch_config(RowNormConfig, backward_prefetch=prefetch, backward_tile_elements=backward_tile):
        ours = run(liger, x, w, b, dy)
    truth = run(torch_layer_norm, x.double(), w.double(), double(b), dy.double())
    check_fp32(ours, truth, n_rows)


def test_in_place_reuses_grad_output():
    x, w, b, dy = make_inputs(7, 123, torch.float32)
    expected = run(liger_out_of_place, x, w, b, dy)
    for in_place in (True, False):
        grad = dy.clone()
        seen = {}
        xi = x.detach().clone().requires_grad_(True)
        xi.register_hook(lambda g, seen=seen: seen.setdefault("dx", g))
        y = LigerLayerNormFunction.apply(xi, w, b, EPS, in_place)
        # The norm's gradient as autograd makes it (y * 1's backward), not the caller's grad.
        y.register_hook(lambda g, seen=seen: seen.update(dy=g.data_ptr()))
        (y * 1).backward(grad)
        assert (seen["dx"].data_ptr() == seen["dy"]) == in_place
        assert torch.equal(seen["dx"], expected[1])
        assert torch.equal(grad, dy)
    # Not eligible (non-contiguous): a fresh dx, and the incoming gradient is left intact.
    grad = dy.t().contiguous().t()
    kept = grad.clone()
    xi = x.detach().clone().requires_grad_(True)
    LigerLayerNormFunction.apply(xi, w, b, EPS, True).backward(grad)
    assert torch.equal(grad, kept)
    assert torch.equal(xi.grad, expected[1])


@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 37), (1, 1), (3, 1)])
def test_sum_backward_expanded_grad(shape):
    """``y.sum()``'s backward hands over one scalar expanded to y's shape (zero strides, and
    contiguous by the book for one element): dx is not written over it, and is right."""
    x = torch.randn(shape, device=DEVICE)
    w = torch.randn(shape[-1], device=DEVICE)
    b = torch.randn(shape[-1], device=DEVICE)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    liger(*leaves, EPS).sum().backward()
    ones = torch.ones(shape, device=DEVICE)
    expected = run(liger_out_of_place, x, w, b, ones)
    for leaf, want in zip(leaves, expected[1:]):
        assert torch.equal(leaf.grad, want)
    truth = run(torch_layer_norm, x.double(), w.double(), b.double(), ones.double())
    check_fp32((None, *(leaf.grad for leaf in leaves)), (None, *truth[1:]), x.numel() // shape[-1])


@pytest.mark.parametrize("shape", [(3, 0), (0, 0), (2, 0, 0)])
@pytest.mark.parametrize("bias", [True, False])
def test_zero_hidden_size(shape, bias):
    """H == 0 (and no rows either): empty output and gradients, as F.layer_norm gives."""
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    w = torch.randn(0, device=DEVICE, requires_grad=True)
    b = torch.randn(0, device=DEVICE, requires_grad=True) if bias else None
    y = liger(x, w, b, EPS)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == (0,)
    if bias:
        assert b.grad.shape == (0,)


def test_in_place_must_be_bool():
    x, w, b, _ = make_inputs(3, 8, torch.float32)
    with pytest.raises(TypeError, match="in_place"):
        LigerLayerNormFunction.apply(x, w, b, EPS, 1)


# Rows whose elements are all equal (c = 1000.1 is not a "round" fp32 value: the fp32 sum of n
# copies of it is not n * c). The truth, and torch in fp32, is exactly y == b, and dx == 0
# where g = dy * w is constant along the row (nn.LayerNorm's initial w = 1 under y.sum()). The fused path (one
# register tile) and the column-block path (a block narrower than the row) in every dtype.
# (On the CPU the column-block path runs with 256-column blocks; the full set adds the
# issue's H = 70000 with the default blocks.)
CONSTANT_ROW_PATHS = dict(shapes(
    small=[("fused_64", (64, None)), ("fused_1027", (1027, None)), ("blocked_1000", (1000, 256))],
    full=[("blocked_70000", (70000, None))],
))


@pytest.mark.parametrize("path", sorted(CONSTANT_ROW_PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [1000.1, -3.3e-3])
def test_constant_rows_match_torch(path, dtype, value):
    hidden, block = CONSTANT_ROW_PATHS[path]
    eps = 1e-6
    x = torch.full((3, hidden), value, device=DEVICE).to(dtype)
    w = (torch.randn(hidden, device=DEVICE) * 0.5 + 1.0).to(dtype)
    b = torch.randn(hidden, device=DEVICE).to(dtype)
    dy = torch.randn(3, hidden, device=DEVICE)
    overrides = {} if block is None else {"max_fused_block": block}
    with override_launch_config(RowNormConfig, **overrides):
        y, dx, dw, db = run(liger, x, w, b, dy, eps)
        ones = [torch.ones_like(t) for t in (w, x)]
        _, dx_flat, _, _ = run(liger, x, ones[0], b, ones[1].float(), eps)
    ref = run(torch_layer_norm, x, w, b, dy, eps)
    assert torch.equal(y, b.expand_as(y))  # the float64 truth, and torch's fp32 result
    assert torch.equal(dw, torch.zeros_like(dw))
    assert torch.equal(dx_flat, torch.zeros_like(dx_flat))
    # dx = rstd * (g - mean(g)) with rstd = 1/sqrt(eps): as torch's, to a rounding of dx.
    g = dy.to(dtype).double() * w.double()  # the norm receives dy in its output dtype
    assert_close(dx, ((g - g.mean(-1, keepdim=True)) / eps ** 0.5).to(dtype), dtype=dtype, scale=4, msg="dx")
    assert_close(db, ref[3], dtype=dtype, scale=2, msg="db")


@pytest.mark.parametrize("path", sorted(CONSTANT_ROW_PATHS))
def test_near_constant_rows_match_torch(path):
    """Rows within a few ulps of 1000.1 (spread ~1e-4 against eps 1e-6): x - mean must not carry
    the ~ulp(1000) error of an fp32 mean, which rstd ~ 1e4 would amplify. The output must be
    as close to the float64 truth as fp32 allows; the gradients within 2x of torch's fp32 error.

    32 rows: dW sums over them, and over 3 rows the ratio of its error to torch's swung between
    0.1x and 2.6x from one draw to the next (both round the mean to fp32 in backward); over 32 it
    stays within 0.2x-0.75x."""
    hidden, block = CONSTANT_ROW_PATHS[path]
    eps, rows = 1e-6, 32
    c = torch.tensor(1000.1)
    ulp = float(torch.nextafter(c, torch.tensor(2000.0)) - c)
    x = (c + ulp * torch.randint(-3, 4, (rows, hidden)).float()).to(DEVICE)
    w, b = torch.randn(hidden, device=DEVICE), torch.randn(hidden, device=DEVICE)
    dy = torch.randn(rows, hidden, device=DEVICE)
    overrides = {} if block is None else {"max_fused_block": block}
    with override_launch_config(RowNormConfig, **overrides):
        ours = run(liger, x, w, b, dy, eps)
    ref = run(torch_layer_norm, x, w, b, dy, eps)
    truth = run(torch_layer_norm, x.double(), w.double(), b.double(), dy.double(), eps)
    assert_close(ours[0], truth[0], dtype=torch.float32, scale=4, msg="y")
    for name, a, r, t in zip(("dx", "dw", "db"), ours[1:], ref[1:], truth[1:]):
        ours_err, ref_err = rel_error(a, t), rel_error(r, t)
        assert ours_err <= max(2 * ref_err, 1e-4), f"{name}: error {ours_err:.3g} vs torch fp32's {ref_err:.3g}"


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("edit", ["mul_", "dropout", "hook"])
@pytest.mark.parametrize("shape", [(2, 3, 37), (2, WIDE)])
def test_output_edited_in_place(shape, edit, in_place):
    """The output is an ordinary tensor, not a view of a private buffer: edits in place (also
    by a forward hook on a module, as activation steering does) work forward and backward as
    for torch's LayerNorm, with either backward."""
    x, w, b, dy = make_inputs(shape[0] if len(shape) == 2 else 6, shape[-1], torch.float32)
    x, dy = x.view(shape), dy.view(shape)
    steer = torch.randn(shape[-1], device=DEVICE)
    edits = {
        "mul_": lambda y: y.mul_(2.0),
        "dropout": ReplayedDropout(),  # F.dropout(inplace=True) on ours, its mask replayed on the reference
        "hook": lambda y: y.add_(steer.to(y.dtype)),
    }
    results = []
    for norm, cast in ((lambda *a: LigerLayerNormFunction.apply(*a, in_place), lambda t: t.clone()),
                       (torch_layer_norm, lambda t: t.double())):
        module = torch.nn.Module()
        module.weight, module.bias = (torch.nn.Parameter(cast(t)) for t in (w, b))
        module.forward = lambda inp, m=module, norm=norm: norm(inp, m.weight, m.bias, EPS)
        if edit == "hook":
            module.register_forward_hook(lambda m, args, out: edits["hook"](out))
        xi = cast(x).requires_grad_(True)
        y = module(xi)
        assert y._base is None
        if edit != "hook":
            edits[edit](y)
        (y * 1).backward(cast(dy))
        results.append((y.detach(), xi.grad, module.weight.grad, module.bias.grad))
    check_fp32(results[0], results[1], x.numel() // shape[-1])


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_meta_tensors(dtype, bias, in_place):
    """Meta in, meta out (shape inference, meta-device models), forward and backward."""
    x = torch.empty(2, 3, 40, device="meta", dtype=dtype, requires_grad=True)
    w = torch.empty(40, device="meta", dtype=dtype, requires_grad=True)
    b = torch.empty(40, device="meta", dtype=dtype, requires_grad=True) if bias else None
    y = LigerLayerNormFunction.apply(x, w, b, EPS, in_place)
    assert y.device.type == "meta" and y.shape == x.shape and y.dtype == dtype
    (y * 1).sum().backward()
    for t in (x, w, b):
        if t is not None:
            assert t.grad.device.type == "meta" and t.grad.shape == t.shape and t.grad.dtype == dtype


def test_fake_tensors():
    """Under a caller's FakeTensorMode (as torch.compile and torch.export trace) no kernel runs."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 7, 33, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(33, dtype=torch.bfloat16, requires_grad=True)
        y = LigerLayerNormFunction.apply(x, w, w, EPS)
        y.sum().backward()
    assert isinstance(y, FakeTensor) and y.shape == x.shape and y.dtype == torch.bfloat16
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
