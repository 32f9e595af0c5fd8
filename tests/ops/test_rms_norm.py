"""LigerRMSNormFunction against the Hugging Face RMSNorm math (written out here, no transformers).

References:
* ``hf_rms_norm``: LlamaRMSNorm / GemmaRMSNorm exactly as HF computes them (fp32
  statistics, the same casts), differentiated by autograd in the input dtype.
* ``exact_rms_norm``: the same function in float64, the truth both are measured against.

fp32 inputs are compared with float64 truth at fp32 tolerances. For bf16/fp16 the output
is compared with HF's at ~2 output ulps (the rstd may differ in its last fp32 bit, which
flips an occasional rounding), and our distance to the float64 truth must not exceed HF's
own by more than 25%. In "none" mode, where the statistics themselves are rounded to the
input dtype, the rstd must match HF's to one ulp of that dtype and the output is compared
with HF's math applied to our rstd (see ``hf_none_output_with_our_statistics``). (Under the Triton interpreter the kernels round fp32 -> bf16 by
hand, because the interpreter's own conversion truncates; see ops/numerics.round_to_dtype.)
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.rms_norm import LigerRMSNormFunction, rms_norm_forward
from liger_kernel.ops.row_norm_geometry import RowNormConfig, row_norm_launch
from tests.utils import DEVICE, ReplayedDropout, assert_close, rel_error, shapes, tolerance

# A row wider than the widest register tile, so the column-block loop runs on the CPU too.
WIDE = RowNormConfig().max_fused_block + 8
# (rows, hidden): odd widths, one row, a ragged last tile, and a WIDE row.
SHAPES = shapes(
    small=[(1, 1), (3, 1), (37, 1), (1, 123), (3, 123), (37, 123), (1, 1027), (3, 1027), (37, 1027),
           (2, WIDE)],
    full=[(1007, 1), (1, 4231), (3, 4231), (1007, 123), (1007, 4231), (64, 4096), (4, 65536), (3, 65536 + 7)],
)
MODES = [("llama", 0.0), ("gemma", 1.0), ("none", 0.0), ("llama", 0.5)]
EPS = 1e-6
# Our distance to float64 truth may exceed HF's own by this factor (see the module docstring).
ERROR_FACTOR = 1.25


def hf_rms_norm(x, w, eps, offset, casting_mode):
    """RMSNorm as Hugging Face computes it (LlamaRMSNorm for "llama", GemmaRMSNorm for "gemma")."""
    input_dtype = x.dtype
    if casting_mode == "none":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.to(input_dtype))
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "llama":
        if offset == 0.0:
            return w * h.to(input_dtype)  # LlamaRMSNorm.forward
        out_dtype = torch.promote_types(w.dtype, input_dtype)
        return ((w.float() + offset) * h.to(input_dtype).float()).to(out_dtype)
    return (h * (offset + w.float())).type_as(x)  # GemmaRMSNorm.forward


def hf_none_output_with_our_statistics(x, w, offset):
    """HF's "none" output recomputed with our per-row rstd, after checking that rstd.

    In "none" mode the mean of squares is rounded to the input dtype, as torch rounds it;
    both sum the same squares in fp32, but in different orders, so a mean lying within an
    fp32 rounding of a tie between two dtype values may round to the other one. Each row's
    rstd must therefore equal HF's or be its neighbour (one ulp of the dtype); a neighbour
    moves the whole row by up to a few output ulps, which is not an error of what follows
    the statistics. Everything after them is then held to HF's exact math.
    """
    _, rstd = rms_norm_forward(x, w, EPS, offset, "none")
    ours = rstd.to(x.dtype).view(x.shape[:-1])
    theirs = torch.rsqrt(x.pow(2).mean(-1) + EPS)
    # Positive finite floats order like their bit patterns: the difference counts ulps.
    ulps = (ours.view(torch.int16).int() - theirs.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1, f"rstd differs from HF's by {int(ulps.max())} ulps"
    return x * ours[..., None] * (offset + w.to(x.dtype))


def exact_rms_norm(x, w, eps, offset):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)


def run(fn, x, w, dy, *args):
    """(y, dx, dw) of ``fn(x, w, *args)`` with upstream gradient ``dy``."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w, *args)
    # Through an exact op (* 1), so the gradient reaching the norm is a buffer nobody else
    # reads, as in a model's decoder layer: in_place=True may write into it (dy itself, the
    # caller's tensor, must stay intact: no in_place promise covers it).
    (y * 1).backward(dy.to(y.dtype, copy=True))
    return y.detach(), x.grad, w.grad


