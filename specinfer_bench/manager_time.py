"""Where the manager's own time per iteration goes, apart from its RPCs: the engine's iteration
(plan, the cost-model controller, merge, commit) over stand-in drafters and a verifier that answer
at once, with and without the controller, and the protobuf work of a Verify step on both sides.
`specinfer_bench.services` reports the whole overhead (the iteration minus the verifier's and the
speculators' own time: the verifier's parsing and answering count in it, since its step time is the
model's); what these leave of it is the RPC transport and the streams to the clients.

    python -m specinfer_bench.manager_time --out bench/results/manager_time_cpu
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from specinfer.acceptance import Verdict
from specinfer.controller import SpeculationController
from specinfer.engine import Check, Request, Sequence, SpeculativeEngine, Verified
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree
from specinfer_rpc.v1 import verifier_pb2
from manager_svc.clients import verified, verify_request
from verifier_svc.servicer import verify_requests, verify_response

from .report import command_line, machine


TREE = TokenTree([5, 6, 7, 8], [-1, -1, 0, 2])
TREE16 = TokenTree(list(range(100, 116)), [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])


class InstantVerifier:
    async def verify(self, checks, release):
        return [Verified([7, 8]) for _ in checks], 1_000_000

    async def release(self, request_ids):
        pass


class InstantDrafter:
    connected = True
    wants_features = False
    draft_ns = 1000

    async def draft(self, drafts):
        return {d.request_id: TREE for d in drafts}

    def release(self, request_id):
        pass

    async def flush(self):
        pass


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def iteration_us(batch: int, controller: bool, repeats: int) -> float:
    """The engine's iteration with the manager's defaults (2,1,1 within a 16-node budget, context
    lookup), 100-token records."""
    engine = SpeculativeEngine(InstantVerifier(), [InstantDrafter()], set(), [2, 1, 1], 16,
                               SpeculationController(lookup=True) if controller else None, True)
    seqs = [Sequence(Request(list(range(100, 200)), 10**6, id=str(i)), None) for i in range(batch)]
    loop = asyncio.new_event_loop()
    try:
        for _ in range(50):  # past the controller's first looks
            loop.run_until_complete(engine.iteration(seqs))
        return median_us(lambda: loop.run_until_complete(engine.iteration(seqs)), repeats)
    finally:
        loop.close()


def verify_hop_us(batch: int, repeats: int) -> tuple[float, float]:
    """The protobuf work of one Verify step, on each side: the manager's (build and serialize the
    message, read the answer) and the verifier's (parse and check the message, build and serialize
    the answer), with the services' own functions; 16-node trees, requests at temperature 0.8."""
    checks = [Check(str(i), [7], 400, TREE16, SamplingParams(0.8, seed=i)) for i in range(batch)]
    wire = verify_request("ns/", checks, []).SerializeToString()
    verdicts = [Verdict([0, 1], [5, 6, 9]) for _ in checks]
    answer = verify_response(verify_requests(verifier_pb2.VerifyRequest.FromString(wire), 50000), verdicts,
                             1000).SerializeToString()

    def manager():
        verify_request("ns/", checks, []).SerializeToString()
        verified(checks, verifier_pb2.VerifyResponse.FromString(answer))

    def verifier():
        requests = verify_requests(verifier_pb2.VerifyRequest.FromString(wire), 50000)
        verify_response(requests, verdicts, 1000).SerializeToString()
    return median_us(manager, repeats), median_us(verifier, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--out", type=Path, default=None, help="write OUT.md")
    args = p.parse_args()
    lines = [f"# The manager's own time per iteration, without its RPCs ({machine()})", "",
             f"`{command_line('python -m specinfer_bench.manager_time', None)}`", "",
             "Medians of the engine's iteration over stand-ins that answer at once (2,1,1 within a 16-node "
             "budget, context lookup, 100-token records) and of a Verify step's protobuf work on each side "
             "(16-node trees, sampled requests; `verify_hop_us`).", "",
             "| batch | iteration with the controller us | without it us | Verify hop's protobuf, manager us | verifier us |",
             "| --- | --- | --- | --- | --- |"]
    for b in [int(x) for x in args.batches.split(",")]:
        manager, verifier = verify_hop_us(b, args.repeats)
        lines.append(f"| {b} | {iteration_us(b, True, args.repeats):.0f} | {iteration_us(b, False, args.repeats):.0f} "
                     f"| {manager:.0f} | {verifier:.0f} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
