"""Speculator scale-out: replicas of one SSM behind one DNS name (SRV records served by a test DNS
server on 127.0.0.1, as a Kubernetes headless Service publishes them). Requests are spread over
every replica; a replica killed mid-load loses nothing; a replica that appears is used. And
managers: two on one verifier share its KV cache and keep their request ids apart."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
import urllib.request

import pytest

from specinfer.generate import Request
from specinfer.lookup import CHAIN_TOKENS
from specinfer_rpc.client import generate_all
from specinfer_rpc.launch import System

from .conftest import MODELS
from .dns_server import DNSServer
from .services import reference_greedy
from .test_metrics import scrape, total

NAME = "speculator.specinfer.test"


def trees_built(service) -> float:
    return total(scrape(service.metrics), "specinfer_speculator_trees_total")


@pytest.fixture(scope="module")
def cluster():
    dns = DNSServer()
    system = System()
    try:
        system.start("verifier", "verifier_svc", ["--model", str(MODELS / "llm"), "--port", "0"], 120)
        for i in range(3):
            start_replica(system, dns, i)
        system.start("manager", "manager_svc",
                     ["--port", "0", "--verifier", system.by_name("verifier").address,
                      "--tokenizer", str(MODELS / "llm"), "--speculators", f"dns://{dns.address}/{NAME}:50052",
                      "--discovery-interval", "0.5", "--expansion", "2,1,1", "--no-adaptive", "--tree-budget", "256"], 120)
        yield system, dns
    finally:
        system.stop()
        dns.close()


def replicas(system) -> list:
    return [s for s in system.services if s.name.startswith("replica-")]


def publish(dns, live) -> None:
    dns.set(f"_grpc._tcp.{NAME}", "SRV", [f"0 0 {s.address.rsplit(':', 1)[1]} pod.{NAME}." for s in live])
    dns.set(f"pod.{NAME}", "A", ["127.0.0.1"])


def start_replica(system, dns, i: int):
    system.start(f"replica-{i}", "speculator_svc", ["--ssm", str(MODELS / "ssm-0"), "--port", "0", "--threads", "1",
                                                    "--metrics-port", "0"], 120)
    publish(dns, [s for s in replicas(system) if s.process.poll() is None])


def test_requests_are_spread_over_every_replica(cluster, heldout_ids):
    system, _ = cluster
    prompts = heldout_ids[:12]
    streams = generate_all(system.manager.address, [Request(p, 32) for p in prompts], timeout=300)
    assert [s.token_ids for s in streams] == reference_greedy(prompts, 32)
    built = [trees_built(s) for s in replicas(system)]
    assert all(b > 0 for b in built), built  # 12 sticky requests, the least loaded replica first: 4 each
    assert sum(s.usage.accepted_draft_tokens for s in streams) > 0


def test_a_replica_killed_mid_load_loses_nothing_and_a_new_one_is_used(cluster, heldout_ids):
    system, dns = cluster
    prompts = heldout_ids[:12]
    want = reference_greedy(prompts, 64)
    victim, *survivors = replicas(system)
    before = {s.name: trees_built(s) for s in survivors}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(generate_all, system.manager.address, [Request(p, 64) for p in prompts], None, 300)
        deadline = time.monotonic() + 60
        while trees_built(victim) < 12 and time.monotonic() < deadline:  # mid-load: it is drafting for them
            time.sleep(0.05)
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        streams = future.result(timeout=300)
    assert [s.token_ids for s in streams] == want  # nothing lost, nothing changed
    assert all(trees_built(s) > before[s.name] for s in survivors)  # the victim's requests moved to them
    publish(dns, survivors)  # the pod left the endpoints

    start_replica(system, dns, 3)  # a replica appears
    newcomer = system.by_name("replica-3")
    time.sleep(1.5)  # three discovery intervals
    streams = generate_all(system.manager.address, [Request(p, 24) for p in prompts[:9]], timeout=300)
    assert [s.token_ids for s in streams] == reference_greedy(prompts[:9], 24)
    assert trees_built(newcomer) > 0

    # scale-down: the newcomer leaves the DNS answer while it drafts (it keeps running); the manager
    # closes its stream between exchanges and moves its requests
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(generate_all, system.manager.address, [Request(p, 64) for p in prompts], None, 300)
        built = trees_built(newcomer)
        deadline = time.monotonic() + 60
        while trees_built(newcomer) < built + 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        publish(dns, survivors)
        streams = future.result(timeout=300)
    assert [s.token_ids for s in streams] == want
    assert newcomer.process.poll() is None


def test_two_managers_share_one_verifier_with_the_same_request_ids_and_one_gateway_in_front(heldout_ids):
    """Manager scale-out: each reserves half of a small verifier KV pool, and their verifier ids
    are their own. Both get the same client request ids at once; every output is exact. Then one
    gateway in front of both by one DNS name with both addresses (a headless Service: the same
    port on 127.0.0.1 and 127.0.0.2) spreads its requests over both, round robin."""
    prompts, new = heldout_ids[:4], 64
    # a request's prompt, output and the draft chain of the managers' context lookup (their only drafter)
    need = max(-(-(len(p) + new + CHAIN_TOKENS) // 16) * 16 for p in prompts)
    system, dns = System(), DNSServer()
    try:
        verifier = system.start("verifier", "verifier_svc", ["--model", str(MODELS / "llm"), "--port", "0",
                                                             "--kv-cache-tokens", str(2 * need)], 120)
        flags = ["--verifier", verifier.address, "--tokenizer", str(MODELS / "llm"), "--kv-cache-share", "0.5",
                 "--metrics-port", "0"]
        managers = [system.start("manager-0", "manager_svc", ["--port", "0", *flags], 120)]
        port = managers[0].address.rsplit(":", 1)[1]
        managers.append(system.start("manager-1", "manager_svc", ["--host", "127.0.0.2", "--port", port, *flags], 120))
        requests = [Request(p, new, id=f"req-{i}") for i, p in enumerate(prompts)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda m: generate_all(m.address, requests, timeout=300), managers))
        want = reference_greedy(prompts, new)
        for streams in results:
            assert [s.token_ids for s in streams] == want

        dns.set("managers.specinfer.test", "A", ["127.0.0.1", "127.0.0.2"])
        gateway = system.start("gateway", "gateway_svc", ["--port", "0", "--tokenizer", str(MODELS / "llm"),
                                                          "--manager", f"dns://{dns.address}/managers.specinfer.test:{port}"],
                               120, http="http")
        before = [total(scrape(m.metrics), "specinfer_requests_finished_total") for m in managers]
        for p in prompts * 2:
            body = json.dumps({"model": "llm", "prompt": p, "max_tokens": 8, "temperature": 0}).encode()
            req = urllib.request.Request(gateway.url + "/v1/completions", body, {"Content-Type": "application/json"})
            assert json.loads(urllib.request.urlopen(req, timeout=120).read())["usage"]["completion_tokens"] >= 1
        served = [total(scrape(m.metrics), "specinfer_requests_finished_total") - b for m, b in zip(managers, before)]
        assert sum(served) == 2 * len(prompts) and min(served) >= len(prompts) - 1, served  # alternating
    finally:
        system.stop()
        dns.close()
