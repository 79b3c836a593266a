"""The manager's Prometheus metrics (served on --metrics-port by specinfer_rpc.server).

Latencies are measured where tokens are produced (the scheduler), from the moment a request is
accepted. Inter-token latency is per token, as in the load client: a chunk of n tokens that comes
dt after the previous one counts as n tokens at dt / n each, so speculation's multi-token chunks
are not mistaken for stalls. Draft and accepted tokens are also counted per tree depth: accepted
at depth d means the accepted path reached depth d, so a depth's acceptance rate is
accepted{depth=d} / draft{depth=d}. The verifier's step time and the speculators' tree time are
on their own services' /metrics.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from specinfer.engine import SPLIT_PARTS, Stats
from specinfer.tree import TokenTree, depths
from specinfer_rpc.metrics import LATENCY_BUCKETS, SIZE_BUCKETS

RUNNING = Gauge("specinfer_requests_running", "requests in the running batch")
WAITING = Gauge("specinfer_requests_waiting", "requests accepted and waiting for admission")
TTFT = Histogram("specinfer_time_to_first_token_seconds", "from acceptance to the first token",
                 buckets=LATENCY_BUCKETS)
ITL = Histogram("specinfer_inter_token_latency_seconds", "per generated token after the first chunk",
                buckets=LATENCY_BUCKETS)
E2E = Histogram("specinfer_request_latency_seconds", "from acceptance to the last token", buckets=LATENCY_BUCKETS)
QUEUE = Histogram("specinfer_request_queue_seconds", "from acceptance to admission into the batch",
                  buckets=LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("specinfer_prompt_tokens", "prompt tokens of admitted requests")
CACHED_TOKENS = Counter("specinfer_prompt_cached_tokens", "of those, the tokens whose KV entries the verifier's prefix "
                        "cache held (hit rate = this / specinfer_prompt_tokens)")
PREEMPTIONS = Counter("specinfer_preemptions", "running requests preempted (state freed, record prefilled again on "
                      "resuming), by why: memory (the verifier's KV cache), priority, turn (fair turns)", ["why"])
KV_BLOCKS = Gauge("specinfer_kv_cache_blocks_used", "verifier KV blocks the running requests' next steps can hold "
                  "(this manager's count: records and largest draft trees)")
GENERATION_TOKENS = Counter("specinfer_generation_tokens", "tokens streamed to clients")
FINISHED = Counter("specinfer_requests_finished", "requests ended, by reason (eos, stop, length, cancelled, failed)",
                   ["reason"])
DRAFT_TOKENS = Counter("specinfer_draft_tokens", "draft tree nodes sent to the verifier, by tree depth", ["depth"])
ACCEPTED_TOKENS = Counter("specinfer_accepted_tokens", "draft tokens accepted, by tree depth", ["depth"])
DRAFTER_TOKENS = Counter("specinfer_drafter_draft_tokens", "draft tree nodes each drafter proposed (speculator-i in "
                         "the order of --speculators, lookup: context lookup, grammar: a grammar's forced tokens, "
                         "prediction: a request's prediction)",
                         ["drafter"])
DRAFTER_ACCEPTED = Counter("specinfer_drafter_accepted_tokens", "of those, the nodes the LLM accepted: each drafter's "
                           "own acceptance, as deep as its tree alone would have been accepted", ["drafter"])
TOKENS_PER_STEP = Histogram("specinfer_tokens_per_step", "tokens a request gets from one verifier step "
                            "(mean tokens per step = sum / count)", buckets=SIZE_BUCKETS)
BATCH_SIZE = Histogram("specinfer_batch_size", "requests per verifier step", buckets=SIZE_BUCKETS)
ITERATION = Histogram("specinfer_iteration_seconds", "one scheduler iteration (draft + verify + stream)",
                      buckets=LATENCY_BUCKETS)


class EngineSplit:
    """Where the engine's iterations went (`Stats.counters`), read at each scrape, so an iteration pays
    nothing for it: iterations, requests over them, and seconds by part. A part's rate over that of
    `all` is its share: `verifier_step` and `drafting` are the verifier's and the slowest speculator's
    own figures, `verifier_wait` and `drafting_wait` what the engine spent awaiting them (their own
    time, and the RPC, queues and threads on both sides), and `all` less the two waits is the
    manager's own work (planning, merging, committing, protobuf). Where plain steps are sent ahead, a
    step runs while the manager does other work, so the wait for it is shorter than the step: the
    hop (wait less step) then reads below zero. Each counter is read as it stands: a scrape during an
    iteration may count part of it."""

    def __init__(self):
        self.stats: Callable[[], Stats] | None = None  # the engine's (set when the manager starts)

    def describe(self):  # the names, for the registry's clash check (collect yields none before the engine is set)
        return self._families(dict.fromkeys(("iterations", "batched", "predraft_hits", "predraft_misses", *SPLIT_PARTS),
                                            0.0))

    def collect(self):
        if self.stats is None:
            return []
        return self._families(self.stats().counters())

    @staticmethod
    def _families(counters: dict[str, float]) -> list:
        seconds = CounterMetricFamily("specinfer_engine_seconds", "the iterations' wall time (all), and of it: the "
                                      "verifier's own step (verifier_step) and the wait for its answer (verifier_wait), "
                                      "the slowest speculator's own drafting (drafting) and the wait for the trees "
                                      "(drafting_wait), constrained requests' grammars (grammar)", labels=["part"])
        for part in SPLIT_PARTS:
            seconds.add_metric([part], counters[part])
        return [CounterMetricFamily("specinfer_engine_iterations", "speculative iterations (one verifier step each)",
                                    value=counters["iterations"]),
                CounterMetricFamily("specinfer_engine_batched_requests", "requests over those iterations (mean batch "
                                    "= this / specinfer_engine_iterations_total)", value=counters["batched"]),
                CounterMetricFamily("specinfer_predraft_hits", "drafting during verification (--draft-ahead): request "
                                    "steps whose every drafter had drafted their tree ahead, for the outcome the step "
                                    "before emitted (the step left without waiting for them)", value=counters["predraft_hits"]),
                CounterMetricFamily("specinfer_predraft_misses", "request steps for which some drafter had drafted ahead "
                                    "and not for the outcome the step before emitted", value=counters["predraft_misses"]),
                seconds]


ENGINE = EngineSplit()
REGISTRY.register(ENGINE)


def drafter_label(number: int, speculators: int) -> str:
    """A drafter's label: its number as the engine counts drafters (the draft trees' proposer bits)."""
    return f"speculator-{number}" if number < speculators else ("lookup", "grammar", "prediction")[number - speculators]


@functools.cache
def labelled(metric: Counter, label: int | str) -> Counter:
    """The metric's child for `label`, looked up once: prometheus_client's labels() takes a lock and
    builds its key on every call, and a step makes about a dozen such updates per request."""
    return metric.labels(str(label))


def record_step(tree: TokenTree, emitted: int, accepted: int, first: bool, since_last: float,
                drafters: dict[int, tuple[int, int]], speculators: int) -> None:
    """One request's step: the tree it verified, the tokens streamed, how many were drafts, the time
    since its previous chunk (since acceptance for the first), and each drafter's (accepted, drafted)."""
    for d, n in collections.Counter(depths(tree.parents)).items():  # one labelled update per depth, not per node
        labelled(DRAFT_TOKENS, d).inc(n)
    for d in range(1, accepted + 1):
        labelled(ACCEPTED_TOKENS, d).inc()
    for number, (hit, drafted) in drafters.items():
        label = drafter_label(number, speculators)
        labelled(DRAFTER_TOKENS, label).inc(drafted)
        labelled(DRAFTER_ACCEPTED, label).inc(hit)
    TOKENS_PER_STEP.observe(emitted)
    GENERATION_TOKENS.inc(emitted)
    if first:
        TTFT.observe(since_last)
    elif emitted:
        for _ in range(emitted):
            ITL.observe(since_last / emitted)
