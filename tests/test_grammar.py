"""Constrained output (specinfer/grammar.py, masks.py): every tree node is checked against its path's
grammar state, the verifier decides over masked logits, and the grammar drafts the tokens it forces.

Properties: a tree's kept nodes are exactly those whose path the grammar allows and each row's mask
is a fresh matcher's after that path; greedy constrained output is identical with speculation off,
fixed trees, merged trees, dynamic trees and the adaptive default, and parses and validates against
its schema; under sampling the emitted tokens follow the masked distribution (chi-square, coupled
and MSS) and a seed gives constrained plain sampling's tokens whatever the speculation; a grammar
that does not compile, and masks that do not fit, are refused naming the field; through the
services and the OpenAI gateway the same."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import jsonschema
import llguidance
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from specinfer.controller import PLAIN
from specinfer.generate import Engine, Mode, Request
from specinfer.grammar import Grammars, GrammarSpec
from specinfer.masks import AllowedTokens, words_for
from specinfer.model import LlamaModel
from specinfer.draws import probabilities
from specinfer.sampling import SamplingParams
from specinfer.tree import DraftGroup, TokenTree
from specinfer.verifier import Verifier, VerifyRequest

from .conftest import MODELS
from .test_sampling_exact import ALPHA, P_LLM, P_SSM, MarkovModel, chi_square_pvalue

# ---------------------------------------------------------------- a 4-token vocabulary: a, b, c and EOS d

PAIRS = "(a[bc]|b[ac]|c[ab])*"  # pairs of distinct letters; may end (EOS) after each pair


def tiny_grammars() -> Grammars:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "c": 2, "d": 3}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return Grammars(tok.to_str(), 4, [3])


def fresh_mask(grammars: Grammars, spec: GrammarSpec, path: list[int]) -> np.ndarray | None:
    """A fresh matcher's mask after `path` (None: the grammar forbids the path); once the grammar
    has ended, EOS alone."""
    m = llguidance.LLMatcher(grammars.tokenizer, llguidance.LLMatcher.grammar_from_regex(spec.text), log_level=0)
    for t in path:
        if m.is_stopped():  # the grammar has ended: EOS alone, which changes nothing
            if t not in grammars.eos:
                return None
            continue
        if m.validate_tokens([t]) != 1:
            return None
        m.consume_token(t)
    if m.is_stopped():
        out = np.zeros(words_for(grammars.vocab_size), dtype=np.int32)
        for e in grammars.eos:
            out[e >> 5] |= 1 << (e & 31)
        return out
    return np.frombuffer(m.compute_bitmask(), dtype=np.int32)[: words_for(grammars.vocab_size)]


def random_tree(rng: random.Random, n: int, vocab: int, groups: bool) -> TokenTree:
    tokens, parents = [], []
    for _ in range(n):
        p = rng.randrange(-1, len(tokens))
        t = rng.randrange(vocab)
        if (p, t) in zip(parents, tokens):
            continue
        tokens.append(t)
        parents.append(p)
    draws = [DraftGroup(p, [t], [1.0], [u], False) for u, (t, p) in enumerate(zip(tokens, parents))] if groups else []
    return TokenTree(tokens, parents, draws)


def path_of(tree: TokenTree, u: int) -> list[int]:
    out = []
    while u >= 0:
        out.append(tree.tokens[u])
        u = tree.parents[u]
    return out[::-1]


@pytest.mark.parametrize("mss", [False, True], ids=["pruned", "mss_kept"])
def test_each_kept_node_is_a_path_the_grammar_allows_with_that_paths_own_mask(mss):
    grammars, spec = tiny_grammars(), GrammarSpec("regex", PAIRS)
    rng = random.Random(0)
    for trial in range(40):
        c = grammars.compile(spec)
        prefix = [rng.choice([0, 1, 2]) for _ in range(rng.randrange(0, 3))]
        prefix = [t for i, t in enumerate(prefix) if fresh_mask(grammars, spec, prefix[: i + 1]) is not None]
        c.advance(prefix)
        before = c.mask().copy()
        tree = random_tree(rng, rng.randrange(0, 14), 4, mss)
        kept, allowed, added = c.constrain(tree, 0, 16, mss)
        assert added == []
        assert np.array_equal(c.mask(), before), "the state is back where it was"
        assert np.array_equal(allowed.words[allowed.index[0]], fresh_mask(grammars, spec, prefix))
        if mss:  # every draw stays; a forbidden node's row takes the mask of the last allowed state above it
            assert kept == tree
            for u in range(len(tree)):
                path = path_of(tree, u)
                valid = next(k for k in range(len(path), -1, -1) if fresh_mask(grammars, spec, prefix + path[:k]) is not None)
                want = fresh_mask(grammars, spec, prefix + path[:valid])
                assert np.array_equal(allowed.words[allowed.index[1 + u]], want), (trial, u)
            continue
        allowed_paths = {tuple(path_of(tree, u)) for u in range(len(tree))
                         if fresh_mask(grammars, spec, prefix + path_of(tree, u)) is not None}
        assert {tuple(p) for p in kept.paths()} == allowed_paths, trial
        for u, p in enumerate(kept.paths()):
            assert np.array_equal(allowed.words[allowed.index[1 + u]], fresh_mask(grammars, spec, prefix + list(p)))


def test_the_grammar_drafts_the_tokens_it_forces_below_the_root_and_the_drafters_nodes():
    grammars = tiny_grammars()
    c = grammars.compile(GrammarSpec("regex", "(ab|cabcab)(a|b)"))
    assert c.forced() == []  # a or c first
    drafted = TokenTree([0, 2, 1], [-1, -1, 0])  # a, c, and b below a
    tree, allowed, added = c.constrain(drafted, 16, 16, False)
    # below "c" the grammar forces "abcab"; below "ab" nothing (a or b)
    assert tree.tokens == [0, 2, 1, 0, 1, 2, 0, 1] and tree.parents == [-1, -1, 0, 1, 3, 4, 5, 6]
    assert added == [3, 4, 5, 6, 7]
    assert len(allowed.index) == 1 + len(tree)
    short, _, added = c.constrain(drafted, 2, 16, False)
    assert short.tokens == [0, 2, 1, 0, 1] and added == [3, 4]  # at most `extend` tokens
    deep, _, added = c.constrain(drafted, 16, 3, False)
    assert deep.tokens == [0, 2, 1, 0, 1] and added == [3, 4]  # none deeper than `room`
    mss, allowed, added = c.constrain(TokenTree(), 16, 16, True)
    assert mss.tokens == [] and added == []
    c.advance([2])
    chain, _, added = c.constrain(TokenTree(), 16, 16, True)  # an MSS tree: the chain's nodes are point-mass draws
    assert chain.tokens == [0, 1, 2, 0, 1] and added == [0, 1, 2, 3, 4]
    assert [(g.parent, g.q_ids, g.children) for g in chain.groups] == [(u - 1, [t], [u]) for u, t in enumerate(chain.tokens)]


# ---------------------------------------------------------------- masks on the verifier


def test_masks_that_do_not_fit_are_refused_naming_allowed():
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    verifier = Verifier(llm)
    words = words_for(llm.cfg.vocab_size)
    ones = np.full((1, words), -1, dtype=np.int32)
    tree = TokenTree([5, 6], [-1, 0])
    cases = {
        "words": AllowedTokens(np.full((1, words + 1), -1, dtype=np.int32), [0, 0, 0]),
        "row entries": AllowedTokens(ones, [0, 0]),
        "outside": AllowedTokens(ones, [0, 1, 0]),
        "no token": AllowedTokens(np.concatenate([ones, np.zeros((1, words), np.int32)]), [0, 1, 0]),
    }
    for name, allowed in cases.items():
        with pytest.raises(ValueError, match=r"^allowed \(request r\):"):
            verifier.step([VerifyRequest("r", [1, 2, 3], tree, allowed=allowed)])
    assert not verifier.caches, "nothing was taken"


def test_the_verifier_decides_over_the_masked_logits():
    """Greedy: with its first choice masked at the root, the bonus is the LLM's second choice, and a
    node carrying the first choice is never accepted however the LLM likes it."""
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    prompt = [1, 20, 30, 40]
    (plain,) = Verifier(llm).step([VerifyRequest("r", prompt, logprobs=True, top_logprobs=2)])
    first, second = (t for t, _ in plain.logprobs[0].top)
    rows = np.full((2, words_for(llm.cfg.vocab_size)), -1, dtype=np.int32)
    rows[0, first >> 5] &= ~np.int32(np.uint32(1 << (first & 31)).view(np.int32))
    (out,) = Verifier(llm).step([VerifyRequest("r", prompt, TokenTree([first], [-1]),
                                               allowed=AllowedTokens.from_rows(rows))])
    assert out.path == [] and out.tokens == [second]


# ---------------------------------------------------------------- exact constrained output in process

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "active"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                                       "properties": {"name": {"type": "string", "maxLength": 16},
                                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
                              "active": {"type": "boolean"}}},
    "array_enum": {"type": "object", "additionalProperties": False, "required": ["tags"],
                   "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 4,
                                           "items": {"enum": ["red", "green", "blue"]}}}},
    "number_pattern": {"type": "object", "additionalProperties": False, "required": ["date", "count"],
                       "properties": {"date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 999}}},
}
# (the fixture LLM writes a JSON number's fraction digits until max_tokens: the numbers here are bounded
# integers; the default LLM's benchmark set has fractions, bench/json_schemas.jsonl)
SETTINGS = {  # name: (mode, expansion, adaptive, dynamic)
    "off": (Mode.INCREMENTAL, None, False, False),
    "tree": (Mode.TREE, [2, 1, 1], False, False),
    "merged": (Mode.MERGED, [1, 1, 3, 1], False, False),
    "default": (Mode.MERGED, [2, 1, 1], True, False),
    "dynamic": (Mode.MERGED, [2, 1, 1], False, True),
}


@pytest.fixture(scope="module")
def fixture_models():
    tok = Tokenizer.from_file(str(MODELS / "llm" / "tokenizer.json"))
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    ssms = [LlamaModel.from_pretrained(MODELS / f"ssm-{i}") for i in range(2)]
    return tok, llm, ssms, Grammars(tok.to_str(), llm.cfg.vocab_size, list(llm.cfg.eos_token_ids))


def constrained_runs(fixture_models, requests, settings=SETTINGS):
    tok, llm, ssms, grammars = fixture_models
    out = {}
    for name, (mode, expansion, adaptive, dynamic) in settings.items():
        engine = Engine(llm, ssms, mode, expansion, lookup=mode != Mode.INCREMENTAL, adaptive=adaptive,
                        dynamic=dynamic, grammars=grammars)
        out[name] = engine.generate(requests)
    return out


def test_greedy_constrained_output_is_identical_with_any_speculation_and_valid(fixture_models, heldout_prompts):
    tok = fixture_models[0]
    requests = [Request(tok.encode(p["prompt"]).ids, 96, grammar=GrammarSpec("json_schema", json.dumps(schema)),
                        id=name) for (name, schema), p in zip(SCHEMAS.items(), heldout_prompts)]
    requests.append(Request(tok.encode(heldout_prompts[3]["prompt"]).ids, 96, grammar=GrammarSpec("json_object"),
                            id="object"))
    out = constrained_runs(fixture_models, requests)
    plain = [g.token_ids for g in out["off"]]
    for name, gens in out.items():
        assert [g.token_ids for g in gens] == plain, name
    for g, r in zip(out["off"], requests):
        assert g.finish_reason == "eos", (g.id, tok.decode(g.token_ids))
        value = json.loads(tok.decode(g.token_ids[:-1]))
        jsonschema.validate(value, SCHEMAS.get(g.id, {"type": "object"}))
    tokens = sum(len(g.token_ids) for g in out["tree"])
    assert tokens / sum(g.steps for g in out["tree"]) > 1.5, "drafts (the grammar's forced tokens among them) hold"


def test_the_grammars_forced_tokens_are_drafted_and_accepted(fixture_models, heldout_prompts):
    """With no SSM and no lookup the grammar alone drafts: compact JSON's keys and punctuation."""
    tok, llm, _, grammars = fixture_models
    compact = r'\{"name": "[a-z]{1,12}", "kind": "(red|green|blue)", "id": [0-9]{1,3}, "ok": (true|false)\}'
    req = Request(tok.encode(heldout_prompts[0]["prompt"]).ids, 96, id="r", grammar=GrammarSpec("regex", compact))
    engine = Engine(llm, [], Mode.TREE, [1], lookup=True, grammars=grammars)
    engine.engine.lookup = False  # the grammar's drafts alone
    (g,) = engine.generate([req])
    (plain,) = Engine(llm, mode=Mode.INCREMENTAL, grammars=grammars).generate([req])
    assert g.token_ids == plain.token_ids
    json.loads(tok.decode(g.token_ids[:-1]))
    assert sum(g.accepted) >= 8 and g.steps < plain.steps


