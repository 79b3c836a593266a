"""The settings every service that runs models has (the verifier, the speculators), apart from
config.py so that the services without models (the manager, the gateway) never import torch."""

from __future__ import annotations

from dataclasses import dataclass

from specinfer.graphs import GraphConfig
from specinfer.kv_cache import POOL_TOKENS

from .config import ServerConfig, option


@dataclass
class ModelServerConfig(ServerConfig):
    """Settings of a service that runs models."""

    dtype: str = option("auto", "weights and activations: float32, float16, bfloat16, float64 "
                                  "(auto: bfloat16 on CUDA, float32 on the CPU)")
    device: str = option("auto", "cpu, cuda or cuda:N (auto: cuda when there is a GPU)")
    threads: int = option(0, "torch CPU threads (0: torch's default)")
    kv_cache_tokens: int = option(POOL_TOKENS, "token slots of the paged KV cache pool, preallocated at start")
    enforce_eager: bool = option(False, "never capture CUDA graphs: every forward pass runs eagerly")
    graph_max_tokens: int = option(2048, "CUDA graphs are captured for steps of 1, 2, ... 8, 10, 12, ... (four sizes "
                                         "per doubling) up to this many tokens (larger steps run eagerly)")
    graph_max_rows: int = option(1344, "rows that reach the LM head, at most, in a CUDA graph (1344: 64 requests "
                                       "verifying 20-node trees)")
    graph_max_batch: int = option(64, "requests per step, at most, in a CUDA graph")
    graph_max_context: int = option(4096, "tokens per request, at most, in a CUDA graph (longer ones run eagerly)")

    def graphs(self) -> GraphConfig:
        """How forward passes run: CUDA graphs on a GPU unless --enforce-eager, eager elsewhere."""
        return GraphConfig("eager" if self.enforce_eager else "auto", self.graph_max_tokens, self.graph_max_batch,
                           max_context=self.graph_max_context, max_rows=self.graph_max_rows)
