"""The tensor- and pipeline-parallel verifier (torch.distributed, gloo on CPU): its logits are the
single process's within float tolerance, its greedy outputs through the real services are the
LLM's own, and a rank that dies makes requests fail UNAVAILABLE promptly, never hang."""

from __future__ import annotations

import asyncio
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

LAYOUTS = [(2, 1), (1, 2), (2, 2)]
LOGITS_ATOL = 1e-4  # float32; sums split over ranks reorder additions


def batches() -> list[list[VerifyRequest]]:
    """A prefill of two prompts, then a step with trees for both."""
    return [[VerifyRequest("a", list(range(5, 60))), VerifyRequest("b", list(range(300, 320)))],
            [VerifyRequest("a", [], TokenTree([7, 8, 9, 10], [-1, 0, 0, 2])), VerifyRequest("b", [], TokenTree([3], [-1]))]]


def captured_logits(verifier) -> list[torch.Tensor]:
    """Run the batches; return the logits [R, V] each step decided on (None where this rank has none)."""
    seen = []
    decide = verifier.decide
    verifier.decide = lambda batch, logits, starts: (seen.append(logits), decide(batch, logits, starts))[1]
    for batch in batches():
        verifier.step(batch)
    return seen


def _rank(rank: int, tp: int, pp: int, init_method: str, results) -> None:
    verifier = _build(RankLayout(tp, pp, rank), init_method, 60.0, str(MODELS / "llm"), torch.float32,
                      torch.device("cpu"), 4096, 1)
    logits = captured_logits(verifier)
    if rank == verifier.layout.leader:  # as numpy: torch tensors would be shared with the exiting process
        results.put([step.numpy() for step in logits])
    dist.barrier()  # every send has been received: no gloo work is pending at exit (it aborted once)
    dist.destroy_process_group()


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_parallel_logits_match_the_single_process(tp, pp):
    want = captured_logits(Verifier(LlamaModel.from_pretrained(MODELS / "llm"), 4096))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, tp, pp, init, results)) for r in range(tp * pp)]
    for p in procs:
        p.start()
    got = results.get(timeout=120)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), w, atol=LOGITS_ATOL, rtol=0)


def system(tp: int, pp: int):
    return launch(MODELS / "llm", [MODELS / "ssm-0"], speculators=1, port=0,
                  verifier_args=["--tp", str(tp), "--pp", str(pp), "--threads", "1", "--device", rank_device(tp * pp)])


def rank_device(ranks: int) -> str:
    """NCCL runs one rank per GPU: with fewer GPUs than ranks the group runs on the CPU (gloo)."""
    return "cuda" if torch.cuda.device_count() >= ranks else "cpu"


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_parallel_verifier_greedy_outputs_through_the_services(heldout_ids, tp, pp):
    prompts = heldout_ids[:6]
    s = system(tp, pp)
    try:
        streams = generate_all(s.manager.address, [Request(p, 32) for p in prompts], "1,1,3,1")
    finally:
        s.stop()
    want = reference_greedy(prompts, 32)
    assert [x.token_ids for x in streams] == want
    assert sum(x.usage.verifier_steps for x in streams) < 0.7 * sum(len(w) for w in want), "trees were verified"


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
