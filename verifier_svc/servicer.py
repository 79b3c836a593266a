"""Thin gRPC adapter over the core `Verifier`: protobuf in, one batched LLM step, token IDs out.

Model compute runs on one worker thread, never on the event loop, so health checks and releases
are answered while a step runs; the caches are only touched from that thread. The verifier is a
core `Verifier`, or a `ParallelVerifier` (rank 0 of a tensor/pipeline-parallel group) with the
same interface.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter, Gauge, Histogram

from specinfer.acceptance import Verdict
from specinfer.verifier import Begun, Verifier, VerifyRequest, stepped, with_skipped
from specinfer_rpc.convert import allowed_from_pb, sampling_from_pb, tree_from_pb, validated
from specinfer_rpc.model_convert import features_to_pb, logprobs_to_pb
from specinfer_rpc.metrics import LATENCY_BUCKETS, SIZE_BUCKETS
from specinfer_rpc.model_thread import ModelThread
from specinfer_rpc.server import Abort, rpc_errors
from specinfer_rpc.v1 import verifier_pb2, verifier_pb2_grpc

from .workers import RankFailed

STEP_SECONDS = Histogram("specinfer_verifier_step_seconds", "one batched verify step (tree decoding, "
                         "verification, KV commit)", buckets=LATENCY_BUCKETS)
STEP_TOKENS = Histogram("specinfer_verifier_step_tokens", "tokens through the LLM in one step (new tokens + tree nodes)",
                        buckets=SIZE_BUCKETS + (512, 1024, 2048, 4096, 8192))
BEHIND = Counter("specinfer_verifier_steps_begun_behind_total", "steps begun on the device behind a running step, "
                 "before its verdicts were read (--overlap)")
IDLE = Histogram("specinfer_verifier_idle_seconds", "per request, from the end of its step to the beginning of its "
                 "next one (0 where the next began behind it, on the device before its verdicts were read), by what "
                 "the next step was: plain (no tree), miss (a tree drafted after the verdict), hit (a tree drafted "
                 "ahead, during the step before)", ["next"],
                 buckets=(.0001, .00025, .0005, .001, .002, .005, .01, .02, .05, .1, .25, 1))
REQUESTS = Gauge("specinfer_verifier_requests", "requests with a KV cache here")
KV_FREE = Gauge("specinfer_kv_cache_free_tokens", "free token slots in the paged KV cache pool (the prefix "
                "cache's included: evicted when a step needs them)")
KV_CACHED = Gauge("specinfer_kv_cache_cached_tokens", "token slots the prefix cache holds (finished requests' full blocks)")
PREFIX_QUERIED = Gauge("specinfer_prefix_cache_queried_tokens", "new requests' tokens looked up in the prefix index "
                       "(hit rate = specinfer_prefix_cache_hit_tokens / this)")
PREFIX_HITS = Gauge("specinfer_prefix_cache_hit_tokens", "of those, the tokens whose KV entries were found there")
KV_TOTAL = Gauge("specinfer_kv_cache_tokens", "token slots in the paged KV cache pool")


def _settled(work: asyncio.Future) -> None:
    """A model-thread job ended: its error is read (no "never retrieved" log for a step whose stream
    is gone), and a model-parallel rank that is gone stops the service, so that the group restarts whole
    (the call that awaited it answers UNAVAILABLE first)."""
    if not work.cancelled() and isinstance(work.exception(), RankFailed):
        os.kill(os.getpid(), signal.SIGTERM)


def verify_requests(request: verifier_pb2.VerifyRequest, vocab_size: int) -> list[VerifyRequest]:
    """A step message's items as the verifier takes them; ValueError naming the field that is wrong."""
    batch = [VerifyRequest(item.request_id, list(item.new_token_ids), tree_from_pb(item.tree),
                           validated(sampling_from_pb(item.sampling)), item.return_features,
                           item.return_logprobs, item.return_prompt_logprobs, item.top_logprobs,
                           allowed_from_pb(item.allowed, vocab_size, f"allowed (request {item.request_id})")
                           if item.HasField("allowed") else None, item.prefill_only, item.output_start,
                           tuple(item.stop_token_ids), item.record_length if item.follows_outcome else None,
                           [(tuple(c.outcome), tree_from_pb(c.tree)) for c in item.candidates])
             for item in request.items]
    for item in request.items:
        if item.candidates and not item.follows_outcome:
            raise ValueError(f"candidates (request {item.request_id}): only a step that follows_outcome has them")
        if item.follows_outcome and (item.new_token_ids or item.tree.token_ids):
            raise ValueError(f"candidates (request {item.request_id}): a step that follows_outcome takes no "
                             f"new_token_ids or tree of its own")
    if len({req.request_id for req in batch}) != len(batch):
        raise ValueError("items: request ids must be unique within a batch")
    return batch


