"""Prometheus /metrics on every service: after real requests, the scraped figures agree with what
the clients were streamed (token counts, steps, accepted drafts, finish reasons)."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specinfer.generate import Request
from specinfer_rpc.client import generate_all
from specinfer_rpc.launch import launch

from .conftest import MODELS


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label pairs: value}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(samples: dict[str, dict[tuple, float]], name: str, **labels) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for k, v in samples.get(name, {}).items() if want <= set(k))


@pytest.fixture(scope="module")
def system():
    system = launch(MODELS / "llm", [MODELS / "ssm-0", MODELS / "ssm-1"], speculators=2, port=0)
    yield system
    system.stop()


def test_scraped_metrics_add_up_to_what_clients_were_streamed(system, heldout_ids):
    urls = {s.name: s.metrics for s in system.services}
    assert all(u.startswith("http://127.0.0.1:") and u.endswith("/metrics") for u in urls.values()), urls

    requests = [Request(p, 40, ignore_eos=i % 2 == 0) for i, p in enumerate(heldout_ids[:8])]
    streams = generate_all(system.manager.address, requests, "2,1,1")  # fixed trees: 8 requests exceed the default budget
    streams += generate_all(system.manager.address, [Request(heldout_ids[8], 12)], "off")
    requests.append(Request(heldout_ids[8], 12))
    with pytest.raises(grpc.RpcError):  # refused before it was accepted: counted nowhere
        generate_all(system.manager.address, [Request([], 4)])

    m = scrape(urls["manager"])
    completion = sum(s.usage.completion_tokens for s in streams)
    steps = sum(s.usage.verifier_steps for s in streams)
    accepted = sum(s.usage.accepted_draft_tokens for s in streams)
    n = len(streams)
    assert total(m, "specinfer_generation_tokens_total") == completion == sum(len(s.token_ids) for s in streams)
    assert total(m, "specinfer_prompt_tokens_total") == sum(len(r.prompt) for r in requests)
    for reason in ("eos", "length"):
        assert total(m, "specinfer_requests_finished_total", reason=reason) == \
            sum(s.finish_reason == reason for s in streams), reason
    assert total(m, "specinfer_requests_finished_total") == n
    assert total(m, "specinfer_requests_running") == 0 and total(m, "specinfer_requests_waiting") == 0

    # one observation per request, one per request-step, one per token after the first chunk
    for name in ("specinfer_time_to_first_token_seconds", "specinfer_request_latency_seconds",
                 "specinfer_request_queue_seconds"):
        assert total(m, name + "_count") == n, name
    assert total(m, "specinfer_tokens_per_step_count") == steps
    assert total(m, "specinfer_tokens_per_step_sum") == completion  # mean tokens per step = sum / count
    assert total(m, "specinfer_batch_size_sum") == steps
    assert total(m, "specinfer_inter_token_latency_seconds_count") == completion - sum(s.chunk_sizes[0] for s in streams)
    assert 0 < total(m, "specinfer_time_to_first_token_seconds_sum") < total(m, "specinfer_request_latency_seconds_sum")

    # drafts and acceptance per depth: the depths' sum is the clients' accepted count, acceptance
    # falls with depth (accepted at depth d means it reached d-1 too), never more than drafted
    assert total(m, "specinfer_accepted_tokens_total") == accepted > 0
    depth_accepted = {int(dict(k)["depth"]): v for k, v in m["specinfer_accepted_tokens_total"].items()}
    depth_drafted = {int(dict(k)["depth"]): v for k, v in m["specinfer_draft_tokens_total"].items()}
    assert sorted(depth_accepted) == list(range(1, len(depth_accepted) + 1))
    assert all(depth_accepted[d] >= depth_accepted[d + 1] for d in range(1, len(depth_accepted)))
    assert all(depth_accepted[d] <= depth_drafted[d] for d in depth_accepted)
    assert total(m, "specinfer_draft_tokens_total") > accepted
    # each drafter's own: every accepted node was proposed by some drafter, and no drafter's tree
    # alone was accepted deeper than the merged tree
    own = {dict(k)["drafter"]: v for k, v in m["specinfer_drafter_accepted_tokens_total"].items()}
    assert {"speculator-0", "speculator-1"} <= set(own), own
    assert max(own.values()) <= accepted <= sum(own.values())
    assert all(v <= total(m, "specinfer_drafter_draft_tokens_total", drafter=d) for d, v in own.items())

    # the verifier's own step time: one step per manager iteration; the speculators' tree time
    v = scrape(urls["verifier"])
    iterations = total(m, "specinfer_batch_size_count")
    assert total(v, "specinfer_verifier_step_seconds_count") == iterations > 0
    assert total(v, "specinfer_verifier_step_seconds_sum") > 0
    # its wait between two steps of a request: one per step but each request's first, by what the next step
    # was: the 'off' request's steps are plain, and the trees were drafted after the verdicts they follow
    idle = "specinfer_verifier_idle_seconds_count"
    assert total(v, idle) == steps - n
    assert total(v, idle, next="plain") >= streams[-1].usage.verifier_steps - 1
    assert total(v, idle, next="miss") > 0 and total(v, idle, next="hit") == 0
    assert total(v, "specinfer_verifier_idle_seconds_sum", next="miss") > 0
    # the manager's split of its iterations: one per verifier step, the batches the steps had; what it waited
    # for holds what the verifier and the speculators report of their own time (a CPU verifier: no step
    # is sent ahead, so every step runs inside its wait), and both waits fit in the iterations' time
    assert total(m, "specinfer_engine_iterations_total") == iterations
    assert total(m, "specinfer_engine_batched_requests_total") == steps
    part = {dict(k)["part"]: x for k, x in m["specinfer_engine_seconds_total"].items()}
    assert part["verifier_step"] == pytest.approx(total(v, "specinfer_verifier_step_seconds_sum"), rel=1e-6)
    assert part["verifier_wait"] > part["verifier_step"] > 0
    assert part["drafting_wait"] > part["drafting"] > 0
    assert part["all"] > part["verifier_wait"] + part["drafting_wait"]
    assert total(v, "specinfer_verifier_requests") == 0
    assert total(v, "specinfer_kv_cache_free_tokens") == total(v, "specinfer_kv_cache_tokens") > 0
    for name in ("speculator-0", "speculator-1"):
        sp = scrape(urls[name])
        assert 0 < total(sp, "specinfer_speculator_tree_seconds_count") <= iterations, name
        assert total(sp, "specinfer_speculator_trees_total") >= total(sp, "specinfer_speculator_tree_seconds_count")
        assert total(sp, "process_resident_memory_bytes") > 0


def test_the_managers_engine_counters_come_back_whole_from_its_metrics_text():
    from prometheus_client import CollectorRegistry, generate_latest

    from manager_svc.metrics import EngineSplit
    from specinfer.engine import Stats, split
    from specinfer_bench.services import counters_from_text

    stats = Stats()
    for b, m, busy in [(2, 0, 0.004), (1, 3, 0.011), (3, 1, 0.009)]:
        stats.add(b, m, busy, busy / 2, busy / 4 if m else 0.0, 0.0005, busy * 0.6, busy / 3 if m else 0.0)
    stats.predraft_hits, stats.predraft_misses = 5, 2
    registry, exporter = CollectorRegistry(), EngineSplit()
    registry.register(exporter)
    assert counters_from_text(generate_latest(registry).decode())["iterations"] == 0  # no engine yet: none exported
    exporter.stats = lambda: stats
    read = counters_from_text(generate_latest(registry).decode())
    assert read == pytest.approx(stats.counters())
    s = split(read)
    assert s["iterations"] == 3 and s["mean_batch"] == pytest.approx(2.0)
    assert s["ms_per_iteration"] == pytest.approx(8.0) and s["verify_ms"] == pytest.approx(4.0)
    assert s["own_ms"] == pytest.approx(8.0 - 4.8 - (11 + 9) / 9)  # less the waits for the verifier and drafters
    assert s["overhead_ms"] == pytest.approx(8.0 - 4.0 - (11 + 9) / 12)


def test_the_managers_iteration_split_by_batch_size_and_levels_adds_up_to_its_totals():
    from specinfer.engine import Stats

    stats = Stats()
    for b, m, busy in [(2, 0, 0.004), (2, 0, 0.005), (1, 3, 0.011), (2, 1, 0.009), (2, 0, 0.0045)]:
        stats.add(b, m, busy, busy / 2, busy / 4 if m else 0.0)
    s = stats.summary()
    shapes = s["by_batch_and_levels"]
    assert set(shapes) == {"2x0", "1x3", "2x1"}
    assert shapes["2x0"] == {"iterations": 3, "ms": 4.5}
    assert sum(v["iterations"] for v in shapes.values()) == s["iterations"] == 5
    assert sum(v["iterations"] * v["ms"] for v in shapes.values()) == pytest.approx(s["ms_per_iteration"] * 5)
    assert s["mean_batch"] == pytest.approx(9 / 5)
