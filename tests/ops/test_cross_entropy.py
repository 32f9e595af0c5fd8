"""Cross entropy kernel against ``F.cross_entropy`` in float64.

Tolerances: the loss is accumulated in float32 from logits that the reference sees exactly
(the bf16 logits upcast), so it matches the float64 reference to float32 rounding scaled by
the row count, whatever the logits dtype. The gradient is stored in the logits dtype: for
bf16 each element is rounded once (relative error <= 2**-8), so it is compared with the
bf16 tolerance relative to the gradient's largest entry; for fp32 to a few ulps of it, plus
at each target entry the fp32 cancellation of ``p_y - 1`` (``fp32_target_cancellation``).
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.cross_entropy import (
    CrossEntropyConfig,
    LigerCrossEntropyFunction,
    cross_entropy_forward,
)
from liger_kernel.reference.losses import cross_entropy as reference_cross_entropy
from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss, liger_cross_entropy
from tests.utils import DEVICE, shapes, target_onehot_coefficients, tolerance

SHAPES = shapes(
    small=[(13, 1007), (37, 2), (5, 4096)],
    full=[(4099, 32003), (257, 131072), (17, 262144), (1024, 128256)],
)


@pytest.fixture(params=["one_block", "many_blocks", "many_blocks_no_prefetch"])
def column_block(request):
    """Also run with a tiny column block so small vocabularies take the multi-block loop,
    with and without the one-block-ahead loads."""
    fields = {}
    if request.param.startswith("many_blocks"):
        fields["max_block"] = 256
    if request.param.endswith("no_prefetch"):
        fields["prefetch"] = False
    with override_launch_config(CrossEntropyConfig, **fields):
        yield request.param


def assert_grad_close(actual, expected, dtype, msg="", tol_scale=1.0, extra=None):
    """Gradient comparison relative to the gradient's scale (see the module docstring), plus
    an optional per-entry allowance ``extra``."""
    tol = tolerance(dtype, tol_scale)
    if expected.numel() == 0:
        assert actual.shape == expected.shape, msg
        return
    scale = float(expected.abs().max()) or 1.0
    if extra is None:
        torch.testing.assert_close(
            actual.double(),
            expected.double(),
            atol=tol["atol"] * scale,
            rtol=tol["rtol"],
            msg=lambda m: f"{msg}\n{m}",
        )
        return
    allowed = tol["atol"] * scale + tol["rtol"] * expected.double().abs() + extra
    error = (actual.double() - expected.double()).abs()
    worst = int(torch.argmax(error - allowed))
    assert bool((error <= allowed).all()), (
        f"{msg}: entry {worst} off by {float(error.flatten()[worst]):.3g}, allowed {float(allowed.flatten()[worst]):.3g}")


def fp32_target_cancellation(target, weight, upstream, reduction, ignore_index, label_smoothing, lse, n_cols):
    """Extra fp32 allowance at each row's target entry ``c_i (p_iy - 1)`` (``c_i`` the one-hot
    coefficient ``|dL/dloss_i| (1 - eps) w_y / D``, ``lse`` the rows' float64 log-sum-exp).

    Where ``p_iy`` is within ~1e-7 of 1 that difference cancels: formed in fp32, as the kernel
    and torch's own softmax-minus-one-hot backward form it, ``s_y - lse`` is already rounded
    to an ulp of ``lse`` (``2**-24 |lse|``) and ``exp`` adds a few ulps of 1, so the entry is off
    by up to ``~2**-24 (|lse| + 4) c_i``, however small it is itself (torch fp32 errs by 5%
    at ``p_y = 1 - 3.4e-7``; the GPU kernel, with its approximate exp, gave 0 there). Twice
    that is allowed.
    """
    safe, coef = target_onehot_coefficients(target, weight, upstream, reduction, ignore_index, label_smoothing)
    extra = lse.new_zeros((target.shape[0], n_cols))
    rows = torch.arange(target.shape[0], device=target.device)
    extra[rows, safe] = 2.0 * 2.0**-24 * (lse.abs() + 4.0) * coef
    return extra


def assert_loss_close(actual, expected, n_rows, msg=""):
    # float32 accumulation over n_rows rows of O(log V) terms, then one rounding to the
    # loss's dtype (half an ulp, relative; nothing more for a float32 loss).
    rounding = torch.finfo(actual.dtype).eps / 2 if actual.dtype != torch.float32 else 0.0
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        atol=1e-5 * max(1, n_rows) ** 0.5,
        rtol=2e-5 + rounding,
        msg=lambda m: f"{msg}\n{m}",
    )


def make_inputs(n_rows, n_cols, dtype, ignore_index=-100, ignore_fraction=0.25, scale=3.0):
    logits = (torch.randn(n_rows, n_cols, device=DEVICE) * scale).to(dtype)
    target = torch.randint(0, n_cols, (n_rows,), device=DEVICE)
    ignored = torch.rand(n_rows, device=DEVICE) < ignore_fraction
    target = torch.where(ignored, torch.full_like(target, ignore_index), target)
    if n_rows > 1:
        target[0] = torch.randint(0, n_cols, ()).item()  # at least one counted row
    return logits, target


def upstream_for(loss):
    return torch.randn_like(loss) if loss.dim() else torch.rand((), device=loss.device) + 0.5


def run_and_compare(
    logits,
    target,
    *,
    weight=None,
    ignore_index=-100,
    label_smoothing=0.0,
    reduction="mean",
    softcap=None,
    lse_square_scale=0.0,
    in_place=True,
    grad_tol_scale=1.0,
):
    """Forward + backward of the kernel and of the reference; compares loss, z-loss, accuracy, grad."""
    ref_input = logits.detach().double().requires_grad_()
    ref_loss, ref_z, ref_acc = reference_cross_entropy(
        ref_input, target, weight, ignore_index, label_smoothing, reduction, softcap, lse_square_scale
    )
    # An upstream gradient the loss's dtype holds exactly, so that both sides see the same one.
    upstream = upstream_for(ref_loss).to(logits.dtype).double()
    ref_loss.backward(upstream)

    x = logits.detach().clone().requires_grad_()
    out = liger_cross_entropy(
        # A temporary (nothing else can read it): with in_place the gradient overwrites it.
        x.clone() if in_place else x,
        target,
        weight=weight,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        return_z_loss=True,
        return_token_accuracy=True,
        in_place=in_place,
    )
    assert out.loss.dtype == out.z_loss.dtype == logits.dtype  # torch's loss dtype
    out.loss.backward(upstream.to(logits.dtype))
    n_rows = logits.shape[0]
    assert_loss_close(out.loss, ref_loss, n_rows, "loss")
    assert_loss_close(out.z_loss, ref_z, n_rows, "z_loss")
    torch.testing.assert_close(out.token_accuracy.double(), ref_acc, atol=1e-6, rtol=0)
    assert x.grad.dtype == logits.dtype
    extra = None
    if logits.dtype == torch.float32:
        capped = softcap * torch.tanh(ref_input.detach() / softcap) if softcap else ref_input.detach()
        extra = fp32_target_cancellation(target, weight, upstream, reduction, ignore_index, label_smoothing,
                                         torch.logsumexp(capped, dim=-1), logits.shape[1])
    assert_grad_close(x.grad, ref_input.grad, logits.dtype, "grad", grad_tol_scale, extra)
    return x


@pytest.mark.parametrize("n_rows, n_cols", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("use_weight", [False, True])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_matches_torch(n_rows, n_cols, dtype, reduction, use_weight, label_smoothing):
    logits, target = make_inputs(n_rows, n_cols, dtype)
    weight = torch.rand(n_cols, device=DEVICE) + 0.1 if use_weight else None
    run_and_compare(logits, target, weight=weight, label_smoothing=label_smoothing, reduction=reduction)


@pytest.mark.parametrize("n_rows, n_cols", shapes(small=[(11, 1007)], full=[(512, 128256)]))
@pytest.mark.parametrize("softcap, lse_square_scale", [(30.0, 0.0), (None, 1e-3), (3.0, 1e-2)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softcap_and_z_loss(n_rows, n_cols, softcap, lse_square_scale, reduction, column_block):
    logits, target = make_inputs(n_rows, n_cols, torch.float32, scale=10.0)
    weight = torch.rand(n_cols, device=DEVICE) + 0.1
    run_and_compare(
        logits,
        target,
        weight=weight,
        label_smoothing=0.05,
        reduction=reduction,
        softcap=softcap,
        lse_square_scale=lse_square_scale,
    )


@pytest.mark.parametrize("ignore_index", [-100, 0, 5])
def test_ignore_index_values(ignore_index, column_block):
    # ignore_index inside [0, V) is a real class id that must be skipped, not scored.
    logits, target = make_inputs(17, 300, torch.float32, ignore_index=ignore_index, ignore_fraction=0.4)
    run_and_compare(logits, target, ignore_index=ignore_index, label_smoothing=0.1)


def test_token_accuracy_ties_pick_first_index():
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[0, [2, 5]] = 4.0  # tie: argmax is 2
    logits[1, [2, 5]] = 4.0
    logits[2, 7] = 1.0
    target = torch.tensor([2, 5, 7], device=DEVICE)
    out = liger_cross_entropy(logits, target, reduction="none", return_token_accuracy=True)
    assert out.token_accuracy.tolist() == [1.0, 0.0, 1.0]
    assert out.z_loss is None


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_ignored_gives_zero_loss_and_grad(reduction, dtype):
    logits = torch.randn(6, 513, device=DEVICE, dtype=dtype, requires_grad=True)
    target = torch.full((6,), -100, device=DEVICE)
    weight = torch.rand(513, device=DEVICE)
    out = liger_cross_entropy(
        logits,
        target,
        weight=weight,
        reduction=reduction,
        label_smoothing=0.1,
        lse_square_scale=1e-3,
        return_z_loss=True,
        return_token_accuracy=True,
    )
    out.loss.sum().backward()
    for value in out:
        assert torch.isfinite(value).all() and (value == 0).all()
    assert (logits.grad == 0).all()


def saved_gradient_pointers():
    """A saved-tensor hook that records the data pointer of every tensor autograd saves (the
    loss saves its gradient: the logits' own memory when it overwrote them)."""
    pointers = []
    return pointers, torch.autograd.graph.saved_tensors_hooks(lambda t: pointers.append(t.data_ptr()) or t,
                                                              lambda t: t)


def temporary_setup():
    """bf16 logits and targets, a leaf ``x`` holding the logits, the saved-gradient pointer
    hook, and ``temporary()``: a fresh ``x * 1.0`` that nothing else references, whose data
    pointer it records in ``made``."""
    logits, target = make_inputs(9, 1007, torch.bfloat16)
    x = logits.clone().requires_grad_()
    pointers, hook = saved_gradient_pointers()
    made = []

    def temporary():
        t = x * 1.0
        made.append(t.data_ptr())
        return t

    return logits, target, x, pointers, hook, made, temporary


ENTRY_POINTS = {
    "functional": lambda logits, target: liger_cross_entropy(logits, target, label_smoothing=0.1),
    "module": LigerCrossEntropyLoss(label_smoothing=0.1),
    "function": lambda logits, target: LigerCrossEntropyFunction.apply(logits, target, None, -100, 0.0, 0.1)[0],
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_overwrites_a_temporary_when_asked(entry):
    """The memory saving is the caller's to ask for (``in_place=True``: nothing reads the logits
    afterwards): the gradient the loss keeps for backward is then the logits' own memory. The
    gradient is right."""
    logits, target, x, pointers, hook, made, temporary = temporary_setup()
    with hook:
        if entry == "functional":
            loss = liger_cross_entropy(temporary(), target, label_smoothing=0.1, in_place=True)
        elif entry == "module":
            loss = LigerCrossEntropyLoss(label_smoothing=0.1, in_place=True)(temporary(), target)
        else:
            loss = LigerCrossEntropyFunction.apply(temporary(), target, None, -100, 0.0, 0.1, "mean", None, False,
                                                   True)[0]
    assert made[0] in pointers, "the logits were not overwritten although the caller asked"
    loss.backward()
    ref = logits.double().requires_grad_()
    ref_loss = reference_cross_entropy(ref, target, label_smoothing=0.1)[0]
    ref_loss.backward()
    assert_loss_close(loss, ref_loss, 9)
    assert_grad_close(x.grad, ref.grad, torch.bfloat16)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_never_overwrites_by_default(entry):
    """Without ``in_place=True`` even a temporary nobody else holds keeps its values: the
    gradient takes its own buffer (no guessing who holds what)."""
    logits, target, x, pointers, hook, made, temporary = temporary_setup()
    with hook:
        loss = ENTRY_POINTS[entry](temporary(), target)
    assert made[0] not in pointers
    loss.backward()
    ref = logits.double().requires_grad_()
    reference_cross_entropy(ref, target, label_smoothing=0.1)[0].backward()
    assert_grad_close(x.grad, ref.grad, torch.bfloat16)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_second_use_of_held_logits_gives_torch_value(entry):
    """Logits the caller still holds keep their values: a second loss (or any function) on
    them gives torch's value, and the first loss's gradient is right too."""
    loss_fn = ENTRY_POINTS[entry]
    logits, target = make_inputs(9, 1007, torch.float32)
    x = logits.clone().requires_grad_()
    held = x * 1.0
    first = loss_fn(held, target)
    assert torch.equal(held.detach(), logits)
    second = F.cross_entropy(held, target, label_smoothing=0.1)
    torch.testing.assert_close(first, second, rtol=1e-5, atol=1e-6)
    assert torch.equal(loss_fn(held, target), first)
    (first + second).backward()
    ref = logits.double().requires_grad_()
    (2 * reference_cross_entropy(ref, target, label_smoothing=0.1)[0]).backward()
    assert_grad_close(x.grad, ref.grad, torch.float32, extra=1e-7)


@pytest.mark.parametrize("keep", ["hook_keeps_output", "hook_keeps_detached_alias", "base_of_a_view",
                                  "loss_module_forward_hook"])
def test_logits_someone_else_can_read_are_not_overwritten(keep):
    """A forward hook that keeps the logits (or a ``.detach()`` alias of them), the tensor they
    are a view of, or a forward hook of the loss module itself (which receives the logits only
    after the loss ran) still reads the logits' values afterwards; the gradient is right."""
    logits, target = make_inputs(6, 300, torch.float32)
    x = logits.clone().requires_grad_()
    head = torch.nn.Identity()
    kept = []
    if keep == "base_of_a_view":
        kept.append((x * 1.0).view(2, 3, 300))
        loss = liger_cross_entropy(kept[0].view(6, 300), target)
    elif keep == "loss_module_forward_hook":
        # Built with in_place=True: the module still leaves the logits alone while a hook of
        # its own (or a global one) receives them.
        loss_fn = LigerCrossEntropyLoss(in_place=True)
        loss_fn.register_forward_hook(lambda module, args, out: kept.append(args[0]))
        loss = loss_fn(x * 1.0, target)
    else:
        detach = keep == "hook_keeps_detached_alias"
        head.register_forward_hook(lambda module, args, out: kept.append(out.detach() if detach else out))
        loss = LigerCrossEntropyLoss()(head(x * 1.0), target)
    assert torch.equal(kept[0].detach().reshape(6, 300), logits)
    loss.backward()
    ref = logits.double().requires_grad_()
    reference_cross_entropy(ref, target)[0].backward()
    assert_grad_close(x.grad, ref.grad, torch.float32, extra=1e-7)


def test_no_grad_leaves_logits_untouched():
    logits, target = make_inputs(5, 333, torch.float32)
    copy = logits.clone()
    with torch.no_grad():
        loss = liger_cross_entropy(logits, target)
    assert torch.equal(logits, copy)
    assert_loss_close(loss, reference_cross_entropy(logits, target)[0], 5)


def test_logits_saved_by_another_op_are_not_overwritten():
    # exp saves its output for backward: by default those logits keep their values, so its backward runs.
    x = torch.randn(4, 50, device=DEVICE, requires_grad=True)
    x_ref = x.detach().double().requires_grad_()
    target = torch.randint(0, 50, (4,), device=DEVICE)
    liger_cross_entropy(torch.exp(x), target).backward()
    reference_cross_entropy(torch.exp(x_ref), target)[0].backward()
    assert_grad_close(x.grad, x_ref.grad, torch.float32, extra=1e-7)


def test_broken_in_place_promise_fails_loudly():
    """``in_place=True`` on logits another op saved (exp saves its output) breaks the promise:
    the overwrite bumps their version, so exp's backward raises instead of using the gradient."""
    x = torch.randn(4, 50, device=DEVICE, requires_grad=True)
    target = torch.randint(0, 50, (4,), device=DEVICE)
    loss = liger_cross_entropy(torch.exp(x), target, in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_second_backward_raises():
    logits, target = make_inputs(4, 64, torch.float32)
    logits.requires_grad_()
    loss = liger_cross_entropy(logits, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


def test_non_contiguous_and_odd_stride_logits():
    base = torch.randn(7, 1100, device=DEVICE)
    logits = base[:, :1007]  # row stride 1100
    target = torch.randint(0, 1007, (7,), device=DEVICE)
    run_and_compare(logits, target, in_place=True, label_smoothing=0.1)
    transposed = torch.randn(1007, 7, device=DEVICE).t()  # column stride != 1
    run_and_compare(transposed, target)
    expanded = torch.randn(1, 1007, device=DEVICE).expand(7, 1007)  # rows alias: not written in place
    run_and_compare(expanded, target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_logits_are_finite(dtype, column_block):
    n_rows, n_cols = 8, 700
    logits = torch.randn(n_rows, n_cols, device=DEVICE) * 1e4
    target = torch.randint(0, n_cols, (n_rows,), device=DEVICE)
    blocked = torch.rand(n_rows, n_cols, device=DEVICE) < 0.5
    blocked[torch.arange(n_rows), target] = False
    blocked[0, :300] = True  # a whole leading column block is -inf
    blocked[0, target[0]] = False
    logits = logits.masked_fill(blocked, float("-inf")).to(dtype)
    # exp(x - lse) with |x| ~ 1e4 inherits lse's float32 rounding, |x| * 2**-24 ~ 6e-4
    # relative: the gradient's tolerance is scaled to that (the loss needs no such slack).
    x = run_and_compare(logits, target, reduction="sum", lse_square_scale=1e-4, grad_tol_scale=100.0)
    assert torch.isfinite(x.grad).all()
    # with a cap, -inf logits become -softcap and still give finite results
    run_and_compare(logits, target, softcap=20.0, label_smoothing=0.1)


def test_empty_batch():
    logits = torch.randn(0, 50, device=DEVICE, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long, device=DEVICE)
    for reduction in ("mean", "sum"):
        loss = liger_cross_entropy(logits, target, reduction=reduction, in_place=False)
        assert loss.item() == 0.0
        loss.backward()
    assert logits.grad.shape == (0, 50)
    assert liger_cross_entropy(logits, target, reduction="none").shape == (0,)


def test_bad_target_raises():
    logits = torch.randn(4, 10, device=DEVICE)
    for bad in (10, -1, 1000):
        target = torch.tensor([1, bad, 2, -100], device=DEVICE)
        with pytest.raises(ValueError, match="outside"):
            liger_cross_entropy(logits, target)


def test_kernel_is_out_of_bounds_safe():
    # Called without the host check (as under torch.compile): bad rows get NaN loss,
    # good rows are untouched, and no memory outside the row is read or written.
    n_rows, n_cols = 4, 10
    storage = torch.randn(n_rows + 2, n_cols, device=DEVICE)
    logits = storage[1:-1]
    guard_before, guard_after = storage[0].clone(), storage[-1].clone()
    target = torch.tensor([3, 10, -5, 1 << 40], device=DEVICE)
    loss, _, _, grad = cross_entropy_forward(
        logits, target, None, -100, 0.0, 0.0, 0.0, "none", True, True
    )
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1:]).all()
    assert torch.equal(storage[0], guard_before) and torch.equal(storage[-1], guard_after)
    assert torch.isfinite(grad).all()
    assert_loss_close(loss[0], F.cross_entropy(logits[:1].double(), target[:1]), 1)


def test_bad_arguments_raise():
    logits = torch.randn(4, 10, device=DEVICE)
    target = torch.randint(0, 10, (4,), device=DEVICE)
    with pytest.raises(TypeError, match="target"):
        liger_cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match="target"):
        liger_cross_entropy(logits, target.view(2, 2))
    with pytest.raises(ValueError, match="rows"):
        liger_cross_entropy(logits, target[:3])
    with pytest.raises(ValueError, match="weight"):
        liger_cross_entropy(logits, target, weight=torch.ones(9, device=DEVICE))
    with pytest.raises(TypeError, match="input"):
        liger_cross_entropy(logits.long(), target)
    with pytest.raises(ValueError, match="2-D"):
        liger_cross_entropy(logits.view(2, 2, 10), target)
    with pytest.raises(ValueError, match="reduction"):
        liger_cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        liger_cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap"):
        liger_cross_entropy(logits, target, softcap=-1.0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_non_contiguous_class_weight(reduction, label_smoothing):
    """A strided weight (every other element of a buffer) counts with its own values, not
    the buffer's first V: the same loss and gradient as its contiguous copy, and as torch."""
    logits, target = make_inputs(9, 101, torch.float32)
    weight = (torch.rand(2 * 101, device=DEVICE) + 0.1)[::2]
    assert not weight.is_contiguous()
    upstream = torch.randn(9, device=DEVICE) if reduction == "none" else torch.tensor(1.5, device=DEVICE)
    results = []
    for w in (weight, weight.contiguous()):
        x = logits.clone().requires_grad_()
        loss = liger_cross_entropy(x, target, weight=w, reduction=reduction, label_smoothing=label_smoothing)
        loss.backward(upstream)
        results.append((loss.detach(), x.grad))
    (strided_loss, strided_grad), (dense_loss, dense_grad) = results
    assert torch.equal(strided_loss, dense_loss) and torch.equal(strided_grad, dense_grad)
    run_and_compare(logits, target, weight=weight, reduction=reduction, label_smoothing=label_smoothing)


@pytest.mark.parametrize("ignore_index", [-100.5, -100.0, True, torch.tensor(-100.0), torch.tensor([-100]), "-100"])
def test_non_integer_ignore_index_raises(ignore_index):
    # int() would truncate -100.5 to -100 (or read True as 1) and ignore other targets than meant.
    logits, target = make_inputs(4, 10, torch.float32)
    with pytest.raises(TypeError, match="ignore_index"):
        LigerCrossEntropyFunction.apply(logits.clone().requires_grad_(), target, None, ignore_index)


@pytest.mark.parametrize("ignore_index", [3, torch.tensor(3), torch.tensor(3, dtype=torch.int32)])
def test_integer_ignore_index_forms(ignore_index):
    logits, target = make_inputs(11, 10, torch.float32, ignore_index=3, ignore_fraction=0.4)
    run_and_compare(logits, target, ignore_index=ignore_index)


def test_int32_target():
    logits, target = make_inputs(9, 400, torch.float32)
    run_and_compare(logits, target.int(), label_smoothing=0.1, weight=torch.rand(400, device=DEVICE))


def test_function_apply_directly():
    logits, target = make_inputs(6, 123, torch.float32)
    x = logits.clone().requires_grad_()
    loss, z_loss, accuracy = LigerCrossEntropyFunction.apply(x, target)
    loss.backward()
    ref = logits.double().requires_grad_()
    F.cross_entropy(ref, target).backward()
    assert_grad_close(x.grad, ref.grad, torch.float32)


def test_torch_compile_fullgraph_matches_eager():
    logits, target = make_inputs(9, 257, torch.float32)
    weight = torch.rand(257, device=DEVICE)

    def fn(x, t):
        return liger_cross_entropy(
            x * 2.0,
            t,
            weight=weight,
            label_smoothing=0.1,
            lse_square_scale=1e-3,
            softcap=10.0,
            return_z_loss=True,
        )

    eager_x = logits.clone().requires_grad_()
    compiled_x = logits.clone().requires_grad_()
    eager = fn(eager_x, target)
    compiled = torch.compile(fn, fullgraph=True)(compiled_x, target)
    eager.loss.backward()
    compiled.loss.backward()
    torch.testing.assert_close(compiled.loss, eager.loss)
    torch.testing.assert_close(compiled.z_loss, eager.z_loss)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)


def test_compiled_forward_declares_no_mutation():
    """The traced forward never overwrites the logits, so it calls the op that declares no
    mutation (a mutating op inside an autograd Function's forward is functionalised into a
    copy of the logits). The gradient is that of the loss, not zeros: see
    ``tests/ops/test_compiled_function_outputs.py`` for the traced-output check."""
    from torch._dynamo.backends.common import aot_autograd

    forward_graphs = []

    def record(gm, example_inputs):
        forward_graphs.append(gm.code)
        return gm

    logits, target = make_inputs(5, 33, torch.float32)
    x = logits.clone().requires_grad_()
    compiled = torch.compile(lambda x, t: liger_cross_entropy(x * 2.0, t, lse_square_scale=1e-3),
                             backend=aot_autograd(fw_compiler=record, bw_compiler=lambda gm, _: gm), fullgraph=True)
    compiled(x, target).backward()
    (code,) = forward_graphs
    assert "liger.cross_entropy_forward.default" in code and "auto_functionalized" not in code, code
    assert x.grad.abs().sum() > 0


@settings(max_examples=15, deadline=None)
@given(
    n_rows=st.integers(1, 20),
    n_cols=st.integers(2, 600),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    use_weight=st.booleans(),
    label_smoothing=st.sampled_from([0.0, 0.2, 1.0]),
    softcap=st.sampled_from([None, 5.0]),
    lse_square_scale=st.sampled_from([0.0, 1e-2]),
    ignore_fraction=st.sampled_from([0.0, 0.5, 1.0]),
    in_place=st.booleans(),
)
def test_property_random_options(
    n_rows,
    n_cols,
    dtype,
    reduction,
    use_weight,
    label_smoothing,
    softcap,
    lse_square_scale,
    ignore_fraction,
    in_place,
):
    logits = (torch.randn(n_rows, n_cols, device=DEVICE) * 4).to(dtype)
    target = torch.randint(0, n_cols, (n_rows,), device=DEVICE)
    target[torch.rand(n_rows, device=DEVICE) < ignore_fraction] = -100
    weight = torch.rand(n_cols, device=DEVICE) + 0.1 if use_weight else None
    if reduction == "mean" and bool((target == -100).all()):
        # torch's mean is NaN here; ours is 0 (documented), checked in the all-ignored test.
        target[0] = 0
    run_and_compare(
        logits,
        target,
        weight=weight,
        label_smoothing=label_smoothing,
        reduction=reduction,
        softcap=softcap,
        lse_square_scale=lse_square_scale,
        in_place=in_place,
    )


@pytest.mark.gpu_only
def test_past_int32_offsets():
    n_cols = 262144
    n_rows = 2**31 // n_cols + 8
    need = n_rows * n_cols * 2 * 1.3
    if DEVICE != "cuda" or torch.cuda.mem_get_info()[0] < need:
        pytest.skip("needs a GPU with ~6 GiB free")
    logits = torch.randn(n_rows, n_cols, device=DEVICE, dtype=torch.bfloat16)
    target = torch.randint(0, n_cols, (n_rows,), device=DEVICE)
    tail = slice(n_rows - 8, n_rows)
    tail_logits = logits[tail].clone()
    x = logits.requires_grad_()
    loss = liger_cross_entropy(x, target, reduction="none")
    loss.backward(torch.ones_like(loss))
    ref_input = tail_logits.double().requires_grad_()
    ref = F.cross_entropy(ref_input, target[tail], reduction="none")
    ref.sum().backward()
    assert_loss_close(loss[tail], ref, 1)
    assert_grad_close(x.grad[tail], ref_input.grad, torch.bfloat16)
    del x, logits, loss
    torch.cuda.empty_cache()


def test_in_place_gradient_is_not_copied_into_leaf_grad():
    # The gradient buffer goes to a leaf's .grad as is, not as an (N, V) clone (which would
    # double the memory the loss saves).
    logits, target = make_inputs(6, 257, torch.float32)
    logits.requires_grad_()
    pointers, hook = saved_gradient_pointers()
    with hook:
        loss = liger_cross_entropy(logits, target)
    loss.backward()
    assert logits.grad.data_ptr() in pointers
