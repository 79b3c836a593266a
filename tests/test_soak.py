"""Soak: two minutes of steady streaming load on the whole system. No request fails, every service's
resident memory stays flat (printed at start and end), and no request state is left behind."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specinfer_rpc.launch import launch
from specinfer_rpc.load import run_load

from .conftest import MODELS
from .services import active_requests

SOAK_S = 120
GROWTH = 1.10  # end RSS within 10% of start, plus slack for allocator pages
SLACK_MIB = 24


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


@pytest.fixture(scope="module")
def system():
    system = launch(MODELS / "llm", [MODELS / "ssm-0", MODELS / "ssm-1"], speculators=2, port=0)
    yield system
    system.stop()


def test_two_minutes_of_steady_load_no_errors_and_flat_memory(system, heldout_ids, capsys):
    def load(seconds):
        return asyncio.run(run_load(system.manager.address, heldout_ids, concurrency=8, duration=seconds,
                                    max_new_tokens=32))

    warm = load(10)  # first requests grow the allocators' pools: measure from steady state
    assert warm.errors == {}
    pids = {s.name: s.process.pid for s in system.services}
    start = {name: rss_mib(pid) for name, pid in pids.items()}
    samples = []
    done = threading.Event()

    def sample():
        while not done.wait(10):
            samples.append({name: rss_mib(pid) for name, pid in pids.items()})

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.monotonic()
    try:
        report = load(SOAK_S)
    finally:
        done.set()
        sampler.join()
    elapsed = time.monotonic() - t0
    end = {name: rss_mib(pid) for name, pid in pids.items()}
    summary = report.summary()

    with capsys.disabled():
        print(f"\nsoak: {elapsed:.0f} s, {report.requests} requests, {summary['tokens_per_s']} tokens/s, "
              f"errors {report.errors}")
        print(f"{'service':<14}{'RSS start MiB':>15}{'RSS end MiB':>13}{'max MiB':>9}")
        for name in pids:
            peak = max([start[name], end[name]] + [s[name] for s in samples])
            print(f"{name:<14}{start[name]:>15.1f}{end[name]:>13.1f}{peak:>9.1f}")

    assert elapsed >= SOAK_S and report.errors == {} and report.requests >= 50
    assert summary["tokens"] == 32 * report.requests
    for name in pids:
        assert end[name] <= start[name] * GROWTH + SLACK_MIB, (name, start[name], end[name])
    deadline = time.monotonic() + 10
    while any(active_requests(system).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert active_requests(system) == {"verifier": 0, "speculator-0": 0, "speculator-1": 0}
