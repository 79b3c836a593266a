"""CUDA graphs for forward passes: persistent padded inputs, one graph per size, replayed.

A `StepRunner` runs one model's forward passes over one KV pool. Sizes are buckets of total
tokens, four per doubling (1, 2, 3, ... 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... `max_tokens`),
so padding costs at most a quarter of a step; each bucket has a `Capacity` (its tokens, up to `max_batch`
requests, block tables `max_context` tokens wide, trees of up to `max_tree` nodes), a bound on the
rows that reach the LM head (its tokens, at most `max_rows`: a long prefill chunk wants few) and one
persistent int32 buffer (`Staging`: pinned on the host, fixed addresses on the device) holding
every per-step input: token ids, positions, KV write slots, block tables, query offsets, causal
limits, ancestor bits, the rows that reach the LM head. A step that fits a bucket is laid out on
the host padded to that capacity (vectorized with numpy) and its used part lands in the bucket's
device buffer in two asynchronous copies; then the bucket's graph, captured at start-up over that
buffer, is replayed, and the step's logits are the first R rows of the graph's output. All graphs
of a process share one memory pool (`graph_pool`); start-up prints the time compiling and
capturing took. Triton keeps compiled kernels in $TRITON_CACHE_DIR (the containers put it on a
volume), so a restart compiles nothing.
Padding queries see no key and write their own K/V into a block reserved for them. A step that
fits no bucket runs eagerly (`eager_steps` counts them).

Modes: "graphs" (CUDA only), "static" (the padded buffers without a graph: what the CPU can check
of the graph path, used by tests), "eager" (the model's own forward), "auto" (graphs on CUDA,
eager elsewhere). The model file stays the plain definition; this module only feeds it.
"""

from __future__ import annotations

import bisect
import math
import time
import weakref
from dataclasses import dataclass

import torch
from tqdm import tqdm

from specinfer_kernels import Capacity, Staging, backend

from .kv_cache import KVPool
from .model import Layout, LlamaModel, Step, StepInput

MODES = ("auto", "graphs", "static", "eager")


@dataclass(frozen=True)
class GraphConfig:
    mode: str = "auto"
    max_tokens: int = 2048  # the largest bucket; a step with more tokens runs eagerly
    max_batch: int = 64  # requests per step, at most, in a graph
    max_tree: int = 512  # tree nodes per request (scratch tree included), at most, in a graph
    max_context: int = 4096  # slots per request, at most, in a graph
    max_rows: int = 1344  # rows that reach the LM head, at most, in a graph: 64 requests verifying 20-node trees

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
    rows: int  # LM-head rows
    staging: Staging  # every per-step input, int32, at fixed device addresses
    graph: torch.cuda.CUDAGraph | None = None

    def fits(self, layout: Layout) -> bool:
        return self.capacity.fits(layout.needs) and layout.n_rows <= self.rows


_POOLS: dict[torch.device, tuple[tuple, weakref.WeakSet]] = {}  # per device: the pool every runner of the
# process shares, and the graphs captured in it


def graph_pool(device: torch.device, graph) -> tuple:
    """The process's graph memory pool on `device`, for `graph` to be captured in: graphs replay one at
    a time on one thread, so all of them (every bucket of every model) can share their intermediate
    memory. A pool lives as long as a graph captured in it: once the last is gone (its runner dropped),
    PyTorch frees the pool and its handle may not be used again, so the next graph gets a new one."""
    handle, graphs = _POOLS.get(device, (None, weakref.WeakSet()))
    if not graphs:
        handle, graphs = torch.cuda.graph_pool_handle(), weakref.WeakSet()
        _POOLS[device] = handle, graphs
    graphs.add(graph)
    return handle