def kinds(request: verifier_pb2.VerifyRequest) -> list[bool]:
    """Whether each item's tree, if it has one, was drafted during the step before (for IDLE: `kind`)."""
    return [item.predrafted or item.follows_outcome for item in request.items]


def kind(req: VerifyRequest, predrafted: bool) -> str:
    """What a step is once its tree is known (`Verifier.resolve`), for IDLE: plain, or a tree drafted after
    the verdict before it (miss) or during that step (hit)."""
    return ("hit" if predrafted else "miss") if len(req.tree) else "plain"


def verify_response(batch: list[VerifyRequest], verdicts: list[Verdict], step_ns: int) -> verifier_pb2.VerifyResponse:
    """The step's answer: each request's verdict, and the step's own time."""
    return verifier_pb2.VerifyResponse(
        results=[verifier_pb2.VerifyResult(request_id=r.request_id, token_ids=v.tokens,
                                           features=features_to_pb(v.features) if v.features else None,
                                           logprobs=logprobs_to_pb(v.logprobs or []),
                                           prompt_logprobs=logprobs_to_pb(v.prompt_logprobs or []),
                                           cached_tokens=v.cached_tokens, candidate=r.chosen + 1)
                 for r, v in zip(batch, verdicts)],
        step_ns=step_ns)


