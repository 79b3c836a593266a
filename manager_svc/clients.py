"""The manager's clients of the verifier and the speculators, the engine's VerifierBackend and
drafters over gRPC: protobuf and gRPC errors stay here; the engine sees core dataclasses and the
core's errors.

A speculator is optional: any failure (error, end of stream, slow answer, malformed tree) marks its
stream broken, this iteration goes on without its trees, and a new stream is tried a moment later.
A verifier failure is the request's failure (`VerifierUnavailable`), except when the verifier lost
a request's state (`VerifierLost`): then the engine resends whole records.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid

import grpc

from specinfer.engine import Check, Draft, Verified
from specinfer.errors import VerifierLost, VerifierUnavailable
from specinfer.tree import TokenTree
from specinfer_rpc.convert import allowed_to_pb, sampling_to_pb, tree_from_pb, tree_to_pb
from specinfer_rpc.security import open_channel
from specinfer_rpc.server import channel_options
from specinfer_rpc.v1 import (
    common_pb2,
    speculator_pb2,
    speculator_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

log = logging.getLogger("specinfer.manager")


def verify_request(namespace: str, batch: list[Check], release: list[str]) -> verifier_pb2.VerifyRequest:
    """One step's message: each request's check under the manager's `namespace`, and the requests to free."""
    return verifier_pb2.VerifyRequest(
        release=[namespace + rid for rid in release],
        items=[verifier_pb2.VerifyItem(request_id=namespace + c.request_id, new_token_ids=c.new_tokens,
                                       record_length=c.record_length, tree=tree_to_pb(c.tree),
                                       sampling=sampling_to_pb(c.sampling), return_features=c.features,
                                       return_logprobs=c.logprobs, top_logprobs=c.top_logprobs,
                                       return_prompt_logprobs=c.prompt_logprobs,
                                       allowed=allowed_to_pb(c.allowed), prefill_only=c.prefill_only,
                                       output_start=c.output_start, stop_token_ids=c.stop_ids,
                                       predrafted=c.predrafted, follows_outcome=c.candidates is not None,
                                       candidates=[common_pb2.OutcomeTree(outcome=o, tree=tree_to_pb(t))
                                                   for o, t in c.candidates or ()])
               for c in batch])


def verified(batch: list[Check], response: verifier_pb2.VerifyResponse) -> list[Verified]:
    """Each request's answer; features and logprobs stay protobuf (FeatureRows, TokenLogprob): the
    manager hands them on as they came."""
    return [Verified(list(r.token_ids), r.features if r.HasField("features") else None,
                     r.logprobs if c.logprobs else None, r.prompt_logprobs if c.prompt_logprobs else None,
                     r.cached_tokens, r.candidate - 1)
            for c, r in zip(batch, response.results)]


