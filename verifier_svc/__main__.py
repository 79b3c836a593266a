"""python -m verifier_svc --model models/llm --port 50053"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specinfer.cli import DTYPES, models_dir, resolve_device
from specinfer.model import LlamaModel
from specinfer.verifier import Verifier
from specinfer_rpc.config import ModelServerConfig, load_config, option
from specinfer_rpc.server import run, serve
from specinfer_rpc.v1 import verifier_pb2, verifier_pb2_grpc

from .servicer import VerifierServicer


@dataclass
class VerifierConfig(ModelServerConfig):
    """The verifier service: the LLM, tree-based parallel decoding and verification."""

    model: str = option(str(models_dir() / "llm"), "LLM checkpoint directory")
    port: int = option(50053, "port to listen on (0: any free port)")
    idle_timeout: float = option(600.0, "seconds after which a request no Verify call touched is freed "
                                        "(its manager went away without releasing it)")


async def main(cfg: VerifierConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = LlamaModel.from_pretrained(cfg.model, dtype=DTYPES[cfg.dtype], device=resolve_device(cfg.device))
    servicer = VerifierServicer(Verifier(model, cfg.kv_cache_tokens), Path(cfg.model).name, cfg.idle_timeout)
    service = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
    await serve("verifier", cfg, [(verifier_pb2_grpc.add_VerifierServicer_to_server, servicer, service)])


if __name__ == "__main__":
    run(main(load_config(VerifierConfig, prog="python -m verifier_svc")))
