"""The tensor- and pipeline-parallel verifier (torch.distributed, gloo on CPU): its logits and the
features it returns for a feature drafter are the single process's within float tolerance, its
greedy outputs through the real services are the LLM's own (with a feature speculator too), and a
rank that dies makes requests fail UNAVAILABLE promptly, never hang."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import time

import grpc
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specinfer.generate import Request
from specinfer.model import LlamaModel
from specinfer.parallel import RankLayout
from specinfer.tree import TokenTree
from specinfer.verifier import Verifier, VerifyRequest
from specinfer_rpc.client import connect, generate_all, request_pb
from specinfer_rpc.launch import launch
from verifier_svc.workers import _build, _free_port

from .conftest import MODELS
from .services import reference_greedy
from .test_feature_drafter import write_random_head
from .test_metrics import scrape, total

LAYOUTS = [(2, 1), (1, 2), (2, 2)]
LOGITS_ATOL = 1e-4  # float32; sums split over ranks reorder additions
FEATURES = (6, 1, 4)  # of the fixture LLM's 8 layers; not in order: the columns follow the order asked


def batches() -> list[list[VerifyRequest]]:
    """A prefill of two prompts, then a step with trees for both."""
    return [[VerifyRequest("a", list(range(5, 60))), VerifyRequest("b", list(range(300, 320)))],
            [VerifyRequest("a", [], TokenTree([7, 8, 9, 10], [-1, 0, 0, 2])), VerifyRequest("b", [], TokenTree([3], [-1]))]]


def captured_logits(verifier) -> list[torch.Tensor]:
    """Run the batches; return the logits [R, V] each step decided on (None where this rank has none)."""
    seen = []
    forward = verifier.forward
    verifier.forward = lambda items: (seen.append(logits := forward(items)), logits)[1]
    for batch in batches():
        verifier.step(batch)
    return seen


def returned_features(verifier) -> list[tuple[int, torch.Tensor]]:
    """Run the batches asking for features; return each verdict's (start, rows)."""
    return [(v.features.start, v.features.rows) for batch in batches()
            for v in verifier.step([dataclasses.replace(r, features=True) for r in batch])]


def _rank(rank: int, tp: int, pp: int, init_method: str, results, features: bool) -> None:
    verifier = _build(RankLayout(tp, pp, rank), init_method, 60.0, str(MODELS / "llm"), torch.float32,
                      torch.device("cpu"), 4096, 1, FEATURES if features else ())
    # as numpy: torch tensors would be shared with the exiting process
    if features:
        got = returned_features(verifier)
        if rank == 0:  # the serving process
            results.put([(start, rows.numpy()) for start, rows in got])
    else:
        logits = captured_logits(verifier)
        if rank == verifier.layout.leader:
            results.put([step.numpy() for step in logits])
    dist.barrier()  # every send has been received: no gloo work is pending at exit (it aborted once)
    dist.destroy_process_group()


def run_ranks(tp: int, pp: int, features: bool):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, tp, pp, init, results, features)) for r in range(tp * pp)]
    for p in procs:
        p.start()
    got = results.get(timeout=120)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_parallel_logits_match_the_single_process(tp, pp):
    want = captured_logits(Verifier(LlamaModel.from_pretrained(MODELS / "llm"), 4096))
    got = run_ranks(tp, pp, features=False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), w, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_parallel_features_match_the_single_process(tp, pp):
    """Each stage's layers come from the rank that holds them, in the order asked."""
    want = returned_features(Verifier(LlamaModel.from_pretrained(MODELS / "llm"), 4096, feature_layers=FEATURES))
    got = run_ranks(tp, pp, features=True)
    assert [start for start, _ in got] == [start for start, _ in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), w, atol=LOGITS_ATOL, rtol=0)


def system(tp: int, pp: int, heads=(), kv_tokens: int = 65536, manager_args: list[str] = ()):
    return launch(MODELS / "llm", [MODELS / "ssm-0"], speculators=1, port=0, heads=heads, manager_args=manager_args,
                  verifier_args=["--tp", str(tp), "--pp", str(pp), "--threads", "1", "--device", rank_device(tp * pp),
                                 "--kv-cache-tokens", str(kv_tokens)])


