"""Iteration-level continuous batching (DESIGN section 5) around the core's speculative iteration
(specinfer/engine.py), which owns every request's token record.

Each iteration:
  1. admit waiting requests up to the batch size, the prefill token budget and the verifier's KV
     cache: each running request reserves the slots it can ever hold there (prompt +
     max_new_tokens + its largest merged draft tree, in whole blocks), so a step never finds the
     verifier's pool full and nothing admitted has to be dropped;
  2. run the engine's iteration over the running requests (plan, draft on the speculator
     services, merge, verify on the verifier service, commit);
  3. stream each request's chunk, retire finished requests and release their state on every
     service (piggybacked on the next messages, or sent at once when idle).

Nothing here runs a model or speaks a wire format: the event loop moves token IDs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from specinfer.engine import Request, Sequence, SpeculativeEngine
from specinfer.errors import AlreadyRunning, Failed, Overloaded
from specinfer.tree import TokenTree

from . import metrics

log = logging.getLogger("specinfer.manager")


@dataclass(eq=False)
class Stream(Sequence):
    """A request as the manager serves it: the engine's sequence, its stream's queue and what it reserved."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk or Exception, for the stream
    kv_reserved: int = 0  # verifier KV slots reserved while running
    arrived: float = field(default_factory=time.monotonic)  # when accepted
    last_chunk: float = 0.0  # when its last chunk was produced (0: none yet)
    posted: int = 0  # events in the scheduler's outbox, not yet in `events`

    @property
    def unread(self) -> int:
        return self.events.qsize() + self.posted


class SlowReader(Overloaded):
    """A stream's client left too many chunks unread: the request was cancelled (RESOURCE_EXHAUSTED)."""


class Scheduler:
    def __init__(self, engine: SpeculativeEngine, max_batch: int, max_queue: int, max_prefill_tokens: int,
                 kv_tokens: int = 0, kv_block_size: int = 1, max_unread: int = 0):
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_unread = max_unread  # chunks a stream may hold that its client has not read (0: no cap)
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_tokens = kv_tokens  # verifier KV slots this manager may reserve (0: not limited)
        self.kv_block_size = kv_block_size
        self.kv_reserved = 0
        self.waiting: deque[Stream] = deque()
        self.running: dict[str, Stream] = {}
        self.wake = asyncio.Event()
        self.outbox: list[tuple[Stream, object]] = []  # events for the streams, delivered on the loop's next pass

    # -- called by the servicer -------------------------------------------------------------
    def submit(self, request: Request, expansion: list[int] | None, want_trees: bool = False) -> Stream:
        request.id = request.id or uuid.uuid4().hex
        if request.id in self.running or any(s.id == request.id for s in self.waiting):
            raise AlreadyRunning(f"request_id: {request.id!r} is already running")
        if len(self.waiting) >= self.max_queue:
            raise Overloaded(f"server busy: {len(self.waiting)} requests waiting (max_queue {self.max_queue})")
        seq = Stream(request, expansion, want_trees)
        if self.kv_tokens and self._kv_need(seq) > self.kv_tokens:
            raise ValueError(f"max_new_tokens: prompt ({len(request.prompt)}) + max_new_tokens "
                             f"({request.max_new_tokens}) + draft tree need {self._kv_need(seq)} KV slots; "
                             f"this manager may reserve {self.kv_tokens} of the verifier's")
        seq.constraint = self.engine.constraint(request)  # a grammar that does not compile: refused here
        self.waiting.append(seq)
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
                                since_last=now - (s.last_chunk or s.arrived))
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

    def _admit(self) -> None:
        budget = self.max_prefill_tokens
        # a prompt that starts like one admitted now waits one iteration: then the verifier gives it
        # the blocks the first one's prefill holds (n choices of a prompt, a shared system prompt)
        # instead of computing them again in the same step
        prefilled = {self._lead(s) for s in self.running.values() if s.steps} if self.waiting else set()
        fresh = set()
        while self.waiting and len(self.running) < self.max_batch:
            n = len(self.waiting[0].request.prompt)
            if n > budget and budget < self.max_prefill_tokens:
                break  # this prompt waits for the next iteration's budget
            lead = self._lead(self.waiting[0])
            if lead is not None and lead in fresh:
                break  # it will share the prefill of one admitted now
            if lead is not None and lead not in prefilled:
                fresh.add(lead)
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

    def _kv_need(self, seq: Stream) -> int:
        """Verifier KV slots the request can ever hold, in whole blocks: its whole record plus the
        largest merged draft tree it can be sent."""
        slots = len(seq.request.prompt) + seq.request.max_new_tokens + self.engine.max_tree(seq)
        return -(-slots // self.kv_block_size) * self.kv_block_size

    def _retire(self, seq: Stream, reason: str) -> None:
        """End a running request: `reason` is its finish reason, "cancelled" or "failed"."""
        if seq.done:  # e.g. cancelled while the step that then failed was running
            return
        metrics.FINISHED.labels(reason).inc()
        seq.done = True
        self.kv_reserved -= seq.kv_reserved
        seq.kv_reserved = 0
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

