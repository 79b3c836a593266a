"""The HTTP gateway as users see it: the official OpenAI client against real processes (verifier,
speculators, managers, gateways) on the shipped models."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

from manager_svc.__main__ import ManagerConfig
from specinfer.generate import Request
from specinfer.sampling import SamplingParams
from specinfer_rpc.launch import System, launch

from .conftest import MODELS, ROOT
from .services import active_requests, reference_greedy, seeded_reference

CHAT_TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}### assistant:\n{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    """The system with its gateway; a second manager on the same verifier and speculators that
    wants a bearer token and holds one request running and one waiting, behind a gateway whose
    tokenizer has a chat template and whose requests time out after 5 s; and a gateway in front
    of an address where nothing listens."""
    root = tmp_path_factory.mktemp("gateway")
    chat_tok = root / "chat-tokenizer"
    chat_tok.mkdir()
    shutil.copy(MODELS / "llm" / "tokenizer.json", chat_tok)
    config = json.loads((MODELS / "llm" / "tokenizer_config.json").read_text())
    (chat_tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    system = launch(MODELS / "llm", [MODELS / "ssm-0", MODELS / "ssm-1"], speculators=2, port=0, http_port=0,
                    manager_args=["--kv-cache-share=0.5"], log_dir=root / "logs")
    strict = System(log_dir=root / "logs")
    dead = None
    try:
        verifier = system.by_name("verifier").address
        specs = ",".join(s.address for s in system.services if s.name.startswith("speculator"))
        manager = strict.start("manager-strict", "manager_svc",
                               ["--port", "0", "--metrics-port", "0", "--verifier", verifier, "--speculators", specs, "--auth-token", "sesame",
                                "--kv-cache-share=0.5", "--max-batch=1", "--max-queue=1", "--tokenizer", str(MODELS / "llm")], 120)
        strict.start("gateway-strict", "gateway_svc", ["--port", "0", "--manager", manager.address, "--tokenizer",
                                                       str(chat_tok), "--request-timeout", "20"], 120, http="http")
        dead_port = free_port()
        dead = subprocess.Popen([sys.executable, "-m", "gateway_svc", "--port", "0", "--manager",
                                 f"127.0.0.1:{dead_port}", "--tokenizer", str(MODELS / "llm")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        dead_address = next(line.split(" listening on ")[1].strip() for line in dead.stdout if " listening on " in line)
        yield {"system": system, "url": system.gateway.url, "strict": strict.by_name("gateway-strict").url,
               "strict_manager": manager, "dead": f"http://{dead_address}"}
    finally:
        if dead is not None:
            dead.terminate()
            dead.wait(30)
        strict.stop()
        system.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODELS / "llm")


def client(url: str, token: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, **kw)


def reference_text(tokenizer, ids: list[int], n: int, ignore_eos: bool = False) -> tuple[str, list[int]]:
    out = reference_greedy([ids], n, ignore_eos)[0]
    return tokenizer.decode(out, skip_special_tokens=True), out


def test_completions_greedy_text_is_the_llm_alone_streamed_or_not(gw, tokenizer, heldout_prompts):
    c = client(gw["url"])
    for p in heldout_prompts[:3]:
        ids = tokenizer(p["prompt"])["input_ids"]
        want, want_ids = reference_text(tokenizer, ids, 32, ignore_eos=True)
        extra = {"speculation": "2,2,1,1", "ignore_eos": True}
        whole = c.completions.create(model="llm", prompt=p["prompt"], max_tokens=32, temperature=0, extra_body=extra)
        assert whole.choices[0].text == want
        assert whole.choices[0].finish_reason == "length"
        u = whole.usage
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), 32, len(ids) + 32)
        spec = u.model_extra["speculation"]
        assert spec["mean_tokens_per_step"] == pytest.approx(32 / spec["verifier_steps"])
        # every step emits its accepted drafts plus the LLM's own token (a last step may be cut)
        assert 0 <= spec["accepted_draft_tokens"] - (32 - spec["verifier_steps"]) <= 1
        assert spec["tree_steps"] >= 1

        chunks = list(c.completions.create(model="llm", prompt=ids, max_tokens=32, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body=extra))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        assert [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]] == want_ids
        assert chunks[-1].usage.completion_tokens == 32 and chunks[-2].choices[0].finish_reason == "length"


def test_a_seed_gives_plain_seeded_samplings_text_whatever_the_speculation_and_no_seed_a_fresh_one(gw, tokenizer,
                                                                                              heldout_prompts):
    c = client(gw["url"])
    prompt = heldout_prompts[1]["prompt"]
    ids = tokenizer(prompt)["input_ids"]
    plain = seeded_reference(Request(ids, 24, SamplingParams(0.8, top_p=0.95, seed=7), ignore_eos=True))

    def tokens(speculation, seed=7, temperature=0.8) -> list[int]:
        extra = {"ignore_eos": True} | ({"speculation": speculation} if speculation else {})
        chunks = c.completions.create(model="llm", prompt=prompt, max_tokens=24, temperature=temperature, top_p=0.95,
                                      seed=seed, stream=True, extra_body=extra)
        return [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]

    for speculation in ("off", "2,2,1", None):
        assert tokens(speculation) == plain, speculation
    unseeded = {tuple(tokens(None, seed=None, temperature=1.5)) for _ in range(3)}
    assert len(unseeded) > 1, "no seed: a fresh seed per request"


def test_min_p_gives_plain_seeded_sampling_with_min_p_whatever_the_speculation(gw, tokenizer, heldout_prompts):
    c = client(gw["url"])
    ids = tokenizer(heldout_prompts[2]["prompt"])["input_ids"]
    sampling = SamplingParams(1.5, min_p=0.2, seed=3)
    want = seeded_reference(Request(ids, 24, sampling, ignore_eos=True))
    for speculation in ("off", "2,2,1"):
        chunks = c.completions.create(model="llm", prompt=ids, max_tokens=24, temperature=1.5, seed=3, stream=True,
                                      extra_body={"min_p": 0.2, "ignore_eos": True, "speculation": speculation})
        assert [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]] == want, speculation
    assert want != seeded_reference(Request(ids, 24, replace(sampling, min_p=0.0), ignore_eos=True))


def test_penalties_bias_min_tokens_and_allowed_ids_give_the_engines_output_whatever_the_speculation(
        gw, tokenizer, heldout_prompts):
    """Greedy and seeded, through the gateway: the in-process LLM alone with the same parameters."""
    c = client(gw["url"])
    ids = tokenizer(heldout_prompts[0]["prompt"])["input_ids"]
    eos = tokenizer.eos_token_id
    params = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logit_bias": {str(eos): 3.0, "11": -2.0}}
    allowed = sorted(set(range(0, tokenizer.vocab_size, 2)) | {eos})
    extra = {"repetition_penalty": 1.3, "min_tokens": 10, "allowed_token_ids": allowed}
    sampling = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                              logit_bias=((11, -2.0), (eos, 3.0)), min_tokens=10, allowed_token_ids=tuple(allowed))
    for temperature, seed in ((0.0, 0), (0.8, 5)):
        want = seeded_reference(Request(ids, 24, replace(sampling, temperature=temperature, seed=seed)))
        for speculation in ("off", "2,2,1,1"):
            chunks = c.completions.create(model="llm", prompt=ids, max_tokens=24, temperature=temperature, seed=seed,
                                          stream=True, extra_body={**extra, "speculation": speculation}, **params)
            got = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]
            assert got == want, (temperature, speculation)
    plain = reference_greedy([ids], 24)[0]
    assert plain != want and eos not in want[:10]
    assert set(want) <= set(allowed) and not set(plain) <= set(allowed)


def test_stop_strings_and_stop_token_ids_end_the_text_before_them(gw, tokenizer, heldout_prompts):
    """... or after a stop string with vLLM's include_stop_str_in_output; vLLM's stop_token_ids are ids in stop."""
    c = client(gw["url"])
    prompt = heldout_prompts[0]["prompt"]
    want, want_ids = reference_text(tokenizer, tokenizer(prompt)["input_ids"], 48, ignore_eos=True)
    stop = next(want[i:i + 2] for i in range(4, len(want) - 2) if want[i:i + 2].strip())  # a string that occurs
    for stream, include in itertools.product((False, True), (False, True)):
        got = c.completions.create(model="llm", prompt=prompt, max_tokens=48, temperature=0, stop=[stop],
                                   stream=stream, extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        text = "".join(ch.choices[0].text for ch in got) if stream else got.choices[0].text
        assert text == want[:want.index(stop) + include * len(stop)], (stream, include)
    # a stop string that spans two tokens: the last character of one and the first of the next
    bounds = [len(tokenizer.decode(want_ids[:k + 1], skip_special_tokens=True)) for k in range(len(want_ids) - 1)]
    spanning = next(want[b - 1:b + 1] for b in bounds[3:] if want[b - 1:b + 1].strip() == want[b - 1:b + 1]
                    and want.index(want[b - 1:b + 1]) == b - 1)
    got = c.completions.create(model="llm", prompt=prompt, max_tokens=48, temperature=0, stop=[spanning],
                               extra_body={"ignore_eos": True})
    assert got.choices[0].text == want[:want.index(spanning)] and got.choices[0].finish_reason == "stop"
    token = want_ids[5]
    for ids in ({"stop": [token]}, {"stop_token_ids": [token]}):
        got = c.completions.create(model="llm", prompt=prompt, max_tokens=48, temperature=0, extra_body={
            "ignore_eos": True, **ids})
        assert got.choices[0].finish_reason == "stop"
        assert got.choices[0].text == tokenizer.decode(want_ids[:want_ids.index(token)], skip_special_tokens=True)


def test_chat_uses_the_checkpoints_template_and_a_model_without_one_gets_400(gw, tokenizer):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    c = client(gw["strict"], "sesame")
    prompt = ("### system:\nYou write Python.\n### user:\ndef add(a, b):\n### assistant:\n")
    want, _ = reference_text(tokenizer, tokenizer(prompt)["input_ids"], 12, ignore_eos=True)
    whole = c.chat.completions.create(model="llm", messages=messages, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    chunks = list(c.chat.completions.create(model="llm", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    with pytest.raises(openai.BadRequestError) as e:
        client(gw["url"]).chat.completions.create(model="llm", messages=messages, max_tokens=4)
    assert e.value.body["param"] == "messages" and "chat template" in e.value.body["message"]


def test_a_chats_next_turn_finds_the_earlier_turns_in_the_prefix_cache(gw, tokenizer):
    """The second turn sends the whole conversation again: the verifier's prefix cache holds every
    full block of the first turn's prompt (reported as cached tokens), and the reply is still the
    LLM's own; `priority` is accepted."""
    c = client(gw["strict"], "sesame")
    messages = [{"role": "system", "content": "You answer in Python, tersely, for the prefix cache test."},
                {"role": "user", "content": "def fibonacci(n):"}]
    first = c.chat.completions.create(model="llm", messages=messages, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True, "priority": -1})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And def factorial(n):"}]
    prompt = "".join(f"### {m['role']}:\n{m['content']}\n" for m in messages) + "### assistant:\n"
    ids = tokenizer(prompt)["input_ids"]
    want, _ = reference_text(tokenizer, ids, 12, ignore_eos=True)
    second = c.chat.completions.create(model="llm", messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert second.choices[0].message.content == want and second.usage.prompt_tokens == len(ids)
    # (the first prompt's last token may be tokenized otherwise once the reply follows it)
    assert second.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens - 1) // 16 * 16 >= 32


