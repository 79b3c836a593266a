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
- Softmax without rescaling: the row's maximum over the keys it sees (exact whatever the order), exp of the
  difference clamped at FLOOR (a weight below exp(-87), 1.6e-38, becomes 1.6e-38), times 0 where the row does
  not see the place.
- Per cell, P @ [V | 1]: the weighted sum and the weight's sum over the cell's CHUNK places in one
  product of CHUNK terms, the same places whether the query is in a plain step or a tree step.
- The cells' partial sums added in chunk order, in float64, then divided.

What this relies on of the BLAS (x @ W, MKL on x86), for products whose row count is a multiple of
ROWS, of CHUNK columns (q @ K^T, K^T a transposed view of the gathered keys) or CHUNK terms
(P @ [V | 1]): a row's result does not depend on the rows beside it, nor on the product's row count or
place in a batch of products; and of exp, that an element's result does not
depend on where it falls in the tensor. Not relied on, since neither holds on every x86 (an AVX2 EPYC
breaks both): that a product of fewer rows, or a sum of other length with zeros among its terms, gives
the same bits. `blas_keeps_rows` checks that once per process, and the first call refuses to run where
it does not hold (`python -m specinfer_bench.invariance` probes more of it). On CUDA the products are
`invariant_matmul.py`'s Triton kernel, one tiling whatever the shape (cuBLAS chooses by the shape), and the
same check runs on them. Every sum is in float32 whatever q's dtype (bfloat16 on a GPU); the output is q's.
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
FLOOR = -87.0  # exp's argument is clamped here: below, exp leaves its fast path (-inf: 2.5x slower on an AVX2 EPYC)


class Cells(NamedTuple):
    """Cells of CHUNK places read in one batched product, R rows each (a query's heads of one KV head, for
    each query that reads the cell, padded to ROWS): their keys' slots, which rows see which place, and where
    each row comes from and goes."""

    slots: torch.Tensor  # [cells * CHUNK] int64: each place's slot of the layer's pool, viewed [slots, Hkv, D]
    hidden: torch.Tensor  # [cells, 1, R, CHUNK], broadcast over KV heads: -inf where a row does not see a place
    seen: torch.Tensor  # the same: 1 where it sees it, else 0
    values: torch.Tensor  # [cells, Hkv, CHUNK, D + 1]: [..., :D] each layer's values in turn, [..., D] ones
    rows: torch.Tensor  # [cells, Hkv, R] int64: each row's query * Hq + head, or N * Hq for a padding row
    chunk: torch.Tensor  # [cells, Hkv, R] int64: each cell's chunk, for each of its rows


class Group(NamedTuple):
    """Requests attended together, whose queries' contexts span NC chunks: a cell for each chunk of a
    request where each position holds one key, read by all the request's queries; a cell for
    each path through a chunk where a tree branches (a leaf's), read by the queries on it."""

    NC: int
    cells: tuple[Cells, ...]
    rows: torch.Tensor  # the group's queries' rows (query * Hq + head)


