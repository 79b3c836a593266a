"""Log-probabilities (logprobs.py): each token's is the log-softmax of the LLM's own logits at its
position, as Hugging Face's model computes it; the prompt's come with the prefill; speculation
changes them no more than float32 rounding; and bad asks are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from specinfer.generate import Engine, Mode, Request, validate
from specinfer.logprobs import MAX_TOP
from specinfer.model import LlamaModel
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree
from specinfer.verifier import Verifier, VerifyRequest

from .conftest import MODELS

TOLERANCE = 1e-4  # float32: a tree step against an incremental one, ours against Hugging Face's


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row i is the distribution of the token after tokens[:i + 1]."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def check(entries, want: torch.Tensor, tokens: list[int], top: int) -> None:
    """entries[i] is tokens[i]'s logprob under want[i] [n, V], with want[i]'s `top` best."""
    assert [e.token_id for e in entries] == tokens
    got = torch.tensor([e.logprob for e in entries])
    torch.testing.assert_close(got, want.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=TOLERANCE, rtol=0)
    best = want.topk(top, dim=-1)
    for e, row, values in zip(entries, want, best.values):
        assert len(e.top) == top
        torch.testing.assert_close(torch.tensor([v for _, v in e.top]), values, atol=TOLERANCE, rtol=0)
        # each listed token has the listed logprob (the ids are the best ones, up to ties)
        torch.testing.assert_close(row[[t for t, _ in e.top]], torch.tensor([v for _, v in e.top]),
                                   atol=TOLERANCE, rtol=0)


def test_prompt_and_step_logprobs_are_the_llms_own(tiny_pair):
    """A prefill with prompt logprobs, then a tree step: every entry as Hugging Face computes it."""
    hf, llm_dir, _ = tiny_pair
    verifier = Verifier(LlamaModel.from_pretrained(llm_dir))
    prompt = [5, 17, 30, 42, 9, 7, 60, 3]
    (v,) = verifier.step([VerifyRequest("r", prompt, logprobs=True, prompt_logprobs=True, top_logprobs=5)])
    want = hf_logprobs(hf, prompt)
    check(v.prompt_logprobs, want[:-1], prompt[1:], 5)
    check(v.logprobs, want[-1:], v.tokens, 5)
    record = prompt + v.tokens
    nxt = hf_logprobs(hf, record)[-1].argmax().item()
    tree = TokenTree([(nxt + 1) % 64, nxt, 11, 12], [-1, -1, 1, 1])  # the LLM's token in a branch; below it two guesses
    (v,) = verifier.step([VerifyRequest("r", [], tree, logprobs=True, top_logprobs=3)])
    assert v.tokens[0] == nxt and len(v.tokens) >= 2
    want = hf_logprobs(hf, record + v.tokens[:-1])[len(record) - 1:]
    check(v.logprobs, want, v.tokens, 3)
    assert v.prompt_logprobs is None


@pytest.mark.parametrize("mode,lookup", [(Mode.TREE, False), (Mode.MERGED, True)])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculation_changes_logprobs_no_more_than_rounding(heldout_ids, mode, lookup, temperature):
    llm, ssm = LlamaModel.from_pretrained(MODELS / "llm"), LlamaModel.from_pretrained(MODELS / "ssm-0")
    requests = [Request(p[:60], 24, SamplingParams(temperature, seed=i), id=str(i), logprobs=True,
                        prompt_logprobs=True, top_logprobs=4) for i, p in enumerate(heldout_ids[:3])]
    plain = Engine(llm, mode=Mode.INCREMENTAL).generate(requests)
    spec = Engine(llm, [ssm], mode, [2, 2, 1], lookup=lookup).generate(requests)
    assert sum(g.tree_steps for g in spec) > 0
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        for got, want in ((a.logprobs, b.logprobs), (a.prompt_logprobs, b.prompt_logprobs)):
            assert [e.token_id for e in got] == [e.token_id for e in want]
            torch.testing.assert_close(torch.tensor([e.logprob for e in got]), torch.tensor([e.logprob for e in want]),
                                       atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(torch.tensor([[v for _, v in e.top] for e in got]),
                                       torch.tensor([[v for _, v in e.top] for e in want]), atol=TOLERANCE, rtol=0)
        assert len(a.logprobs) == len(a.token_ids)
        assert len(a.prompt_logprobs) == len(requests[int(a.id)].prompt) - 1


def test_logprobs_are_only_returned_when_asked(heldout_ids):
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    (g,) = Engine(llm, mode=Mode.INCREMENTAL).generate([Request(heldout_ids[0][:20], 4)])
    assert g.logprobs is None and g.prompt_logprobs is None
    (g,) = Engine(llm, mode=Mode.INCREMENTAL).generate([Request(heldout_ids[0][:20], 4, logprobs=True)])
    assert len(g.logprobs) == 4 and all(not e.top for e in g.logprobs) and g.prompt_logprobs is None


@pytest.mark.parametrize("request_", [Request([1], 4, logprobs=True, top_logprobs=MAX_TOP + 1),
                                      Request([1], 4, logprobs=True, top_logprobs=-1),
                                      Request([1], 4, top_logprobs=3)])
def test_bad_logprob_asks_are_refused_naming_the_field(request_):
    with pytest.raises(ValueError, match="^top_logprobs:"):
        validate(request_, vocab_size=64, context=512)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The services on the fixture models with the gateway, whose tokenizer has a chat template."""
    import json
    import shutil

    from specinfer_rpc.launch import launch

    from .test_gateway import CHAT_TEMPLATE

    root = tmp_path_factory.mktemp("logprobs")
    shutil.copytree(MODELS / "llm", root / "llm")
    config = json.loads((root / "llm" / "tokenizer_config.json").read_text())
    (root / "llm" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    system = launch(root / "llm", [MODELS / "ssm-0"], speculators=1, port=0, http_port=0, log_dir=root / "logs")
    yield system
    system.stop()


def in_process(requests: list[Request]):
    return Engine(LlamaModel.from_pretrained(MODELS / "llm"), mode=Mode.INCREMENTAL).generate(requests)


def close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), torch.tensor(want, dtype=torch.float32),
                               atol=TOLERANCE, rtol=0)


