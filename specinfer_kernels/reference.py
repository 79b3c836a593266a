"""Tree attention over a paged KV cache in plain PyTorch: the readable definition the Triton
kernel is tested against, and what the model runs where there is no GPU.

Requests of like shape at once: gather each group's keys and values through its block tables into
a padded [B, max_seq_len] layout, scatter its flat queries into [B, max_queries], build the mask
from the batch's causal limits and tree bits (padding keys hidden; padding query rows see key 0 so
that nothing is NaN; the padding queries of a batch with a Capacity get zeros), and make one call
to PyTorch's scaled_dot_product_attention (GQA by `enable_gqa`, no K/V copies per head). A batch
whose requests are alike is one group, so the ops dispatched do not depend on the batch size. A
request far larger than the rest (a prompt's chunk of hundreds of rows on a long record, beside
decoding requests of a few rows each) is a group of its own: padded with them, every request would
pay its rows times its keys (`_groups`). The index and mask tensors are built once per batch and
shared by all layers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .batch import TreeBatch

# what one more call costs, in query-key pairs of attention: a request joins the group before it
# unless padding it in costs more than its own call would
CALL_PAIRS = 1 << 16


class Group(NamedTuple):
    """Requests attended in one call: B of them, padded to M queries and L keys each."""

    B: int
    M: int
    L: int
    rows: torch.Tensor | None  # the queries of the group, in order (None: the batch's first n_real, all of it)
    tables: torch.Tensor  # [B * blocks] their block tables, flattened
    where: tuple[torch.Tensor, torch.Tensor]  # each query's (request in the group, row) index into [B, M]
    mask: torch.Tensor  # [B, 1, M, L]


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TreeBatch,
                             scale: float | None = None) -> torch.Tensor:
    """q [N, Hq, D]; k_cache, v_cache [n_blocks, block_size, Hkv, D] (one layer of the pool), Hq a
    multiple of Hkv. Returns [N, Hq, D] in q's dtype."""
    n_q, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert hq % hkv == 0 and k_cache.shape == v_cache.shape and bs == batch.block_size
    groups = batch.derived("reference", lambda: _plan(batch))

    def attend(g: Group, qg: torch.Tensor) -> torch.Tensor:
        k = k_cache.index_select(0, g.tables).view(g.B, -1, hkv, d)[:, :g.L].transpose(1, 2)  # [B, Hkv, L, D]
        v = v_cache.index_select(0, g.tables).view(g.B, -1, hkv, d)[:, :g.L].transpose(1, 2)
        qp = q.new_zeros(g.B, g.M, hq, d)
        qp[g.where] = qg
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=g.mask, scale=scale,
                                           enable_gqa=True)  # [B, Hq, M, D]
        return o.transpose(1, 2)[g.where]

    if len(groups) == 1 and groups[0].rows is None and len(groups[0].where[0]) == n_q:
        return attend(groups[0], q)
    out = torch.zeros_like(q)
    for g in groups:
        if g.rows is None:
            n = len(g.where[0])
            out[:n] = attend(g, q[:n])
        else:
            out[g.rows] = attend(g, q[g.rows])
    return out


def _groups(sizes: list[tuple[int, int]]) -> list[list[int]]:
    """The requests (by index) of each call, from each request's (queries, keys): in order of
    queries then keys, most first, each joins the group before it unless padding it to the group's
    shape (or the group to its) costs more query-key pairs than a call of its own (CALL_PAIRS more)."""
    groups: list[list[int]] = []
    shape = (0, 0)  # the last group's padded (queries, keys)
    for b in sorted(range(len(sizes)), key=lambda b: sizes[b], reverse=True):
        m, n = sizes[b]
        if groups:
            joined = (len(groups[-1]) + 1) * max(shape[0], m) * max(shape[1], n)
            if joined <= len(groups[-1]) * shape[0] * shape[1] + m * n + CALL_PAIRS:
                groups[-1].append(b)
                shape = (max(shape[0], m), max(shape[1], n))
                continue
        groups.append([b])
        shape = (m, n)
    return groups


def live_groups(batch: TreeBatch) -> tuple[list[int], list[tuple[int, int]], list[list[int]]]:
    """The batch's query starts, each live request's (queries, keys), and the groups (`_groups`) of
    those with queries (none: no query)."""
    seq_lens, q_starts = batch.host_seq_lens.tolist(), batch.host_q_starts.tolist()
    live = sum(1 for n in seq_lens if n > 0)
    sizes = [(q_starts[b + 1] - q_starts[b], seq_lens[b]) for b in range(live)]
    members = [[b for b in g if sizes[b][0]] for g in _groups(sizes)] if q_starts[live] else []
    return q_starts, sizes, [g for g in members if g]


def _plan(batch: TreeBatch) -> list[Group]:
    """What every layer's call shares, from the batch alone: its groups of live requests with
    queries. This batch's own sizes, not a capacity's bounds: the reference never runs inside a
    graph. A padded batch's empty slots and padding request (no keys) come last; their rows stay
    zeros."""
    q_starts, sizes, members = live_groups(batch)
    if not members:
        return []
    device = batch.causal.device
    live, n_real = len(sizes), q_starts[len(sizes)]
    visible = batch.visible(max(n for _, n in sizes))[:n_real]
    if len(members) == 1:  # the whole batch in its own order: no gathering of queries
        members = [list(range(live))]
    out = []
    for g in members:
        B, M, L = len(g), max(sizes[b][0] for b in g), max(sizes[b][1] for b in g)
        index = torch.tensor(g, device=device)
        tables = batch.block_tables[index, : math.ceil(L / batch.block_size)].long().flatten()
        if len(members) == 1:
            rows = None
            owner = batch.query_requests[:n_real].long()
            row = torch.arange(n_real, device=device) - batch.q_starts.long()[owner]
        else:
            rows = torch.cat([torch.arange(q_starts[b], q_starts[b + 1], device=device) for b in g])
            owner = torch.cat([torch.full((sizes[b][0],), i, device=device) for i, b in enumerate(g)])
            row = rows - torch.tensor([q_starts[b] for b in g], device=device)[owner]
        where = (owner, row)
        mask = torch.zeros(B, M, L, dtype=torch.bool, device=device)
        mask[..., 0] = True
        mask[where] = visible[slice(None) if rows is None else rows, :L]
        out.append(Group(B, M, L, rows, tables, where, mask[:, None]))
    return out
