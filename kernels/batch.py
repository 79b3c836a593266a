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

The batch is laid out on the host with numpy, vectorized over queries (per request, only its block
table and its tree rows are read), into one flat int32 buffer (`Staging`), and reaches the device
in one copy (two for a padded batch: only its used rows), so building it dispatches no torch op
that grows with the number of requests. With a
`Capacity` the fields have fixed shapes instead (what a captured CUDA graph reads): unused request
slots are empty, and the last slot owns the padding queries, which see no key and write their own
K/V into a block no request holds.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 4x, and a batch makes one per request
class RequestView:
    """One request's part of a batch, as the KV cache knows it."""

    blocks: list[int]  # its block table
    first: int  # slot of its first new query (the first new committed token or tree node)
    n_committed: int  # new committed tokens (slots first .. first + n_committed - 1), attending causally
    tree_start: int  # first tree slot
    tree_parents: list[int]  # its whole scratch tree, by tree slot: each node's parent (-1: the root)
    n_new_nodes: int  # the tree's last nodes, this batch's queries (the ones before are cached already)

    @property
    def n_queries(self) -> int:
        return self.n_committed + self.n_new_nodes


@dataclass(frozen=True)
class Needs:
    """What a batch of requests needs of a capacity: its queries, its requests, the longest block
    table, and the tree-bit words per query of its largest tree (at least 1)."""

    queries: int
    requests: int
    blocks: int
    words: int

    @classmethod
    def of(cls, requests: list[RequestView], scalars: np.ndarray | None = None) -> "Needs":
        """`scalars`: `request_scalars(requests)`, when the caller has them already."""
        n_blocks, first, n_com, tree_start, n_tree, _ = (request_scalars(requests) if scalars is None else scalars).T
        end = first + n_com + n_tree
        return cls(int((n_com + n_tree).sum()), len(requests), int(n_blocks.max(initial=0)),
                   max(1, int((-(-(end - tree_start) // 32)).max(initial=1))))


def request_scalars(requests: list[RequestView]) -> np.ndarray:
    """[B, 6] int64, per request: its blocks, first, n_committed, tree_start, new tree nodes and
    scratch tree nodes (new ones included)."""
    values = itertools.chain.from_iterable([(len(r.blocks), r.first, r.n_committed, r.tree_start, r.n_new_nodes,
                                             len(r.tree_parents)) for r in requests])
    return np.fromiter(values, dtype=np.int64, count=6 * len(requests)).reshape(-1, 6)


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


def ancestor_words(parents: np.ndarray, sizes: np.ndarray, words: int) -> np.ndarray:
    """Every node's row of its tree's ancestor-or-self matrix, for many trees at once: parents [M]
    (each tree's nodes in turn, a parent before its children, -1 for the root), sizes [T] (nodes per
    tree). Returns [M, words] uint32; bit t of word w is the tree's node 32 w + t. By pointer jumping:
    after round k a node's row holds its ancestors up to 2^k - 1 steps up, so a tree of depth d takes
    ceil(log2(d)) rounds of numpy over every node of every tree, with no Python loop per node."""
    m = parents.shape[0]
    start = np.repeat(np.cumsum(sizes) - sizes, sizes)  # each node's tree's first node
    local = np.arange(m) - start
    if (parents >= local).any() or parents.min() < -1:
        u = int(np.argmax((parents < -1) | (parents >= local)))
        raise ValueError(f"tree batch: node {local[u]} of a tree has parent {parents[u]}; parents must precede children")
    up = np.append(parents + start, m)  # row m: no node (all zero, its own parent)
    up[:m][parents < 0] = m
    rows = np.zeros((m + 1, words), dtype=np.uint32)
    rows[np.arange(m), local >> 5] = np.left_shift(np.uint32(1), (local & 31).astype(np.uint32))
    while up.min() < m:
        rows[:m] |= rows[up[:m]]
        up = up[up]
    return rows[:m]


@dataclass(frozen=True)
class Queries:
    """A packed batch's queries, as the host knows them (numpy arrays [N])."""

    owner: np.ndarray  # its request
    local: np.ndarray  # its index among its request's queries
    slot: np.ndarray  # the KV slot it writes, in its request
    committed: np.ndarray  # bool: a new committed token (else a tree node)
    depth: np.ndarray  # a tree node's depth (a child of the root: 1); 0 for a committed token


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

    @staticmethod
    def shapes(needs: Needs, capacity: Capacity | None = None) -> Shapes:
        """The fields' shapes for a batch with these needs, or padded to `capacity`."""
        if capacity is not None:
            return batch_shapes(capacity.queries, capacity.requests, capacity.words, capacity.blocks)
        return batch_shapes(needs.queries, needs.requests, needs.words, max(1, needs.blocks))

    @staticmethod
    def pack(requests: list[RequestView], scalars: np.ndarray, block_size: int, out: dict[str, np.ndarray],
             capacity: Capacity | None = None) -> tuple[dict, "Queries"]:
        """Write the batch's fields into the host arrays `out` (shaped by `shapes`), vectorized over
        queries: per request only its block table and tree rows are read. Returns the attention
        batch's host facts and what the host knows of each query."""
        n_blocks, first, n_com, tree_start, n_tree, n_nodes = scalars.T
        n_q = n_com + n_tree
        end = first + n_q
        if (end > n_blocks * block_size).any():
            b = int(np.argmax(end > n_blocks * block_size))
            raise ValueError(f"tree batch: {end[b]} slots do not fit {n_blocks[b]} blocks of {block_size}")
        if ((first + n_com > tree_start) & (n_com > 0)).any():
            raise ValueError("tree batch: new committed tokens must lie before the tree")
        B, n = len(requests), int(n_q.sum())
        q_starts = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(n_q, out=q_starts[1:])
        owner = np.repeat(np.arange(B), n_q)
        local = np.arange(n) - q_starts[owner]
        slot = first[owner] + local
        committed = local < n_com[owner]
        tables = out["block_tables"]
        if B:
            flat = np.fromiter(itertools.chain.from_iterable(r.blocks for r in requests), dtype=np.int32,
                               count=int(n_blocks.sum()))
            row = np.repeat(np.arange(B), n_blocks)
            tables[row, np.arange(flat.size) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)] = flat
        out["causal"][:n] = np.where(committed, slot + 1, tree_start[owner])
        out["write_blocks"][:n] = tables[owner, slot // block_size]
        out["write_offsets"][:n] = slot % block_size
        out["query_requests"][:n] = owner
        bits = out["tree_bits"]
        bits[:n] = 0
        depth = np.zeros(n, dtype=np.int64)
        if n_tree.any():  # only the words the largest tree uses; the rest stay zero
            parents = np.fromiter(itertools.chain.from_iterable(r.tree_parents for r in requests), dtype=np.int64,
                                  count=int(n_nodes.sum()))
            rows = ancestor_words(parents, n_nodes, int(-(-n_nodes.max() // 32)))
            if (n_nodes > n_tree).any():  # some trees were cached in part (grown level by level): their new nodes
                new = np.cumsum(n_nodes) - n_tree  # each request's first new node
                rows = rows[np.repeat(new, n_tree) + np.arange(int(n_tree.sum())) - np.repeat(np.cumsum(n_tree) - n_tree, n_tree)]
            tree = np.flatnonzero(~committed)
            bits[tree, : rows.shape[1]] = rows.view(np.int32)
            depth[tree] = np.bitwise_count(rows).sum(1)  # ancestors and itself
        seq_lens, starts = out["seq_lens"], out["tree_starts"]
        seq_lens[:B], starts[:B], out["q_starts"][: B + 1] = end, tree_start, q_starts
        has_tree = bool(np.any(end > tree_start))
        max_queries, max_seq_len = int(n_q.max(initial=0)), int(end.max(initial=0))
        if capacity is not None:  # empty slots, then the padding request: no keys, writes to the trash block
            pad = capacity.queries - n
            out["causal"][n:] = 0
            out["write_blocks"][n:] = capacity.trash_block
            out["write_offsets"][n:] = np.arange(pad) % block_size
            out["query_requests"][n:] = capacity.requests - 1
            seq_lens[B:], starts[B:] = 0, 0
            out["q_starts"][B + 1:] = n
            out["q_starts"][-1] = capacity.queries
            has_tree, max_queries, max_seq_len = True, capacity.queries, capacity.blocks * block_size
        host = dict(max_queries=max_queries, max_seq_len=max_seq_len, has_tree=has_tree,
                    host_q_starts=out["q_starts"], host_seq_lens=seq_lens)
        return host, Queries(owner, local, slot, committed, depth)

    @classmethod
    def build(cls, requests: list[RequestView], block_size: int, device: torch.device | str = "cpu",
              capacity: Capacity | None = None) -> "TreeBatch":
        """Lay the batch out on the host and copy it to the device in one copy."""
        scalars = request_scalars(requests)
        needs = Needs.of(requests, scalars)
        if capacity is not None and not capacity.fits(needs):
            raise ValueError(f"tree batch: {needs} exceed the capacity {capacity}")
        staging = Staging(cls.shapes(needs, capacity), device, persistent=False)
        host, _ = cls.pack(requests, scalars, block_size, staging.host(), capacity)
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
        slots = self.derived("write_slots", lambda: self.write_blocks.long() * self.block_size + self.write_offsets)
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)
