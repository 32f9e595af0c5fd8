"""LigerRMSNorm against the Hugging Face norms it replaces (LlamaRMSNorm, GemmaRMSNorm, Qwen3RMSNorm).

fp32: the Liger module and the HF module agree to fp32 tolerances in output and in the
input and weight gradients. bf16: outputs agree to ~2 bf16 ulps (the fp32 rstd can differ
in its last bit, flipping an occasional rounding) and gradients to bf16 tolerance scaled
for the row and column reductions. The kernel math itself is tested in tests/ops.
"""

import types

import pytest
import torch

from liger_kernel.transformers.rms_norm import LigerRMSNorm, liger_rms_norm
from tests.transformers.model_configs import MODEL_TYPES, VOCAB, build_model, random_batch
from tests.utils import (
    DEVICE,
    ReplayedDropout,
    assert_close,
    forward_backward_with_output_edit,
)

transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

HIDDEN = 123


def liger_like(kind, hidden, dtype, eps=1e-6):
    if kind == "gemma":
        return LigerRMSNorm(hidden, eps=eps, offset=1.0, casting_mode="gemma", init_fn="zeros").to(DEVICE, dtype)
    return LigerRMSNorm(hidden, eps=eps).to(DEVICE, dtype)


def hf_like(kind, hidden, dtype, eps=1e-6):
    cls = {"llama": LlamaRMSNorm, "qwen3": Qwen3RMSNorm, "gemma": GemmaRMSNorm}[kind]
    return cls(hidden, eps=eps).to(DEVICE, dtype)


def forward_backward(module, x, dy):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad()
    y = module(x)
    y.backward(dy.clone())  # a copy: the in-place backward overwrites it
    return y.detach(), x.grad, module.weight.grad.clone()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, HIDDEN), (2, 5, 3, 64)])
def test_matches_hf_module(kind, dtype, shape):
    hidden = shape[-1]
    ours, hf = liger_like(kind, hidden, dtype), hf_like(kind, hidden, dtype)
    with torch.no_grad():
        hf.weight.normal_(0.0 if kind == "gemma" else 1.0, 0.5)
        ours.weight.copy_(hf.weight)
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    dy = torch.randn(shape, device=DEVICE, dtype=dtype)
    y, dx, dw = forward_backward(ours, x, dy)
    y_ref, dx_ref, dw_ref = forward_backward(hf, x, dy)
    assert y.dtype == y_ref.dtype and dw.dtype == dw_ref.dtype
    n_rows = x.numel() // hidden
    assert_close(y, y_ref, msg="y")
    assert_close(dx, dx_ref, scale=4, msg="dx")
    # HF's bf16 dw is a bf16 sum over rows; ours is summed in fp32 and rounded once.
    assert_close(dw, dw_ref, scale=max(4, n_rows ** 0.5), msg="dw")


def test_module_attributes():
    norm = LigerRMSNorm(16, eps=1e-5)
    assert "RMSNorm" in type(norm).__name__
    assert isinstance(norm.weight, torch.nn.Parameter) and torch.equal(norm.weight, torch.ones(16))
    assert norm.variance_epsilon == 1e-5 and norm.eps == 1e-5
    norm.eps = 1e-3
    assert norm.variance_epsilon == 1e-3
    assert (norm.offset, norm.casting_mode, norm.in_place) == (0.0, "llama", False)
    assert "casting_mode='llama'" in repr(norm) and "eps=0.001" in repr(norm)
    gemma = LigerRMSNorm(16, offset=1.0, casting_mode="gemma", init_fn="zeros", in_place=True)
    assert torch.equal(gemma.weight, torch.zeros(16)) and gemma.in_place is True
    with pytest.raises(ValueError, match="init_fn"):
        LigerRMSNorm(16, init_fn="normal")
    with pytest.raises(ValueError, match="casting_mode"):
        LigerRMSNorm(16, casting_mode="fp8")


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_forward_bound_onto_hf_instance(kind):
    """The patcher may bind LigerRMSNorm.forward onto HF norms (variance_epsilon or eps)."""
    hf = hf_like(kind, HIDDEN, torch.float32, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.5)
    x = torch.randn(3, 4, HIDDEN, device=DEVICE)
    dy = torch.randn(3, 4, HIDDEN, device=DEVICE)
    expected = forward_backward(hf, x, dy)
    if kind == "gemma":
        hf.offset, hf.casting_mode = 1.0, "gemma"
    hf.forward = types.MethodType(LigerRMSNorm.forward, hf)
    got = forward_backward(hf, x, dy)
    for name, a, e in zip(("y", "dx", "dw"), got, expected):
        assert_close(a, e, scale=4, msg=name)