def liger(x, w, eps, offset, mode, in_place=True):
    return LigerRMSNormFunction.apply(x, w, eps, offset, mode, in_place)


def make_inputs(n_rows, hidden, dtype, w_dtype=None, offset=0.0):
    x = torch.randn(n_rows, hidden, device=DEVICE, dtype=dtype)
    w = torch.randn(hidden, device=DEVICE, dtype=w_dtype or dtype) * 0.5 + (1.0 - offset)
    dy = torch.randn(n_rows, hidden, device=DEVICE, dtype=torch.float32)
    return x, w, dy


@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("n_rows,hidden", SHAPES)
@pytest.mark.parametrize("in_place", [True, False])
def test_fp32_matches_float64(n_rows, hidden, mode, offset, in_place):
    x, w, dy = make_inputs(n_rows, hidden, torch.float32, offset=offset)
    y, dx, dw = run(liger, x, w, dy, EPS, offset, mode, in_place)
    y_ref, dx_ref, dw_ref = run(exact_rms_norm, x.double(), w.double(), dy.double(), EPS, offset)
    assert y.dtype == torch.float32
    assert_close(y, y_ref, msg="y")
    # dx sums over a row, dw over all rows: fp32 error grows with the reduction length.
    assert_dx_close(dx, dx_ref, x, w, dy, offset)
    assert_close(dw, dw_ref, scale=max(4, n_rows ** 0.5), msg="dw")


# dx = rstd * (g - x_hat * mean(x_hat * g)), g = (w + offset) * dy, subtracts two terms that
# nearly cancel where x_hat^2 ~ 1 - as in every row of width 1, where dx = rstd * g * (1 -
# x_hat^2). Any fp32 evaluation of that formula then errs by some ulps of the *terms*, not of
# dx: torch's own fp32 autograd reached 5.4 u * s (s below) over 3000 draws of (1007, 1) and
# (1007, 123), and missed the plain tolerance of 4e-5 in about one draw in 2000 at (1007, 1);
# our kernel, 3.2 u * s in the interpreter (the GPU's rsqrt is approximate, <= 2 ulps).
# Hence the bound adds DX_CANCELLATION_ULPS units of roundoff of the terms' magnitude
# s = rstd * (|g| + |x_hat| * mean(|x_hat * g|)); for rows without cancellation s ~ |dx|
# and the term adds ~2e-6 to the 4e-5 tolerance.
DX_CANCELLATION_ULPS = 32


def assert_dx_close(dx, dx_ref, x, w, dy, offset):
    x, g = x.double(), (w.double() + offset) * dy.double()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    x_hat = x * rstd
    terms = rstd * (g.abs() + x_hat.abs() * (x_hat * g).abs().mean(-1, keepdim=True))
    tol = tolerance(torch.float32, scale=4)
    allowed = tol["atol"] + tol["rtol"] * dx_ref.double().abs() + DX_CANCELLATION_ULPS * 2.0**-24 * terms
    excess = (dx.double() - dx_ref.double()).abs() - allowed
    worst = int(excess.argmax())
    assert float(excess.max()) <= 0, (
        f"dx: {int((excess > 0).sum())} of {dx.numel()} elements beyond the bound; worst at flat index {worst}: "
        f"{float(dx.flatten()[worst]):.6e} vs {float(dx_ref.flatten()[worst]):.6e}, "
        f"allowed {float(allowed.flatten()[worst]):.2e}")


@pytest.mark.parametrize("row_accumulator", [True, False])
@pytest.mark.parametrize("n_rows,hidden", [(37, 123), (1000 + 7, 64)])
def test_backward_accumulators_agree(n_rows, hidden, row_accumulator):
    """Both dW accumulations of multi-row backward tiles (RowNormConfig.backward_row_accumulator)."""
    with override_launch_config(RowNormConfig, backward_row_accumulator=row_accumulator):
        assert row_norm_launch(n_rows, hidden, torch.device(DEVICE)).backward_row_accumulator is row_accumulator
        x, w, dy = make_inputs(n_rows, hidden, torch.float32)
        _, dx, dw = run(liger, x, w, dy, EPS, 0.0, "llama", False)
    _, dx_ref, dw_ref = run(exact_rms_norm, x.double(), w.double(), dy.double(), EPS, 0.0)
    assert_close(dx, dx_ref, scale=4, msg="dx")
    assert_close(dw, dw_ref, scale=max(4, n_rows ** 0.5), msg="dw")


