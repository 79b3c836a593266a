"""A Llama-family causal LM (Llama, Mistral, Qwen2) that decodes ragged batches of token trees.

Loads a Hugging Face checkpoint directory (config.json + *.safetensors) with no download and no
`transformers` model code, so that the KV cache, positions and attention mask are ours:

    new committed tokens (the prompt, or the previous step's bonus) attend causally;
    tree node u attends to every committed token, its ancestors and itself;
    position(u) = committed length - 1 + depth(u)  (the root is the last committed token).

A batch is flattened over requests (no padding): projections and MLPs run once over all tokens;
per layer, the new tokens' keys and values are written into the paged KV pool and one
tree-attention call (the Triton kernel on CUDA, its PyTorch reference elsewhere) covers the whole
batch. Only the rows asked for reach the LM head, and their logits stay on the model's device.
The batch's layout (token ids, positions, KV slots, masks) is built on the host with numpy,
vectorized over queries, and reaches the device in one copy (two when padded), so the ops a
forward dispatches do not grow with the number of requests. The model knows nothing about trees beyond the mask and positions its caches
hand it, and nothing about sampling.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from specinfer_kernels import (Capacity, Needs, Staging, TreeBatch, add_rms_norm, rotary_qkv_store, row_invariant,
                               silu_mul, tree_attention)
from specinfer_kernels.batch import SCALARS, Shapes

from .checkpoints import checkpoint_dir
from .errors import check_token_ids
from .kv_cache import BLOCK_SIZE, POOL_TOKENS, KVCache, KVPool

SUPPORTED = {"llama", "mistral", "qwen2"}
DRAFT_VOCAB = "draft_vocab.json"  # an SSM checkpoint's draft vocabulary (see `LlamaModel.restrict_vocab`)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool  # biases on the q, k, v projections
    output_bias: bool  # bias on the attention output projection
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """The config of any checkpoint reference (a directory, a .gguf file: see checkpoints.py)."""
        path = checkpoint_dir(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: not a checkpoint directory (no config.json)")
        return cls.from_dict(json.loads((path / "config.json").read_text()), path)

    @classmethod
    def from_dict(cls, c: dict, path: str | Path) -> "ModelConfig":
        """A Hugging Face config.json's fields (ValueError naming `path` where one is not supported)."""
        kind = c.get("model_type")
        if kind not in SUPPORTED:
            raise ValueError(f"{path}: model_type {kind!r} is not one of {sorted(SUPPORTED)}")
        if c.get("mlp_bias"):
            raise ValueError(f"{path}: mlp_bias is not supported")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act {c['hidden_act']!r} is not supported (only silu)")
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"{path}: rope_type {rope_type!r} is not supported")
        context = c.get("max_position_embeddings", 2048)
        if kind in ("mistral", "qwen2") and c.get("sliding_window") and c.get("use_sliding_window", kind == "mistral"):
            context = min(context, c["sliding_window"])  # full attention is exact up to the window
        eos = c.get("eos_token_id")
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type != "default" else None,
            attention_bias=kind == "qwen2" or bool(c.get("attention_bias", False)),
            output_bias=kind != "qwen2" and bool(c.get("attention_bias", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=context,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )


@dataclass
class StepInput:
    """One request's part of a forward pass."""

    cache: KVCache
    new_tokens: list[int]  # committed tokens not yet in the cache
    tree_tokens: list[int]  # draft nodes to add to the cache's scratch tree
    tree_parents: list[int]  # their parents, indexing the whole scratch tree (-1: the root)
    every_row: bool = False  # logits of every new committed token, not only the last (a prompt's logprobs)

    @property  # not cached: functools.cached_property takes a lock, dearer than the sum
    def n_rows(self) -> int:
        """Rows of this item in the forward's logits: the last new committed token's (if any; with
        every_row, every new committed token's), then one per new tree node."""
        return (len(self.new_tokens) if self.every_row else 1 if self.new_tokens else 0) + len(self.tree_tokens)


def row_starts(items: list[StepInput]) -> list[int]:
    """Each item's first row in the forward's logits."""
    return [0, *itertools.accumulate(it.n_rows for it in items)][:-1]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2], float32, as Hugging Face computes them."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.get("rope_type", s.get("type")) == "linear":
        return inv / s["factor"]
    # llama3: long wavelengths slowed down by `factor`, short ones kept, a smooth band between
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, smoothed, scaled)


