"""Failures of parts: a speculator killed mid-batch costs only speed; a verifier that goes away
fails its requests with UNAVAILABLE promptly, and the system serves again once it is back."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from specinfer.generate import Request
from specinfer_rpc.client import connect, generate_all, request_pb
from specinfer_rpc.launch import launch
from specinfer_rpc.v1 import generation_pb2

from .conftest import MODELS
from .services import reference_greedy


@pytest.fixture
def fresh_system():
    system = launch(MODELS / "llm", [MODELS / "ssm-0", MODELS / "ssm-1"], speculators=2, port=0)
    yield system
    system.stop()


def speculators_connected(address: str) -> int:
    async def go():
        return (await connect(address).GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)).speculators
    return asyncio.run(go())


async def read_rest(call) -> list[int]:
    tokens = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        tokens.extend(chunk.token_ids)
    return tokens


def test_killing_a_speculator_mid_batch_loses_no_request(fresh_system, heldout_ids):
    system, prompts = fresh_system, heldout_ids[:12]

    async def go():
        stub = connect(system.manager.address)
        # fixed trees: 12 requests exceed the default tree budget, and the speculators must be in use
        calls = [stub.Generate(request_pb(Request(p, 64), "1,1,1"), timeout=300) for p in prompts]
        firsts = await asyncio.gather(*(c.read() for c in calls))  # all streaming
        os.kill(system.by_name("speculator-0").process.pid, signal.SIGKILL)
        rests = await asyncio.gather(*(read_rest(c) for c in calls))
        return [list(f.token_ids) + r for f, r in zip(firsts, rests)]

    assert asyncio.run(go()) == reference_greedy(prompts, 64)
    assert speculators_connected(system.manager.address) == 1
    system.restart(system.by_name("speculator-0"))
    time.sleep(1.2)  # the manager reopens a broken stream after a second
    again = generate_all(system.manager.address, [Request(prompts[0], 16)], "2,1,1")[0]  # drafts whatever the controller says
    assert again.token_ids == reference_greedy(prompts[:1], 16)[0]
    assert speculators_connected(system.manager.address) == 2


def test_a_stopped_verifier_gives_unavailable_promptly_and_service_resumes_when_it_is_back(fresh_system, heldout_ids):
    system = fresh_system
    verifier = system.by_name("verifier")

    async def in_flight_then_kill():
        stub = connect(system.manager.address)
        calls = [stub.Generate(request_pb(Request(p, 500, ignore_eos=True)), timeout=120) for p in heldout_ids[:8]]
        await asyncio.gather(*(c.read() for c in calls))  # all streaming
        os.kill(verifier.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        codes = []
        for c in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_rest(c)
            codes.append(err.value.code())
        return codes, time.monotonic() - killed

    codes, seconds = asyncio.run(in_flight_then_kill())
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 8 and seconds < 5
    verifier.process.wait()

    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        generate_all(system.manager.address, [Request(heldout_ids[0], 8)], timeout=60)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < 5
    assert all(s.process.poll() is None for s in system.services if s.name != "verifier")

    system.restart(verifier)
    streams = generate_all(system.manager.address, [Request(p, 24) for p in heldout_ids[:4]])
    assert [s.token_ids for s in streams] == reference_greedy(heldout_ids[:4], 24)


def test_sigterm_drains_streams_and_refuses_new_requests(fresh_system, heldout_ids):
    """SIGTERM to the manager during 16 streams: every stream completes with all its tokens (the
    LLM's own), a request sent after the signal is refused, and the manager then exits cleanly."""
    system, prompts = fresh_system, heldout_ids[:16]
    manager = system.manager

    async def go():
        stub = connect(manager.address)
        calls = [stub.Generate(request_pb(Request(p, 64, ignore_eos=True)), timeout=300) for p in prompts]
        firsts = await asyncio.gather(*(c.read() for c in calls))  # all streaming
        manager.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await connect(manager.address).Generate(request_pb(Request(prompts[0], 8)), timeout=10).read()
        rests = await asyncio.gather(*(read_rest(c) for c in calls))
        return [list(f.token_ids) + r for f, r in zip(firsts, rests)], refused.value.code()

    outputs, code = asyncio.run(go())
    assert all(len(o) == 64 for o in outputs), "a stream was truncated"
    assert outputs == reference_greedy(prompts, 64, ignore_eos=True)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert manager.process.wait(30) == 0
