"""Paged key/value caches: one preallocated pool of fixed-size blocks per model, and per request a
block table into it.

`KVPool` holds every layer's keys and values as [n_layers, n_blocks, block_size, n_kv_heads,
head_dim] and a free list of blocks. Memory use is the pool's size, fixed at start, whatever the
requests' lengths; a request holds ceil(slots / block_size) blocks and gives them back when it is
released (or garbage-collected).

`KVCache` is one request's view: its token record as this model knows it (`tokens`), the block
table, and the draft tree in scratch. The pool also keeps every cache's block table in one numpy
array (`KVPool.tables`, a row per cache, written when the cache takes blocks), so a batch gathers
its requests' tables in one operation instead of converting a list per request. Slots
[0, length) hold committed tokens; slots [length, length + n_tree) hold the current draft tree's
nodes in the order they were added (DFS order for a verifier tree, level order for a tree an SSM is
growing). After verification `commit(path)` moves the accepted nodes' entries to consecutive
committed slots (no recomputation), drops the rest of the tree, and returns blocks that no longer
hold anything.

Requests with the same leading tokens share their blocks (n choices of one prompt, a system prompt
many requests repeat): a cache offers its committed full blocks to the pool's prefix index
(`KVCache.register`), and a new cache takes the blocks that already hold its leading full blocks
(`KVCache.share_prefix`) instead of computing them. A shared block is only read: a cache writes at
its slots >= length, past every full committed block. The pool counts each block's holders. When
the last one gives an indexed block back, the block stays indexed (`KVPool.cached`, least recently
used first) for later requests (the next turn of a chat resends the conversation, a preempted
request resumes), and is evicted only when a step needs a block and none is free: a prefix cache
across requests, as vLLM's automatic prefix caching and SGLang's radix cache. A request's blocks
go back last block first, so its deepest blocks are evicted before the ones that lead to them.
On the CPU in float32 K/V rows do not depend on the other rows of their batch (model.py), so a
shared block holds what the cache would have computed itself, bit for bit (elsewhere to float
rounding, as for a tree's rows).

Which earlier slots each new query may attend to (committed tokens causally, tree nodes every
committed slot plus their own ancestors and themselves) the batch works out from the scratch tree's
parents (`TreeBatch.pack`), for every request at once.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict

import numpy as np
import torch

from .devices import to_device
from .errors import CacheFull
from .tree import TokenTree

BLOCK_SIZE = 16
POOL_TOKENS = 65536  # default pool size in token slots


class KVPool:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", tokens: int = POOL_TOKENS, block_size: int = BLOCK_SIZE,
                 prefix_cache: bool = True):
        """prefix_cache: keep indexed blocks no request holds until a step needs them (False: they
        are freed with their last holder, and only live requests share)."""
        if tokens < block_size:
            raise ValueError(f"kv pool: {tokens} tokens is less than one block of {block_size}")
        self.block_size = block_size
        n_blocks = tokens // block_size
        # zeros, not garbage: attention over a padded batch reads (and masks) slots no request wrote,
        # and a NaN there would survive the mask
        self.k = torch.zeros(n_layers, n_blocks, block_size, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.free: list[int] = list(range(n_blocks - 1, -1, -1))  # a stack: recently freed blocks are reused first
        self.reserved = 0  # blocks taken for good by the runtime (a graph's padding writes), never a request's
        # row r: the block table of the cache holding row r, written as it takes blocks (columns past
        # its blocks are stale: a batch reads only its slots' blocks); rows and columns grow as needed
        self.tables = np.zeros((8, 64), dtype=np.int32)
        self.free_rows: list[int] = list(range(7, -1, -1))
        self.holders = np.zeros(n_blocks, dtype=np.int32)  # caches holding each block (several: a shared prefix)
        self.prefix: dict[int, int] = {}  # chain hash of a committed full block's tokens and its prefix -> the block
        self.held: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # indexed block -> (its hash, the block
        # before it in its cache (-1: none), its tokens): what a hit is checked against
        self.prefix_cache = prefix_cache
        self.cached: OrderedDict[int, None] = OrderedDict()  # indexed blocks no cache holds, least recently used first
        self.queried_tokens = 0  # prompt tokens looked up in the index
        self.hit_tokens = 0  # of which found there

    @property
    def n_blocks(self) -> int:
        """Blocks requests can hold: the pool's own, less the reserved ones."""
        return self.k.shape[1] - self.reserved

    @property
    def available(self) -> int:
        """Blocks a step can take: the free ones and the cached ones (evicted on demand)."""
        return len(self.free) + len(self.cached)

    def reserve(self) -> int:
        """Take one block for good, out of what requests can ever hold."""
        self.check_room(1)
        self.reserved += 1
        return self._take()

    def _take(self) -> int:
        """A block for a cache to write: a free one, else the least recently used cached one."""
        if self.free:
            return self.free.pop()
        block, _ = self.cached.popitem(last=False)
        self._unindex(block)
        return block

    def _unindex(self, block: int) -> None:
        """Take the block out of the prefix index, if it is there."""
        if block in self.held:
            del self.prefix[self.held.pop(block)[0]]

    def blocks_for(self, slots: int) -> int:
        return math.ceil(slots / self.block_size)

    def check_room(self, blocks: int) -> None:
        if blocks > self.available:
            raise CacheFull(f"kv cache full: a step needs {blocks} more blocks of {self.block_size} tokens, "
                            f"{self.available} of {self.n_blocks} are free")

    def give_back(self, blocks: list[int]) -> None:
        """A cache lets go of `blocks`; those no other cache holds are free again, or cached if
        indexed (with the prefix cache on; else they leave the index)."""
        for block in reversed(blocks):
            self.holders[block] -= 1
            if self.holders[block]:
                continue
            if self.prefix_cache and block in self.held:
                self.cached[block] = None
            else:
                self._unindex(block)
                self.free.append(block)

    def take_row(self) -> int:
        """A row of `tables` for a new cache."""
        if not self.free_rows:
            n = len(self.tables)
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self.free_rows.extend(range(2 * n - 1, n - 1, -1))  # in place: a finalizer may append meanwhile
        return self.free_rows.pop()

    def grow(self, row: int, blocks: list[int], slots: int) -> None:
        """Append to a cache's block table (`blocks`, and its row of `tables`) the blocks it lacks
        for `slots` slots."""
        at, end = len(blocks), self.blocks_for(slots)
        self.check_room(end - at)
        if end > self.tables.shape[1]:
            wider = np.zeros((len(self.tables), max(end, 2 * self.tables.shape[1])), dtype=np.int32)
            wider[:, : self.tables.shape[1]] = self.tables
            self.tables = wider
        table = self.tables[row]
        for i in range(at, end):  # mostly a block or two: one at a time is faster than converting lists
            table[i] = block = self._take()
            self.holders[block] = 1
            blocks.append(block)

    def share(self, row: int, blocks: list[int], block: int) -> None:
        """Append an indexed block another cache holds to a cache's block table."""
        if len(blocks) >= self.tables.shape[1]:
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)], axis=1)
        self.tables[row, len(blocks)] = block
        self.cached.pop(block, None)
        self.holders[block] += 1
        blocks.append(block)

    def drop(self, blocks: list[int], row: int) -> None:
        """A dropped cache's blocks and row come back."""
        self.give_back(blocks)
        self.free_rows.append(row)

    def new_cache(self) -> "KVCache":
        return KVCache(self)

    def move(self, moves: list[tuple[list[int], list[int]]]) -> None:
        """Copy K/V between slots of many caches at once: each (src, dst) pair lists pool slots
        (block * block_size + offset). Sources are all read before any destination is written."""
        src = [s for m in moves for s in m[0]]
        if not src:
            return
        dst = [s for m in moves for s in m[1]]
        index = to_device(torch.tensor([src, dst], dtype=torch.long), self.k.device)
        for cache in (self.k, self.v):
            flat = cache.view(cache.shape[0], -1, *cache.shape[3:])  # [layers, blocks * block_size, Hkv, D]
            flat[:, index[1]] = flat[:, index[0]]


