"""Token trees (SpecInfer section 3).

A tree hangs below a *root*: the request's last committed token, which is not a node of the tree.
Node u has token t_u and parent p_u (-1 for a child of the root); nodes are stored in DFS order,
so every parent precedes its children and every subtree is contiguous. S_u, the token sequence
from the root to u, is unique per node: two draws of the same token under the same parent are one
node.

Under stochastic decoding the tree also records *how* each child was drawn, because
multi-step speculative sampling needs it (see acceptance.py): a `DraftGroup` is one SSM's draws of
children of one parent, in draw order, from one sparse distribution q, with or without
replacement. A node may be drawn several times (with replacement) and by several groups (after a
merge). Greedy trees have no groups.

This module knows nothing about models or tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import lt


@dataclass
class DraftGroup:
    """Draws of children of `parent` from one sparse distribution q = {q_ids[i]: q_probs[i]}."""

    parent: int  # node index, -1 for the root
    q_ids: list[int]
    q_probs: list[float]
    children: list[int]  # node index of each draw, in draw order (repeats allowed with replacement)
    replacement: bool


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    groups: list[DraftGroup] = field(default_factory=list)

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError("tree: tokens and parents differ in length")
        # every tree a server reads passes here: the check runs in C (map), the loop only names the node
        if self.parents and (min(self.parents) < -1 or not all(map(lt, self.parents, range(len(self.parents))))):
            u, p = next((u, p) for u, p in enumerate(self.parents) if not -1 <= p < u)
            raise ValueError(f"tree: node {u} has parent {p}; parents must precede children")

    def __len__(self) -> int:
        return len(self.tokens)

    def child_with_token(self, u: int, token: int) -> int | None:
        for c, p in enumerate(self.parents):
            if p == u and self.tokens[c] == token:
                return c
        return None

    def paths(self) -> list[tuple[int, ...]]:
        """S_u for every node u (root excluded)."""
        out: list[tuple[int, ...]] = []
        for t, p in zip(self.tokens, self.parents):
            out.append((out[p] if p >= 0 else ()) + (t,))
        return out

    def groups_of(self, u: int) -> list[DraftGroup]:
        return [g for g in self.groups if g.parent == u]


def check_groups(tree: TokenTree) -> None:
    """Raise ValueError ("tree: ...") unless every draft group names nodes of the tree and gives one
    probability per q id."""
    for g in tree.groups:
        if not -1 <= g.parent < len(tree) or any(not 0 <= c < len(tree) for c in g.children):
            raise ValueError("tree: a draft group names a node outside the tree")
        if len(g.q_ids) != len(g.q_probs):
            raise ValueError("tree: a draft group's q_token_ids and q_probs differ in length")


def check_verifiable(tree: TokenTree) -> None:
    """Raise ValueError ("tree: ...") unless the tree is what verification assumes: one node per
    path (no two children of a node with the same token), and every draft group's draws are
    children of its parent with positive probability in its q (distinct ids, finite probabilities)."""
    seen = set()
    for u, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
        if (p, t) in seen:
            raise ValueError(f"tree: node {u} repeats token {t} under parent {p} (one node per path)")
        seen.add((p, t))
    check_groups(tree)
    for g in tree.groups:
        if len(set(g.q_ids)) != len(g.q_ids):
            raise ValueError("tree: a draft group's q_token_ids must be distinct")
        if not all(0.0 <= q < float("inf") for q in g.q_probs):
            raise ValueError("tree: a draft group's q_probs must be finite and >= 0")
        q = dict(zip(g.q_ids, g.q_probs))
        for c in g.children:
            if tree.parents[c] != g.parent or q.get(tree.tokens[c], 0.0) <= 0.0:
                raise ValueError(f"tree: draft group of node {g.parent} draws node {c}, which is not its child "
                                 f"with positive probability in its q")


def depths(parents: list[int]) -> list[int]:
    """Per node, its depth: a child of the root has depth 1."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def dfs_order(parents: list[int]) -> list[int]:
    """A DFS preorder of nodes given in any parent-before-child order (children kept in their order)."""
    kids: dict[int, list[int]] = {}
    for u, p in enumerate(parents):
        kids.setdefault(p, []).append(u)
    order, stack = [], list(reversed(kids.get(-1, [])))
    while stack:
        u = stack.pop()
        order.append(u)
        stack.extend(reversed(kids.get(u, [])))
    return order


def within(tree: TokenTree, depth: int) -> TokenTree:
    """The tree's nodes of depth `depth` at most (a tree of top-k drafts: it has no draft groups)."""
    keep = [u for u, d in enumerate(depths(tree.parents)) if d <= depth]
    return tree if len(keep) == len(tree) else reorder(TokenTree(tree.tokens, tree.parents), keep)


