"""Tree attention whose output row for a query does not depend on the shape of the step it is in: the
same bits whether the query is a plain one-row step, a node of a tree of any size, a row beside other
requests, or a row of a prompt chunk (float32 on a CPU; `bench/results/invariance_cpu.md` has the
probes it rests on).

Where the reference (`reference.py`) differs by shape: SDPA's blocking follows the call's query and key
counts, a request's keys are padded to its group's, and a tree node's ancestors sit at scratch-tree
slots, not at the positions a plain step gives them. Here every sum a query's output depends on has an
order and a length fixed by the query's own context:

- A query sees one key at each canonical position up to its own: its context in order (a tree node's
  ancestors at the tree's start plus their depth, what a plain step would give them). Keys go to
  cells of CHUNK canonical positions, a key at place `position % CHUNK` of its cell. Where each of a
  request's positions in a chunk is one key, every query of the request shares the cell; where a
  tree's branches put two keys at one position, the chunk has a cell for each path through it (one
  per leaf of the tree), read by the queries on that path. A cell's places a query does not see
  (later positions) have weight exactly 0.
- Scores: q @ K^T, a dot product of the head dimension per score, in products of CHUNK columns whose
  rows (a query's heads of one KV head, queries of a shared cell) come in multiples of ROWS.
- Softmax without rescaling: the row's maximum over the keys it sees (exact whatever the order), exp.
- Per cell, P @ [V | 1]: the weighted sum and the weight's sum over the cell's CHUNK places in one
  product of CHUNK terms, the same places whether the query is in a plain step or a tree step.
- The cells' partial sums added in chunk order, in float64, then divided.

What this relies on of the BLAS (x @ W, MKL on x86), for products whose row count is a multiple of
ROWS, of CHUNK columns or CHUNK terms: a row's result does not depend on the rows beside it, nor on
the product's row count or place in a batch of products; and of exp, that an element's result does not
depend on where it falls in the tensor. Not relied on, since neither holds on every x86 (an AVX2 EPYC
breaks both): that a product of fewer rows, or a sum of other length with zeros among its terms, gives
the same bits. `blas_keeps_rows` checks that once per process, and the first call refuses to run where
it does not hold (`python -m specinfer_bench.invariance` probes more of it).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .batch import TreeBatch
from .reference import live_groups

CHUNK = 128  # canonical positions per cell: every P @ V product sums exactly CHUNK terms
ROWS = 4  # a product's rows come in multiples of ROWS (an AVX2 MKL computes the rows of a smaller tail otherwise)


class Cells(NamedTuple):
    """Cells of CHUNK places read in one batched product: their keys' slots and which rows see which place."""

    slots: torch.Tensor  # [cells * CHUNK] int64: each place's slot of the layer's pool, viewed [slots, Hkv, D]
    hidden: torch.Tensor  # [..., R, CHUNK], broadcast over KV heads: -inf where a row does not see a place, else 0
    values: torch.Tensor  # [..., Hkv, CHUNK, D + 1]: [..., :D] each layer's values in turn, [..., D] ones