class KVCache:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.blocks: list[int] = []  # block table: slot s is in blocks[s // block_size]
        self.row = pool.take_row()  # its block table's row of pool.tables
        self._free = weakref.finalize(self, pool.drop, self.blocks, self.row)  # a dropped cache returns its blocks
        self.tokens: list[int] = []  # the request's committed tokens as this model knows them
        self.length = 0  # committed slots: tokens[:length] have K/V here
        self.indexed = 0  # its leading full blocks in the pool's prefix index (or taken from it)
        self.key = 0  # the chain hash of those blocks' tokens
        self.tree = TokenTree()  # the draft tree in scratch; its root is the last committed token

    @property
    def slots(self) -> int:
        """Slots in use: committed tokens and the scratch tree."""
        return self.length + len(self.tree)

    def blocks_to_grow(self, slots: int) -> int:
        """Blocks this cache must take from the pool to hold `slots` slots."""
        return max(0, self.pool.blocks_for(slots) - len(self.blocks))

    def _trim(self) -> None:
        keep = self.pool.blocks_for(self.slots)
        self.pool.give_back(self.blocks[keep:])
        del self.blocks[keep:]

    def release(self) -> None:
        """Return every block to the pool; the cache is empty afterwards."""
        self.pool.give_back(self.blocks)
        self.blocks.clear()
        self.tokens, self.length, self.indexed, self.key = [], 0, 0, 0
        self.drop_tree()

    def _next_key(self) -> tuple[int, tuple[int, ...]]:
        bs = self.pool.block_size
        tokens = tuple(self.tokens[self.indexed * bs: (self.indexed + 1) * bs])
        return hash((self.key, tokens)), tokens

    def share_prefix(self) -> int:
        """Take from the prefix index the blocks that already hold this cache's next full blocks of
        tokens, and count their tokens as committed, so that its step computes only the rest.

        For a cache that holds only blocks taken from the index (a new one, or one whose record
        comes in chunks and found every block so far there) and whose `tokens` already hold the
        tokens to come. Blocks are taken in order, from the one after its last, while the index has
        a block holding exactly the next `block_size` tokens after exactly its own last block
        (checked, not trusted to the hash); it stops at the first miss, and before the block that
        holds the record's last token, whose row the step needs. Returns the tokens taken; the
        pool counts the tokens looked up and those found (`queried_tokens`, `hit_tokens`)."""
        bs, pool = self.pool.block_size, self.pool
        before = self.length
        pool.queried_tokens += len(self.tokens) - before
        while (self.indexed + 1) * bs < len(self.tokens):
            key, tokens = self._next_key()
            block = pool.prefix.get(key)
            if block is None or pool.held[block][1:] != (self.blocks[-1] if self.blocks else -1, tokens):
                break
            pool.share(self.row, self.blocks, block)
            self.indexed, self.key, self.length = self.indexed + 1, key, self.length + bs
        pool.hit_tokens += self.length - before
        return self.length - before

    def register(self) -> None:
        """Offer its committed full blocks to later caches with the same leading tokens."""
        bs, pool = self.pool.block_size, self.pool
        while (self.indexed + 1) * bs <= self.length:
            key, tokens = self._next_key()
            block = self.blocks[self.indexed]
            if key not in pool.prefix and block not in pool.held:
                pool.prefix[key] = block
                pool.held[block] = (key, self.blocks[self.indexed - 1] if self.indexed else -1, tokens)
            self.indexed, self.key = self.indexed + 1, key

    def pool_slots(self, slots) -> list[int]:
        """Where this cache's slots lie in the pool (block * block_size + offset)."""
        bs = self.pool.block_size
        return [self.blocks[s // bs] * bs + s % bs for s in slots]

    @property
    def pending(self) -> list[int]:
        """Committed tokens whose K/V are not here yet."""
        return self.tokens[self.length :]

    def extend(self, n_new: int, tree_tokens: list[int], tree_parents: list[int]) -> int:
        """Make room for n_new committed tokens followed by new tree nodes (parents index the whole
        scratch tree, earlier nodes included; the batch they join checks them, `TreeBatch.pack`).
        Returns the first slot written."""
        n_old = len(self.tree.tokens)
        if n_new and n_old:
            raise ValueError("kv cache: committed tokens cannot be appended while a draft tree is pending")
        first = self.length + n_old
        end = first + n_new + len(tree_tokens)
        if end > len(self.blocks) * self.pool.block_size:
            self.pool.grow(self.row, self.blocks, end)
        self.length += n_new
        self.tree.tokens += tree_tokens
        self.tree.parents += tree_parents
        return first

    def commit(self, path: list[int]) -> None:
        """Keep the tree nodes on `path` (scratch indices, root side first) as committed tokens."""
        commit_all([self], [path])

    def _commit(self, path: list[int]) -> tuple[list[int], list[int]]:
        """`commit`'s bookkeeping; returns the K/V move still to be made, (source pool slots,
        destination pool slots)."""
        move = ([], [])
        if path:
            move = (self.pool_slots(self.length + u for u in path), self.pool_slots(range(self.length, self.length + len(path))))
            self.length += len(path)
        self.drop_tree()
        self._trim()  # a trimmed block keeps its contents until the pool hands it out again
        return move

    def drop_tree(self) -> None:
        self.tree = TokenTree()

    def matching_path(self, tokens: list[int]) -> list[int]:
        """The longest chain of tree nodes from the root whose tokens are a prefix of `tokens`."""
        path, u = [], -1
        for t in tokens:
            nxt = self.tree.child_with_token(u, t)
            if nxt is None:
                break
            path.append(nxt)
            u = nxt
        return path


def commit_all(caches: list[KVCache], paths: list[list[int]]) -> None:
    """`commit` every cache's accepted path, moving all their K/V entries in one pool operation."""
    if caches:
        caches[0].pool.move([c._commit(p) for c, p in zip(caches, paths)])