@pytest.mark.parametrize("params, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 100000}, "max_tokens"),
    ({"n": 17}, "n"), ({"logprobs": 21}, "logprobs"), ({"best_of": 3}, "best_of"), ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "stream": True, "n": 2}, "echo"), ({"suffix": "x"}, "suffix"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"logit_bias": {"the": 1}}, "logit_bias"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"extra_body": {"min_tokens": 5}}, "min_tokens"), ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"speculation": "9,9"}}, "speculation"), ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ({"extra_body": {"allowed_token_ids": [10 ** 9]}}, "allowed_token_ids"),
    ({"extra_body": {"stop": [10 ** 9]}}, "stop"), ({"extra_body": {"not_a_parameter": 1}}, "not_a_parameter"),
    ({"prompt": ""}, "prompt"), ({"prompt": [[1]] * 513, "n": 2}, "prompt"),
    ({"extra_body": {"prediction": {"type": "text", "content": "x"}}}, "prediction.type"),
    ({"extra_body": {"prediction": {"type": "content", "content": [{"type": "image_url"}]}}}, "prediction.content"),
    ({"extra_body": {"prediction": {"type": "content", "content": "def f(x):\n" * 600}}}, "prediction")])
def test_bad_or_unsupported_parameters_get_400_naming_the_field(gw, params, field):
    kw = {"model": "llm", "prompt": "x", "max_tokens": 4, **params}
    with pytest.raises(openai.BadRequestError) as e:
        client(gw["url"]).completions.create(**kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == field and e.value.body["message"].startswith(field), e.value.body


def test_error_statuses_in_openais_shape(gw):
    c = client(gw["url"])
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    for token in ("unused", "wrong"):
        with pytest.raises(openai.AuthenticationError) as e:
            client(gw["strict"], token).completions.create(model="llm", prompt="x", max_tokens=2)
        assert e.value.body["type"] == "authentication_error"
    ok = client(gw["strict"], "sesame").completions.create(model="llm", prompt="x", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1
    with pytest.raises(openai.APIStatusError) as e:
        client(gw["dead"]).completions.create(model="llm", prompt="x", max_tokens=2)
    assert e.value.status_code == 503
    with urllib.request.urlopen(gw["url"] + "/health") as r:
        assert json.load(r)["status"] == "ok"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(gw["dead"] + "/health")
    assert e.value.code == 503
    request = urllib.request.Request(gw["url"] + "/v1/completions", b"{not json", {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request)
    assert e.value.code == 400 and "error" in json.load(e.value)


def test_a_batch_of_128_prompts_gives_each_prompts_own_choice(gw, heldout_ids):
    """lm-evaluation-harness's `--batch_size 128`: 128 token-id prompts in one request (echo, logprobs,
    as it scores), each choice the prompt sent alone."""
    c = client(gw["url"])
    prompts = [ids[:8 + k] for ids in heldout_ids[:32] for k in (0, 3, 6, 9)]
    kw = {"model": "llm", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    batch = sorted(c.completions.create(prompt=prompts, **kw).choices, key=lambda ch: ch.index)
    assert [ch.index for ch in batch] == list(range(128))
    for got, prompt in zip(batch, prompts):
        (alone,) = c.completions.create(prompt=prompt, **kw).choices
        assert (got.text, got.logprobs.tokens) == (alone.text, alone.logprobs.tokens)
        assert got.logprobs.token_logprobs[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-4)


def test_a_batch_beyond_the_managers_queue_gets_429_and_leaves_no_request_behind(gw):
    """The strict manager runs one request and queues one: of three prompts in one request, one is
    refused, so the client gets 429 for the whole request and the other two are cancelled, not kept
    running for no one."""
    c = client(gw["strict"], "sesame")
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="llm", prompt=["def f(x):", "class A:", "import os"], max_tokens=1000,
                             temperature=0, extra_body={"ignore_eos": True})
    assert e.value.body["type"] == "rate_limit_error" and "3 choices" in e.value.body["message"]
    manager = gw["strict_manager"].metrics.removesuffix("/metrics")
    deadline = time.monotonic() + 30
    while gateway_metric(manager, "specinfer_requests_running") + waiting(gw["strict_manager"]) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway_metric(manager, "specinfer_requests_running") == waiting(gw["strict_manager"]) == 0


def test_unknown_routes_and_wrong_methods_get_openais_error_shape(gw):
    for method, path, status in (("GET", "/v1/nope", 404), ("POST", "/v1/engines/llm/completions", 404),
                                 ("GET", "/static/nope.js", 404), ("POST", "/v1/models", 405),
                                 ("GET", "/v1/completions", 405), ("DELETE", "/v1/chat/completions", 405)):
        request = urllib.request.Request(gw["url"] + path, b"{}" if method != "GET" else None,
                                         {"Content-Type": "application/json"}, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request)
        body = json.load(e.value)
        assert e.value.code == status, (method, path)
        assert body.keys() == {"error"} and body["error"].keys() == {"message", "type", "param", "code"}
        assert f"{method} {path}" in body["error"]["message"]
        if status == 405:
            allowed = "GET" if path == "/v1/models" else "POST"
            assert e.value.headers["Allow"] == allowed and f"allowed: {allowed}" in body["error"]["message"]


def test_a_full_queue_gets_429_and_a_slow_request_504(gw):
    """The strict manager runs one request and queues one; its gateway gives a request 20 s. The
    verifier is paused (SIGSTOP) once the first request runs, so the queued one cannot finish in
    time on any machine."""
    c = client(gw["strict"], "sesame")
    long = {"model": "llm", "prompt": "def f(x):", "max_tokens": 1000, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    running = c.completions.create(**long, stream=True)
    next(iter(running))  # the first request is running
    verifier = gw["system"].by_name("verifier").process.pid
    os.kill(verifier, signal.SIGSTOP)
    try:
        outcomes = []
        queued = threading.Thread(target=lambda: outcomes.append(_status(lambda: c.completions.create(**long))))
        queued.start()
        deadline = time.monotonic() + 30
        while waiting(gw["strict_manager"]) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(**long)
        assert e.value.status_code == 429 and e.value.body["type"] == "rate_limit_error"
        queued.join(60)
        assert outcomes == [504]
    finally:
        os.kill(verifier, signal.SIGCONT)
        running.close()


def _status(call) -> int:
    try:
        call()
        return 200
    except openai.APIStatusError as e:
        return e.status_code


def waiting(manager) -> float:
    return gateway_metric(manager.metrics.removesuffix("/metrics"), "specinfer_requests_waiting")


def test_a_client_that_disconnects_frees_the_request_on_every_service(gw):
    system = gw["system"]
    before = gateway_metric(gw["url"], "specinfer_gateway_client_disconnects_total")
    c = client(gw["url"], timeout=2.0)
    long = {"model": "llm", "prompt": "class A:", "max_tokens": 1000, "temperature": 0,
            "extra_body": {"ignore_eos": True, "speculation": "2,1"}}
    stream = c.completions.create(**long, stream=True)
    events = iter(stream)
    next(events), next(events)
    assert sum(active_requests(system).values()) > 0  # mid-stream: the request holds state
    stream.close()
    with pytest.raises(openai.APITimeoutError):  # non-streaming: the client gives up after 2 s
        c.completions.create(**long)
    deadline = time.monotonic() + 30
    while sum(active_requests(system).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert active_requests(system) == {s.name: 0 for s in system.services if s.name not in ("manager", "gateway")}
    metrics = urllib.request.urlopen(system.manager.metrics).read().decode()
    assert "specinfer_requests_running 0.0" in metrics
    assert gateway_metric(gw["url"], "specinfer_gateway_client_disconnects_total") == before + 2
    assert gateway_metric(gw["url"], "specinfer_gateway_requests_in_flight") == 0


def gateway_metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def post(url: str, body: dict, token: str = "sesame") -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                      "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_tokenize_counts_as_completions_and_chat_do_and_detokenize_inverts_it(gw, tokenizer):
    """vLLM's /tokenize, /detokenize and /tokenizer_info with the gateway's own tokenizer (and chat
    template), as lm-evaluation-harness's remote tokenizer reads them."""
    from lm_eval.utils import RemoteTokenizer

    url, c = gw["strict"], client(gw["strict"], "sesame")
    context = c.models.list().data[0].model_extra["specinfer"]["context_length"]
    text = "def add(a, b):\n    return a + b  # <|endoftext|> é"
    status, got = post(url + "/tokenize", {"model": "llm", "prompt": text})
    assert status == 200 and got == {"count": len(got["tokens"]), "max_model_len": context,
                                     "tokens": tokenizer(text)["input_ids"]}
    assert c.completions.create(model="llm", prompt=text, max_tokens=1).usage.prompt_tokens == got["count"]
    messages = [{"role": "user", "content": "def add(a, b):"}]
    status, chat = post(url + "/tokenize", {"messages": messages})
    assert status == 200 and chat["count"] == c.chat.completions.create(
        model="llm", messages=messages, max_tokens=1).usage.prompt_tokens
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    status, with_tools = post(url + "/tokenize", {"messages": messages, "tools": tools, "tool_choice": "required"})
    assert status == 200 and with_tools["count"] == c.chat.completions.create(
        model="llm", messages=messages, tools=tools, tool_choice="required", max_tokens=1).usage.prompt_tokens > chat["count"]
    bare = post(url + "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"]
    assert post(url + "/detokenize", {"model": "llm", "tokens": bare}) == (200, {"prompt": text})

    remote = RemoteTokenizer(url + "/v1/completions", auth_token="sesame")
    assert remote.encode(text) == bare and remote.decode(bare) == text
    assert remote.eos_token_id == tokenizer.eos_token_id
    info = remote.tokenizer_info
    assert info["chat_template"] == CHAT_TEMPLATE and info["model_max_length"] == context

    for path, body, status, field in (("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
                                      ("/tokenize", {"model": "llm"}, 400, "prompt"),
                                      ("/tokenize", {"prompt": "x", "return_token_strs": 1}, 400, "return_token_strs"),
                                      ("/tokenize", {"prompt": "x", "tools": tools}, 400, "tools"),
                                      ("/tokenize", {"messages": messages, "tool_choice": "auto"}, 400, "tool_choice"),
                                      ("/detokenize", {"tokens": [0, -1]}, 400, "tokens"),
                                      ("/detokenize", {"tokens": "12"}, 400, "tokens")):
        got = post(url + path, body)
        assert got[0] == status and got[1]["error"]["param"] == field, (path, body, got)


def test_models_lists_the_served_model_with_its_speculation_settings(gw):
    models = client(gw["url"]).models.list().data
    assert [m.id for m in models] == ["llm"]
    assert models[0].model_extra["specinfer"]["expansion"] == ManagerConfig().expansion


# ---------------------------------------------------------------- tool calls (gateway_svc/tools.py)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
                   "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                  "unit": {"enum": ["c", "f"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["utc", "cet", "pst"]}}}}}
ZONES = {"type": "function", "function": {"name": "get_times", "parameters": {  # references, as pydantic writes them
    "$defs": {"Zone": {"enum": ["utc", "cet", "pst"]},
              "Zones": {"type": "array", "items": {"$ref": "#/$defs/Zone"}, "minItems": 1, "maxItems": 3}},
    "type": "object", "additionalProperties": False, "required": ["zones"], "properties": {"zones": {"$ref": "#/$defs/Zones"}}}}}
ASK = [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "def weather(city):"}]


def tool_reference(tokenizer, messages: list[dict], plan) -> tuple[list[int], str, int]:
    """The LLM alone, greedy, constrained by the plan's grammar, on the conversation as the gateway
    shows it (the strict gateway's template): its tokens, text and prompt length."""
    from tokenizers import Tokenizer

    from gateway_svc.protocol import ChatMessage
    from gateway_svc.tools import shown
    from specinfer.generate import Engine, Mode
    from specinfer.grammar import Grammars, GrammarSpec
    from specinfer.model import LlamaModel

    turns = shown([ChatMessage(**m).turn(i) for i, m in enumerate(messages)], plan)
    prompt = "".join(f"### {t['role']}:\n{t['content']}\n" for t in turns) + "### assistant:\n"
    ids = tokenizer(prompt)["input_ids"]
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    tok = Tokenizer.from_file(str(MODELS / "llm" / "tokenizer.json"))
    grammars = Grammars(tok.to_str(), llm.cfg.vocab_size, list(llm.cfg.eos_token_ids))
    (g,) = Engine(llm, mode=Mode.INCREMENTAL, grammars=grammars).generate(
        [Request(ids, 96, grammar=GrammarSpec("lark", plan.grammar()) if plan else None)])
    out = g.token_ids[:-1] if g.finish_reason == "eos" else g.token_ids
    return out, tokenizer.decode(out, skip_special_tokens=True), len(ids)


def streamed_calls(chunks) -> tuple[str, list[dict], str]:
    """A streamed reply's text, calls (their fragments joined by index, as OpenAI's clients do) and
    finish reason."""
    text, calls, finish = "", {}, None
    for ch in chunks:
        delta = ch.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or ():
            got = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            got["name"] += call.function.name or ""
            got["arguments"] += call.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tools, choice, parallel", [
    ([WEATHER, CLOCK], "required", True), ([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}}, True),
    ([WEATHER], "required", False), ([ZONES, WEATHER], "required", False), ([WEATHER, CLOCK], "auto", True),
    ([WEATHER, CLOCK], None, True)])
def test_tool_calls_are_the_llms_constrained_output_whatever_the_speculation_and_validate(
        gw, tokenizer, tools, choice, parallel):
    """A request with tools gets the LLM's greedy output under the call grammar (tools.py), exactly,
    with speculation off, a fixed tree or the default; a call parses into OpenAI's tool_calls, each
    name among the tools offered and its arguments valid against the tool's parameters, the same
    streamed; `auto` (the default) may also be text, which is then the reply's content."""
    import jsonschema

    from gateway_svc.protocol import ChatCompletionRequest

    body = {"model": "llm", "messages": ASK, "tools": tools, "parallel_tool_calls": parallel,
            **({"tool_choice": choice} if choice else {})}
    plan = ChatCompletionRequest(**body).tool_plan()
    _, want_text, prompt_tokens = tool_reference(tokenizer, ASK, plan)
    want_calls = plan.parse(want_text)
    # a call is forced; with auto the fixtures' LLM (a code model) answers in text (the auto call's
    # stream: test_a_streamed_reply_is_held_back_only_while_it_may_be_a_call)
    assert (want_calls is not None) == (choice not in ("auto", None)), want_text
    offered = {t["function"]["name"]: t["function"]["parameters"] for t in tools
               if not isinstance(choice, dict) or t["function"]["name"] == choice["function"]["name"]}
    for call in want_calls or ():
        jsonschema.validate(json.loads(call["function"]["arguments"]), offered[call["function"]["name"]])
        assert "$defs" not in call["function"]["arguments"]
    if want_calls and not parallel:
        assert len(want_calls) == 1
    strip = lambda calls: [(x["function"]["name"], x["function"]["arguments"]) for x in calls]  # noqa: E731
    c = client(gw["strict"], "sesame")
    kw = {k: v for k, v in body.items() if k not in ("model", "messages")}
    for speculation in ("off", "2,2,1,1", None):
        extra = {"speculation": speculation} if speculation else {}
        whole = c.chat.completions.create(model="llm", messages=ASK, max_tokens=96, temperature=0, extra_body=extra, **kw)
        got = whole.choices[0]
        assert whole.usage.prompt_tokens == prompt_tokens
        if want_calls:
            assert got.finish_reason == "tool_calls" and got.message.content is None
            assert strip([x.model_dump() for x in got.message.tool_calls]) == strip(want_calls)
            assert all(x.id.startswith("call_") and x.type == "function" for x in got.message.tool_calls)
        else:
            assert got.message.content == want_text and not got.message.tool_calls
        text, calls, finish = streamed_calls(c.chat.completions.create(
            model="llm", messages=ASK, max_tokens=96, temperature=0, stream=True, extra_body=extra, **kw))
        if want_calls:
            assert (text, finish) == ("", "tool_calls")
            assert [(x["name"], x["arguments"]) for x in calls] == strip(want_calls)
        else:
            assert (text, calls) == (want_text, [])


def test_a_conversation_carries_earlier_calls_and_their_results(gw, tokenizer):
    """The client sends the reply's message back with the tool's result: the calls are written in the
    format the model is asked for, the result in the `tool` role, and the next reply is the LLM's own
    on that conversation; tool_choice "none" hides the tools and gives text."""
    from gateway_svc.protocol import ChatCompletionRequest

    c = client(gw["strict"], "sesame")
    first = c.chat.completions.create(model="llm", messages=ASK, tools=[WEATHER], tool_choice="required",
                                      max_tokens=96, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(),  # as clients send it back (refusal: None, ...)
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == call.function.arguments
    for choice in ("auto", "none"):
        plan = ChatCompletionRequest(model="llm", messages=messages, tools=[WEATHER], tool_choice=choice).tool_plan()
        _, want_text, prompt_tokens = tool_reference(tokenizer, messages, plan)
        got = c.chat.completions.create(model="llm", messages=messages, tools=[WEATHER], tool_choice=choice,
                                        max_tokens=96, temperature=0)
        assert got.usage.prompt_tokens == prompt_tokens
        calls = plan.parse(want_text) if plan else None
        if calls:
            assert [x.function.arguments for x in got.choices[0].message.tool_calls] == \
                [x["function"]["arguments"] for x in calls]
        else:
            assert got.choices[0].message.content == want_text
    assert plan is None  # "none": the reference above had no tools in its prompt and no grammar


@pytest.mark.parametrize("params, field", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "("}}}]},
     "tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls")])
