"""Megatron-style model parallelism for the verifier's LLM on torch.distributed (gloo on CPU,
NCCL on GPU): tensor parallelism inside a pipeline stage, pipeline parallelism across stages.

RankLayout: world = tp * pp ranks; rank r is tensor-parallel rank r % tp of pipeline stage r // tp.

Tensor parallelism is applied to a built stage from outside (the model knows nothing of it):
  - qkv  ColumnParallel: Y = X A with A split along its columns by heads; rank t holds query heads
    [t Hq/T, (t+1) Hq/T) and the matching KV heads, and so does its KV cache (sharded by heads);
  - o    RowParallel: its input is already split by heads; the partial products are all-reduced;
  - gate_up ColumnParallel (the intermediate dimension split), down RowParallel, all-reduced;
  - embedding vocabulary-parallel: rank t holds rows [t V/T, (t+1) V/T), ids outside give zeros,
    the lookups are all-reduced; LM head vocabulary-parallel, its logits all-gathered.
  So a layer costs two all-reduces, and each rank reads only its slices from the checkpoint.

Pipeline parallelism: stage s holds a contiguous run of layers; stage 0 also the embedding, the
last stage the final norm and LM head. A step's batch is cut into micro-batches by request; they
flow through the stages by point-to-point sends, so stage s works on micro-batch i + 1 while
stage s + 1 works on micro-batch i.

Every rank keeps caches for every request (its own layers and heads) and runs the same
bookkeeping, so only hidden states, logits shards and the verdicts cross ranks. The first rank
of the last stage verifies and broadcasts each request's accepted path; every rank commits it.

Features (a feature drafter's input, verifier.py): the residual stream entering a layer is whole
on every tensor-parallel rank of its stage (the row-parallel outputs are all-reduced), so the first
rank of each stage that holds feature layers picks the committed rows of its own layers, once the
verdicts are known, and sends them to rank 0, the serving process, which puts the columns in the
order the layers were asked for. No rank sends more than the rows that step returns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .graphs import GraphConfig
from .model import LlamaModel, ModelConfig, StepInput, read_weights
from .verifier import FEATURE_BYTES, Verifier, VerifyRequest, check_feature_layers
from .acceptance import Verdict


@dataclass(frozen=True)
class RankLayout:
    tp: int
    pp: int
    rank: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def leader(self) -> int:
        """The rank that verifies: tensor-parallel rank 0 of the last stage."""
        return (self.pp - 1) * self.tp

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    def layers(self, n_layers: int) -> range:
        """This stage's layers: contiguous, as even as possible, earlier stages take the extra."""
        base, extra = divmod(n_layers, self.pp)
        start = self.stage * base + min(self.stage, extra)
        return range(start, start + base + (self.stage < extra))

    def check(self, cfg: ModelConfig) -> None:
        for name, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                        ("intermediate size", cfg.intermediate_size), ("vocabulary", cfg.vocab_size)):
            if n % self.tp:
                raise ValueError(f"tp: {self.tp} does not divide the model's {name} ({n})")
        if cfg.num_layers < self.pp:
            raise ValueError(f"pp: {self.pp} stages for {cfg.num_layers} layers")


