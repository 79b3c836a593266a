"""Thin gRPC adapter over the core `Verifier`: protobuf in, one batched LLM step, token IDs out.

Model compute runs on one worker thread, never on the event loop, so health checks and releases
are answered while a step runs; the caches are only touched from that thread. The verifier is a
core `Verifier`, or a `ParallelVerifier` (rank 0 of a tensor/pipeline-parallel group) with the
same interface.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
from prometheus_client import Gauge, Histogram

from specinfer.acceptance import Verdict
from specinfer.verifier import Verifier, VerifyRequest
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
                           tuple(item.stop_token_ids))
             for item in request.items]
    if len({req.request_id for req in batch}) != len(batch):
        raise ValueError("items: request ids must be unique within a batch")
    return batch


def verify_response(batch: list[VerifyRequest], verdicts: list[Verdict], step_ns: int) -> verifier_pb2.VerifyResponse:
    """The step's answer: each request's verdict, and the step's own time."""
    return verifier_pb2.VerifyResponse(
        results=[verifier_pb2.VerifyResult(request_id=r.request_id, token_ids=v.tokens,
                                           features=features_to_pb(v.features) if v.features else None,
                                           logprobs=logprobs_to_pb(v.logprobs or []),
                                           prompt_logprobs=logprobs_to_pb(v.prompt_logprobs or []),
                                           cached_tokens=v.cached_tokens)
                 for r, v in zip(batch, verdicts)],
        step_ns=step_ns)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, verifier: Verifier, model_name: str, idle_timeout: float, thread: ModelThread):
        self.verifier = verifier
        self.model_name = model_name
        self.idle_timeout = idle_timeout  # a request untouched this long is freed (its manager is gone)
        self.last_used: dict[str, float] = {}
        self.thread = thread  # the one thread that touches the model and the caches
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
        return await self._finish(*self._start(request))

    @rpc_errors
    async def VerifyStream(self, requests, context):
        """Steps answered in order. The next message is read, and its step queued on the model thread,
        while this one runs: a step the manager sent ahead starts the moment this one ends."""
        started: asyncio.Queue = asyncio.Queue(1)  # steps queued beyond the one being answered: at most 2
        reader = asyncio.ensure_future(self._start_all(requests, started))
        try:
            while (step := await started.get()) is not None:
                if isinstance(step, Exception):  # a message that is wrong: the stream's status, in its turn
                    raise step
                yield await self._finish(*step)
        finally:  # the stream ended (an error, the manager went away): the steps not begun are not run
            reader.cancel()
            while not started.empty():
                if isinstance(step := started.get_nowait(), tuple):
                    step[1].cancel()

    async def _start_all(self, requests, started: asyncio.Queue) -> None:
        try:
            async for request in requests:
                step = self._start(request)
                try:
                    await started.put(step)
                except asyncio.CancelledError:
                    step[1].cancel()
                    raise
        except Exception as e:  # noqa: BLE001 (a wrong message, bytes that do not parse: the stream's end)
            await started.put(e)
            return
        await started.put(None)

    def _start(self, request: verifier_pb2.VerifyRequest) -> tuple[list[VerifyRequest], asyncio.Future]:
        """The step's requests, and its work queued on the model thread."""
        batch = verify_requests(request, self.verifier.model.cfg.vocab_size)
        lengths = [item.record_length for item in request.items]
        return batch, self._submit(self._step, list(request.release), batch, lengths)

    async def _finish(self, batch: list[VerifyRequest], work: asyncio.Future) -> verifier_pb2.VerifyResponse:
        verdicts, step_ns = await self._answer(work)
        STEP_SECONDS.observe(step_ns / 1e9)
        STEP_TOKENS.observe(sum(len(r.new_tokens) + len(r.tree) for r in batch))
        return verify_response(batch, verdicts, step_ns)

    def _step(self, release: list[str], batch: list[VerifyRequest], lengths: list[int]) -> tuple[list[Verdict], int]:
        """The step on the model thread, and its time there (ns)."""
        start = time.perf_counter_ns()
        now = time.monotonic()
        stale = [rid for rid, t in self.last_used.items() if now - t > self.idle_timeout]
        self._release(release + stale)
        self.last_used.update((req.request_id, now) for req in batch)
        for req, length in zip(batch, lengths):
            cache = self.verifier.caches.get(req.request_id)
            have = len(cache.tokens) if cache is not None else 0
            if have + len(req.new_tokens) != length:
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"request {req.request_id}: the verifier holds {have} tokens of its record, "
                            f"+{len(req.new_tokens)} new != record_length {length}; resend the whole record")
        return self.verifier.step(batch), time.perf_counter_ns() - start

    @rpc_errors
    async def Release(self, request: verifier_pb2.ReleaseRequest, context) -> verifier_pb2.ReleaseResponse:
        await self._on_worker(self._release, list(request.request_ids))
        return verifier_pb2.ReleaseResponse()

    def _release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.verifier.release(rid)
            self.last_used.pop(rid, None)

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