def test_a_prediction_beside_a_grammar_gives_the_constrained_output_and_counts_no_pruned_node(fixture_models,
                                                                                             heldout_prompts):
    """A prediction that starts with a token the grammar forbids: its first chain is pruned whole
    (verified nowhere, so rejected nowhere), the token taken for a substitution, and the rest of the
    prediction, the constrained output itself, drafted with no token rejected."""
    tok, llm, ssms, grammars = fixture_models
    req = Request(tok.encode(heldout_prompts[2]["prompt"]).ids, 96,
                  grammar=GrammarSpec("json_schema", json.dumps(SCHEMAS["nested"])))
    (plain,) = Engine(llm, mode=Mode.INCREMENTAL, grammars=grammars).generate([req])
    forbidden = next(t for t in tok.encode("x q z").ids if t not in plain.token_ids)  # (a swap of it never drafts)
    engine = Engine(llm, ssms[:1], Mode.TREE, [2, 1, 1], lookup=True, adaptive=True, grammars=grammars)
    (g,) = engine.generate([dataclasses.replace(req, prediction=(forbidden, *plain.token_ids[1:]))])
    assert g.token_ids == plain.token_ids
    assert g.prediction[1] == 0 and g.prediction[0] > 0


def test_the_grammars_forced_tokens_are_drafted_when_the_controller_decodes_plainly(fixture_models, heldout_prompts):
    """The cost model chooses plain decoding at every step: the forced tokens still go in the tree."""
    tok, llm, ssms, grammars = fixture_models
    req = Request(tok.encode(heldout_prompts[1]["prompt"]).ids, 64, id="r",
                  grammar=GrammarSpec("json_schema", json.dumps(SCHEMAS["nested"])))
    engine = Engine(llm, ssms, Mode.TREE, [2, 1, 1], lookup=True, adaptive=True, grammars=grammars)
    engine.engine.controller.choose = lambda batch_size, full_trees, chained=False: PLAIN
    (g,) = engine.generate([req])
    (plain,) = Engine(llm, mode=Mode.INCREMENTAL, grammars=grammars).generate([req])
    assert g.token_ids == plain.token_ids
    assert sum(g.accepted) >= 8 and g.steps < plain.steps


