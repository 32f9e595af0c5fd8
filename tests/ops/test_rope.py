"""LigerRopeFunction against Hugging Face's ``apply_rotary_pos_emb`` math in float64 (no transformers).

Reference: HF's rotate-half RoPE written out below (``hf_apply_rotary_pos_emb``, including
Phi-3's partial rotary: the first R = cos.shape[-1] channels rotated, the rest passed
through), and for the other layouts HF's variants of it (``rotate_every_two`` pairs of GLM,
Cohere and GPT-J, cos/sin per pair widened by ``repeat_interleave``/``cat`` as GPT-J and
gpt-oss do, GLM's first half of the table, NanoChat's ``cat(x2, -x1)``), evaluated in float64
on the same inputs and differentiated by autograd.

cos/sin are random angles whose two halves differ (HF's tables repeat the frequencies,
cos[..., :R/2] == cos[..., R/2:]), so a kernel that mixed up the halves would fail.

Tolerances: each output element is x1 * c - x2 * s in fp32, rounded once, so fp32 is within
the default fp32 tolerance of float64 and bf16/fp16 within ``tolerance(dtype)`` (about two
output ulps).
"""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liger_kernel.ops.rope import (
    ROTATE_HALF,
    TABLE_FIRST_HALF,
    TABLE_FULL,
    TABLE_PAIR,
    TABLES,
    LigerRopeFunction,
    RopeLayout,
)
from tests.utils import DEVICE, assert_close, shapes


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, layout=ROTATE_HALF):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    if layout.table == TABLE_FIRST_HALF:
        cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    if layout.table != TABLE_FULL:
        # One entry per pair, widened to one per channel as HF does.
        if layout.interleaved:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        else:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if layout.negate_sin:
        sin = -sin
    rotate = rotate_every_two if layout.interleaved else rotate_half
    rotary_dim = cos.shape[-1]

    def embed(x):
        if layout.rotate_last:  # DeepSeek V4: the rotated block is the last R channels
            x_pass, x_rot = x[..., : x.shape[-1] - rotary_dim], x[..., x.shape[-1] - rotary_dim:]
            return torch.cat([x_pass, x_rot * cos + rotate(x_rot) * sin], dim=-1)
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat([x_rot * cos + rotate(x_rot) * sin, x_pass], dim=-1)

    return embed(q), embed(k)


ALL_LAYOUTS = [RopeLayout(interleaved, table, negate_sin, rotate_last) for interleaved in (False, True)
               for table in TABLES for negate_sin in (False, True) for rotate_last in (False, True)]


def layout_id(layout):
    return (("interleaved" if layout.interleaved else "half") + f"-{layout.table}"
            + ("-neg" if layout.negate_sin else "") + ("-last" if layout.rotate_last else ""))


LAYOUTS = ("dense", "transposed", "qkv_slices")


def make_qk_source(layout, batch, seq, n_q, n_k, head_dim, unsqueeze_dim, dtype):
    """(leaves, view): leaf tensors and a function building q, k from them in ``layout``.

    ``dense``: q, k are contiguous leaves in the layout ``unsqueeze_dim`` names.
    ``transposed``: q, k are transposes of contiguous tensors of the other layout (for
    ``unsqueeze_dim=1`` the usual ``proj(x).view(B, T, H, D).transpose(1, 2)``).
    ``qkv_slices``: q and k are slices of one fused (B, T, (Hq + 2 Hk) D) projection, as in Phi-3.
    """

    def rand(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype).requires_grad_(True)

    heads_first = unsqueeze_dim == 1
    if layout == "dense":
        def shape(h):
            return (batch, h, seq, head_dim) if heads_first else (batch, seq, h, head_dim)

        return [rand(*shape(n_q)), rand(*shape(n_k))], lambda q, k: (q, k)
    if layout == "transposed":
        def shape(h):
            return (batch, seq, h, head_dim) if heads_first else (batch, h, seq, head_dim)

        return [rand(*shape(n_q)), rand(*shape(n_k))], lambda q, k: (q.transpose(1, 2), k.transpose(1, 2))

    def slices(qkv):
        q = qkv[..., : n_q * head_dim].view(batch, seq, n_q, head_dim)
        k = qkv[..., n_q * head_dim: (n_q + n_k) * head_dim].view(batch, seq, n_k, head_dim)
        return (q.transpose(1, 2), k.transpose(1, 2)) if heads_first else (q, k)

    return [rand(batch, seq, (n_q + 2 * n_k) * head_dim)], slices


