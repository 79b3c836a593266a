"""One request's key/value cache in one model: committed slots, then scratch slots for a draft tree.

The cache also keeps the request's token record as this model knows it (`tokens`); the first
`length` of them have their keys and values here, the rest are pending for the next forward.

Layout per layer: [n_kv_heads, capacity, head_dim]. Slots [0, length) hold the committed tokens.
Slots [length, length + n_tree) hold the current draft tree's nodes in the order they were added
(DFS order for a verifier tree, level order for a tree an SSM is growing). After verification
`commit(path)` moves the accepted nodes' entries to consecutive committed slots (no recomputation)
and drops the rest of the tree.

The cache also answers which earlier slots each new query may attend to: committed tokens
causally, tree nodes to every committed slot plus their own ancestors and themselves.
"""

from __future__ import annotations

import torch

from .tree import TokenTree, ancestor_mask


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", capacity: int = 64):
        self.k = torch.empty(n_layers, n_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.tokens: list[int] = []  # the request's committed tokens as this model knows them
        self.length = 0  # committed slots: tokens[:length] have K/V here
        self.tree = TokenTree()  # the draft tree in scratch; its root is the last committed token
        self.tree_depths: list[int] = []  # a child of the root has depth 1
        self.tree_mask = torch.zeros(0, 0, dtype=torch.bool)  # [n_tree, n_tree] ancestor-or-self

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def _reserve(self, slots: int) -> None:
        if slots <= self.capacity:
            return
        new = max(slots, 2 * self.capacity)
        shape = (self.k.shape[0], self.k.shape[1], new, self.k.shape[3])
        k = self.k.new_empty(shape)
        v = self.v.new_empty(shape)
        used = self.length + len(self.tree)
        k[:, :, :used] = self.k[:, :, :used]
        v[:, :, :used] = self.v[:, :, :used]
        self.k, self.v = k, v

    @property
    def pending(self) -> list[int]:
        """Committed tokens whose K/V are not here yet."""
        return self.tokens[self.length :]

    def extend(self, n_new: int, tree_tokens: list[int], tree_parents: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Make room for n_new committed tokens followed by new tree nodes (parents index the whole
        scratch tree, earlier nodes included). Returns (first slot written, positions [n], mask [n, T])
        for the n = n_new + len(tree_tokens) queries, T = all slots in use afterwards."""
        n_old_tree = len(self.tree)
        if n_new and n_old_tree:
            raise ValueError("kv cache: committed tokens cannot be appended while a draft tree is pending")
        first = self.length + n_old_tree
        self._reserve(first + n_new + len(tree_tokens))
        self.length += n_new
        depths = []
        for t, p in zip(tree_tokens, tree_parents):
            if not -1 <= p < len(self.tree):
                raise ValueError(f"kv cache: tree parent {p} out of range")
            d = 1 if p < 0 else self.tree_depths[p] + 1
            self.tree.tokens.append(t)
            self.tree.parents.append(p)
            self.tree_depths.append(d)
            depths.append(d)
        n_tree = len(self.tree)
        self.tree_mask = ancestor_mask(self.tree.parents, self.tree_mask)

        n = n_new + len(tree_tokens)
        total = self.length + n_tree
        positions = torch.cat([
            torch.arange(self.length - n_new, self.length),
            self.length - 1 + torch.tensor(depths, dtype=torch.long),
        ])
        mask = torch.zeros(n, total, dtype=torch.bool)
        if n_new:
            mask[:n_new, : self.length] = torch.ones(n_new, self.length, dtype=torch.bool).tril(self.length - n_new)
        mask[n_new:, : self.length] = True
        mask[n_new:, self.length :] = self.tree_mask[n_old_tree:]
        return first, positions, mask

    def commit(self, path: list[int]) -> None:
        """Keep the tree nodes on `path` (scratch indices, root side first) as committed tokens."""
        if path:
            src = self.length + torch.tensor(path)
            dst = slice(self.length, self.length + len(path))
            self.k[:, :, dst] = self.k[:, :, src]
            self.v[:, :, dst] = self.v[:, :, src]
            self.length += len(path)
        self.drop_tree()

    def drop_tree(self) -> None:
        self.tree, self.tree_depths = TokenTree(), []
        self.tree_mask = torch.zeros(0, 0, dtype=torch.bool)

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
