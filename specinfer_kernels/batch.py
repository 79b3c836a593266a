"""What a tree-attention call needs to know about a ragged batch, built once per forward pass.

Each request b owns the KV slots 0 .. seq_len[b]-1, stored in fixed-size blocks of a shared pool:
slot s lives in block `block_tables[b, s // block_size]` at offset `s % block_size`. Its slots
from `tree_start[b]` on hold draft-tree nodes; the slots before are committed tokens (the prefix
every node of its tree shares).

The batch's queries are flattened (no padding): request b's queries are rows
`q_starts[b] .. q_starts[b+1]-1`, first its new committed tokens, then its new tree nodes. Query i
may see key slot j of its request when

    j < causal[i]                                   (committed tokens: causally; tree nodes: all of them)
    or j >= tree_start and bit (j - tree_start) of tree_bits[i] is set   (a tree node's ancestors and itself)

`tree_bits` packs each query's row of the tree's ancestor-or-self matrix into int32 words, so a
tree of any size costs ceil(n / 32) words per query, not a dense [queries, keys] mask.

The batch is laid out on the host with numpy, vectorized over queries, from each request's scalars
(`SCALARS`), its scratch tree's parents and a table of block tables it gathers rows of (the KV
pool's, kept up to date as caches grow), into one flat int32 buffer (`Staging`), and reaches the
device in one copy (two for a padded batch: only its used rows), so building it dispatches no torch
op that grows with the number of requests. With a `Capacity` the fields have fixed shapes instead
(what a captured CUDA graph reads): unused request slots are empty, and the last slot owns the
padding queries, which see no key and write their own K/V into a block no request holds.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class RequestView:
    """One request's part of a batch, spelled out (what `TreeBatch.build` takes; a model's forward
    writes the same facts straight into `SCALARS` rows)."""

    blocks: list[int]  # its block table
    first: int  # slot of its first new query (the first new committed token or tree node)
    n_committed: int  # new committed tokens (slots first .. first + n_committed - 1), attending causally
    tree_start: int  # first tree slot
    tree_parents: list[int]  # its whole scratch tree, by tree slot: each node's parent (-1: the root)
    n_new_nodes: int  # the tree's last nodes, this batch's queries (the ones before are cached already)

    @property
    def n_queries(self) -> int:
        return self.n_committed + self.n_new_nodes


# a batch's requests as one [B, 7] int64 array, a row per request: its block table's row in the
# table of tables, its blocks, and then as RequestView says (the scratch tree's nodes, new ones included)
SCALARS = ("row", "blocks", "first", "committed", "tree_start", "new_nodes", "nodes")


def request_scalars(requests: list[RequestView]) -> np.ndarray:
    """`SCALARS` of requests whose block tables are rows 0.. of `block_table(requests)`."""
    values = itertools.chain.from_iterable([(b, len(r.blocks), r.first, r.n_committed, r.tree_start, r.n_new_nodes,
                                             len(r.tree_parents)) for b, r in enumerate(requests)])
    return np.fromiter(values, dtype=np.int64, count=7 * len(requests)).reshape(-1, 7)


def block_table(requests: list[RequestView]) -> np.ndarray:
    """[B, the most blocks (at least 1)] int32: request b's block table in row b."""
    table = np.zeros((len(requests), max([1, *(len(r.blocks) for r in requests)])), dtype=np.int32)
    for b, r in enumerate(requests):
        table[b, : len(r.blocks)] = r.blocks
    return table


