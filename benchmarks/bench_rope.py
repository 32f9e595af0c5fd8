"""Rotary position embedding (rotate-half convention, GQA): liger against HF eager and compile.

Shapes as in a HF Llama attention layer: q (B, Hq, T, D) and k (B, Hk, T, D) are
transposed views of the (B, T, H, D) projections (non-contiguous), cos/sin (1, T, D) in
the activation dtype, as ``LlamaRotaryEmbedding`` returns them for ``position_ids``
(1, T). Target shape: B 4, T 4096, Hq 32, Hk 8, D 128 (Llama-3-8B). s = bytes/element,
|q| = B*Hq*T*D*s, |k| = B*Hk*T*D*s, |cs| = T*D*s.

Floors (minimum bytes moved):
    forward   read q, k, write q', k'; read cos, sin      2*(|q|+|k|) + 2*|cs|
    backward  read dq', dk', write dq, dk; cos, sin       2*(|q|+|k|) + 2*|cs|
    full      both                                        4*(|q|+|k|) + 4*|cs|
The issue's table: full floor 0.157 ms at 4.27 TB/s.
"""

from __future__ import annotations

import torch

from benchmarks.harness import Floor, Inputs, OpSpec, Target, dtype_size

GPU_SHAPES = [
    {"B": 4, "T": 4096, "Hq": 32, "Hk": 8, "D": 128},
    {"B": 4, "T": 1024, "Hq": 32, "Hk": 8, "D": 128},
    {"B": 4, "T": 16384, "Hq": 32, "Hk": 8, "D": 128},
]
TINY_SHAPES = [{"B": 1, "T": 8, "Hq": 4, "Hk": 2, "D": 16}, {"B": 2, "T": 16, "Hq": 4, "Hk": 2, "D": 16}]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``apply_rotary_pos_emb`` of HF Llama with ``unsqueeze_dim=1``."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _liger_rope():
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    return lambda q, k, cos, sin: liger_rotary_pos_emb(q, k, cos, sin)


def _heads_view(b: int, t: int, h: int, d: int, dtype: torch.dtype, device: torch.device,
                requires_grad: bool) -> torch.Tensor:
    # (B, T, H, D) storage seen as (B, H, T, D), as after `proj(x).view(B, T, H, D).transpose(1, 2)`.
    x = torch.randn(b, t, h, d, device=device, dtype=dtype).transpose(1, 2)
    return x.requires_grad_() if requires_grad else x


def _rotary_cos_sin(t: int, d: int, dtype: torch.dtype, device: torch.device):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)


def make_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
    b, t, hq, hk, d = (shape[k] for k in ("B", "T", "Hq", "Hk", "D"))
    q = _heads_view(b, t, hq, d, dtype, device, True)
    k = _heads_view(b, t, hk, d, dtype, device, True)
    cos, sin = _rotary_cos_sin(t, d, dtype, device)
    grad_output = (_heads_view(b, t, hq, d, dtype, device, False), _heads_view(b, t, hk, d, dtype, device, False))
    return Inputs(args=(q, k, cos, sin), grad_args=(0, 1), grad_output=grad_output)


def _qk_bytes(shape: dict[str, int], dtype: torch.dtype) -> tuple[float, float]:
    s = dtype_size(dtype)
    qk = shape["B"] * (shape["Hq"] + shape["Hk"]) * shape["T"] * shape["D"] * s
    return qk, shape["T"] * shape["D"] * s


def floor(shape: dict[str, int], dtype: torch.dtype, mode: str) -> Floor:
    qk, cs = _qk_bytes(shape, dtype)
    one_way = 2 * qk + 2 * cs
    return Floor(bytes=2 * one_way if mode == "full" else one_way)


def floor_peak(shape: dict[str, int], dtype: torch.dtype, mode: str) -> float:
    return _qk_bytes(shape, dtype)[0]  # q', k' (forward) or dq, dk (backward, full)


SPECS = [
    OpSpec(
        name="rope",
        shape_keys=("B", "T", "Hq", "Hk", "D"),
        gpu_shapes=GPU_SHAPES,
        tiny_shapes=TINY_SHAPES,
        make_inputs=make_inputs,
        reference=hf_rotary_pos_emb,
        liger=_liger_rope,
        floor=floor,
        floor_peak_bytes=floor_peak,
        size=lambda s: s["B"] * (s["Hq"] + s["Hk"]) * s["T"] * s["D"],
        size_label="q+k elements",
        targets=(Target("full", "efficiency", 0.85),),
    ),
]
