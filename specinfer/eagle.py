"""A feature drafter's head: EAGLE-3 (Li et al., arXiv 2503.01840), a draft model that reads the LLM's
own hidden states.

Terms:
  features  the LLM's residual stream entering each of its `layers` (EAGLE-3's default: 2, L/2, L-3)
            for one committed token, concatenated: [len(layers) * H_llm]; the verifier returns them
            for the rows it commits (`LlamaModel.aux_layers`).
  pair j    the head's input at position j: the embedding of record token j + 1 and a hidden vector,
            fc(features of token j) for a committed token; for a drafted token, the head's own
            output (before its final norm) at the token's parent. Pair j predicts token j + 2, as
            the LLM's row j + 1 does, so after a step the head is one pair behind the record: the
            bonus token's features come with the next step.

The head: fc (len(layers) * H_llm -> H); one decoder layer whose attention reads [input_norm(embedding),
hidden_norm(hidden)] (2H in, H out), the hidden vector being the residual; the final norm; an LM head
over a reduced draft vocabulary whose row d is target token d + d2t[d]. The embedding is the LLM's,
frozen, taken from the LLM at load. Checkpoints are the layout published EAGLE-3 heads use, as vLLM and
SGLang read them: config.json (a Llama config with `draft_vocab_size`, optionally `target_hidden_size`
and `eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors with `fc.weight`,
`midlayer.{input_layernorm,hidden_norm,self_attn.{q,k,v,o}_proj,post_attention_layernorm,
mlp.{gate,up,down}_proj}.weight`, `norm.weight`, `lm_head.weight`, `d2t` and `t2d`.

The head runs on the paged KV cache and tree attention of `LlamaModel` (one layer of it), so its
drafts are tree levels like an SSM's (speculator.FeatureSpeculator).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specinfer_kernels import rotary_qkv, rotary_qkv_store, silu_mul, tree_attention

from .checkpoints import checkpoint_dir
from .model import Dense, LlamaModel, ModelConfig, RMSNorm, Step, read_weights, rope_inv_freq, rotary


def head_layers(path: str | Path, llm: str | Path) -> tuple[int, ...]:
    """The LLM layers a head checkpoint reads (checked against the LLM checkpoint `llm`)."""
    return HeadConfig.from_dir(checkpoint_dir(path), ModelConfig.from_dir(llm)).layers


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default target layers: the residual stream entering layers 2, L/2 and L-3."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass(frozen=True)
class HeadConfig:
    model: ModelConfig  # the head's own layer (num_layers 1) and vocabulary (the LLM's)
    draft_vocab_size: int
    target_hidden_size: int  # the LLM's hidden size, H_llm
    layers: tuple[int, ...]  # the LLM's layers whose entering residual stream the head reads
    norm_before_residual: bool  # the residual is hidden_norm(hidden) rather than hidden

    @classmethod
    def from_dir(cls, path: str | Path, llm: ModelConfig) -> "HeadConfig":
        """The head's config, checked against the LLM it drafts for: ValueError naming what does not fit."""
        path = Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: not a head checkpoint (no config.json)")
        c = json.loads((path / "config.json").read_text())
        if "draft_vocab_size" not in c:
            raise ValueError(f"{path}/config.json: no draft_vocab_size: not an EAGLE-3 head")
        model = ModelConfig.from_dict({"model_type": "llama", **c, "num_hidden_layers": 1}, path)
        layers = tuple((c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                       or default_layers(llm.num_layers))
        cfg = cls(model, int(c["draft_vocab_size"]), int(c.get("target_hidden_size") or model.hidden_size), layers,
                  bool(c.get("norm_before_residual", False)))
        if model.vocab_size != llm.vocab_size:
            raise ValueError(f"{path}: the head's vocab_size {model.vocab_size} is not the LLM's {llm.vocab_size}")
        if cfg.target_hidden_size != llm.hidden_size:
            raise ValueError(f"{path}: the head reads features of hidden size {cfg.target_hidden_size}, "
                             f"the LLM's is {llm.hidden_size}")
        if model.hidden_size != llm.hidden_size:
            raise ValueError(f"{path}: the head's hidden_size {model.hidden_size} is not the LLM's {llm.hidden_size}, "
                             f"whose embedding it reads")
        if not all(0 <= i < llm.num_layers for i in layers):
            raise ValueError(f"{path}: target layers {list(layers)} are not all layers of the LLM (0..{llm.num_layers - 1})")
        if not 0 < cfg.draft_vocab_size <= llm.vocab_size:
            raise ValueError(f"{path}: draft_vocab_size {cfg.draft_vocab_size} is not in 1..{llm.vocab_size}")
        return cfg


class EagleLayer(nn.Module):
    """The head's decoder layer: attention over [embedding, hidden] (2H in), the hidden vector as the
    residual, then the MLP. Returns its output with the residual added (the head's pre-norm output)."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        m = cfg.model
        self.cfg = cfg
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        self.input_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.qkv = Dense(2 * m.hidden_size, q + 2 * kv, bias=m.attention_bias)
        self.o = Dense(q, m.hidden_size, bias=m.output_bias)
        self.post_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.gate_up = Dense(m.hidden_size, 2 * m.intermediate_size, bias=False)
        self.down = Dense(m.intermediate_size, m.hidden_size, bias=False)

    def forward(self, e: torch.Tensor, hidden: torch.Tensor, cos, sin, step: Step) -> torch.Tensor:
        """e, hidden [N, H]: the tokens' embeddings and the hidden vectors. Returns [N, H]."""
        qkv, residual = self.project(e, hidden)
        m, pool = self.cfg.model, step.pool
        q = rotary_qkv_store(qkv, cos, sin, m.num_heads, m.num_kv_heads, pool.k[0], pool.v[0], step.batch)
        return self.finish(tree_attention(q, pool.k[0], pool.v[0], step.batch), residual)

    def project(self, e, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused QKV projection [N, (Hq + 2 Hkv) D], not yet rotated, and the residual [N, H]."""
        h = self.hidden_norm(hidden)[0]
        residual = h if self.cfg.norm_before_residual else hidden
        return self.qkv(torch.cat([self.input_norm(e)[0], h], -1)), residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attended [N, Hq, D] through the output projection and the MLP."""
        h, residual = self.post_norm(self.o(attended.reshape(residual.shape[0], -1)), residual)
        return self.down(silu_mul(self.gate_up(h))) + residual


class EagleHead(LlamaModel):
    """An EAGLE-3 head as a one-layer `LlamaModel` (its KV pool, layout and LM head over a restricted
    vocabulary), whose forward also takes each row's hidden vector and returns its output for the
    wanted rows (what their children read)."""

    def __init__(self, cfg: HeadConfig):
        nn.Module.__init__(self)
        m = cfg.model
        self.head_cfg = cfg
        self.cfg = m
        self.embed = nn.Embedding(m.vocab_size, m.hidden_size)  # the LLM's, frozen
        self.fc = Dense(len(cfg.layers) * cfg.target_hidden_size, m.hidden_size, bias=False)
        self.layers = nn.ModuleList([EagleLayer(cfg)])
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.lm_head = Dense(m.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(m), persistent=False)
        self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab_size), persistent=False)  # d + d2t[d]
        self.aux_layers = ()

    @classmethod
    def from_pretrained(cls, path: str | Path, llm: ModelConfig, embedding: torch.Tensor,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "EagleHead":
        """A published-layout head (see the module) for an LLM of config `llm`, whose embedding
        [vocab, H] it takes. ValueError naming what does not fit."""
        path = checkpoint_dir(path)
        cfg = HeadConfig.from_dir(path, llm)
        raw = read_weights(path)
        missing = [n for n in ("fc.weight", "norm.weight", "lm_head.weight", "d2t") if n not in raw]
        if missing:
            raise ValueError(f"{path}: not an EAGLE-3 head: no {', '.join(missing)}")
        vocab_ids = torch.arange(cfg.draft_vocab_size) + raw["d2t"].long()
        if raw["d2t"].shape != (cfg.draft_vocab_size,) or not (0 <= vocab_ids).all() or not (vocab_ids < llm.vocab_size).all():
            raise ValueError(f"{path}: d2t must map each of the {cfg.draft_vocab_size} draft tokens into the "
                             f"LLM's vocabulary [0, {llm.vocab_size})")
        p = "midlayer."
        a = p + "self_attn."
        state = {
            "embed.weight": embedding,
            "fc.weight": raw["fc.weight"].t(),
            "layers.0.input_norm.weight": raw[p + "input_layernorm.weight"],
            "layers.0.hidden_norm.weight": raw[p + "hidden_norm.weight"],
            "layers.0.qkv.weight": torch.cat([raw[a + f"{x}_proj.weight"] for x in "qkv"]).t(),
            "layers.0.o.weight": raw[a + "o_proj.weight"].t(),
            "layers.0.post_norm.weight": raw[p + "post_attention_layernorm.weight"],
            "layers.0.gate_up.weight": torch.cat([raw[p + "mlp.gate_proj.weight"], raw[p + "mlp.up_proj.weight"]]).t(),
            "layers.0.down.weight": raw[p + "mlp.down_proj.weight"].t(),
            "norm.weight": raw["norm.weight"],
            "lm_head.weight": raw["lm_head.weight"].t(),
        }
        with torch.device("meta"):
            head = cls(cfg)
        try:
            head.load_state_dict({k: v.contiguous() for k, v in state.items()}, assign=True, strict=True)
        except RuntimeError as e:
            raise ValueError(f"{path}: the head's tensors do not fit its config.json: {e}") from None
        head.inv_freq, head.vocab_ids = rope_inv_freq(cfg.model), vocab_ids  # out of the meta device
        head = head.to(device=device, dtype=dtype)
        head.inv_freq, head.vocab_ids = rope_inv_freq(cfg.model).to(device), vocab_ids.to(device)  # float32, as in HF
        for dense in (head.fc, *(getattr(head.layers[0], n) for n in ("qkv", "o", "gate_up", "down")), head.lm_head):
            dense.pack()
        return head.eval().requires_grad_(False)

    @classmethod
    def for_llm(cls, path: str | Path, llm: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> "EagleHead":
        """A head for the LLM checkpoint `llm`, reading only its config and embedding (a speculator
        service holds the head, not the LLM)."""
        cfg = ModelConfig.from_dir(llm)
        embed = read_weights(llm, lambda name, shape: (...) if name == "model.embed_tokens.weight" else None)
        return cls.from_pretrained(path, cfg, embed["model.embed_tokens.weight"], dtype, device)

    @torch.no_grad()
    def forward(self, items, ids: torch.Tensor | None, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over a ragged batch (`LlamaModel.forward`), `hidden` [N, H] the rows' hidden
        vectors. Returns the logits [R, V] over the whole vocabulary (-inf outside the draft
        vocabulary) and the outputs [R, H] of the wanted rows."""
        return self.run(self.prepare(self.layout(items), ids), hidden)

    def chains(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test, dense and differentiable: from every root pair j of the sequences at
        once, the chain of `steps` drafts a tree would grow with the record's own next tokens.
        features [B, T, len(layers) * H_llm] and tokens [B, T]: the LLM's records. Returns, for step
        k, the outputs [B, T - 1, H] of pair j's depth-k chain node (token j + 1 + k at position
        j + k, reading step k - 1's output), whose logits predict token j + 2 + k; rows whose token
        lies past the record are padding. A step-k node attends to the root's pairs 0..j and to the
        chain above it, as in a drafted tree."""
        B, T = tokens.shape
        n, m = T - 1, self.cfg
        layer = self.layers[0]
        root = torch.arange(n, device=tokens.device)
        hidden = self.fc(features[:, :n].reshape(B * n, -1))
        past_k, past_v, outs = [], [], []
        for k in range(steps):
            ids = tokens[:, (root + 1 + k).clamp(max=T - 1)]  # [B, n]
            cos, sin = rotary((root + k).repeat(B), self.inv_freq, self.dtype)
            qkv, residual = layer.project(self.embed(ids.reshape(-1)), hidden)
            q, key, value = rotary_qkv(qkv, cos, sin, m.num_heads, m.num_kv_heads)
            shape = lambda x: x.view(B, n, x.shape[1], m.head_dim)
            q, key, value = shape(q), shape(key), shape(value)
            past_k.append(key)
            past_v.append(value)
            attended = _chain_attention(q, past_k, past_v, m.head_dim ** -0.5)
            hidden = layer.finish(attended.reshape(B * n, m.num_heads, m.head_dim), residual)
            outs.append(hidden.view(B, n, -1))
        return outs

    def published(self) -> dict[str, torch.Tensor]:
        """The head's own tensors by their published names (see the module), for `save_head`."""
        L = self.layers[0]
        m = self.cfg
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        qkv = L.qkv.weight.t()
        gate, up = L.gate_up.weight.t().split(m.intermediate_size)
        p, a = "midlayer.", "midlayer.self_attn."
        return {"fc.weight": self.fc.weight.t(), p + "input_layernorm.weight": L.input_norm.weight,
                p + "hidden_norm.weight": L.hidden_norm.weight, a + "q_proj.weight": qkv[:q],
                a + "k_proj.weight": qkv[q: q + kv], a + "v_proj.weight": qkv[q + kv:],
                a + "o_proj.weight": L.o.weight.t(), p + "post_attention_layernorm.weight": L.post_norm.weight,
                p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": L.down.weight.t(), "norm.weight": self.norm.weight,
                "lm_head.weight": self.lm_head.weight.t()}

    @torch.no_grad()
    def run(self, step: Step, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary(step.positions, self.inv_freq, self.dtype)
        out = self.layers[0](self.embed(step.ids), hidden, cos, sin, step)[step.wanted]  # [R, H]
        return self.lm_logits(out), out


def _chain_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """q [B, n, Hq, D], the query of each root's chain node at its newest step; keys, values: per
    step [B, n, Hkv, D]. Root j's query sees step 0's keys 0..j (the committed pairs) and, of every
    later step, root j's own (its chain). Returns [B, n, Hq, D]."""
    B, n, Hq, D = q.shape
    rep = Hq // keys[0].shape[2]
    grow = lambda x: x.repeat_interleave(rep, dim=2)  # [B, n, Hq, D]
    causal = torch.einsum("bihd,bjhd->bhij", q, grow(keys[0])) * scale  # [B, Hq, n, n]
    causal = causal.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    chain = [(q * grow(k)).sum(-1).transpose(1, 2)[..., None] * scale for k in keys[1:]]  # [B, Hq, n, 1] each
    p = torch.cat([causal, *chain], -1).float().softmax(-1).to(q.dtype)
    out = torch.einsum("bhij,bjhd->bihd", p[..., :n], grow(values[0]))
    for i, v in enumerate(values[1:]):
        out = out + p[..., n + i].transpose(1, 2)[..., None] * grow(v)
    return out


def save_head(path: str | Path, llm: ModelConfig, tensors: dict[str, torch.Tensor], draft_vocab: list[int],
              layers: list[int], intermediate_size: int, **config) -> None:
    """Write a head in the published EAGLE-3 layout: `tensors` by their published names (fc, midlayer.*,
    norm, lm_head; the LM head's row d for token draft_vocab[d]), with d2t and t2d made from
    `draft_vocab`, and a config.json of the LLM's shapes (`config` adds or overrides fields)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = torch.tensor(sorted(draft_vocab))
    t2d = torch.zeros(llm.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors = {**{k: v.contiguous() for k, v in tensors.items()}, "d2t": ids - torch.arange(len(ids)), "t2d": t2d}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": llm.hidden_size,
           "intermediate_size": intermediate_size, "num_attention_heads": llm.num_heads,
           "num_key_value_heads": llm.num_kv_heads, "head_dim": llm.head_dim, "rms_norm_eps": llm.rms_norm_eps,
           "rope_theta": llm.rope_theta, "max_position_embeddings": llm.max_position_embeddings,
           "vocab_size": llm.vocab_size, "draft_vocab_size": len(ids), "target_hidden_size": llm.hidden_size,
           "tie_word_embeddings": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}, **config}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