def test_grpc_logprobs_through_the_services_are_the_llms_own(served, heldout_ids):
    from specinfer_rpc.client import generate_all

    requests = [Request(p[:50], 24, SamplingParams(t, seed=3), id=str(i), logprobs=True, prompt_logprobs=True,
                        top_logprobs=3) for i, (p, t) in enumerate(zip(heldout_ids[:4], [0.0, 0.0, 0.8, 0.8]))]
    streams = generate_all(served.manager.address, requests, "2,2,1")
    assert sum(s.usage.tree_steps for s in streams) > 0
    for s, want in zip(streams, in_process(requests)):
        assert s.token_ids == want.token_ids
        for got, ref in ((s.logprobs, want.logprobs), (s.prompt_logprobs, want.prompt_logprobs)):
            assert [e.token_id for e in got] == [e.token_id for e in ref]
            close([e.logprob for e in got], [e.logprob for e in ref])
            close([v for e in got for v in e.top_logprobs], [v for e in ref for _, v in e.top])


def test_completions_echo_gives_the_prompts_logprobs_as_lm_eval_asks(served, heldout_ids):
    """lm-evaluation-harness's loglikelihood request: token-id prompts in a batch, echo, logprobs 1,
    max_tokens 1 (and 0): the prompt's logprobs first, its first token's None."""
    import openai

    prompts = [p[:30] for p in heldout_ids[:3]]
    want = in_process([Request(p, 1, prompt_logprobs=True, logprobs=True, top_logprobs=1) for p in prompts])
    c = openai.OpenAI(base_url=served.gateway.url + "/v1", api_key="x", max_retries=0)
    for max_tokens in (1, 0):
        out = c.completions.create(model="llm", prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens,
                                   temperature=0)
        assert [ch.index for ch in sorted(out.choices, key=lambda ch: ch.index)] == [0, 1, 2]
        for ch in sorted(out.choices, key=lambda ch: ch.index):
            w = want[ch.index]
            lp = ch.logprobs
            entries = w.prompt_logprobs + w.logprobs[:max_tokens]
            assert len(lp.tokens) == len(prompts[ch.index]) + max_tokens
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            close(lp.token_logprobs[1:], [e.logprob for e in entries])
            # the top alternative's logprob, as lm-eval reads it to tell greedy continuations
            close([max(t.values()) for t in lp.top_logprobs[1:]], [e.top[0][1] for e in entries])
        assert out.usage.completion_tokens == 3 * max_tokens