def reorder(tree: TokenTree, order: list[int]) -> TokenTree:
    """The same tree with its nodes renumbered so that node order[i] becomes node i."""
    new = {old: i for i, old in enumerate(order)}
    new[-1] = -1
    return TokenTree(
        tokens=[tree.tokens[o] for o in order],
        parents=[new[tree.parents[o]] for o in order],
        groups=[
            DraftGroup(new[g.parent], g.q_ids, g.q_probs, [new[c] for c in g.children], g.replacement)
            for g in tree.groups
        ],
    )


def merge(trees: list[TokenTree]) -> TokenTree:
    """Merge-based construction: the union of several trees over the same root.

    Every sequence S_u of every input tree is a path of the result and every path of the result
    is a sequence of some input tree. Draft groups are kept (remapped), in input-tree order, so the
    verifier sees each SSM's draws exactly as they were made. The result is in DFS order.
    """
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node: one per path
    tokens: list[int] = []
    parents: list[int] = []
    groups: list[DraftGroup] = []
    for tree in trees:
        local = []
        for t, p in zip(tree.tokens, tree.parents):
            parent = local[p] if p >= 0 else -1
            u = index.setdefault((parent, t), len(tokens))
            if u == len(tokens):
                tokens.append(t)
                parents.append(parent)
            local.append(u)
        for g in tree.groups:
            parent = local[g.parent] if g.parent >= 0 else -1
            groups.append(DraftGroup(parent, g.q_ids, g.q_probs, [local[c] for c in g.children], g.replacement))
    merged = TokenTree(tokens, parents, groups)
    return reorder(merged, dfs_order(parents))


def proposers(merged: TokenTree, trees: dict[int, TokenTree]) -> list[int]:
    """Per node of `merged` (the merge of `trees`, keyed by source number, maybe pruned by a grammar),
    a bitmask of the sources whose tree has the node's path: bit i for source i."""
    index = {path: u for u, path in enumerate(merged.paths())}
    bits = [0] * len(merged)
    for i, tree in trees.items():
        for path in tree.paths():
            if path in index:  # not a path a grammar pruned
                bits[index[path]] |= 1 << i
    return bits


def path_along(tree: TokenTree, tokens: list[int]) -> list[int]:
    """The nodes from the root along `tokens`, as far as the tree has them."""
    path, u = [], -1
    for t in tokens:
        u = tree.child_with_token(u, t)
        if u is None:
            break
        path.append(u)
    return path


def accepted_nodes(tree: TokenTree, tokens: list[int]) -> list[int]:
    """The nodes a verifier step accepted, given the tokens it returned (the accepted path's tokens
    and then its own bonus token): the path from the root along tokens[:-1]."""
    path = path_along(tree, tokens[:-1])
    if len(path) < len(tokens) - 1:
        raise ValueError(f"tree: accepted token {tokens[len(path)]} is not a child of node {path[-1] if path else -1}")
    return path


MAX_EXPANSION_DEPTH, MAX_EXPANSION_WIDTH = 16, 8


def validate_expansion(expansion: list[int], field: str = "expansion") -> None:
    """Raise ValueError naming `field` unless every k_i is in [1, 8] and the depth at most 16."""
    if len(expansion) > MAX_EXPANSION_DEPTH or any(not 1 <= k <= MAX_EXPANSION_WIDTH for k in expansion):
        raise ValueError(f"{field}: each k_i must be in [1, {MAX_EXPANSION_WIDTH}] and the depth at most "
                         f"{MAX_EXPANSION_DEPTH}, got {list(expansion)}")


def tree_size(expansion: list[int]) -> int:
    """Nodes of the full tree of expansion config <k_1, ..., k_m>: sum over i of k_1 * ... * k_i."""
    total, width = 0, 1
    for k in expansion:
        width *= k
        total += width
    return total


def fit_expansion(expansion: list[int], max_nodes: int) -> list[int]:
    """The deepest prefix of the expansion config whose full tree has at most max_nodes nodes."""
    depth = len(expansion)
    while depth and tree_size(expansion[:depth]) > max_nodes:
        depth -= 1
    return expansion[:depth]


def parse_expansion(text: str) -> list[int]:
    """'1,1,3,1' -> [1, 1, 3, 1]; an empty string means no speculation."""
    text = text.strip()
    if not text:
        return []
    try:
        ks = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"expansion: expected comma-separated integers, got {text!r}") from None
    if any(k < 1 for k in ks):
        raise ValueError(f"expansion: every k_i must be >= 1, got {text!r}")
    return ks