@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("n_rows,hidden", shapes(small=[(37, 123), (3, 1027), (2, WIDE)],
                                                  full=[(1007, 4231), (64, 4096)]))
@pytest.mark.parametrize("dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                           (torch.float16, torch.float16)])
def test_low_precision_matches_hf(n_rows, hidden, mode, offset, dtype, w_dtype):
    x, w, dy = make_inputs(n_rows, hidden, dtype, w_dtype, offset)
    ours = run(liger, x, w, dy, EPS, offset, mode, False)
    hf = run(hf_rms_norm, x, w, dy, EPS, offset, mode)
    truth = run(exact_rms_norm, x.double(), w.double(), dy.double(), EPS, offset)
    if mode == "none":
        hf = (hf_none_output_with_our_statistics(x, w, offset), *hf[1:])
    # HF's own output dtype: promoted in llama mode (bf16 x, fp32 w -> fp32), x's otherwise.
    assert ours[0].dtype == hf[0].dtype
    assert ours[1].dtype == x.dtype and ours[2].dtype == w.dtype
    assert_close(ours[0], hf[0], dtype=dtype, msg="y vs HF")
    for name, a, h, t in zip(("y", "dx", "dw"), ours, hf, truth):
        ours_err, hf_err = rel_error(a, t), rel_error(h, t)
        assert ours_err <= ERROR_FACTOR * hf_err + 1e-6, f"{name}: error {ours_err:.3g} vs HF's {hf_err:.3g}"


@pytest.mark.parametrize("mode,offset", MODES[:3])
@pytest.mark.parametrize("in_place", [True, False])
def test_4d_non_contiguous(mode, offset, in_place):
    """Qwen3-style q/k norm: (B, T, heads, head_dim) as a transposed, non-contiguous view."""
    b, t, heads, head_dim = 2, 5, 3, 64
    base = torch.randn(b, heads, t, head_dim, device=DEVICE)
    x = base.transpose(1, 2)  # (B, T, heads, head_dim), not contiguous
    assert not x.is_contiguous()
    w = torch.randn(head_dim, device=DEVICE) * 0.5 + (1.0 - offset)
    dy = torch.randn(b, t, heads, head_dim, device=DEVICE).transpose(1, 2).contiguous().transpose(1, 2)
    y, dx, dw = run(liger, x, w, dy, EPS, offset, mode, in_place)
    y_ref, dx_ref, dw_ref = run(exact_rms_norm, x.double(), w.double(), dy.double(), EPS, offset)
    assert y.shape == x.shape and dx.shape == x.shape
    assert_close(y, y_ref, msg="y")
    assert_close(dx, dx_ref, scale=4, msg="dx")
    assert_close(dw, dw_ref, scale=4, msg="dw")


def test_in_place_reuses_grad_output():
    x = torch.randn(7, 123, device=DEVICE, requires_grad=True)
    w = torch.randn(123, device=DEVICE, requires_grad=True)
    dy = torch.randn(7, 123, device=DEVICE)
    expected = run(liger, x, w, dy, EPS, 0.0, "llama", False)

    for in_place in (True, False):
        grad = dy.clone()
        seen = {}

        def keep(g, seen=seen):
            seen["dx"] = g

        xi = x.detach().clone().requires_grad_(True)
        xi.register_hook(keep)
        y = liger(xi, w, EPS, 0.0, "llama", in_place)
        # The norm's gradient as autograd makes it (y * 1's backward), not the caller's grad.
        y.register_hook(lambda g, seen=seen: seen.update(dy=g.data_ptr()))
        (y * 1).backward(grad)
        assert (seen["dx"].data_ptr() == seen["dy"]) == in_place
        assert torch.equal(seen["dx"], expected[1])
        assert torch.equal(grad, dy)

    # Not eligible (non-contiguous / different dtype from x): a fresh dx is allocated.
    grad = torch.randn(123, 7, device=DEVICE).t()
    xi = x.detach().clone().requires_grad_(True)
    liger(xi, w, EPS, 0.0, "llama", True).backward(grad)
    assert xi.grad.data_ptr() != grad.data_ptr()
    assert_close(xi.grad, run(liger, x, w, grad.contiguous(), EPS, 0.0, "llama", False)[1])
    xb = torch.randn(7, 123, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = liger(xb, w, EPS, 0.0, "llama", True)  # fp32 output (promoted), bf16 dx
    grad = torch.randn_like(y)
    y.backward(grad)
    assert xb.grad.dtype == torch.bfloat16 and xb.grad.data_ptr() != grad.data_ptr()


@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 37), (1, 1), (3, 1)])
def test_sum_backward_expanded_grad(shape):
    """``y.sum()``'s backward hands over one scalar expanded to y's shape (zero strides, and
    contiguous by the book for one element): dx is not written over it, and is right."""
    x = torch.randn(shape, device=DEVICE)
    w = torch.randn(shape[-1], device=DEVICE)
    xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    liger(xi, wi, EPS, 0.0, "llama", True).sum().backward()
    _, dx, dw = run(liger, x, w, torch.ones(shape, device=DEVICE), EPS, 0.0, "llama", False)
    assert torch.equal(xi.grad, dx) and torch.equal(wi.grad, dw)
    _, dx_exact, dw_exact = run(exact_rms_norm, x.double(), w.double(), torch.ones(shape, device=DEVICE).double(),
                                EPS, 0.0)
    assert_close(xi.grad, dx_exact, scale=4, msg="dx")
    assert_close(wi.grad, dw_exact, scale=4, msg="dw")


