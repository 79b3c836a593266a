"""python -m manager_svc --verifier 127.0.0.1:50053 --speculators 127.0.0.1:50052,127.0.0.1:50054"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from dataclasses import dataclass

from tokenizers import Tokenizer

from specinfer.checkpoints import DEFAULT_LLM, checkpoint_dir
from specinfer.controller import SpeculationController
from specinfer.engine import PREFILL_CHUNK, SpeculativeEngine, default_tree_budget, steps_ahead_for
from specinfer.prediction import prediction_tokens
from specinfer.grammar import Grammars
from specinfer.lookup import CHAIN_TOKENS
from specinfer.tree import validate_expansion
from specinfer_rpc.config import ServerConfig, load_config, option
from specinfer_rpc.security import BearerToken, channel_credentials
from specinfer_rpc.server import run, serve
from specinfer_rpc.v1 import generation_pb2, generation_pb2_grpc

from . import metrics
from .clients import VerifierClient
from .discovery import parse_target
from .replicas import SpeculatorReplicas
from .scheduler import Scheduler
from .servicer import GenerationServicer

log = logging.getLogger("specinfer.manager")


@dataclass
class ManagerConfig(ServerConfig):
    """The manager service: the public Generation API, continuous batching, tree merge, admission."""

    verifier: str = option("127.0.0.1:50053", "verifier address")
    speculators: list[str] = option([], "speculators, comma-separated, one entry per SSM (merged): host:port, "
                                        "host:port|host:port|... (replicas of one SSM), or dns://[server]/name:port "
                                        "(replicas: SRV _grpc._tcp.name, else every A/AAAA address of name); "
                                        "none: context lookup alone (with --no-context-lookup too: incremental decoding)")
    discovery_interval: float = option(5.0, "seconds between DNS lookups of speculator replicas")
    auth_token: str = option("", "bearer token clients must send (metadata authorization: Bearer <token>); empty: none",
                             repr=False)  # never printed with the configuration
    tokenizer: str = option(DEFAULT_LLM, "the LLM's checkpoint (directory, .gguf file or the default), for its tokenizer")
    expansion: list[int] = option([2, 1, 1], "default expansion config k_1,...,k_m (for the default LLM and its drafter "
                                             "on a CPU; see bench/results/services_defaults_cpu.md)")
    tree_budget: int = option(0, "tree nodes per iteration, shared by the batch (cuts each request's tree); 0: by the "
                                 "verifier's device, 16 on a CPU (on the default 2,1,1: the whole tree for 1-2 "
                                 "requests, 2 levels for 3-4, 1 for 5-8, none from 9: plain incremental), 256 on a "
                                 "GPU, where a step of hundreds of rows costs little more than one of a row per "
                                 "request (the whole tree up to 42 requests, 2 levels at 64)")
    adaptive: bool = option(True, "choose each iteration's depth of the server's trees (down to none, or context "
                                  "lookup's chain alone without asking the speculators) from a cost model fitted "
                                  "online and the measured acceptance; off: the whole expansion within the tree budget")
    context_lookup: bool = option(True, "also draft, here, from each request's own earlier text: the tokens that followed "
                                        "the latest earlier occurrence of its last 1-3 tokens, a chain as deep as the "
                                        "speculators' trees (or --lookup-tokens), merged with them (code and loops repeat; "
                                        "a 1-layer SSM cannot copy from its context); with no speculators, the only "
                                        "drafter: an LLM without a drafter model of its own still speculates")
    lookup_tokens: int = option(CHAIN_TOKENS, "the longest chain context lookup drafts per step, whatever the trees' "
                                              "depth (it costs no drafting, only verified rows; the cost model "
                                              "measures its acceptance that deep); 0: as deep as the step's trees")
    kv_cache_share: float = option(1.0, "fraction of the verifier's KV cache this manager may reserve "
                                        "(1/N with N managers on one verifier)")
    max_batch: int = option(32, "requests decoded together")
    max_queue: int = option(256, "requests waiting beyond the batch; past it RESOURCE_EXHAUSTED")
    max_unread_chunks: int = option(256, "chunks a stream may queue that its client has not read (beyond what gRPC "
                                         "and the socket buffers hold); past it the request is cancelled and the "
                                         "client gets RESOURCE_EXHAUSTED after the queued chunks (0: no cap)")
    max_prefill_tokens: int = option(4096, "prompt tokens admitted per iteration (a chunked prompt counts its first chunk)")
    prefill_chunk: int = option(PREFILL_CHUNK, "a prompt (or a preempted request's record) longer than this goes to the verifier "
                                     "in chunks of this many tokens, one a step beside the running requests' steps, "
                                     "so it does not stall them for its whole prefill (0: whole)")
    default_max_new_tokens: int = option(0, "max_new_tokens when a request leaves it unset (0: the rest of the "
                                            "context, as much as the verifier's KV cache can hold beside the prompt)")
    max_new_tokens_cap: int = option(0, "largest max_new_tokens accepted (0: the rest of the context)")
    kv_watermark: float = option(0.01, "share of the verifier's KV cache admission leaves free for the running "
                                       "requests' growth (past it, requests wait; when growth still overflows, the "
                                       "newest of the lowest priority is preempted and resumes later)")
    turn_tokens: int = option(32, "fair turns: while requests wait for a full batch, one preempts a running request "
                                  "of the same priority whose output holds this many tokens more, in whole turns "
                                  "(so short requests never wait behind long ones for long); 0: only priority "
                                  "preempts")
    steps_ahead: str = option("auto", "where every request of a step decodes plainly and so will the next, send the next "
                                      "to the verifier before this one is answered (async scheduling: the hop and this "
                                      "manager's work overlap the verifier's steps instead of standing between them): on, "
                                      "off, or auto: on when the verifier runs on a GPU (on a CPU its threads use every "
                                      "core, and the overlap slows its steps as much as it saves)")
    draft_ahead: int = option(0, "drafting during verification: the speculators draft each tree's next trees for this "
                                 "many of the likeliest outcomes of verifying it, and a step whose outcome they drafted "
                                 "for leaves without waiting for them (greedy requests on fixed trees; 0: off). The "
                                 "adaptive controller drafts ahead on the steps where it prices it faster")
    outcome_steps: bool = option(False, "with --draft-ahead: a step whose every request verifies a tree drafted by "
                                        "the speculators sends the next step before its answer, with the trees drafted "
                                        "ahead as candidates; the verifier verifies the outcome's, or skips a request "
                                        "none was drafted for (sent again with a tree)")
    verify_timeout: float = option(60.0, "seconds a verify step may take before its requests fail UNAVAILABLE")
    speculate_timeout: float = option(10.0, "seconds a speculator may take before its trees are skipped")
    startup_timeout: float = option(120.0, "seconds to wait for the verifier at start")
    port: int = option(50051, "port to listen on (0: any free port)")
    max_message_bytes: int = option(4 << 20, "largest gRPC message accepted or sent")
    internal_message_bytes: int = option(16 << 20, "largest gRPC message to or from the verifier and the speculators "
                                                   "(a verifier's answer carries up to its --feature-bytes, 8 MiB, of "
                                                   "features for feature speculators)")
    grace: float = option(30.0, "seconds in-flight streams get to finish on SIGTERM")


def stop_if_scheduler_ends(task: asyncio.Task) -> None:
    """The scheduler loop runs until shutdown; if it ends otherwise no stream would ever get a
    token again, so stop the manager (it drains, exits and is restarted) instead of serving nothing."""
    if not task.cancelled():
        log.critical("the scheduler loop ended: %r; stopping", task.exception())
        os.kill(os.getpid(), signal.SIGTERM)


async def main(cfg: ManagerConfig) -> None:
    validate_expansion(cfg.expansion)
    if not 0 < cfg.kv_cache_share <= 1:
        raise ValueError(f"kv_cache_share: must be in (0, 1], got {cfg.kv_cache_share}")
    if not 0 <= cfg.kv_watermark < 1:
        raise ValueError(f"kv_watermark: must be in [0, 1), got {cfg.kv_watermark}")
    if cfg.turn_tokens < 0:
        raise ValueError(f"turn_tokens: must be >= 0, got {cfg.turn_tokens}")
    steps_ahead_for("", cfg.steps_ahead)  # a setting it does not know: refused before anything starts
    if cfg.tree_budget < 0:
        raise ValueError(f"tree_budget: must be >= 0 (0: by the verifier's device), got {cfg.tree_budget}")
    targets = [parse_target(entry) for entry in cfg.speculators]
    credentials = channel_credentials(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)  # to the verifier and speculators
    verifier = VerifierClient(cfg.verifier, cfg.verify_timeout, cfg.internal_message_bytes, credentials)
    log.info("waiting for the verifier at %s", cfg.verifier)
    vinfo = await verifier.info(wait=cfg.startup_timeout)
    tree_budget = default_tree_budget(vinfo.device, cfg.tree_budget)
    steps_ahead = steps_ahead_for(vinfo.device, cfg.steps_ahead)
    speculators = [SpeculatorReplicas(t, i, cfg.speculate_timeout, cfg.internal_message_bytes, credentials,
                                      tuple(vinfo.feature_layers)) for i, t in enumerate(targets)]
    await asyncio.gather(*(s.refresh() for s in speculators))
    lookup = cfg.context_lookup  # with no speculators, the only drafter (beside grammars and predictions)
    tokenizer = Tokenizer.from_file(str(checkpoint_dir(cfg.tokenizer) / "tokenizer.json"))
    grammars = Grammars(tokenizer.to_str(), vinfo.vocab_size, list(vinfo.eos_token_ids))
    engine = SpeculativeEngine(verifier, speculators, set(vinfo.eos_token_ids), cfg.expansion, tree_budget,
                               SpeculationController(lookup=lookup, chain=cfg.lookup_tokens, trees=bool(speculators),
                                                     ahead=cfg.draft_ahead > 0)
                               if cfg.adaptive and (speculators or lookup) else None,
                               lookup, cfg.lookup_tokens, grammars, cfg.prefill_chunk, steps_ahead,
                               prediction_tokens(vinfo.device), cfg.draft_ahead, cfg.outcome_steps)
    scheduler = Scheduler(engine, cfg.max_batch, cfg.max_queue, cfg.max_prefill_tokens,
                          kv_tokens=max(1, int(vinfo.kv_cache_tokens * cfg.kv_cache_share)) if vinfo.kv_cache_tokens else 0,
                          kv_block_size=max(vinfo.kv_block_size, 1), max_unread=cfg.max_unread_chunks,
                          kv_watermark=cfg.kv_watermark, turn_tokens=cfg.turn_tokens)
    info = generation_pb2.ModelInfo(
        model_name=vinfo.model_name, vocab_size=vinfo.vocab_size, context_length=vinfo.context_length,
        eos_token_ids=vinfo.eos_token_ids, default_max_new_tokens=cfg.default_max_new_tokens,
        max_new_tokens_cap=cfg.max_new_tokens_cap, expansion=cfg.expansion, tree_budget=tree_budget,
        context_lookup_mask=1 << engine.lookup_source if lookup else 0, grammar_mask=1 << engine.grammar_source,
        prediction_mask=1 << engine.prediction_source)
    metrics.RUNNING.set_function(lambda: len(scheduler.running))
    metrics.WAITING.set_function(lambda: len(scheduler.waiting))
    metrics.ENGINE.stats = lambda: engine.stats
    servicer = GenerationServicer(scheduler, tokenizer, info)
    tasks = [asyncio.create_task(scheduler.run())]
    tasks[0].add_done_callback(stop_if_scheduler_ends)
    tasks += [asyncio.create_task(s.discover(cfg.discovery_interval)) for s in speculators]
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    auth = (BearerToken(cfg.auth_token, f"/{service}/"),) if cfg.auth_token else ()
    try:
        await serve("manager", cfg, [(generation_pb2_grpc.add_GenerationServicer_to_server, servicer, service)], auth)
    finally:
        for task in tasks:
            task.cancel()
        log.info("scheduler stats %s", json.dumps(engine.stats.summary()))
        if engine.controller is not None:
            log.info("controller stats %s", json.dumps(engine.controller.summary()))
        await asyncio.gather(verifier.close(), *(c.close() for c in speculators))


if __name__ == "__main__":
    run(main(load_config(ManagerConfig, prog="python -m manager_svc")))
