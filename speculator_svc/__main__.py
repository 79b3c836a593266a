"""python -m speculator_svc --ssm models/ssm-0 --port 50052"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specinfer.cli import DTYPES, default_ssms
from specinfer.model import LlamaModel
from specinfer.speculator import Speculator
from specinfer_rpc.config import load_config, option
from specinfer_rpc.server import run, serve
from specinfer_rpc.v1 import speculator_pb2, speculator_pb2_grpc

from .servicer import SpeculatorServicer


@dataclass
class SpeculatorConfig:
    """The speculator service: SSMs building draft token trees for batches of requests."""

    ssm: list[str] = option([str(p) for p in default_ssms()[:1]],
                            "SSM checkpoint directories (comma-separated); their trees are merged")
    dtype: str = option("float32", f"weights and activations: {', '.join(sorted(DTYPES))}")
    q_top: int = option(32, "stochastic drafts: q is truncated to its most likely q_top tokens")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(50052, "port to listen on (0: any free port)")
    threads: int = option(0, "torch CPU threads (0: torch's default)")
    max_message_bytes: int = option(16 << 20, "largest gRPC message accepted or sent")
    grace: float = option(10.0, "seconds in-flight calls get to finish on SIGTERM")


async def main(cfg: SpeculatorConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if not cfg.ssm:
        raise SystemExit("speculator: no SSM given (--ssm)")
    models = [LlamaModel.from_pretrained(d, dtype=DTYPES[cfg.dtype]) for d in cfg.ssm]
    if len({m.cfg.vocab_size for m in models}) != 1:
        raise SystemExit("speculator: the SSMs must share a tokenizer (vocab sizes differ)")
    servicer = SpeculatorServicer([Speculator(m, index=i, q_top=cfg.q_top) for i, m in enumerate(models)],
                                  [Path(d).name for d in cfg.ssm])
    service = speculator_pb2.DESCRIPTOR.services_by_name["Speculator"].full_name
    await serve("speculator", f"{cfg.host}:{cfg.port}",
                [(speculator_pb2_grpc.add_SpeculatorServicer_to_server, servicer, service)],
                cfg.max_message_bytes, cfg.grace)


if __name__ == "__main__":
    run(main(load_config(SpeculatorConfig, prog="python -m speculator_svc")))