@dataclass(frozen=True)
class Needs:
    """What a batch of requests needs of a capacity: its queries, its requests, the longest block
    table, and the tree-bit words per query of its largest tree (at least 1)."""

    queries: int
    requests: int
    blocks: int
    words: int

    @classmethod
    def of(cls, scalars: np.ndarray) -> "Needs":
        """From the requests' `SCALARS`."""
        total, most = scalars.sum(0), scalars.max(0, initial=0)
        return cls(int(total[3] + total[5]), len(scalars), int(most[1]), max(1, -(-int(most[6]) // 32)))


@dataclass(frozen=True)
class Capacity:
    """Fixed shapes of a padded batch: `queries` rows, `requests` request slots (the last holds the
    padding), block tables `blocks` wide, `words` tree-bit words per query. Padding queries write
    their K/V into `trash_block`, a pool block that belongs to no request."""

    queries: int
    requests: int
    blocks: int
    words: int
    trash_block: int

    def fits(self, needs: Needs) -> bool:
        """Whether a batch with these needs can be padded to this capacity (one slot stays for the padding)."""
        return (needs.queries <= self.queries and needs.requests < self.requests and needs.blocks <= self.blocks
                and needs.words <= self.words)


Shapes = dict[str, tuple[int, ...]]  # field name -> shape, in buffer order
ALIGN = 4  # int32 values: fields start at multiples of 16 bytes


class Staging:
    """Named int32 fields laid out in one flat buffer: written on the host as numpy arrays, read on
    the device as tensor views. On the CPU both are the same memory, so nothing is copied. On a GPU,
    `send` copies the given ranges host-to-device.
    - persistent (a graph's inputs): the host side is pinned, the device side is allocated once, and
      its views keep their addresses; each range is one asynchronous copy. An event guards the host
      side: `host()` waits until the previous send has been read before it may be written again.
    - otherwise (one step's): pageable host memory and a fresh device buffer, filled by one copy.
    """

    def __init__(self, shapes: Shapes, device: torch.device | str, persistent: bool = True, mirror: bool | None = None):
        """mirror: the device side is a buffer of its own, filled only by `send` (default: on a
        GPU; tests mirror on the CPU to check that what is sent is enough)."""
        self.device = torch.device(device)
        sizes = [math.prod(shape) for shape in shapes.values()]
        starts = itertools.accumulate([0, *sizes[:-1]], lambda at, n: at + -(-n // ALIGN) * ALIGN)
        self.offsets = dict(zip(shapes, starts))  # every field 16-byte aligned, as Triton specializes on it
        self.total = list(self.offsets.values())[-1] + sizes[-1]
        cuda = self.device.type == "cuda"
        if cuda and persistent:
            self._host = torch.zeros(self.total, dtype=torch.int32, pin_memory=True)
            flat = self._host.numpy()
        else:  # from numpy: no torch op (a per-step staging dispatches nothing on the CPU)
            flat = np.zeros(self.total, dtype=np.int32)
            self._host = torch.from_numpy(flat)
        self.arrays = {name: flat[o: o + n].reshape(shape) for (name, shape), o, n in
                       zip(shapes.items(), self.offsets.values(), sizes)}
        self.shapes, self.persistent, self._pending = shapes, persistent, False
        self._event = torch.cuda.Event() if cuda and persistent else None  # recorded after each send
        self.mirror = cuda if mirror is None else mirror
        make = torch.zeros if persistent else torch.empty  # a step's own buffer is sent whole
        self._device = make(self.total, dtype=torch.int32, device=self.device) if self.mirror else self._host
        self._views = {name: self._device[o: o + n].view(shape) for (name, shape), o, n in
                       zip(shapes.items(), self.offsets.values(), sizes)}  # made once: their addresses never change
        self._claimed: dict[str, int] = {}  # see `claim`
        self.kept: dict = {}  # what a caller made of the device views once, to reuse with them (their addresses never change)

    def claim(self, group: str, rows: int) -> int:
        """Record that a group of fields now holds a step's values in its first `rows` rows, the
        padding's after them; returns how many rows held a step's values before (at first: all).
        A padded batch rewrites its padding only in rows [rows, that), the others still hold it."""
        before = self._claimed.get(group, self.total)
        self._claimed[group] = rows
        return before

    def host(self) -> dict[str, np.ndarray]:
        """The host arrays, once the last send has read them."""
        if self._pending:
            self._event.synchronize()
            self._pending = False
        return self.arrays

    def send(self, ranges: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Copy the flat ranges [start, end) of the host buffer to the device (its caller sends a
        step's own staging whole, a bucket's only what the step uses); the fields as device tensors."""
        if self.mirror:
            for a, b in ranges:
                if b > a:  # from pinned memory: asynchronous; from pageable memory the host waits
                    self._device[a:b].copy_(self._host[a:b], non_blocking=self.persistent)
            if self._event is not None:
                self._event.record()
                self._pending = True
        return self._views

    def span(self, name: str, rows: int) -> tuple[int, int]:
        """The flat range of field `name`'s first `rows` rows."""
        shape = self.shapes[name]
        return self.offsets[name], self.offsets[name] + rows * math.prod(shape[1:])


def batch_shapes(queries: int, requests: int, words: int, blocks: int) -> Shapes:
    """A tree batch's fields, in buffer order: the tree bits and block tables last (the large ones:
    only their used rows are sent)."""
    return {"causal": (queries,), "write_blocks": (queries,), "write_offsets": (queries,),
            "query_requests": (queries,), "seq_lens": (requests,), "tree_starts": (requests,),
            "q_starts": (requests + 1,), "tree_bits": (queries, words), "block_tables": (max(requests, 1), blocks)}


SMALL_TREES = 128  # nodes in all, up to which a Python loop is faster than numpy's rounds


def ancestor_words(trees: list[list[int]], sizes: np.ndarray, words: int, last: np.ndarray | None = None) -> np.ndarray:
    """Every node's row of its tree's ancestor-or-self matrix, for many trees at once: each tree's
    parents (a parent before its children, -1 for the root), sizes [T] (their lengths). Returns
    [M, words] uint32, the trees' nodes in turn; bit t of word w is the tree's node 32 w + t.
    last [T]: only the last last[t] nodes of tree t (those of a tree grown level by level that a
    batch adds; the rows of all are computed).

    Over many nodes by pointer jumping: after round k a node's row holds its ancestors up to 2^k - 1
    steps up, so a tree of depth d takes ceil(log2(d)) rounds of numpy over every node of every tree,
    with no Python loop per node. Up to SMALL_TREES nodes of at most 64 per tree (a batch of one or
    a few requests), one Python integer per node is faster: its parent's bits and its own."""
    m = int(sizes.sum())
    if m <= SMALL_TREES and words <= 2 and np.little_endian:
        masks, kept = [], []
        for parents, keep in zip(trees, sizes.tolist() if last is None else last.tolist()):
            base = len(masks)
            for u, p in enumerate(parents):
                if not -1 <= p < u:
                    _bad_parent(u, p)
                masks.append(1 << u | (masks[base + p] if p >= 0 else 0))
            kept += masks[len(masks) - keep:] if keep else ()
        return np.fromiter(kept, dtype=np.uint64, count=len(kept)).view(np.uint32).reshape(-1, 2)[:, :words]
    parents = np.fromiter(itertools.chain.from_iterable(trees), dtype=np.int64, count=m)
    start = np.repeat(np.cumsum(sizes) - sizes, sizes)  # each node's tree's first node
    local = np.arange(m) - start
    if (parents >= local).any() or parents.min() < -1:
        u = int(np.argmax((parents < -1) | (parents >= local)))
        _bad_parent(local[u], parents[u])
    up = np.append(parents + start, m)  # row m: no node (all zero, its own parent)
    up[:m][parents < 0] = m
    rows = np.zeros((m + 1, words), dtype=np.uint32)
    rows[np.arange(m), local >> 5] = np.left_shift(np.uint32(1), (local & 31).astype(np.uint32))
    while up.min() < m:
        rows[:m] |= rows[up[:m]]
        up = up[up]
    if last is None or (last == sizes).all():
        return rows[:m]
    shift = np.cumsum(sizes) - np.cumsum(last)  # per tree: its first kept row, less its first kept node's place in the result
    return rows[np.arange(int(last.sum())) + np.repeat(shift, last)]


def _bad_parent(u: int, p: int):
    raise ValueError(f"tree batch: node {u} of a tree has parent {p}; parents must precede children")


@dataclass(frozen=True)
class Queries:
    """A packed batch's queries, as the host knows them (numpy arrays [N])."""

    owner: np.ndarray  # its request
    slot: np.ndarray  # the KV slot it writes, in its request
    position: np.ndarray  # in its sequence: a committed token's is its slot; a tree node's, the committed length - 1 + its depth


@dataclass
class TreeBatch:
    block_size: int
    block_tables: torch.Tensor  # [B, max_blocks] int32 (rows padded with 0)
    seq_lens: torch.Tensor  # [B] int32
    tree_starts: torch.Tensor  # [B] int32
    q_starts: torch.Tensor  # [B + 1] int32
    causal: torch.Tensor  # [N] int32
    tree_bits: torch.Tensor  # [N, W] int32, W >= 1
    write_blocks: torch.Tensor  # [N] int32: the block each query's own K/V is written to
    write_offsets: torch.Tensor  # [N] int32: and the offset in it
    query_requests: torch.Tensor  # [N] int32: the request of each query
    # sizes the host knows, so launching never waits for the device: with a Capacity they are
    # the capacity's bounds, the same for every batch of that capacity
    max_queries: int  # queries of one request, at most
    max_seq_len: int  # keys of one request, at most
    has_tree: bool  # whether any query may see a tree slot
    # the batch's facts on the host (views of the staged arrays, valid for this step), for the
    # reference (which runs where there is no graph)
    host_q_starts: np.ndarray = field(repr=False)
    host_seq_lens: np.ndarray = field(repr=False)
    # tensors derived from the batch alone (index and mask tensors), made once per forward pass and
    # shared by all its layers; see `derived`
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    def derived(self, key, make):
        """make(), computed on the first call for `key` and kept with this batch: what every layer
        of a forward would otherwise recompute from the batch (it never depends on a layer)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def renew(self) -> "TreeBatch":
        """This batch for the next forward pass over the same fields (refilled in place): what
        was derived from the last one's values is gone."""
        self._derived.clear()
        return self

    @staticmethod
    def shapes(needs: Needs, capacity: Capacity | None = None) -> Shapes:
        """The fields' shapes for a batch with these needs, or padded to `capacity`."""
        if capacity is not None:
            return batch_shapes(capacity.queries, capacity.requests, capacity.words, capacity.blocks)
        return batch_shapes(needs.queries, needs.requests, needs.words, max(1, needs.blocks))

    @staticmethod
    def pack(scalars: np.ndarray, trees: list[list[int]], tables: np.ndarray, block_size: int, staging: Staging,
             needs: Needs, capacity: Capacity | None = None) -> tuple[dict, "Queries"]:
        """Write the batch's fields into `staging`'s host arrays (shaped by `shapes`), vectorized over
        queries: scalars [B, 7] (`SCALARS`, consistent as `check` says: a KV cache's are by
        construction), each request's scratch tree (its parents, checked here), and the table of
        block tables whose rows `scalars` names; `needs`: `Needs.of(scalars)`. Returns the attention batch's host facts and what
        the host knows of each query."""
        row, _, first, n_com, tree_start, n_tree, n_nodes = scalars.T
        n_q = n_com + n_tree
        end = first + n_q
        out, B = staging.host(), len(scalars)
        q_starts = out["q_starts"]
        q_starts[0], q_starts[1: B + 1] = 0, n_q.cumsum()
        n = int(q_starts[B])
        if capacity is not None:  # first (a step that fails below leaves no row unclaimed): the padding
            TreeBatch._pad(staging, capacity, block_size, n, B)
        owner = np.repeat(np.arange(B), n_q)
        slot = np.arange(n) + (first - q_starts[:B])[owner]
        starts = tree_start[owner]
        out["causal"][:n] = np.minimum(slot + 1, starts)  # committed tokens: causally; tree nodes: the prefix
        out["block_tables"][:B, : needs.blocks] = tables[row, : needs.blocks]
        out["write_blocks"][:n] = out["block_tables"][owner, slot // block_size]
        out["write_offsets"][:n] = slot % block_size
        out["query_requests"][:n] = owner
        bits = out["tree_bits"]
        bits[:n] = 0
        depth = slot - starts + 1  # a tree node's is set below; a committed token's (<= 0) makes its position its slot
        if n_tree.any():  # only the words the largest tree uses; the rest stay zero
            rows = ancestor_words(trees, n_nodes, needs.words, n_tree)
            tree = np.flatnonzero(depth > 0)
            bits[tree, : rows.shape[1]] = rows.view(np.int32)
            depth[tree] = np.bitwise_count(rows).sum(1)  # ancestors and itself
        seq_lens = out["seq_lens"]
        seq_lens[:B], out["tree_starts"][:B] = end, tree_start
        if capacity is None:
            host = dict(max_queries=int(n_q.max(initial=0)), max_seq_len=int(end.max(initial=0)),
                        has_tree=bool(np.any(end > tree_start)))
        else:
            host = dict(max_queries=capacity.queries, max_seq_len=capacity.blocks * block_size, has_tree=True)
        return dict(host, host_q_starts=q_starts, host_seq_lens=seq_lens), Queries(owner, slot, starts - 1 + depth)

    @staticmethod
    def _pad(staging: Staging, capacity: Capacity, block_size: int, n: int, B: int) -> None:
        """A padded step's empty request slots, then the padding request: no keys, its queries
        (rows n..) write to the trash block. Rewritten only where an earlier step used the rows."""
        out = staging.arrays
        padded = staging.claim("queries", n)
        if padded > n:
            out["causal"][n:padded] = 0
            out["write_blocks"][n:padded] = capacity.trash_block
            out["write_offsets"][n:padded] = np.arange(n, min(padded, capacity.queries)) % block_size
            out["query_requests"][n:padded] = capacity.requests - 1
        padded = staging.claim("requests", B)
        if padded > B:
            out["seq_lens"][B:padded], out["tree_starts"][B:padded] = 0, 0
        out["q_starts"][B + 1:] = n
        out["q_starts"][-1] = capacity.queries

    @staticmethod
    def check(scalars: np.ndarray, block_size: int) -> None:
        """Refuse requests whose slots do not fit their blocks, or whose scratch tree does not fill
        the slots from tree_start on with the new committed tokens ending where it starts."""
        _, n_blocks, first, n_com, tree_start, n_tree, n_nodes = scalars.T
        end = first + n_com + n_tree
        overflow = end > n_blocks * block_size
        misplaced = (end - tree_start != n_nodes) | ((n_com > 0) & (first + n_com != tree_start)) | (n_tree > n_nodes)
        if (overflow | misplaced).any():
            b = int(np.argmax(overflow | misplaced))
            if overflow[b]:
                raise ValueError(f"tree batch: {end[b]} slots do not fit {n_blocks[b]} blocks of {block_size}")
            raise ValueError(f"tree batch: request {b}'s new committed tokens must lie just before its tree "
                             f"(slots {first[b]}.. with {n_com[b]} committed and {n_tree[b]} of {n_nodes[b]} tree "
                             f"nodes, the tree from slot {tree_start[b]})")

    @classmethod
    def build(cls, requests: list[RequestView], block_size: int, device: torch.device | str = "cpu",
              capacity: Capacity | None = None) -> "TreeBatch":
        """Lay the batch out on the host and copy it to the device in one copy."""
        scalars = request_scalars(requests)
        cls.check(scalars, block_size)
        needs = Needs.of(scalars)
        if capacity is not None and not capacity.fits(needs):
            raise ValueError(f"tree batch: {needs} exceed the capacity {capacity}")
        staging = Staging(cls.shapes(needs, capacity), device, persistent=False)
        host, _ = cls.pack(scalars, [r.tree_parents for r in requests], block_table(requests), block_size, staging,
                           needs, capacity)
        return cls.from_device(staging.send([(0, staging.total)]), block_size, host)

    @classmethod
    def from_device(cls, tensors: dict[str, torch.Tensor], block_size: int, host: dict) -> "TreeBatch":
        """The batch from its fields on the device (picked out of `tensors` by name) and its host facts."""
        names = ("block_tables", "seq_lens", "tree_starts", "q_starts", "causal", "tree_bits", "write_blocks",
                 "write_offsets", "query_requests")
        return cls(block_size, *(tensors[n] for n in names), **host)

    @property
    def n_requests(self) -> int:
        return len(self.host_seq_lens)

    def visible(self, n_keys: int) -> torch.Tensor:
        """[N, n_keys] bool: whether query i sees key slot j of its request, by the rules above."""
        keys = torch.arange(n_keys, device=self.causal.device)[None, :]
        req = self.query_requests[:, None]
        t = keys - self.tree_starts[req]  # tree slot of key j
        in_tree = (t >= 0) & (keys < self.seq_lens[req])
        t = t.clamp(min=0)
        word = self.tree_bits.gather(1, (t >> 5).clamp(max=self.tree_bits.shape[1] - 1).long())
        bit = ((word >> (t & 31)) & 1).bool()
        return (keys < self.causal[:, None]) | (in_tree & bit)

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the queries' own keys and values: k, v [N, Hkv, D] into one layer's pool
        k_cache, v_cache [n_blocks, block_size, Hkv, D] (contiguous)."""
        slots = self.write_slots()
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def write_slots(self) -> torch.Tensor:
        """[N] int64: the slot of a layer's pool, viewed as [n_blocks * block_size, Hkv, D], that each
        query's own key and value go to."""
        return self.derived("write_slots", lambda: self.write_blocks.long() * self.block_size + self.write_offsets)
