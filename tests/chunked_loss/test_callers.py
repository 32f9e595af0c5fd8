"""What callers import and call, and the preference losses used the way their callers use them
(TRL's DPO and KTO trainers, the functional forms, and subclasses of the base in the style
downstream projects write).

``CALLERS`` lists, per caller release, every ``(module, name)`` its source imports from
``liger_kernel`` and the keywords (or number of positional arguments) of each call it makes,
read from the released packages (``pip download --no-deps``: trl 1.0.0 and 1.12.0, axolotl
0.19.0, llamafactory 0.9.5, ms-swift 4.6.0, verl 0.9.1, openrlhf 0.11.2). A rename or a dropped
keyword on our side fails here before it breaks a caller.
"""

import importlib
import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from liger_kernel.chunked_loss import (
    LigerFusedLinearDPOLoss,
    LigerFusedLinearKTOLoss,
    LigerFusedLinearPreferenceBase,
    liger_fused_linear_dpo,
)
from liger_kernel.chunked_loss.functional import liger_fused_linear_kto
from tests.chunked_loss.test_preference import make_batch, make_ref_head
from tests.utils import DEVICE


def test_trl_dpo_call():
    """TRL's ``_compute_loss_liger``: positional ``(weight, hidden, labels, bias, ref_hidden, ref_weight,
    ref_bias)``, a bias-free head, and seven metrics."""
    x, weight, _, target = make_batch(4, 6, 16, 41, torch.float32, with_bias=False)
    ref_x, ref_w, _ = make_ref_head(x, weight, None)
    hidden = x.requires_grad_()
    lm_weight = weight.requires_grad_()
    loss_fn = LigerFusedLinearDPOLoss(beta=0.1, loss_type="sigmoid")
    loss, metrics = loss_fn(lm_weight, hidden, target, None, ref_x, ref_w, None)
    chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss, chosen_r, rejected_r = metrics
    assert chosen_logps.shape == rejected_logps.shape == chosen_r.shape == rejected_r.shape == (2,)
    assert chosen_logits_mean.dim() == rejected_logits_mean.dim() == nll_loss.dim() == 0
    loss.backward()
    assert hidden.grad.shape == hidden.shape and lm_weight.grad.shape == lm_weight.shape


def test_trl_kto_call_on_a_sliced_hidden_state():
    """TRL's KTO passes ``last_hidden_state[:, :-1]`` (not contiguous) by keyword and unpacks six sums."""
    x, weight, bias, target = make_batch(3, 5, 16, 23, torch.float32, with_bias=True)
    full = torch.randn(3, 6, 16, device=DEVICE, requires_grad=True)
    ref_x, ref_w, ref_b = make_ref_head(x, weight, bias)
    loss_fn = LigerFusedLinearKTOLoss(beta=0.1, use_ref_model=True)
    loss, (c_logps, r_logps, c_logits, r_logits, c_rewards, r_rewards) = loss_fn(
        _input=full[:, :-1], lin_weight=weight, target=target, bias=bias,
        preference_labels=torch.tensor([True, False, True], device=DEVICE), ref_input=ref_x, ref_weight=ref_w,
        ref_bias=ref_b, kl=torch.zeros(1, device=DEVICE))
    for m in (c_logps, r_logps, c_logits, r_logits, c_rewards, r_rewards):
        assert m.dim() == 0
    loss.backward()
    assert full.grad.shape == full.shape and bool((full.grad[:, -1] == 0).all())


def test_functional_forms_take_the_function_arguments():
    x, weight, bias, target = make_batch(4, 3, 8, 19, torch.float32, with_bias=True)
    module_loss, _ = LigerFusedLinearDPOLoss(beta=0.3, use_ref_model=False)(weight, x, target, bias)
    loss, metrics = liger_fused_linear_dpo(x, weight, target, bias, None, None, None, -100, 0.3, False, True, False)
    torch.testing.assert_close(loss, module_loss)
    labels = torch.tensor([True, False, False, True], device=DEVICE)
    loss, metrics = liger_fused_linear_kto(x, weight, target, labels, bias, None, None, None, None, -100, 0.1, True,
                                           False)
    assert loss.dim() == 0 and len(metrics) == 6


