"""python -m speculator_svc --ssm models/ssm-0 --port 50052"""

from __future__ import annotations

from specinfer_rpc.openmp import bound_spin

bound_spin()  # before torch is imported (see openmp.py)

from dataclasses import dataclass
from pathlib import Path

from specinfer.checkpoints import DEFAULT_LLM, same_tokenizer, served_ssms
from specinfer.devices import resolve_device, resolve_dtype
from specinfer.eagle import EagleHead
from specinfer.engine import PREFILL_CHUNK
from specinfer.feature_drafter import FeatureSpeculator
from specinfer.model import LlamaModel
from specinfer.speculator import Speculator
from specinfer_rpc.config import load_config, option
from specinfer_rpc.model_config import ModelServerConfig
from specinfer_rpc.model_thread import ModelThread
from specinfer_rpc.server import run, serve
from specinfer_rpc.v1 import speculator_pb2, speculator_pb2_grpc

from .servicer import SpeculatorServicer


@dataclass
class SpeculatorConfig(ModelServerConfig):
    """The speculator service: SSMs building draft token trees for batches of requests."""

    ssm: list[str] = option([str(p) for p in served_ssms()],
                            "SSM checkpoints (comma-separated; directories or .gguf files); their trees are merged")
    head: list[str] = option([], "feature drafters: EAGLE-3 heads of the LLM (published layout, comma-separated), "
                                 "merged with the SSMs' trees; the service then reads the LLM's features (--ssm= "
                                 "for a service of heads alone)")
    llm: str = option(DEFAULT_LLM, "with --head: the LLM the heads draft for (its config and embedding are read)")
    q_top: int = option(32, "sampled requests: q is truncated to its most likely q_top tokens (the draws of MSS "
                               "requests; the guess of the coupled sample of the others)")
    dynamic_tree: bool = option(False, "EAGLE-2's dynamic trees for requests with top-k drafts: the manager's expansion "
                                       "read as a budget (its depth and node count), filled with the drafter's most "
                                       "probable paths")
    prefill_chunk: int = option(PREFILL_CHUNK, "a request with more tokens to catch up on than this (a long prompt) is "
                                               "fed this many per draft and gets no tree until it has caught up, so it "
                                               "does not stall the batch's other requests (0: all at once; the "
                                               "manager's --prefill-chunk does the same on the verifier)")
    port: int = option(50052, "port to listen on (0: any free port)")


def build(cfg: SpeculatorConfig) -> list[Speculator]:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    models = [LlamaModel.from_pretrained(d, dtype=dtype, device=device) for d in cfg.ssm]
    try:
        for d in cfg.ssm[1:]:
            same_tokenizer(cfg.ssm[0], d)
        heads = [EagleHead.for_llm(h, cfg.llm, dtype, device) for h in cfg.head]
    except ValueError as e:
        raise SystemExit(f"speculator: {e}")
    if len({h.head_cfg.layers for h in heads}) > 1:
        raise SystemExit("speculator: every head must read the same layers of the LLM")
    speculators = [Speculator(m, index=i, q_top=cfg.q_top, kv_tokens=cfg.kv_cache_tokens, graphs=cfg.graphs(),
                              progress=True, dynamic=cfg.dynamic_tree, prefill_chunk=cfg.prefill_chunk)
                    for i, m in enumerate(models)]
    speculators += [FeatureSpeculator(h, index=len(models) + i, q_top=cfg.q_top, kv_tokens=cfg.kv_cache_tokens,
                                      dynamic=cfg.dynamic_tree, prefill_chunk=cfg.prefill_chunk)
                    for i, h in enumerate(heads)]
    for spec, name in zip(speculators, cfg.ssm + cfg.head):
        print(f"speculator {Path(name).name}: {spec.run.describe()}", flush=True)
    return speculators


async def main(cfg: SpeculatorConfig) -> None:
    if not cfg.ssm and not cfg.head:
        raise SystemExit("speculator: no SSM or head given (--ssm, --head)")
    thread = ModelThread("speculator", cfg.threads, resolve_device(cfg.device))
    servicer = SpeculatorServicer(thread.call(build, cfg), [Path(d).name for d in cfg.ssm + cfg.head], thread)
    service = speculator_pb2.DESCRIPTOR.services_by_name["Speculator"].full_name
    await serve("speculator", cfg, [(speculator_pb2_grpc.add_SpeculatorServicer_to_server, servicer, service)])


if __name__ == "__main__":
    run(main(load_config(SpeculatorConfig, prog="python -m speculator_svc")))