def tree_attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TreeBatch,
                             scale: float | None = None) -> torch.Tensor:
    """Same contract as `tree_attention_reference`: q [N, Hq, D]; k_cache, v_cache [n_blocks, block_size,
    Hkv, D]. Returns [N, Hq, D] in q's dtype, each row computed as the module says, in float32 whatever
    q's dtype."""
    f32 = torch.float32
    if (broken := blas_keeps_rows(q.device.type, f32)) is not None:
        raise RuntimeError(f"row-invariant tree attention is not available here: {broken}")
    n_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    keys, values = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    queries = torch.nn.functional.pad((q.to(f32) * scale).view(n_q * hq, d), (0, 0, 0, 1))  # last: padding rows'
    out = torch.zeros_like(q)
    for g in batch.derived(("invariant", hq // hkv, hkv, d, f32), lambda: _plan(batch, hq // hkv, hkv, d, f32)):
        scores = [_matmul(queries[c.rows], _cell_keys(keys, c).mT).add_(c.hidden) for c in g.cells]
        top = queries.new_full((n_q * hq + 1,), -math.inf)  # each row's maximum over the places it sees, in all cells
        for s, c in zip(scores, g.cells):
            top.scatter_reduce_(0, c.rows.flatten(), s.amax(3).flatten(), "amax")
        parts = queries.new_zeros(g.NC, n_q * hq + 1, d + 1)  # a chunk a row does not reach adds exact zeros
        for s, c in zip(scores, g.cells):
            p = s.sub_(top[c.rows][..., None]).clamp_(min=FLOOR).exp_().mul_(c.seen)
            parts[c.chunk, c.rows] = _matmul(p, _cell_values(values, c))
        total = parts[0].double()
        for i in range(1, g.NC):  # in chunk order
            total += parts[i]
        total = total.to(f32)
        out.view(-1, d)[g.rows] = (total[:, :d] / total[:, d:])[g.rows].to(q.dtype)
    return out


def _cell_keys(keys: torch.Tensor, cells: Cells) -> torch.Tensor:
    """The cells' keys as [cells, Hkv, CHUNK, D], in float32."""
    hkv, d = keys.shape[1:]
    return keys.index_select(0, cells.slots).view(-1, CHUNK, hkv, d).transpose(1, 2).to(torch.float32).contiguous()


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b by products that keep what the module relies on: on CUDA the Triton kernel of
    `invariant_matmul.py` (cuBLAS picks its kernel by the shape), elsewhere the BLAS (`blas_keeps_rows`)."""
    if a.is_cuda:
        from .invariant_matmul import invariant_matmul
        return invariant_matmul(a, b)
    return torch.matmul(a, b)


def _cell_values(values: torch.Tensor, cells: Cells) -> torch.Tensor:
    """The cells' [V | 1] in the plan's buffer, [cells, Hkv, CHUNK, D + 1]."""
    hkv, d = values.shape[1:]
    cells.values[..., :d].copy_(values.index_select(0, cells.slots).view(-1, CHUNK, hkv, d).transpose(1, 2))
    return cells.values


def _plan(batch: TreeBatch, G: int, hkv: int, d: int, dtype: torch.dtype) -> list[Group]:
    """What every layer's call shares, from the batch, the KV heads' count and size (G query heads each)
    and q's dtype: its groups (as the reference's), each request's keys in cells by canonical position,
    the masks of the rows (as -inf to add to the scores) and buffers for the values."""
    q_starts, sizes, groups = live_groups(batch)
    if not groups:
        return []
    device = batch.causal.device
    live, n_real, hq = len(sizes), q_starts[len(sizes)], G * hkv
    padding = len(batch.causal) * hq  # the row that padding rows read and write
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
    slots_at = torch.nn.functional.pad(slots_at, (0, pad), value=-1).view(live, n_chunks, CHUNK)
    tables = batch.block_tables.long()
    heads = torch.arange(hq, device=device).view(hkv, G)
    places = torch.arange(CHUNK, device=device)

    def cells(request: torch.Tensor, chunk: torch.Tensor, logical: torch.Tensor, queries: torch.Tensor) -> Cells:
        """Cells of `request`'s `chunk` with its keys' `logical` slots [cells, CHUNK], read by `queries`
        [cells, Q] (-1: none); a query sees a place below its context's length."""
        n, Q = queries.shape
        R = -(-Q * G // ROWS) * ROWS
        real = queries >= 0
        rows = torch.where(real[:, None, :, None], queries[:, None, :, None] * hq + heads[None, :, None, :], padding)
        rows = torch.nn.functional.pad(rows.view(n, hkv, Q * G), (0, R - Q * G), value=padding)
        sees = chunk[:, None, None] * CHUNK + places < length[queries.clamp(min=0)][..., None]
        sees &= logical[:, None] >= 0
        real = torch.nn.functional.pad(real.repeat_interleave(G, 1), (0, R - Q * G))  # [cells, R]
        mask = torch.nn.functional.pad(sees.repeat_interleave(G, 1), (0, 0, 0, R - Q * G)) & real[..., None]
        mask[:, :, 0] |= ~real  # padding rows see place 0, so that nothing is NaN
        physical = (tables[request[:, None], logical.clamp(min=0) // batch.block_size] * batch.block_size
                    + logical.clamp(min=0) % batch.block_size) * (logical >= 0)
        return Cells(physical.flatten(), _hidden(mask[:, None], dtype), mask[:, None].to(dtype),
                     torch.ones(n, hkv, CHUNK, d + 1, dtype=dtype, device=device), rows,
                     chunk[:, None, None].expand(n, hkv, R))

    out = []
    for members in groups:
        index = torch.tensor(members, device=device)
        M = max(sizes[b][0] for b in members)
        rows = torch.cat([torch.arange(q_starts[b], q_starts[b + 1], device=device) for b in members])
        local = torch.cat([torch.full((sizes[b][0],), i, device=device) for i, b in enumerate(members)])
        NC = -(-int(length[rows].max()) // CHUNK)
        queries = torch.full((len(members), M), -1, dtype=torch.long, device=device)  # each request's, in order
        queries[local, rows - torch.tensor([q_starts[b] for b in members], device=device)[local]] = rows
        # a cell for each chunk a request's queries reach where it does not branch
        longest = torch.zeros(len(members), dtype=torch.long, device=device).scatter_reduce_(
            0, local, length[rows], "amax")
        reach = (torch.arange(NC, device=device) * CHUNK < longest[:, None]) & ~branches[index, :NC]
        i, c = reach.nonzero(as_tuple=True)
        kinds = [cells(index[i], c, slots_at[index[i], c], queries[i])]
        # a cell for each leaf's path through each branching chunk, read by the queries on that path
        reach = branches[index[local], :NC] & (torch.arange(NC, device=device) * CHUNK < length[rows, None])
        if reach.any():
            inside = reach.any(1).nonzero().flatten()  # the group's queries that reach a branching chunk
            leaf, rank = _leaves(path[rows[inside]], length[rows[inside]], local[inside])
            pq, pc = reach[inside].nonzero(as_tuple=True)  # (query of `inside`, chunk)
            found, cell = torch.unique(leaf[pq] * NC + pc, return_inverse=True)
            readers = torch.full((len(found), int(rank.max()) + 1), -1, dtype=torch.long, device=device)
            readers[cell, rank[pq]] = rows[inside[pq]]
            on_leaf = rows[inside[found // NC]]
            chunk = found % NC
            logical = torch.nn.functional.pad(path[on_leaf], (0, pad), value=-1).view(-1, n_chunks, CHUNK)
            kinds.append(cells(owner[on_leaf], chunk, logical[torch.arange(len(found), device=device), chunk], readers))
        out.append(Group(NC, tuple(k for k in kinds if len(k.slots)),
                         (rows[:, None] * hq + torch.arange(hq, device=device)).flatten()))
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
        a, b = rand(12 * ROWS, k), (rand(n, k).mT if n == CHUNK else rand(k, n))  # K^T: a transposed view
        alone = torch.stack([_matmul(torch.cat([row[None], a.new_zeros(ROWS - 1, k)]), b)[0] for row in a])
        if not all(torch.equal(_matmul(a[:m], b), alone[:m]) for m in (ROWS, 2 * ROWS, 3 * ROWS, 12 * ROWS)):
            return "a row of a product gets other bits by the rows beside it"
        shifted = torch.stack([a.roll(i * ROWS + 1, 0) for i in range(5)])  # each row elsewhere in 5 products
        if not torch.equal(_matmul(shifted, b), torch.stack([alone.roll(i * ROWS + 1, 0) for i in range(5)])):
            return "a row of a batched product gets other bits by its place"
    x = rand(1000) * 4
    whole = torch.exp(x)
    if not all(torch.equal(torch.exp(x[i: i + n]), whole[i: i + n]) for i, n in ((0, 5), (3, 37), (500, 31), (1, 999))):
        return "exp gives an element other bits by where it falls in the tensor (a vectorized loop's tail)"
    return None