def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(fixture_models):
    grammars = fixture_models[3]
    bad = {"json_schema": ["{not json", json.dumps({"type": "strin"}), json.dumps({"type": "array", "uniqueItems": True}),
                           json.dumps({"type": "string", "pattern": "(unclosed"}), "[1, 2]"],
           "regex": ["(a|b"], "lark": ["start: foo"], "xml": [""]}
    for kind, texts in bad.items():
        for text in texts:
            with pytest.raises(ValueError, match=r"^response_format: "):
                grammars.compile(GrammarSpec(kind, text))
    engine = Engine(fixture_models[1], mode=Mode.INCREMENTAL, grammars=grammars)
    with pytest.raises(ValueError, match=r"^response_format\.json_schema: "):
        engine.generate([Request([1, 2], 4, grammar=GrammarSpec("json_schema", "{", "response_format.json_schema"))])


# ---------------------------------------------------------------- sampling


def masked_markov_exact(grammars: Grammars, spec: GrammarSpec, params: SamplingParams, keep: int) -> dict:
    """Exact law of the first `keep` tokens of constrained plain sampling from the Markov chain
    (prompt token 0): each step samples from the LLM's tempered distribution over the tokens the
    grammar allows after the path."""
    exact = {}
    for cell in itertools.product(range(4), repeat=keep):
        p, last = 1.0, 0
        for i, t in enumerate(cell):
            mask = fresh_mask(grammars, spec, list(cell[:i]))
            if mask is None:  # an impossible prefix
                p = 0.0
                break
            ok = torch.tensor([(int(mask[v >> 5]) >> (v & 31)) & 1 for v in range(4)], dtype=torch.bool)
            row = probabilities(P_LLM.log()[last].masked_fill(~ok, float("-inf"))[None], params)[0].double()
            p *= float(row[t])
            last = t
        exact[cell] = p
    return exact