def rank_device(ranks: int) -> str:
    """NCCL runs one rank per GPU: with fewer GPUs than ranks the group runs on the CPU (gloo)."""
    return "cuda" if torch.cuda.device_count() >= ranks else "cpu"


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_parallel_verifier_greedy_outputs_through_the_services(heldout_ids, tp, pp):
    """On a pool that holds about two of the requests at their longest: they are preempted as they
    grow, resume with the prefix cache's blocks, and the outputs are the LLM's own."""
    prompts = heldout_ids[:6]
    s = system(tp, pp, kv_tokens=2 * max(-(-(len(p) + 32 + 16) // 16) * 16 for p in prompts))
    try:
        streams = generate_all(s.manager.address, [Request(p, 32) for p in prompts], "1,1,3,1")
    finally:
        s.stop()
    want = reference_greedy(prompts, 32)
    assert [x.token_ids for x in streams] == want
    assert sum(x.usage.preemptions for x in streams) > 0
    assert sum(x.usage.verifier_steps for x in streams) < 0.7 * sum(len(w) for w in want), "trees were verified"


def test_parallel_verifier_with_a_feature_speculator_greedy_outputs_are_the_llms_own(heldout_ids, tmp_path):
    """TP 2 x PP 2: the head's features come from both stages; SSM 0 and the head draft together."""
    write_random_head(tmp_path / "head", LlamaModel.from_pretrained(MODELS / "llm").cfg, seed=0, scale=4.0)
    prompts = heldout_ids[:4]
    s = system(2, 2, heads=[tmp_path / "head"])
    try:
        streams = generate_all(s.manager.address, [Request(p, 32) for p in prompts], "2,2,1")
    finally:
        s.stop()
    assert [x.token_ids for x in streams] == reference_greedy(prompts, 32)
    assert sum(x.usage.verifier_steps for x in streams) < sum(len(x.token_ids) for x in streams), "trees were verified"


def test_parallel_verifier_with_drafting_ahead_greedy_outputs_are_the_llms_own(heldout_ids):
    """TP 2: drafting during verification touches the manager and the speculators only; on a fixed tree
    (which always drafts ahead) steps hit and leave without the speculator, and on the server's trees (where
    the controller weighs it) too, the outputs are the LLM's own."""
    prompts = heldout_ids[:4]
    s = system(2, 1, manager_args=["--draft-ahead", "4"])
    try:
        fixed = generate_all(s.manager.address, [Request(p, 32) for p in prompts], "2,1,1")
        hits = total(scrape(s.manager.metrics), "specinfer_predraft_hits_total")
        server = generate_all(s.manager.address, [Request(p, 32) for p in prompts])
    finally:
        s.stop()
    want = reference_greedy(prompts, 32)
    assert [x.token_ids for x in fixed] == want and [x.token_ids for x in server] == want
    assert hits > 0


def worker_pids(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in children if "spawn_main" in open(f"/proc/{c}/cmdline").read()]


def test_killing_a_rank_fails_requests_unavailable_promptly(heldout_ids):
    s = system(1, 2)
    try:
        verifier = s.by_name("verifier")
        ranks = worker_pids(verifier.process.pid)
        assert len(ranks) == 1

        async def go():
            call = connect(s.manager.address).Generate(request_pb(Request(heldout_ids[0], 500, ignore_eos=True), "off"),
                                                       timeout=60)
            await call.read()  # the request is running: its first tokens came
            killed = time.monotonic()
            os.kill(ranks[0], signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as failure:
                while await call.read() is not grpc.aio.EOF:
                    pass
            return failure.value.code(), time.monotonic() - killed

        code, after = asyncio.run(go())
        assert code == grpc.StatusCode.UNAVAILABLE
        assert after < 10
        verifier.process.wait(30)  # rank 0 stops itself so that the group is restarted whole
    finally:
        s.stop()