class Dense(nn.Module):
    """y = x W (+ b) with W stored [in, out]."""

    PACKED_ROWS = 32  # products of up to this many rows go to oneDNN as they are (see `pack`)
    ROW_BUCKETS = (40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # larger ones: zero-padded to one, sliced

    def __init__(self, d_in: int, d_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_in, d_out))
        self.bias = nn.Parameter(torch.empty(d_out)) if bias else None
        self.packed: torch.Tensor | None = None  # W in oneDNN's blocked layout (see `pack`)
        self._one_row_differs: bool | None = None  # see `_pad_one_row`

    def pack(self) -> None:
        """On a CPU with oneDNN, in float32: also keep W in oneDNN's blocked layout and multiply by
        that. PyTorch's x @ W goes to MKL, whose small-row products are slow on this project's AMD
        CPUs; oneDNN's are faster from 2 rows on and about even at one (figures:
        bench/results/rows_cpu.md). oneDNN keeps what it builds for every row count it meets
        (over 1-400 distinct counts that grew a process by gigabytes), so it sees at most
        PACKED_ROWS + len(ROW_BUCKETS) counts: up to PACKED_ROWS rows as they are, then padded to the
        next bucket; beyond the last bucket x @ W (MKL), which gives a row other bits by the row count,
        or with `row_invariant` slices of the last bucket (more ops as rows grow, so only where bits must
        hold). A row's result does not depend on the other rows of a oneDNN product, bit for bit, so a
        tree node's projections equal those of the same row computed alone, and with `row_invariant` a
        prompt chunk's too. Elsewhere (CUDA, half precision) nothing changes; with `row_invariant` on CUDA
        every product is `invariant_matmul`'s (one tiling whatever the row count). Costs one more copy of W."""
        w = self.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().t().contiguous(), None)

    def _apply(self, fn, recurse=True):
        self.packed, self._one_row_differs = None, None  # moved or cast: back to `weight` (pack again)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.packed is None:
            if row_invariant() and x.is_cuda:  # cuBLAS chooses its kernel by the row count: one tiling instead
                from specinfer_kernels.invariant_matmul import invariant_matmul
                return invariant_matmul(x, self.weight, self.bias)
            return self._plain(x)
        if n <= self.ROW_BUCKETS[-1]:
            return self._packed(x)
        if row_invariant():
            return torch.cat([self._packed(part) for part in x.split(self.ROW_BUCKETS[-1])])
        return self._plain(x)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y + self.bias if self.bias is not None else y

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        """x W by the packed weight, x of at most the last bucket's rows. With `row_invariant`, one row
        goes with a zero row where `_pad_one_row` says so."""
        n = x.shape[0]
        fewest = 2 if n == 1 and row_invariant() and self._pad_one_row() else 1
        rows = max(n, fewest) if n <= self.PACKED_ROWS else self.ROW_BUCKETS[bisect.bisect_left(self.ROW_BUCKETS, n)]
        if rows == n:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, rows - n)), self.packed, self.bias, "none", [], "")[:n]

    def _pad_one_row(self) -> bool:
        """Whether oneDNN's one-row product by this weight sums in another order than the same row beside a
        zero row: on an AVX-512 Xeon from 1,280 inputs on, never on an AVX2 EPYC (where the pad would cost one
        stream's plain step 5-10% for nothing). Checked on random rows, once per weight."""
        if self._one_row_differs is None:
            x = torch.randn(8, self.weight.shape[0], generator=torch.Generator().manual_seed(0))
            product = lambda a: torch.ops.mkldnn._linear_pointwise(a, self.packed, None, "none", [], "")  # noqa: E731
            self._one_row_differs = any(not torch.equal(product(row[None]), product(F.pad(row[None], (0, 0, 0, 1)))[:1])
                                        for row in x)
        return self._one_row_differs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual) * weight, x + residual), the add fused into the norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Block(nn.Module):
    """One decoder layer with fused QKV and gate/up projections. The residual stream is carried
    beside the layer's output and added inside the next norm, so a layer is four GEMMs, one
    attention call and four fused elementwise kernels (add + norm twice, rotary + split + the K/V
    store into the pool, SiLU * up)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv = Dense(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias)
        self.o = Dense(q, cfg.hidden_size, bias=cfg.output_bias)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up = Dense(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Dense(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, residual, cos, sin, layer: int, pool: KVPool,
                batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden]: the previous layer's output, not yet added to `residual` (None before
        the first layer). Returns this layer's output and the residual stream, likewise."""
        cfg = self.cfg
        h, residual = self.input_norm(x, residual)
        q = rotary_qkv_store(self.qkv(h), cos, sin, cfg.num_heads, cfg.num_kv_heads, pool.k[layer], pool.v[layer], batch)
        out = tree_attention(q, pool.k[layer], pool.v[layer], batch)
        h, residual = self.post_norm(self.o(out.view(x.shape[0], -1)), residual)
        return self.down(silu_mul(self.gate_up(h))), residual