class StepRunner:
    """model(items, ids) through padded persistent buffers and captured graphs (see the module)."""

    def __init__(self, model: LlamaModel, pool: KVPool, config: GraphConfig = GraphConfig(), progress: bool = False):
        self.model, self.pool = model, pool
        self.mode = config.resolve(model.device)
        self.buckets: list[_Bucket] = []
        self.graph_bytes = 0  # device memory the captured graphs hold
        self.logits: torch.Tensor | None = None  # [the largest bucket's rows, V]: every graph writes its logits here
        self.eager_steps = 0  # steps that fit no bucket
        self.features: torch.Tensor | None = None  # [tokens (a bucket's when padded), k * hidden] of the last
        # call, with the model's `aux_layers`: the residual stream entering them, valid until the next call
        self.capture_s = 0.0  # compiling the kernels, warming up and capturing, at start
        self.sizes: list[int] = []  # the buckets' tokens, ascending
        if self.mode == "eager":
            return
        trash = pool.reserve()  # the padding queries' K/V land here; no request ever holds it
        blocks = math.ceil(config.max_context / pool.block_size)
        for size in bucket_sizes(config.max_tokens):
            cap = Capacity(size, min(size, config.max_batch) + 1, blocks, math.ceil(config.max_tree / 32), trash)
            rows = min(size, config.max_rows)
            self.buckets.append(_Bucket(cap, rows, Staging(Layout.empty(self.pool).shapes(cap, rows), model.device)))
        self.sizes = [b.capacity.queries for b in self.buckets]
        if self.mode == "graphs":
            start = time.perf_counter()
            self._capture(progress)
            self.capture_s = time.perf_counter() - start

    def _capture(self, progress: bool) -> None:
        """Capture every bucket's graph, largest first, in the process's graph pool, after running each
        bucket eagerly on a side stream (compiling the kernels, warming cuBLAS); on the model's
        device, whichever device is current."""
        with torch.cuda.device(self.model.device):
            self._capture_here(progress)

    def _capture_here(self, progress: bool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in tqdm(self.buckets, desc="warming up", disable=not progress):
                for _ in range(2):
                    self.model.run(self.model.prepare(Layout.empty(self.pool), capacity=bucket.capacity, staging=bucket.staging))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        self.logits = torch.empty(self.buckets[-1].rows, self.model.cfg.vocab_size, device=self.model.device)
        for bucket in tqdm(self.buckets[::-1], desc="capturing CUDA graphs", disable=not progress):
            step = self.model.prepare(Layout.empty(self.pool), capacity=bucket.capacity, staging=bucket.staging)
            bucket.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.graph, pool=graph_pool(self.model.device, bucket.graph)):
                self.logits[: bucket.rows].copy_(self.model.run(step))
        torch.cuda.synchronize()
        self.graph_bytes = torch.cuda.memory_reserved() - before

    def describe(self) -> str:
        """One line for a service's start-up output."""
        if not self.buckets:
            return f"forward passes run eagerly ({self.mode})"
        sizes = f"{self.buckets[0].capacity.queries}..{self.buckets[-1].capacity.queries} tokens"
        if self.mode == "static":
            return f"static buffers for {len(self.buckets)} sizes ({sizes}), no graphs"
        return (f"{len(self.buckets)} CUDA graphs ({sizes}) holding {self.graph_bytes / 2**20:.1f} MiB, "
                f"compiled and captured in {self.capture_s:.1f} s")

    def prepare(self, items: list[StepInput], ids: torch.Tensor | None = None) -> tuple[Step, _Bucket | None, int]:
        """The host's part of a forward: extend the caches, lay the batch out into the bucket's
        staging (or a fresh one) and send it. Returns the step, its bucket (None: eager) and its
        LM-head rows. (specinfer_bench.host times this.)"""
        layout = self.model.layout(items)
        first = bisect.bisect_left(self.sizes, layout.needs.queries)  # the smallest bucket with room for its tokens
        bucket = next((b for b in self.buckets[first:] if b.fits(layout)), None)
        if bucket is None:
            self.eager_steps += 1
            return self.model.prepare(layout, ids), None, layout.n_rows
        return self.model.prepare(layout, ids, bucket.capacity, bucket.staging), bucket, layout.n_rows

    def __call__(self, items: list[StepInput], ids: torch.Tensor | None = None,
                 fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [R, V] of one forward pass, as `LlamaModel.forward` returns them. After a replay
        they are a view of the runner's one output buffer, valid until its next call: a caller
        that keeps them across steps must clone them. fill: (where, tokens), device tensors: the
        batch's token ids at those places (of new tokens and tree nodes, item by item) are these,
        not the items' (tokens a step before this one decided, still on the device)."""
        if self.mode == "eager" and not self.model.aux_layers and fill is None:
            self.features = None
            return self.model(items, ids)
        if self.mode == "eager":  # the model's forward as its three calls, to read the step's features or fill its ids
            step = self.model.prepare(self.model.layout(items), ids)
            bucket = rows = None
        else:
            step, bucket, rows = self.prepare(items, ids)
        if fill is not None:
            where, tokens = fill
            step.ids[where] = tokens.to(step.ids.dtype)
        if bucket is None or bucket.graph is None:
            logits = self.model.run(step)
            logits = logits if rows is None else logits[:rows]
        else:
            bucket.graph.replay()
            logits = self.logits[:rows]
        self.features = step.features  # with the model's aux_layers (a captured step's: the graph's buffer)
        return logits
