"""The LLM side: tree-based parallel decoding and verification for a batch of requests.

A `Verifier` hosts the LLM and keeps, per request, its token record and LLM KV cache. One `step`
runs one LLM forward over the whole batch: for each request its tokens not yet in the cache (the
prompt on the first step, the previous bonus token afterwards) followed by its draft tree. It then
verifies each tree against the LLM's rows (verify.py), moves the accepted path's KV entries to
committed slots, drops the rest, and returns the accepted tokens plus the bonus token.

A request with an empty tree takes a plain incremental step; incremental decoding is this same
path with no speculator at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_cache import POOL_TOKENS, KVCache
from .model import LlamaModel, StepInput, check_token_ids
from .sampling import SamplingParams, probabilities, request_generator
from .tree import TokenTree
from .verify import Verdict, verify_greedy, verify_stochastic


@dataclass
class VerifyRequest:
    request_id: str
    new_tokens: list[int]  # tokens to append to the request's record (the whole prompt at first)
    tree: TokenTree = field(default_factory=TokenTree)
    sampling: SamplingParams = field(default_factory=SamplingParams)


class Verifier:
    def __init__(self, model: LlamaModel, kv_tokens: int = POOL_TOKENS):
        self.model = model
        self.pool = model.new_pool(kv_tokens)
        self.caches: dict[str, KVCache] = {}

    def release(self, request_id: str) -> None:
        cache = self.caches.pop(request_id, None)
        if cache is not None:
            cache.release()

    def _check_room(self, batch: list[VerifyRequest]) -> None:
        """Raise CacheFull, before anything changes, if the pool cannot hold the step."""
        need = 0
        for req in batch:
            cache = self.caches.get(req.request_id)
            slots = (len(cache.tokens) if cache else 0) + len(req.new_tokens) + len(req.tree)
            need += cache.blocks_to_grow(slots) if cache else self.pool.blocks_for(slots)
        self.pool.check_room(need)

    def step(self, batch: list[VerifyRequest]) -> list[Verdict]:
        for req in batch:
            check_token_ids(f"new_token_ids (request {req.request_id})", req.new_tokens, self.model.cfg.vocab_size)
            check_token_ids(f"tree (request {req.request_id})", req.tree.tokens, self.model.cfg.vocab_size)
        self._check_room(batch)
        items = []
        for req in batch:
            cache = self.caches.get(req.request_id)
            if cache is None:
                cache = self.caches[req.request_id] = self.pool.new_cache()
            cache.tokens.extend(req.new_tokens)
            if not cache.pending:
                raise ValueError(f"request {req.request_id}: nothing to decode (empty prompt?)")
            items.append(StepInput(cache, cache.pending, req.tree.tokens, req.tree.parents))
        verdicts = self.decide(batch, self.forward(items))
        for req, verdict in zip(batch, verdicts):
            cache = self.caches[req.request_id]
            cache.commit(verdict.path)
            cache.tokens.extend(verdict.tokens)
        return verdicts

    def forward(self, items: list[StepInput]) -> list[torch.Tensor] | None:
        """The LLM's logits [1 + n_tree, V] per item (a model-parallel verifier: None on the ranks
        that do not hold them)."""
        return self.model(items)

    def decide(self, batch: list[VerifyRequest], logits: list[torch.Tensor]) -> list[Verdict]:
        """Each request's accepted path and tokens, from its logits."""
        verdicts = []
        for req, rows in zip(batch, logits):
            if req.sampling.greedy:
                verdicts.append(verify_greedy(req.tree, rows.argmax(dim=-1).tolist()))
            else:
                gen = request_generator(req.sampling.seed, "verify", len(self.caches[req.request_id].tokens))
                verdicts.append(verify_stochastic(req.tree, probabilities(rows, req.sampling), gen))
        return verdicts