@pytest.mark.parametrize("shape", [(3, 0), (0, 0), (2, 0, 0)])
def test_zero_hidden_size(shape):
    """H == 0 (and no rows either): empty output and gradients, as torch's rms_norm gives."""
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    w = torch.randn(0, device=DEVICE, requires_grad=True)
    y = liger(x, w, EPS, 0.0, "llama")
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == (0,)


@pytest.mark.parametrize("mode,offset", MODES[:3])
@pytest.mark.parametrize("n_rows,hidden", shapes(small=[(37, 123), (3, WIDE)],
                                                  full=[(4097, 4231), (33, 65536)]))
def test_dw_deterministic(n_rows, hidden, mode, offset):
    x, w, dy = make_inputs(n_rows, hidden, torch.bfloat16, offset=offset)
    first = run(liger, x, w, dy, EPS, offset, mode, False)
    second = run(liger, x, w, dy, EPS, offset, mode, False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hidden", [1, 123, WIDE])
@pytest.mark.parametrize("mode,offset", MODES[:3])
def test_zero_rows_are_finite(hidden, mode, offset):
    x = torch.zeros(3, hidden, device=DEVICE)
    w = torch.randn(hidden, device=DEVICE)
    dy = torch.randn(3, hidden, device=DEVICE)
    y, dx, dw = run(liger, x, w, dy, EPS, offset, mode, False)
    assert torch.all(y == 0)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    # rstd = 1/sqrt(eps), so dx = dy * (w + offset) / sqrt(eps) (xhat = 0).
    assert_close(dx, dy * (w + offset) / EPS ** 0.5, msg="dx")
    assert torch.all(dw == 0)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (0, WIDE)])
def test_empty_input(shape):
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    w = torch.randn(shape[-1], device=DEVICE, requires_grad=True)
    y = liger(x, w, EPS, 0.0, "llama")
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w))


X_OK = torch.randn(2, 8, device=DEVICE)
W_OK = torch.ones(8, device=DEVICE)


@pytest.mark.parametrize("args,error,match", [
    ((X_OK, torch.ones(7, device=DEVICE)), ValueError, "last dimension"),
    ((X_OK, torch.ones(2, 8, device=DEVICE)), ValueError, "W must be 1-D"),
    ((torch.randn(2, 8, device=DEVICE, dtype=torch.float64), W_OK), TypeError, "X has dtype"),
    ((X_OK, W_OK.to(torch.int32)), TypeError, "W has dtype"),
    ((X_OK.tolist(), W_OK), TypeError, "X must be a torch.Tensor"),
    ((torch.tensor(1.0, device=DEVICE), W_OK), ValueError, "last dimension"),
    ((X_OK, W_OK, 1e-6, 0.0, "mistral"), ValueError, "casting_mode"),
    ((X_OK, W_OK, 1e-6, 0.0, 1), TypeError, "casting_mode"),
    ((X_OK, W_OK, "1e-6"), TypeError, "eps"),
    ((X_OK, W_OK, -1.0), ValueError, "eps"),
    ((X_OK, W_OK, 1e-6, None), TypeError, "offset"),
    ((X_OK, W_OK, 1e-6, 0.0, "llama", 1), TypeError, "in_place"),
])
def test_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        LigerRMSNormFunction.apply(*args)