def _part(n: int, parts: int, i: int) -> slice:
    return slice(i * n // parts, (i + 1) * n // parts)


def load_stage(path: str | Path, layout: RankLayout, dtype: torch.dtype, device: torch.device | str) -> LlamaModel:
    """This rank's part of the checkpoint: its stage's layers, its heads and its vocabulary rows,
    reading only those slices. Its `cfg` keeps the whole vocabulary (token ids are checked against
    it) and has this rank's head, intermediate and layer counts."""
    cfg = ModelConfig.from_dir(path)
    layout.check(cfg)
    T, t = layout.tp, layout.tp_rank
    layers = layout.layers(cfg.num_layers)
    d = cfg.head_dim
    rows = {"q_proj": cfg.num_heads * d, "k_proj": cfg.num_kv_heads * d, "v_proj": cfg.num_kv_heads * d,
            "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
    cols = {"o_proj": cfg.num_heads * d, "down_proj": cfg.intermediate_size}

    def select(name: str, shape: list[int]):
        parts = name.split(".")
        if name.startswith("model.layers."):
            if int(parts[2]) not in layers:
                return None
            kind = parts[-2]
            if kind in rows:  # column-parallel: output features (weight rows, bias) split
                return (_part(rows[kind], T, t),)
            if kind in cols and parts[-1] == "weight":  # row-parallel: input features split
                return (slice(None), _part(cols[kind], T, t))
            return (...,)  # norms, the o bias (added once, after the all-reduce)
        if name == "model.embed_tokens.weight":
            needed = layout.first or (layout.last and cfg.tie_word_embeddings)
            return (_part(cfg.vocab_size, T, t),) if needed else None
        if name == "lm_head.weight":
            return (_part(cfg.vocab_size, T, t),) if layout.last else None
        if name == "model.norm.weight":
            return (...,) if layout.last else None
        return None

    raw = {}
    for name, tensor in read_weights(path, select).items():
        if name.startswith("model.layers."):
            parts = name.split(".")
            parts[2] = str(int(parts[2]) - layers.start)
            name = ".".join(parts)
        raw[name] = tensor
    local = replace(cfg, num_heads=cfg.num_heads // T, num_kv_heads=cfg.num_kv_heads // T,
                    intermediate_size=cfg.intermediate_size // T, num_layers=len(layers),
                    vocab_size=cfg.vocab_size // T)
    model = LlamaModel.from_weights(local, raw, dtype, device, embed=layout.first, head=layout.last)
    model.cfg = replace(local, vocab_size=cfg.vocab_size)
    return model


class VocabParallelEmbedding(nn.Module):
    """Rows [offset, offset + n) of the table; other ids look up zeros; all-reduced over the group."""

    def __init__(self, table: nn.Embedding, offset: int, group):
        super().__init__()
        self.weight, self.offset, self.group = table.weight, offset, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.offset
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """Logits for this rank's vocabulary columns, all-gathered into the whole vocabulary."""

    def __init__(self, head: nn.Module, group, size: int):
        super().__init__()
        self.head, self.group, self.size = head, group, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.head(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def _all_reduce_output(group):
    def hook(module, inputs, output):
        dist.all_reduce(output, group=group)
    return hook


def apply_tensor_parallel(model: LlamaModel, layout: RankLayout, group) -> None:
    """Wrap a loaded stage's vocabulary-parallel parts and all-reduce its row-parallel outputs."""
    if layout.tp == 1:
        return
    rows = model.cfg.vocab_size // layout.tp
    if model.embed is not None:
        model.embed = VocabParallelEmbedding(model.embed, layout.tp_rank * rows, group)
    if model.lm_head is not None:
        model.lm_head = VocabParallelHead(model.lm_head, group, layout.tp)
    for block in model.layers:
        if block.o.bias is not None and layout.tp_rank:
            block.o.bias.zero_()  # the bias is added once in the sum
        block.o.register_forward_hook(_all_reduce_output(group))
        block.down.register_forward_hook(_all_reduce_output(group))


class PipelineVerifier(Verifier):
    """One rank's verifier: its stage of the model, its shard of every request's KV cache."""

    chains = False  # its steps run one at a time: every rank meets every step's collectives

    def __init__(self, model: LlamaModel, kv_tokens: int, layout: RankLayout, n_layers: int,
                 feature_layers: tuple[int, ...] = (), feature_bytes: int = FEATURE_BYTES, prefix_cache: bool = True):
        """n_layers: the whole LLM's; feature_layers: of the whole LLM (`Verifier`)."""
        super().__init__(model, kv_tokens, GraphConfig(mode="eager"), feature_bytes=feature_bytes,
                         prefix_cache=prefix_cache)  # its own forward
        self.layout = layout
        check_feature_layers(feature_layers, n_layers)
        self.feature_layers = tuple(feature_layers)
        stages = [RankLayout(layout.tp, layout.pp, s * layout.tp).layers(n_layers) for s in range(layout.pp)]
        held = {s: [i for i in self.feature_layers if i in r] for s, r in enumerate(stages)}  # in asked order
        self.holders = {s: layers for s, layers in held.items() if layers}  # the stages holding feature layers
        mine = stages[layout.stage]
        model.aux_layers = tuple(i - mine.start for i in self.holders.get(layout.stage, ()))
        self.features: torch.Tensor | None = None  # this stage's, of the last step's rows

    def forward(self, items: list[StepInput]) -> torch.Tensor | None:
        lay, model = self.layout, self.model
        n_micro = min(lay.pp, len(items))
        chunks = [items[i * len(items) // n_micro:(i + 1) * len(items) // n_micro] for i in range(n_micro)]
        logits, sends, features = [], [], []
        for chunk in chunks:
            step = model.prepare(model.layout(chunk))
            if lay.first:
                x = model.embed(step.ids)
            else:
                x = torch.empty(len(step.ids), model.cfg.hidden_size, dtype=model.dtype, device=model.device)
                dist.recv(x, src=lay.rank - lay.tp)
            x = model.run_layers(x, step)
            features.append(step.features)
            if lay.last:
                logits.append(model.logits(x, step))
            else:
                sends.append(dist.isend(x, dst=lay.rank + lay.tp))
        for s in sends:
            s.wait()
        self.features = torch.cat(features) if model.aux_layers else None
        return torch.cat(logits) if lay.last else None

    def feature_rows(self, index: list[int]) -> torch.Tensor:
        """Rank 0: every stage's features of rows `index`, gathered; other ranks send theirs (if they
        are their stage's first rank and it holds any) and return [len(index), 0]."""
        lay, H = self.layout, self.model.cfg.hidden_size
        mine = self.features[torch.tensor(index, device=self.features.device)] if self.features is not None else None
        if lay.rank:
            if lay.tp_rank == 0 and mine is not None:
                dist.send(mine.contiguous(), dst=0)
            return torch.empty(len(index), 0)
        columns = {}
        for stage, held in self.holders.items():
            if stage == lay.stage:
                part = mine
            else:
                part = torch.empty(len(index), len(held) * H, dtype=self.model.dtype, device=self.model.device)
                dist.recv(part, src=stage * lay.tp)
            columns.update(zip(held, part.split(H, dim=1)))
        return torch.cat([columns[i] for i in self.feature_layers], dim=1).cpu()

    def decide(self, batch: list[VerifyRequest], logits, starts: list[int]) -> list[Verdict]:
        verdicts = [super().decide(batch, logits, starts) if self.layout.rank == self.layout.leader else None]
        dist.broadcast_object_list(verdicts, src=self.layout.leader)
        return verdicts[0]


def init_rank(layout: RankLayout, init_method: str, timeout_s: float, device: torch.device):
    """Join the process group; return this rank's tensor-parallel group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL collectives (and object broadcasts) use the current device
    dist.init_process_group(backend, init_method=init_method, rank=layout.rank, world_size=layout.world,
                            timeout=timedelta(seconds=timeout_s))
    groups = [dist.new_group(layout.stage_ranks(s)) for s in range(layout.pp)]  # every rank makes every group
    return groups[layout.stage]
