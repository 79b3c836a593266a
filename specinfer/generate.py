"""In-process speculative generation: the engine's iteration (engine.py) over SSMs and the LLM
loaded in this process, for the CLI, the tests and the benchmarks.

Modes: incremental (no drafter), sequence (SSM 0, a chain: expansion <1, ..., 1>), tree (SSM 0,
an expansion config), merged (every SSM with the same config, trees merged). With `lookup`, a
chain of up to `lookup_tokens` tokens drafted from the request's own earlier text (lookup.py)
joins the merge; with no SSM, it is the only drafter. The chain's length is its own, not the
expansion's depth: it costs no model, only verified rows. With `adaptive`, the expansion config
is the server's and the cost-model controller picks each iteration's depth, as the manager does;
otherwise every request drafts the whole config.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field, replace
from enum import Enum

from tqdm import tqdm

from .controller import SpeculationController
from .eagle import EagleHead
from .engine import Draft, Generation, Request, Sequence, SpeculativeEngine, Verified, add_tallies, validate
from .feature_drafter import FeatureSpeculator
from .grammar import Grammars
from .kv_cache import POOL_TOKENS
from .graphs import GraphConfig
from .lookup import CHAIN_TOKENS
from .model import LlamaModel
from .prediction import prediction_tokens
from .speculator import DraftRequest, Speculator
from .tree import TokenTree
from .verifier import Verifier, VerifyRequest


class Mode(str, Enum):
    INCREMENTAL = "incremental"
    SEQUENCE = "sequence"
    TREE = "tree"
    MERGED = "merged"


PAPER_EXPANSION = [1, 1, 3, 1, 1, 1, 1, 1]  # SpecInfer's default <1,1,3,1,1,1,1,1>


class LocalDrafter:
    """An SSM in this process as a drafter: each draft tells it the tokens committed since it last
    drafted for the request. `drafter` numbers it among the request's drafters, as the manager numbers
    its speculator services, so that sampled drafts are the same here and there."""

    connected = True

    def __init__(self, speculator: Speculator, drafter: int, replacement: bool = False):
        self.speculator = speculator
        self.wants_features = speculator.wants_features
        self.drafter = drafter
        self.replacement = replacement  # sampled drafts: i.i.d. draws instead of draws without replacement
        self.told: dict[str, int] = {}  # request id -> tokens of its record the SSM has been given
        self.ahead: dict[str, dict[tuple[int, ...], TokenTree]] = {}  # its last draft's trees drafted ahead
        self.draft_ns = 0

    async def draft(self, drafts: list[Draft]) -> dict[str, TokenTree]:
        """The trees; with Draft.ahead, then the trees drafted ahead (in process, on the same device: they
        are drafted before the step is verified, not during it)."""
        start = time.perf_counter_ns()
        batch = [DraftRequest(d.request_id, d.record.tail(self.told.get(d.request_id, 0)), d.expansion, d.sampling,
                              self.replacement, self.drafter, d.features, d.ahead) for d in drafts]
        if self.speculator.drafts_ahead and any(d.ahead for d in drafts):
            trees, later = self.speculator.draft_ahead(batch)
            self.draft_ns = time.perf_counter_ns() - start
            self.ahead = {d.request_id: a for d, a in zip(drafts, later()) if a}
        else:
            trees = self.speculator.draft(batch)
            self.draft_ns = time.perf_counter_ns() - start
            self.ahead = {}
        for d in drafts:
            self.told[d.request_id] = len(d.record)
        return {d.request_id: t for d, t in zip(drafts, trees)}

    async def drafted_ahead(self) -> dict[str, dict[tuple[int, ...], TokenTree]]:
        return self.ahead

    def release(self, request_id: str) -> None:
        self.told.pop(request_id, None)
        self.ahead.pop(request_id, None)
        self.speculator.release(request_id)

    async def flush(self) -> None:
        pass


class LocalVerifier:
    """The LLM in this process as the engine's verifier."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier

    async def verify(self, checks, release: list[str], follows: bool = False) -> tuple[list[Verified], int]:
        await self.release(release)
        start = time.perf_counter_ns()
        batch = [VerifyRequest(c.request_id, c.new_tokens, c.tree, c.sampling, c.features, c.logprobs,
                               c.prompt_logprobs, c.top_logprobs, c.allowed, c.prefill_only, c.output_start, c.stop_ids,
                               None if c.candidates is None else c.record_length, c.candidates or [])
                 for c in checks]
        verdicts = self.verifier.step(batch)
        return ([Verified(v.tokens, v.features, v.logprobs, v.prompt_logprobs, v.cached_tokens, r.chosen)
                 for v, r in zip(verdicts, batch)], time.perf_counter_ns() - start)

    async def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.verifier.release(rid)