class ReferenceFreeSigmoid(LigerFusedLinearPreferenceBase):
    """A downstream subclass in the documented style."""

    @staticmethod
    def preference_loss_fn(chosen_logps, rejected_logps, full_target, beta=0.1, margin=0.0):
        losses = -F.logsigmoid(beta * (chosen_logps - rejected_logps) - margin)
        return losses.sum() / (full_target.shape[0] // 2), chosen_logps - rejected_logps

    @classmethod
    def forward(cls, ctx, _input, weight, target, bias=None, beta=0.1, margin=0.0):
        return super().forward(cls=cls, ctx=ctx, _input=_input, weight=weight, target=target, bias=bias, beta=beta,
                               compute_nll_loss=False, average_log_prob=False, margin=margin)

    @staticmethod
    def backward(ctx, *grad_output):
        grads = LigerFusedLinearPreferenceBase.backward(ctx, grad_output)[:4]
        return *grads, None, None


def test_subclass_matches_dpo_without_reference():
    x, weight, bias, target = make_batch(6, 4, 8, 17, torch.float32, with_bias=True)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    loss, metrics = ReferenceFreeSigmoid.apply(*leaves[:2], target, leaves[2], 0.4)
    loss.backward()
    assert metrics[-1].shape == (3,)
    expected = [t.clone().requires_grad_() for t in (x, weight, bias)]
    dpo_loss, _ = LigerFusedLinearDPOLoss(beta=0.4, use_ref_model=False)(expected[1], expected[0], target, expected[2])
    dpo_loss.backward()
    torch.testing.assert_close(loss, dpo_loss)
    for a, b in zip(leaves, expected):
        torch.testing.assert_close(a.grad, b.grad)


def test_bad_arguments_raise():
    x, weight, bias, target = make_batch(4, 3, 8, 19, torch.float32, with_bias=True)
    with pytest.raises(ValueError, match="loss_type"):
        LigerFusedLinearDPOLoss(loss_type="nope")
    with pytest.raises(ValueError, match="exo_pair"):
        LigerFusedLinearDPOLoss(loss_type="exo_pair")
    with pytest.raises(ValueError, match="f_divergence_type"):
        LigerFusedLinearDPOLoss(f_divergence_type="hellinger")
    with pytest.raises(ValueError, match="f_divergence_type"):
        LigerFusedLinearDPOLoss(loss_type=["sigmoid", "nca_pair"], f_divergence_type="js_divergence")
    with pytest.raises(ValueError, match="loss_weights"):
        LigerFusedLinearDPOLoss(loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="at least one"):
        LigerFusedLinearDPOLoss(loss_type=[])
    with pytest.raises(ValueError, match="label_smoothing"):
        LigerFusedLinearDPOLoss(loss_type="aot", label_smoothing=0.7)
    with pytest.raises(ValueError, match="use_weighting"):
        LigerFusedLinearDPOLoss(loss_type=["sigmoid", "aot"], use_weighting=True)
    with pytest.raises(ValueError, match="ld_alpha"):
        LigerFusedLinearDPOLoss(ld_alpha=1.5)
    with pytest.raises(ValueError, match="ld_alpha"):
        LigerFusedLinearDPOLoss(ld_alpha=0.5, average_log_prob=True)
    with pytest.raises(ValueError, match="use_weighting"):
        LigerFusedLinearDPOLoss(loss_type=["sigmoid", "sft"], use_weighting=True)
    with pytest.raises(ValueError, match="use_ref_model"):
        LigerFusedLinearDPOLoss()(weight, x, target, bias)
    with pytest.raises(ValueError, match="even"):
        LigerFusedLinearDPOLoss(use_ref_model=False)(weight, x[:3], target[:3], bias)
    with pytest.raises(ValueError, match="target"):
        LigerFusedLinearDPOLoss(use_ref_model=False)(weight, x, target[:, :2], bias)
    with pytest.raises(ValueError, match="preference_labels"):
        LigerFusedLinearKTOLoss()(x, weight, target, bias)


def test_under_autocast_like_a_mixed_precision_trainer():
    """fp32 parameters and hidden states under bf16 autocast: the head runs in bf16 (as F.linear
    would), the gradients come back in fp32, equal to those of the same call on bf16 casts."""
    x, weight, bias, target = make_batch(4, 5, 16, 37, torch.float32, with_bias=True)
    ref_x, ref_w, ref_b = make_ref_head(x, weight, bias)
    loss_fn = LigerFusedLinearDPOLoss(beta=0.2)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss, _ = loss_fn(leaves[1], leaves[0], target, leaves[2], ref_x, ref_w, ref_b)
    loss.backward()
    cast = [t.bfloat16().requires_grad_() for t in (x, weight, bias)]
    expected, _ = loss_fn(cast[1], cast[0], target, cast[2], ref_x.bfloat16(), ref_w.bfloat16(), ref_b.bfloat16())
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for got, want in zip(leaves, cast):
        assert got.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad, want.grad.float())


@dataclass(frozen=True)
class Use:
    """``from module import name``; ``init``/``call``: keywords of the constructor (or of the
    function itself) and of ``forward``/``__call__``/``apply``; ``*_positional``: how many
    arguments a call passes by position."""

    module: str
    name: str
    init: frozenset = field(default_factory=frozenset)
    init_positional: int = 0
    call: frozenset = field(default_factory=frozenset)
    call_positional: int = 0


