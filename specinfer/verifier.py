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

from .kv_cache import KVCache
from .model import LlamaModel, StepInput
from .sampling import SamplingParams, probabilities, request_generator
from .tree import TokenTree
from .verify import Verdict, verify_greedy, verify_stochastic


@dataclass
class VerifyRequest:
    request_id: str
    new_tokens: list[int]  # tokens to append to the request's record (the whole prompt at first)
    tree: TokenTree = field(default_factory=TokenTree)
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class _State:
    cache: KVCache
    tokens: list[int] = field(default_factory=list)


class Verifier:
    def __init__(self, model: LlamaModel):
        self.model = model
        self.states: dict[str, _State] = {}

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def step(self, batch: list[VerifyRequest]) -> list[Verdict]:
        items = []
        for req in batch:
            st = self.states.get(req.request_id)
            if st is None:
                st = self.states[req.request_id] = _State(self.model.new_cache(len(req.new_tokens) + 64))
            st.tokens.extend(req.new_tokens)
            pending = st.tokens[st.cache.length :]
            if not pending:
                raise ValueError(f"request {req.request_id}: nothing to decode (empty prompt?)")
            items.append(StepInput(st.cache, pending, req.tree.tokens, req.tree.parents))
        verdicts = []
        for req, logits in zip(batch, self.model(items)):  # logits [1 + n_tree, V]
            st = self.states[req.request_id]
            if req.sampling.greedy:
                verdict = verify_greedy(req.tree, logits.argmax(dim=-1).tolist())
            else:
                gen = request_generator(req.sampling.seed, "verify", len(st.tokens))
                verdict = verify_stochastic(req.tree, probabilities(logits, req.sampling), gen)
            st.cache.commit(verdict.path)
            st.tokens.extend(verdict.tokens)
            verdicts.append(verdict)
        return verdicts
