"""Hostile load on the real services (separate processes on 127.0.0.1, the tiny fixtures): a flood
far past the queue bound, clients that disconnect at every phase of a request, and slow readers. Nothing admitted
is lost or wrong, every service goes back to idle, memory stays bounded, and no service logs a
traceback. Each service's RSS before and after is printed (pytest -s)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from specinfer.generate import Request
from specinfer_rpc.client import connect, generate, request_pb
from specinfer_rpc.launch import System

from .conftest import MODELS
from .services import active_requests, reference_greedy
from .test_metrics import scrape, total
from .test_soak import rss_mib

FLOOD = 1000
MAX_QUEUE = 64
RSS_GROWTH_MIB = 200  # the bound on any service's growth over a test


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    logs = tmp_path_factory.mktemp("hostile-logs")
    system = System(log_dir=logs)
    try:
        verifier = system.start("verifier", "verifier_svc", ["--model", str(MODELS / "llm"), "--port", "0",
                                                             "--metrics-port", "0"], 120)
        speculator = system.start("speculator", "speculator_svc", ["--ssm", str(MODELS / "ssm-0"), "--port", "0",
                                                                   "--threads", "1", "--metrics-port", "0"], 120)
        system.start("manager", "manager_svc", [
            "--port", "0", "--metrics-port", "0", "--verifier", verifier.address, "--speculators", speculator.address,
            "--tokenizer", str(MODELS / "llm"), "--max-queue", str(MAX_QUEUE), "--max-batch", "8"], 120)
        yield system, logs
    finally:
        system.stop()


def rss(system) -> dict[str, float]:
    return {s.name: round(rss_mib(s.process.pid), 1) for s in system.services}


def idle(system) -> dict:
    """What every service holds for requests: their state on the verifier and the speculator, the
    verifier's used KV slots, and the manager's running and waiting requests."""
    verifier, manager = scrape(system.by_name("verifier").metrics), scrape(system.manager.metrics)
    return {**active_requests(system),
            "kv_used": total(verifier, "specinfer_kv_cache_tokens") - total(verifier, "specinfer_kv_cache_free_tokens"),
            "running": total(manager, "specinfer_requests_running"), "waiting": total(manager, "specinfer_requests_waiting")}


async def until_idle(system, seconds: float = 15.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while any((state := idle(system)).values()) and loop.time() < deadline:
        await asyncio.sleep(0.2)
    return state


def test_a_flood_past_the_queue_bound_is_refused_at_once_and_the_rest_is_exact(hostile, heldout_ids):
    system, _ = hostile
    prompts = heldout_ids[:8]
    want = {tuple(p): w for p, w in zip(prompts, reference_greedy(prompts, 8))}
    before = rss(system)

    async def one(stub, prompt):
        try:
            return prompt, await generate(stub, request_pb(Request(prompt, 8)), 300)
        except grpc.aio.AioRpcError as e:
            return prompt, e

    async def go():
        stub = connect(system.manager.address)
        results = await asyncio.gather(*(one(stub, prompts[i % len(prompts)]) for i in range(FLOOD)))
        after = await until_idle(system)
        again = await generate(stub, request_pb(Request(prompts[0], 8)), 60)
        return results, after, again

    results, after, again = asyncio.run(go())
    served = [(p, s) for p, s in results if not isinstance(s, grpc.aio.AioRpcError)]
    refused = [s for _, s in results if isinstance(s, grpc.aio.AioRpcError)]
    print(f"flood of {FLOOD}: {len(served)} served, {len(refused)} refused; RSS MiB before {before}, after {rss(system)}")
    assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all("max_queue" in e.details() for e in refused)
    assert len(served) >= MAX_QUEUE and len(refused) >= FLOOD // 2
    assert all(s.token_ids == want[tuple(p)] for p, s in served)
    assert not any(after.values()), after
    assert again.token_ids == want[tuple(prompts[0])]
    assert all(rss(system)[name] - mib <= RSS_GROWTH_MIB for name, mib in before.items())


def test_clients_that_disconnect_at_every_phase_leave_every_service_idle(hostile, heldout_ids):
    """200 requests, 50 at a time, cancelled after a random delay: while queued (8 run at once),
    during the prompt's step, while drafting, mid-stream; a fifth of them after reading a chunk."""
    system, _ = hostile
    rng = random.Random(0)
    before = rss(system)

    async def one(stub, i):
        call = stub.Generate(request_pb(Request(heldout_ids[i % 32], rng.randrange(16, 200), ignore_eos=True)),
                             timeout=300)
        if i % 5 == 0:
            await call.read()  # mid-stream: after its first chunk
        await asyncio.sleep(rng.uniform(0.0, 1.5))
        call.cancel()

    async def go():
        stub = connect(system.manager.address)
        for wave in range(4):  # 50 at once: within the queue bound, so every one is accepted
            await asyncio.gather(*(one(stub, 50 * wave + i) for i in range(50)))
        after = await until_idle(system)
        prompt = heldout_ids[3]
        return after, await generate(stub, request_pb(Request(prompt, 24)), 60)

    after, again = asyncio.run(go())
    print(f"200 disconnects: RSS MiB before {before}, after {rss(system)}")
    assert not any(after.values()), after
    assert again.token_ids == reference_greedy([heldout_ids[3]], 24)[0]
    assert all(rss(system)[name] - mib <= RSS_GROWTH_MIB for name, mib in before.items())


def test_slow_readers_hold_back_no_one_and_get_their_whole_output_when_they_read(hostile, heldout_ids):
    """32 streams that read nothing for 20 s beside 8 normal clients: the normal clients finish, with
    the LLM's exact tokens, while the slow ones are still not reading (the scheduler never waits for
    a stream: a step's chunks go to per-stream queues); the manager's memory stays bounded (each
    stream holds at most max_new_tokens tokens); the slow readers then get their whole exact output."""
    system, _ = hostile
    prompts = heldout_ids[:8]
    want = reference_greedy(prompts, 48)
    before = rss(system)

    async def read_all(call) -> list[int]:
        return [t async for m in call for t in m.token_ids]

    async def go():
        stub = connect(system.manager.address)
        slow = [stub.Generate(request_pb(Request(prompts[i % 8], 48)), timeout=300) for i in range(32)]
        await asyncio.sleep(0.5)
        normal = await asyncio.gather(*(read_all(stub.Generate(request_pb(Request(p, 48)), timeout=300))
                                        for p in prompts))
        during = rss(system)
        await asyncio.sleep(20)
        return normal, during, await asyncio.gather(*(read_all(c) for c in slow)), await until_idle(system)

    normal, during, slow, after = asyncio.run(go())
    print(f"slow readers: RSS MiB before {before}, while they did not read {during}, after {rss(system)}")
    assert normal == want
    assert slow == [want[i % 8] for i in range(32)]
    assert not any(after.values()), after
    assert during["manager"] - before["manager"] <= RSS_GROWTH_MIB


def test_no_service_logged_a_traceback_through_the_hostile_load_and_its_stop(hostile):
    system, logs = hostile
    system.stop()
    texts = {p.name: p.read_text() for p in logs.glob("*.log")}
    assert sorted(texts) == ["manager.log", "speculator.log", "verifier.log"]
    assert all("stopping" in t and "Traceback" not in t for t in texts.values()), \
        {name: t[t.index("Traceback") - 200:][:2000] for name, t in texts.items() if "Traceback" in t}