@dataclass
class Layout:
    """One forward pass's inputs on the host, laid out once: the caches are extended already."""

    pool: KVPool
    tokens: list[int]  # [N] the new committed tokens and tree nodes, item by item
    scalars: np.ndarray  # [B, 7] what attention needs to know per item (`SCALARS`)
    trees: list[list[int]]  # per item, its cache's scratch tree (parents)
    n_rows: int  # rows that reach the LM head: per item its last new committed token's (if any) and its tree nodes'
    every: np.ndarray | None = None  # [B] bool: the items whose every new committed token reaches it (None: none)

    @classmethod
    def empty(cls, pool: KVPool) -> "Layout":
        """No request: a padded step of nothing but padding (what a graph is captured with)."""
        return cls(pool, [], np.zeros((0, len(SCALARS)), dtype=np.int64), [], 0)

    @functools.cached_property
    def needs(self) -> Needs:
        """What a capacity must hold for this batch."""
        return Needs.of(self.scalars)

    def shapes(self, capacity: Capacity | None = None, rows: int | None = None) -> Shapes:
        """The step's int32 fields (see `Staging`): its own, then the attention batch's; padded to
        `capacity` and to `rows` rows for the LM head (default: one per query)."""
        n = capacity.queries if capacity else len(self.tokens)
        rows = rows if rows is not None else capacity.queries if capacity else self.n_rows
        return {"ids": (n,), "positions": (n,), "wanted": (rows,), **TreeBatch.shapes(self.needs, capacity)}

    def stage(self, staging: Staging, capacity: Capacity | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """Write every field into `staging`'s host arrays (vectorized, see `TreeBatch.pack`), send
        what is used to the device, and return the device fields and the attention batch's host facts."""
        host, q = TreeBatch.pack(self.scalars, self.trees, self.pool.tables, self.pool.block_size, staging, self.needs,
                                 capacity)
        out, n = staging.arrays, len(self.tokens)
        # the rows that reach the LM head: from each item's last new committed token (or its tree)
        # on; every row unless an item brings several committed tokens (a prefill)
        if self.n_rows == n:
            wanted = np.arange(n)
        else:
            n_com, tree_start = self.scalars[:, 3], self.scalars[:, 4]
            back = n_com > 0 if self.every is None else np.where(self.every, n_com, n_com > 0)
            wanted = np.flatnonzero(q.slot >= (tree_start - back)[q.owner])
        if capacity is not None:  # padding (before the step's rows: see `TreeBatch._pad`): token 0 at position 0, LM-head row 0
            padded = staging.claim("tokens", n)
            if padded > n:
                out["ids"][n:padded], out["positions"][n:padded] = 0, 0
            padded = staging.claim("wanted", len(wanted))
            if padded > len(wanted):
                out["wanted"][len(wanted):padded] = 0
        out["ids"][:n], out["positions"][:n], out["wanted"][: len(wanted)] = self.tokens, q.position, wanted
        if capacity is None:
            return staging.send([(0, staging.total)]), host
        bits_end = staging.span("tree_bits", n)[1]
        return staging.send([(0, bits_end), staging.span("block_tables", len(self.scalars))]), host


@dataclass
class Step:
    """One forward pass's inputs on the device."""

    ids: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N]
    pool: KVPool
    batch: TreeBatch
    wanted: torch.Tensor  # [R] the rows that reach the LM head, item by item
    features: torch.Tensor | None = None  # [N, k * hidden] after the forward, with `LlamaModel.aux_layers`

    @classmethod
    def from_device(cls, tensors: dict[str, torch.Tensor], pool: KVPool, host: dict) -> "Step":
        return cls(tensors["ids"], tensors["positions"], pool, TreeBatch.from_device(tensors, pool.block_size, host),
                   tensors["wanted"])


