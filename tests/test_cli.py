"""`specinfer generate` as a user runs it: a real subprocess on the test-fixture models."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .conftest import MODELS, ROOT

SUMMARY = re.compile(r"^\[(\w+)\] (\d+) requests?, (\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\), "
                     r"([\d.]+) tokens/step; (.+)$", re.MULTILINE)


FIXTURES = ("--llm", str(MODELS / "llm"), "--ssm", str(MODELS / "ssm-0"), "--ssm", str(MODELS / "ssm-1"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specinfer_cli", "generate", *FIXTURES, *args],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary_of(proc: subprocess.CompletedProcess) -> str:
    """The summary line's tree part, after checking its figures against the JSON lines on stdout (with
    --compare-off: the first line's, the requested mode's; the generations printed are its)."""
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    line, *off = SUMMARY.findall(proc.stderr)
    assert len(off) == ("--compare-off" in proc.args)
    _, requests, tokens, seconds, tok_s, per_step, trees = line
    assert int(requests) == len(results)
    assert int(tokens) == sum(len(r["token_ids"]) for r in results)
    assert float(per_step) == pytest.approx(sum(len(r["token_ids"]) for r in results)
                                            / sum(r["steps"] for r in results), abs=0.006)
    # both figures are rounded: the true seconds lie within half a unit of the last printed digit
    half = 0.5 * 10.0 ** -len(seconds.partition(".")[2])
    assert int(tokens) / (float(seconds) + half) - 0.05 <= float(tok_s) <= int(tokens) / max(float(seconds) - half, 1e-9) + 0.05
    return trees


def test_generate_json_prints_one_object_per_prompt_with_the_llm_greedy_tokens(tmp_path, heldout_prompts):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p["prompt"]}) + "\n"
                                   for i, p in enumerate(heldout_prompts[:2])))
    proc = run_cli("--prompt-file", str(prompt_file), "--mode", "merged", "--max-new-tokens", "24", "--json")
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    # no --expansion: the cost model picks each step's depth, and the engine counts the steps it chose none
    # (the prompt's step drafts nothing: its first token comes first)
    assert re.fullmatch(r"trees in \d+% of steps \(otherwise: (the prompt's step: its first token comes first|"
                        r"the last token needs no draft|the cost model predicts plain decoding faster at batch size 2)\)",
                        summary_of(proc))
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
        assert r["steps"] >= 1 and r["tokens_per_step"] == round(len(want) / r["steps"], 4)


def test_a_chat_request_for_an_llm_without_a_chat_template_is_refused_naming_the_request():
    from specinfer.prompts import prompt_ids

    tok = AutoTokenizer.from_pretrained(MODELS / "llm")  # the fixture LLM's: no chat template
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"^c7: a chat request, and the LLM's tokenizer has no chat template"):
        prompt_ids(tok, {"id": "c7", "messages": chat})  # a prompt file's record
    with pytest.raises(ValueError, match=r"^a chat request, and the LLM's tokenizer has no chat template"):
        prompt_ids(tok, {"messages": chat})  # a caller's (a benchmark's chat turns)
    assert prompt_ids(tok, {"prompt": "def f():"}) == tok("def f():")["input_ids"]


def test_sampling_flags_are_seeded_and_bad_values_are_refused():
    args = ["--prompt", "def main():\n", "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9", "--json"]
    a, b = run_cli(*args, "--seed", "5"), run_cli(*args, "--seed", "5")
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]
    bad = run_cli("--prompt", "x", "--top-p", "1.5", "--temperature", "1")
    assert bad.returncode == 2 and "top_p" in bad.stderr
    bad = run_cli("--prompt", "x", "--lookup-tokens", "0")
    assert bad.returncode == 2 and "--lookup-tokens: must be >= 1, got 0" in bad.stderr


def test_generate_server_says_it_waits_for_an_absent_server_and_gives_up_after_wait_naming_it():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "specinfer_cli", "generate", "--server", address, "--prompt", "x",
                             "--wait", "3"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [(time.monotonic() - start, line) for line in proc.stderr]  # as each line comes
        proc.wait(timeout=30)
    finally:
        proc.kill()
    exited = time.monotonic() - start
    (notice_at, notice), = [(t, line) for t, line in lines if "waiting for the server" in line]
    (error_at, error), = [(t, line) for t, line in lines if line.startswith("error:")]
    assert notice == f"specinfer generate: waiting for the server at {address} (up to 3 s) ...\n"
    assert address in error and "no server answered within 3 s" in error
    assert proc.returncode == 2
    # the client gives up --wait s after it starts waiting, so this says the notice came within
    # 2.5 s of that start (the clock cannot start at launch: importing torch alone takes seconds)
    assert notice_at < error_at - (3 - 2.5)
    assert exited - notice_at < 3 + 5


def test_serve_answers_generate_server_like_in_process_and_stops_every_process_on_sigterm(tmp_path, heldout_prompts):
    port = free_port()
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p["prompt"]}) + "\n"
                                   for i, p in enumerate(heldout_prompts[:3])))
    serve = subprocess.Popen([sys.executable, "-m", "specinfer_cli", "serve", "--port", str(port), "--http-port", "0",
                              "--llm", str(MODELS / "llm"), "--ssm", str(MODELS / "ssm-0")],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # started at once: generate --server waits for the manager to come up
        server = ("--server", f"127.0.0.1:{port}", "--wait", "240", "--prompt-file", str(prompt_file),
                  "--max-new-tokens", "24", "--json")
        remote = run_cli(*server)
        assert remote.returncode == 0, remote.stderr
        assert "ready" in serve.stdout.readline()
        assert re.search(r"live token-tree viewer on http://127\.0\.0\.1:\d+/", serve.stdout.readline())
        assert re.fullmatch(r"trees in every step|trees in \d+% of steps \(otherwise: .+\)|no step used a tree: .+",
                            summary_of(remote))
        plain = run_cli(*server, "--mode", "incremental")
        assert plain.returncode == 0, plain.stderr
        assert summary_of(plain) == "no step used a tree: speculation off for this request"
        # the README's first command: the same requests with speculation off, one at a time, taking turns
        compared = run_cli(*server, "--concurrency", "1", "--compare-off")
        assert compared.returncode == 0, compared.stderr
        summary_of(compared)
        (tree, off) = SUMMARY.findall(compared.stderr)
        assert (tree[0], off[0], off[2], off[5]) == ("tree", "incremental", tree[2], "1.00")
        assert off[6] == "no step used a tree: speculation off for this request"
        assert re.search(r"^speculation \(tree\) ran at [\d.]+x the tokens/s of no speculation; outputs identical$",
                         compared.stderr, re.MULTILINE)
    finally:
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=60)
    local = run_cli("--prompt-file", str(prompt_file), "--mode", "incremental", "--max-new-tokens", "24", "--json")
    assert summary_of(local) == "no step used a tree: speculation off for this request"
    strip = lambda out: [{k: r[k] for k in ("id", "token_ids", "text", "finish_reason")} for r in map(json.loads, out.splitlines())]
    assert strip(remote.stdout) == strip(local.stdout) == strip(plain.stdout) == strip(compared.stdout)
    assert serve.returncode == 0
    pids = [int(m) for m in re.findall(r" pid (\d+) on ", err)]
    assert len(pids) == 4  # verifier, a speculator (SSM 0), manager, gateway
    for pid in pids:  # every service process is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def children(pid: int) -> dict[int, str]:
    """pid -> command line of every live process whose parent is `pid` (from /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
            if entry.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out[int(entry)] = open(f"/proc/{entry}/cmdline").read().replace("\0", " ")
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_serve_stopped_while_starting_stops_the_services_it_already_started():
    serve = subprocess.Popen([sys.executable, "-m", "specinfer_cli", "serve", "--port", str(free_port()),
                              "--http-port", "0", "--llm", str(MODELS / "llm"), "--ssm", str(MODELS / "ssm-0")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not any("speculator_svc" in c for c in children(serve.pid).values()):  # the verifier is up
            assert time.monotonic() < deadline and serve.poll() is None
            time.sleep(0.05)
        started = children(serve.pid)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    assert serve.returncode == 128 + signal.SIGTERM  # stopped before it was ready
    assert any("verifier_svc" in c for c in started.values())
    for pid in started:  # none is left running, orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_serve_names_a_service_that_fails_at_start_with_its_errors_last_line_and_stops_the_others():
    serve = subprocess.run([sys.executable, "-m", "specinfer_cli", "serve", "--port", str(free_port()), "--http-port", "-1",
                            "--llm", str(MODELS / "llm"), "--ssm", str(MODELS / "ssm-0"), "--manager-arg=--no-such-flag"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    last = serve.stderr.strip().splitlines()[-1]
    assert serve.returncode == 1, serve.stderr[-2000:]
    assert last.startswith("specinfer serve: manager failed at start (exit code 2): "), last
    assert "unrecognized arguments: --no-such-flag" in last and last.endswith("every service stopped")
    assert "verifier listening on" not in serve.stdout  # the launcher printed no address: it never got ready


def test_the_default_llms_drafters_serve_unless_told_otherwise_and_another_llm_gets_only_those_named():
    from specinfer.checkpoints import DEFAULT_LLM, default_llm_file, drafter_dirs, served_heads, served_ssms

    (head,), (ssm,) = served_heads(), served_ssms()
    assert (head / "config.json").is_file() and (ssm / "config.json").is_file()
    for defaults, own in ((served_heads, head), (served_ssms, ssm)):
        assert drafter_dirs(None, False, DEFAULT_LLM, defaults) == [own]
        assert drafter_dirs(None, False, str(default_llm_file()), defaults) == [own]  # its GGUF file by path
        assert drafter_dirs(None, True, DEFAULT_LLM, defaults) == []  # --no-head, --no-ssm
        assert drafter_dirs(None, False, str(MODELS / "llm"), defaults) == []  # not the default LLM's
        assert drafter_dirs([MODELS / "d"], False, str(MODELS / "llm"), defaults) == [MODELS / "d"]
    nothing = subprocess.run([sys.executable, "-m", "specinfer_cli", "serve", "--llm", str(MODELS / "llm"),
                              "--speculators", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert nothing.returncode == 2 and "--speculators 2: speculator processes host an SSM" in nothing.stderr


def test_serve_of_an_llm_without_drafters_speculates_with_context_lookup_alone(tmp_path, heldout_prompts):
    """`specinfer serve --llm` of an LLM with no drafter model named: no speculator starts (the default
    LLM's SSM would not share its tokenizer), the manager's context lookup drafts alone, and the
    output is the LLM's greedy output."""
    port = free_port()
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p["prompt"]}) + "\n"
                                   for i, p in enumerate(heldout_prompts[:3])))
    serve = subprocess.Popen([sys.executable, "-m", "specinfer_cli", "serve", "--port", str(port), "--http-port", "-1",
                              "--llm", str(MODELS / "llm")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        remote = subprocess.run([sys.executable, "-m", "specinfer_cli", "generate", "--llm", str(MODELS / "llm"),
                                 "--server", f"127.0.0.1:{port}", "--wait", "240", "--prompt-file", str(prompt_file),
                                 "--max-new-tokens", "48", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert remote.returncode == 0, remote.stderr
        assert re.fullmatch(r"trees in every step|trees in \d+% of steps \(otherwise: .+\)", summary_of(remote))
    finally:
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=60)
    assert serve.returncode == 0, err
    assert re.findall(r"specinfer serve: (\S+) pid \d+ on ", err) == ["verifier", "manager"]
    local = run_cli("--prompt-file", str(prompt_file), "--mode", "incremental", "--max-new-tokens", "48", "--json")
    alone = subprocess.run([sys.executable, "-m", "specinfer_cli", "generate", "--llm", str(MODELS / "llm"),  # in process
                            "--prompt-file", str(prompt_file), "--max-new-tokens", "48", "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr
    assert re.fullmatch(r"trees in every step|trees in \d+% of steps \(otherwise: .+\)", summary_of(alone))
    strip = lambda out: [{k: r[k] for k in ("id", "token_ids", "finish_reason")} for r in map(json.loads, out.splitlines())]
    assert strip(remote.stdout) == strip(local.stdout) == strip(alone.stdout)
    nothing = subprocess.run([sys.executable, "-m", "specinfer_cli", "generate", "--llm", str(MODELS / "llm"), "--no-ssm",
                              "--no-context-lookup", "--prompt", "x"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert nothing.returncode == 2 and "needs at least one SSM or head (or context lookup)" in nothing.stderr


def test_compare_off_runs_the_modes_in_rounds_that_take_turns_and_adds_each_modes_rounds():
    from specinfer.generate import Generation
    from specinfer_cli.main import interleaved

    calls, shown = [], []

    def run(mode: str, seconds: float):
        def go(records):
            calls.append((mode, [r["id"] for r in records]))
            return [Generation(r["id"], [1, 2], "length", 1) for r in records], [mode + r["id"] for r in records], seconds
        return go
    records = [{"id": str(i)} for i in range(5)]
    out = interleaved({"tree": run("tree", 0.5), "incremental": run("incremental", 2.0)}, records, 2,
                      lambda mode, gens, texts: shown.append((mode, texts)))
    assert calls == [("tree", ["0", "1"]), ("incremental", ["0", "1"]),
                     ("incremental", ["2", "3"]), ("tree", ["2", "3"]),
                     ("tree", ["4"]), ("incremental", ["4"])]
    assert [mode for mode, _ in shown] == [mode for mode, _ in calls]
    assert shown[3] == ("tree", ["tree2", "tree3"])
    for mode, seconds in (("tree", 0.5), ("incremental", 2.0)):
        gens, total = out[mode]
        assert [g.id for g in gens] == [r["id"] for r in records]
        assert total == pytest.approx(3 * seconds)


def test_compare_off_names_the_first_difference_and_fails_a_greedy_or_seeded_one_but_not_an_mss_sample():
    from specinfer.generate import Generation
    from specinfer_cli.main import compared_outputs

    plain = [Generation("a", [5, 6, 7]), Generation("b", [1, 2, 3]), Generation("c", [4])]
    assert compared_outputs([Generation(g.id, list(g.token_ids)) for g in plain], plain, exact=True) == ("identical", False)
    flipped = [Generation("a", [5, 6, 7]), Generation("b", [1, 9, 3]), Generation("c", [8])]
    verdict, failed = compared_outputs(flipped, plain, exact=True)
    assert failed and verdict.startswith("DIFFER, a failure")
    assert verdict.endswith("request b first differs at generated token 1: 9 with speculation, 2 without")
    verdict, failed = compared_outputs(flipped, plain, exact=False)  # --mss: another correct sample
    assert not failed and "each is a correct sample" in verdict and "request b" in verdict
    shorter = [Generation("a", [5, 6])] + plain[1:]  # one stopped early
    assert compared_outputs(shorter, plain, exact=True)[0].endswith("token 2: the end with speculation, 7 without")