@dataclass
class _Lane:
    """One VerifyStream: its answers in order, and the step it left running on the model thread."""

    loop: asyncio.AbstractEventLoop
    answers: asyncio.Queue = field(default_factory=asyncio.Queue)
    room: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(3))  # messages read and not answered
    sent: int = 0  # messages queued on the model thread
    running: Begun | None = None  # (model thread) begun and not ended
    ended_ns: int = 0  # (model thread) when its last step ended (perf_counter_ns)
    closed: bool = False  # the stream ended: messages still queued are not run
    whole: dict[int, list[VerifyRequest]] = field(default_factory=dict)  # a step's batch with those it skipped


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, verifier: Verifier, model_name: str, idle_timeout: float, thread: ModelThread,
                 overlap: bool = False):
        """overlap: a stream's step is left running on the device, for the next one to begin behind it
        (`Verifier.follows`; only a verifier that `chains`)."""
        self.verifier = verifier
        self.model_name = model_name
        self.idle_timeout = idle_timeout  # a request untouched this long is freed (its manager is gone)
        self.last_used: dict[str, float] = {}
        self.thread = thread  # the one thread that touches the model and the caches
        self.overlap = overlap and getattr(verifier, "chains", False)
        self.running: dict[int, tuple[_Lane, Begun]] = {}  # (model thread) the streams' steps left running
        self.ended: dict[str, int] = {}  # (model thread) request -> when its last step ended (perf_counter_ns)
        self.streams = 0  # VerifyStreams open (each a manager's)
        self.waits = ModelThread("verifier-waits", 0, verifier.model.device)  # waits for a running step's
        # decision on the GPU (`_watch`), with the model's device current
        pool = verifier.pool
        REQUESTS.set_function(lambda: len(self.verifier.caches))
        KV_FREE.set_function(lambda: pool.available * pool.block_size)
        KV_CACHED.set_function(lambda: len(pool.cached) * pool.block_size)
        PREFIX_QUERIED.set_function(lambda: pool.queried_tokens)
        PREFIX_HITS.set_function(lambda: pool.hit_tokens)
        KV_TOTAL.set(pool.n_blocks * pool.block_size)

    async def _on_worker(self, fn, *args):
        return await self._answer(self._submit(fn, *args))

    def _submit(self, fn, *args) -> asyncio.Future:
        """Queue fn on the model thread; its future. A step whose answer nobody awaits any more (its
        stream ended) still settles quietly, and a rank that failed in it still stops the service."""
        work = self.thread.submit(fn, *args)
        work.add_done_callback(_settled)
        return work

    @staticmethod
    async def _answer(work: asyncio.Future):
        try:
            return await work
        except RankFailed as e:  # a model-parallel rank is gone (the service stops: _settled)
            raise Abort(grpc.StatusCode.UNAVAILABLE, str(e)) from e

    @rpc_errors
    async def Verify(self, request: verifier_pb2.VerifyRequest, context) -> verifier_pb2.VerifyResponse:
        batch = verify_requests(request, self.verifier.model.cfg.vocab_size)
        lengths = [item.record_length for item in request.items]
        return self._response(*await self._on_worker(self._step, list(request.release), batch, lengths, kinds(request)))

    @rpc_errors
    async def VerifyStream(self, requests, context):
        """Steps answered in order. Each message is read, and its step queued on the model thread,
        while the steps before it run: a step the manager sent ahead starts the moment the one before
        ends, and with `overlap` it begins on the device behind that one before its verdicts are read
        (`Verifier.follows`), so that a GPU does not wait for the host between them."""
        lane = _Lane(asyncio.get_running_loop())
        reader = asyncio.ensure_future(self._read_all(requests, lane))
        self.streams += 1
        try:
            while (answer := await lane.answers.get()) is not None:
                lane.room.release()
                if isinstance(answer, RankFailed):  # a model-parallel rank is gone (the service stops: _settled)
                    raise Abort(grpc.StatusCode.UNAVAILABLE, str(answer))
                if isinstance(answer, Exception):  # a message that is wrong: the stream's status, in its turn
                    raise answer
                yield self._response(*answer)
        finally:  # the stream ended (an error, the manager went away): the steps not begun are not run
            self.streams -= 1
            reader.cancel()
            lane.closed = True
            self._submit(self._close, lane)

    async def _read_all(self, requests, lane: "_Lane") -> None:
        end = None
        try:
            async for request in requests:
                batch = verify_requests(request, self.verifier.model.cfg.vocab_size)
                await lane.room.acquire()
                lane.sent += 1
                work = self._submit(self._advance, lane, list(request.release), batch,
                                    [item.record_length for item in request.items], kinds(request))
                work.add_done_callback(functools.partial(self._watch, lane, lane.sent))
        except Exception as e:  # noqa: BLE001 (a wrong message, bytes that do not parse: the stream's end)
            end = e
        self._submit(self._close, lane, None, end)

    def _watch(self, lane: "_Lane", sent: int, work: asyncio.Future) -> None:
        """A step left running with no message read after it: end it once its decision is done on the
        device, unless a step began behind it meanwhile (`_close` then finds it gone)."""
        if work.cancelled() or work.exception() is not None or (begun := work.result()) is None or lane.sent > sent:
            return
        if begun.ready is None:  # nothing runs on its own (a CPU's step is done when it is begun)
            self._submit(self._close, lane, begun)
            return
        done = self.waits.submit(begun.ready.synchronize)
        done.add_done_callback(lambda _: lane.closed or self._submit(self._close, lane, begun))

    # on the model thread:

    def _step(self, release: list[str], batch: list[VerifyRequest], lengths: list[int], kinds: list[bool]):
        """A step begun and ended: its batch, its verdicts and its time (ns)."""
        start = time.perf_counter_ns()
        self._admit(release + self._stale(), batch, lengths, None)
        self.verifier.resolve(batch)
        self._idle(batch, kinds, None)
        verdicts = self.verifier.step(batch)
        end = time.perf_counter_ns()
        self.ended.update((req.request_id, end) for req in stepped(batch))
        return batch, verdicts, end - start

    def _advance(self, lane: "_Lane", release: list[str], batch: list[VerifyRequest], lengths: list[int],
                 kinds: list[bool]) -> Begun | None:
        """The message's step: without `overlap`, run; with it, begun behind the lane's running step if
        it may follow it (which then ends), else after that one ends, and left running: unless ending
        it reads its logits, or every request of it verifies a tree (no request gets the one token a
        plain step could begin behind: its manager waits for the answer before it sends more) and no
        other manager's stream is open (whose steps the model thread must not stop launching while it
        waits); such a step is waited for here, sparing its answer the hops through the waiting thread
        and back. Returns the step left running."""
        if lane.closed:
            return None
        if not self.overlap:
            try:
                self._put(lane, self._step(release, batch, lengths, kinds))
            except Exception as e:
                self._put(lane, e)
                raise
            return None
        start = time.perf_counter_ns()
        running, lane.running = lane.running, None
        released = release + self._stale()
        after = running if running is not None and self.verifier.follows(running, batch, released) else None
        if running is not None and after is None:
            self._end(lane, running)  # (an error there is on the stream already)
        try:
            self._admit(released, batch, lengths, after)
            self.verifier.resolve(batch)  # (a step that follows an outcome never begins behind it: `follows`)
            self._idle(batch, kinds, after)
            run = stepped(batch)
            if not run:  # every request skipped (none of their outcomes drafted for): nothing runs
                self._put(lane, (batch, with_skipped(batch, []), 0))
                return None
            begun = self.verifier.begin(run, after)
            if len(run) < len(batch):
                lane.whole[id(begun)] = batch
        except Exception as e:
            if after is not None:  # the step it was to follow ends first
                self._end(lane, after)
            self._put(lane, e)
            raise
        begun.started_ns = start
        if after is not None:
            BEHIND.inc()
            try:
                self._end(lane, after)
            except Exception:  # (its stream has the error) what began behind it is not to be trusted either
                for req in begun.batch:
                    self.verifier.release(req.request_id)
                raise
        if begun.reads_rows or (not begun.passes and self.streams <= 1):
            self._end(lane, begun)
            return None
        lane.running = begun
        self.running[id(begun)] = lane, begun
        return begun

    def _close(self, lane: "_Lane", begun: Begun | None = None, end: Exception | None | bool = False) -> None:
        """End the lane's running step (only if it is `begun`, when given: a later message may have
        taken its place); then, unless `end` is False, the stream's last answer: None or an error."""
        if lane.running is not None and (begun is None or lane.running is begun):
            running, lane.running = lane.running, None
            self._end(lane, running)
        if end is not False:
            self._put(lane, end)

    def _end(self, lane: "_Lane", begun: Begun) -> None:
        self.running.pop(id(begun), None)
        try:
            verdicts = self.verifier.end(begun)
        except Exception as e:
            self._put(lane, e)
            raise
        # its time: from its begin, or from the end of the step it began behind, to its end (what it adds)
        now = time.perf_counter_ns()
        batch = lane.whole.pop(id(begun), begun.batch)  # with the requests it skipped
        self._put(lane, (batch, with_skipped(batch, verdicts), now - max(begun.started_ns, lane.ended_ns)))
        lane.ended_ns = now
        self.ended.update((req.request_id, now) for req in begun.batch)

    def _idle(self, batch: list[VerifyRequest], predrafted: list[bool], after: Begun | None) -> None:
        """The verifier's wait for each request's step now beginning (IDLE), where it had a step before."""
        now = time.perf_counter_ns()
        behind = {req.request_id for req in after.batch} if after is not None else ()
        for req, ahead in zip(batch, predrafted):
            if not req.skipped and (ended := self.ended.get(req.request_id)) is not None:
                IDLE.labels(next=kind(req, ahead)).observe(0.0 if req.request_id in behind
                                                           else max(0, now - ended) / 1e9)

    @staticmethod
    def _put(lane: "_Lane", answer) -> None:
        """The stream's next answer: (batch, verdicts, step ns), an error, or None (no more)."""
        lane.loop.call_soon_threadsafe(lane.answers.put_nowait, answer)

    def _stale(self) -> list[str]:
        """Requests no step touched for `idle_timeout` (their manager is gone), but those in a running step."""
        now = time.monotonic()
        stale = [rid for rid, t in self.last_used.items() if now - t > self.idle_timeout]
        if not stale or not self.running:
            return stale
        busy = {r.request_id for _, b in self.running.values() for r in b.batch}
        return [rid for rid in stale if rid not in busy]

    def _end_holding(self, request_ids: set[str], spare: Begun | None = None) -> None:
        """End the running steps (but `spare`) that hold any of these requests, their answers to their
        streams: a step or a release of a request must not overtake the step it is in."""
        for lane, begun in list(self.running.values()):
            if begun is not spare and any(r.request_id in request_ids for r in begun.batch):
                lane.running = None
                try:
                    self._end(lane, begun)
                except Exception:  # noqa: BLE001 (the error went to that step's own stream)
                    pass

    def _admit(self, release: list[str], batch: list[VerifyRequest], lengths: list[int], after: Begun | None) -> None:
        """Release what the message releases, and check that each request's record_length is what
        this verifier holds, with its new tokens and the token of the step it follows (`after`)."""
        self._end_holding({req.request_id for req in batch}, after)
        self._release(release)
        now = time.monotonic()
        self.last_used.update((req.request_id, now) for req in batch)
        for req, length in zip(batch, lengths):
            cache = self.verifier.caches.get(req.request_id)
            have = (len(cache.tokens) if cache is not None else 0) + (after is not None and req.request_id in after.passes)
            if req.since is not None:  # the outcome of the step before, at least its bonus token, lies past length
                if have <= length:
                    raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"request {req.request_id}: the verifier holds {have} tokens of its record, no "
                                f"outcome past record_length {length}; resend the whole record")
                continue
            if have + len(req.new_tokens) != length:
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"request {req.request_id}: the verifier holds {have} tokens of its record, "
                            f"+{len(req.new_tokens)} new != record_length {length}; resend the whole record")

    def _response(self, batch: list[VerifyRequest], verdicts: list[Verdict], step_ns: int) -> verifier_pb2.VerifyResponse:
        STEP_SECONDS.observe(step_ns / 1e9)
        STEP_TOKENS.observe(sum(max(1, len(r.new_tokens)) + len(r.tree) for r in batch))
        return verify_response(batch, verdicts, step_ns)

    @rpc_errors
    async def Release(self, request: verifier_pb2.ReleaseRequest, context) -> verifier_pb2.ReleaseResponse:
        await self._on_worker(self._release, list(request.request_ids))
        return verifier_pb2.ReleaseResponse()

    def _release(self, request_ids: list[str]) -> None:
        """Free the requests' caches; a running step that holds any of them ends first."""
        self._end_holding(set(request_ids))
        for rid in request_ids:
            self.verifier.release(rid)
            self.last_used.pop(rid, None)
            self.ended.pop(rid, None)

    @rpc_errors
    async def GetInfo(self, request, context) -> verifier_pb2.VerifierInfo:
        cfg, pool = self.verifier.model.cfg, self.verifier.pool
        return verifier_pb2.VerifierInfo(model_name=self.model_name, vocab_size=cfg.vocab_size,
                                         context_length=cfg.max_position_embeddings,
                                         eos_token_ids=cfg.eos_token_ids,
                                         active_requests=len(self.verifier.caches),
                                         kv_cache_tokens=pool.n_blocks * pool.block_size,
                                         kv_cache_free_tokens=pool.available * pool.block_size,
                                         kv_cache_cached_tokens=len(pool.cached) * pool.block_size,
                                         kv_block_size=pool.block_size,
                                         feature_layers=self.verifier.feature_layers,
                                         device=self.verifier.model.device.type)
