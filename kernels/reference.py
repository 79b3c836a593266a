"""Tree attention over a paged KV cache in plain PyTorch: the readable definition the Triton
kernel is tested against, and what the model runs where there is no GPU.

The whole batch at once: gather every request's keys and values through its block table into a
padded [B, max_seq_len] layout, scatter the flat queries into [B, max_queries], build the mask
from the batch's causal limits and tree bits (padding keys hidden; padding query rows see key 0 so
that nothing is NaN; the padding queries of a batch with a Capacity get zeros), and make one call
to PyTorch's scaled_dot_product_attention (GQA by `enable_gqa`, no K/V copies per head). The index
and mask tensors are built once per batch and shared by all layers. The ops dispatched do not
depend on the batch size.
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
    plan = batch.derived("reference", lambda: _plan(batch))
    if plan is None:
        return torch.zeros_like(q)
    B, M, n_real, tables, where, mask = plan
    L = mask.shape[-1]
    k = k_cache.index_select(0, tables).view(B, -1, hkv, d)[:, :L].transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache.index_select(0, tables).view(B, -1, hkv, d)[:, :L].transpose(1, 2)
    qp = q.new_zeros(B, M, hq, d)
    qp[where] = q[:n_real]
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=True)  # [B, Hq, M, D]
    if n_real == n_q:
        return o.transpose(1, 2)[where]
    out = torch.zeros_like(q)
    out[:n_real] = o.transpose(1, 2)[where]
    return out


def _plan(batch: TreeBatch):
    """What every layer's call shares, from the batch alone: (requests B, queries per request M, real
    queries, the live requests' block tables flattened [B * blocks], each query's (request, row) index into
    [B, M], the mask [B, 1, M, L]); None when no query is real. This batch's own sizes, not a
    capacity's bounds: the reference never runs inside a graph. A padded batch's empty slots and
    padding request (no keys) come last; their rows stay zeros."""
    seq_lens, q_starts = batch.host_seq_lens.tolist(), batch.host_q_starts.tolist()
    live = sum(1 for n in seq_lens if n > 0)
    n_real = q_starts[live]
    if n_real == 0:
        return None
    qs = q_starts[: live + 1]
    B, L, M = live, max(seq_lens, default=0), max(b - a for a, b in zip(qs, qs[1:]))
    device = batch.causal.device
    tables = batch.block_tables[:B, : math.ceil(L / batch.block_size)].long().flatten()
    owner = batch.query_requests[:n_real].long()
    row = torch.arange(n_real, device=device) - batch.q_starts.long()[owner]  # index within its request
    where = (owner, row)
    mask = torch.zeros(B, M, L, dtype=torch.bool, device=device)
    mask[..., 0] = True
    mask[where] = batch.visible(L)[:n_real]
    return B, M, n_real, tables, where, mask[:, None]
