"""The SSM side: expansion-based token tree construction for a batch of requests.

A `Speculator` hosts one SSM and keeps, per request, the tokens it has been told were committed
and an SSM KV cache. `draft` grows every request's tree one level at a time with one batched SSM
forward per level: level 1 comes from the row of the last committed token (the root), level i+1
from the rows of level i's nodes, each node attending to the committed prefix and its ancestors.

Greedy: a node at depth i gets the top-k_i tokens as children.
Stochastic: a node at depth i gets k_i draws from q, the SSM's distribution after the request's
sampling transforms, truncated to its `q_top` most likely tokens and renormalized; draws are
sequential without replacement by default, i.i.d. with replacement on request. The draws and q
are recorded in the tree (DraftGroup) for the verifier.

Losing a speculator's state only costs speed: the next `draft` recomputes whatever it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_cache import POOL_TOKENS, KVCache
from .model import LlamaModel, StepInput, check_token_ids
from .sampling import SamplingParams, probabilities, request_generator, sparsify
from .tree import DraftGroup, TokenTree, dfs_order, reorder


@dataclass
class DraftRequest:
    request_id: str
    new_tokens: list[int]  # tokens committed since this speculator last heard of the request
    expansion: list[int]  # <k_1, ..., k_m>; empty: no tree
    sampling: SamplingParams = field(default_factory=SamplingParams)
    replacement: bool = False  # stochastic drafts: i.i.d. draws instead of draws without replacement
    drafter: int = 0  # tells apart the drafters of one request (e.g. speculator services) so their draws are independent


class Speculator:
    def __init__(self, model: LlamaModel, index: int = 0, q_top: int = 32, kv_tokens: int = POOL_TOKENS):
        self.model = model
        self.pool = model.new_pool(kv_tokens)
        self.index = index  # keeps each SSM's random draws independent of the others'
        self.q_top = q_top
        self.caches: dict[str, KVCache] = {}

    def release(self, request_id: str) -> None:
        cache = self.caches.pop(request_id, None)
        if cache is not None:
            cache.release()

    def _sync(self, req: DraftRequest) -> KVCache:
        """Record new tokens and keep the KV of the part of the last tree they confirm; the root
        (the last token) always stays pending, so the first forward yields its row."""
        cache = self.caches.get(req.request_id)
        if cache is None:
            cache = self.caches[req.request_id] = self.pool.new_cache()
        cache.tokens.extend(req.new_tokens)
        if not cache.tokens:
            raise ValueError(f"request {req.request_id}: no tokens to draft from")
        cache.commit(cache.matching_path(cache.tokens[cache.length : -1]))
        return cache

    def draft(self, batch: list[DraftRequest]) -> list[TokenTree]:
        trees = [TokenTree() for _ in batch]
        for r in batch:  # all checked before any state changes
            check_token_ids(f"new_token_ids (request {r.request_id})", r.new_tokens, self.model.cfg.vocab_size)
        caches = [self._sync(r) for r in batch]
        gens = [None if r.sampling.greedy else request_generator(r.sampling.seed, "draft", r.drafter, self.index, len(c.tokens))
                for r, c in zip(batch, caches)]
        active = [i for i, r in enumerate(batch) if r.expansion]
        # frontier[i]: tree nodes of request i added at the previous level, not yet run through the SSM
        frontier: dict[int, list[int]] = {i: [] for i in active}
        depth = 0
        while active:
            # Nodes enter the SSM cache level by level in tree-index order, so a node's index in
            # the cache's scratch tree equals its tree index, and tree parents index the scratch.
            items = [StepInput(caches[i], caches[i].pending if depth == 0 else [],
                               [trees[i].tokens[u] for u in frontier[i]],
                               [trees[i].parents[u] for u in frontier[i]])
                     for i in active]
            rows = self.model(items)
            still = []
            for i, logits in zip(active, rows):
                parents = [-1] if depth == 0 else frontier[i]
                frontier[i] = self._expand(trees[i], parents, logits, batch[i], gens[i], batch[i].expansion[depth])
                if depth + 1 < len(batch[i].expansion):
                    still.append(i)
            active = still
            depth += 1
        return [reorder(t, dfs_order(t.parents)) for t in trees]

    def _expand(self, tree: TokenTree, parents: list[int], logits: torch.Tensor, req: DraftRequest,
                gen: torch.Generator, k: int) -> list[int]:
        """Add k children (or k draws) under each parent from its logits row; return the new nodes."""
        new: list[int] = []
        if req.sampling.greedy:
            top = logits.topk(k, dim=-1).indices.tolist()
            for parent, tokens in zip(parents, top):
                for t in tokens:
                    new.append(_add(tree, parent, t))
            return new
        q_ids, q_probs = sparsify(probabilities(logits, req.sampling), self.q_top)  # [R, K] each
        support = (q_probs > 0).sum(dim=-1).tolist()
        draws = _draw(q_probs, k, req.replacement, support, gen)
        ids, ps = q_ids.tolist(), q_probs.tolist()
        for r, parent in enumerate(parents):
            made: dict[int, int] = {}  # token -> node: repeated draws of one token are one node
            children = []
            for j in draws[r]:
                t = ids[r][j]
                if t not in made:
                    made[t] = _add(tree, parent, t)
                    new.append(made[t])
                children.append(made[t])
            n = support[r]
            tree.groups.append(DraftGroup(parent, ids[r][:n], ps[r][:n], children, req.replacement))
        return new


def _draw(q: torch.Tensor, k: int, replacement: bool, support: list[int], gen: torch.Generator) -> list[list[int]]:
    """k draws per row of q [R, K] (indices into K): i.i.d., or sequential without replacement
    (at most the row's support), one multinomial call for all rows when the support allows."""
    if replacement or min(support) >= k:
        return torch.multinomial(q, k, replacement=replacement, generator=gen).tolist()
    return [torch.multinomial(row, min(k, n), generator=gen).tolist() for row, n in zip(q, support)]


def _add(tree: TokenTree, parent: int, token: int) -> int:
    tree.tokens.append(token)
    tree.parents.append(parent)
    return len(tree.tokens) - 1

