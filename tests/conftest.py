"""Shared fixtures: tiny random Llama checkpoints, the shipped models and the held-out prompts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors in Triton's interpreter; this must be set before anything
    # imports triton (transformers' model classes do)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The services that tests start run on the CPU in float32 (--device auto would pick a GPU and bf16),
# because their outputs are compared with the LLM run here in process, on the CPU: greedy equality
# holds on one device and dtype. The CUDA path is checked against itself (test_graphs, test_kernels,
# test_fused, test_kv_cache run on the GPU when there is one).
os.environ.setdefault("SPECINFER_DEVICE", "cpu")

from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models" / "fixtures"  # the tiny test-fixture pair (most tests run on it)


def save_random_llama(path: Path, seed: int, vocab: int = 64, hidden: int = 32, layers: int = 2,
                      heads: int = 4, kv_heads: int = 2, logit_scale: float = 1.0, **extra) -> LlamaForCausalLM:
    """A random Llama checkpoint directory; logit_scale > 1 sharpens its next-token distributions."""
    torch.manual_seed(seed)
    extra = {"tie_word_embeddings": False, "eos_token_id": None, **extra}
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=512, **extra)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(HF LLM, LLM dir, SSM dir): a random 64-token-vocabulary LLM and an unrelated random SSM."""
    root = tmp_path_factory.mktemp("tiny")
    hf = save_random_llama(root / "llm", seed=0, hidden=64, logit_scale=20.0)
    save_random_llama(root / "ssm", seed=1, hidden=16, layers=1, logit_scale=20.0)
    return hf, root / "llm", root / "ssm"


@pytest.fixture(scope="session")
def heldout_prompts() -> list[dict]:
    with open(MODELS / "heldout_prompts.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def path_to(tree, u: int) -> list[int]:
    """Node indices from the root's child down to u."""
    path = []
    while u >= 0:
        path.append(u)
        u = tree.parents[u]
    return path[::-1]


@pytest.fixture(scope="session")
def heldout_ids(heldout_prompts) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODELS / "llm" / "tokenizer.json"))
    return [tok.encode(p["prompt"]).ids for p in heldout_prompts]


@pytest.fixture(scope="module")
def system():
    """The whole system on the shipped models as separate processes: verifier, two speculators,
    manager (on a free port)."""
    from specinfer_rpc.launch import launch

    system = launch(MODELS / "llm", [MODELS / "ssm-0", MODELS / "ssm-1"], speculators=2, port=0)
    yield system
    system.stop()
