"""Tree attention whose output row for a query does not depend on the shape of the step it is in: the
same bits whether the query is a plain one-row step, a node of a tree of any size, a row beside other
requests, or a row of a prompt chunk (float32 on a CPU; `bench/results/invariance_cpu.md` has the
probes it rests on).

Where the reference (`reference.py`) differs by shape: SDPA's blocking follows the call's query and key
counts, a request's keys are padded to its group's, and a tree node's ancestors sit at scratch-tree
slots, not at the positions a plain step gives them. Here every sum a query's output depends on has an
order fixed by the query's own context:

- Each key a query sees has a canonical position: a committed slot's is the slot, a tree slot's is
  the tree's start plus its depth, what a plain step would give it. Keys go to chunks of CHUNK
  canonical positions, in slot order within a chunk (a tree's ancestors come in depth order, since
  parents precede children); a chunk holds, beside a query's own keys, other queries' tree nodes and
  padding, which it does not see.
- Scores: q @ K^T, K^T row-major, a dot product of the head dimension per score, by a BLAS product of
  at least 2 rows (a query's heads of one KV head are its rows; GQA keeps each KV head once).
- Softmax without rescaling: the row's maximum over the keys it sees (exact whatever the order), exp.
- Per chunk, P @ [V | 1]: the weighted sum and the weight's sum over the chunk's keys in one product
  whose k terms the chunk orders; a key not seen has weight exactly 0.
- The chunks' partial sums added in chunk order, in float64, then divided.

What this relies on of the BLAS (x @ W, MKL on x86), for products of at least 2 rows: a row's result
does not depend on the rows or columns beside it, in a batched product too, and the sum over k of up to
MAX_PLACES terms is one chain in k's order, so zero terms inserted among or appended to it leave it
unchanged; and of exp, that an element's result does not depend on where it falls in the tensor. `blas_keeps_rows` checks that once per process, and the first call refuses to run where it
does not hold (`python -m specinfer_bench.invariance` probes more of it).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .batch import TreeBatch
from .reference import live_groups

CHUNK = 128  # canonical positions per chunk: a chunk's product sums at most CHUNK + a tree's nodes terms
MAX_PLACES = 320  # places of a chunk at most (a tree of up to about 190 nodes): the longest sum checked


class Group(NamedTuple):
    """Requests attended together: B of them, M queries each at most, their keys laid out in NC chunks of LC."""

    B: int
    M: int
    rows: torch.Tensor  # the group's queries, in order
    where: tuple[torch.Tensor, torch.Tensor]  # each query's (request in the group, row) index into [B, M]
    slots: torch.Tensor  # [B * NC * LC] int64: each place's slot of the layer's pool, viewed [slots, Hkv, D]
    hidden: torch.Tensor  # [B, 1, NC, rows, LC]: -inf where a row (query * G + head, at least 2) does not see, else 0
    values: torch.Tensor  # [B, Hkv, NC, LC, D + 1]: [..., :D] each layer's values in turn, [..., D] ones
    NC: int
    LC: int


def tree_attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TreeBatch,
                             scale: float | None = None) -> torch.Tensor:
    """Same contract as `tree_attention_reference`: q [N, Hq, D]; k_cache, v_cache [n_blocks, block_size,
    Hkv, D]. Returns [N, Hq, D] in q's dtype, each row computed as the module says."""
    if (broken := blas_keeps_rows(q.device.type, q.dtype)) is not None:
        raise RuntimeError(f"row-invariant tree attention is not available here: {broken}")
    n_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    G = hq // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    keys, values = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    out = torch.zeros_like(q)
    for g in batch.derived(("invariant", G, hkv, d, q.dtype), lambda: _plan(batch, G, hkv, d, q.dtype)):
        qp = q.new_zeros(g.B, g.M, hq, d)
        qp[g.where] = q[g.rows] * scale
        qp = qp.view(g.B, g.M, hkv, G, d).transpose(1, 2).reshape(g.B, hkv, 1, g.M * G, d)  # row = query * G + head
        if g.M * G == 1:  # one row: a BLAS may take another path (GEMV); a zero row beside it
            qp = torch.cat([qp, torch.zeros_like(qp)], 3)
        k = keys.index_select(0, g.slots).view(g.B, g.NC, g.LC, hkv, d).permute(0, 3, 1, 4, 2).contiguous()
        s = torch.matmul(qp, k).add_(g.hidden)  # [B, Hkv, NC, rows, LC]; a place not seen is -inf
        p = s.sub_(s.amax(4, keepdim=True).amax(2, keepdim=True)).exp_()
        v = g.values  # [V | 1]: the weights' sum from the same product; the ones are the plan's
        v[..., :d].copy_(values.index_select(0, g.slots).view(g.B, g.NC, g.LC, hkv, d).permute(0, 3, 1, 2, 4))
        parts = torch.matmul(p, v)  # [B, Hkv, NC, rows, D + 1]
        total = parts[:, :, 0].double()
        for c in range(1, g.NC):  # in chunk order; a chunk a row does not reach adds exact zeros
            total += parts[:, :, c]
        total = total.to(q.dtype)
        o = (total[..., :d] / total[..., d:])[:, :, : g.M * G]
        o = o.view(g.B, hkv, g.M, G, d).transpose(1, 2).reshape(g.B, g.M, hq, d)
        out[g.rows] = o[g.where]
    return out


