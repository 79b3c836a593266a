"""python -m verifier_svc --model models/llm --port 50053"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specinfer.cli import DTYPES, models_dir
from specinfer.model import LlamaModel
from specinfer.verifier import Verifier
from specinfer_rpc.config import load_config, option
from specinfer_rpc.server import run, serve
from specinfer_rpc.v1 import verifier_pb2, verifier_pb2_grpc

from .servicer import VerifierServicer


@dataclass
class VerifierConfig:
    """The verifier service: the LLM, tree-based parallel decoding and verification."""

    model: str = option(str(models_dir() / "llm"), "LLM checkpoint directory")
    dtype: str = option("float32", f"weights and activations: {', '.join(sorted(DTYPES))}")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(50053, "port to listen on (0: any free port)")
    threads: int = option(0, "torch CPU threads (0: torch's default)")
    max_message_bytes: int = option(16 << 20, "largest gRPC message accepted or sent")
    grace: float = option(10.0, "seconds in-flight calls get to finish on SIGTERM")


async def main(cfg: VerifierConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = LlamaModel.from_pretrained(cfg.model, dtype=DTYPES[cfg.dtype])
    servicer = VerifierServicer(Verifier(model), Path(cfg.model).name)
    service = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
    await serve("verifier", f"{cfg.host}:{cfg.port}",
                [(verifier_pb2_grpc.add_VerifierServicer_to_server, servicer, service)],
                cfg.max_message_bytes, cfg.grace)


if __name__ == "__main__":
    run(main(load_config(VerifierConfig, prog="python -m verifier_svc")))