def make_cos_sin(cos_batch, seq, rotary_dim, dtype, hf_style=False, layout=ROTATE_HALF):
    half = rotary_dim // 2
    if layout.table == TABLE_PAIR:
        rotary_dim = half  # one entry per pair
    if hf_style:
        freqs = torch.randn(cos_batch, seq, half, device=DEVICE) * 3
        angles = torch.cat([freqs, freqs], dim=-1)
    else:
        angles = torch.randn(cos_batch, seq, rotary_dim, device=DEVICE) * 3
    return angles.cos().to(dtype), angles.sin().to(dtype)


def run(fn, leaves, view, cos, sin, grads, unsqueeze_dim, upcast=False):
    """(q_embed, k_embed, *leaf grads) of ``fn`` on copies of the leaves."""
    leaves = [t.detach().clone().double() if upcast else t.detach().clone() for t in leaves]
    for t in leaves:
        t.requires_grad_(True)
    if upcast:
        cos, sin, grads = cos.double(), sin.double(), [g.double() for g in grads]
    q, k = view(*leaves)
    q_embed, k_embed = fn(q, k, cos, sin, unsqueeze_dim)
    torch.autograd.backward((q_embed, k_embed), grads)
    return [q_embed.detach(), k_embed.detach()] + [t.grad for t in leaves]


def liger(q, k, cos, sin, unsqueeze_dim, rope_layout=ROTATE_HALF):
    return LigerRopeFunction.apply(q, k, cos, sin, None, unsqueeze_dim, rope_layout)


def check_case(layout, batch, seq, n_q, n_k, head_dim, rotary_dim, cos_batch, unsqueeze_dim, dtype,
               cos_dtype=None, hf_style=False, rope_layout=ROTATE_HALF):
    """``layout``: how q/k sit in memory (:data:`LAYOUTS`); ``rope_layout``: the pairs and table."""
    leaves, view = make_qk_source(layout, batch, seq, n_q, n_k, head_dim, unsqueeze_dim, dtype)
    cos, sin = make_cos_sin(cos_batch, seq, rotary_dim, cos_dtype or dtype, hf_style, rope_layout)
    q, k = view(*leaves)
    grads = [torch.randn(q.shape, device=DEVICE).to(dtype), torch.randn(k.shape, device=DEVICE).to(dtype)]
    got = run(functools.partial(liger, rope_layout=rope_layout), leaves, view, cos, sin, grads, unsqueeze_dim)
    want = run(functools.partial(hf_apply_rotary_pos_emb, layout=rope_layout), leaves, view, cos, sin, grads,
               unsqueeze_dim, upcast=True)
    names = ["q_embed", "k_embed"] + [f"grad of leaf {i}" for i in range(len(leaves))]
    for name, x, y in zip(names, got, want):
        assert x.dtype == dtype and x.shape == y.shape, name
        assert_close(x, y, dtype=dtype, msg=f"{name} ({layout}, ud={unsqueeze_dim}, R={rotary_dim}, "
                                           f"{rope_layout.describe()})")


