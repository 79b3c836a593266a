"""Attention of a request's new queries over its cached keys and values, under an explicit mask.

This is the one interface the model calls. Here it is PyTorch's scaled_dot_product_attention with
a boolean mask (the readable reference); a fused tree-attention kernel plugs in behind the same
signature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [n, Hq, D]; k, v [Hkv, T, D] with Hq a multiple of Hkv; mask [n, T] bool (True: attend).
    Returns [n, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask[None, None], enable_gqa=True
    )  # [1, Hq, n, D]
    return out[0].transpose(0, 1)
