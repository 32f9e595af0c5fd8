"""Fused linear cross entropy against ``F.cross_entropy(x @ W.T + b)`` in float64.

Tolerances. fp32: the logits are one fp32 GEMM and the kernel is float32, so losses and
gradients agree with a float64 reference to float32 rounding (relative to each gradient's
largest entry, since many entries of dW are sums that cancel), plus, per entry, the float32
cancellation of the target entry ``p_y - 1`` (see ``fp32_cancellation_bound``): when every
``p_y`` of a batch is near 1 all gradients are small and that one absolute unit dominates.

bf16: like the HF recipe, the logits are a bf16 GEMM output, so the reference evaluates the
loss and its logit gradient ``G`` in float64 *at those bf16 logits* (rounded by the same
GEMM calls, see ``chunked_low_precision_logits``), then forms
``dX = G W``, ``dW = G^T X``, ``dB = sum_i G_i`` in float64. Our ``G`` is rounded to bf16
(unit roundoff u = 2**-8) and every product is accumulated in fp32 and rounded to bf16
once, except dW, which (without ``accum_dtype=float32``) is re-rounded after each chunk. The
standard componentwise bound for a product of rounded factors then gives
``|ours - ref| <= k * u * (|G|^T |X|)`` (resp. ``|G| |W|``, ``sum |G|``), with ``k = 2`` for
dX, dB and fp32-accumulated dW, and ``k = chunks + 1`` for bf16-accumulated dW, one more
for ``"mean"``/``"sum"`` (their gradients are stored in bf16 by the forward and rounded
again when backward multiplies them by the upstream gradient), plus one more unit because the target entry ``p_y - 1`` cancels in float32 when ``p_y`` is near 1
(observed up to ~2.2u for dX). Under Triton's interpreter the kernel's bf16 store
truncates instead of rounding, so G's unit counts double there (``G_ROUNDOFF``). The
loss at those logits is float32-accurate for every dtype.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import liger_kernel.ops.fused_linear_cross_entropy as flce_ops
import liger_kernel.ops.head_chunking as head_chunking
from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
from liger_kernel.ops.head_chunking import HeadChunkConfig, chunk_rows_for, gradient_bytes
from liger_kernel.ops.launch import is_interpreter
from liger_kernel.reference.losses import cross_entropy as reference_cross_entropy
from liger_kernel.transformers.fused_linear_cross_entropy import liger_fused_linear_cross_entropy
from tests.ops.test_cross_entropy import assert_grad_close, assert_loss_close
from tests.utils import DEVICE, FULL_SHAPES, shapes, target_onehot_coefficients

SHAPES = shapes(
    small=[(23, 32, 1007), (5, 16, 2), (19, 64, 300)],
    full=[(4099, 512, 32003), (1024, 4096, 128256), (257, 1024, 262144)],
)

# Each set fixes whether there is a bias, to keep the CPU run short.
OPTION_SETS = {
    "plain": {"with_bias": False},
    "bias_weighted_smoothing": {"with_bias": True, "use_class_weight": True, "label_smoothing": 0.1},
    "bias_softcap_z_loss": {"with_bias": True, "softcap": 15.0, "lse_square_scale": 1e-3},
    "ignore_3": {"with_bias": False, "ignore_index": 3, "label_smoothing": 0.05},
}


@pytest.fixture
def four_row_chunks():
    """Chunks of 4 rows, so small problems cross several chunk boundaries (and a ragged last one)."""
    with override_launch_config(HeadChunkConfig, max_chunk_rows=4):
        yield


def make_problem(n_rows, hidden, vocab, dtype, with_bias, ignore_index=-100, ignore_fraction=0.25):
    x = torch.randn(n_rows, hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, hidden, device=DEVICE) / hidden**0.5 * 2).to(dtype)
    bias = torch.randn(vocab, device=DEVICE).to(dtype) if with_bias else None
    target = torch.randint(0, vocab, (n_rows,), device=DEVICE)
    target[torch.rand(n_rows, device=DEVICE) < ignore_fraction] = ignore_index
    if n_rows:
        target[0] = torch.randint(0, vocab, ()).item()
    return x, weight, bias, target


def reference(x, lin_weight, bias, target, upstream_like=None, floor_bytes=0, **options):
    """float64 reference: (loss, z_loss, accuracy, [grads], bf16-only (hf_loss, bounds)).

    fp32 inputs: autograd through ``x @ W.T + b`` in float64. Low-precision inputs: loss and
    logit gradient at the logits ``F.linear`` gives in that dtype (see module docstring),
    with the componentwise error bounds of each gradient.
    """
    x64, w64 = x.detach().double(), lin_weight.detach().double()
    b64 = bias.detach().double() if bias is not None else None
    if x.dtype == torch.float32:
        leaves = [t.requires_grad_() for t in (x64, w64) + ((b64,) if b64 is not None else ())]
        logits = leaves[0] @ leaves[1].t() + (leaves[2] if b64 is not None else 0)
        loss, z_loss, accuracy = reference_cross_entropy(logits, target, **options)
        upstream = make_upstream(loss)
        loss.backward(upstream)
        return loss, z_loss, accuracy, upstream, [t.grad for t in leaves], None
    logits = chunked_low_precision_logits(x.detach(), lin_weight.detach(), bias, floor_bytes).double().requires_grad_()
    loss, z_loss, accuracy = reference_cross_entropy(logits, target, **options)
    upstream = make_upstream(loss)
    loss.backward(upstream)
    g = logits.grad
    grads = [g @ w64, g.t() @ x64, g.sum(0)]
    bounds = [g.abs() @ w64.abs(), g.abs().t() @ x64.abs(), g.abs().sum(0)]
    return loss, z_loss, accuracy, upstream, grads, bounds


def chunked_low_precision_logits(x, lin_weight, bias, floor_bytes):
    """``x @ W.T + b`` in the input dtype by the same GEMM calls on the same row chunks as the op.

    A GEMM's bf16 rounding can depend on its shape (blocking, split-K), and one bf16 ulp of
    a logit near 4 (2**-6) moves its probability by 1.6%, so the reference must round the
    logits exactly as the op does; what is tested is everything after that rounding.
    """
    n_rows = x.shape[0]
    step = flce_ops.chunk_rows_for(n_rows, lin_weight.shape[0], x.element_size(), floor_bytes) if n_rows else 1
    chunks = []
    with flce_ops.gemm_reduction_precision():  # the op's GEMM settings, so the roundings agree
        for start in range(0, n_rows, step):
            rows = x[start : start + step]
            chunks.append(
                torch.matmul(rows, lin_weight.t()) if bias is None else torch.addmm(bias, rows, lin_weight.t())
            )
    return torch.cat(chunks) if chunks else x.new_empty((0, lin_weight.shape[0]))


# The kernel's fp32 -> bf16 store rounds to nearest on the GPU, but Triton's interpreter
# truncates (round toward zero, error up to 2**-7), so G's rounding is worth twice as much there.
G_ROUNDOFF = 2.0**-7 if is_interpreter() else 2.0**-8
BF16_ROUNDOFF = 2.0**-8


def componentwise_bound_units(output_roundings):
    """k * u of the module docstring: G's rounding, the outputs' roundings, one unit for p_y - 1."""
    return G_ROUNDOFF + output_roundings * BF16_ROUNDOFF + BF16_ROUNDOFF


def fp32_cancellation_bound(name, x, weight, target, upstream, class_weight, reduction, ignore_index=-100,
                            label_smoothing=0.0, **_):
    """Extra fp32 allowance for the target entry ``G_iy = c_i (p_iy - 1)`` of the logit gradient.

    Where ``p_iy`` is near 1 that difference cancels: computed in float32 (as torch's own
    softmax-minus-one-hot backward does) it carries an absolute error of about one unit
    ``u = 2**-24`` of ``c_i``, the row's one-hot coefficient ``|dL/dloss_i| (1 - eps) w_y / D``,
    however small ``G_iy`` itself is. Propagated through the GEMMs that is ``2u c_i |W_y|``
    for dX, ``2u c_i |x_i|`` in dW's row y and ``2u sum c_i`` for dB (a cap's slope is <= 1).
    """
    safe, coef = target_onehot_coefficients(target, class_weight, upstream, reduction, ignore_index, label_smoothing)
    onehot = torch.zeros(target.shape[0], weight.shape[0], dtype=torch.float64, device=target.device)
    onehot[torch.arange(target.shape[0], device=target.device), safe] = coef
    unit = 2.0 * 2.0**-24
    if name == "input":
        return unit * onehot @ weight.detach().double().abs()
    if name == "weight":
        return unit * onehot.t() @ x.detach().double().abs()
    return unit * onehot.sum(0)


def make_upstream(loss):
    return (
        torch.randn_like(loss) if loss.dim() else torch.rand((), device=loss.device, dtype=loss.dtype) + 0.5
    )


def run_and_compare(
    x,
    weight,
    bias,
    target,
    reduction="mean",
    use_class_weight=False,
    accum_dtype=None,
    requires=(True, True, True),
    grad_tol_scale=1.0,
    **options,
):
    n_rows, vocab = x.shape[0], weight.shape[0]
    class_weight = torch.rand(vocab, device=DEVICE) + 0.1 if use_class_weight else None
    ref_options = dict(weight=class_weight, reduction=reduction, **options)
    floor_bytes = gradient_bytes(x, weight, requires[0], requires[1])  # the op's chunks
    loss_ref, z_ref, acc_ref, upstream, ref_grads, bounds = reference(x, weight, bias, target,
                                                                      floor_bytes=floor_bytes, **ref_options)

    inputs = [x, weight] + ([bias] if bias is not None else [])
    leaves = [t.detach().clone().requires_grad_(need) for t, need in zip(inputs, requires)]
    n_chunks = -(-n_rows // flce_ops.chunk_rows_for(n_rows, vocab, x.element_size(), floor_bytes)) if n_rows else 0
    out = liger_fused_linear_cross_entropy(
        leaves[0],
        leaves[1],
        target,
        bias=leaves[2] if bias is not None else None,
        ce_weight=class_weight,
        reduction=reduction,
        accum_dtype=accum_dtype,
        return_z_loss=True,
        return_token_accuracy=True,
        **options,
    )
    assert out.loss.dtype == torch.float32
    if any(t.requires_grad for t in leaves):
        out.loss.backward(upstream.float())
    if x.dtype == torch.float32:
        assert_loss_close(out.loss, loss_ref, n_rows, "loss")
        assert_loss_close(out.z_loss, z_ref, n_rows, "z_loss")
        torch.testing.assert_close(out.token_accuracy.double(), acc_ref, atol=1e-6, rtol=0)
    else:
        # Same bf16 logits on both sides (see chunked_low_precision_logits): float32 accuracy.
        assert_loss_close(out.loss, loss_ref, n_rows, "loss at the bf16 logits")
    for index, (name, leaf, ref) in enumerate(zip(("input", "weight", "bias"), leaves, ref_grads)):
        if not leaf.requires_grad:
            assert leaf.grad is None
            continue
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape
        if x.dtype == torch.float32:
            assert_grad_close(leaf.grad, ref, torch.float32, f"grad {name}", grad_tol_scale,
                              fp32_cancellation_bound(name, x, weight, target, upstream, class_weight, reduction,
                                                      **options))
            continue
        output_roundings = n_chunks if name == "weight" and accum_dtype is None else 1
        if reduction != "none":
            output_roundings += 1  # backward rounds again after scaling by the upstream gradient
        allowed = componentwise_bound_units(output_roundings) * bounds[index] + 1e-12
        excess = ((leaf.grad.double() - ref).abs() - allowed).max()
        assert excess <= 0, f"grad {name}: exceeds the componentwise bound by {float(excess):.3g}"
    return out, leaves


@pytest.mark.parametrize("n_rows, hidden, vocab", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", list(OPTION_SETS), ids=list(OPTION_SETS))
def test_matches_torch(n_rows, hidden, vocab, dtype, reduction, options):
    # Small problems use 8-row chunks to cross chunk boundaries; full shapes the real budget.
    small = vocab < 1024 or not FULL_SHAPES
    options = dict(OPTION_SETS[options])
    with_bias = options.pop("with_bias")
    x, weight, bias, target = make_problem(
        n_rows, hidden, vocab, dtype, with_bias, ignore_index=options.get("ignore_index", -100)
    )
    with override_launch_config(HeadChunkConfig, max_chunk_rows=8 if small else None):
        run_and_compare(x, weight, bias, target, reduction=reduction, **options)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(
    "requires",
    [(False, True, True), (True, False, False), (False, False, True)],
    ids=["input_no_grad", "frozen_weight_and_bias", "bias_only"],
)
def test_partial_grads(reduction, requires, monkeypatch, four_row_chunks):
    x, weight, bias, target = make_problem(11, 24, 301, torch.float32, True)
    if not requires[1]:

        def fail(*args):
            raise AssertionError("dW must not be computed for a frozen weight")

        # Fault injection (no configuration can say "never called").
        monkeypatch.setattr(flce_ops, "accumulate_grad_weight", fail)
    run_and_compare(x, weight, bias, target, reduction=reduction, label_smoothing=0.1, requires=requires)


def test_frozen_weight_without_bias_gives_input_grad_only(four_row_chunks):
    x, weight, _, target = make_problem(9, 16, 200, torch.bfloat16, False)
    run_and_compare(x, weight, None, target, requires=(True, False))


def test_grad_accumulation_over_micro_batches(four_row_chunks):
    x, weight, bias, target = make_problem(14, 24, 333, torch.float32, True)
    full_w = weight.clone().requires_grad_()
    full_b = bias.clone().requires_grad_()
    liger_fused_linear_cross_entropy(x, full_w, target, bias=full_b, reduction="sum").backward()

    micro_w = weight.clone().requires_grad_()
    micro_b = bias.clone().requires_grad_()
    for rows in (slice(0, 6), slice(6, 14)):
        loss = liger_fused_linear_cross_entropy(x[rows], micro_w, target[rows], bias=micro_b, reduction="sum")
        loss.backward()
    assert_grad_close(micro_w.grad, full_w.grad, torch.float32, "accumulated dW")
    assert_grad_close(micro_b.grad, full_b.grad, torch.float32, "accumulated dB")


def test_fp32_accumulation_for_bf16(four_row_chunks):
    x, weight, _, target = make_problem(37, 32, 500, torch.bfloat16, False, ignore_fraction=0.0)
    _, _, _, upstream, (_, ref_dw, _), (_, bound_dw, _) = reference(x, weight, None, target, reduction="sum",
                                                                 floor_bytes=gradient_bytes(x, weight, True, True))
    errors = {}
    for accum in (None, torch.float32):
        w = weight.clone().requires_grad_()
        loss = liger_fused_linear_cross_entropy(x, w, target, reduction="sum", accum_dtype=accum)
        loss.backward(upstream.float())
        assert w.grad.dtype == torch.bfloat16
        errors[accum] = float(((w.grad.double() - ref_dw).abs() / (bound_dw + 1e-12)).max())
    # float32 accumulation leaves two roundings (G, final dW) plus the p_y - 1 unit (see top).
    assert errors[torch.float32] <= componentwise_bound_units(1)
    assert errors[torch.float32] <= errors[None]


def test_fp32_accumulation_fallback_path(monkeypatch, four_row_chunks):
    # The vocabulary-sliced fallback used where addmm(out_dtype=float32) is unavailable.
    head_chunking._fp32_out_addmm_works.cache_clear()
    monkeypatch.setattr(head_chunking, "_fp32_out_addmm_works", lambda device, dtype: False)
    x, weight, _, target = make_problem(13, 16, 401, torch.bfloat16, False)
    run_and_compare(x, weight, None, target, accum_dtype=torch.float32, label_smoothing=0.1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_grads(reduction, four_row_chunks):
    x, weight, bias, target = make_problem(7, 16, 100, torch.float32, True)
    target.fill_(-100)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    out = liger_fused_linear_cross_entropy(
        *leaves[:2],
        target,
        bias=leaves[2],
        reduction=reduction,
        label_smoothing=0.1,
        lse_square_scale=1e-3,
        return_z_loss=True,
        return_token_accuracy=True,
    )
    out.loss.sum().backward()
    for value in out:
        assert torch.isfinite(value).all() and (value == 0).all()
    for leaf in leaves:
        assert (leaf.grad == 0).all()


def test_reshaped_hidden_states_view(four_row_chunks):
    # HF passes hidden_states[:, :-1].reshape(-1, H), a copy of a strided view.
    hidden = torch.randn(3, 9, 32, device=DEVICE, requires_grad=True)
    weight = torch.randn(250, 32, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, 250, (3, 8), device=DEVICE)
    shifted = hidden[:, :-1].reshape(-1, 32)
    loss = liger_fused_linear_cross_entropy(shifted, weight, labels.reshape(-1), reduction="sum")
    loss.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = F.cross_entropy(h64[:, :-1].reshape(-1, 32) @ w64.t(), labels.reshape(-1), reduction="sum")
    ref.backward()
    assert_loss_close(loss, ref, 24)
    assert_grad_close(hidden.grad, h64.grad, torch.float32)
    assert_grad_close(weight.grad, w64.grad, torch.float32)
    assert (hidden.grad[:, -1] == 0).all()


def test_large_logits_are_finite(four_row_chunks):
    x, weight, bias, target = make_problem(9, 16, 300, torch.float32, True)
    x, bias = x * 300, bias * 1e3
    # Logits of ~1e3-1e4: exp(z - lse) inherits the float32 rounding of z and lse, about
    # max|z| * 2**-24 relative, so the fp32 gradient tolerance (1e-5) is scaled to that.
    max_logit = float((x.double() @ weight.double().t() + bias.double()).abs().max())
    grad_tol_scale = max(1.0, 4 * max_logit * 2.0**-24 / 1e-5)
    out, leaves = run_and_compare(x, weight, bias, target, reduction="sum", grad_tol_scale=grad_tol_scale)
    assert all(torch.isfinite(leaf.grad).all() for leaf in leaves)


def test_autocast_casts_operands():
    x, weight, _, target = make_problem(8, 32, 64, torch.float32, False)
    w = weight.clone().requires_grad_()
    with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
        loss = liger_fused_linear_cross_entropy(x, w, target)
    loss.backward()
    assert w.grad.dtype == torch.float32
    # The same as running on the bf16-cast operands (upstream 1 here; the reference draws
    # its own upstream, so compare with the gradient divided by it).
    low_x, low_w = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    ref_loss, _, _, upstream, (_, ref_dw, _), (_, bound_dw, _) = reference(low_x, low_w, None, target,
                                                                        floor_bytes=gradient_bytes(low_x, low_w, True, True))
    assert_loss_close(loss, ref_loss, 8)
    # the cast back to fp32 is exact, so the fp32 grad carries the bf16 bound (4-row chunks).
    allowed = componentwise_bound_units(2) * bound_dw + 1e-12
    excess = ((w.grad.double() * upstream - ref_dw).abs() - allowed).max()
    assert excess <= 0


def test_empty_batch():
    x = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(30, 8, device=DEVICE, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long, device=DEVICE)
    loss = liger_fused_linear_cross_entropy(x, weight, target)
    assert loss.item() == 0.0
    loss.backward()
    assert x.grad.shape == (0, 8) and (weight.grad == 0).all()


def test_chunk_rows_for_budget():
    config = HeadChunkConfig.heuristic()
    assert (config.budget_fraction, config.min_budget_bytes) == (0.75, 128 * 2**20)
    # The target shape: 3/4 of its 1066 MiB gradients hold 3197 rows; three balanced chunks of
    # 2731 rows, rounded up to 2752.
    floor = 128256 * 4096 * 2 + 8192 * 4096 * 2
    rows = chunk_rows_for(8192, 128256, 2, floor)
    assert rows == 2752 and rows * 128256 * 2 <= 0.75 * floor
    # No gradients: the 128 MiB minimum (523 rows), balanced over the 16 chunks it takes.
    assert chunk_rows_for(8192, 128256, 2) == 512
    assert chunk_rows_for(10, 128256, 2) == 10
    assert chunk_rows_for(8192, 262144 * 256, 4) == 1
    # Balanced: 1000 rows at most 700 a chunk is two chunks of 500, rounded up to 512 where that fits.
    with override_launch_config(HeadChunkConfig, budget_bytes=700 * 1007 * 4):
        assert chunk_rows_for(1000, 1007, 4) == 512
    with override_launch_config(HeadChunkConfig, budget_bytes=510 * 1007 * 4):
        assert chunk_rows_for(1000, 1007, 4) == 500
    with override_launch_config(HeadChunkConfig, max_chunk_rows=5):
        assert chunk_rows_for(1000, 1007, 4) == 5
    with override_launch_config(HeadChunkConfig, budget_bytes=3 * 1007 * 4):
        assert chunk_rows_for(1000, 1007, 4) == 3


def test_bad_arguments_raise():
    x, weight, bias, target = make_problem(4, 8, 10, torch.float32, True)
    with pytest.raises(ValueError, match="hidden size"):
        liger_fused_linear_cross_entropy(x, weight[:, :7], target)
    with pytest.raises(TypeError, match="same dtype"):
        liger_fused_linear_cross_entropy(x, weight.bfloat16(), target)
    with pytest.raises(ValueError, match="bias"):
        liger_fused_linear_cross_entropy(x, weight, target, bias=bias[:9])
    with pytest.raises(ValueError, match="outside"):
        liger_fused_linear_cross_entropy(x, weight, torch.tensor([0, 1, 10, 2], device=DEVICE))
    with pytest.raises(ValueError, match="rows"):
        liger_fused_linear_cross_entropy(x, weight, target[:3])
    with pytest.raises(TypeError, match="target"):
        liger_fused_linear_cross_entropy(x, weight, target.float())
    with pytest.raises(ValueError, match="ce_weight"):
        liger_fused_linear_cross_entropy(x, weight, target, ce_weight=torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="2-D"):
        liger_fused_linear_cross_entropy(x.view(2, 2, 8), weight, target)
    with pytest.raises(ValueError, match="accum_dtype"):
        liger_fused_linear_cross_entropy(x, weight, target, accum_dtype=torch.float16)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_non_contiguous_ce_weight(reduction, four_row_chunks):
    """A strided ce_weight (every other element of a buffer) counts with its own values: the
    same loss and gradients as its contiguous copy, and as torch (``"none"`` also reads it
    again in backward)."""
    x, weight, bias, target = make_problem(11, 16, 67, torch.float32, True)
    ce_weight = (torch.rand(2 * 67, device=DEVICE) + 0.1)[::2]
    assert not ce_weight.is_contiguous()
    upstream = torch.randn(11, device=DEVICE) if reduction == "none" else torch.tensor(1.5, device=DEVICE)
    results = []
    for w in (ce_weight, ce_weight.contiguous()):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
        loss = liger_fused_linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2], ce_weight=w,
                                                label_smoothing=0.1, reduction=reduction)
        loss.backward(upstream)
        results.append([loss.detach()] + [t.grad for t in leaves])
    for strided, dense in zip(*results):
        assert torch.equal(strided, dense)
    refs = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    ref_loss = F.cross_entropy(refs[0] @ refs[1].t() + refs[2], target, weight=ce_weight.double(),
                               label_smoothing=0.1, reduction=reduction)
    ref_loss.backward(upstream.double())
    assert_loss_close(results[0][0], ref_loss, 11, "loss")
    for name, got, ref in zip(("input", "weight", "bias"), results[0][1:], refs):
        extra = fp32_cancellation_bound(name, x, weight, target, upstream.double(), ce_weight, reduction,
                                        label_smoothing=0.1)
        assert_grad_close(got, ref.grad, torch.float32, f"grad {name}", extra=extra)


@pytest.mark.parametrize("ignore_index", [-100.5, -100.0, True, torch.tensor(-100.0), torch.tensor([-100])])
def test_non_integer_ignore_index_raises(ignore_index):
    # int() would truncate -100.5 to -100 (or read True as 1) and ignore other targets than meant.
    x, weight, _, target = make_problem(4, 8, 10, torch.float32, False)
    with pytest.raises(TypeError, match="ignore_index"):
        LigerFusedLinearCrossEntropyFunction.apply(x, weight.clone().requires_grad_(), target, None, None,
                                                   ignore_index)


def test_function_apply_directly(four_row_chunks):
    x, weight, _, target = make_problem(6, 8, 40, torch.float32, False)
    w = weight.clone().requires_grad_()
    loss, _, _ = LigerFusedLinearCrossEntropyFunction.apply(x, w, target)
    loss.backward()
    w64 = weight.double().requires_grad_()
    F.cross_entropy(x.double() @ w64.t(), target).backward()
    assert_grad_close(w.grad, w64.grad, torch.float32)


def test_torch_compile_fullgraph_matches_eager(four_row_chunks):
    x, weight, bias, target = make_problem(9, 16, 130, torch.float32, True)

    def fn(h, w, b, t):
        return liger_fused_linear_cross_entropy(h * 1.5, w, t, bias=b, label_smoothing=0.1, softcap=20.0)

    eager = [t.clone().requires_grad_() for t in (x, weight, bias)]
    compiled = [t.clone().requires_grad_() for t in (x, weight, bias)]
    loss_eager = fn(*eager, target)
    loss_compiled = torch.compile(fn, fullgraph=True)(*compiled, target)
    loss_eager.backward()
    loss_compiled.backward()
    torch.testing.assert_close(loss_compiled, loss_eager)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad)


@settings(max_examples=12, deadline=None)
@given(
    n_rows=st.integers(1, 17),
    hidden=st.integers(1, 40),
    vocab=st.integers(2, 300),
    chunk=st.integers(1, 8),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    with_bias=st.booleans(),
    use_class_weight=st.booleans(),
    label_smoothing=st.sampled_from([0.0, 0.3]),
    softcap=st.sampled_from([None, 8.0]),
    lse_square_scale=st.sampled_from([0.0, 1e-2]),
)
def test_property_random_options(
    n_rows,
    hidden,
    vocab,
    chunk,
    dtype,
    reduction,
    with_bias,
    use_class_weight,
    label_smoothing,
    softcap,
    lse_square_scale,
):
    original = flce_ops.chunk_rows_for
    flce_ops.chunk_rows_for = lambda rows, cols, size, *_: max(1, min(chunk, rows))
    try:
        x, weight, bias, target = make_problem(n_rows, hidden, vocab, dtype, with_bias)
        run_and_compare(
            x,
            weight,
            bias,
            target,
            reduction=reduction,
            use_class_weight=use_class_weight,
            label_smoothing=label_smoothing,
            softcap=softcap,
            lse_square_scale=lse_square_scale,
        )
    finally:
        flce_ops.chunk_rows_for = original


@pytest.mark.gpu_only
def test_peak_memory_within_floor():
    n_rows, hidden, vocab = 8192, 4096, 128256
    if DEVICE != "cuda" or torch.cuda.mem_get_info()[0] < 8 * 2**30:
        pytest.skip("needs a GPU with 8 GiB free")
    x = torch.randn(n_rows, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, hidden, device=DEVICE) * 0.02).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (n_rows,), device=DEVICE)
    # A first call on a small problem: cuBLAS's per-process workspace (32 MiB on Hopper)
    # is allocated by the first GEMM and would otherwise count as this op's memory.
    liger_fused_linear_cross_entropy(x[:256], weight[:4096], target[:256] % 4096).backward()
    x.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = liger_fused_linear_cross_entropy(x, weight, target)
    loss.backward()
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - base
    floor = (vocab * hidden + n_rows * hidden) * 2
    # The gradients, one logits chunk of the shared budget, and O(N + V) besides.
    chunk = chunk_rows_for(n_rows, vocab, 2, floor) * vocab * 2
    assert peak_extra <= floor + chunk + 8 * 2**20 and peak_extra <= 2.0 * floor, (
        f"peak extra {peak_extra / 2**20:.0f} MiB vs floor {floor / 2**20:.0f} MiB + chunk {chunk / 2**20:.0f} MiB"
    )


@pytest.mark.gpu_only
def test_past_int32_rows_times_vocab():
    n_rows, hidden, vocab = 2**31 // 262144 + 8, 64, 262144
    if DEVICE != "cuda" or torch.cuda.mem_get_info()[0] < 4 * 2**30:
        pytest.skip("needs a GPU with 4 GiB free")
    x, weight, _, target = make_problem(n_rows, hidden, vocab, torch.float32, False, ignore_fraction=0.0)
    loss = liger_fused_linear_cross_entropy(x, weight, target, reduction="none")
    tail = slice(n_rows - 8, n_rows)
    ref = F.cross_entropy(x[tail].double() @ weight.double().t(), target[tail], reduction="none")
    assert_loss_close(loss[tail], ref, 1)



@pytest.mark.parametrize("bad", [-1, 10, 2**40])
@pytest.mark.parametrize("class_weights", [False, True])
def test_bad_target_raises_after_the_chunks_without_touching_inputs(bad, class_weights, four_row_chunks):
    """The range check's verdict is awaited after the chunk loop is queued (so the GPU is
    not drained first): a bad target in a later chunk still raises, naming the index, and
    leaves the inputs and any existing weight gradient untouched."""
    x, weight, _, target = make_problem(11, 8, 10, torch.float32, False)
    target[9] = bad
    weight = weight.detach().requires_grad_(True)
    weight.grad = torch.ones_like(weight)
    x_before, weight_before = x.detach().clone(), weight.detach().clone()
    ce_weight = torch.rand(10, device=DEVICE) + 0.5 if class_weights else None
    with pytest.raises(ValueError, match=f"class index {bad} outside"):
        liger_fused_linear_cross_entropy(x, weight, target, ce_weight=ce_weight)
    assert torch.equal(x.detach(), x_before) and torch.equal(weight.detach(), weight_before)
    assert torch.equal(weight.grad, torch.ones_like(weight))
