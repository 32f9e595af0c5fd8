"""liger_rotary_pos_emb as a drop-in for HF's ``apply_rotary_pos_emb`` (Llama and Phi-3; the other
layouts of GLM, gpt-oss, Cohere and NanoChat; Gemma 4's per-tensor signature).

cos/sin come from the HF rotary embedding module of a tiny config (Phi-3 with
``partial_rotary_factor=0.5``, so only half of each head is rotated), q/k are laid out the
way the HF attention forwards produce them (``proj(x).view(B, T, H, D).transpose(1, 2)``,
and for Phi-3 slices of the fused ``qkv_proj`` output). Truth: HF's own function evaluated
in float64. fp32 at the default fp32 tolerance; bf16 at ``tolerance(bf16)`` (each of our
outputs is rounded once; HF's bf16 result, three roundings, is also checked against the
truth at twice that, to show the tolerance is not loose for us alone).
"""

import functools
import importlib

import pytest
import torch

from liger_kernel.ops.rope import ROTATE_HALF, TABLE_FIRST_HALF, TABLE_PAIR, RopeLayout
from liger_kernel.transformers.functional import liger_rope, liger_rotary_pos_emb, liger_rotary_pos_emb_single
from tests.utils import DEVICE, assert_close, shapes

transformers = pytest.importorskip("transformers")

# (batch, seq): T = 1, 3, 37 (and a long sequence on the full set).
SEQS = shapes(small=[(2, 1), (1, 3), (2, 37)], full=[(2, 1024)])


def _family(model_type):
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    if model_type == "llama":
        config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        return config, modeling.LlamaRotaryEmbedding(config), modeling.apply_rotary_pos_emb
    config = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    return config, modeling.Phi3RotaryEmbedding(config), modeling.apply_rotary_pos_emb


def _inputs(config, rotary, batch, seq, dtype, fused_qkv):
    """Leaf projection outputs, a function viewing them as (q, k) like HF's attention, cos, sin."""
    n_q, n_k = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_q
    if fused_qkv:
        leaves = [torch.randn(batch, seq, (n_q + 2 * n_k) * head_dim, device=DEVICE).to(dtype)]

        def view(qkv):
            q = qkv[..., : n_q * head_dim].view(batch, seq, -1, head_dim).transpose(1, 2)
            k = qkv[..., n_q * head_dim: (n_q + n_k) * head_dim].view(batch, seq, -1, head_dim).transpose(1, 2)
            return q, k
    else:
        leaves = [torch.randn(batch, seq, n * head_dim, device=DEVICE).to(dtype) for n in (n_q, n_k)]

        def view(q, k):
            return (q.view(batch, seq, -1, head_dim).transpose(1, 2), k.view(batch, seq, -1, head_dim).transpose(1, 2))

    position_ids = torch.arange(seq, device=DEVICE)[None].expand(batch, -1) + 5
    cos, sin = rotary.to(DEVICE)(leaves[0], position_ids)
    return leaves, view, cos, sin