def test_different_devices():
    if DEVICE != "cuda":
        pytest.skip("needs a CUDA device to put W elsewhere")
    with pytest.raises(ValueError, match="device"):
        LigerRMSNormFunction.apply(X_OK, W_OK.cpu())


@settings(max_examples=15, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    hidden=st.integers(1, 300),
    mode=st.sampled_from(["llama", "gemma", "none"]),
    offset=st.sampled_from([0.0, 1.0, -0.25]),
    in_place=st.booleans(),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_property(lead, hidden, mode, offset, in_place, eps, dtype):
    x = torch.randn(*lead, hidden, device=DEVICE).to(dtype)
    w = torch.randn(hidden, device=DEVICE).to(dtype)
    dy = torch.randn(*lead, hidden, device=DEVICE)
    y, dx, dw = run(liger, x, w, dy, eps, offset, mode, in_place)
    y_ref, dx_ref, dw_ref = run(exact_rms_norm, x.double(), w.double(), dy.to(dtype).double(), eps, offset)
    assert y.shape == x.shape and dx.shape == x.shape and dw.shape == w.shape
    # Low precision: y carries up to three roundings ("none" mode), about 1.5 ulp; the
    # gradients also see dy and g rounded, and dw one more rounding after its fp32 sum.
    assert_close(y, y_ref, dtype=dtype, msg="y")
    tol = tolerance(dtype, 4)
    allowed = tol["atol"] + tol["rtol"] * dx_ref.abs() + dx_cancellation_allowance(x, w, dy, eps, offset, mode)
    error = (dx.double() - dx_ref).abs()
    assert bool((error <= allowed).all()), f"dx off by {float(error.max()):.3g} at {int(error.argmax())}"
    assert_close(dw, dw_ref, dtype=dtype, scale=4, msg="dw")


def dx_cancellation_allowance(x, w, dy, eps, offset, mode):
    """What rounding to x's dtype inside the backward can do to dx where its two terms cancel.

    ``dx = rstd (g - xhat mean(g xhat))`` with ``g = dy (w + offset)``. Where HF rounds ``g``
    (llama and none modes: the product in the input dtype) and ``xhat`` (none mode) to the input
    dtype, each term moves by a few units ``u`` of its own size, however small their difference
    (a row of one element, or one dominated by one element, has ``xhat`` near +-1 and ``dx``
    near 0): ``4 u rstd (|g| + |xhat| mean|g xhat|)``, float64. Zero for low-precision modes that
    round only their outputs (gemma) and for float32."""
    if mode == "gemma" or x.dtype == torch.float32:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    unit = torch.finfo(x.dtype).eps / 2
    x64, g = x.double(), dy.to(x.dtype).double() * (w.double() + offset)
    rstd = (x64.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    xhat = x64 * rstd
    return 4 * unit * rstd * (g.abs() + xhat.abs() * (g * xhat).abs().mean(-1, keepdim=True))


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("backward_tile", [1, 4096])
@pytest.mark.parametrize("n_rows,hidden", [(37, 123), (5, 1027), (1, 64)])
def test_backward_launch_variants(n_rows, hidden, prefetch, backward_tile):
    """The backward's launch configuration changes only the schedule, never the result:
    prefetch on and off, one row per tile and several (with a ragged last tile), against
    float64 truth."""
    x, w, dy = make_inputs(n_rows, hidden, torch.float32)
    with override_launch_config(RowNormConfig, backward_prefetch=prefetch, backward_tile_elements=backward_tile):
        _, dx, dw = run(liger, x, w, dy, EPS, 0.0, "llama", True)
    _, dx_ref, dw_ref = run(exact_rms_norm, x.double(), w.double(), dy.double(), EPS, 0.0)
    assert_close(dx, dx_ref, scale=4, msg="dx")
    assert_close(dw, dw_ref, scale=max(4, n_rows ** 0.5), msg="dw")


@pytest.mark.parametrize("elements_per_thread", [None, 4, 32])
@pytest.mark.parametrize("n_rows,hidden", [(37, 123), (5, 4096), (1000 + 7, 64)])
def test_forward_warps_change_only_the_summation_order(n_rows, hidden, elements_per_thread):
    """RowNormConfig.forward_elements_per_thread picks the forward's warps. Other warps sum a
    row's squares in another order, so rstd may move by an fp32 ulp (on a GPU) and y
    by one rounding of its dtype; nothing more."""
    x, w, _ = make_inputs(n_rows, hidden, torch.bfloat16)
    y_default, rstd_default = rms_norm_forward(x, w, EPS, 0.0, "llama")
    with override_launch_config(RowNormConfig, forward_elements_per_thread=elements_per_thread):
        y, rstd = rms_norm_forward(x, w, EPS, 0.0, "llama")
    torch.testing.assert_close(rstd, rstd_default, rtol=4 * 2.0**-24, atol=0)
    torch.testing.assert_close(y.float(), y_default.float(), rtol=2.0**-7, atol=0)  # one bf16 ulp


# The output is an ordinary tensor (not a view of a private buffer): whatever a user does
# with HF's output in place works, forward and backward, with either backward.
IN_PLACE_EDITS = {
    "mul_": lambda: lambda y: y.mul_(2.0),
    "dropout": ReplayedDropout,  # F.dropout(inplace=True) on ours, its mask replayed on the reference
    "add_": lambda: lambda y: y.add_(1.0),
}


class _Norm(torch.nn.Module):
    """A norm module: ``norm(x, self.weight)``."""

    def __init__(self, weight, norm):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.norm = norm

    def forward(self, x):
        return self.norm(x, self.weight)


@pytest.mark.parametrize("edit", sorted(IN_PLACE_EDITS))
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("shape", [(2, 3, 37), (5, 64), (2, WIDE)])
def test_output_edited_in_place(shape, in_place, edit):
    x = torch.randn(shape, device=DEVICE)
    w = torch.randn(shape[-1], device=DEVICE)
    dy = torch.randn(shape, device=DEVICE)
    results = []
    edit_in_place = IN_PLACE_EDITS[edit]()
    for fn, cast in ((liger, lambda t: t.clone()), (exact_rms_norm, lambda t: t.double())):
        xi, wi = cast(x).requires_grad_(True), cast(w).requires_grad_(True)
        y = fn(xi, wi, EPS, 0.0, "llama", in_place) if fn is liger else fn(xi, wi, EPS, 0.0)
        assert y._base is None
        edit_in_place(y)
        (y * 1).backward(cast(dy))
        results.append((y.detach(), xi.grad, wi.grad))
    for name, ours, truth in zip(("y", "dx", "dw"), *results):
        assert_close(ours, truth, scale=4, msg=name)


@pytest.mark.parametrize("in_place", [True, False])
def test_forward_hook_edits_the_output_in_place(in_place):
    """A forward hook that edits a norm module's output in place (activation steering)."""
    x = torch.randn(2, 5, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    steer = torch.randn(64, device=DEVICE)
    results = []
    for fn, cast in ((liger, lambda t: t.clone()), (exact_rms_norm, lambda t: t.double())):
        if fn is liger:
            module = _Norm(cast(w), lambda x, w: liger(x, w, EPS, 0.0, "llama", in_place))
        else:
            module = _Norm(cast(w), lambda x, w: exact_rms_norm(x, w, EPS, 0.0))
        steering = cast(steer)
        module.register_forward_hook(lambda m, args, out, s=steering: out.add_(s))
        xi = cast(x).requires_grad_(True)
        y = module(xi)
        (y * y).sum().backward()
        results.append((y.detach(), xi.grad, module.weight.grad))
    for name, ours, truth in zip(("y", "dx", "dw"), *results):
        assert_close(ours, truth, scale=4, msg=name)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("mode,offset", MODES)
def test_meta_tensors(mode, offset, in_place):
    """Meta in, meta out (shape inference, meta-device models), forward and backward."""
    for dtype, w_dtype in ((torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float32,) * 2):
        x = torch.empty(2, 3, 40, device="meta", dtype=dtype, requires_grad=True)
        w = torch.empty(40, device="meta", dtype=w_dtype, requires_grad=True)
        y = liger(x, w, EPS, offset, mode, in_place)
        assert y.device.type == "meta" and y.shape == x.shape
        assert y.dtype == (torch.promote_types(dtype, w_dtype) if mode == "llama" else dtype)
        (y * 1).sum().backward()
        assert x.grad.device.type == "meta" and x.grad.shape == x.shape and x.grad.dtype == dtype
        assert w.grad.device.type == "meta" and w.grad.shape == w.shape and w.grad.dtype == w_dtype


def test_fake_tensors():
    """Under a caller's FakeTensorMode (as torch.compile and torch.export trace) no kernel runs."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 7, 33, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(33, requires_grad=True)
        y = liger(x, w, EPS, 0.0, "llama")
        y.sum().backward()
    assert isinstance(y, FakeTensor) and y.shape == x.shape and y.dtype == torch.float32
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
