"""Discovery (``liger_kernel.transformers.patching.discovery``): candidates are swapped only when
their probe proves them equal; what differs stays HF's, with the reason in the report."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from liger_kernel.ops.rope import ROTATE_HALF, TABLE_FIRST_HALF, TABLE_PAIR, RopeLayout
from liger_kernel.transformers.patching import discovery
from liger_kernel.transformers.rope import liger_rotary_pos_emb
from tests.transformers.census.tiny_configs import tiny_model
from tests.utils import DEVICE

UPSTREAM_NAMES = ("llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3", "gemma3_text", "qwen2", "qwen2_vl",
                  "qwen2_5_vl", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "mllama", "glm4", "glm4v", "granite",
                  "llava", "olmo2", "paligemma", "phi3", "gpt_oss", "llama4")


class LlamaStyleRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


class OffsetRMSNorm(LlamaStyleRMSNorm):
    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return ((x.float() * torch.rsqrt(variance + self.variance_epsilon)) * (1.0 + self.weight.float())).type_as(x)


class MeanAbsNorm(LlamaStyleRMSNorm):
    """Not an RMSNorm: divides by the mean absolute value."""

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.mark.parametrize("cls, expected", [(LlamaStyleRMSNorm, 0.0), (OffsetRMSNorm, 1.0)])
def test_rms_norm_offset_is_probed(cls, expected):
    plan = discovery.probe_norm(cls(24).to(DEVICE))
    assert isinstance(plan, discovery.NormPlan) and plan.kind == "rms_norm" and plan.offset == expected


def test_norm_with_other_math_is_left_alone():
    why = discovery.probe_norm(MeanAbsNorm(24).to(DEVICE))
    assert isinstance(why, str) and "neither RMSNorm nor LayerNorm" in why


class GatedMLP(nn.Module):
    up_first = False

    def __init__(self, hidden: int, inner: int, act: nn.Module, fused: bool = False) -> None:
        super().__init__()
        if fused:
            self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        else:
            self.gate_proj = nn.Linear(hidden, inner, bias=False)
            self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = act

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            first, second = self.gate_up_proj(x).chunk(2, dim=-1)
            gate, up = (second, first) if self.up_first else (first, second)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


class UpFirstMLP(GatedMLP):
    """A fused projection holding up first: the Liger forward (gate first) must not be used."""

    up_first = True


@pytest.mark.parametrize("act, option", [(nn.SiLU(), "swiglu"), (nn.GELU(approximate="tanh"), "geglu")])
@pytest.mark.parametrize("fused", [False, True])
def test_gated_mlp_is_probed(act, option, fused):
    plan = discovery.probe_mlp(GatedMLP(16, 24, act, fused=fused).to(DEVICE))
    assert isinstance(plan, discovery.MLPPlan) and plan.option == option


@pytest.mark.parametrize("mlp, reason", [
    (lambda: GatedMLP(16, 24, nn.ReLU()), "neither SiLU nor tanh-GELU"),
    (lambda: GatedMLP(16, 24, nn.GELU()), "neither SiLU nor tanh-GELU"),  # exact GELU, not tanh
    (lambda: UpFirstMLP(16, 24, nn.SiLU(), fused=True), "differs"),
])
def test_gated_mlp_with_other_math_is_left_alone(mlp, reason):
    why = discovery.probe_mlp(mlp().to(DEVICE))
    assert isinstance(why, str) and reason in why


class DropoutMLP(GatedMLP):
    def forward(self, x):
        return nn.functional.dropout(super().forward(x), 0.1, self.training)


def test_dropout_inside_is_probed_in_training_mode():
    """A model patched in eval mode (``from_pretrained``'s default) must not lose a module's
    dropout in training: probes run in training mode, and the module's mode is restored."""
    mlp = DropoutMLP(16, 24, nn.SiLU()).to(DEVICE).eval()
    why = discovery.probe_mlp(mlp)
    assert isinstance(why, str) and "dropout" in why
    assert not mlp.training


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_rope(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    def rotate_every_two(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin


def per_tensor_rope(x, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return x * cos + _rotate_half(x) * sin


def half_table_rope(q, k, cos, sin, unsqueeze_dim=1):
    """gpt-oss: rotate-half with cos/sin of R/2 entries used for both halves."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def embed(x):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return embed(q), embed(k)


def scaled_sin_rope(q, k, cos, sin, unsqueeze_dim=1):
    """Not RoPE: the sine term is doubled."""
    return rotate_half_rope(q, k, cos, 2 * sin, unsqueeze_dim)


def other_math_for_unsqueeze_dim_2(q, k, cos, sin, unsqueeze_dim=1):
    """Rotate-half only for (B, H, T, D): the probe calls the (B, T, H, D) form too."""
    q_embed, k_embed = rotate_half_rope(q, k, cos, sin, unsqueeze_dim)
    return (q_embed, k_embed) if unsqueeze_dim == 1 else (2 * q_embed, k_embed)


@pytest.mark.parametrize("fn, head_dim, dims, expected", [
    (rotate_half_rope, 8, {8}, discovery.RopePlan(ROTATE_HALF)),
    (interleaved_rope, 8, {8}, discovery.RopePlan(RopeLayout(interleaved=True, table=TABLE_FIRST_HALF))),
    (half_table_rope, 8, {4}, discovery.RopePlan(RopeLayout(table=TABLE_PAIR))),
    (per_tensor_rope, 8, {8}, discovery.RopePlan(ROTATE_HALF, per_tensor=True)),
    ("deepseek_v4", 16, {2}, discovery.RopePlan(RopeLayout(interleaved=True, table=TABLE_PAIR, rotate_last=True),
                                                per_tensor=True)),
], ids=["rotate_half", "interleaved_first_half", "half_table", "per_tensor", "deepseek_v4_last_channels"])
def test_rope_probe_finds_the_layout(fn, head_dim, dims, expected):
    if isinstance(fn, str):  # HF's own function of that model type
        import importlib

        fn = importlib.import_module(f"transformers.models.{fn}.modeling_{fn}").apply_rotary_pos_emb
    assert discovery.probe_rope(fn, head_dim, dims, torch.device(DEVICE)) == expected


@pytest.mark.parametrize("fn", [scaled_sin_rope, other_math_for_unsqueeze_dim_2])
def test_rope_probe_rejects_other_math(fn):
    why = discovery.probe_rope(fn, 8, {8}, torch.device(DEVICE))
    assert isinstance(why, str) and "none of the kernel's RoPE layouts" in why


def test_rope_probe_reports_a_function_it_cannot_call():
    def three_tables(q, k, cos, sin, tan):
        return q, k

    why = discovery.probe_rope(three_tables, 8, {8}, torch.device(DEVICE))
    assert isinstance(why, str) and "failed on every probe shape" in why


def test_rope_plan_replacements_are_shared():
    """One replacement object per plan: rebound attention forwards are cached by it."""
    plan = discovery.RopePlan(RopeLayout(interleaved=True))
    assert plan.replacement is discovery.RopePlan(RopeLayout(interleaved=True)).replacement
    assert discovery.RopePlan(ROTATE_HALF).replacement is liger_rotary_pos_emb


def test_head_with_a_logit_scale_is_fused_with_the_scale():
    """Granite divides its logits by ``logits_scaling``: the fused loss scales the hidden states
    to match, and the patched step equals HF's."""
    import copy

    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    model, batch = tiny_model("granite")
    model.config.logits_scaling = 4.0
    reference = copy.deepcopy(model)
    report = _apply_liger_kernel_to_instance(model)
    assert "fused_linear_cross_entropy" in report.patched
    torch.testing.assert_close(model(**batch).loss, reference(**batch).loss, rtol=1e-5, atol=1e-5)


def test_head_computing_something_else_keeps_its_forward():
    """A head whose logits the fused loss cannot reproduce (here a per-token scale) stays HF's."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from liger_kernel.transformers.patching.generic import patch_discovered
    from liger_kernel.transformers.patching.options import PatchOptions
    from transformers import LlamaForCausalLM

    class TokenScaledLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            logits = self.lm_head(hidden) * torch.linspace(0.5, 1.5, self.config.vocab_size, device=hidden.device)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    config = tiny_model("llama")[0].config
    report = patch_discovered(TokenScaledLlama(config).to(DEVICE), PatchOptions())
    assert "fused_linear_cross_entropy" not in report.patched
    assert any("loss" in what and "differs" in why for what, why in report.left_alone), report.left_alone


def test_upstream_names_are_importable():
    import importlib

    module = importlib.import_module("liger_kernel.transformers")
    from liger_kernel.transformers import MODEL_TYPE_TO_APPLY_LIGER_FN

    for model_type in UPSTREAM_NAMES:
        fn = getattr(module, f"apply_liger_kernel_to_{model_type}")
        assert MODEL_TYPE_TO_APPLY_LIGER_FN[model_type] is fn
    with pytest.raises(ImportError):
        exec("from liger_kernel.transformers import apply_liger_kernel_to_not_a_model_type")


def test_discovered_class_level_patch_and_revert():
    """``apply_liger_kernel_to_<model_type>()`` for a type the table does not name patches every
    model built afterwards by discovery; revert stops it."""
    from liger_kernel.transformers import (
        MODEL_TYPE_TO_APPLY_LIGER_FN,
        liger_patched_modules,
        revert_liger_kernel,
    )

    MODEL_TYPE_TO_APPLY_LIGER_FN["olmo2"](rope=False)
    try:
        model, _ = tiny_model("olmo2")
        patched = liger_patched_modules(model)
        assert "" in patched and "model.norm" in patched
        assert not any(name.endswith("self_attn") for name in patched)  # rope=False honoured
    finally:
        revert_liger_kernel("olmo2")
    model, _ = tiny_model("olmo2")
    assert liger_patched_modules(model) == []