class Group(NamedTuple):
    """Requests attended together: B of them, M queries each at most, R = M * G rows padded to ROWS, in NC
    shared cells each (a cell that branches holds nothing there); and where a request's chunk branches, a
    cell for each path through it (a leaf of the tree), read by MB queries at most."""

    B: int
    M: int
    R: int
    NC: int
    rows: torch.Tensor  # the group's queries, in order
    where: tuple[torch.Tensor, torch.Tensor]  # each query's (request in the group, row) index into [B, M]
    shared: Cells  # B * NC cells; hidden [B, 1, NC, R, CHUNK]; values [B, Hkv, NC, CHUNK, D + 1]
    branch: Cells | None  # X cells; hidden [X, 1, MB * G padded to ROWS, CHUNK]; values [X, Hkv, CHUNK, D + 1]
    MB: int
    # each (query, branching chunk it reaches): its query (a row of the batch) and (cell, query of the cell)
    pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    # each of their rows (query * G + head): its (request, chunk, row) in the shared cells, (cell, row) in its branch's
    at: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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
        B, NC, R = g.B, g.NC, g.R
        qp = q.new_zeros(B, g.M, hq, d)
        qp[g.where] = q[g.rows] * scale
        qp = qp.view(B, g.M, hkv, G, d).transpose(1, 2).reshape(B, hkv, 1, g.M * G, d)  # row = query * G + head
        qp = torch.nn.functional.pad(qp, (0, 0, 0, R - g.M * G))
        s = torch.matmul(qp, _cell_keys(keys, g.shared, (B, NC))).add_(g.shared.hidden)  # [B, Hkv, NC, R, CHUNK]
        top = s.amax(4).amax(2)  # [B, Hkv, R]: -inf for a row that sees no shared place
        if g.branch is not None:
            X, RO = g.branch.hidden.shape[0], g.branch.hidden.shape[-2]
            query, cell, rank = g.pairs
            qb = q.new_zeros(X, g.MB, hq, d)
            qb[cell, rank] = q[query] * scale
            qb = qb.view(X, g.MB, hkv, G, d).transpose(1, 2).reshape(X, hkv, g.MB * G, d)
            qb = torch.nn.functional.pad(qb, (0, 0, 0, RO - g.MB * G))
            sb = torch.matmul(qb, _cell_keys(keys, g.branch, (X,))).add_(g.branch.hidden)  # [X, Hkv, RO, CHUNK]
            b, c, r, x, xr = g.at
            branch_top = sb.amax(3)  # [X, Hkv, RO]
            flat = top.transpose(1, 2).contiguous().view(B * R, hkv)  # a row's maximum over its branch cells too
            flat.scatter_reduce_(0, (b * R + r)[:, None].expand(-1, hkv), branch_top.transpose(1, 2)[x, xr], "amax")
            branch_top.transpose(1, 2)[x, xr] = flat[b * R + r]
            top = flat.view(B, R, hkv).transpose(1, 2)
            parts_branch = torch.matmul(sb.sub_(branch_top[..., None]).exp_(), _cell_values(values, g.branch, (X,)))
        p = s.sub_(top[:, :, None, :, None]).exp_()
        parts = torch.matmul(p, _cell_values(values, g.shared, (B, NC)))  # [B, Hkv, NC, R, D + 1]
        if g.branch is not None:  # a branching chunk's rows in its shared cell saw nothing there: exact zeros, replaced
            parts.permute(0, 2, 3, 1, 4)[b, c, r] = parts_branch.transpose(1, 2)[x, xr]
        total = parts[:, :, 0].double()
        for c in range(1, NC):  # in chunk order; a chunk a row does not reach adds exact zeros
            total += parts[:, :, c]
        total = total.to(q.dtype)
        o = (total[..., :d] / total[..., d:])[:, :, : g.M * G]
        o = o.view(B, hkv, g.M, G, d).transpose(1, 2).reshape(B, g.M, hq, d)
        out[g.rows] = o[g.where]
    return out


def _cell_keys(keys: torch.Tensor, cells: Cells, lead: tuple[int, ...]) -> torch.Tensor:
    """The cells' keys as [*lead, Hkv, D, CHUNK] (lead: the cells' shape; shared cells [B, NC] come as
    [B, Hkv, NC, D, CHUNK])."""
    hkv, d = keys.shape[1:]
    k = keys.index_select(0, cells.slots).view(*lead, CHUNK, hkv, d)
    return (k.permute(0, 3, 1, 4, 2) if len(lead) == 2 else k.permute(0, 2, 3, 1)).contiguous()


def _cell_values(values: torch.Tensor, cells: Cells, lead: tuple[int, ...]) -> torch.Tensor:
    """The cells' [V | 1] in the plan's buffer, [*lead, Hkv, CHUNK, D + 1] (shared: [B, Hkv, NC, CHUNK, D + 1])."""
    hkv, d = values.shape[1:]
    v = values.index_select(0, cells.slots).view(*lead, CHUNK, hkv, d)
    cells.values[..., :d].copy_(v.permute(0, 3, 1, 2, 4) if len(lead) == 2 else v.permute(0, 2, 1, 3))
    return cells.values


