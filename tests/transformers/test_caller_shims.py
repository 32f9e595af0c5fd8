"""The import paths callers use beside our own (axolotl 0.19, ms-swift): each shim works with the
callers' semantics, against float64 references or the Hugging Face module it stands for."""

import importlib.util
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.ops.test_cross_entropy import assert_grad_close, assert_loss_close
from tests.utils import DEVICE


def test_ops_launch_helpers():
    from liger_kernel.ops.utils import (
        calculate_settings,
        compare_version,
        ensure_contiguous,
        torch_to_triton_dtype,
    )

    for n in (1, 7, 4096, 4097, 65536):
        block, warps = calculate_settings(n)
        assert block >= n and block & (block - 1) == 0 and block < 2 * n + 1 and warps >= 1
    with pytest.raises(RuntimeError, match="65537"):
        calculate_settings(65537)
    assert compare_version("torch", operator.ge, "2.0.0")
    assert not compare_version("torch", operator.lt, "2.0.0")
    assert not compare_version("no_such_package_here", operator.ge, "0.0")
    assert set(torch_to_triton_dtype) == {torch.float32, torch.float16, torch.bfloat16}

    @ensure_contiguous
    def forward(ctx, x, scale=1.0, y=None):
        return x.is_contiguous(), y.is_contiguous(), scale

    strided = torch.randn(4, 6)[:, ::2]
    assert forward(None, strided, 2.0, y=strided.t()) == (True, True, 2.0)


def test_environment_facts():
    from liger_kernel.ops.backends.registry import IMPL_REGISTRY
    from liger_kernel.utils import PEFT_AVAILABLE, is_npu_available

    assert PEFT_AVAILABLE == (importlib.util.find_spec("peft") is not None)
    npu = getattr(torch, "npu", None)
    assert is_npu_available() == bool(npu is not None and npu.is_available())
    assert IMPL_REGISTRY == {}  # one implementation: the Triton kernels


@pytest.mark.parametrize("mode", ["mean", "num_items", "shift_labels", "softcap"])
def test_liger_for_causal_lm_loss_is_hf_causal_lm_loss(mode):
    """``LigerForCausalLMLoss(hidden_states, lm_head_weight, labels, hidden_size, ...)`` equals HF's
    ``ForCausalLMLoss`` of the materialised logits (float64), values and gradients; keywords the
    fused loss does not take (a Trainer's loss kwargs) are ignored."""
    from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss

    batch, seq, hidden, vocab = 2, 7, 16, 53
    h = torch.randn(batch, seq, hidden, device=DEVICE, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=DEVICE) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), device=DEVICE)
    labels[1, :3] = -100
    kwargs = {"position_ids": None, "cu_seq_lens_q": None}
    softcap = 2.0 if mode == "softcap" else None
    num_items = 9 if mode == "num_items" else None
    shift = None
    if mode == "shift_labels":
        shift = torch.randint(0, vocab, (batch, seq), device=DEVICE)
        shift[0, -2:] = -100
    loss = LigerForCausalLMLoss(h, w, None if shift is not None else labels, hidden, num_items_in_batch=num_items,
                                shift_labels=shift, final_logit_softcapping=softcap, **kwargs)
    ref_h, ref_w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = ref_h @ ref_w.t()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    targets = shift if shift is not None else F.pad(labels, (0, 1), value=-100)[:, 1:]
    ref = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="sum" if num_items else "mean")
    if num_items:
        ref = ref / num_items
    loss.backward()
    ref.backward()
    assert_loss_close(loss, ref, batch * seq)
    assert_grad_close(h.grad, ref_h.grad, torch.float32)
    assert_grad_close(w.grad, ref_w.grad, torch.float32)


class _Wrapper(nn.Module):
    """An FSDP (v1)-like wrapper: its forward runs hooks around the wrapped module's forward."""

    def __init__(self, module):
        super().__init__()
        self._fsdp_wrapped_module = module
        self.events = []

    def forward(self, *args, **kwargs):
        self.events.append("pre")
        out = self._fsdp_wrapped_module(*args, **kwargs)
        self.events.append("post")
        return out


def test_fsdp_forward_redirection_runs_the_method_inside_the_wrapper():
    from liger_kernel.transformers.trainer.orpo_trainer import _FSDPForwardRedirection

    head = nn.Linear(4, 3, device=DEVICE)
    wrapper = _Wrapper(head)
    x = torch.randn(2, 4, device=DEVICE)

    def method(module, inputs, scale=1.0):
        wrapper.events.append("method")
        assert module.forward.__func__ is nn.Linear.forward  # the real forward is back for the method
        return module(inputs) * scale

    out = _FSDPForwardRedirection()(wrapper, method, head, x, scale=2.0)
    torch.testing.assert_close(out, head(x) * 2.0)
    assert wrapper.events == ["pre", "method", "post"]
    assert "forward" not in vars(head)

    def failing(*args):
        raise KeyError("inside")

    with pytest.raises(KeyError):
        _FSDPForwardRedirection()(wrapper, failing, x)
    assert "forward" not in vars(head)
    with pytest.raises(TypeError, match="FSDP"):
        _FSDPForwardRedirection()(head, method, head, x)


@pytest.mark.parametrize("variant", ["gemma2", "gemma4", "gemma4_scale_free"])
def test_gemma_norm_classes_match_hf(variant):
    pytest.importorskip("transformers")
    from liger_kernel.transformers.rms_norm import LigerRMSNormForGemma2, LigerRMSNormForGemma4

    hidden = 48
    if variant == "gemma2":
        from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

        ours, theirs = LigerRMSNormForGemma2(hidden, eps=1e-6), Gemma2RMSNorm(hidden, eps=1e-6)
        assert ours.in_place is False
    else:
        gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
        with_scale = variant == "gemma4"
        ours = LigerRMSNormForGemma4(hidden if with_scale else None, eps=1e-6, with_scale=with_scale)
        theirs = gemma4.Gemma4RMSNorm(hidden, eps=1e-6, with_scale=with_scale)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours, theirs = ours.to(DEVICE), theirs.to(DEVICE)
    if "weight" in ours.state_dict():
        with torch.no_grad():
            theirs.weight.normal_()
            ours.weight.copy_(theirs.weight)
    x = torch.randn(3, 5, hidden, device=DEVICE, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    dy = torch.randn(3, 5, hidden, device=DEVICE)
    ours(x).backward(dy)
    expected = theirs(ref_x)
    expected.backward(dy)
    torch.testing.assert_close(ours(x), expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(x.grad, ref_x.grad, atol=2e-5, rtol=1e-4)
    if "weight" in ours.state_dict():
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, atol=2e-5, rtol=1e-4)
