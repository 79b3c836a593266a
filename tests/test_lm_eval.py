"""A real client no one here wrote: lm-evaluation-harness (`lm_eval`, its `local-completions` model)
against the gateway, on tasks this test writes as local JSONL files. The loglikelihood task scores
every choice with echoed prompt logprobs: the same per-choice log-likelihoods and accuracy as the
engine in process; the generate-until task's outputs are the LLM's own greedy text."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel

from .conftest import MODELS, ROOT

QUESTIONS = [
    ("The capital of France is", ["Paris", "Rome", "a dog"], 0),
    ("Two plus two equals", ["four", "seven", "blue"], 0),
    ("def add(a, b):\n    return", ["a + b", "a - b", "None"], 0),
    ("The sky on a clear day is", ["green", "blue", "loud"], 1),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Fahrenheit"], 0),
    ("import numpy as", ["np", "pd", "tf"], 0),
]  # lm_eval puts its target delimiter, a space, before each choice
GENERATE = ["Question: What is 3 + 4?\nAnswer:", "def square(x):\n", "The three primary colours are"]
TASKS = """task: specinfer_mcq
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mcq}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
---
task: specinfer_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: ""
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """lm_eval's samples of both tasks, run against the services' gateway (SSM 0 drafting)."""
    from specinfer_rpc.launch import launch

    root = tmp_path_factory.mktemp("lm-eval")
    (root / "mcq.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                            for q, c, a in QUESTIONS))
    (root / "gen.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in GENERATE))
    for i, text in enumerate(TASKS.format(mcq=root / "mcq.jsonl", gen=root / "gen.jsonl").split("---\n")):
        (root / f"task{i}.yaml").write_text(text)
    system = launch(MODELS / "llm", [MODELS / "ssm-0"], speculators=1, port=0, http_port=0, log_dir=root / "logs")
    try:
        args = (f"base_url={system.gateway.url}/v1/completions,model=llm,tokenizer={MODELS / 'llm'},"
                "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2,max_retries=1")
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                              "--tasks", "specinfer_mcq,specinfer_gen", "--include_path", str(root),
                              "--output_path", str(root / "out"), "--log_samples"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        system.stop()
    assert run.returncode == 0, run.stderr[-3000:]
    samples = {}
    for path in (root / "out").rglob("samples_*.jsonl"):
        task = path.name.split("_", 1)[1].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


@pytest.fixture(scope="module")
def engine():
    return Engine(LlamaModel.from_pretrained(MODELS / "llm"), mode=Mode.INCREMENTAL)


def loglikelihood(engine, tok, context: str, continuation: str) -> tuple[float, bool]:
    """The continuation's log-likelihood after the context and whether it is the greedy one, in
    process, tokenized as lm_eval tokenizes a causal model's pair (the whole text, then split)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    n_ctx = len(tok(context, add_special_tokens=False).input_ids)
    (g,) = engine.generate([Request(whole, 1, prompt_logprobs=True, top_logprobs=1)])
    entries = g.prompt_logprobs[n_ctx - 1:]
    return sum(e.logprob for e in entries), all(e.logprob >= e.top[0][1] for e in entries)


def test_loglikelihoods_and_accuracy_are_the_engines_own(results, engine):
    tok = AutoTokenizer.from_pretrained(MODELS / "llm")
    samples = sorted(results["specinfer_mcq"], key=lambda s: s["doc_id"])
    assert len(samples) == len(QUESTIONS)
    for s, (question, choices, answer) in zip(samples, QUESTIONS):
        got = [r[0] for r in s["resps"]]  # per choice: [log-likelihood, is_greedy], logged as text
        want = [loglikelihood(engine, tok, question, " " + c) for c in choices]
        assert [float(g[0]) for g in got] == pytest.approx([w[0] for w in want], abs=1e-3)
        assert [str(g[1]) == "True" for g in got] == [w[1] for w in want]
        best = max(range(len(want)), key=lambda i: want[i][0])
        assert s["acc"] == float(best == answer)


def test_generate_until_gives_the_llms_greedy_text(results, engine):
    tok = AutoTokenizer.from_pretrained(MODELS / "llm")
    samples = sorted(results["specinfer_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == len(GENERATE)
    for s, question in zip(samples, GENERATE):
        (g,) = engine.generate([Request(tok(question, add_special_tokens=False).input_ids, 16)])
        want = tok.decode(g.token_ids, skip_special_tokens=True).split("\n\n")[0]
        assert s["filtered_resps"][0] == want
