"""A small decoder-only language model composed from liger_kernel's modules.

No Hugging Face model code: the blocks are written out so every Liger piece is visible.

Per layer (pre-norm)::

    h = x + Attention(LigerRMSNorm(x))      # q, k rotated by liger_rotary_pos_emb, causal sdpa
    y = h + LigerSwiGLUMLP(LigerRMSNorm(h)) # down(silu(gate(x)) * up(x))

then a final ``LigerRMSNorm`` and the LM head with its loss fused:
``LigerFusedLinearCrossEntropyLoss()(embedding.weight, hidden (N, D), targets (N,))`` - the
(N, vocab) logits are never materialised. The head is tied to the token embedding.

``LigerDecoder(config, use_liger=False)`` runs the same parameters through plain PyTorch
(the reference used by the tests): RMSNorm, rotary embedding, SwiGLU and the loss written
with torch ops, logits materialised.

This file needs only torch and liger_kernel (not Lightning, not transformers).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from liger_kernel.transformers import (
    LigerFusedLinearCrossEntropyLoss,
    LigerRMSNorm,
    LigerSwiGLUMLP,
    liger_rotary_pos_emb,
)


@dataclass
class DecoderConfig:
    vocab_size: int = 257  # 256 byte values + one separator
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"  # read by LigerSwiGLUMLP
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape (1, T, head_dim) in the Hugging Face layout (frequencies repeated twice).

    Angle of position p, pair i: ``p * theta ** (-2i / head_dim)``, computed in float32.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _reference_rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Llama casting: normalise in fp32, cast back, then scale.
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * y.to(x.dtype)


def _reference_rope(q, k, cos, sin):
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _reference_swiglu(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary position embeddings."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, use_liger: bool) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (B, T, H*D) -> (B, H, T, D): transposed views, as in HF models; the RoPE kernel takes them as they are.
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = liger_rotary_pos_emb(q, k, cos, sin) if use_liger else _reference_rope(q, k, cos, sin)
        repeat = self.num_heads // self.num_kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.input_norm = LigerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = LigerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LigerSwiGLUMLP(config)

    def forward(self, x, cos, sin, use_liger: bool):
        norm = (lambda m, t: m(t)) if use_liger else _reference_rms_norm
        x = x + self.attention(norm(self.input_norm, x), cos, sin, use_liger)
        h = norm(self.mlp_norm, x)
        return x + (self.mlp(h) if use_liger else _reference_swiglu(self.mlp, h))


class LigerDecoder(nn.Module):
    """Decoder LM; ``forward(input_ids (B, T)) -> mean next-token loss`` (a float32 scalar)."""

    def __init__(self, config: DecoderConfig, use_liger: bool = True):
        super().__init__()
        self.config = config
        self.use_liger = use_liger
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LigerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.loss_fn = LigerFusedLinearCrossEntropyLoss()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
        # Scale the residual-branch outputs down with depth (GPT-2 style) for a stable start.
        for layer in self.layers:
            for proj in (layer.attention.o_proj, layer.mlp.down_proj):
                nn.init.normal_(proj.weight, std=std / math.sqrt(2 * self.config.num_hidden_layers))

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states (B, T, D)."""
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(input_ids.shape[1], self.config.head_dim, self.config.rope_theta, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, self.use_liger)
        return self.norm(x) if self.use_liger else _reference_rms_norm(self.norm, x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be (batch, seq >= 2), got shape {tuple(input_ids.shape)}")
        hidden = self.hidden_states(input_ids[:, :-1])
        targets = input_ids[:, 1:].reshape(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.use_liger:
            return self.loss_fn(self.embed_tokens.weight, flat, targets)
        logits = flat @ self.embed_tokens.weight.t()
        return F.cross_entropy(logits.float(), targets)