@pytest.mark.parametrize("mss", [False, True], ids=["coupled", "mss"])
def test_constrained_sampling_follows_the_masked_distribution(mss):
    grammars, spec = tiny_grammars(), GrammarSpec("regex", PAIRS)
    params = SamplingParams(temperature=0.9)
    engine = Engine(MarkovModel(P_LLM), [MarkovModel(P) for P in P_SSM], Mode.MERGED, [2, 2, 1], grammars=grammars)
    gens = engine.generate([Request([0], 4, dataclasses.replace(params, seed=s, mss=mss), grammar=spec)
                            for s in range(4000)])
    assert sum(g.accepted[0] for g in gens) > 0.3 * len(gens), "drafts were accepted"
    samples = [tuple(g.token_ids[:3]) for g in gens]
    assert chi_square_pvalue(samples, masked_markov_exact(grammars, spec, params, 3)) > ALPHA


def test_a_seed_gives_constrained_plain_samplings_tokens_whatever_the_speculation(fixture_models, heldout_prompts):
    tok = fixture_models[0]
    schema = GrammarSpec("json_schema", json.dumps(SCHEMAS["array_enum"]))
    requests = [Request(tok.encode(p["prompt"]).ids, 64, SamplingParams(0.8, seed=i), grammar=schema, id=str(i))
                for i, p in enumerate(heldout_prompts[:4])]
    out = constrained_runs(fixture_models, requests)
    plain = [g.token_ids for g in out["off"]]
    for name, gens in out.items():
        assert [g.token_ids for g in gens] == plain, name


