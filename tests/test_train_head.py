"""`specinfer train-head` end to end on the test fixtures, as a user runs it (a real subprocess on the CPU),
and the repository's request set."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specinfer.checkpoints import BASE, checkpoint_dir, default_requests, models_dir, write_base
from specinfer.eagle import EagleHead
from specinfer.generate import Engine, Mode, Request
from specinfer.head_training import RepliesFile, replies, weighted_order
from specinfer.model import LlamaModel
from specinfer.prompts import read_prompt_file
from specinfer.sampling import SamplingParams

from .conftest import MODELS, ROOT
from .test_gguf import write_gguf


def train_head(out: Path, requests: Path, heldout: Path, steps: int, *more: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "specinfer_cli", "train-head", "--llm", str(MODELS / "llm"),
                           "--out", str(out), "--requests", str(requests), "--heldout", str(heldout),
                           "--new-tokens", "16", "--score-tokens", "16", "--batch", "2", "--steps", str(steps),
                           "--draft-vocab", "512", *more],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def trained(tmp_path_factory, heldout_prompts):
    """A head trained for 4 steps, then the same command rerun for 8: (out, heldout records, replies' mtimes
    after the first run)."""
    tmp = tmp_path_factory.mktemp("train-head")
    source = [line for f in sorted((ROOT / "specinfer").glob("*.py")) for line in f.read_text().splitlines(keepends=True)]
    requests = tmp / "requests.jsonl"
    requests.write_text("".join(json.dumps({"id": str(k), "prompt": "".join(source[i: i + 3])}) + "\n"
                                for k, i in enumerate(range(0, 8 * 50, 50))))
    heldout = tmp / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"id": r["id"], "prompt": r["prompt"][-120:]}) + "\n" for r in heldout_prompts[:2]))
    out = tmp / "head"
    train_head(out, requests, heldout, 4)
    replies = (out / "train" / "replies.jsonl.gz").stat().st_mtime_ns
    train_head(out, requests, heldout, 8)
    return out, read_prompt_file(heldout), replies


def logged_losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train" / "loss.jsonl").read_text().splitlines()]


def test_a_rerun_continues_training_where_the_run_stopped(trained):
    out, _, replies = trained
    assert [r["step"] for r in logged_losses(out)] == list(range(8))  # steps 0-3, then 4-7: none twice
    assert (out / "train" / "replies.jsonl.gz").stat().st_mtime_ns == replies  # not generated again
    assert json.loads((out / "agreement.json").read_text())["steps"] == 8


def test_the_loss_falls(trained):
    loss = [r["loss"] for r in logged_losses(trained[0])]
    assert sum(loss[-2:]) < sum(loss[:2])


def test_agreement_is_scored_on_the_heldout_requests(trained):
    report = json.loads((trained[0] / "agreement.json").read_text())
    scored = report["agreement"]["heldout/code"]
    assert scored["prompts"] == 2 and scored["positions"] > 0 and 0 <= scored["first_token"] <= 1
    assert report["draft_vocab"] == 512


def test_the_written_head_loads_and_drafts_and_greedy_output_is_unchanged(trained):
    out, heldout, _ = trained
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    head = EagleHead.from_pretrained(out, llm.cfg, llm.embed.weight)
    assert head.head_cfg.draft_vocab_size == 512
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODELS / "llm")
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in heldout]
    requests = [Request(p, 16, id=str(i)) for i, p in enumerate(prompts)]
    drafted = Engine(llm, mode=Mode.TREE, expansion=[2, 1], heads=[head]).generate(requests)
    plain = Engine(llm, mode=Mode.INCREMENTAL).generate(requests)
    assert [g.token_ids for g in drafted] == [g.token_ids for g in plain]
    assert sum(g.tree_steps for g in drafted) > 0


def test_training_goes_on_from_a_trained_head(trained, tmp_path):
    """--init: training starts from the head's weights and keeps its draft vocabulary: the first step's
    loss, on the same first batch as the fresh run's first step, is the trained head's, lower."""
    out = trained[0]
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    trained_head = EagleHead.from_pretrained(out, llm.cfg, llm.embed.weight)
    again = tmp_path / "again"
    train_head(again, out.parent / "requests.jsonl", out.parent / "heldout.jsonl", 1, "--init", str(out),
               "--replies", str(out / "train" / "replies.jsonl.gz"))
    assert logged_losses(again)[0]["loss"] < logged_losses(out)[0]["loss"]
    assert not (again / "train" / "draft_vocab.json").exists()
    went_on = EagleHead.from_pretrained(again, llm.cfg, llm.embed.weight)
    assert torch.equal(went_on.vocab_ids, trained_head.vocab_ids)


def test_a_head_of_a_gguf_llm_completes_once(trained, tmp_path):
    """A head beside a GGUF LLM holds base.json; completed, it is a plain directory that loads as it is."""
    out = trained[0]
    head = tmp_path / "head"
    head.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(out / name, head / name)
    write_base(head, write_gguf(MODELS / "llm", tmp_path / "llm.gguf"), [])
    done = checkpoint_dir(head)
    assert done != head and not (done / BASE).exists()
    assert checkpoint_dir(done) == done
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    assert EagleHead.from_pretrained(head, llm.cfg, llm.embed.weight).head_cfg.draft_vocab_size == 512


def test_the_request_set_is_large_and_holds_no_heldout_request():
    train = read_prompt_file(default_requests())
    assert len(train) >= 20_000
    text = lambda r: r.get("prompt") or r["messages"][-1]["content"]  # noqa: E731
    heldout = {text(r) for f in models_dir().rglob("*.jsonl") if f != default_requests() for r in read_prompt_file(f)}
    assert len(heldout) >= 64
    assert not {text(r) for r in train} & heldout


def test_replies_file_drops_a_batch_cut_short_refuses_other_flags_and_keeps_dtype_per_batch(tmp_path):
    store = RepliesFile(tmp_path / "r.jsonl.gz", {"llm": "x", "new_tokens": 8})
    store.append([("a", [1, 2]), ("b", [3])])
    whole = store.path.stat().st_size
    store.append([("c", [4, 5, 6])])
    assert store.read() == {"a": [1, 2], "b": [3], "c": [4, 5, 6]}
    with open(store.path, "r+b") as f:  # the second batch's member cut short, as a run killed mid-write leaves it
        f.truncate(store.path.stat().st_size - 5)
    assert store.read() == {"a": [1, 2], "b": [3]}
    assert store.path.stat().st_size == whole
    store.append([("c", [4, 5, 6])])  # appends after the good members
    assert store.read()["c"] == [4, 5, 6]
    with pytest.raises(ValueError, match="new_tokens=8, not 16"):
        RepliesFile(store.path, {"llm": "x", "new_tokens": 16}).read()
    other = RepliesFile(store.path, {"llm": "x", "new_tokens": 8, "dtype": "torch.float32"})
    other.append([("d", [7])])  # another dtype's batch joins the file: a member's dtype is its own
    assert other.read() == {"a": [1, 2], "b": [3], "c": [4, 5, 6], "d": [7]}
    assert {json.loads(line)["meta"].get("dtype") for line in gzip.open(store.path, "rt") if "meta" in line} == {
        None, "torch.float32"}


def test_replies_resume_where_a_run_stopped_and_equal_one_run(tmp_path):
    """Replies made in two runs (the first stopped after its first batch) are those of one run, and the second
    run decodes only the requests the first did not reach."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODELS / "llm")
    records = [{"id": f"r{i}", "prompt": f"def f{i}(x):\n    return"} for i in range(5)]
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in records]
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    made = []

    def model():
        made.append(1)
        return llm

    meta = {"llm": "fixture", "new_tokens": 6}
    whole = replies(model, records, prompts, 6, SamplingParams(), RepliesFile(tmp_path / "one.gz", meta), 2)
    two = RepliesFile(tmp_path / "two.gz", meta)
    first = replies(model, records[:2], prompts[:2], 6, SamplingParams(), two, 2)
    assert len(first) == 2
    assert replies(model, records, prompts, 6, SamplingParams(), two, 2) == whole
    assert len(made) == 3
    assert replies(model, records, prompts, 6, SamplingParams(), two, 2) == whole and len(made) == 3  # nothing to decode


def test_the_order_weights_general_requests_up():
    records = [{"id": f"{kind}-{n}"} for n in range(2000) for kind in ("general", "code")]
    first = weighted_order(records, 0)[: len(records) // 4]
    general = sum(r["id"].startswith("general-") for r in first) / len(first)
    assert general > 0.6  # weight 2 against 1: about 65% of the first quarter, against 50% of the whole
    assert sorted(map(str, weighted_order(records, 0))) == sorted(map(str, records))
