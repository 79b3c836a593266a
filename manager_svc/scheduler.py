"""Iteration-level continuous batching (DESIGN section 5).

The scheduler owns every request's token record (prompt + committed tokens), the single source of
truth. Each iteration:

  1. admit waiting requests up to the batch size, the prefill token budget and the verifier's KV
     cache: each running request reserves the slots it can ever hold there (prompt +
     max_new_tokens + its largest merged draft tree, in whole blocks), so a step never finds the
     verifier's pool full and nothing admitted has to be dropped;
  2. ask every speculator, concurrently, for the batch's draft trees and merge them per request
     (with context lookup on, also with a chain drafted here from the request's own earlier text:
     specinfer/lookup.py, a dictionary lookup per request);
  3. one batched Verify: a new request's prompt rides in the same batch as the others' trees;
  4. append each request's accepted tokens, stream them, retire finished requests and release
     their state on every service (piggybacked on the next messages, or sent at once when idle).

Tree budget: the server's expansion config is cut, per request, to at most
tree_budget // batch_size nodes, so speculation shrinks as the batch grows; within that, a
controller (controller.py) picks each iteration's depth of the server's trees from a cost model
fitted online and the measured acceptance, down to none (plain incremental decoding), or context
lookup's chain alone (no speculator asked: no drafting time, no RPC). A request
that fixes its own expansion gets exactly that. Which trees are verified never changes a request's
tokens, apart from sampled requests that ask for MSS (their seeded samples then depend on the trees).

Nothing here runs a model: the event loop moves token IDs. It knows nothing of protobuf.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import grpc

from specinfer.generate import Request, append_tokens
from specinfer.lookup import ContextIndex, chain_tree
from specinfer.tree import TokenTree, accepted_nodes, fit_expansion, merge, proposers, tree_size
from specinfer_rpc.server import Abort

from . import metrics
from .clients import Check, Draft, VerifierClient, VerifierResync, VerifierUnavailable
from .controller import Choice, SpeculationController, Step
from .replicas import SpeculatorReplicas

log = logging.getLogger("specinfer.manager")


@dataclass
class Chunk:
    """Tokens accepted in one step; the last chunk of a request has its finish reason."""

    tokens: list[int]
    finish_reason: str = ""
    # for a request that asked for its draft trees: the tree this step verified, which speculators
    # proposed each node (bit i: speculator i), and the nodes the verifier accepted
    tree: TokenTree | None = None
    proposers: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    request: Request
    expansion: list[int] | None  # None: the server's, within the tree budget; [] none; else fixed
    want_trees: bool = False  # stream each step's draft tree with its chunk
    generated: list[int] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk or Abort, for the stream
    steps: int = 0  # verifier steps, the prefill included
    accepted: int = 0  # draft tokens accepted
    tree_steps: int = 0  # steps that verified a draft tree
    no_tree: collections.Counter = field(default_factory=collections.Counter)  # why the other steps had none
    verifier_has: int = 0  # tokens of the record the verifier holds
    resyncs: int = 0
    kv_reserved: int = 0  # verifier KV slots reserved while running
    done: bool = False
    arrived: float = field(default_factory=time.monotonic)  # when accepted
    last_chunk: float = 0.0  # when its last chunk was produced (0: none yet)
    context: ContextIndex = field(default_factory=ContextIndex)  # its record, indexed for context lookup

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def record(self) -> list[int]:
        return self.request.prompt + self.generated


@dataclass
class Stats:
    """Where the iterations' time went, by (batch size, levels asked of the speculators): e.g. whether
    the few tree steps of a load that mostly decodes plainly cost more than they win."""

    shapes: dict = field(default_factory=dict)  # (batch size, levels) -> [iterations, wall time]
    verify_s: float = 0.0  # of the wall time, the verifier's step
    draft_s: float = 0.0  # of the wall time, the slowest speculator's tree building

    def add(self, batch_size: int, levels: int, busy_s: float, verify_s: float, draft_s: float) -> None:
        shape = self.shapes.setdefault((batch_size, levels), [0, 0.0])
        shape[0] += 1
        shape[1] += busy_s
        self.verify_s += verify_s
        self.draft_s += draft_s

    def summary(self) -> dict:
        iterations = sum(k for k, _ in self.shapes.values())
        busy_s = sum(t for _, t in self.shapes.values())
        n = max(iterations, 1)
        return {"iterations": iterations, "mean_batch": sum(b * k for (b, _), (k, _) in self.shapes.items()) / n,
                "ms_per_iteration": 1e3 * busy_s / n, "verify_ms": 1e3 * self.verify_s / n,
                "draft_ms": 1e3 * self.draft_s / n,
                "overhead_ms": 1e3 * (busy_s - self.verify_s - self.draft_s) / n,
                "by_batch_and_levels": {f"{b}x{m}": {"iterations": k, "ms": round(1e3 * t / k, 2)}
                                        for (b, m), (k, t) in sorted(self.shapes.items())}}


class Scheduler:
    def __init__(self, verifier: VerifierClient, speculators: list[SpeculatorReplicas], eos: set[int],
                 expansion: list[int], tree_budget: int, max_batch: int, max_queue: int,
                 max_prefill_tokens: int, controller: SpeculationController | None = None,
                 kv_tokens: int = 0, kv_block_size: int = 1, lookup: bool = False):
        self.verifier = verifier
        self.speculators = speculators
        self.lookup = lookup and bool(speculators)  # context lookup joins the speculators' trees (source number N)
        self.eos = eos
        self.expansion = expansion
        self.tree_budget = tree_budget
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.controller = controller  # None: always use the server's trees (within the budget)
        self.kv_tokens = kv_tokens  # verifier KV slots this manager may reserve (0: not limited)
        self.kv_block_size = kv_block_size
        self.kv_reserved = 0
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.verifier_release: set[str] = set()
        self.wake = asyncio.Event()
        self.stats = Stats()

    # -- called by the servicer -------------------------------------------------------------
    def submit(self, request: Request, expansion: list[int] | None, want_trees: bool = False) -> Sequence:
        request.id = request.id or uuid.uuid4().hex
        if request.id in self.running or any(s.id == request.id for s in self.waiting):
            raise Abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request.id!r} is already running")
        if len(self.waiting) >= self.max_queue:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"server busy: {len(self.waiting)} requests waiting (max_queue {self.max_queue})")
        seq = Sequence(request, expansion, want_trees)
        if self.kv_tokens and self._kv_need(seq) > self.kv_tokens:
            raise ValueError(f"max_new_tokens: prompt ({len(request.prompt)}) + max_new_tokens "
                             f"({request.max_new_tokens}) + draft tree need {self._kv_need(seq)} KV slots; "
                             f"this manager may reserve {self.kv_tokens} of the verifier's")
        self.waiting.append(seq)
        self.wake.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """The client went away (cancel, deadline): free the request's state everywhere."""
        if seq.done:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.done = True
            metrics.FINISHED.labels("cancelled").inc()
        else:
            self._retire(seq, "cancelled")
        self.wake.set()

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                await self._flush_releases()
                self.wake.clear()
                if not self.running and not self.waiting:
                    await self.wake.wait()
                continue
            try:
                await self.iteration()
            except Exception as e:  # a bug must fail the batch, not hang every stream
                log.exception("iteration failed")
                for seq in list(self.running.values()):
                    self._fail(seq, Abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"))

    async def iteration(self) -> None:
        start = time.perf_counter()
        self._admit()
        batch = list(self.running.values())
        steady = all(s.verifier_has for s in batch)
        full_trees = self._full_trees(len(batch))
        choice = Choice(len(full_trees)) if self.controller is None else self.controller.choose(len(batch), full_trees)
        trees, sources, plans, (levels, nodes) = await self._draft(batch, choice, len(full_trees))
        for s in batch:
            if s.done:  # cancelled while drafting: its draft may have reached a speculator after the release
                for c in self.speculators:
                    c.release(s.id)
        batch = [s for s in batch if not s.done]  # cancelled while drafting: released below
        if not batch:
            return
        checks = [Check(s.id, s.record[s.verifier_has:], len(s.record), trees.get(s.id, TokenTree()),
                        s.request.sampling) for s in batch]
        release = sorted(self.verifier_release)
        self.verifier_release.clear()
        try:
            results, step_ns = await self.verifier.verify(checks, release)
        except VerifierResync as e:
            log.warning("verifier lost request state (%s); resending whole records", e)
            for s in batch:
                s.resyncs += 1
                if s.resyncs > 2:
                    self._fail(s, Abort(grpc.StatusCode.UNAVAILABLE, f"verifier keeps losing state: {e}"))
                else:
                    s.verifier_has = 0
                    self.verifier_release.add(s.id)
            return
        except VerifierUnavailable as e:
            self.verifier_release.update(release)
            for s in batch:
                self._fail(s, Abort(grpc.StatusCode.UNAVAILABLE, str(e)))
            return
        # the slowest speculator's own time this iteration (0: none was asked)
        draft_ns = max((c.draft_ns for c in self.speculators if c.connected), default=0) if levels else 0
        if self.controller is not None and steady:
            on_server = [(s, r) for s, r in zip(batch, results) if s.expansion is None and s.id in plans]
            self.controller.record(Step(
                batch_size=len(batch), choice=choice, rows=sum(len(c.new_tokens) + len(c.tree) for c in checks),
                trees=bool(trees), draft_levels=levels, draft_nodes=nodes,
                seconds=time.perf_counter() - start, verify_s=step_ns / 1e9, draft_s=draft_ns / 1e9,
                accepted=[(len(r) - 1 if s.id in trees else 0, len(plans[s.id])) for s, r in on_server],
                tree_nodes=[len(trees.get(s.id, ())) for s, _ in on_server]))
        now = time.monotonic()
        for s, tokens in zip(batch, results):
            if s.done:  # cancelled while the step ran; already retired
                continue
            s.verifier_has = len(s.record) + len(tokens)
            s.steps += 1
            tree = trees.get(s.id)
            s.tree_steps += tree is not None
            before = len(s.generated)
            reason = append_tokens(s.generated, s.request, tokens, self.eos)
            emitted = s.generated[before:]
            accepted = len(emitted) - (len(emitted) == len(tokens))  # the bonus token is not a draft
            s.accepted += accepted
            metrics.record_step(tree or TokenTree(), len(emitted), accepted, first=not before,
                                since_last=now - (s.last_chunk or s.arrived))
            s.last_chunk = now
            chunk = Chunk(emitted, reason)
            if s.want_trees and tree is not None:
                chunk.tree, chunk.proposers = tree, proposers(tree, sources[s.id])
                chunk.accepted = accepted_nodes(tree, tokens)
            s.events.put_nowait(chunk)
            if reason:
                metrics.E2E.observe(now - s.arrived)
                self._retire(s, reason)
        metrics.BATCH_SIZE.observe(len(batch))
        busy_s = time.perf_counter() - start
        metrics.ITERATION.observe(busy_s)
        self.stats.add(len(batch), levels, busy_s, step_ns / 1e9, draft_ns / 1e9)

    def _admit(self) -> None:
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_batch:
            n = len(self.waiting[0].request.prompt)
            if n > budget and budget < self.max_prefill_tokens:
                break  # this prompt waits for the next iteration's budget
            need = self._kv_need(self.waiting[0])
            if self.kv_tokens and self.kv_reserved + need > self.kv_tokens:
                break  # waits for running requests to free the verifier's KV cache
            seq = self.waiting.popleft()
            self.running[seq.id] = seq
            metrics.QUEUE.observe(time.monotonic() - seq.arrived)
            metrics.PROMPT_TOKENS.inc(n)
            seq.kv_reserved = need
            self.kv_reserved += need
            budget -= n

    def _kv_need(self, seq: Sequence) -> int:
        """Verifier KV slots the request can ever hold, in whole blocks: its whole record plus the
        largest tree the speculators (and context lookup, a chain) can send it (merging unions their trees)."""
        tree = tree_size(seq.expansion) if seq.expansion is not None else min(tree_size(self.expansion), self.tree_budget)
        slots = len(seq.request.prompt) + seq.request.max_new_tokens + tree * (len(self.speculators) + self.lookup)
        return -(-slots // self.kv_block_size) * self.kv_block_size

    def _full_trees(self, batch_size: int) -> list[int]:
        """Nodes of one speculator's tree for each depth of the server's expansion config that fits
        the tree budget at this batch size (the depths the controller may choose from)."""
        fits = fit_expansion(self.expansion, self.tree_budget // max(batch_size, 1))
        return [tree_size(fits[:m]) for m in range(1, len(fits) + 1)]

    def _plan(self, seq: Sequence, choice: Choice) -> list[int]:
        """The request's expansion config this step: its own if fixed, else the server's first
        `choice.depth` levels (a chain of that many tokens for lookup alone)."""
        expansion = self.expansion[: choice.depth] if seq.expansion is None else seq.expansion
        # never draft past max_new_tokens: a step emits the accepted path plus one bonus token
        return expansion[: max(0, seq.request.max_new_tokens - len(seq.generated) - 1)]

    def _why_no_plan(self, seq: Sequence, batch_size: int, fits: int) -> str:
        """Why `_plan` gave the request no tree this step, in words for its usage report (`fits`:
        how many levels of the server's expansion the tree budget allows at this batch size)."""
        if seq.expansion == []:
            return "speculation off for this request"
        if seq.request.max_new_tokens - len(seq.generated) <= 1:
            return "the last token needs no draft"
        if not self.expansion:
            return "the server's default expansion is empty"
        if not fits:
            return (f"the tree budget ({self.tree_budget} nodes) over {batch_size} requests is smaller than the "
                    f"expansion's first level ({self.expansion[0]})")
        return f"the manager's cost model predicts plain decoding faster at batch size {batch_size}"

    def _asks(self, seq: Sequence, choice: Choice) -> bool:
        """Whether the speculators draft for the request this step: always for a fixed expansion (the
        server's choice is for the server's trees), else when the server's choice uses them."""
        return choice.speculators or seq.expansion is not None

    async def _draft(self, batch: list[Sequence], choice: Choice, fits: int) -> tuple[
            dict[str, TokenTree], dict[str, dict[int, TokenTree]], dict[str, list[int]], tuple[int, int]]:
        """Each request's merged draft tree (none for a request that gets no tree this step), for
        requests that asked for their trees the trees it merged by speculator number (context
        lookup's: the number after the speculators'), the expansion config each drafted request
        was planned, and the deepest tree asked of the speculators (0: they were not asked) with the
        nodes asked of them in all."""
        drafting = []
        for s in batch:
            if plan := self._plan(s, choice):
                drafting.append((s, Draft(s.id, s.record, plan, s.request.sampling)))
            else:
                s.no_tree[self._why_no_plan(s, len(batch), fits)] += 1
        if not drafting or not self.speculators:
            for s, _ in drafting:
                s.no_tree["no speculators configured"] += 1
            return {}, {}, {}, (0, 0)
        asked = [d for s, d in drafting if self._asks(s, choice)]
        answers = ([{}] * len(self.speculators) if not asked  # context lookup alone: no RPC
                   else await asyncio.gather(*(c.draft(asked) for c in self.speculators)))
        merged, sources = {}, {}
        for s, d in drafting:
            trees = {i: a[s.id] for i, a in enumerate(answers) if len(a.get(s.id, ())) > 0}
            if self.lookup:
                s.context.extend(d.record[len(s.context.tokens):])
                if chain := s.context.draft(len(d.expansion)):
                    trees[len(answers)] = chain_tree(chain, s.request.sampling.sampled_drafts)
            if not trees:
                s.no_tree["no speculator sent a tree in time" if self._asks(s, choice)
                          else "context lookup found no earlier occurrence to continue"] += 1
                continue
            merged[s.id] = next(iter(trees.values())) if len(trees) == 1 else merge(list(trees.values()))
            if s.want_trees:
                sources[s.id] = trees
        asked_for = (max((len(d.expansion) for d in asked), default=0), sum(tree_size(d.expansion) for d in asked))
        return merged, sources, {s.id: d.expansion for s, d in drafting}, asked_for

    def _retire(self, seq: Sequence, reason: str) -> None:
        """End a running request: `reason` is its finish reason, "cancelled" or "failed"."""
        if seq.done:  # e.g. cancelled while the step that then failed was running
            return
        metrics.FINISHED.labels(reason).inc()
        seq.done = True
        self.kv_reserved -= seq.kv_reserved
        seq.kv_reserved = 0
        if self.running.pop(seq.id, None) is not None:
            self.verifier_release.add(seq.id)  # it may be in a verify call right now
        for c in self.speculators:
            c.release(seq.id)

    def _fail(self, seq: Sequence, error: Abort) -> None:
        seq.events.put_nowait(error)
        self._retire(seq, "failed")

    async def _flush_releases(self) -> None:
        if self.verifier_release:
            ids = sorted(self.verifier_release)
            self.verifier_release.clear()
            try:
                await self.verifier.release(ids)
            except VerifierUnavailable:
                pass  # a verifier that is down holds nothing
        await asyncio.gather(*(c.flush() for c in self.speculators))
