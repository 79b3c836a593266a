"""Iteration-level continuous batching (DESIGN section 5) around the core's speculative iteration
(specinfer/engine.py), which owns every request's token record.

Each iteration:
  1. admit waiting requests, best first, up to the batch size, the prefill token budget and the
     verifier's KV cache as it is now: a request takes blocks as it grows, so admission counts the
     blocks each running request's next step can hold (its record and its largest merged draft
     tree) and keeps a watermark free for their growth, not what their max_new_tokens could reach;
  2. make room: when the running requests' next steps would not fit the verifier's pool, preempt
     (lowest priority first, then the newest) until they do; and when requests wait for a full
     batch, a waiting request takes the place of a running one that ranks below it (`rank`);
  3. run the engine's iteration over the running requests (plan, draft on the speculator
     services, merge, verify on the verifier service, commit);
  4. stream each request's chunk, retire finished requests and release their state on every
     service (piggybacked on the next messages, or sent at once when idle).

Preemption is by recompute (vLLM's default): the request's state is released on every service,
its record (prompt + output so far) stays here, and it goes back to the waiting requests; when it
is admitted again its next step prefills the whole record, most of it found in the verifier's prefix
cache (its full blocks stay there until evicted), and it goes on. Its stream only waits: the tokens
are exactly those it would have had, since a seeded draw depends on the position, not the batch.
Swapping KV blocks to host memory instead would spare the recompute on a GPU, at the cost of a copy
per block each way and host memory to manage; with the prefix cache a resumed request recomputes
only its last partial block unless its blocks were evicted, so recompute is the one mechanism here.

Fair turns: waiting requests are ranked by (priority, turns, arrival), where turns counts the
`turn_tokens` its output already holds; a request that waits for a full batch preempts the running
request of the worst rank when that rank is worse than its own. So a short request waits for no
long one beyond its first `turn_tokens` tokens, long requests take turns, and a request is
preempted for another only when the other has had at least a turn less (no thrashing).

Nothing here runs a model or speaks a wire format: the event loop moves token IDs.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

from specinfer.engine import Request, Sequence, SpeculativeEngine
from specinfer.errors import AlreadyRunning, Failed, Overloaded
from specinfer.tree import TokenTree

from . import metrics

log = logging.getLogger("specinfer.manager")


ARRIVALS = itertools.count()  # the order requests were accepted in


@dataclass(eq=False)
class Stream(Sequence):
    """A request as the manager serves it: the engine's sequence and its stream's queue."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk or Exception, for the stream
    arrived: float = field(default_factory=time.monotonic)  # when accepted
    order: int = field(default_factory=lambda: next(ARRIVALS))
    max_tree: int = 0  # the most nodes its merged draft tree can have (SpeculativeEngine.max_tree)
    last_chunk: float = 0.0  # when its last chunk was produced (0: none yet)
    posted: int = 0  # events in the scheduler's outbox, not yet in `events`

    @property
    def unread(self) -> int:
        return self.events.qsize() + self.posted


class SlowReader(Overloaded):
    """A stream's client left too many chunks unread: the request was cancelled (RESOURCE_EXHAUSTED)."""