def _plan(batch: TreeBatch, G: int, hkv: int, d: int, dtype: torch.dtype) -> list[Group]:
    """What every layer's call shares, from the batch, the KV heads' count and size (G query heads each)
    and q's dtype: its groups (as the reference's), each request's keys in chunks by canonical position,
    the mask of the rows (as -inf to add to the scores) and a buffer for the values."""
    q_starts, sizes, groups = live_groups(batch)
    if not groups:
        return []
    device = batch.causal.device
    live, n_real = len(sizes), q_starts[len(sizes)]
    L = max(n for _, n in sizes)
    visible = batch.visible(L)[:n_real]  # [N, L]
    owner = batch.query_requests[:n_real].long()
    # a seen key's canonical position: the keys a query sees, in slot order, are its context in order
    seen = torch.where(visible, visible.long().cumsum(1) - 1, -1)
    position = torch.full((live, L), -1, dtype=torch.long, device=device)
    position.scatter_reduce_(0, owner[:, None].expand(-1, L), seen, "amax")  # -1: a key no query sees
    out = []
    for members in groups:
        index = torch.tensor(members, device=device)
        B, M = len(members), max(sizes[b][0] for b in members)
        pos = position[index]  # [B, L]
        b_of, slot = (pos >= 0).nonzero(as_tuple=True)
        chunk = pos[b_of, slot] // CHUNK
        NC = int(chunk.max()) + 1
        cell = b_of * NC + chunk  # the (request, chunk) each seen key goes to, keys in slot order
        counts = torch.bincount(cell, minlength=B * NC)
        LC = max(8, -(-int(counts.max()) // 8) * 8)
        if LC > MAX_PLACES:
            raise ValueError(f"row-invariant tree attention: a chunk of {LC} keys, more than {MAX_PLACES} (a tree too "
                             f"large for one chunk)")
        # each key's place in its chunk, in slot order: a chunk's keys need not be one run of slots (a tree
        # across a chunk's end: a branch's deep nodes, past it, come before another branch's shallow ones)
        by_cell = torch.argsort(cell, stable=True)
        place = torch.empty_like(cell)
        place[by_cell] = torch.arange(len(cell), device=device) - (counts.cumsum(0) - counts)[cell[by_cell]]
        slots = torch.zeros(B, NC * LC, dtype=torch.long, device=device)
        valid = torch.zeros(B, NC * LC, dtype=torch.bool, device=device)
        at = chunk * LC + place
        tables = batch.block_tables[index].long()
        slots[b_of, at] = tables[b_of, slot // batch.block_size] * batch.block_size + slot % batch.block_size
        valid[b_of, at] = True
        logical = torch.zeros(B, NC * LC, dtype=torch.long, device=device)
        logical[b_of, at] = slot
        rows = torch.cat([torch.arange(q_starts[b], q_starts[b + 1], device=device) for b in members])
        local = torch.cat([torch.full((sizes[b][0],), i, device=device) for i, b in enumerate(members)])
        row = rows - torch.tensor([q_starts[b] for b in members], device=device)[local]
        mask = torch.zeros(B, M, NC * LC, dtype=torch.bool, device=device)
        mask[local, row] = visible[rows].gather(1, logical[local]) & valid[local]
        mask[..., 0] |= ~mask.any(-1)  # padding queries see one place, so that nothing is NaN; their rows are dropped
        mask = mask[:, :, None].expand(B, M, G, NC * LC).reshape(B, M * G, NC, LC).transpose(1, 2)[:, None]
        hidden = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, -math.inf)
        hidden = hidden if M * G > 1 else torch.cat([hidden, hidden], 3)
        values = torch.ones(B, hkv, NC, LC, d + 1, dtype=dtype, device=device)
        out.append(Group(B, M, rows, (local, row), slots.flatten(), hidden, values, NC, LC))
    return out


@functools.cache
def blas_keeps_rows(device: str, dtype: torch.dtype) -> str | None:
    """None where products on `device` in `dtype` keep what this module relies on (see the module); else
    what they do not keep, in words. Checked once per process, on random data, in a few milliseconds."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    a, b = rand(40, 64), rand(64, 96)
    ref = (a[:2] @ b)[0]
    if not all(torch.equal((a[:m] @ b)[0], ref) for m in (3, 5, 17, 40)):
        return "a row of a product gets other bits by the rows beside it"
    if not torch.equal((a[:2] @ torch.cat([b, rand(64, 40)], 1))[0, :96], ref):
        return "a row of a product gets other bits by the columns beside it"
    ab, bb = rand(6, 2, 64), rand(6, 64, 96)
    ab[0], bb[0] = a[:2], b
    if not torch.equal(torch.bmm(ab, bb)[0, 0], ref):
        return "a row of a batched product gets other bits than alone"
    for k in (8, 64, 200, MAX_PLACES - 32):
        p, v = rand(3, k).abs(), rand(k, 65)
        one = (p @ v)[0]
        appended = torch.cat([p, p.new_zeros(3, 32)], 1) @ torch.cat([v, rand(32, 65)])
        at = torch.arange(k) * 2 - torch.arange(k).clamp(max=k - 32) if k > 32 else torch.arange(k) * 2
        spread, vs = p.new_zeros(3, int(at[-1]) + 1), rand(int(at[-1]) + 1, 65)
        spread[:, at], vs[at] = p, v
        if not (torch.equal(appended[0], one) and torch.equal((spread @ vs)[0], one)):
            return f"a product's sum over {k} terms changes with zero terms beside them (not one chain in order)"
    x = rand(1000) * 4
    whole = torch.exp(x)
    if not all(torch.equal(torch.exp(x[i: i + n]), whole[i: i + n]) for i, n in ((0, 5), (3, 37), (500, 31), (1, 999))):
        return "exp gives an element other bits by where it falls in the tensor (a vectorized loop's tail)"
    return None
