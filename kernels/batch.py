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
"""

from __future__ import annotations

import functools
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
    tree_rows: torch.Tensor  # [n_tree_queries, n_tree] bool: ancestor-or-self rows of its new tree nodes

    @property
    def n_queries(self) -> int:
        return self.n_committed + self.tree_rows.shape[0]


def pack_bits(rows: torch.Tensor, words: int) -> torch.Tensor:
    """rows [n, m] bool -> [n, words] int32; bit t of word w is column 32 * w + t."""
    n, m = rows.shape
    padded = torch.zeros(n, words * 32, dtype=torch.int64)
    padded[:, :m] = rows
    packed = (padded.view(n, words, 32) << torch.arange(32)).sum(-1)  # < 2**32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_bits(words: torch.Tensor, m: int) -> torch.Tensor:
    """The inverse of `pack_bits`: [n, words] int32 -> [n, m] bool."""
    bits = (words.to(torch.int64)[:, :, None] >> torch.arange(32, device=words.device)) & 1
    return bits.flatten(1)[:, :m].bool()


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
    # the same facts on the host, so launching never waits for the device
    host_q_starts: list[int] = field(repr=False)
    host_seq_lens: list[int] = field(repr=False)

    @classmethod
    def build(cls, requests: list[RequestView], block_size: int, device: torch.device | str = "cpu") -> "TreeBatch":
        q_starts, seq_lens, causal, slots_b, slots_o, bit_rows = [0], [], [], [], [], []
        words = max(1, max((math.ceil(r.tree_rows.shape[1] / 32) for r in requests), default=1))
        for r in requests:
            n_tree = r.tree_rows.shape[0]
            end = r.first + r.n_queries
            if math.ceil(end / block_size) > len(r.blocks):
                raise ValueError(f"tree batch: {end} slots do not fit {len(r.blocks)} blocks of {block_size}")
            if r.n_committed and r.first + r.n_committed > r.tree_start:
                raise ValueError("tree batch: new committed tokens must lie before the tree")
            q_starts.append(q_starts[-1] + r.n_queries)
            seq_lens.append(end)
            causal += [s + 1 for s in range(r.first, r.first + r.n_committed)] + [r.tree_start] * n_tree
            slots = range(r.first, end)
            slots_b += [r.blocks[s // block_size] for s in slots]
            slots_o += [s % block_size for s in slots]
            bit_rows.append(torch.zeros(r.n_committed, words, dtype=torch.int32))
            bit_rows.append(pack_bits(r.tree_rows, words))
        width = max((len(r.blocks) for r in requests), default=0)
        tables = torch.zeros(len(requests), max(width, 1), dtype=torch.int32)
        for b, r in enumerate(requests):
            tables[b, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)

        def to(x, dtype=torch.int32):
            return torch.as_tensor(x, dtype=dtype).to(device, non_blocking=True)
        return cls(block_size, to(tables), to(seq_lens), to([r.tree_start for r in requests]), to(q_starts),
                   to(causal), to(torch.cat(bit_rows)), to(slots_b, torch.int64), to(slots_o, torch.int64),
                   q_starts, seq_lens)

    @property
    def n_requests(self) -> int:
        return len(self.host_seq_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.host_seq_lens, default=0)

    @functools.cached_property
    def masks(self) -> list[torch.Tensor | None]:
        """Per request, the bool mask [queries, seq_len] the rules above give, or None where every
        query sees every key (for the reference)."""
        out = []
        tree_starts = self.tree_starts.tolist()
        for b, n in enumerate(self.host_seq_lens):
            a, e = self.host_q_starts[b], self.host_q_starts[b + 1]
            keys = torch.arange(n, device=self.causal.device)
            t = tree_starts[b]
            causal = keys[None, :] < self.causal[a:e, None]
            tree = torch.zeros_like(causal)
            if n > t:
                tree[:, t:] = unpack_bits(self.tree_bits[a:e], n - t)
            mask = causal | tree
            out.append(None if bool(mask.all()) else mask)
        return out

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the queries' own keys and values: k, v [N, Hkv, D] into one layer's pool
        k_cache, v_cache [n_blocks, block_size, Hkv, D]."""
        k_cache[self.write_blocks, self.write_offsets] = k
        v_cache[self.write_blocks, self.write_offsets] = v
