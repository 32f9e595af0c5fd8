"""Rotary position embedding: a drop-in for Hugging Face's ``apply_rotary_pos_emb``.

The math, the accepted layouts (GQA, transposed and fused-qkv views, partial rotary; rotate-half
or interleaved pairs, cos/sin per channel or per pair, the rotation by -theta) and the backward
are documented in :mod:`liger_kernel.ops.rope`. Needs only torch and triton.
"""

from __future__ import annotations

import torch

from liger_kernel.ops.rope import ROTATE_HALF, LigerRopeFunction, RopeLayout


def liger_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1,
                         layout: RopeLayout = ROTATE_HALF) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``, as HF's ``apply_rotary_pos_emb``.

    Args:
        q: (B, Hq, T, D) queries ((B, T, Hq, D) with ``unsqueeze_dim=2``); any strides with a
            unit-stride last dim.
        k: (B, Hk, T, D) keys (Hk may differ from Hq), laid out like q.
        cos, sin: (1, T, W) or (B, T, W) (or a (T, W) table), W = R the rotated channels (R/2
            for ``layout.table == "pair"``). ``R < D`` rotates only the first R channels and
            passes the rest through (partial rotary); R must be even.
        position_ids: ignored for 3-D cos/sin (HF's deprecated argument); indexes a 2-D
            (max_positions, W) cos/sin table when given.
        unsqueeze_dim: 1 when the head dim of q/k is dim 1, 2 when it is dim 2.
        layout: which channels pair up and which table entries rotate them
            (:class:`~liger_kernel.ops.rope.RopeLayout`); rotate-half by default.

    Returns:
        ``(q_embed, k_embed)`` with q's and k's shapes and dtypes.
    """
    return LigerRopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim, layout)


def liger_rotary_pos_emb_single(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
                                layout: RopeLayout = ROTATE_HALF) -> torch.Tensor:
    """RoPE of one tensor, as the per-tensor ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)``
    of Gemma 3n and Gemma 4: ``x`` (B, H, T, D) ((B, T, H, D) with ``unsqueeze_dim=2``), the
    other arguments as :func:`liger_rotary_pos_emb`. Returns x's shape and dtype."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 4-D tensor (B, H, T, D) or (B, T, H, D), got {shape}")
    # The kernel rotates q and k in one launch; here k has no heads.
    head_axis = 2 if unsqueeze_dim == 2 else 1
    no_heads = x.detach().narrow(head_axis, 0, 0)
    return LigerRopeFunction.apply(x, no_heads, cos, sin, None, unsqueeze_dim, layout)[0]


# The functional API name.
liger_rope = liger_rotary_pos_emb
