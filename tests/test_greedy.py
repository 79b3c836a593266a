"""Greedy speculative generation is token-for-token the LLM's own incremental greedy decoding
(transformers' `generate(do_sample=False)`), in every mode, for batches of prompts of different
lengths; plus the edge cases of a step: empty tree, one node, EOS or max_new_tokens inside an
accepted path."""

import json
import shutil
from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specinfer.controller import PROBE, Choice
from specinfer.generate import Engine, Mode, Request, validate
from specinfer.graphs import GraphConfig
from specinfer.model import DRAFT_VOCAB, LlamaModel
from specinfer.sampling import SamplingParams
from specinfer.speculator import DraftRequest, Speculator
from specinfer.tree import TokenTree
from specinfer.verifier import Verifier, VerifyRequest

from .conftest import MODELS, save_random_llama

NEW_TOKENS = 64
N_PROMPTS = 10


def hf_greedy(hf, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def shipped():
    tok = AutoTokenizer.from_pretrained(MODELS / "llm")
    hf = AutoModelForCausalLM.from_pretrained(MODELS / "llm", dtype=torch.float32).eval()
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    ssms = [LlamaModel.from_pretrained(MODELS / f"ssm-{i}") for i in range(2)]
    return tok, hf, llm, ssms


@pytest.fixture(scope="module")
def reference(shipped, heldout_prompts):
    tok, hf, llm, _ = shipped
    prompts = [tok(p["prompt"])["input_ids"] for p in heldout_prompts[:N_PROMPTS]]
    assert len({len(p) for p in prompts}) > 1, "want prompts of different lengths"
    return prompts, [hf_greedy(hf, p, NEW_TOKENS, eos=llm.cfg.eos_token_ids[0]) for p in prompts]


@pytest.mark.parametrize("mode,expansion,lookup", [
    (Mode.INCREMENTAL, None, False),
    (Mode.SEQUENCE, [1] * 8, False),
    (Mode.TREE, [1, 1, 3, 1, 1, 1, 1, 1], False),
    (Mode.TREE, [2, 2, 2, 1, 1], False),
    (Mode.MERGED, [1, 1, 3, 1, 1, 1, 1, 1], False),
    (Mode.TREE, [1, 1, 1], True),
    (Mode.SEQUENCE, [1, 1, 1, 1], None),
], ids=["incremental", "sequence", "tree", "wide-tree", "merged", "tree-with-context-lookup", "context-lookup-alone"])
def test_greedy_output_matches_incremental_decoding(shipped, reference, mode, expansion, lookup):
    """lookup None: context lookup is the only drafter."""
    _, _, llm, ssms = shipped
    prompts, want = reference
    engine = Engine(llm, [] if lookup is None else ssms, mode, expansion, lookup=lookup is not False)
    gens = engine.generate([Request(p, NEW_TOKENS) for p in prompts])
    assert [g.token_ids for g in gens] == want
    if mode != Mode.INCREMENTAL:
        assert sum(map(sum, (g.accepted for g in gens))) > 0, "no draft token was ever accepted"


def test_prompts_prefilled_in_chunks_give_the_same_output_and_no_step_takes_more_than_a_chunk(shipped, reference):
    """Chunked prefill: a prompt longer than the chunk reaches the verifier a chunk a step, beside
    the other requests' steps, and the SSM a chunk a draft; the output is the LLM's own."""
    _, _, llm, ssms = shipped
    prompts, want = reference
    chunk = 16
    assert max(map(len, prompts)) > 2 * chunk
    engine = Engine(llm, ssms, Mode.TREE, [2, 1, 1], prefill_chunk=chunk)
    rows, forward = [], engine.verifier.forward
    engine.verifier.forward = lambda items: rows.extend(len(it.new_tokens) for it in items) or forward(items)
    ssm = engine.engine.drafters[0].speculator
    fed, run = [], ssm.run
    ssm.run = lambda items, ids=None: fed.extend(len(it.new_tokens) for it in items) or run(items, ids)
    gens = engine.generate([Request(p, NEW_TOKENS) for p in prompts])
    assert [g.token_ids for g in gens] == want
    assert max(rows) == max(fed) == chunk and sum(map(sum, (g.accepted for g in gens))) > 0


def test_a_chunk_decides_nothing_and_takes_no_tree(shipped):
    llm = shipped[2]
    verifier = Verifier(llm)
    assert verifier.step([VerifyRequest("a", list(range(5, 40)), prefill_only=True)])[0].tokens == []
    assert verifier.caches["a"].length == 35 and not verifier.caches["a"].pending
    with pytest.raises(ValueError, match="^prefill_only"):
        verifier.step([VerifyRequest("a", [7], TokenTree([3], [-1]), prefill_only=True)])


def test_context_lookup_chain_reaches_past_the_expansion_and_stops_at_its_length(shipped, reference):
    """Context lookup's chain has its own length: with a one-level SSM tree, steps accept more than
    one draft token (only the chain goes deeper), never more than `lookup_tokens`, and the output
    stays the LLM's own."""
    _, _, llm, ssms = shipped
    prompts, want = reference
    gens = Engine(llm, ssms[:1], Mode.TREE, [1], lookup=True, lookup_tokens=5).generate(
        [Request(p, NEW_TOKENS) for p in prompts])
    assert [g.token_ids for g in gens] == want
    accepted = [a for g in gens for a in g.accepted]
    assert 1 < max(accepted) <= 5, accepted


def test_a_drafter_that_never_agrees_is_cut_off_per_request_and_the_output_stays_the_llms(shipped, reference, tmp_path):
    """Beside SSM 0, a drafter with random weights: on the server's expansion (adaptive, the cost
    model held at the whole tree) it drafts for a request only until its own acceptance there is
    measured, then one level every PROBE steps; SSM 0 keeps drafting."""
    _, _, llm, ssms = shipped
    prompts, want = reference
    save_random_llama(tmp_path / "junk", 3, vocab=llm.cfg.vocab_size, hidden=32, layers=1)
    junk = LlamaModel.from_pretrained(tmp_path / "junk")
    engine = Engine(llm, [ssms[0], junk], Mode.MERGED, [2, 1, 1], adaptive=True)
    engine.engine.controller.choose = lambda batch_size, full_trees, chained=False: Choice(3)
    drafted = {0: Counter(), 1: Counter()}  # drafter -> request -> steps it drafted for the request
    for i, drafter in enumerate(engine.engine.drafters):
        real = drafter.speculator.draft
        drafter.speculator.draft = lambda batch, real=real, i=i: drafted[i].update(r.request_id for r in batch) or \
            real(batch)
    gens = engine.generate([Request(p, NEW_TOKENS) for p in prompts[:3]])
    assert [g.token_ids for g in gens] == want[:3]
    for g in gens:
        assert drafted[0][g.id] >= 0.9 * g.steps - 1
        assert drafted[1][g.id] <= 6 + g.steps / PROBE, (drafted, g.steps)
        # each drafter's own tally over the request: every accepted draft token was on some drafter's
        # own accepted path, and the junk drafter's own acceptance is the lower
        (hit0, nodes0), (hit1, nodes1) = g.drafters[0], g.drafters[1]
        assert sum(g.accepted) <= hit0 + hit1 and hit0 <= nodes0 and hit1 <= nodes1, g.drafters
        assert hit1 / nodes1 < hit0 / nodes0, g.drafters


def test_greedy_output_matches_incremental_decoding_through_static_buffers(shipped, reference):
    """Every forward pass padded to its bucket in persistent buffers (the CUDA-graph path, without
    the graph on the CPU): still the LLM's own greedy output."""
    _, _, llm, ssms = shipped
    prompts, want = reference
    graphs = GraphConfig(mode="static", max_tokens=512, max_batch=16, max_tree=64, max_context=256)
    gens = Engine(llm, ssms, Mode.MERGED, [1, 1, 3, 1, 1, 1, 1, 1], graphs=graphs).generate(
        [Request(p, NEW_TOKENS) for p in prompts])
    assert [g.token_ids for g in gens] == want


@pytest.fixture(scope="module")
def oracle(tiny_pair):
    """The LLM as its own SSM: every draft on the greedy path is accepted, so paths are long."""
    hf, llm_dir, _ = tiny_pair
    llm = LlamaModel.from_pretrained(llm_dir)
    return hf, llm


def test_empty_tree_is_a_plain_incremental_step(oracle):
    hf, llm = oracle
    verifier = Verifier(llm)
    prompt = [5, 9, 2]
    first = verifier.step([VerifyRequest("a", prompt)])[0]
    second = verifier.step([VerifyRequest("a", [], TokenTree())])[0]
    assert first.path == second.path == []
    assert first.tokens + second.tokens == hf_greedy(hf, prompt, 2)


def test_one_node_tree_accepts_or_rejects_by_argmax(oracle):
    hf, llm = oracle
    prompt = [3, 3, 7]
    want = hf_greedy(hf, prompt, 3)
    for node, accepted in [(want[1], True), ((want[1] + 1) % llm.cfg.vocab_size, False)]:
        verifier = Verifier(llm)
        verifier.step([VerifyRequest("a", prompt)])
        v = verifier.step([VerifyRequest("a", [], TokenTree([node], [-1]))])[0]
        assert v.tokens == (want[1:3] if accepted else want[1:2])


def test_eos_inside_an_accepted_path_ends_the_output_there(oracle):
    hf, llm = oracle
    prompt = [1, 2, 3, 4]
    free = hf_greedy(hf, prompt, 24)
    stop_at = next(i for i in range(3, len(free)) if free[i] not in free[:i])  # a first occurrence
    eos = free[stop_at]
    llm_eos = replace(llm.cfg, eos_token_ids=(eos,))
    llm.cfg = llm_eos
    try:
        gen = Engine(llm, [llm], Mode.TREE, [1] * 8).generate([Request(prompt, 24)])[0]
    finally:
        llm.cfg = replace(llm_eos, eos_token_ids=())
    assert gen.token_ids == free[: stop_at + 1]
    assert gen.finish_reason == "eos"
    # the prefill emits token 0; the first step's accepted path covers tokens 1..accepted[0]
    assert gen.accepted[0] >= stop_at, "EOS was not inside an accepted path"


def test_stop_token_ends_the_output_and_ignore_eos_goes_on(oracle):
    hf, llm = oracle
    prompt = [8, 8, 1]
    free = hf_greedy(hf, prompt, 20)
    stop = free[4]
    engine = Engine(llm, [llm], Mode.TREE, [1] * 8)
    gen = engine.generate([Request(prompt, 20, stop_token_ids=(stop,))])[0]
    assert gen.token_ids == free[: free.index(stop) + 1] and gen.finish_reason == "stop"
    llm.cfg = replace(llm.cfg, eos_token_ids=(stop,))
    try:
        gen = engine.generate([Request(prompt, 20, ignore_eos=True)])[0]
    finally:
        llm.cfg = replace(llm.cfg, eos_token_ids=())
    assert gen.token_ids == free and gen.finish_reason == "length"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 9, 10, 13])
