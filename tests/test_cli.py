"""`specinfer generate` as a user runs it: a real subprocess on the shipped models."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .conftest import MODELS, ROOT


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specinfer_cli", "generate", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_generate_json_prints_one_object_per_prompt_with_the_llm_greedy_tokens(tmp_path, heldout_prompts):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p["prompt"]}) + "\n"
                                   for i, p in enumerate(heldout_prompts[:2])))
    proc = run_cli("--prompt-file", str(prompt_file), "--mode", "merged", "--max-new-tokens", "24", "--json")
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["id"] for r in results] == ["p0", "p1"]

    tok = AutoTokenizer.from_pretrained(MODELS / "llm")
    hf = AutoModelForCausalLM.from_pretrained(MODELS / "llm", dtype=torch.float32).eval()
    for r, p in zip(results, heldout_prompts):
        ids = tok(p["prompt"])["input_ids"]
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert r["token_ids"] == want
        assert r["text"] == tok.decode(want)
        assert r["steps"] >= 1 and r["tokens_per_step"] == round((len(want) - 1) / r["steps"], 4)


def test_sampling_flags_are_seeded_and_bad_values_are_refused():
    args = ["--prompt", "def main():\n", "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9", "--json"]
    a, b = run_cli(*args, "--seed", "5"), run_cli(*args, "--seed", "5")
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]
    bad = run_cli("--prompt", "x", "--top-p", "1.5", "--temperature", "1")
    assert bad.returncode == 2 and "top_p" in bad.stderr


def test_serve_answers_generate_server_like_in_process_and_stops_every_process_on_sigterm(tmp_path, heldout_prompts):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p["prompt"]}) + "\n"
                                   for i, p in enumerate(heldout_prompts[:3])))
    serve = subprocess.Popen([sys.executable, "-m", "specinfer_cli", "serve", "--port", str(port)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # started at once: generate --server waits for the manager to come up
        remote = run_cli("--server", f"127.0.0.1:{port}", "--prompt-file", str(prompt_file), "--max-new-tokens", "24", "--json")
        assert remote.returncode == 0, remote.stderr
        assert "ready" in serve.stdout.readline()
    finally:
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=60)
    local = run_cli("--prompt-file", str(prompt_file), "--mode", "incremental", "--max-new-tokens", "24", "--json")
    strip = lambda out: [{k: r[k] for k in ("id", "token_ids", "text", "finish_reason")} for r in map(json.loads, out.splitlines())]
    assert strip(remote.stdout) == strip(local.stdout)
    assert serve.returncode == 0
    pids = [int(m) for m in re.findall(r" pid (\d+) on ", err)]
    assert len(pids) == 4
    for pid in pids:  # every service process is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