def _run(fn, leaves, view, cos, sin, grads, upcast):
    leaves = [t.detach().clone().double() if upcast else t.detach().clone() for t in leaves]
    for t in leaves:
        t.requires_grad_(True)
    if upcast:
        cos, sin, grads = cos.double(), sin.double(), [g.double() for g in grads]
    q_embed, k_embed = fn(*view(*leaves), cos, sin)
    torch.autograd.backward((q_embed, k_embed), grads)
    return [q_embed.detach(), k_embed.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("model_type,fused_qkv", [("llama", False), ("phi3", True)])
@pytest.mark.parametrize("batch,seq", SEQS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf(model_type, fused_qkv, batch, seq, dtype):
    config, rotary, hf_fn = _family(model_type)
    leaves, view, cos, sin = _inputs(config, rotary, batch, seq, dtype, fused_qkv)
    assert cos.dtype == dtype  # HF's rotary module returns cos/sin in the activations' dtype
    if model_type == "phi3":
        assert cos.shape[-1] * 2 == view(*leaves)[0].shape[-1]  # partial rotary is exercised
    q, k = view(*leaves)
    grads = [torch.randn(q.shape, device=DEVICE).to(dtype), torch.randn(k.shape, device=DEVICE).to(dtype)]
    ours = _run(liger_rotary_pos_emb, leaves, view, cos, sin, grads, upcast=False)
    truth = _run(hf_fn, leaves, view, cos, sin, grads, upcast=True)
    for x, y in zip(ours, truth):
        assert x.dtype == dtype
        assert_close(x, y, dtype=dtype)
    if dtype == torch.bfloat16:
        hf = _run(hf_fn, leaves, view, cos, sin, grads, upcast=False)
        for x, y in zip(hf, truth):
            assert_close(x, y, dtype=dtype, scale=2.0)


def test_unsqueeze_dim_2_layout():
    # (B, T, H, D) layout, as used by some attention implementations.
    config, rotary, hf_fn = _family("llama")
    batch, seq, head_dim = 2, 9, 16
    q = torch.randn(batch, seq, 4, head_dim, device=DEVICE)
    k = torch.randn(batch, seq, 2, head_dim, device=DEVICE)
    cos, sin = rotary.to(DEVICE)(q, torch.arange(seq, device=DEVICE)[None].expand(batch, -1))
    ours = liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    want = hf_fn(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim=2)
    for x, y in zip(ours, want):
        assert_close(x, y)


def test_functional_aliases():
    assert liger_rope is liger_rotary_pos_emb
    from liger_kernel.transformers import liger_rotary_pos_emb as exported

    assert exported is liger_rotary_pos_emb


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_outputs_scaled_in_place_as_hf(unsqueeze_dim):
    """``q_embed *= scale`` after the call works forward and backward with HF's values."""
    config, rotary, hf_fn = _family("llama")
    batch, seq, head_dim = 2, 7, 16
    shape = (batch, 4, seq, head_dim) if unsqueeze_dim == 1 else (batch, seq, 4, head_dim)
    q0 = torch.randn(shape, device=DEVICE)
    k0 = torch.randn(shape, device=DEVICE)
    cos, sin = rotary.to(DEVICE)(q0, torch.arange(seq, device=DEVICE)[None].expand(batch, -1))
    results = []
    for fn, dtype in ((liger_rotary_pos_emb, torch.float32), (hf_fn, torch.float64)):
        q, k = (t.detach().to(dtype).requires_grad_(True) for t in (q0, k0))
        q_embed, k_embed = fn(q, k, cos.to(dtype), sin.to(dtype), unsqueeze_dim=unsqueeze_dim)
        q_embed *= head_dim**-0.5
        k_embed.add_(1.0)
        (q_embed * k_embed).sum().backward()
        results.append((q_embed.detach(), k_embed.detach(), q.grad, k.grad))
    for x, y in zip(*results):
        assert_close(x, y)


def test_meta_inputs_give_meta_outputs():
    q = torch.empty(2, 4, 5, 16, device="meta", requires_grad=True)
    k = torch.empty(2, 2, 5, 16, device="meta", requires_grad=True)
    cos = torch.empty(2, 5, 16, device="meta")
    q_embed, k_embed = liger_rotary_pos_emb(q, k, cos, cos)
    assert q_embed.is_meta and q_embed.shape == q.shape and k_embed.shape == k.shape
    (q_embed.sum() + k_embed.sum()).backward()
    assert q.grad.is_meta and q.grad.shape == q.shape and k.grad.shape == k.shape


# Model types whose apply_rotary_pos_emb is another layout than rotate-half, with that layout:
# GLM (interleaved pairs, the first half of a partial-rotary table), gpt-oss (rotate-half with
# half-size tables), Cohere (interleaved pairs, interleaved tables), NanoChat (rotation by -theta).
OTHER_LAYOUTS = {
    "glm": ("GlmRotaryEmbedding", RopeLayout(interleaved=True, table=TABLE_FIRST_HALF)),
    "gpt_oss": ("GptOssRotaryEmbedding", RopeLayout(table=TABLE_PAIR)),
    "cohere": ("CohereRotaryEmbedding", RopeLayout(interleaved=True)),
    "nanochat": ("NanoChatRotaryEmbedding", RopeLayout(negate_sin=True)),
}


def _other_family(model_type):
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    config = transformers.AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=16)
    rotary_class, layout = OTHER_LAYOUTS[model_type]
    return config, getattr(modeling, rotary_class)(config), modeling.apply_rotary_pos_emb, layout


@pytest.mark.parametrize("model_type", sorted(OTHER_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_layouts_match_hf(model_type, dtype):
    """HF's own function and rotary module; discovery's probe proves the same layout."""
    from liger_kernel.transformers.patching import discovery

    config, rotary, hf_fn, layout = _other_family(model_type)
    batch, seq = 2, 7
    leaves, view, cos, sin = _inputs(config, rotary, batch, seq, dtype, fused_qkv=False)
    plan = discovery.probe_rope(hf_fn, 16, {cos.shape[-1]}, torch.device(DEVICE))
    assert plan == discovery.RopePlan(layout), plan
    q, k = view(*leaves)
    grads = [torch.randn(q.shape, device=DEVICE).to(dtype), torch.randn(k.shape, device=DEVICE).to(dtype)]
    ours = _run(functools.partial(liger_rotary_pos_emb, layout=layout), leaves, view, cos, sin, grads, upcast=False)
    truth = _run(hf_fn, leaves, view, cos, sin, grads, upcast=True)
    for x, y in zip(ours, truth):
        assert x.dtype == dtype
        assert_close(x, y, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_tensor_matches_gemma4(dtype):
    """Gemma 4's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)`` on (B, T, H, D) projections."""
    gemma4 = importlib.import_module("transformers.models.gemma4.modeling_gemma4")
    config, rotary, _ = _family("llama")
    batch, seq, head_dim = 2, 5, 16
    x0 = torch.randn(batch, seq, 3, head_dim, device=DEVICE).to(dtype)
    cos, sin = rotary.to(DEVICE)(x0, torch.arange(seq, device=DEVICE)[None].expand(batch, -1) + 2)
    grad = torch.randn(x0.shape, device=DEVICE).to(dtype)
    results = []
    for fn, upcast in ((functools.partial(liger_rotary_pos_emb_single, layout=ROTATE_HALF), False),
                       (gemma4.apply_rotary_pos_emb, True)):
        x = x0.detach().clone().double() if upcast else x0.detach().clone()
        x.requires_grad_(True)
        c, s = (cos.double(), sin.double()) if upcast else (cos, sin)
        out = fn(x, c, s, unsqueeze_dim=2)
        out.backward(grad.double() if upcast else grad)
        results.append((out.detach(), x.grad))
    for x, y in zip(*results):
        assert x.dtype == dtype
        assert_close(x, y, dtype=dtype)
    with pytest.raises(ValueError, match="4-D"):
        liger_rotary_pos_emb_single(x0[0], cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptj_signature_through_the_discovered_plan(dtype):
    """GPT-J's ``apply_rotary_pos_emb(tensor, sin, cos)`` on (B, T, H, R) slices of the heads, tables
    of R/2 from its rotary module, called as its attention does: the plan discovery proves
    (interleaved pairs, per-pair tables, sin first, heads in dim 2) gives HF's values and gradients."""
    from liger_kernel.transformers.patching import discovery

    gptj = importlib.import_module("transformers.models.gptj.modeling_gptj")
    if not hasattr(gptj, "GPTJRotaryEmbedding"):
        pytest.skip("this transformers version builds GPT-J's tables without a rotary module")
    config = transformers.GPTJConfig(n_embd=64, n_head=4, rotary_dim=8)
    batch, seq, heads, head_dim = 2, 7, 4, 16
    x0 = torch.randn(batch, seq, heads, head_dim, device=DEVICE).to(dtype)
    sin, cos = gptj.GPTJRotaryEmbedding(config).to(DEVICE)(x0, torch.arange(seq, device=DEVICE)[None] + 3)
    plan = discovery.probe_rope(gptj.apply_rotary_pos_emb, head_dim, {sin.shape[-1]}, torch.device(DEVICE))
    assert plan == discovery.RopePlan(RopeLayout(interleaved=True, table=TABLE_PAIR), per_tensor=True,
                                      sin_first=True, heads_dim=2), plan
    grad = torch.randn(batch, seq, heads, 8, device=DEVICE).to(dtype)
    results = []
    for fn, upcast in ((plan.replacement, False), (gptj.apply_rotary_pos_emb, True)):
        x = x0.detach().clone().double() if upcast else x0.detach().clone()
        x.requires_grad_(True)
        s, c = (sin.double(), cos.double()) if upcast else (sin, cos)
        out = fn(x[..., :8], s, c)
        out.backward(grad.double() if upcast else grad)
        results.append((out.detach(), x.grad))
    for x, y in zip(*results):
        assert x.dtype == dtype
        assert_close(x, y, dtype=dtype)