# ---------------------------------------------------------------- through the services


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from specinfer_rpc.launch import launch

    root = tmp_path_factory.mktemp("grammar")
    system = launch(MODELS / "llm", [MODELS / "ssm-0"], speculators=1, port=0, http_port=0, log_dir=root)
    yield system
    system.stop()


def test_services_give_the_engines_constrained_output_whatever_the_speculation(served, fixture_models, heldout_prompts):
    import openai

    from specinfer_rpc.client import generate_all

    tok, llm, _, grammars = fixture_models
    requests = [Request(tok.encode(p["prompt"]).ids, 96, grammar=GrammarSpec("json_schema", json.dumps(schema)))
                for schema, p in zip(SCHEMAS.values(), heldout_prompts)]
    want = [g.token_ids for g in Engine(llm, mode=Mode.INCREMENTAL, grammars=grammars).generate(requests)]
    for speculation in (None, "off", "2,1,1"):
        assert [s.token_ids for s in generate_all(served.manager.address, requests, speculation, timeout=120)] == want
    client = openai.OpenAI(base_url=served.gateway.url + "/v1", api_key="x", max_retries=0)
    for (name, schema), p, tokens in zip(SCHEMAS.items(), heldout_prompts, want):
        out = client.completions.create(model="llm", prompt=p["prompt"], max_tokens=96, temperature=0, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}})
        assert out.choices[0].text == tok.decode(tokens[:-1])
        jsonschema.validate(json.loads(out.choices[0].text), schema)


