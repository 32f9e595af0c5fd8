"""Rotary position embedding: a drop-in for Hugging Face's ``apply_rotary_pos_emb``.

The math, the accepted layouts (GQA, transposed and fused-qkv views, partial rotary) and the
backward are documented in :mod:`liger_kernel.ops.rope`. Needs only torch and triton.
"""

from __future__ import annotations

import torch

from liger_kernel.ops.rope import LigerRopeFunction


def liger_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         position_ids: torch.Tensor | None = None,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``, as HF's ``apply_rotary_pos_emb``.

    Args:
        q: (B, Hq, T, D) queries ((B, T, Hq, D) with ``unsqueeze_dim=2``); any strides with a
            unit-stride last dim.
        k: (B, Hk, T, D) keys (Hk may differ from Hq), laid out like q.
        cos, sin: (1, T, R) or (B, T, R) (or a (T, R) table). ``R < D`` rotates only the first R
            channels and passes the rest through (Phi-3 partial rotary); R must be even.
        position_ids: ignored for 3-D cos/sin (HF's deprecated argument); indexes a 2-D
            (max_positions, R) cos/sin table when given.
        unsqueeze_dim: 1 when the head dim of q/k is dim 1, 2 when it is dim 2.

    Returns:
        ``(q_embed, k_embed)`` with q's and k's shapes and dtypes.
    """
    return LigerRopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


# The functional API name.
liger_rope = liger_rotary_pos_emb
