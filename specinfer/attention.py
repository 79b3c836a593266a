"""Attention of a request's new queries over its cached keys and values, under an explicit mask.

This is the one interface the model calls: `attention_mask` turns a request's boolean mask into
what `tree_attention` takes, once per forward pass, and `tree_attention` runs per layer. Here it
is PyTorch's scaled_dot_product_attention with an additive mask (the readable reference); a fused
tree-attention kernel plugs in behind the same two functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """mask [n, T] bool (True: attend) -> additive mask [n, T], or None when every query sees
    every key (a single new token, the common decode case)."""
    if bool(mask.all()):
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [n, Hq, D]; k, v [Hkv, T, D] with Hq a multiple of Hkv; mask from `attention_mask`.
    Returns [n, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None],
        attn_mask=None if mask is None else mask[None, None], enable_gqa=True,
    )  # [1, Hq, n, D]
    return out[0].transpose(0, 1)