def test_a_response_format_that_does_not_compile_is_refused_naming_it_and_costs_no_other_request(served, heldout_prompts):
    import asyncio

    import grpc
    import openai

    from specinfer_rpc.client import connect, generate, request_pb

    client = openai.OpenAI(base_url=served.gateway.url + "/v1", api_key="x", max_retries=0)
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
                {"type": "json_schema", "json_schema": {"name": "x"}}, {"type": "regex", "regex": "(a"}, {"type": "xml"}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="llm", prompt="x", max_tokens=4, extra_body={"response_format": fmt})
        assert err.value.body["param"] == "response_format", fmt

    async def both():
        stub = connect(served.manager.address)
        good = asyncio.create_task(generate(stub, request_pb(Request([1, 2, 3], 24, ignore_eos=True)), 60))
        bad = Request([1, 2, 3], 8, grammar=GrammarSpec("json_schema", '{"type": "strin"}'))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, request_pb(bad), 60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("response_format.json_schema: ")
        return await good

    assert len(asyncio.run(both()).token_ids) == 24


def test_the_verifier_refuses_masks_that_do_not_fit_naming_allowed(served):
    import grpc

    from specinfer_rpc.v1 import verifier_pb2, verifier_pb2_grpc

    address = served.by_name("verifier").address
    with grpc.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        item = verifier_pb2.VerifyItem(request_id="hostile", new_token_ids=[1, 2], record_length=2,
                                       allowed=verifier_pb2.AllowedTokens(masks=b"\xff" * 7, index=[0]))
        with pytest.raises(grpc.RpcError) as e:
            stub.Verify(verifier_pb2.VerifyRequest(items=[item]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("allowed (request hostile)")


def test_the_grammars_drafts_are_named_in_the_trees_a_client_watches(served, fixture_models, heldout_prompts):
    import asyncio

    from specinfer_rpc.client import connect, request_pb
    from specinfer_rpc.v1 import generation_pb2

    tok = fixture_models[0]
    compact = r'\{"name": "[a-z]{1,12}", "kind": "(red|green|blue)", "id": [0-9]{1,3}, "ok": (true|false)\}'
    # a fixed expansion: every step speculates (the server's adaptive choice depends on this machine's timing)
    pb = request_pb(Request(tok.encode(heldout_prompts[0]["prompt"]).ids, 64, grammar=GrammarSpec("regex", compact)),
                    "2,1")
    pb.return_draft_trees = True

    async def watch():
        stub = connect(served.manager.address)
        info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30)
        return info, [chunk.draft_tree async for chunk in stub.Generate(pb, timeout=120)]

    info, trees = asyncio.run(watch())
    assert info.grammar_mask == 1 << (len(info.drafter_names) + 1) and info.grammar_mask != info.context_lookup_mask
    marked = [(t, u) for t in trees for u, bits in enumerate(t.speculators) if bits & info.grammar_mask]
    assert marked, "the grammar drafted"
    assert any(u in t.accepted for t, u in marked), "and its drafts were accepted"