def _plan(batch: TreeBatch, G: int, hkv: int, d: int, dtype: torch.dtype) -> list[Group]:
    """What every layer's call shares, from the batch, the KV heads' count and size (G query heads each)
    and q's dtype: its groups (as the reference's), each request's keys in cells by canonical position,
    the masks of the rows (as -inf to add to the scores) and buffers for the values."""
    q_starts, sizes, groups = live_groups(batch)
    if not groups:
        return []
    device = batch.causal.device
    live, n_real = len(sizes), q_starts[len(sizes)]
    L = max(n for _, n in sizes)
    visible = batch.visible(L)[:n_real]  # [N, L]
    owner = batch.query_requests[:n_real].long()
    length = visible.sum(1)  # each query's context: it sees one key at each position below it
    # each key a query sees, at its canonical position: the keys a query sees, in slot order, are its context in order
    q_of, slot = visible.nonzero(as_tuple=True)
    pos = visible.long().cumsum(1)[q_of, slot] - 1
    path = torch.full((n_real, L), -1, dtype=torch.long, device=device)
    path[q_of, pos] = slot  # [N, L]: the slot a query sees at each position of its context
    # a position two of a request's keys hold (a tree's branches) makes its chunk branch: a cell per path
    slots_at = torch.full((live, L), -1, dtype=torch.long, device=device)
    slots_at.scatter_reduce_(0, owner[:, None].expand(-1, L), path, "amax")
    fewest = torch.full((live, L), L, dtype=torch.long, device=device)
    fewest.scatter_reduce_(0, owner[:, None].expand(-1, L), torch.where(path >= 0, path, L), "amin")
    n_chunks = -(-L // CHUNK)
    pad = n_chunks * CHUNK - L
    branches = torch.nn.functional.pad((slots_at >= 0) & (slots_at != fewest), (0, pad))
    branches = branches.view(live, n_chunks, CHUNK).any(2)  # [live, n_chunks]
    tables = batch.block_tables.long()

    def physical(request: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        return (tables[request, logical.clamp(min=0) // batch.block_size] * batch.block_size
                + logical.clamp(min=0) % batch.block_size) * (logical >= 0)

    out = []
    for members in groups:
        index = torch.tensor(members, device=device)
        B, M = len(members), max(sizes[b][0] for b in members)
        R = -(-M * G // ROWS) * ROWS
        rows = torch.cat([torch.arange(q_starts[b], q_starts[b + 1], device=device) for b in members])
        local = torch.cat([torch.full((sizes[b][0],), i, device=device) for i, b in enumerate(members)])
        row = rows - torch.tensor([q_starts[b] for b in members], device=device)[local]
        NC = -(-int(length[rows].max()) // CHUNK)
        # shared cells: [B, NC * CHUNK] places by position; a branching chunk's places hold nothing
        at = torch.nn.functional.pad(slots_at[index], (0, pad), value=-1)[:, : NC * CHUNK]
        split = branches[index, :NC].repeat_interleave(CHUNK, 1)
        at = torch.where(split, -1, at)
        sees = torch.arange(NC * CHUNK, device=device) < length[rows, None]  # [queries, places]
        mask = torch.zeros(B, M, NC * CHUNK, dtype=torch.bool, device=device)
        mask[local, row] = sees & (at[local] >= 0)
        mask = mask[:, :, None].expand(B, M, G, NC * CHUNK).reshape(B, M * G, NC, CHUNK).transpose(1, 2)
        mask = torch.nn.functional.pad(mask, (0, 0, 0, R - M * G))
        real = torch.zeros(B, R, dtype=torch.bool, device=device)  # padding rows see place 0, so that nothing is NaN
        real[:, : M * G] = (torch.arange(M, device=device) < torch.tensor(
            [sizes[b][0] for b in members], device=device)[:, None]).repeat_interleave(G, 1)
        mask[:, 0, :, 0] |= ~real
        shared = Cells(physical(index[:, None].expand_as(at), at).flatten(), _hidden(mask[:, None], dtype),
                       torch.ones(B, hkv, NC, CHUNK, d + 1, dtype=dtype, device=device))
        # branch cells: a cell for each leaf's path through each branching chunk, read by the queries on it
        reach = branches[index[local], :NC] & (torch.arange(NC, device=device) * CHUNK < length[rows, None])
        if not reach.any():
            out.append(Group(B, M, R, NC, rows, (local, row), shared, None, 0, (), ()))
            continue
        inside = reach.any(1).nonzero().flatten()  # the group's queries that reach a branching chunk
        leaf, rank = _leaves(path[rows[inside]], length[rows[inside]], local[inside])
        pq, pc = reach[inside].nonzero(as_tuple=True)  # (query of `inside`, chunk)
        cells, cell = torch.unique(leaf[pq] * NC + pc, return_inverse=True)
        X, MB = len(cells), int(rank.max()) + 1
        RO = -(-MB * G // ROWS) * ROWS
        places = (cells % NC)[:, None] * CHUNK + torch.arange(CHUNK, device=device)
        on_leaf = rows[inside[cells // NC]]
        logical = torch.nn.functional.pad(path[on_leaf], (0, pad), value=-1).gather(1, places)  # [X, CHUNK]
        query = rows[inside[pq]]
        heads = torch.arange(G, device=device)
        x, xr = cell.repeat_interleave(G), (rank[pq, None] * G + heads).flatten()
        mask = torch.zeros(X, RO, CHUNK, dtype=torch.bool, device=device)
        mask[x, xr] = (places[cell] < length[query, None]).repeat_interleave(G, 0)
        real = torch.zeros(X, RO, dtype=torch.bool, device=device)
        real[x, xr] = True
        mask[:, :, 0] |= ~real
        branch = Cells(physical(owner[on_leaf][:, None].expand_as(logical), logical).flatten(),
                       _hidden(mask[:, None], dtype), torch.ones(X, hkv, CHUNK, d + 1, dtype=dtype, device=device))
        at = (local[inside[pq]].repeat_interleave(G), pc.repeat_interleave(G),
              (row[inside[pq], None] * G + heads).flatten(), x, xr)
        out.append(Group(B, M, R, NC, rows, (local, row), shared, branch, MB, (query, cell, rank[pq]), at))
    return out


def _leaves(path: torch.Tensor, length: torch.Tensor, request: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For queries with their paths [Q, L] (the slot seen at each position), lengths and requests: each one's
    leaf (the first query whose path holds its own, itself if none), and its rank among its leaf's queries."""
    Q = len(length)
    key = path[torch.arange(Q, device=path.device), length - 1]  # each query's own key
    extends = ((path[:, length - 1] == key) & (length[:, None] > length) & (request[:, None] == request))  # [j, i]
    is_leaf = ~extends.any(0)
    leaf = ((extends | torch.eye(Q, dtype=torch.bool, device=path.device)) & is_leaf[:, None]).int().argmax(0)
    order = torch.argsort(leaf * Q + torch.arange(Q, device=path.device))
    counts = torch.bincount(leaf, minlength=Q)
    rank = torch.empty_like(leaf)
    rank[order] = torch.arange(Q, device=path.device) - (counts.cumsum(0) - counts)[leaf[order]]
    return leaf, rank


def _hidden(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """-inf where `mask` is False, else 0: what the scores add."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


@functools.cache
def blas_keeps_rows(device: str, dtype: torch.dtype) -> str | None:
    """None where products on `device` in `dtype` keep what this module relies on (see the module); else
    what they do not keep, in words. Checked once per process, on random data, in a few milliseconds."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    for k, n in ((32, CHUNK), (64, CHUNK), (128, CHUNK), (CHUNK, 33), (CHUNK, 65), (CHUNK, 129)):  # q K^T, P [V | 1]
        a, b = rand(12 * ROWS, k), rand(k, n)
        alone = torch.stack([(torch.cat([row[None], a.new_zeros(ROWS - 1, k)]) @ b)[0] for row in a])
        if not all(torch.equal(a[:m] @ b, alone[:m]) for m in (ROWS, 2 * ROWS, 3 * ROWS, 12 * ROWS)):
            return "a row of a product gets other bits by the rows beside it"
        shifted = torch.stack([a.roll(i * ROWS + 1, 0) for i in range(5)])  # each row elsewhere in 5 products
        if not torch.equal(torch.matmul(shifted, b), torch.stack([alone.roll(i * ROWS + 1, 0) for i in range(5)])):
            return "a row of a batched product gets other bits by its place"
    x = rand(1000) * 4
    whole = torch.exp(x)
    if not all(torch.equal(torch.exp(x[i: i + n]), whole[i: i + n]) for i, n in ((0, 5), (3, 37), (500, 31), (1, 999))):
        return "exp gives an element other bits by where it falls in the tensor (a vectorized loop's tail)"
    return None