@pytest.mark.parametrize("top", [0, 2])
def test_completions_top_logprobs_hold_the_chosen_token_as_openai_gives_up_to_logprobs_plus_one(served, heldout_ids,
                                                                                             top):
    """Echoed prompt tokens and sampled ones are often not among the best `top`: their own entry is
    added to the position's alternatives."""
    import openai

    c = openai.OpenAI(base_url=served.gateway.url + "/v1", api_key="x", max_retries=0)
    out = c.completions.create(model="llm", prompt=heldout_ids[2][:24], echo=True, logprobs=top, max_tokens=12,
                               temperature=1.5, seed=5, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    outside = 0
    for token, logprob, alternatives in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert alternatives[token] == logprob
        best = sorted(alternatives.values(), reverse=True)[:top]
        outside += logprob not in best
        assert len(alternatives) == top + (logprob not in best)
    assert outside > 0  # the case this is about occurred


def test_streamed_token_ids_are_the_tokens_its_text_and_logprobs_hold(served, heldout_ids):
    """Echo (with max_tokens 0, the generated token is output nowhere) and a stop token id (ends the
    text before it): each stream's token_ids, text and logprobs name the same tokens."""
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODELS / "llm")
    c = openai.OpenAI(base_url=served.gateway.url + "/v1", api_key="x", max_retries=0)
    prompt = heldout_ids[3][:20]

    def stream(**kw) -> tuple[list[int], str, list[str]]:
        chunks = [ch.choices[0] for ch in c.completions.create(model="llm", prompt=prompt, temperature=0, stream=True,
                                                               logprobs=1, **kw) if ch.choices]
        return ([t for ch in chunks for t in ch.model_extra["token_ids"]], "".join(ch.text for ch in chunks),
                [t for ch in chunks for t in ch.logprobs.tokens])

    greedy, _, _ = stream(max_tokens=8, extra_body={"ignore_eos": True})
    stop = next(t for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    for kw, want in (({"echo": True, "max_tokens": 0}, prompt), ({"echo": True, "max_tokens": 3}, prompt + greedy[:3]),
                     ({"max_tokens": 8, "extra_body": {"ignore_eos": True, "stop": [stop]}},
                      greedy[:greedy.index(stop)])):
        ids, text, tokens = stream(**kw)
        assert ids == want, kw
        assert text == tok.decode(ids, skip_special_tokens=True) and tokens == [tok.decode([t]) for t in ids]


def test_n_choices_are_each_the_request_with_its_derived_seed(served, heldout_ids):
    import openai

    from gateway_svc.protocol import choice_seeds

    c = openai.OpenAI(base_url=served.gateway.url + "/v1", api_key="x", max_retries=0)
    prompt = heldout_ids[1][:40]
    kw = {"model": "llm", "max_tokens": 12, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    both = c.completions.create(prompt=[prompt], n=3, seed=11, **kw)
    alone = [c.completions.create(prompt=prompt, seed=s, **kw) for s in choice_seeds(11, 3)]
    got = sorted(both.choices, key=lambda ch: ch.index)
    assert [ch.text for ch in got] == [a.choices[0].text for a in alone]
    assert len({ch.text for ch in got}) > 1, "the choices sample independently"
    streamed = c.completions.create(prompt=prompt, n=2, seed=11, stream=True, **kw)
    texts = ["", ""]
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in got[:2]]


def test_chat_logprobs_name_each_token_and_its_alternatives(served):
    import openai

    c = openai.OpenAI(base_url=served.gateway.url + "/v1", api_key="x", max_retries=0)
    out = c.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hello there"}], max_tokens=8,
                                    temperature=0, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 8 == out.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 4
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy: the best token
        assert e.token == e.top_logprobs[0].token and bytes(e.bytes).decode() == e.token
    sampled = c.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hello there"}],
                                        max_tokens=12, temperature=1.5, seed=5, logprobs=True, top_logprobs=1,
                                        extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert any(e.token != e.top_logprobs[0].token for e in sampled)  # chosen outside the top 1 ...
    assert all(len(e.top_logprobs) == 1 for e in sampled)  # ... yet exactly top_logprobs alternatives, as OpenAI's
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="llm", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"