class Engine:
    def __init__(self, llm: LlamaModel, ssms: list[LlamaModel] = (), mode: Mode = Mode.TREE,
                 expansion: list[int] | None = None, replacement: bool = False, graphs: GraphConfig = GraphConfig(),
                 lookup: bool = False, lookup_tokens: int = CHAIN_TOKENS, adaptive: bool = False,
                 tree_budget: int | None = None, heads: list[EagleHead] = (), dynamic: bool = False,
                 grammars: Grammars | None = None, prefill_chunk: int = 0, kv_tokens: int = POOL_TOKENS,
                 draft_ahead: int = 0, outcome_steps: bool = False):
        """heads: feature drafters (EAGLE-3 heads of this LLM), drafting after the SSMs the mode uses
        (sequence and tree: SSM 0, if any; merged: every SSM); dynamic: every drafter reads the
        expansion as a budget and drafts EAGLE-2's dynamic trees (speculator.py); grammars: compiles
        constrained requests' grammars (Request.grammar) for the LLM's tokenizer; prefill_chunk:
        prompts longer than this are prefilled in chunks of it, by the verifier and the drafters
        (engine.py, speculator.py; 0: whole); kv_tokens: the LLM's KV pool in token slots (what a batch
        of requests in flight needs at most); draft_ahead: the drafters draft each tree's next trees for this
        many of the likeliest outcomes of its verification (engine.py; in process they are drafted before the
        step, on the same device: what that costs and how often it hits, not what it saves)."""
        mode = Mode(mode)
        if mode != Mode.INCREMENTAL and not ssms and not heads and not lookup:
            raise ValueError(f"mode {mode.value} needs at least one SSM or head (or context lookup)")
        if any(s.cfg.vocab_size != llm.cfg.vocab_size for s in ssms):
            raise ValueError("LLM and SSMs must share a tokenizer (vocab sizes differ)")
        if len({h.head_cfg.layers for h in heads}) > 1:
            raise ValueError("heads: every head must read the same layers of the LLM")
        self.llm = llm
        expansion = list(expansion if expansion is not None else PAPER_EXPANSION)
        if mode == Mode.SEQUENCE:
            expansion = [1] * len(expansion)
        used = {Mode.INCREMENTAL: [], Mode.SEQUENCE: ssms[:1], Mode.TREE: ssms[:1], Mode.MERGED: list(ssms)}[mode]
        speculating = mode != Mode.INCREMENTAL
        adaptive, lookup = adaptive and speculating, lookup and speculating
        # each request's expansion: the server's, chosen per step (None), the whole config, or none
        self.own_expansion = None if adaptive else expansion if speculating else []
        drafters = [Speculator(m, graphs=graphs, dynamic=dynamic, prefill_chunk=prefill_chunk) for m in used] + \
            [FeatureSpeculator(h, dynamic=dynamic, prefill_chunk=prefill_chunk) for h in heads if speculating]
        self.verifier = Verifier(llm, kv_tokens, graphs=graphs, feature_layers=heads[0].head_cfg.layers if heads else ())
        self.engine = SpeculativeEngine(
            LocalVerifier(self.verifier),
            [LocalDrafter(d, i, replacement) for i, d in enumerate(drafters)],
            set(llm.cfg.eos_token_ids), expansion, tree_budget,
            SpeculationController(lookup=lookup, chain=lookup_tokens, trees=bool(drafters), ahead=draft_ahead > 0)
            if adaptive else None, lookup,
            lookup_tokens, grammars, prefill_chunk, prediction_tokens=prediction_tokens(llm.device.type),
            draft_ahead=draft_ahead, outcome_steps=outcome_steps)

    def generate(self, requests: list[Request], progress: bool = False) -> list[Generation]:
        for r in requests:
            validate(r, self.llm.cfg.vocab_size, self.llm.cfg.max_position_embeddings)
        ids = [r.id or str(i) for i, r in enumerate(requests)]
        if len(set(ids)) != len(ids):
            raise ValueError("id: request ids must be unique")
        seqs = [Sequence(replace(r, id=i), self.own_expansion) for r, i in zip(requests, ids)]
        for s in seqs:
            s.constraint = self.engine.constraint(s.request)
        bar = tqdm(total=sum(r.max_new_tokens for r in requests), disable=not progress, unit="tok")
        logprobs: dict = {}
        drafters: dict = {s.id: {} for s in seqs}
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no event loop in this thread
            asyncio.run(self._run(seqs, bar, logprobs, drafters))
        else:  # called from a coroutine: the engine's loop runs in a thread of its own
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, self._run(seqs, bar, logprobs, drafters)).result()
        bar.close()
        return [Generation(s.id, s.generated, s.finish_reason, s.steps, s.accepted, s.tree_steps,
                           s.no_tree.most_common(1)[0][0] if s.no_tree else "", *logprobs.get(s.id, (None, None)),
                           drafters[s.id],
                           (s.prediction.accepted, s.prediction.rejected) if s.prediction is not None else (0, 0))
                for s in seqs]

    async def _run(self, seqs: list[Sequence], bar, logprobs: dict, drafters: dict) -> None:
        """Step until every sequence is done; `logprobs` gets the (logprobs, prompt logprobs) asked for,
        `drafters` each drafter's (accepted, drafted) nodes."""
        live = list(seqs)
        while live:
            for s, event in await self.engine.iteration(live):
                if isinstance(event, Exception):
                    raise event
                drafters[s.id] = add_tallies(drafters[s.id], event.drafters)
                if s.request.logprobs or s.request.prompt_logprobs:
                    mine = logprobs.setdefault(s.id, ([] if s.request.logprobs else None, None))
                    if event.logprobs is not None:
                        mine[0].extend(event.logprobs)
                    if event.prompt_logprobs is not None:
                        logprobs[s.id] = (mine[0], event.prompt_logprobs)
                bar.update(len(event.tokens))
                if event.finish_reason:
                    s.done = True
                    self.engine.release(s.id)
            live = [s for s in live if not s.done]
        await self.engine.flush()
