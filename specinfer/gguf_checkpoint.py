"""llama.cpp GGUF files as checkpoints: a Llama-architecture `.gguf` file is converted once into a
Hugging Face checkpoint directory (config.json, float32 model.safetensors, tokenizer files with the
chat template, generation_config.json) under a cache keyed by the file's SHA-256, and every loader
then reads that directory. Weights are dequantized by the `gguf` package itself; the tokenizer is
read from the file by transformers. Nothing here knows about serving.

    gguf name                      Hugging Face name
    token_embd.weight              model.embed_tokens.weight
    output_norm.weight             model.norm.weight
    output.weight                  lm_head.weight           (absent: tied to the embedding)
    blk.{i}.attn_norm.weight       model.layers.{i}.input_layernorm.weight
    blk.{i}.attn_{q,k,v}.weight    model.layers.{i}.self_attn.{q,k,v}_proj.weight  (q, k: rotary halves
                                                                                    un-interleaved)
    blk.{i}.attn_output.weight     model.layers.{i}.self_attn.o_proj.weight
    blk.{i}.ffn_norm.weight        model.layers.{i}.post_attention_layernorm.weight
    blk.{i}.ffn_{gate,up,down}.weight  model.layers.{i}.mlp.{gate,up,down}_proj.weight
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

ARCHITECTURES = {"llama"}  # Llama and Mistral files both say "llama"
DEQUANTIZED = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
CONVERTED_FORMAT = 1  # bump when the converted directory's contents change, so old caches are not reused

LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


class GGUFError(ValueError):
    """A GGUF file this project cannot serve; the message names the file and what is wrong."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` file in a directory without a
    config.json. None when `path` is a checkpoint directory (or nothing GGUF)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"{path}: holds {len(files)} .gguf files; name one of them")
        return files[0] if files else None
    return None


def cache_root() -> Path:
    """Where converted files are kept: $SPECINFER_CACHE, else $XDG_CACHE_HOME/specinfer, else ~/.cache/specinfer."""
    if "SPECINFER_CACHE" in os.environ:
        return Path(os.environ["SPECINFER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specinfer"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def converted(file: str | Path) -> Path:
    """The checkpoint directory of GGUF `file`, converted on first use (`cached_dir`)."""
    file = Path(file)
    if not file.is_file():
        raise GGUFError(f"{file}: no such file")
    return cached_dir(cache_root() / "gguf" / f"{sha256(file)[:32]}-v{CONVERTED_FORMAT}", lambda out: convert(file, out))


def cached_dir(target: Path, fill) -> Path:
    """`target`, a checkpoint directory that `fill(directory)` writes, made once: filled in a temporary
    directory beside it and renamed into place, so that processes starting side by side may all fill
    it and one copy wins."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fill-", dir=target.parent))
    try:
        fill(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process made it first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_gguf(file: Path):
    """The file's reader, after checking what it claims: GGUF, whole, Llama architecture, tensor types
    the `gguf` package dequantizes."""
    import gguf

    try:
        reader = gguf.GGUFReader(file)
    except Exception as e:  # the reader raises ValueError, IndexError, ... on a damaged file
        raise GGUFError(f"{file}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > file.stat().st_size:
        raise GGUFError(f"{file}: truncated: its tensors end at byte {end}, the file has {file.stat().st_size}")
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{file}: architecture {arch!r} is not supported (only {sorted(ARCHITECTURES)})")
    for t in reader.tensors:
        if t.tensor_type.name not in DEQUANTIZED:
            raise GGUFError(f"{file}: tensor {t.name} has type {t.tensor_type.name}, which is not supported "
                            f"(supported: {', '.join(sorted(DEQUANTIZED))})")
    return reader


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader, file: Path) -> dict:
    """config.json of a Llama GGUF file's model."""
    a = "llama."
    need = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count"]
    missing = [a + k for k in need if field(reader, a + k) is None]
    if missing:
        raise GGUFError(f"{file}: metadata {', '.join(missing)} missing")
    if field(reader, a + "rope.scaling.type", "none") not in ("none", None):
        raise GGUFError(f"{file}: rope scaling {field(reader, a + 'rope.scaling.type')!r} is not supported")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError(f"{file}: tensor rope_freqs.weight (Llama 3.1 rope scaling) is not supported")
    heads = field(reader, a + "attention.head_count")
    hidden = field(reader, a + "embedding_length")
    tokens = field(reader, "tokenizer.ggml.tokens")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": field(reader, a + "vocab_size") or (len(tokens) if tokens else None),
        "hidden_size": hidden, "intermediate_size": field(reader, a + "feed_forward_length"),
        "num_hidden_layers": field(reader, a + "block_count"),
        "num_attention_heads": heads, "num_key_value_heads": field(reader, a + "attention.head_count_kv", heads),
        "head_dim": field(reader, a + "rope.dimension_count", hidden // heads),
        "rms_norm_eps": field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": field(reader, a + "rope.freq_base", 10000.0),
        "max_position_embeddings": field(reader, a + "context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"), "eos_token_id": eos,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }


def hf_name(name: str) -> str | None:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q and k with each head's rotary pairs interleaved; Hugging Face keeps the two
    halves apart. w [heads * head_dim, in]."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def weights(reader, file: Path, cfg: dict) -> dict[str, np.ndarray]:
    """Every tensor, dequantized to float32, by Hugging Face name."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise GGUFError(f"{file}: unexpected tensor {t.name}")
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if name.endswith("q_proj.weight"):
            w = unpermute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, cfg["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}.weight" for i in range(cfg["num_hidden_layers"]) for n in LAYER_NAMES.values()}
    if missing := sorted(expected - out.keys()):
        raise GGUFError(f"{file}: tensors missing: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    return out


def convert(file: Path, out: Path) -> None:
    """Write GGUF `file` as a Hugging Face checkpoint directory `out`."""
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    reader = read_gguf(file)
    cfg = hf_config(reader, file)
    if field(reader, "tokenizer.ggml.tokens") is None:
        raise GGUFError(f"{file}: no tokenizer (tokenizer.ggml.tokens missing)")
    save_file(weights(reader, file, cfg), out / "model.safetensors", metadata={"format": "pt", "source": file.name})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg[k] is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as e:
        raise GGUFError(f"{file}: its tokenizer could not be read ({type(e).__name__}: {e})") from None
    template = field(reader, "tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))
