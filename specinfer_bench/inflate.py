"""Cost-realistic benchmark models: widen and deepen a Llama-family checkpoint so that it costs what
a user's LLM costs per step and still predicts exactly what the source predicts.

With H -> H' hidden, heads x m (head dim kept), I -> I' MLP units and L -> L' layers:
- the residual stream keeps the source's values in its first H dimensions and zeros in the new
  ones: embedding columns of the new dimensions are zero, and o_proj, down_proj (and the o_proj
  bias) write nothing into them;
- RMSNorm then sees the same vector padded with zeros: its mean square shrinks by H/H', so eps is
  scaled by H/H' and the norm weights by sqrt(H/H'), which gives back the source's normalized
  values exactly (in exact arithmetic; float rounding aside);
- new query/KV heads and new MLP units have random weights, but o_proj / down_proj read nothing
  from them (those columns are zero), so they cost what real ones cost and change nothing;
- new layers (appended after the source's) have random weights and zero o_proj and down_proj,
  so each adds exactly zero to the residual stream;
- the LM head reads only the first H dimensions (tied embeddings stay tied).
The tokenizer is copied, so the shipped SSMs draft for the inflated LLM with their real acceptance.
Generated on the fly, never committed:

    python -m specinfer_bench.inflate models/llm --preset llama-1b --out /tmp/llm-1b
    python -m specinfer_bench.inflate models/fixtures/llm --preset llama-7b --device cuda --out /dev/shm/llm-7b

`--device cuda` builds the tensors on the GPU (a 7B-class model's random weights in seconds rather than
minutes of one CPU core's generator); its generator draws other random values than the CPU's for the
same seed, which by construction change no output.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specinfer.model import ModelConfig, read_weights

# (hidden size, MLP width, layers) of Llama-3.2-1B and Llama-2-7B
PRESETS = {"llama-1b": (2048, 8192, 16), "llama-7b": (4096, 11008, 32)}


def inflate(src: Path, out: Path, hidden: int, heads_multiple: int, intermediate: int, layers: int,
            dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str = "cpu") -> Path:
    """Write the inflated checkpoint to `out` (config, weights, tokenizer) and return `out`; the tensors
    are built on `device`."""
    cfg = ModelConfig.from_dir(src)
    if cfg.attention_bias or cfg.output_bias:
        raise ValueError(f"{src}: attention biases are not supported by the inflation")
    H, I, L, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim
    nq, nkv = cfg.num_heads, cfg.num_kv_heads
    if hidden < H or intermediate < I or layers < L or heads_multiple < 1:
        raise ValueError(f"inflation must not shrink the model: hidden {H} -> {hidden}, intermediate "
                         f"{I} -> {intermediate}, layers {L} -> {layers}, heads x{heads_multiple}")
    nq2, nkv2 = nq * heads_multiple, nkv * heads_multiple
    raw = {k: v.to(device, torch.float32) for k, v in read_weights(src).items()}
    gen = torch.Generator(device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device) * 0.02

    def grow(w: torch.Tensor, rows: int, cols: int, fill_rows: bool, fill_cols: bool) -> torch.Tensor:
        """w [r, c] in the top-left corner of [rows, cols]; new rows / columns random or zero."""
        r, c = w.shape
        out = torch.zeros(rows, cols, device=device)
        if fill_rows:
            out[r:] = rand(rows - r, cols)
        if fill_cols:
            out[:r, c:] = rand(r, cols - c)
        out[:r, :c] = w
        return out

    scale = math.sqrt(H / hidden)
    norm = lambda w: torch.cat([w, torch.ones(hidden - H, device=device)]) * scale
    new: dict[str, torch.Tensor] = {}
    new["model.embed_tokens.weight"] = grow(raw["model.embed_tokens.weight"], cfg.vocab_size, hidden, False, False)
    new["model.norm.weight"] = norm(raw["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        new["lm_head.weight"] = grow(raw["lm_head.weight"], cfg.vocab_size, hidden, False, False)
    shapes = {"self_attn.q_proj.weight": (nq * d, H), "self_attn.k_proj.weight": (nkv * d, H),
              "self_attn.v_proj.weight": (nkv * d, H), "self_attn.o_proj.weight": (H, nq * d),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
              "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    for i in tqdm(range(layers), desc="inflate layers", unit="layer"):
        p = f"model.layers.{i}."
        source = i < L  # a source layer, widened; past them, new layers whose outputs are zeroed
        w = {n: raw[p + n] if source else (rand(*s) if len(s) == 2 else torch.ones(s, device=device))
             for n, s in shapes.items()}
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            new[p + n] = norm(w[n])
        for name, heads in (("q_proj", nq), ("k_proj", nkv), ("v_proj", nkv)):
            new[p + f"self_attn.{name}.weight"] = grow(w[f"self_attn.{name}.weight"], heads * heads_multiple * d,
                                                       hidden, True, True)
        o = grow(w["self_attn.o_proj.weight"], hidden, nq2 * d, False, False)  # reads old heads, writes old dims
        new[p + "self_attn.o_proj.weight"] = o if source else torch.zeros_like(o)
        for name in ("gate_proj", "up_proj"):
            new[p + f"mlp.{name}.weight"] = grow(w[f"mlp.{name}.weight"], intermediate, hidden, True, True)
        down = grow(w["mlp.down_proj.weight"], hidden, intermediate, False, False)
        new[p + "mlp.down_proj.weight"] = down if source else torch.zeros_like(down)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous().cpu() for k, v in new.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((Path(src) / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=nq2, num_key_value_heads=nkv2, head_dim=d,
                  rms_norm_eps=cfg.rms_norm_eps * H / hidden, dtype=str(dtype).removeprefix("torch."))
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in Path(src).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specinfer_bench.inflate", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a Llama-family checkpoint directory")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="hidden size, MLP width and depth of a real model")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads-multiple", type=int, help="default: the hidden size's multiple of the source's query width")
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the tensors are built: cpu, cuda (see the module)")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_dir(args.src)
    hidden, intermediate, layers = PRESETS[args.preset] if args.preset else (cfg.hidden_size, cfg.intermediate_size,
                                                                              cfg.num_layers)
    hidden, intermediate, layers = args.hidden or hidden, args.intermediate or intermediate, args.layers or layers
    multiple = args.heads_multiple or max(1, hidden // (cfg.num_heads * cfg.head_dim))
    out = inflate(args.src, args.out, hidden, multiple, intermediate, layers, getattr(torch, args.dtype), args.seed,
                  args.device)
    with safe_open(out / "model.safetensors", framework="pt") as f:  # the shapes, not the 13 GB of a 7B model
        n = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    print(f"{out}: hidden {hidden}, {cfg.num_heads * multiple} query / {cfg.num_kv_heads * multiple} KV heads, "
          f"intermediate {intermediate}, {layers} layers, {n / 1e9:.2f}B parameters ({args.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