def test_never_more_tokens_than_asked_even_mid_path(oracle, max_new_tokens):
    hf, llm = oracle
    prompt = [6, 1, 6]
    gen = Engine(llm, [llm], Mode.TREE, [1] * 8).generate([Request(prompt, max_new_tokens)])[0]
    assert gen.token_ids == hf_greedy(hf, prompt, max_new_tokens)
    assert gen.finish_reason == "length"


@pytest.mark.parametrize("field,request_", [
    ("prompt", Request([])),
    ("prompt", Request([10**6])),
    ("max_new_tokens", Request([1], 0)),
    ("max_new_tokens", Request([1], 10**6)),
    ("temperature", Request([1], 4, SamplingParams(temperature=-1))),
    ("temperature", Request([1], 4, SamplingParams(temperature=float("nan")))),
    ("top_p", Request([1], 4, SamplingParams(temperature=1, top_p=0))),
    ("top_p", Request([1], 4, SamplingParams(temperature=1, top_p=1.5))),
    ("top_k", Request([1], 4, SamplingParams(temperature=1, top_k=-1))),
    ("min_p", Request([1], 4, SamplingParams(temperature=1, min_p=1.5))),
    ("min_p", Request([1], 4, SamplingParams(temperature=1, min_p=float("nan")))),
])
def test_bad_requests_are_refused_naming_the_field(field, request_):
    with pytest.raises(ValueError, match=f"^{field}:"):
        validate(request_, vocab_size=64, context=512)


def test_drafts_from_a_draft_vocabulary_keep_the_output_exact(tiny_pair, tmp_path):
    """The LLM as its own SSM, drafting from half its vocabulary: every draft node is in the draft
    vocabulary, drafts on the greedy path are accepted, and the output is still the LLM's own."""
    hf, llm_dir, _ = tiny_pair
    keep = set(range(0, 64, 2))
    shutil.copytree(llm_dir, tmp_path / "drafter")
    (tmp_path / "drafter" / DRAFT_VOCAB).write_text(json.dumps({"token_ids": sorted(keep)}))
    llm, drafter = LlamaModel.from_pretrained(llm_dir), LlamaModel.from_pretrained(tmp_path / "drafter")
    prompt = [7, 1, 30, 12]
    trees = Speculator(drafter).draft([DraftRequest("a", prompt, [2, 2, 1])])
    assert trees[0].tokens and set(trees[0].tokens) <= keep
    gen = Engine(llm, [drafter], Mode.TREE, [2, 2, 1]).generate([Request(prompt, 40)])[0]
    assert gen.token_ids == hf_greedy(hf, prompt, 40)
    assert sum(gen.accepted) > 0
