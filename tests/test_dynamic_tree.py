"""Dynamic trees (EAGLE-2, speculator.py): a drafter's tree is the expansion's number of best paths
by its own log-probability, grown as EAGLE-2 grows it (reference: the algorithm run on plain
forwards of each path, no cache, no batching); later drafts do not depend on what the cache kept of
earlier ones; and greedy output with dynamic trees is the LLM's own."""

from __future__ import annotations

import itertools

import pytest
import torch

from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel, StepInput
from specinfer.speculator import DYNAMIC_TOP, DraftRequest, Speculator
from specinfer.tree import TokenTree

from .conftest import MODELS, path_to


@pytest.fixture(scope="module")
def ssm():
    return LlamaModel.from_pretrained(MODELS / "ssm-0")


def last_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """The model's next-token logits after `tokens`, from a plain forward of a fresh cache."""
    cache = model.new_pool(1024).new_cache()
    try:
        return model.forward([StepInput(cache, tokens, [], [])])[0]
    finally:
        cache.release()


def eagle2_paths(model: LlamaModel, record: list[int], expansion: list[int]) -> set[tuple[int, ...]]:
    """EAGLE-2's tree for a depth-and-size budget given as an expansion, as paths from the root."""
    widths = list(itertools.accumulate(expansion, lambda a, b: a * b))
    top = min(max(widths), DYNAMIC_TOP)
    score, frontier, order = {(): 0.0}, [()], []
    for depth in range(len(expansion)):
        level = []
        for path in frontier:
            best = last_logits(model, record + list(path)).log_softmax(-1).topk(top)
            for token, logp in zip(best.indices.tolist(), best.values.tolist()):
                score[path + (token,)] = score[path] + logp
                level.append(path + (token,))
        order += level
        ranked = sorted(range(len(level)), key=lambda u: (-score[level[u]], u))
        frontier = [level[u] for u in sorted(ranked[: widths[depth]])]
    kept = sorted(range(len(order)), key=lambda u: (-score[order[u]], u))[: sum(widths)]
    return {order[u] for u in kept}


def paths(tree: TokenTree) -> set[tuple[int, ...]]:
    """Each node's tokens from the root's child down to it."""
    return {tuple(tree.tokens[v] for v in path_to(tree, u)) for u in range(len(tree))}


@pytest.mark.parametrize("expansion", [[2, 1, 1], [3, 2, 1], [1, 1, 1, 1]])
def test_a_dynamic_tree_is_eagle2s_best_paths(ssm, heldout_ids, expansion):
    requests = [DraftRequest(str(i), p[:40], expansion) for i, p in enumerate(heldout_ids[:3])]
    trees = Speculator(ssm, dynamic=True).draft(requests)  # batched: the rows of three requests in each forward
    for r, tree in zip(requests, trees):
        assert len(tree) == sum(itertools.accumulate(expansion, lambda a, b: a * b))
        assert paths(tree) == eagle2_paths(ssm, r.new_tokens, expansion)


def test_a_dynamic_tree_is_no_fixed_tree(ssm, heldout_ids):
    """Somewhere among the prompts, the best paths are not the fixed expansion's shape."""
    spec, fixed = Speculator(ssm, dynamic=True), Speculator(ssm)
    differ = [paths(spec.draft([DraftRequest("a", p[:40], [2, 1, 1])])[0]) !=
              paths(fixed.draft([DraftRequest("a", p[:40], [2, 1, 1])])[0]) for p in heldout_ids[:8]]
    assert any(differ)


def test_a_dynamic_draft_after_a_commit_equals_a_fresh_ones(ssm, heldout_ids):
    """The cache keeps the K/V of the nodes that went through the model, not the tree's first nodes:
    committing a drafted path and drafting again gives what a fresh speculator drafts."""
    spec = Speculator(ssm, dynamic=True)
    record = heldout_ids[0][:40]
    (tree,) = spec.draft([DraftRequest("r", record, [3, 2, 1])])
    deepest = max(range(len(tree)), key=lambda u: len(path_to(tree, u)))
    accepted = [tree.tokens[v] for v in path_to(tree, deepest)]
    again = spec.draft([DraftRequest("r", accepted + [5], [3, 2, 1])])[0]
    fresh = Speculator(ssm, dynamic=True).draft([DraftRequest("f", record + accepted + [5], [3, 2, 1])])[0]
    assert paths(again) == paths(fresh)


def test_greedy_output_with_dynamic_trees_is_the_llms_own(heldout_ids):
    llm, ssm = LlamaModel.from_pretrained(MODELS / "llm"), LlamaModel.from_pretrained(MODELS / "ssm-0")
    requests = [Request(p, 32) for p in heldout_ids[:4]]
    plain = Engine(llm, mode=Mode.INCREMENTAL).generate(requests)
    dynamic = Engine(llm, [ssm], Mode.TREE, [3, 2, 1], lookup=True, dynamic=True).generate(requests)
    assert [g.token_ids for g in dynamic] == [g.token_ids for g in plain]
    assert sum(g.steps for g in dynamic) < sum(len(g.token_ids) for g in dynamic)
