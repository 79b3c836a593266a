"""Load testing: the ghz configs name a real method with a body the server accepts, and
`specinfer loadtest` runs a bounded load and reports what it measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from google.protobuf import json_format
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from specinfer.checkpoints import DEFAULT_LLM, DEFAULT_LLM_INSTALL, checkpoint_dir
from specinfer.generate import Request
from specinfer_rpc.client import generate_all
from specinfer_rpc.v1 import generation_pb2

from .conftest import MODELS, ROOT

CONFIGS = sorted((ROOT / "loadtest").glob("ghz-*.json"))


def default_llm_tokenizer(text: str):
    try:
        return AutoTokenizer.from_pretrained(checkpoint_dir(DEFAULT_LLM))(text)
    except FileNotFoundError:
        pytest.skip(f"the default LLM's package is not installed ({DEFAULT_LLM_INSTALL})")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_ghz_config_names_a_real_method_with_a_valid_body(path, system):
    cfg = json.loads(path.read_text())
    service, method = cfg["call"].rsplit(".", 1)
    assert service == generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    assert method in generation_pb2.DESCRIPTOR.services_by_name["Generation"].methods_by_name
    if "proto" in cfg:
        assert (path.parent / cfg["proto"]).resolve().is_file()
        assert all((path.parent / p).resolve().is_dir() for p in cfg["import-paths"])
    body = json_format.ParseDict(cfg["data"], generation_pb2.GenerateRequest())  # the proto3 JSON mapping
    # the prompt is `def fibonacci(n):` in the default LLM's tokenizer (loadtest/README.md)
    assert list(body.prompt_token_ids) == default_llm_tokenizer("def fibonacci(n):")["input_ids"]
    speculation = "off" if body.speculation.mode == generation_pb2.SPECULATION_MODE_OFF else None
    # the rest of the body, served by the fixture system (its own tokens for the prompt)
    prompt = Tokenizer.from_file(str(MODELS / "llm" / "tokenizer.json")).encode("def fibonacci(n):").ids
    stream = generate_all(system.manager.address, [Request(prompt, body.stopping.max_new_tokens,
                                                           ignore_eos=body.stopping.ignore_eos)], speculation)[0]
    assert len(stream.token_ids) == body.stopping.max_new_tokens


def test_specinfer_loadtest_reports_a_bounded_run(system):
    out = subprocess.run([sys.executable, "-m", "specinfer_cli", "loadtest", "--server", system.manager.address,
                          "--concurrency", "4", "--duration", "4", "--max-new-tokens", "16",
                          "--prompt-file", str(MODELS / "heldout_prompts.jsonl")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["errors"] == 0 and report["requests"] >= 4
    assert report["tokens"] == 16 * report["requests"]
    assert report["tokens_per_s"] > 0 and report["ttft_p50_ms"] <= report["latency_p50_ms"]
    assert report["tokens_per_step"] >= 1.0