class LlamaModel(nn.Module):
    """The whole model, or one pipeline stage of it: `embed` and `head` say whether this part has
    the embedding and the final norm + LM head; `cfg.num_layers` is the number of layers it has.

    A step is three calls: `layout(items)` on the host (extends the requests' caches and lays the
    batch out), `prepare(layout, ...)` (stages it and sends it to the device, padded to a capacity
    when a CUDA graph will read it) and `run(step)` on the device alone (what a graph captures).
    `forward(items)` is the three in a row. A pipeline stage runs its part of `run` as
    `run_layers` (this stage's layers) and, on the last stage, `logits`."""

    def __init__(self, cfg: ModelConfig, embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if head else None
        self.lm_head = Dense(cfg.hidden_size, cfg.vocab_size, bias=False) if head else None  # a transposed copy when tied
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.register_buffer("vocab_ids", None, persistent=False)  # the LM head's tokens, when restricted
        self.aux_layers: tuple[int, ...] = ()  # layers whose entering residual stream a forward keeps (`run_layers`)

    def restrict_vocab(self, token_ids: list[int]) -> None:
        """Keep only `token_ids` in the LM head: logits of every other token are -inf from now on.
        For a drafter (FR-Spec's frequency-ranked drafting): the shipped SSMs' 256 x 8192 head is
        most of the weights a draft level streams, and the 3072 tokens the training corpus uses most
        cover 99% of the shipped LLM's greedy tokens on held-out prompts. Outputs stay exact:
        the verifier checks whatever the SSM proposes, and a draw's q is the restricted distribution,
        so speculative sampling stays exact too."""
        ids = sorted(set(token_ids))
        check_token_ids("token_ids", ids, self.cfg.vocab_size)
        if not ids:
            raise ValueError("token_ids: must not be empty")
        head = self.lm_head
        self.vocab_ids = torch.tensor(ids, device=head.weight.device)
        self.lm_head = Dense(head.weight.shape[0], len(ids), bias=False)
        self.lm_head.weight = nn.Parameter(head.weight[:, self.vocab_ids].contiguous(), requires_grad=False)
        self.lm_head.pack()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "LlamaModel":
        """A checkpoint directory's model; with a draft vocabulary file (DRAFT_VOCAB, {"token_ids":
        [...]}) beside the weights, its LM head restricted to those tokens (`restrict_vocab`)."""
        cfg = ModelConfig.from_dir(path)
        model = cls.from_weights(cfg, read_weights(path), dtype, device)
        ids = read_draft_vocab(path)
        if ids is not None:
            try:
                model.restrict_vocab(ids)
            except ValueError as e:
                raise ValueError(f"{checkpoint_dir(path) / DRAFT_VOCAB}: {e}") from None
        return model

    @classmethod
    def from_weights(cls, cfg: ModelConfig, raw: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: str | torch.device, embed: bool = True, head: bool = True) -> "LlamaModel":
        """Build from Hugging Face-named tensors (layers numbered from 0 for a pipeline stage)."""
        with torch.device("meta"):
            model = cls(cfg, embed, head)
        model.load_state_dict(hf_to_ours(raw, cfg, embed, head), assign=True, strict=True)
        inv_freq = rope_inv_freq(cfg)
        model.inv_freq = inv_freq  # out of the meta device, so that the model can move
        model = model.to(device=device, dtype=dtype)
        model.inv_freq = inv_freq.to(device)  # float32 whatever the weights' dtype, as in HF
        for block in model.layers:
            for dense in (block.qkv, block.o, block.gate_up, block.down):
                dense.pack()
        if model.lm_head is not None:
            model.lm_head.pack()
        return model.eval().requires_grad_(False)

    def new_pool(self, tokens: int = POOL_TOKENS, block_size: int = BLOCK_SIZE, prefix_cache: bool = True) -> KVPool:
        """A KV pool for this model holding `tokens` token slots (rounded down to whole blocks)."""
        c = self.cfg
        return KVPool(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.device, tokens, block_size,
                      prefix_cache)

    @torch.no_grad()
    def forward(self, items: list[StepInput], ids: torch.Tensor | None = None) -> torch.Tensor:
        """One forward pass over a ragged batch. Returns logits [R, V] (float32, on the model's
        device): for each item in turn, its `n_rows` rows (see `row_starts`).
        ids: the batch's token ids [N] already on the device (new tokens and tree nodes, item by
        item), instead of the items' token lists (a speculator's next level, drawn on the device)."""
        return self.run(self.prepare(self.layout(items), ids))

    def prepare(self, layout: Layout, ids: torch.Tensor | None = None, capacity: Capacity | None = None,
                staging: Staging | None = None) -> Step:
        """A laid-out batch on the device, in one copy: through a new buffer, or padded to
        `capacity` through its persistent `staging` (see `Staging`). ids: the token ids [N] already
        on the device, instead of the layout's (a speculator's next level, drawn on the device)."""
        if staging is None:
            staging = Staging(layout.shapes(capacity), self.device, persistent=False)
        tensors, host = layout.stage(staging, capacity)
        step = staging.kept.get("step") if capacity is not None else None
        if step is None or step.pool is not layout.pool:  # a padded step's host facts are its capacity's: made once
            step = Step.from_device(tensors, layout.pool, host)
            if capacity is not None:
                staging.kept["step"] = step
        else:
            step.batch.renew()
        if ids is not None:
            assert ids.shape == (len(layout.tokens),), (ids.shape, len(layout.tokens))
            if capacity is None:
                step.ids = ids
            else:
                step.ids[: ids.shape[0]].copy_(ids)
        return step

    def layout(self, items: list[StepInput]) -> Layout:
        """Extend every item's cache and lay the batch out on the host."""
        pool = items[0].cache.pool
        tokens, values, trees, n_rows, every = [], [], [], 0, []
        for i, it in enumerate(items):
            cache = it.cache
            if cache.pool is not pool:
                raise ValueError("one forward pass runs on one KV pool")
            n_new, n_tree = len(it.new_tokens), len(it.tree_tokens)
            first = cache.extend(n_new, it.tree_tokens, it.tree_parents)
            tokens += it.new_tokens
            tokens += it.tree_tokens
            values += (cache.row, len(cache.blocks), first, n_new, cache.length, n_tree, len(cache.tree.parents))
            trees.append(cache.tree.parents)
            n_rows += it.n_rows
            if it.every_row:
                every.append(i)
        scalars = np.fromiter(values, dtype=np.int64, count=len(values)).reshape(-1, len(SCALARS))
        mask = None
        if every:
            mask = np.zeros(len(items), dtype=bool)
            mask[every] = True
        return Layout(pool, tokens, scalars, trees, n_rows, mask)

    @torch.no_grad()
    def run(self, step: Step) -> torch.Tensor:
        """The forward pass proper, on the device only (what a CUDA graph captures): [R, V] logits."""
        return self.logits(self.run_layers(self.embed(step.ids), step), step)

    @torch.no_grad()
    def run_layers(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [N, hidden] through this model's layers. With `aux_layers`, the residual stream entering
        each of them is kept as `step.features` [N, len(aux_layers) * hidden] (a feature drafter's input)."""
        cos, sin = rotary(step.positions, self.inv_freq, self.dtype)
        residual, streams = None, {}
        for layer, block in enumerate(self.layers):
            if layer in self.aux_layers:
                streams[layer] = x if residual is None else x + residual
            x, residual = block(x, residual, cos, sin, layer, step.pool, step.batch)
        if streams:
            step.features = torch.cat([streams[i] for i in self.aux_layers], -1)
        return x + residual if residual is not None else x

    @torch.no_grad()
    def logits(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """[R, V] float32 logits of the wanted rows, on the device (-inf outside a restricted vocabulary)."""
        return self.lm_logits(x[step.wanted])

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[R, V] float32 logits of the rows x [R, hidden] (final norm and LM head)."""
        logits = self.lm_head(self.norm(x)[0]).float()
        return logits if self.vocab_ids is None else spread_vocab(logits, self.vocab_ids, self.cfg.vocab_size)


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, 1, D] of the rotary embedding at `positions` [N] (angles in float32, as in HF)."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def spread_vocab(values: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a draft vocabulary, values [..., K] for the K token ids `token_ids`, as logits over
    the whole vocabulary [..., vocab_size]: -inf for every other token."""
    full = values.new_full((*values.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(values.dim() - 1, token_ids, values)


def read_draft_vocab(path: str | Path) -> list[int] | None:
    """The token ids of a checkpoint's draft vocabulary (DRAFT_VOCAB), or None without one."""
    f = checkpoint_dir(path) / DRAFT_VOCAB
    if not f.exists():
        return None
    ids = json.loads(f.read_text()).get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueError(f"{f}: token_ids: must be a list of token ids")
    return ids


def read_weights(path: str | Path, select=None) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors by Hugging Face name. `select(name, shape)` may return
    None to skip a tensor, or an index (e.g. a tuple of slices) to read only that part of it."""
    path = checkpoint_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as reader:
            for name in reader.keys():
                part = reader.get_slice(name)
                index = (...,) if select is None else select(name, part.get_shape())
                if index is not None:
                    raw[name] = part[index]
    return raw


def hf_to_ours(raw: dict[str, torch.Tensor], cfg: ModelConfig, embed: bool = True,
               head: bool = True) -> dict[str, torch.Tensor]:
    """Rename Hugging Face weights, fuse q/k/v and gate/up, and store projections [in, out]."""
    out = {}
    if embed:
        out["embed.weight"] = raw["model.embed_tokens.weight"]
    if head:
        out["norm.weight"] = raw["model.norm.weight"]
        out["lm_head.weight"] = raw["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"].t().contiguous()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.input_norm.weight"] = raw[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_norm.weight"] = raw[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.qkv.weight"] = torch.cat([raw[a + f"{x}_proj.weight"] for x in "qkv"]).t().contiguous()
        if cfg.attention_bias:
            out[f"layers.{i}.qkv.bias"] = torch.cat([raw[a + f"{x}_proj.bias"] for x in "qkv"])
        out[f"layers.{i}.o.weight"] = raw[a + "o_proj.weight"].t().contiguous()
        if cfg.output_bias:
            out[f"layers.{i}.o.bias"] = raw[a + "o_proj.bias"]
        gate_up = torch.cat([raw[p + "mlp.gate_proj.weight"], raw[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.gate_up.weight"] = gate_up.t().contiguous()
        out[f"layers.{i}.down.weight"] = raw[p + "mlp.down_proj.weight"].t().contiguous()
    return out