# (batch, seq, n_q_heads, n_k_heads, head_dim): GQA, odd head counts, T = 1, 3, 37.
SIZES = shapes(
    small=[(2, 1, 4, 2, 8), (1, 3, 3, 1, 16), (2, 37, 4, 2, 8)],
    full=[(2, 37, 32, 8, 128), (1, 1024, 32, 8, 128), (3, 129, 12, 4, 96), (2, 255, 8, 1, 256)],
)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("size", SIZES)
def test_fp32_matches_float64(layout, unsqueeze_dim, size):
    batch, seq, n_q, n_k, head_dim = size
    check_case(layout, batch, seq, n_q, n_k, head_dim, head_dim, 1, unsqueeze_dim, torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("partial", [2, 4], ids=["half", "quarter"])
def test_partial_rotary(layout, partial):
    # Phi-3: rotary dim = head_dim * partial_rotary_factor; the rest passes through.
    head_dim = 16
    check_case(layout, 2, 5, 4, 2, head_dim, head_dim // partial, 2, 1, torch.float32)


@pytest.mark.parametrize("rope_layout", ALL_LAYOUTS, ids=layout_id)
def test_layouts_fp32_partial_rotary_gqa(rope_layout):
    # Odd sequence and head counts, Hq != Hk, R = 8 of D = 14 (the pass-through tail is odd),
    # one table per batch row; q/k read in place from a fused qkv projection.
    check_case("qkv_slices", 2, 7, 5, 3, 14, 8, 2, 1, torch.float32, rope_layout=rope_layout)


@pytest.mark.parametrize("rope_layout", ALL_LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layouts_full_rotary_transposed(rope_layout, dtype):
    check_case("transposed", 2, 9, 3, 1, 12, 12, 1, 2, dtype, rope_layout=rope_layout)


def test_bad_layouts():
    q = torch.randn(2, 4, 5, 8, device=DEVICE)
    cos, sin = make_cos_sin(1, 5, 8, torch.float32)
    with pytest.raises(ValueError, match="table must be one of"):
        RopeLayout(table="half")
    with pytest.raises(TypeError, match="RopeLayout"):
        LigerRopeFunction.apply(q, q, cos, sin, None, 1, "interleaved")
    with pytest.raises(ValueError, match="do not broadcast.*per pair"):
        LigerRopeFunction.apply(q, q, cos, sin, None, 1, RopeLayout(table=TABLE_PAIR))  # R = 16 > D = 8
    with pytest.raises(ValueError, match="do not broadcast"):
        LigerRopeFunction.apply(q, q, cos[..., :5], sin[..., :5], None, 1, RopeLayout(True, TABLE_FIRST_HALF))  # odd R


@pytest.mark.parametrize("cos_batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(cos_batch, dtype):
    check_case("transposed", 2, 37, 4, 2, 16, 16, cos_batch, 1, dtype, hf_style=True)
    check_case("qkv_slices", 2, 7, 4, 2, 12, 6, cos_batch, 2, dtype)


def test_fp32_tables_with_bf16_inputs():
    check_case("transposed", 2, 9, 4, 2, 16, 16, 2, 1, torch.bfloat16, cos_dtype=torch.float32)


def test_outputs_and_gradients_keep_the_input_layout():
    # q = proj(x).view(B, T, H, D).transpose(1, 2): the output and the gradient handed back to
    # the view are (B, T, H, D)-dense too, so transposing back and .view() need no copy.
    leaves, view = make_qk_source("transposed", 2, 5, 4, 2, 8, 1, torch.float32)
    q, k = view(*leaves)
    cos, sin = make_cos_sin(1, 5, 8, torch.float32)
    seen = {}
    q.register_hook(lambda g: seen.setdefault("q", g))
    q_embed, k_embed = LigerRopeFunction.apply(q, k, cos, sin)
    assert q_embed.stride() == q.stride() and k_embed.stride() == k.stride()
    (q_embed.sum() + k_embed.sum()).backward()
    assert seen["q"].stride() == q.stride()
    assert leaves[0].grad.is_contiguous()


def test_last_dim_not_unit_stride_is_copied_and_correct():
    base = torch.randn(2, 4, 5, 16, device=DEVICE)
    q, k = base[..., ::2], base[:, :2, :, 1::2]
    cos, sin = make_cos_sin(1, 5, 8, torch.float32)
    got = LigerRopeFunction.apply(q, k, cos, sin)
    want = hf_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    for x, y in zip(got, want):
        assert_close(x, y)


def test_position_ids_index_a_2d_table():
    max_positions, batch, seq = 50, 2, 7
    table_cos, table_sin = make_cos_sin(1, max_positions, 8, torch.float32)
    table_cos, table_sin = table_cos[0], table_sin[0]
    position_ids = torch.randint(0, max_positions, (batch, seq), device=DEVICE)
    q = torch.randn(batch, 4, seq, 8, device=DEVICE)
    k = torch.randn(batch, 2, seq, 8, device=DEVICE)
    got = LigerRopeFunction.apply(q, k, table_cos, table_sin, position_ids)
    want = hf_apply_rotary_pos_emb(q.double(), k.double(), table_cos[position_ids].double(),
                                   table_sin[position_ids].double())
    for x, y in zip(got, want):
        assert_close(x, y)
    # A (T, R) table without position_ids is (1, T, R); 3-D tables ignore position_ids (as HF).
    cos, sin = table_cos[:seq], table_sin[:seq]
    want = hf_apply_rotary_pos_emb(q.double(), k.double(), cos[None].double(), sin[None].double())
    for got in (LigerRopeFunction.apply(q, k, cos, sin), LigerRopeFunction.apply(q, k, cos[None], sin[None], position_ids)):
        for x, y in zip(got, want):
            assert_close(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_non_integer_position_ids_raise_type_error(dtype):
    """position_ids gathering a 2-D table must be int64/int32: a float tensor would fail as a
    bare IndexError, and a uint8/bool one would be read as a mask."""
    table_cos, table_sin = (t[0] for t in make_cos_sin(1, 50, 8, torch.float32))
    position_ids = torch.randint(0, 2, (2, 7), device=DEVICE).to(dtype)
    q = torch.randn(2, 4, 7, 8, device=DEVICE)
    k = torch.randn(2, 2, 7, 8, device=DEVICE)
    with pytest.raises(TypeError, match=f"position_ids.*{dtype}"):
        LigerRopeFunction.apply(q, k, table_cos, table_sin, position_ids)
    # int32 positions index the table as int64 ones do.
    positions = torch.randint(0, 50, (2, 7), device=DEVICE)
    for got, want in zip(LigerRopeFunction.apply(q, k, table_cos, table_sin, positions.int()),
                         LigerRopeFunction.apply(q, k, table_cos, table_sin, positions)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("size", [(0, 3, 4, 2, 8), (2, 0, 4, 2, 8), (2, 3, 4, 0, 8)])
def test_empty(size):
    batch, seq, n_q, n_k, head_dim = size
    q = torch.randn(batch, n_q, seq, head_dim, device=DEVICE, requires_grad=True)
    k = torch.randn(batch, n_k, seq, head_dim, device=DEVICE, requires_grad=True)
    cos, sin = make_cos_sin(1, seq, head_dim, torch.float32)
    q_embed, k_embed = LigerRopeFunction.apply(q, k, cos, sin)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape
    (q_embed.sum() + k_embed.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_bad_arguments():
    q = torch.randn(2, 4, 5, 8, device=DEVICE)
    k = torch.randn(2, 2, 5, 8, device=DEVICE)
    cos, sin = make_cos_sin(1, 5, 8, torch.float32)
    apply = LigerRopeFunction.apply
    with pytest.raises(ValueError, match="batch, sequence length and head dim"):
        apply(q, k[:, :, :4], cos, sin)
    with pytest.raises(ValueError, match="batch, sequence length and head dim"):
        apply(q, k[..., :6], cos, sin)
    with pytest.raises(ValueError, match="batch, sequence length and head dim"):
        apply(q, k[:1], cos, sin)
    with pytest.raises(ValueError, match="do not broadcast"):
        apply(q, k, cos[:, :4], sin[:, :4])  # wrong T
    with pytest.raises(ValueError, match="do not broadcast"):
        apply(q, k, cos.expand(3, -1, -1), sin.expand(3, -1, -1))  # wrong B
    with pytest.raises(ValueError, match="do not broadcast"):
        apply(q, k, cos[..., :7], sin[..., :7])  # odd rotary dim
    with pytest.raises(ValueError, match="do not broadcast"):
        apply(q[..., :6], k[..., :6], cos, sin)  # rotary dim > head dim
    with pytest.raises(ValueError, match="same shape"):
        apply(q, k, cos, sin[..., :6])
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        apply(q, k, cos, sin, None, 3)
    with pytest.raises(ValueError, match="4-D"):
        apply(q[0], k[0], cos, sin)
    with pytest.raises(TypeError, match="dtype"):
        apply(q.long(), k, cos, sin)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        apply(q, k, 1.0, sin)
    with pytest.raises(ValueError, match="device"):
        apply(q, k.to("meta"), cos, sin)
    with pytest.raises(ValueError, match="must not require grad"):
        apply(q, k, cos.requires_grad_(True), sin)


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 40),
    n_q=st.integers(1, 6),
    n_k=st.integers(1, 3),
    half=st.integers(1, 12),
    extra=st.sampled_from([0, 0, 1, 4]),
    layout=st.sampled_from(LAYOUTS),
    unsqueeze_dim=st.sampled_from([1, 2]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    per_batch_tables=st.booleans(),
    rope_layout=st.sampled_from(ALL_LAYOUTS),
)
def test_property_random_shapes(batch, seq, n_q, n_k, half, extra, layout, unsqueeze_dim, dtype, per_batch_tables,
                                rope_layout):
    rotary_dim = 2 * half
    check_case(layout, batch, seq, n_q, n_k, rotary_dim + extra, rotary_dim, batch if per_batch_tables else 1,
               unsqueeze_dim, dtype, rope_layout=rope_layout)


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    leaves, view = make_qk_source("qkv_slices", 2, 5, 4, 2, 8, 1, torch.float32)
    cos, sin = make_cos_sin(1, 5, 8, torch.float32)
    q, k = view(*leaves)
    grads = [torch.randn(q.shape, device=DEVICE), torch.randn(k.shape, device=DEVICE)]

    def fn(q, k, cos, sin, unsqueeze_dim):
        q_embed, k_embed = LigerRopeFunction.apply(q, k, cos, sin, None, unsqueeze_dim)
        return q_embed * 2, k_embed + 1

    eager = run(fn, leaves, view, cos, sin, grads, 1)
    compiled = run(torch.compile(fn, fullgraph=True), leaves, view, cos, sin, grads, 1)
    for x, y in zip(compiled, eager):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def scaled_in_place(fn):
    """``fn`` whose outputs are then edited in place, as attention code may (``q_embed *= scale``)."""

    def scaled(q, k, cos, sin, unsqueeze_dim):
        q_embed, k_embed = fn(q, k, cos, sin, unsqueeze_dim)
        q_embed *= 0.125
        k_embed.mul_(-2.0)
        return q_embed, k_embed

    return scaled


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_outputs_may_be_edited_in_place(layout, unsqueeze_dim):
    """The outputs are ordinary tensors (not views of a private buffer): editing them in place
    works forward and backward, with HF's values."""
    leaves, view = make_qk_source(layout, 2, 5, 4, 2, 8, unsqueeze_dim, torch.float32)
    cos, sin = make_cos_sin(1, 5, 8, torch.float32)
    q, k = view(*leaves)
    q_embed, k_embed = liger(q, k, cos, sin, unsqueeze_dim)
    assert q_embed._base is None and k_embed._base is None
    grads = [torch.randn(q.shape, device=DEVICE), torch.randn(k.shape, device=DEVICE)]
    got = run(scaled_in_place(liger), leaves, view, cos, sin, grads, unsqueeze_dim)
    want = run(scaled_in_place(hf_apply_rotary_pos_emb), leaves, view, cos, sin, grads, unsqueeze_dim, upcast=True)
    for x, y in zip(got, want):
        assert_close(x, y, dtype=torch.float32)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_meta_inputs_give_meta_outputs(unsqueeze_dim):
    """Shape inference on ``meta`` tensors: outputs and gradients of the right shapes and dtypes."""
    leaves, view = make_qk_source("transposed", 2, 5, 4, 2, 8, unsqueeze_dim, torch.bfloat16)
    leaves = [torch.empty_like(t, device="meta").requires_grad_(True) for t in leaves]
    cos = torch.empty(1, 5, 6, device="meta", dtype=torch.bfloat16)
    q, k = view(*leaves)
    q_embed, k_embed = liger(q, k, cos, cos, unsqueeze_dim)
    assert q_embed.is_meta and q_embed.shape == q.shape and q_embed.dtype == torch.bfloat16
    assert k_embed.is_meta and k_embed.shape == k.shape and k_embed.stride() == k.stride()
    (q_embed.sum() + k_embed.sum()).backward()
    assert all(t.grad.is_meta and t.grad.shape == t.shape for t in leaves)


@pytest.mark.parametrize("block_t, block_hq, block_hk", [(1, 1, 1), (2, 4, 1), (16, 2, 2)])
def test_launch_config_overrides_change_the_schedule_only(block_t, block_hq, block_hk):
    from liger_kernel.ops.config import override_launch_config
    from liger_kernel.ops.rope import RopeConfig

    with override_launch_config(RopeConfig, block_t=block_t, block_hq=block_hq, block_hk=block_hk):
        check_case("qkv_slices", 2, 7, 5, 3, 12, 8, 2, 1, torch.float32)


def test_rope_config_heuristic_and_search_space():
    from liger_kernel.ops.rope import RopeConfig

    # Half-tiles of 2048 elements: 8 heads x 64 rotary pairs -> 4 positions per program.
    config = RopeConfig.heuristic(4096, 32, 8, 64)
    assert (config.block_t, config.block_hq, config.block_hk) == (4, 8, 8)
    assert RopeConfig.heuristic(4096, 32, 8, 64) is config  # memoised per shape
    space = RopeConfig.search_space(4096, 32, 8, 64)
    assert config in space and len(set(space)) == len(space) > 1
    with pytest.raises(ValueError, match="power of two"):
        RopeConfig(3, 1, 1, 1)
