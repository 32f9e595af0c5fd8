"""Shared helpers of ops/ (row norms, gradient ownership, scaling) that are not covered through an op: the in-place gradient
scale and the column sum of the norm backward's partials."""

import pytest
import torch

from liger_kernel.ops.layer_norm import LigerLayerNormFunction
from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from liger_kernel.ops.row_norm import sum_partials
from liger_kernel.ops.scaling import scale_in_place
from tests.utils import DEVICE


def expected(x, scale):
    """fp32 product rounded once to x's dtype, as the kernel computes it."""
    return (x.float() * scale.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (7, 13), (3, 5000), (4097,), (2, 3, 5)])
def test_scalar_scale(shape, dtype):
    x = torch.randn(shape, device=DEVICE).to(dtype)
    scale = torch.tensor(0.37, device=DEVICE)
    want = expected(x, scale)
    scale_in_place(x, scale)
    assert torch.equal(x, want)


def test_unit_scale_leaves_tensor_untouched():
    # NaN and inf would change under any arithmetic: an exact 1 must skip the row entirely.
    x = torch.randn(6, 300, device=DEVICE)
    x[1, 7] = float("nan")
    x[4, 0] = float("inf")
    before = x.clone()
    scale_in_place(x, torch.ones((), device=DEVICE))
    assert torch.equal(x.isnan(), before.isnan())
    assert torch.equal(torch.nan_to_num(x), torch.nan_to_num(before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_scale(dtype):
    x = torch.randn(9, 1031, device=DEVICE).to(dtype)
    scale = torch.rand(9, device=DEVICE) + 0.5
    scale[[0, 4, 8]] = 1.0
    x[4, 3] = float("nan")  # a unit row is skipped, so its NaN stays a NaN and nothing else changes
    want = expected(x, scale[:, None])
    scale_in_place(x, scale)
    assert torch.equal(torch.nan_to_num(x), torch.nan_to_num(want))


def test_per_row_scale_expanded_and_strided():
    # Upstream gradients of a sum are expanded (stride 0); logits views may have padded rows.
    storage = torch.randn(5, 40, device=DEVICE)
    x = storage[:, :33]
    scale = torch.tensor(3.0, device=DEVICE).expand(5)
    want = expected(x, scale[:, None])
    scale_in_place(x, scale)
    assert torch.equal(x, want)
    assert torch.equal(storage[:, 33:], storage[:, 33:])


def test_non_contiguous_scalar_scale_falls_back():
    x = torch.randn(8, 6, device=DEVICE).t()
    want = expected(x, torch.tensor(2.5))
    scale_in_place(x, torch.tensor(2.5, device=DEVICE))
    assert torch.equal(x, want.to(DEVICE))


def test_empty_and_bad_shapes():
    scale_in_place(torch.empty(0, 5, device=DEVICE), torch.tensor(2.0, device=DEVICE))
    with pytest.raises(ValueError, match="per-row scale"):
        scale_in_place(torch.randn(4, 3, device=DEVICE), torch.ones(3, device=DEVICE))


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("n_partials,n_cols", [(1, 1), (3, 65), (33, 200), (264, 4096 + 3)])
def test_sum_partials(n_partials, n_cols, dtypes):
    """Each slab summed over its rows in fp32, then rounded once to its own dtype; fresh tensors."""
    partials = torch.randn(len(dtypes), n_partials, n_cols, device=DEVICE)
    outs = sum_partials(partials, dtypes)
    assert len(outs) == len(dtypes)
    for k, (out, dtype) in enumerate(zip(outs, dtypes)):
        assert out.shape == (n_cols,) and out.dtype == dtype
        exact = partials[k].double().sum(dim=0)
        # fp32 summation of n_partials terms, then one rounding to the output dtype.
        bound = n_partials * 2.0**-24 * partials[k].double().abs().sum(dim=0) + exact.abs() * torch.finfo(dtype).eps
        assert bool(((out.double() - exact).abs() <= bound + 1e-30).all()), f"slab {k}"
    if len(outs) == 2:
        assert outs[0].data_ptr() != outs[1].data_ptr()


def test_sum_partials_is_deterministic():
    partials = torch.randn(2, 131, 777, device=DEVICE)
    first = sum_partials(partials, (torch.float32, torch.float32))
    second = sum_partials(partials, (torch.float32, torch.float32))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_sum_partials_rejects_bad_slab_count():
    with pytest.raises(ValueError, match="1 or 2 dtypes"):
        sum_partials(torch.zeros(3, 2, 4, device=DEVICE), (torch.float32,) * 3)


def test_row_norm_launch_reads_max_fused_block_at_call_time(monkeypatch):
    """MAX_FUSED_BLOCK is a tunable: setting it changes which rows are walked in blocks."""
    import liger_kernel.ops.launch as ops_launch
    import liger_kernel.ops.row_norm as ops_utils

    assert ops_utils.row_norm_launch(4, 1000, torch.device(DEVICE)).fused
    monkeypatch.setattr(ops_launch, "MAX_FUSED_BLOCK", 256)
    monkeypatch.setattr(ops_utils, "MAX_FUSED_BLOCK", 256)
    launch = ops_utils.row_norm_launch(4, 1000, torch.device(DEVICE))
    assert not launch.fused and launch.block_cols == 256
    assert ops_launch.row_launch_settings(1000)[0] == 256


def test_next_power_of_2_matches_triton():
    import triton

    from liger_kernel.ops.launch import next_power_of_2

    for n in [*range(0, 300), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(max(n, 1)), n


# ``backward_writes_into_grad``: the norms' backward writes dx over the incoming gradient only
# when autograd owns it. Each norm as (x, params, in_place) -> y.
NORMS = {
    "rms_norm": lambda x, params, in_place: LigerRMSNormFunction.apply(x, params[0], 1e-6, 0.0, "llama", in_place),
    "layer_norm": lambda x, params, in_place: LigerLayerNormFunction.apply(x, params[0], params[1], 1e-6, in_place),
}


def norm_inputs(norm, shape):
    x = torch.randn(shape, device=DEVICE)
    params = [torch.randn(shape[-1], device=DEVICE) for _ in range(2 if norm == "layer_norm" else 1)]
    return x, params


def leaves_of(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def norm_into_projection(norm):
    """The norm feeding a Linear, with ``in_place`` True and False on the same values:
    ``{in_place: whether dx was written over dy}`` after checking that both gave the same
    gradients."""
    x, params = norm_inputs(norm, (2, 3, 123))
    proj = torch.nn.Linear(123, 17).to(DEVICE)
    grads, written = {}, {}
    for in_place in (True, False):
        seen = {}
        xi, *ps = leaves_of(x, *params)
        xi.register_hook(lambda g, seen=seen: seen.update(dx=g.data_ptr()))
        y = NORMS[norm](xi, ps, in_place)
        y.register_hook(lambda g, seen=seen: seen.update(dy=g.data_ptr()))
        proj(y).sum().backward()
        written[in_place] = seen["dx"] == seen["dy"]
        grads[in_place] = [xi.grad, *(p.grad for p in ps)]
    for with_write, without in zip(grads[True], grads[False]):
        assert torch.equal(with_write, without)
    return written


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_reuses_the_gradient_of_a_projection(norm):
    """In a model the norm feeds a projection, whose backward hands over a view of a fresh
    (N, H) product: autograd owns it, so the backward writes dx into it."""
    assert norm_into_projection(norm) == {True: True, False: False}


@pytest.mark.parametrize("how", ["backward", "autograd_grad", "through_view", "through_add"])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_leaves_the_callers_grad_alone(norm, how):
    """autograd hands the very tensor given to ``backward(g)`` / ``autograd.grad(.., g)`` to the
    norm's backward (also through an addition, or as a view of it through view ops): with
    ``in_place=True`` it must still keep its values, and the grads be the out-of-place ones."""
    x, params = norm_inputs(norm, (6, 123))
    g = torch.randn(6, 123, device=DEVICE)
    kept = g.clone()
    reference = leaves_of(x, *params)
    NORMS[norm](reference[0], reference[1:], False).backward(g)
    leaves = leaves_of(x, *params)
    y = NORMS[norm](leaves[0], leaves[1:], True)
    if how == "backward":
        y.backward(g)
    elif how == "autograd_grad":
        for leaf, grad in zip(leaves, torch.autograd.grad(y, leaves, g)):
            leaf.grad = grad
    elif how == "through_view":
        y.view(-1).backward(g.view(-1))
    else:
        other = torch.randn(6, 123, device=DEVICE, requires_grad=True)
        (y + other).backward(g)
        assert torch.equal(other.grad, kept)
    assert torch.equal(g, kept)
    for leaf, want in zip(leaves, reference):
        assert torch.equal(leaf.grad, want.grad)


@pytest.mark.parametrize("alias", ["detach", "data"])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_leaves_a_hook_kept_detached_alias_alone(norm, alias):
    """A hook that keeps ``g.detach()`` / ``g.data`` of the norm output's gradient (an
    activation-gradient cache) holds no Python reference to ``g`` itself, only a second tensor
    on its storage: with ``in_place=True`` the cached values must still be dy, not dx."""
    x, params = norm_inputs(norm, (2, 3, 123))
    proj = torch.nn.Linear(123, 17).to(DEVICE)
    results = {}
    for in_place in (True, False):
        kept = []
        leaves = leaves_of(x, *params)
        y = NORMS[norm](leaves[0], leaves[1:], in_place)
        y.register_hook(lambda g, kept=kept: kept.append(g.detach() if alias == "detach" else g.data))
        proj(y).sum().backward()
        results[in_place] = [kept[0], *(leaf.grad for leaf in leaves)]
    for with_write, without in zip(results[True], results[False]):
        assert torch.equal(with_write, without)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_leaves_a_module_hook_kept_grad_input_alone(norm):
    """A full backward hook on the norm's consumer that keeps a detached ``grad_input`` (the
    norm output's gradient, as activation-statistics tools do) must keep dy."""
    x, params = norm_inputs(norm, (2, 3, 123))
    results = {}
    for in_place in (True, False):
        kept = []
        proj = torch.nn.Linear(123, 17).to(DEVICE)
        torch.nn.init.ones_(proj.weight)
        proj.register_full_backward_hook(lambda m, gi, go, kept=kept: kept.append(gi[0].detach()))
        leaves = leaves_of(x, *params)
        proj(NORMS[norm](leaves[0], leaves[1:], in_place)).sum().backward()
        results[in_place] = [kept[0], *(leaf.grad for leaf in leaves)]
    for with_write, without in zip(results[True], results[False]):
        assert torch.equal(with_write, without)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_with_its_output_added_to_a_residual_stream(norm):
    """``norm(x) + r`` hands the one gradient tensor autograd made for the sum to both inputs:
    r's gradient must not become the norm's dx."""
    x, params = norm_inputs(norm, (2, 3, 123))
    r = torch.randn(2, 3, 123, device=DEVICE)
    proj = torch.nn.Linear(123, 17).to(DEVICE)
    results = {}
    for in_place in (True, False):
        leaves = leaves_of(x, *params, r)
        proj(NORMS[norm](leaves[0], leaves[1:-1], in_place) + leaves[-1]).sum().backward()
        results[in_place] = [leaf.grad for leaf in leaves]
    for with_write, without in zip(results[True], results[False]):
        assert torch.equal(with_write, without)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_without_storage_use_count_writes_nothing_in_place(norm, monkeypatch):
    """A torch without ``torch._C._storage_Use_Count`` cannot tell a detached alias apart:
    calibration gives up, and the in-place backward then allocates dx instead of failing."""
    import liger_kernel.ops.grad_ownership as ops_utils

    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    assert ops_utils._calibrate_owned_grad_references() is None
    monkeypatch.setattr(ops_utils, "_OWNED_GRAD_REFERENCES", None)
    assert norm_into_projection(norm) == {True: False, False: False}
