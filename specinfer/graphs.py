"""CUDA graphs for forward passes: persistent padded inputs, one graph per size, replayed.

A `StepRunner` runs one model's forward passes over one KV pool. Sizes are buckets of total
tokens, four per doubling (1, 2, 3, ... 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... `max_tokens`),
so padding costs at most a quarter of a step; each bucket has a `Capacity` (its tokens, up to `max_batch`
requests, block tables `max_context` tokens wide, trees of up to `max_tree` nodes) and one
persistent int32 device buffer holding every per-step input: token ids, positions, KV write
slots, block tables, query offsets, causal limits, ancestor bits, the rows that reach the LM head.
A step that fits a bucket is laid out on the host padded to that capacity and lands in the
bucket's buffer in one host-to-device copy; then the bucket's graph, captured at start-up over
that buffer, is replayed, and the step's logits are the first R rows of the graph's output.
Padding queries see no key and write their own K/V into a block reserved for them. A step that
fits no bucket runs eagerly (`eager_steps` counts them).

Modes: "graphs" (CUDA only), "static" (the padded buffers without a graph: what the CPU can check
of the graph path, used by tests), "eager" (the model's own forward), "auto" (graphs on CUDA,
eager elsewhere). The model file stays the plain definition; this module only feeds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from specinfer_kernels import Capacity, backend

from .kv_cache import KVPool
from .model import Layout, LlamaModel, StepInput

MODES = ("auto", "graphs", "static", "eager")


@dataclass(frozen=True)
class GraphConfig:
    mode: str = "auto"
    max_tokens: int = 256  # the largest bucket; a step with more tokens runs eagerly
    max_batch: int = 64  # requests per step, at most, in a graph
    max_tree: int = 512  # tree nodes per request (scratch tree included), at most, in a graph
    max_context: int = 4096  # slots per request, at most, in a graph

    def resolve(self, device: torch.device) -> str:
        """The mode a model on `device` runs in."""
        if self.mode not in MODES:
            raise ValueError(f"graph mode {self.mode!r} is not one of {MODES}")
        # a graph replays what was captured; the reference attention sizes its work on the host
        capturable = device.type == "cuda" and backend(device) == "triton"
        if self.mode == "graphs" and not capturable:
            raise ValueError(f"graph mode 'graphs' needs a CUDA device and the Triton tree attention "
                             f"(the model is on {device}, attention: {backend(device)})")
        if self.mode == "auto":
            return "graphs" if capturable else "eager"
        return self.mode


def bucket_sizes(max_tokens: int) -> list[int]:
    """Token counts with a graph: every size up to 8, then four per doubling (10, 12, 14, 16, 20,
    ...), so a step pads by less than a quarter; `max_tokens` is the last."""
    sizes, size = [], 1
    while size < max_tokens:
        sizes.append(size)
        size += max(1, 2 ** (size.bit_length() - 3))
    return sizes + [max_tokens] if max_tokens > 0 else []


@dataclass
class _Bucket:
    capacity: Capacity
    buffer: torch.Tensor  # every per-step input, int32
    graph: torch.cuda.CUDAGraph | None = None


class StepRunner:
    """model(items, ids) through padded persistent buffers and captured graphs (see the module)."""

    def __init__(self, model: LlamaModel, pool: KVPool, config: GraphConfig = GraphConfig(), progress: bool = False):
        self.model, self.pool = model, pool
        self.mode = config.resolve(model.device)
        self.buckets: list[_Bucket] = []
        self.graph_bytes = 0  # device memory the captured graphs hold
        self.logits: torch.Tensor | None = None  # [max_tokens, V]: every graph writes its logits here
        self.eager_steps = 0  # steps that fit no bucket
        if self.mode == "eager":
            return
        trash = pool.reserve()  # the padding queries' K/V land here; no request ever holds it
        blocks = math.ceil(config.max_context / pool.block_size)
        for size in bucket_sizes(config.max_tokens):
            cap = Capacity(size, min(size, config.max_batch) + 1, blocks, math.ceil(config.max_tree / 32), trash)
            n = sum(len(values) for values, _ in self._empty().fields(cap)[0].values())
            self.buckets.append(_Bucket(cap, torch.zeros(n, dtype=torch.int32, device=model.device)))
        if self.mode == "graphs":
            self._capture(progress)

    def _empty(self) -> Layout:
        return Layout(self.pool, [], [], [], [])

    def _capture(self, progress: bool) -> None:
        """Capture every bucket's graph, largest first, all in one memory pool, after running each
        bucket eagerly on a side stream (compiling the kernels, warming cuBLAS)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in tqdm(self.buckets, desc="warming up", disable=not progress):
                for _ in range(2):
                    self.model.run(self.model.step(self._empty(), capacity=bucket.capacity, out=bucket.buffer))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        self.logits = torch.empty(self.buckets[-1].capacity.queries, self.model.cfg.vocab_size, device=self.model.device)
        mempool = torch.cuda.graph_pool_handle()
        for bucket in tqdm(self.buckets[::-1], desc="capturing CUDA graphs", disable=not progress):
            step = self.model.step(self._empty(), capacity=bucket.capacity, out=bucket.buffer)
            bucket.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.graph, pool=mempool):
                self.logits[: bucket.capacity.queries].copy_(self.model.run(step))
        torch.cuda.synchronize()
        self.graph_bytes = torch.cuda.memory_reserved() - before

    def describe(self) -> str:
        """One line for a service's start-up output."""
        if not self.buckets:
            return f"forward passes run eagerly ({self.mode})"
        sizes = f"{self.buckets[0].capacity.queries}..{self.buckets[-1].capacity.queries} tokens"
        if self.mode == "static":
            return f"static buffers for {len(self.buckets)} sizes ({sizes}), no graphs"
        return f"{len(self.buckets)} CUDA graphs ({sizes}) holding {self.graph_bytes / 2**20:.1f} MiB"

    def __call__(self, items: list[StepInput], ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, V] of one forward pass, as `LlamaModel.forward` returns them. After a replay
        they are a view of the runner's one output buffer, valid until its next call: a caller
        that keeps them across steps must clone them."""
        if self.mode == "eager":
            return self.model(items, ids)
        layout = self.model.layout(items)
        bucket = next((b for b in self.buckets if b.capacity.fits(layout.needs)), None)
        if bucket is None:
            self.eager_steps += 1
            return self.model.run(self.model.step(layout, ids))
        step = self.model.step(layout, ids, bucket.capacity, bucket.buffer)
        rows = len(layout.wanted)
        if bucket.graph is None:
            return self.model.run(step)[:rows]
        bucket.graph.replay()
        return self.logits[:rows]