class VerifierClient:
    """Request ids on the verifier are this manager's own (a random prefix), so several managers
    can share one verifier even when their clients choose the same ids. Steps go over one
    long-lived VerifyStream, a request and its response each: a step pays no call set-up. A step
    is queued on the stream when its `verify` call starts, and the next may be sent before its answer
    came (the engine's steps ahead); answers come back in order. A stream that ended (an error, a
    restarted verifier) fails the steps it had not answered and is replaced by the next step's."""

    CONNECT_GRACE = 2.0  # seconds a call waits for a (re)connecting verifier before failing

    def __init__(self, address: str, timeout: float, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        self.timeout = timeout
        self.channel = open_channel(address, credentials, channel_options(max_message_bytes))
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        self.namespace = uuid.uuid4().hex[:12] + "/"
        self.steps: StepStream | None = None  # None: the next step opens one

    async def info(self, wait: float) -> verifier_pb2.VerifierInfo:
        """The verifier's model info, waiting up to `wait` seconds for it to come up."""
        return await self.stub.GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=wait, wait_for_ready=True)

    async def verify(self, batch: list[Check], release: list[str], follows: bool = False) -> tuple[list[Verified], int]:
        """Each request's answer and the verifier's step time in ns; features and logprobs stay
        protobuf (FeatureRows, TokenLogprob): the manager hands them on as they came. The step is
        queued before the first await. `follows`: it needs what the step sent before it leaves (a step
        ahead), so it goes on that step's stream or nowhere: VerifierLost if that one ended."""
        if self.steps is None or self.steps.ended:
            if follows:
                raise VerifierLost(f"verifier {self.address}: the stream of the step this one follows ended")
            self.steps = StepStream(self._open)
        steps = self.steps
        answer = steps.send(verify_request(self.namespace, batch, release))
        try:
            async with asyncio.timeout(self.timeout):
                response = await answer  # raises the stream's error status
        except grpc.aio.AioRpcError as e:
            self._drop(steps)
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise VerifierLost(e.details()) from e
            raise VerifierUnavailable(f"verifier {self.address}: {e.code().name}: {e.details()}") from e
        except asyncio.TimeoutError as e:
            self._drop(steps)
            raise VerifierUnavailable(f"verifier {self.address}: DEADLINE_EXCEEDED: no answer in {self.timeout}s") from e
        except (asyncio.InvalidStateError, ConnectionError) as e:  # the stream ended before or without an answer
            self._drop(steps)
            raise VerifierUnavailable(f"verifier {self.address}: UNAVAILABLE: {e}") from e
        return verified(batch, response), response.step_ns

    async def _open(self):
        await self._connected()
        return self.stub.VerifyStream()

    def _drop(self, steps: StepStream) -> None:
        steps.end(ConnectionError("the step stream was dropped"))
        if self.steps is steps:
            self.steps = None

    async def _connected(self) -> None:
        """Give a verifier that is (re)starting a moment to accept the connection; one that is
        down stays down and the call after this fails UNAVAILABLE at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.CONNECT_GRACE
        state = self.channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY and (left := deadline - loop.time()) > 0:
            try:
                await asyncio.wait_for(self.channel.wait_for_state_change(state), left)
            except asyncio.TimeoutError:
                return
            state = self.channel.get_state(try_to_connect=True)

    async def release(self, request_ids: list[str]) -> None:
        try:
            await self.stub.Release(verifier_pb2.ReleaseRequest(request_ids=[self.namespace + r for r in request_ids]),
                                    timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            raise VerifierUnavailable(f"verifier {self.address}: {e.code().name}: {e.details()}") from e

    async def close(self) -> None:
        if self.steps is not None:
            self.steps.end(ConnectionError("the client closed"))
            await self.steps.stopped()
        await self.channel.close()


class StepStream:
    """One VerifyStream call with its steps in order: `send` queues a request at once and returns the
    future of its answer; a task opens the call and writes the queue, another reads the answers.
    When the call ends (its error, EOF) or is ended, every step not answered fails with that."""

    def __init__(self, open_call):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.ended = False
        self.call = None
        self.reader: asyncio.Task | None = None
        self.writer = asyncio.ensure_future(self._write(open_call))

    def send(self, request) -> asyncio.Future:
        answer = asyncio.get_running_loop().create_future()
        self.waiting.append(answer)
        self.queue.put_nowait(request)
        return answer

    async def _write(self, open_call) -> None:
        try:
            self.call = await open_call()
            self.reader = asyncio.ensure_future(self._read())  # it ends with the call
            while True:
                await self.call.write(await self.queue.get())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # grpc.aio.AioRpcError, or the call ended under a write:
            if self.reader is not None:  # the reader ends with the call's own status (FAILED_PRECONDITION:
                await asyncio.wait([self.reader])  # the verifier lost a request), which the steps fail with
            self.end(e)

    async def _read(self) -> None:
        try:
            while (response := await self.call.read()) is not grpc.aio.EOF:
                if not self.waiting:
                    raise ConnectionError("the verifier answered a step that was not sent")
                answer = self.waiting.popleft()
                if not answer.done():  # else its caller stopped waiting (cancelled)
                    answer.set_result(response)
            self.end(ConnectionError("the verifier ended the step stream"))
        except asyncio.CancelledError:  # the call was cancelled (end)
            raise
        except Exception as e:  # grpc.aio.AioRpcError: the stream's error status
            self.end(e)

    def end(self, error: Exception) -> None:
        """Stop: the steps not answered fail with `error`; the call is cancelled, and the reader
        ends with it."""
        if self.ended:
            return
        self.ended = True
        while self.waiting:
            answer = self.waiting.popleft()
            if not answer.done():
                answer.set_exception(error)
        if self.call is not None:
            self.call.cancel()
        self.writer.cancel()

    async def stopped(self) -> None:
        """Wait for its tasks to end (after `end`)."""
        await asyncio.wait([t for t in (self.writer, self.reader) if t is not None])


class FeaturesMismatch(ValueError):
    """A feature speculator reads features the verifier does not return."""


class SpeculatorClient:
    """One long-lived Speculate stream, with what this stream's speculator has been told."""

    RETRY_AFTER = 1.0  # seconds before a broken stream is reopened

    def __init__(self, address: str, drafter: int, timeout: float, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str = "",
                 verifier_layers: tuple[int, ...] = ()):
        self.address = address
        self.verifier_layers = verifier_layers  # the features the verifier returns (VerifierInfo.feature_layers)
        self.drafter = drafter  # distinct per SSM (replicas share it): independent random draws
        self.timeout = timeout
        # a replica found by DNS is dialled by IP: its certificate is checked against the DNS name
        names = [("grpc.ssl_target_name_override", server_name)] if server_name and credentials else []
        self.channel = open_channel(address, credentials, channel_options(max_message_bytes) + names)
        self.exchange = asyncio.Lock()  # one message and its answer at a time; close() waits for it
        self.stub = speculator_pb2_grpc.SpeculatorStub(self.channel)
        self.call = None
        self.iteration = 0
        self.told: dict[str, int] = {}  # request id -> tokens of its record sent on this stream
        self.to_release: set[str] = set()
        self.retry_at = 0.0
        self.draft_ns = 0  # the speculator's own time in the last exchange
        self.ahead: dict[str, dict[tuple[int, ...], TokenTree]] = {}  # the last exchange's trees drafted ahead
        self.pending: asyncio.Future | None = None  # reading them (the exchange's second response)
        self.feature_layers: tuple[int, ...] = ()  # a feature speculator's (SpeculatorInfo), read as the stream opens
        self.model_names: list[str] = []  # what it hosts (SpeculatorInfo), likewise

    @property
    def connected(self) -> bool:
        return self.call is not None

    @property
    def wants_features(self) -> bool:
        return bool(self.feature_layers)

    async def _open(self) -> None:
        """Ask what the speculator is (a feature speculator's drafts carry features), then open the stream."""
        info = await self.stub.GetInfo(speculator_pb2.GetSpeculatorInfoRequest(), timeout=self.timeout)
        self.model_names = list(info.model_names)
        layers = tuple(info.feature_layers)
        if layers and layers != self.verifier_layers:
            raise FeaturesMismatch(f"speculator {self.address} reads the LLM's features of layers {list(layers)}, "
                                   f"the verifier returns those of {list(self.verifier_layers)} "
                                   f"(start it with --feature-layers {','.join(map(str, layers))})")
        self.feature_layers = layers
        self.call = self.stub.Speculate()

    @property
    def usable(self) -> bool:
        """Not waiting out a broken stream."""
        return self.call is not None or time.monotonic() >= self.retry_at

    async def connect(self, wait: float) -> None:
        """Open the stream now if the speculator answers within `wait` seconds (at start, and when a
        replica joins), so that `connected` counts it before the first request; otherwise the first
        draft tries again."""
        try:
            await asyncio.wait_for(self.channel.channel_ready(), wait)
        except asyncio.TimeoutError:
            return
        async with self.exchange:
            if self.call is None:
                try:
                    await self._open()
                except grpc.RpcError:
                    return  # the first draft tries again

    def release(self, request_id: str) -> None:
        """Free the request on the speculator with the next message (a draft may be in flight)."""
        self.told.pop(request_id, None)
        self.ahead.pop(request_id, None)
        if self.call is not None:
            self.to_release.add(request_id)

    async def draft(self, drafts: list[Draft]) -> dict[str, TokenTree]:
        """Trees by request id; empty when the speculator cannot answer now. Where some draft asks to draft
        ahead, the trees drafted ahead come after (`drafted_ahead`)."""
        async with self.exchange:
            await self._settled()
            return await self._draft(drafts)

    async def drafted_ahead(self) -> dict[str, dict[tuple[int, ...], TokenTree]]:
        async with self.exchange:
            await self._settled()
            return self.ahead

    async def _settled(self) -> None:
        """The last exchange's second response read (or given up)."""
        if self.pending is not None:
            await asyncio.wait([self.pending])
            self.pending = None

    async def _read_ahead(self, iteration: int) -> None:
        """The exchange's second response: the trees drafted ahead, by request and outcome."""
        try:
            async with asyncio.timeout(self.timeout):
                response = await self.call.read()
            if response is grpc.aio.EOF or response.iteration != iteration or not response.drafted_ahead:
                raise ConnectionError("stream ended or out of step")
            for o in response.outcomes:
                if o.request_id in self.told:  # (not released meanwhile)
                    self.ahead.setdefault(o.request_id, {})[tuple(o.outcome)] = tree_from_pb(o.tree)
        except (grpc.RpcError, asyncio.TimeoutError, asyncio.InvalidStateError, ConnectionError, ValueError) as e:
            self.ahead = {}
            if self.call is not None:
                self._broken(e)

    async def _draft(self, drafts: list[Draft]) -> dict[str, TokenTree]:
        if self.call is None:
            if not self.usable:
                return {}
            try:
                await self._open()
            except (grpc.RpcError, FeaturesMismatch) as e:
                self.retry_at = time.monotonic() + self.RETRY_AFTER
                log.warning("speculator %s: %s; going on without it", self.address,
                            e.code().name if isinstance(e, grpc.RpcError) else e)
                return {}
        self.iteration += 1
        request = speculator_pb2.SpeculateRequest(iteration=self.iteration, release=sorted(self.to_release))
        lengths = {d.request_id: len(d.record) for d in drafts}  # what the speculator will have been told
        for d in drafts:
            request.updates.append(speculator_pb2.DraftUpdate(
                request_id=d.request_id, new_token_ids=d.record.tail(self.told.get(d.request_id, 0)),
                expansion=d.expansion, sampling=sampling_to_pb(d.sampling), drafter=self.drafter,
                features=d.features if self.feature_layers else (), ahead=d.ahead))
        self.ahead = {}
        try:
            async with asyncio.timeout(self.timeout):
                await self.call.write(request)
                response = await self.call.read()
            if response is grpc.aio.EOF or response.iteration != self.iteration:
                raise ConnectionError("stream ended or out of step")
            trees = {t.request_id: tree_from_pb(t.tree) for t in response.trees}
        except (grpc.RpcError, asyncio.TimeoutError, asyncio.InvalidStateError,  # a write after the call ended
                ConnectionError, ValueError) as e:
            self._broken(e)
            return {}
        self.to_release.difference_update(request.release)
        for rid, length in lengths.items():
            if rid not in self.to_release:  # not released while this exchange ran
                self.told[rid] = length
        self.draft_ns = response.draft_ns
        if any(d.ahead for d in drafts):
            self.pending = asyncio.ensure_future(self._read_ahead(self.iteration))
        return trees

    def _broken(self, error: Exception) -> None:
        detail = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else repr(error)
        log.warning("speculator %s: %s; going on without it", self.address, detail)
        self.call.cancel()
        self.call = None
        self.told.clear()  # the speculator frees a stream's state when the stream ends
        self.to_release.clear()
        self.ahead = {}
        self.retry_at = time.monotonic() + self.RETRY_AFTER

    async def flush(self) -> None:
        """Send pending releases now (when no iteration is coming to carry them)."""
        if self.to_release and self.call is not None:
            await self.draft([])

    async def close(self) -> None:
        async with self.exchange:  # cancelling a call mid-exchange would raise CancelledError in draft()
            if self.pending is not None:
                self.pending.cancel()
                await self._settled()
            if self.call is not None:
                self.call.cancel()
                self.call = None
            await self.channel.close()