def test_functional_matches_module():
    norm = LigerRMSNorm(HIDDEN, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, HIDDEN, device=DEVICE)
    assert torch.equal(liger_rms_norm(x, norm.weight, 1e-5), norm(x))


def test_torch_compile_fullgraph():
    """One compiled graph (the norm is an opaque custom op) matching eager, in-place backward included."""
    norm = LigerRMSNorm(64, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    scale = torch.randn(2, 5, 64, device=DEVICE)

    def loss_fn(x):
        # (norm(x) * scale).sum() gives the norm a fresh, contiguous grad: the in-place path.
        return (norm(x * 2.0) * scale).sum()

    x = torch.randn(2, 5, 64, device=DEVICE, requires_grad=True)
    eager = loss_fn(x)
    eager_grads = torch.autograd.grad(eager, [x, norm.weight])
    compiled = torch.compile(loss_fn, fullgraph=True)(x)
    compiled_grads = torch.autograd.grad(compiled, [x, norm.weight])
    # Inductor reorders the surrounding fp32 sum; the norm itself is the same kernel.
    assert_close(compiled, eager, scale=10, msg="loss")
    for name, a, e in zip(("dx", "dw"), compiled_grads, eager_grads):
        assert_close(a, e, scale=4, msg=name)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_patched_models_write_norm_gradients_in_place(model_type, monkeypatch):
    """In a patched model each decoder-layer norm the patch marks ``in_place`` (its output is an
    intermediate nobody else receives) writes dx over dy - the memory the option exists for -
    and the final norm, whose output the model hands out, does not. Observed in
    ``rms_norm_backward``, which is told the decision."""
    import liger_kernel.ops.rms_norm as rms_norm_ops
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    model = build_model(model_type, seed=1)
    _apply_liger_kernel_to_instance(model)
    model.train()
    in_place = [getattr(module, "in_place", True) for module in model.modules()
                if getattr(module.forward, "__func__", None) is LigerRMSNorm.forward]
    assert in_place
    decided = []

    def recording_backward(*args):
        decided.append(args[-1])
        return rms_norm_backward(*args)

    rms_norm_backward = rms_norm_ops.rms_norm_backward
    monkeypatch.setattr(rms_norm_ops, "rms_norm_backward", recording_backward)
    batch = random_batch(VOCAB, seed=0)
    model(**batch).loss.backward()
    assert sorted(decided) == sorted(in_place), f"written in place: {decided}, asked for: {in_place}"
    assert in_place.count(True) == len(in_place) - 1 or not any(in_place)  # all but the final norm


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("edit", ["hook", "dropout"])
def test_output_edited_in_place_like_hf(edit, in_place):
    """A forward hook that edits the norm's output in place (activation steering), or an
    in-place dropout after it: works forward and backward as with HF's module."""
    steer = torch.randn(HIDDEN, device=DEVICE)
    x = torch.randn(2, 7, HIDDEN, device=DEVICE)
    dy = torch.randn(2, 7, HIDDEN, device=DEVICE)
    results = []
    dropout = ReplayedDropout()
    for module in (liger_like("llama", HIDDEN, torch.float32), hf_like("llama", HIDDEN, torch.float32)):
        if isinstance(module, LigerRMSNorm):
            module.in_place = in_place
        with torch.no_grad():
            module.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN))
        results.append((*forward_backward_with_output_edit(module, x, dy, edit, steer, dropout), module.weight.grad))
    for name, ours, ref in zip(("y", "dx", "dw"), *results):
        assert_close(ours, ref, scale=4, msg=name)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_device_module(kind, dtype):
    """A module built on the meta device (meta-device model init, shape inference) gives meta
    outputs and gradients of HF's shapes and dtypes."""
    with torch.device("meta"):
        ours = LigerRMSNorm(HIDDEN, eps=1e-6, offset=1.0 if kind == "gemma" else 0.0,
                            casting_mode=kind, init_fn="zeros" if kind == "gemma" else "ones").to(dtype)
        hf = {"llama": LlamaRMSNorm, "gemma": GemmaRMSNorm}[kind](HIDDEN, eps=1e-6).to(dtype)
    x = torch.empty(2, 5, HIDDEN, device="meta", dtype=dtype, requires_grad=True)
    y, y_ref = ours(x), hf(x)
    assert y.device.type == "meta" and y.shape == y_ref.shape and y.dtype == y_ref.dtype
    y.sum().backward()
    assert x.grad.device.type == "meta" and x.grad.shape == x.shape and x.grad.dtype == dtype
    assert ours.weight.grad.shape == ours.weight.shape and ours.weight.grad.dtype == dtype
