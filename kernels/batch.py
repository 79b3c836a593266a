"""What a tree-attention call needs to know about a ragged batch, built once per forward pass.

Each request b owns the KV slots 0 .. seq_len[b]-1, stored in fixed-size blocks of a shared pool:
slot s lives in block `block_tables[b, s // block_size]` at offset `s % block_size`. Its slots
from `tree_start[b]` on hold draft-tree nodes; the slots before are committed tokens.

The batch's queries are flattened (no padding): request b's queries are rows
`q_starts[b] .. q_starts[b+1]-1`, first its new committed tokens, then its new tree nodes. Query i
may see key slot j of its request when

    j < causal[i]                                   (committed tokens: causally; tree nodes: all of them)
    or j >= tree_start and bit (j - tree_start) of tree_bits[i] is set   (a tree node's ancestors and itself)

`tree_bits` packs each query's row of the tree's ancestor-or-self matrix into int32 words, so a
tree of any size costs ceil(n / 32) words per query, not a dense [queries, keys] mask.

The batch is laid out with plain Python lists and each tensor is copied to the device once, so
building it dispatches the same few ops whatever the number of requests.
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
    write_blocks: torch.Tensor  # [N] int64: the block each query's own K/V is written to
    write_offsets: torch.Tensor  # [N] int64: and the offset in it
    query_requests: torch.Tensor  # [N] int64: the request of each query
    # the same facts on the host, so launching never waits for the device
    host_q_starts: list[int] = field(repr=False)
    host_seq_lens: list[int] = field(repr=False)

    @classmethod
    def build(cls, requests: list[RequestView], block_size: int, device: torch.device | str = "cpu") -> "TreeBatch":
        """Lay the batch out on the host (plain lists) and copy each tensor to the device once."""
        q_starts, seq_lens, causal, slots_b, slots_o, bits, owner = [0], [], [], [], [], [], []
        words = max(1, max((math.ceil((r.first + r.n_queries - r.tree_start) / 32) for r in requests), default=1))
        for b, r in enumerate(requests):
            end = r.first + r.n_queries
            if math.ceil(end / block_size) > len(r.blocks):
                raise ValueError(f"tree batch: {end} slots do not fit {len(r.blocks)} blocks of {block_size}")
            if r.n_committed and r.first + r.n_committed > r.tree_start:
                raise ValueError("tree batch: new committed tokens must lie before the tree")
            q_starts.append(q_starts[-1] + r.n_queries)
            seq_lens.append(end)
            causal += [s + 1 for s in range(r.first, r.first + r.n_committed)] + [r.tree_start] * len(r.tree_rows)
            slots = range(r.first, end)
            slots_b += [r.blocks[s // block_size] for s in slots]
            slots_o += [s % block_size for s in slots]
            bits += [[0] * words] * r.n_committed + [_words(row, words) for row in r.tree_rows]
            owner += [b] * r.n_queries
        width = max(1, max((len(r.blocks) for r in requests), default=0))
        tables = [r.blocks + [0] * (width - len(r.blocks)) for r in requests] or [[0]]

        def to(x, dtype=torch.int32):
            return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)
        return cls(block_size, to(tables), to(seq_lens), to([r.tree_start for r in requests]), to(q_starts),
                   to(causal), to(bits).view(len(causal), words), to(slots_b, torch.int64), to(slots_o, torch.int64),
                   to(owner, torch.int64), q_starts, seq_lens)

    @property
    def n_requests(self) -> int:
        return len(self.host_seq_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.host_seq_lens, default=0)

    @property
    def max_queries(self) -> int:
        return max((b - a for a, b in zip(self.host_q_starts, self.host_q_starts[1:])), default=0)

    def visible(self, n_keys: int) -> torch.Tensor:
        """[N, n_keys] bool: whether query i sees key slot j of its request, by the rules above."""
        keys = torch.arange(n_keys, device=self.causal.device)[None, :]
        req = self.query_requests[:, None]
        t = keys - self.tree_starts[req]  # tree slot of key j
        in_tree = (t >= 0) & (keys < self.seq_lens[req])
        word = self.tree_bits.gather(1, (t.clamp(min=0) >> 5).clamp(max=self.tree_bits.shape[1] - 1))
        bit = ((word >> (t.clamp(min=0) & 31)) & 1).bool()
        return (keys < self.causal[:, None]) | (in_tree & bit)

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the queries' own keys and values: k, v [N, Hkv, D] into one layer's pool
        k_cache, v_cache [n_blocks, block_size, Hkv, D]."""
        k_cache[self.write_blocks, self.write_offsets] = k
        v_cache[self.write_blocks, self.write_offsets] = v
