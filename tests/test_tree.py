"""Token tree structure: merge, DFS layout, ancestor mask, depths."""

import random

import numpy as np
import pytest

from specinfer.tree import (TokenTree, accepted_nodes, depths, dfs_order, merge, parse_expansion,
                            proposers, reorder)

from specinfer_kernels.batch import SMALL_TREES, ancestor_words

from .conftest import path_to


def random_tree(rng: random.Random, n: int, vocab: int = 5) -> TokenTree:
    """A random tree with unique sibling tokens, nodes in creation order (not necessarily DFS)."""
    tokens, parents = [], []
    for _ in range(n):
        p = rng.randrange(-1, len(tokens))
        used = {t for t, q in zip(tokens, parents) if q == p}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            continue
        tokens.append(rng.choice(free))
        parents.append(p)
    return TokenTree(tokens, parents)


def is_dfs(parents: list[int]) -> bool:
    """Preorder: each node's parent lies on the root path of the node just before it."""
    stack: list[int] = []
    for u, p in enumerate(parents):
        while stack and stack[-1] != p:
            stack.pop()
        if p >= 0 and not stack:
            return False
        stack.append(u)
    return True


@pytest.mark.parametrize("seed", range(20))
def test_merge_paths_are_exactly_the_union_of_input_paths(seed):
    rng = random.Random(seed)
    trees = [random_tree(rng, rng.randrange(0, 12)) for _ in range(rng.randrange(1, 4))]
    merged = merge(trees)
    want = set().union(*(set(t.paths()) for t in trees))
    assert set(merged.paths()) == want
    assert len(merged.paths()) == len(want)  # no path twice
    assert is_dfs(merged.parents)


@pytest.mark.parametrize("seed", range(10))
def test_proposers_mark_each_merged_node_with_exactly_the_trees_that_have_its_path(seed):
    rng = random.Random(seed)
    trees = {i: random_tree(rng, rng.randrange(1, 12)) for i in rng.sample(range(5), rng.randrange(1, 4))}
    merged = merge(list(trees.values()))
    bits = proposers(merged, trees)
    for path, b in zip(merged.paths(), bits):
        assert b == sum(1 << i for i, t in trees.items() if path in set(t.paths()))


def test_accepted_nodes_follow_the_returned_tokens_and_leave_out_the_bonus():
    tree = TokenTree([5, 6, 7, 8], [-1, 0, 0, -1])
    assert accepted_nodes(tree, [5, 7, 9]) == [0, 2]  # 9: the LLM's own token
    assert accepted_nodes(tree, [4]) == []
    with pytest.raises(ValueError, match="not a child"):
        accepted_nodes(tree, [5, 9, 1])


def test_merge_keeps_draft_groups_remapped_to_merged_nodes():
    from specinfer.tree import DraftGroup

    a = TokenTree([7, 8], [-1, 0], [DraftGroup(-1, [7, 1], [0.6, 0.4], [0], False)])
    b = TokenTree([1, 7, 9], [-1, -1, 1], [DraftGroup(-1, [1, 7], [0.5, 0.5], [0, 1, 0], True)])
    m = merge([a, b])
    by_path = {p: u for u, p in enumerate(m.paths())}
    assert [m.groups[0].children, m.groups[1].children] == [
        [by_path[(7,)]], [by_path[(1,)], by_path[(7,)], by_path[(1,)]]]
    assert m.groups[1].replacement and not m.groups[0].replacement


@pytest.mark.parametrize("seed", range(10))
def test_dfs_reorder_preserves_paths_and_is_dfs(seed):
    tree = random_tree(random.Random(seed), 15)
    t = reorder(tree, dfs_order(tree.parents))
    assert sorted(t.paths()) == sorted(tree.paths())
    assert is_dfs(t.parents)


def test_parse_expansion():
    assert parse_expansion("1,1,3,1") == [1, 1, 3, 1]
    assert parse_expansion("") == []
    with pytest.raises(ValueError, match="expansion"):
        parse_expansion("1,0")


def test_parents_must_precede_children():
    with pytest.raises(ValueError, match="parent"):
        TokenTree([1, 2], [1, -1])


def ancestor_cases() -> dict[str, tuple[list[TokenTree], int]]:
    """Trees of every shape, and their words: over SMALL_TREES nodes in all (numpy's rounds: a root
    alone, a 100-deep chain, 150 wide, random ones of up to 300 nodes, 10 words), and under it (the
    Python loop: up to 64 nodes each, 2 words)."""
    rng = random.Random(7)
    many = [random_tree(rng, 1), TokenTree(list(range(100)), list(range(-1, 99))),
            TokenTree(list(range(150)), [-1] * 150), *(random_tree(rng, n) for n in (14, 300, 33))]
    few = [random_tree(rng, 1), TokenTree(list(range(40)), list(range(-1, 39))), random_tree(rng, 64),
           random_tree(rng, 16)]
    return {"many": (many, 10), "few": (few, 2)}


@pytest.mark.parametrize("case", ["many", "few"])
def test_ancestor_words_mark_exactly_ancestors_and_self_for_many_trees_at_once(case):
    """One call over many trees: each node's row is its path from the root, its depth the row's bits."""
    trees, words = ancestor_cases()[case]
    assert (sum(map(len, trees)) <= SMALL_TREES) == (case == "few")
    rows = ancestor_words([t.parents for t in trees], np.array([len(t) for t in trees]), words)
    assert rows.shape == (sum(map(len, trees)), words) and rows.dtype == np.uint32
    at = 0
    for t in trees:
        for u in range(len(t)):
            bits = {32 * w + b for w in range(words) for b in range(32) if int(rows[at + u, w]) >> b & 1}
            assert bits == set(path_to(t, u)) and len(bits) == depths(t.parents)[u]
        at += len(t)
    last = np.array([random.Random(len(t)).randint(0, len(t)) for t in trees])  # a tree's nodes added last
    tails = np.concatenate([rows[end - k: end] for end, k in zip(np.cumsum([len(t) for t in trees]), last)])
    assert np.array_equal(ancestor_words([t.parents for t in trees], np.array([len(t) for t in trees]), words, last), tails)


@pytest.mark.parametrize("size", [3, SMALL_TREES + 1])
def test_ancestor_words_refuse_a_parent_after_its_child(size):
    parents = [-1, *range(size - 2), size - 1]
    with pytest.raises(ValueError, match=f"node {size - 1} of a tree has parent {size - 1}"):
        ancestor_words([parents], np.array([size]), -(-size // 32))
