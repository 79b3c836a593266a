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

The batch is laid out with plain Python lists on the host and all its tensors reach the device
in one copy (`to_device`), so building it dispatches the same few ops whatever the number of
requests. With a `Capacity` the tensors have fixed shapes instead (what a captured CUDA graph
reads): unused request slots are empty, and the last slot owns the padding queries, which see no
key and write their own K/V into a block no request holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RequestView:
    """One request's part of a batch, as the KV cache knows it."""

    blocks: list[int]  # its block table
    first: int  # slot of its first new query (the first new committed token or tree node)
    n_committed: int  # new committed tokens (slots first .. first + n_committed - 1), attending causally
    tree_start: int  # first tree slot
    tree_rows: list[int]  # per new tree node, its ancestor-or-self row over the scratch tree (bit t: tree slot t)

    @property
    def n_queries(self) -> int:
        return self.n_committed + len(self.tree_rows)


@dataclass(frozen=True)
class Needs:
    """What a batch of requests needs of a capacity: its queries, its requests, the longest block
    table, and the tree-bit words per query of its largest tree (at least 1)."""

    queries: int
    requests: int
    blocks: int
    words: int

    @classmethod
    def of(cls, requests: list[RequestView]) -> "Needs":
        return cls(sum(r.n_queries for r in requests), len(requests), max((len(r.blocks) for r in requests), default=0),
                   max(1, max((math.ceil((r.first + r.n_queries - r.tree_start) / 32) for r in requests), default=1)))


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


Fields = dict[str, tuple[list[int], tuple[int, ...]]]  # name -> (flat int values, shape)


def to_device(fields: Fields, device: torch.device | str, out: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Every field as an int32 tensor on `device`, all of them views of one buffer filled by one
    host-to-device copy: a new buffer, or `out` (a persistent one: the same fields with the same
    shapes then land at the same addresses every time)."""
    flat = [v for values, _ in fields.values() for v in values]
    host = torch.tensor(flat, dtype=torch.int32)
    if out is None:
        buf = host.to(device, non_blocking=True)
    else:
        if out.numel() < len(flat):
            raise ValueError(f"static buffer: {len(flat)} values do not fit {out.numel()}")
        buf = out[: len(flat)]
        buf.copy_(host, non_blocking=True)
    parts = buf.split([len(values) for values, _ in fields.values()])  # one op for every field's view
    views = {}
    for part, (name, (values, shape)) in zip(parts, fields.items()):
        assert len(values) == math.prod(shape), (name, len(values), shape)
        views[name] = part.view(shape)
    return views


def _words(row: int, words: int) -> list[int]:
    """An ancestor row as `words` int32 words; bit t of word w is tree slot 32 * w + t."""
    out = []
    for _ in range(words):
        w = row & 0xFFFFFFFF
        out.append(w - (1 << 32) if w >= 1 << 31 else w)
        row >>= 32
    return out


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
    # the batch's facts on the host, for the reference (which runs where there is no graph)
    host_q_starts: list[int] = field(repr=False)
    host_seq_lens: list[int] = field(repr=False)
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
    def fields(requests: list[RequestView], block_size: int, capacity: Capacity | None = None,
               needs: Needs | None = None) -> tuple[Fields, dict]:
        """The batch's tensors as host lists (see `to_device`) and its host-side facts. `needs`:
        `Needs.of(requests)`, when the caller has it already."""
        q_starts, seq_lens, starts, causal, slots_b, slots_o, bits, owner = [0], [], [], [], [], [], [], []
        needs = needs or Needs.of(requests)
        words, width = needs.words, max(1, needs.blocks)
        if capacity is not None:
            if not capacity.fits(needs):
                raise ValueError(f"tree batch: {needs} exceed the capacity {capacity}")
            words, width = capacity.words, capacity.blocks
        for b, r in enumerate(requests):
            end = r.first + r.n_queries
            if math.ceil(end / block_size) > len(r.blocks):
                raise ValueError(f"tree batch: {end} slots do not fit {len(r.blocks)} blocks of {block_size}")
            if r.n_committed and r.first + r.n_committed > r.tree_start:
                raise ValueError("tree batch: new committed tokens must lie before the tree")
            q_starts.append(q_starts[-1] + r.n_queries)
            seq_lens.append(end)
            starts.append(r.tree_start)
            causal += [s + 1 for s in range(r.first, r.first + r.n_committed)] + [r.tree_start] * len(r.tree_rows)
            slots = range(r.first, end)
            slots_b += [r.blocks[s // block_size] for s in slots]
            slots_o += [s % block_size for s in slots]
            bits += [0] * (words * r.n_committed) + [w for row in r.tree_rows for w in _words(row, words)]
            owner += [b] * r.n_queries
        tables = [x for r in requests for x in r.blocks + [0] * (width - len(r.blocks))]
        has_tree = any(r.first + r.n_queries > r.tree_start for r in requests)
        max_queries = max((b - a for a, b in zip(q_starts, q_starts[1:])), default=0)
        max_seq_len = max(seq_lens, default=0)
        if capacity is not None:  # empty slots, then the padding request: no keys, writes to the trash block
            n, pad = q_starts[-1], capacity.queries - q_starts[-1]
            empty = capacity.requests - 1 - len(requests)
            q_starts += [n] * empty + [capacity.queries]
            seq_lens += [0] * (empty + 1)
            starts += [0] * (empty + 1)
            causal += [0] * pad
            slots_b += [capacity.trash_block] * pad
            slots_o += [i % block_size for i in range(pad)]
            bits += [0] * (words * pad)
            owner += [capacity.requests - 1] * pad
            tables += [0] * (width * (empty + 1))
            has_tree, max_queries, max_seq_len = True, capacity.queries, capacity.blocks * block_size
        n_req, n_q = len(seq_lens), len(causal)
        if not n_req:  # an empty batch still has a block table row
            tables = [0] * width
        fields = {
            "block_tables": (tables, (max(n_req, 1), width)), "seq_lens": (seq_lens, (n_req,)),
            "tree_starts": (starts, (n_req,)), "q_starts": (q_starts, (n_req + 1,)), "causal": (causal, (n_q,)),
            "tree_bits": (bits, (n_q, words)), "write_blocks": (slots_b, (n_q,)), "write_offsets": (slots_o, (n_q,)),
            "query_requests": (owner, (n_q,)),
        }
        host = dict(max_queries=max_queries, max_seq_len=max_seq_len, has_tree=has_tree,
                    host_q_starts=q_starts, host_seq_lens=seq_lens)
        return fields, host

    @classmethod
    def build(cls, requests: list[RequestView], block_size: int, device: torch.device | str = "cpu",
              capacity: Capacity | None = None) -> "TreeBatch":
        """Lay the batch out on the host and copy it to the device in one copy."""
        fields, host = cls.fields(requests, block_size, capacity)
        return cls.from_device(to_device(fields, device), block_size, host)

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