def test_bad_tools_get_400_naming_the_field(gw, params, field):
    body = {"model": "llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **params}
    status, got = post(gw["strict"] + "/v1/chat/completions", body)
    assert status == 400 and got["error"]["param"] == field and got["error"]["message"].startswith(field), got


def test_a_streamed_reply_is_held_back_only_while_it_may_be_a_call():
    from gateway_svc.tools import FunctionDef, StreamedCalls, ToolPlan

    auto = ToolPlan((FunctionDef(name="f"),), "auto")
    s = StreamedCalls(auto)
    assert [s.add(p) for p in ("\n", "<", "tool", "box", " is")] == ["", "", "", "\n<toolbox", " is"]
    assert s.end() == ("", None)
    s = StreamedCalls(auto)
    assert [s.add(p) for p in ("<tool_call>", '[{"name": "f", ', '"arguments": {}}]</tool_call>')] == ["", "", ""]
    held, calls = s.end()
    assert held == "" and [(c["type"], c["function"]) for c in calls] == [("function", {"name": "f", "arguments": "{}"})]
    s = StreamedCalls(ToolPlan((FunctionDef(name="f"),), "required"))
    assert [s.add(p) for p in ("<tool_call>", '[{"name": "f", ')] == ["", ""]
    assert s.end() == ('<tool_call>[{"name": "f", ', None)  # cut short (max_tokens): the text as it is


def test_a_prediction_leaves_the_text_unchanged_and_usage_counts_what_was_drafted_from_it(gw, tokenizer,
                                                                                       heldout_prompts):
    """Completions and chat, streamed or not: the LLM's own text with a prediction of it, of an
    edited copy or of unrelated text; usage says how many of its tokens were drafted and accepted
    or rejected (OpenAI's completion_tokens_details)."""
    c = client(gw["url"])
    prompt = heldout_prompts[2]["prompt"]
    want, _ = reference_text(tokenizer, tokenizer(prompt)["input_ids"], 40, ignore_eos=True)
    for prediction, held in ((want, True), (want.replace("(", "[").replace(" ", "  ", 3), False),
                             ("Nothing like it at all.", False)):
        # (a fixed tree: the same steps streamed or not, whatever the controller would explore)
        extra = {"ignore_eos": True, "speculation": "2,1,1", "prediction": {"type": "content", "content": prediction}}
        whole = c.completions.create(model="llm", prompt=prompt, max_tokens=40, temperature=0, extra_body=extra)
        assert whole.choices[0].text == want
        details = whole.usage.completion_tokens_details
        if held:  # (the text tokenized alone is not always tokenized as the output was)
            assert details.accepted_prediction_tokens > details.rejected_prediction_tokens
        elif prediction != want:  # a wrong prediction: what it got wrong was drafted and rejected
            assert details.rejected_prediction_tokens > 0
        chunks = list(c.completions.create(model="llm", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body=extra))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        assert chunks[-1].usage.completion_tokens_details == details
    plain = c.completions.create(model="llm", prompt=prompt, max_tokens=4, temperature=0)
    assert plain.usage.completion_tokens_details is None  # only with a prediction
    stop = want[len(want) // 2:len(want) // 2 + 3]  # cut by a stop string: the counts of the steps seen
    cut = c.completions.create(model="llm", prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True, "prediction": {"type": "content", "content": want}})
    assert cut.choices[0].text == want[:want.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens_details.accepted_prediction_tokens > 0

    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat = client(gw["strict"], "sesame")
    want, _ = reference_text(tokenizer, tokenizer("### user:\ndef add(a, b):\n### assistant:\n")["input_ids"], 24,
                             ignore_eos=True)
    parts = [{"type": "text", "text": want[:10]}, {"type": "text", "text": want[10:]}]
    reply = chat.chat.completions.create(model="llm", messages=messages, max_tokens=24, temperature=0,
                                         prediction={"type": "content", "content": parts},
                                         extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == want
    assert reply.usage.completion_tokens_details.accepted_prediction_tokens > 0