class Scheduler:
    def __init__(self, engine: SpeculativeEngine, max_batch: int, max_queue: int, max_prefill_tokens: int,
                 kv_tokens: int = 0, kv_block_size: int = 1, max_unread: int = 0, kv_watermark: float = 0.01,
                 turn_tokens: int = 0):
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_unread = max_unread  # chunks a stream may hold that its client has not read (0: no cap)
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_block_size = kv_block_size
        self.kv_blocks = kv_tokens // kv_block_size  # verifier KV blocks this manager may use (0: not limited)
        self.kv_watermark = int(kv_watermark * self.kv_blocks)  # blocks admission leaves free for growth
        self.turn_tokens = turn_tokens  # a fair turn (0: waiting requests preempt only for priority)
        self.waiting: list[Stream] = []  # best rank first
        self.running: dict[str, Stream] = {}
        self.wake = asyncio.Event()
        self.outbox: list[tuple[Stream, object]] = []  # events for the streams, delivered on the loop's next pass

    # -- called by the servicer -------------------------------------------------------------
    def submit(self, request: Request, expansion: list[int] | None, want_trees: bool = False,
               fit_max_new_tokens: bool = False) -> Stream:
        """Accept a request (ValueError names a bad field). fit_max_new_tokens: the client left it
        unset, so at most what the verifier's pool can hold beside the prompt."""
        request.id = request.id or uuid.uuid4().hex
        if request.id in self.running or any(s.id == request.id for s in self.waiting):
            raise AlreadyRunning(f"request_id: {request.id!r} is already running")
        if len(self.waiting) >= self.max_queue:
            raise Overloaded(f"server busy: {len(self.waiting)} requests waiting (max_queue {self.max_queue})")
        seq = Stream(request, expansion, want_trees)
        seq.max_tree = tree = self.engine.max_tree(seq)
        if self.kv_blocks:  # alone it must fit, at its longest
            room = self.kv_blocks * self.kv_block_size - tree - len(request.prompt)
            if fit_max_new_tokens:
                request.max_new_tokens = min(request.max_new_tokens, room)
            if request.max_new_tokens > room:
                raise ValueError(f"max_new_tokens: prompt ({len(request.prompt)}) + max_new_tokens "
                                 f"({request.max_new_tokens}) + draft tree ({tree}) are more KV slots than the "
                                 f"{self.kv_blocks * self.kv_block_size} this manager may use of the verifier's")
        seq.constraint = self.engine.constraint(request)  # a grammar that does not compile: refused here
        self._wait(seq)
        self.wake.set()
        return seq

    def cancel(self, seq: Stream) -> None:
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
                await self.engine.flush()
                self.wake.clear()
                if not self.running and not self.waiting:
                    await self.wake.wait()
                continue
            try:
                await self.iteration()
            except Exception as e:  # a bug must fail the batch, not hang every stream
                log.exception("iteration failed")
                for seq in list(self.running.values()):
                    self._fail(seq, Failed(f"internal error: {type(e).__name__}: {e}"))

    async def iteration(self) -> None:
        start = time.perf_counter()
        self._admit()
        self._make_room()
        batch = list(self.running.values())
        events = await self.engine.iteration(batch)
        now = time.monotonic()
        for s, event in events:
            if s.done:  # cancelled meanwhile; already retired
                continue
            if isinstance(event, Exception):
                self._fail(s, event)
                continue
            metrics.record_step(event.tree or TokenTree(), len(event.tokens), event.accepted, first=s.steps == 1,
                                since_last=now - (s.last_chunk or s.arrived), drafters=event.drafters,
                                speculators=len(self.engine.drafters))
            if s.steps == 1:
                metrics.CACHED_TOKENS.inc(s.cached_tokens)
            s.last_chunk = now
            if self.max_unread and s.unread >= self.max_unread:
                # what is queued stays for the client to read, then this status: its memory is bounded
                self._fail(s, SlowReader(f"stream: the client left {s.unread} chunks unread "
                                         f"(max_unread_chunks {self.max_unread}); the request was cancelled"))
                continue
            self._post(s, event)
            if event.finish_reason:
                metrics.E2E.observe(now - s.arrived)
                self._retire(s, event.finish_reason)
        metrics.BATCH_SIZE.observe(len(batch))
        metrics.ITERATION.observe(time.perf_counter() - start)

    def _lead(self, seq: Stream) -> tuple[int, ...] | None:
        """The prompt's first KV block, if the verifier could share it (a prompt longer than a block)."""
        prompt = seq.request.prompt
        return tuple(prompt[: self.kv_block_size]) if len(prompt) > self.kv_block_size else None

    # -- ranks, blocks, preemption ------------------------------------------------------------
    def rank(self, seq: Stream) -> tuple[int, int, int]:
        """Who goes first (lower first): priority, then fair turns taken, then arrival."""
        turns = len(seq.generated) // self.turn_tokens if self.turn_tokens else 0
        return seq.request.priority, turns, seq.order

    def _wait(self, seq: Stream) -> None:
        bisect.insort(self.waiting, seq, key=self.rank)

    def _blocks(self, seq: Stream) -> int:
        """Verifier KV blocks the request's next step can hold: its record and its largest merged
        draft tree, or the one token of a plain step the engine sent ahead (blocks on demand: what it
        holds now, not what it may grow to)."""
        return -(-(seq.length + max(seq.max_tree, int(self.engine.steps_ahead))) // self.kv_block_size)

    @property
    def kv_used(self) -> int:
        """Blocks the running requests' next steps can hold (shared prefix blocks counted per holder:
        an upper bound, so a step never finds the verifier's pool full)."""
        return sum(self._blocks(s) for s in self.running.values())

    def _preempt(self, seq: Stream, why: str) -> None:
        """Free the request's state everywhere and put it back among the waiting requests; it
        resumes from its record, which stays here."""
        del self.running[seq.id]
        self.engine.preempt(seq)
        metrics.PREEMPTIONS.labels(why).inc()
        self._wait(seq)

    def _make_room(self) -> None:
        """Preempt until the running requests' next steps fit the verifier's pool: lowest priority
        first, then the newest. A request alone always fits (submit)."""
        if not self.kv_blocks:
            return
        used = self.kv_used
        while used > self.kv_blocks and len(self.running) > 1:
            victim = max(self.running.values(), key=lambda s: (s.request.priority, s.order))
            used -= self._blocks(victim)
            self._preempt(victim, "memory")
        metrics.KV_BLOCKS.set(used)

    def _take_turns(self) -> None:
        """While requests wait for a full batch, the best waiting one takes the place of the worst
        running one if that one ranks below it, and its blocks make room for it."""
        while self.waiting and len(self.running) >= self.max_batch:
            head = self.waiting[0]
            victim = max(self.running.values(), key=self.rank)
            if self.rank(victim)[:2] <= self.rank(head)[:2]:
                return
            if self.kv_blocks and (self.kv_used - self._blocks(victim) + self._blocks(head)
                                   > self.kv_blocks - self.kv_watermark):
                return  # it would not be admitted even then
            self._preempt(victim, "priority" if victim.request.priority > head.request.priority else "turn")

    def _admit(self) -> None:
        self._take_turns()
        budget = self.max_prefill_tokens
        # a prompt that starts like one admitted now waits one iteration: then the verifier gives it
        # the blocks the first one's prefill holds (n choices of a prompt, a shared system prompt)
        # instead of computing them again in the same step
        prefilled = {self._lead(s) for s in self.running.values() if s.steps} if self.waiting else set()
        fresh = set()
        free = self.kv_blocks - self.kv_used - self.kv_watermark
        while self.waiting and len(self.running) < self.max_batch:
            head = self.waiting[0]
            n = head.length  # a preempted request prefills its whole record again
            if self.engine.prefill_chunk:
                n = min(n, self.engine.prefill_chunk)  # the rest comes in the next iterations' steps
            if n > budget and budget < self.max_prefill_tokens:
                break  # this prompt waits for the next iteration's budget
            lead = self._lead(head)
            if lead is not None and lead in fresh:
                break  # it will share the prefill of one admitted now
            if lead is not None and lead not in prefilled:
                fresh.add(lead)
            need = self._blocks(head)
            if self.kv_blocks and need > free and self.running:
                break  # waits for running requests to free the verifier's KV cache
            seq = self.waiting.pop(0)
            self.running[seq.id] = seq
            if not seq.preemptions:
                metrics.QUEUE.observe(time.monotonic() - seq.arrived)
                metrics.PROMPT_TOKENS.inc(len(seq.request.prompt))
            free -= need
            budget -= n

    def _retire(self, seq: Stream, reason: str) -> None:
        """End a running request: `reason` is its finish reason, "cancelled" or "failed"."""
        if seq.done:  # e.g. cancelled while the step that then failed was running
            return
        metrics.FINISHED.labels(reason).inc()
        seq.done = True
        if self.running.pop(seq.id, None) is not None:
            self.engine.release(seq.id)  # it may be in a verify call right now: released with the next

    def _fail(self, seq: Stream, error: Exception) -> None:
        self._post(seq, error)
        self._retire(seq, "failed")

    def _post(self, seq: Stream, event) -> None:
        """Queue an event for its stream one pass of the event loop later. The loop runs its ready
        work in order, and a gRPC call starts as a task of its own: so the next iteration's calls
        to the speculators and the verifier start before the streams' writes to their clients,
        which then overlap the step instead of delaying it."""
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self._deliver)
        self.outbox.append((seq, event))
        seq.posted += 1

    def _deliver(self) -> None:
        outbox, self.outbox = self.outbox, []
        for seq, event in outbox:
            seq.posted -= 1
            seq.events.put_nowait(event)

