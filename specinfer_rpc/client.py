"""A Python client of the public Generation API, for the CLI, the tests and the load client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from specinfer.engine import Generation, Request
from specinfer.tree import parse_expansion

from .convert import grammar_to_pb, sampling_to_pb
from .security import open_channel
from .server import channel_options
from .v1 import generation_pb2, generation_pb2_grpc

FINISH_NAMES = {v: k for k, v in {"eos": generation_pb2.FINISH_REASON_EOS, "stop": generation_pb2.FINISH_REASON_STOP,
                                  "length": generation_pb2.FINISH_REASON_LENGTH}.items()}


WAITING_NOTICE_S = 2.0  # a client waiting this long for a connection says so (on_waiting), if not before


def connect(address: str, credentials: grpc.ChannelCredentials | None = None,
            max_message_bytes: int = 64 << 20) -> generation_pb2_grpc.GenerationStub:
    """A stub on a new channel: plaintext, or TLS/token with `security.channel_credentials`."""
    return generation_pb2_grpc.GenerationStub(open_channel(address, credentials, channel_options(max_message_bytes)))


async def connect_when_ready(address: str, credentials: grpc.ChannelCredentials | None = None, wait: float = 60.0,
                             on_waiting: Callable[[], None] | None = None) -> generation_pb2_grpc.GenerationStub:
    """A stub once the channel to `address` is connected: the server may still be starting (e.g.
    `specinfer serve &` just before). Calls `on_waiting` once if the server is not there yet (a
    connection attempt failed, or none succeeded within WAITING_NOTICE_S); raises RuntimeError
    naming the address after `wait` s."""
    told = on_waiting is None

    def tell() -> None:
        nonlocal told
        if not told:
            told = True
            on_waiting()

    channel = open_channel(address, credentials, channel_options(64 << 20))
    notice = asyncio.get_running_loop().call_later(WAITING_NOTICE_S, tell)
    try:
        await asyncio.wait_for(channel_ready(channel, on_failure=tell), wait)
    except TimeoutError:
        await channel.close()
        raise RuntimeError(f"{address}: no server answered within {wait:g} s (is `specinfer serve` running there, "
                           f"with the same TLS settings?)") from None
    finally:
        notice.cancel()
    return generation_pb2_grpc.GenerationStub(channel)


async def channel_ready(channel: grpc.aio.Channel, on_failure: Callable[[], None]) -> None:
    """`channel.channel_ready()` that calls `on_failure` whenever a connection attempt has failed."""
    state = channel.get_state(try_to_connect=True)
    while state != grpc.ChannelConnectivity.READY:
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            on_failure()
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)


def speculation_pb(spec: str | None) -> generation_pb2.Speculation:
    """None: the server's default; "off": none; "1,1,3": that expansion, fixed."""
    if spec is None:
        return generation_pb2.Speculation()
    if spec == "off":
        return generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_OFF)
    return generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_FIXED, expansion=parse_expansion(spec))


def request_pb(req: Request, speculation: str | None = None) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=req.id, prompt_token_ids=req.prompt, sampling=sampling_to_pb(req.sampling),
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=req.max_new_tokens,
                                                 stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos),
        speculation=speculation_pb(speculation), return_logprobs=req.logprobs, top_logprobs=req.top_logprobs,
        return_prompt_logprobs=req.prompt_logprobs, response_format=grammar_to_pb(req.grammar),
        prediction_token_ids=req.prediction)


@dataclass
class Streamed:
    """One Generate stream as the client saw it."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: generation_pb2.Usage | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds since the call, per chunk
    chunk_sizes: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # protobuf TokenLogprob, with return_logprobs
    prompt_logprobs: list = field(default_factory=list)  # with return_prompt_logprobs


async def generate(stub, request: generation_pb2.GenerateRequest, timeout: float | None = None) -> Streamed:
    out = Streamed()
    start = time.perf_counter()
    async for chunk in stub.Generate(request, timeout=timeout):
        out.chunk_times.append(time.perf_counter() - start)
        out.chunk_sizes.append(len(chunk.token_ids))
        out.token_ids.extend(chunk.token_ids)
        out.logprobs.extend(chunk.logprobs)
        out.prompt_logprobs.extend(chunk.prompt_logprobs)
        if chunk.finish_reason:
            out.finish_reason = FINISH_NAMES[chunk.finish_reason]
            out.usage = chunk.usage
    return out


def generate_all(address: str, requests: list[Request], speculation: str | None = None,
                 timeout: float | None = None, credentials: grpc.ChannelCredentials | None = None) -> list[Streamed]:
    """Send every request concurrently and wait for all the streams (blocking)."""
    async def run():
        stub = connect(address, credentials)
        return await asyncio.gather(*(generate(stub, request_pb(r, speculation), timeout) for r in requests))
    return asyncio.run(run())


@dataclass
class RemoteRun:
    """`generate_remote`'s answer: per prompt its generation (with the server's usage figures) and text."""

    generations: list[Generation]
    texts: list[str]
    seconds: float  # from the first Generate call to the end of the last stream


def generate_remote(address: str, prompts: list[tuple[str, str]], max_new_tokens: int, sampling,
                    speculation: str | None, credentials: grpc.ChannelCredentials | None = None,
                    wait: float = 60.0, on_waiting: Callable[[], None] | None = None,
                    concurrency: int = 0) -> RemoteRun:
    """`specinfer generate --server`: wait up to `wait` s for the server (see `connect_when_ready`),
    tokenize on it, send the prompts, `concurrency` streams at a time (0: all at once), detokenize on it. Raises RuntimeError naming the
    address, with the server's status if it answered, on failure."""

    async def run():
        stub = await connect_when_ready(address, credentials, wait, on_waiting)
        try:
            prompt_ids = await asyncio.gather(*(stub.Tokenize(generation_pb2.TokenizeRequest(text=t), timeout=wait,
                                                              wait_for_ready=True) for _, t in prompts))
            requests = [request_pb(Request(list(p.token_ids), max_new_tokens, sampling), speculation)
                        for p in prompt_ids]
            start = time.perf_counter()
            slots = asyncio.Semaphore(concurrency or len(requests))

            async def one(r):
                async with slots:
                    return await generate(stub, r)
            streams = await asyncio.gather(*(one(r) for r in requests))
            seconds = time.perf_counter() - start
            texts = await asyncio.gather(*(stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=s.token_ids))
                                           for s in streams))
        except grpc.aio.AioRpcError as e:
            raise RuntimeError(f"{address}: {e.code().name}: {e.details()}") from e
        gens = [Generation(pid, s.token_ids, s.finish_reason, s.usage.verifier_steps, [], s.usage.tree_steps,
                           s.usage.no_tree_reason)
                for (pid, _), s in zip(prompts, streams)]
        return RemoteRun(gens, [t.text for t in texts], seconds)

    return asyncio.run(run())
