"""Helpers for the service tests: the real system in separate processes, its clients, and the
reference outputs of the LLM alone."""

from __future__ import annotations

import grpc

from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel
from specinfer_rpc.v1 import speculator_pb2, speculator_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from .conftest import MODELS


def reference_greedy(prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
    """The LLM's own incremental greedy decoding (in-process, fp32)."""
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    gens = Engine(llm, mode=Mode.INCREMENTAL).generate([Request(p, max_new_tokens, ignore_eos=ignore_eos)
                                                        for p in prompts])
    return [g.token_ids for g in gens]


def seeded_reference(request: Request) -> list[int]:
    """Plain seeded sampling: the LLM alone (in-process, fp32, no speculation) on a sampled request."""
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    return Engine(llm, mode=Mode.INCREMENTAL).generate([request])[0].token_ids


def active_requests(system) -> dict[str, int]:
    """Requests holding state on each verifier and speculator process."""
    out = {}
    for s in system.services:
        if s.name == "manager" or s.http:  # the manager holds records, not model state; the gateway neither
            continue
        with grpc.insecure_channel(s.address) as channel:
            if s.name == "verifier":
                info = verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10)
            else:
                info = speculator_pb2_grpc.SpeculatorStub(channel).GetInfo(
                    speculator_pb2.GetSpeculatorInfoRequest(), timeout=10)
        out[s.name] = info.active_requests
    return out