def _kw(*names):
    return frozenset(names)


_APPLY = "liger_kernel.transformers"
_GRPO_INIT_1_0 = _kw("beta", "epsilon_low", "epsilon_high", "temperature", "use_ref_model", "loss_type",
                     "max_completion_length", "importance_sampling_level")
_GRPO_CALL = _kw("_input", "lin_weight", "selected_token_ids", "attention_mask", "advantages", "bias",
                 "old_per_token_logps", "ref_per_token_logps", "vllm_is_ratio")
_JSD_INIT = _kw("beta", "ignore_index", "temperature", "compiled", "weight_hard_loss", "weight_soft_loss")
_JSD_CALL = _kw("student_input", "student_weight", "teacher_input", "teacher_weight", "true_labels", "student_bias",
                "teacher_bias")
_KTO_CALL = _kw("_input", "lin_weight", "target", "bias", "preference_labels", "ref_input", "ref_weight", "ref_bias",
                "kl")
_TRL_COMMON = [
    Use("liger_kernel.chunked_loss", "LigerFusedLinearDPOLoss", init=_kw("beta", "loss_type"), call_positional=7),
    Use("liger_kernel.chunked_loss", "LigerFusedLinearKTOLoss", init=_kw("beta", "use_ref_model"), call=_KTO_CALL),
    Use("liger_kernel.chunked_loss", "LigerFusedLinearJSDLoss", init=_JSD_INIT, call=_JSD_CALL),
]
_LLAMA_FACTORY_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text", "glm4", "glm4v", "granite", "llama", "llava",
                        "mistral", "mixtral", "mllama", "olmo2", "paligemma", "phi3", "qwen2", "qwen2_vl",
                        "qwen2_5_vl", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                        "qwen3_5_moe_text", "gpt_oss")
_MS_SWIFT_TYPES = ("gemma", "gemma3", "gemma3_text", "glm4", "glm4v", "glm4v_moe", "internvl", "llama", "llama4",
                   "llava", "mistral", "mixtral", "mllama", "paligemma", "phi3", "qwen2", "qwen2_5_vl", "qwen2_vl",
                   "qwen3", "qwen3_moe", "qwen3_next")
_CAUSAL_LM_LOSS = Use("liger_kernel.transformers.model.loss_utils", "LigerForCausalLMLoss",
                      init=_kw("hidden_states", "lm_head_weight", "labels", "hidden_size", "shift_labels",
                               "num_items_in_batch", "ignore_index", "final_logit_softcapping"))

