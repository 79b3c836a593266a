"""Tree attention over a paged KV cache in plain PyTorch: the readable definition the Triton
kernel is tested against, and what the model runs where there is no GPU.

Per request: gather its keys and values through its block table, build its mask from the batch's
causal limits and tree bits, and hand both to PyTorch's scaled_dot_product_attention (GQA by
`enable_gqa`, no K/V copies per head; no mask at all when every query sees every key, the plain
decoding case).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .batch import TreeBatch


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TreeBatch,
                             scale: float | None = None) -> torch.Tensor:
    """q [N, Hq, D]; k_cache, v_cache [n_blocks, block_size, Hkv, D] (one layer of the pool), Hq a
    multiple of Hkv. Returns [N, Hq, D] in q's dtype."""
    n_q, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert hq % hkv == 0 and k_cache.shape == v_cache.shape and bs == batch.block_size
    out = torch.empty_like(q)
    for b, n in enumerate(batch.host_seq_lens):
        a, e = batch.host_q_starts[b], batch.host_q_starts[b + 1]
        if a == e:
            continue
        blocks = batch.block_tables[b, : math.ceil(n / bs)]
        k = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)  # [Hkv, n, D]
        v = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[a:e].transpose(0, 1)[None], k[None], v[None],
                                           attn_mask=batch.masks[b], scale=scale, enable_gqa=True)  # [1, Hq, nq, D]
        out[a:e] = o[0].transpose(0, 1)
    return out
