"""Thin gRPC adapter over the core `Speculator`s: per iteration, one batched tree build per SSM,
the SSMs' trees merged per request, streamed back; where an update asks to draft ahead, then the trees
drafted ahead (`Speculator.draft_ahead`) in a second response.

Per-request SSM state belongs to the stream it came on (keys are "<stream>/<request id>"), so two
managers never collide and a stream that ends, for any reason, frees everything it created.
Model compute runs on one worker thread, never on the event loop.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from specinfer.speculator import DraftRequest, Speculator
from specinfer.tree import TokenTree, merge, validate_expansion
from specinfer_rpc.convert import sampling_from_pb, tree_to_pb, validated
from specinfer_rpc.model_convert import features_from_pb
from specinfer_rpc.metrics import LATENCY_BUCKETS
from specinfer_rpc.model_thread import ModelThread
from specinfer_rpc.server import rpc_errors
from specinfer_rpc.v1 import common_pb2, speculator_pb2, speculator_pb2_grpc

TREE_SECONDS = Histogram("specinfer_speculator_tree_seconds", "building one batch of draft trees (all SSMs, merged)",
                         buckets=LATENCY_BUCKETS)
TREES = Counter("specinfer_speculator_trees", "draft trees built (one per request per iteration)")
REQUESTS = Gauge("specinfer_speculator_requests", "requests with SSM state here")

def merged(trees: list[TokenTree]) -> TokenTree:
    """One SSM's tree as it is, several merged."""
    return trees[0] if len(trees) == 1 else merge(trees)


class SpeculatorServicer(speculator_pb2_grpc.SpeculatorServicer):
    def __init__(self, speculators: list[Speculator], model_names: list[str], thread: ModelThread):
        self.speculators = speculators
        self.model_names = model_names
        self.thread = thread  # the one thread that touches the models and their caches
        self.streams = itertools.count()
        self.keys: set[str] = set()  # every request with state, over all streams (worker thread only)
        REQUESTS.set_function(lambda: len(self.keys))

    @rpc_errors
    async def Speculate(self, request_iterator, context):
        prefix = f"{next(self.streams)}/"
        try:
            async for request in request_iterator:
                start = time.perf_counter_ns()
                batch = [self._draft_request(prefix, u) for u in request.updates]
                releases = [prefix + r for r in request.release]
                trees, later = await self.thread.run(self._draft, releases, batch)
                if batch:
                    TREE_SECONDS.observe((time.perf_counter_ns() - start) / 1e9)
                    TREES.inc(len(batch))
                yield speculator_pb2.SpeculateResponse(
                    iteration=request.iteration, draft_ns=time.perf_counter_ns() - start,
                    trees=[speculator_pb2.DraftTree(request_id=u.request_id, tree=tree_to_pb(t))
                           for u, t in zip(request.updates, trees)])
                if later is not None:  # drafting during the verification of the trees just sent
                    outcomes = await self.thread.run(later)
                    yield speculator_pb2.SpeculateResponse(
                        iteration=request.iteration, drafted_ahead=True,
                        outcomes=[common_pb2.OutcomeTree(request_id=u.request_id, outcome=key, tree=tree_to_pb(t))
                                  for u, ahead in zip(request.updates, outcomes) for key, t in ahead.items()])
        finally:
            await self.thread.run(self._release_stream, prefix)

    def _draft_request(self, prefix: str, u: speculator_pb2.DraftUpdate) -> DraftRequest:
        validate_expansion(list(u.expansion))
        sampling = validated(sampling_from_pb(u.sampling))
        features = [features_from_pb(f, f"features (request {u.request_id})") for f in u.features]
        return DraftRequest(prefix + u.request_id, list(u.new_token_ids), list(u.expansion), sampling,
                            u.replacement, u.drafter, features, u.ahead)

    def _draft(self, releases: list[str], batch: list[DraftRequest]
               ) -> tuple[list[TokenTree], Callable[[], list[dict[tuple[int, ...], TokenTree]]] | None]:
        """Each request's tree, its SSMs' merged; and where some request asks to draft ahead, what does that
        once the trees are sent (on this thread, before anything else runs on these requests): its trees
        by outcome, the SSMs' merged."""
        for key in releases:
            self._release(key)
        self.keys.update(r.request_id for r in batch)
        ahead = any(r.ahead for r in batch)
        drafted = [s.draft_ahead(batch) if ahead and s.drafts_ahead else (s.draft(batch), None)
                   for s in self.speculators]
        trees = [merged(list(t)) for t in zip(*(t for t, _ in drafted))]
        laters = [later for _, later in drafted if later is not None]
        if not laters:
            return trees, None
        return trees, lambda: [{key: merged([o[key] for o in per if key in o]) for o in per for key in o}
                               for per in zip(*(later() for later in laters))]

    def _release(self, key: str) -> None:
        self.keys.discard(key)
        for s in self.speculators:
            s.release(key)

    def _release_stream(self, prefix: str) -> None:
        for key in [k for k in self.keys if k.startswith(prefix)]:
            self._release(key)

    @rpc_errors
    async def GetInfo(self, request, context) -> speculator_pb2.SpeculatorInfo:
        layers = next((s.head.head_cfg.layers for s in self.speculators if s.wants_features), ())
        return speculator_pb2.SpeculatorInfo(model_names=self.model_names,
                                             vocab_size=self.speculators[0].model.cfg.vocab_size,
                                             active_requests=len(self.keys), feature_layers=layers)