CALLERS = {
    "trl 1.0": _TRL_COMMON + [
        Use("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss", init=_GRPO_INIT_1_0, call=_GRPO_CALL),
    ],
    "trl 1.12": _TRL_COMMON + [
        Use("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss",
            init=_GRPO_INIT_1_0 | _kw("delta", "use_bias_correction_kl", "sapo_temperature_pos",
                                      "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                                      "vespo_lambda_neg"),
            call=_GRPO_CALL | _kw("num_items_in_batch")),
    ],
    "axolotl 0.19": [
        Use("liger_kernel.ops.utils", "calculate_settings", init_positional=1),
        Use("liger_kernel.ops.utils", "compare_version", init_positional=3),
        Use("liger_kernel.ops.utils", "ensure_contiguous", init_positional=1),
        Use("liger_kernel.ops.utils", "torch_to_triton_dtype"),
        Use("liger_kernel.utils", "is_npu_available"),
        Use("liger_kernel.utils", "PEFT_AVAILABLE"),
        Use("liger_kernel.ops.backends.registry", "IMPL_REGISTRY"),
        Use("liger_kernel.ops.grpo_loss", "fused_selective_log_softmax", init_positional=3),
        Use("liger_kernel.ops.fused_linear_cross_entropy", "fused_linear_cross_entropy_forward"),
        Use("liger_kernel.ops.fused_linear_cross_entropy", "fused_linear_cross_entropy_backward"),
        Use("liger_kernel.chunked_loss.fused_linear_distillation", "LigerFusedLinearDistillationBase"),
        _CAUSAL_LM_LOSS,
        Use("liger_kernel.transformers.trainer.orpo_trainer", "_FSDPForwardRedirection", call_positional=5),
        Use("liger_kernel.transformers.monkey_patch", "MODEL_TYPE_TO_APPLY_LIGER_FN"),
        Use(_APPLY, "apply_liger_kernel_to_granite",
            init=_kw("rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", "swiglu")),
        Use("liger_kernel.transformers.cross_entropy", "LigerCrossEntropyLoss"),
        Use("liger_kernel.transformers.functional", "liger_cross_entropy"),
        Use("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy", init=_kw("use_token_scaling")),
        Use("liger_kernel.transformers.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss",
            init=_kw("use_token_scaling"), call_positional=3),
        Use("liger_kernel.transformers.layer_norm", "LigerLayerNorm"),
        Use("liger_kernel.transformers.rms_norm", "LigerRMSNorm", init=_kw("eps", "offset", "casting_mode", "init_fn",
                                                                            "in_place"), init_positional=1),
        Use("liger_kernel.transformers.rms_norm", "LigerRMSNormForGemma2"),
        Use("liger_kernel.transformers.rms_norm", "LigerRMSNormForGemma4", init=_kw("with_scale"), init_positional=2),
        Use("liger_kernel.transformers.rope", "liger_rotary_pos_emb"),
        Use("liger_kernel.transformers.swiglu", "LigerSwiGLUMLP", init_positional=1),
        Use("liger_kernel.transformers.geglu", "LigerGEGLUMLP", init_positional=1),
    ],
    "llamafactory 0.9.5": [
        Use(_APPLY, f"apply_liger_kernel_to_{model_type}", init=_kw("fused_linear_cross_entropy", "cross_entropy"))
        for model_type in _LLAMA_FACTORY_TYPES
    ],
    "ms-swift 4.6": [Use(_APPLY, f"apply_liger_kernel_to_{model_type}") for model_type in _MS_SWIFT_TYPES] + [
        Use("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss",
            init=_GRPO_INIT_1_0 | _kw("compiled", "sapo_temperature_pos", "sapo_temperature_neg"), call=_GRPO_CALL),
        Use("liger_kernel.chunked_loss", "LigerFusedLinearJSDLoss", init=_JSD_INIT, call=_JSD_CALL),
        _CAUSAL_LM_LOSS,
    ],
    "verl 0.9.1": [
        Use("liger_kernel.transformers.monkey_patch", "_apply_liger_kernel_to_instance",
            init=_kw("model", "fused_linear_cross_entropy", "swiglu")),
        Use("liger_kernel.ops", "LigerFusedLinearScaledCrossEntropyFunction", call_positional=7),
    ],
    "openrlhf 0.11": [
        Use("liger_kernel.transformers", "AutoLigerKernelForCausalLM"),
    ],
}


def _resolve(use: Use):
    return getattr(importlib.import_module(use.module), use.name)


def _call_signature(obj) -> tuple[inspect.Signature, int]:
    """The signature a call of ``obj`` binds to, and how many leading arguments (self, ctx) it has."""
    if isinstance(obj, type) and issubclass(obj, (torch.autograd.Function, torch.nn.Module)):
        return inspect.signature(obj.forward), 1  # apply(...) -> forward(ctx, ...); module(...) -> forward
    if isinstance(obj, type) and hasattr(obj, "apply"):
        return inspect.signature(obj.apply), 0  # a static or class method
    return inspect.signature(obj.__call__), 1


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_every_name_a_caller_imports_exists_and_takes_its_arguments(caller):
    pytest.importorskip("transformers")
    for use in CALLERS[caller]:
        obj = _resolve(use)
        if use.init or use.init_positional:
            target = obj if not isinstance(obj, type) else obj.__init__
            extra = () if not isinstance(obj, type) else (None,)  # self
            inspect.signature(target).bind_partial(*extra, *[None] * use.init_positional,
                                                   **dict.fromkeys(use.init))
        if use.call or use.call_positional:
            signature, leading = _call_signature(obj)
            signature.bind_partial(*[None] * (leading + use.call_positional), **dict.fromkeys(use.call))


def test_verl_instance_patch_keywords_for_a_gemma_model(caplog):
    """verl passes ``swiglu=True`` whatever the model: for a Gemma model it is dropped with a warning."""
    import logging

    pytest.importorskip("transformers")
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    from tests.transformers.model_configs import build_model

    model = build_model("gemma")
    with caplog.at_level(logging.WARNING, logger="liger_kernel"):
        report = _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False, swiglu=True)
    assert "swiglu" in caplog.text
    assert "geglu" in report.patched and "fused_linear_cross_entropy" not in report.patched


def test_axolotl_builds_the_gated_mlps_from_a_namespace():
    """axolotl builds ``LigerSwiGLUMLP``/``LigerGEGLUMLP`` from a bare namespace of the three sizes."""
    config = SimpleNamespace(hidden_size=16, intermediate_size=40, hidden_act="silu")
    from liger_kernel.transformers.geglu import LigerGEGLUMLP
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    assert LigerSwiGLUMLP(config).down_proj.weight.shape == (16, 40)
    assert LigerGEGLUMLP(SimpleNamespace(hidden_size=16, intermediate_size=40,
                                         hidden_act="gelu_pytorch_tanh")).up_proj.weight.shape == (40, 16)
