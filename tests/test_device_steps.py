"""Device-resident, batched steps: verification and tree drafting run as batched tensor ops on the
model's device, with one host synchronization per step, and give what the per-request rules give.

- Batched greedy and coupled verification equal the rules walked node by node in Python, on random
  trees, and dispatch the same ops whatever the trees' depth.
- Batched greedy drafting equals drafting each request alone, node by node, with transformers.
- A seeded request's sampled tree is the same alone and in any batch.
- A request re-drafted with no new tokens gets the same tree again (in-process and through the service).
- Ops dispatched per verifier step and per speculator draft do not grow with the batch (torch.profiler
  on the shipped models), and each makes exactly one host synchronization.
"""

from __future__ import annotations

import json
import random

import grpc
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specinfer.model import DRAFT_VOCAB, LlamaModel
from specinfer.draws import coupled_noise, coupled_sample, mix, probabilities
from specinfer.sampling import SamplingParams, stream_key
from specinfer.speculator import DraftRequest, Speculator
from specinfer.tree import DraftGroup, TokenTree, merge
from specinfer.verifier import Verifier, VerifyRequest
from specinfer import acceptance
from specinfer.acceptance import verify_batch
from specinfer_bench import ops
from specinfer_bench.attention_cases import random_tree
from specinfer_rpc.convert import tree_from_pb
from specinfer_rpc.launch import System
from specinfer_rpc.v1 import speculator_pb2, speculator_pb2_grpc

from .conftest import MODELS


def greedy_walk(tree: TokenTree, argmax: list[int]) -> tuple[list[int], int]:
    """The rule spelled out: from the root, descend into the child whose token is the argmax."""
    path, u = [], -1
    while True:
        child = next((c for c, p in enumerate(tree.parents) if p == u and tree.tokens[c] == argmax[u + 1]), None)
        if child is None:
            return path, argmax[u + 1]
        path.append(child)
        u = child


@pytest.mark.parametrize("seed", range(5))
def test_batched_greedy_verification_equals_the_rule_walked_per_request(seed):
    rng = random.Random(seed)
    vocab = 5  # small, so that many nodes match and paths are long
    trees = [merge([random_tree(rng, rng.choice([0, 1, 7, 30, 60]), vocab)]) for _ in range(16)]  # one node per path
    logits, starts = tilted_logits(rng, trees, vocab, seed)
    verdicts = verify_batch(trees, logits, starts, [SamplingParams()] * len(trees), [0] * len(trees))
    for t, start, v in zip(trees, starts, verdicts):
        path, bonus = greedy_walk(t, logits[start: start + 1 + len(t)].argmax(-1).tolist())
        assert v.path == path and v.tokens == [t.tokens[u] for u in path] + [bonus]
    assert any(len(v.path) > 2 for v in verdicts), "some long accepted paths"


def coupled_walk(tree: TokenTree, p: torch.Tensor, key: int, position: int) -> tuple[list[int], int]:
    """The coupled rule spelled out: from the root, descend into the child whose token is the
    coupled sample of the LLM's p there, keyed by the record position that row predicts."""
    path, u = [], -1
    while True:
        x = coupled_sample(p[u + 1: u + 2], torch.tensor([key]), torch.tensor([position + len(path)]))[0].item()
        child = next((c for c, q in enumerate(tree.parents) if q == u and tree.tokens[c] == x), None)
        if child is None:
            return path, x
        path.append(child)
        u = child


def tilted_logits(rng: random.Random, trees: list[TokenTree], vocab: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Random logits for the trees' rows (and their row starts), mostly favouring one child of each
    node by a wide margin, so that accepted paths get long."""
    starts, rows = [], 0
    for t in trees:
        starts.append(rows)
        rows += 1 + len(t)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    for t, start in zip(trees, starts):
        for u in range(-1, len(t)):
            kids = [c for c, p in enumerate(t.parents) if p == u]
            if kids and rng.random() < 0.9:
                logits[start + 1 + u, t.tokens[rng.choice(kids)]] += 10.0
    return logits, starts


@pytest.mark.parametrize("seed", range(3))
def test_batched_coupled_verification_equals_the_rule_walked_per_request(seed):
    rng = random.Random(seed)
    vocab = 5
    trees = [merge([random_tree(rng, rng.choice([0, 1, 7, 30, 60]), vocab)]) for _ in range(16)]
    logits, starts = tilted_logits(rng, trees, vocab, seed)
    params = [SamplingParams(rng.choice([0.5, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9]), seed=b) for b in range(16)]
    positions = [rng.randrange(1000) for _ in trees]
    verdicts = verify_batch(trees, logits, starts, params, positions)
    for t, start, s, position, v in zip(trees, starts, params, positions, verdicts):
        p = probabilities(logits[start: start + 1 + len(t)], s)
        path, bonus = coupled_walk(t, p, stream_key(s.seed, "sample"), position)
        assert v.path == path and v.tokens == [t.tokens[u] for u in path] + [bonus]
    assert any(len(v.path) > 2 for v in verdicts), "some long accepted paths"


def test_coupled_verification_makes_one_noise_row_per_request_and_depth_of_its_own_tree(monkeypatch):
    """The noise is the costly part of a sampled step: a request without a tree, beside one with a
    deep tree, makes one row of it, not one per level of the batch's deepest tree."""
    rows = []
    real = acceptance.coupled_noise
    monkeypatch.setattr(acceptance, "coupled_noise", lambda word, vocab: rows.append(len(word)) or real(word, vocab))
    chain = TokenTree([3, 4, 5, 6], [-1, 0, 1, 2])  # depth 4
    bush = TokenTree([3, 4, 5], [-1, -1, 0])  # depth 2
    trees = [chain, TokenTree(), bush, TokenTree()]
    logits, starts = tilted_logits(random.Random(0), trees, 8, 0)
    verify_batch(trees, logits, starts, [SamplingParams(1.0, seed=b) for b in range(4)], [10, 20, 30, 40])
    assert rows == [5 + 1 + 3 + 1]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "coupled"])
def test_verification_ops_do_not_grow_with_the_depth_of_the_trees(temperature):
    """A chain of 24 nodes dispatches the ops a bush of 24 nodes two levels deep does."""
    rng = random.Random(0)
    chain = TokenTree(list(range(24)), list(range(-1, 23)))
    bush = TokenTree(list(range(24)), [-1] * 4 + [u % 4 for u in range(20)])
    counts = {}
    for name, tree in (("chain", chain), ("bush", bush)):
        trees = [tree] * 8
        logits, starts = tilted_logits(rng, trees, 32, 0)
        verify = lambda: verify_batch(trees, logits, starts, [SamplingParams(temperature, seed=1)] * 8, [100] * 8)
        verify()  # the noise's per-token words are made once per vocabulary
        counts[name] = ops.count(verify)
    assert counts["chain"] == counts["bush"], counts


@pytest.mark.parametrize("tree,message", [
    (TokenTree([5, 5], [-1, -1]), "repeats token 5"),
    (TokenTree([5], [-1], [DraftGroup(-1, [5, 10**6], [0.5, 0.5], [0], False)]), "q_token_ids: token id 1000000"),
    (TokenTree([5], [-1], [DraftGroup(-1, [6], [1.0], [0], False)]), "positive probability"),
    (TokenTree([5], [-1], [DraftGroup(-1, [5, 5], [0.5, 0.5], [0], False)]), "distinct"),
])
def test_trees_verification_cannot_handle_are_refused_naming_the_field_before_anything_changes(tree, message):
    verifier = Verifier(LlamaModel.from_pretrained(MODELS / "llm"))
    verifier.step([VerifyRequest("a", [1, 2, 3])])
    record = list(verifier.caches["a"].tokens)
    with pytest.raises(ValueError, match=f"^tree.*{message}"):
        verifier.step([VerifyRequest("a", [], tree, SamplingParams(0.8))])
    assert verifier.caches["a"].tokens == record


def reference_draft(hf, prefix: list[int], expansion: list[int], vocab: list[int]) -> set[tuple[int, ...]]:
    """Greedy expansion drafted alone with transformers: every node's children are the top-k of
    the SSM after prefix + S_u among the draft vocabulary `vocab`. Returns the tree's paths S_u."""
    paths, frontier = set(), [()]
    for k in expansion:
        nxt = []
        for s in frontier:
            with torch.no_grad():
                logits = hf(torch.tensor([prefix + list(s)])).logits[0, -1, vocab]
            for t in torch.tensor(vocab)[logits.topk(k).indices].tolist():
                nxt.append(s + (t,))
        paths.update(nxt)
        frontier = nxt
    return paths


def test_batched_greedy_drafting_equals_drafting_each_request_alone(heldout_ids):
    hf = AutoModelForCausalLM.from_pretrained(MODELS / "ssm-0", dtype=torch.float32).eval()
    spec = Speculator(LlamaModel.from_pretrained(MODELS / "ssm-0"))
    expansions = [[2, 1, 1], [1, 1, 3, 1], [3, 2], [], [1]]
    prompts = heldout_ids[:5]
    batch = [DraftRequest(str(i), p, e) for i, (p, e) in enumerate(zip(prompts, expansions))]
    first = spec.draft(batch)
    # a second draft after a few committed tokens goes through the kept KV of the first tree
    more = [t.tokens[:1] + [7] if len(t) else [7] for t in first]
    second = spec.draft([DraftRequest(str(i), m, e) for i, (m, e) in enumerate(zip(more, expansions))])
    vocab = json.loads((MODELS / "ssm-0" / DRAFT_VOCAB).read_text())["token_ids"]
    for prompt, e, m, a, b in zip(prompts, expansions, more, first, second):
        assert set(a.paths()) == reference_draft(hf, prompt, e, vocab)
        assert set(b.paths()) == reference_draft(hf, prompt + m, e, vocab)
        assert len(a.paths()) == len(set(a.paths())), "one node per path"


def same_tree(a: TokenTree, b: TokenTree) -> bool:
    """The same nodes and draws; q may differ in its last bits (other row counts round matmuls
    differently)."""
    return (a.tokens, a.parents) == (b.tokens, b.parents) and len(a.groups) == len(b.groups) and all(
        (g.parent, g.children, g.q_ids, g.replacement) == (h.parent, h.children, h.q_ids, h.replacement)
        and g.q_probs == pytest.approx(h.q_probs, abs=1e-5) for g, h in zip(a.groups, b.groups))


@pytest.mark.parametrize("mss", [True, False], ids=["mss", "coupled"])
def test_a_seeded_sampled_tree_is_the_same_alone_and_in_any_batch(heldout_ids, mss):
    """MSS's draws, and coupled matching's guesses of the sample (keyed by the request and the position)."""
    ssm = LlamaModel.from_pretrained(MODELS / "ssm-0")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, mss=mss)
    mine = DraftRequest("me", heldout_ids[0], [2, 2, 1], params)
    alone = Speculator(ssm).draft([mine])[0]
    others = [DraftRequest(f"o{i}", p, [3, 1], SamplingParams(1.0, seed=i, mss=i < 2), replacement=bool(i % 2))
              for i, p in enumerate(heldout_ids[1:5])]
    crowd = Speculator(ssm).draft(others[:2] + [mine] + others[2:])[2]
    assert bool(alone.groups) == mss and len(alone) and same_tree(alone, crowd)


def test_drafts_for_coupled_matching_guess_the_sample_then_take_the_ssms_top_k(heldout_ids):
    """A sampled request verified by matching (not MSS) gets the greedy tree's shape with no draft
    groups. A node's first child is the SSM's guess of the LLM's coupled sample: its q (the
    request's sampling transforms, its 32 likeliest tokens) raced against the verifier's noise of
    that position (draws.coupled_noise); the others are the SSM's top-k without it. Worked out here
    at the root with transformers."""
    hf = AutoModelForCausalLM.from_pretrained(MODELS / "ssm-0", dtype=torch.float32).eval()
    ssm = LlamaModel.from_pretrained(MODELS / "ssm-0")
    prompt = heldout_ids[0]
    greedy = Speculator(ssm).draft([DraftRequest("a", prompt, [2, 2, 1])])[0]
    vocab = torch.tensor(json.loads((MODELS / "ssm-0" / DRAFT_VOCAB).read_text())["token_ids"])
    with torch.no_grad():
        row = hf(torch.tensor([prompt])).logits[0, -1]
    logits = torch.full_like(row, float("-inf")).index_copy(0, vocab, row[vocab])
    guesses = []
    for seed in range(6):
        params = SamplingParams(1.3, seed=seed)
        sampled = Speculator(ssm).draft([DraftRequest("a", prompt, [2, 2, 1], params)])[0]
        assert sampled.parents == greedy.parents and not sampled.groups and len(sampled) == 2 + 4 + 4
        q = probabilities(logits[None], [params])[0]
        ids = q.topk(32).indices
        word = torch.tensor(mix(np.array([stream_key(seed, "sample")]), np.array([len(prompt)])))
        guess = ids[(q[ids] / coupled_noise(word, len(q), ids)[0]).argmax()].item()
        top = [t for t in logits.topk(2).indices.tolist() if t != guess]
        assert [sampled.tokens[u] for u, p in enumerate(sampled.parents) if p == -1] == [guess, top[0]], seed
        # a dynamic tree scores the guess as the SSM's likeliest child: it keeps it, first
        dynamic = Speculator(ssm, dynamic=True).draft([DraftRequest("a", prompt, [2, 2, 1], params)])[0]
        assert dynamic.tokens[dynamic.parents.index(-1)] == guess, seed
        guesses.append(guess)
    assert len(set(guesses)) > 1, "seeds whose guesses are all one token would not tell the rules apart"


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3),
                                      SamplingParams(temperature=0.8, seed=3, mss=True)])
def test_redrafting_with_no_new_tokens_gives_the_same_tree(sampling):
    spec = Speculator(LlamaModel.from_pretrained(MODELS / "ssm-0"))
    first = spec.draft([DraftRequest("a", [5, 6, 7, 8], [1, 1, 3], sampling)])[0]
    again = spec.draft([DraftRequest("a", [], [1, 1, 3], sampling)])[0]
    assert len(first) == 5 or not sampling.greedy
    assert same_tree(again, first)


def test_the_speculator_service_redrafts_a_request_with_no_new_tokens():
    system = System()
    try:
        svc = system.start("speculator", "speculator_svc", ["--ssm", str(MODELS / "ssm-0"), "--port", "0",
                                                           "--metrics-port", "0", "--threads", "1"], 120)
        update = lambda tokens: speculator_pb2.DraftUpdate(request_id="a", new_token_ids=tokens, expansion=[1, 1, 3])
        requests = [speculator_pb2.SpeculateRequest(iteration=i, updates=[update(t)])
                    for i, t in enumerate([[5, 6, 7, 8], [], []])]
        with grpc.insecure_channel(svc.address) as channel:
            answers = list(speculator_pb2_grpc.SpeculatorStub(channel).Speculate(iter(requests), timeout=60))
        trees = [tree_from_pb(a.trees[0].tree) for a in answers]
        assert len(trees) == 3 and len(trees[0]) == 5 and same_tree(trees[0], trees[1]) and same_tree(trees[0], trees[2])
    finally:
        system.stop()


@pytest.mark.parametrize("temperature,mss", [(0.0, False), (0.8, False), (0.8, True)])
def test_ops_per_step_do_not_grow_with_the_batch_and_one_sync_per_step(temperature, mss):
    """Greedy, sampled with coupled matching (the guess of the coupled sample, then top-k drafts) and
    sampled with MSS (sampled drafts)."""
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    ssm = LlamaModel.from_pretrained(MODELS / "ssm-0")
    verifier = {b: ops.count(ops.verifier_step(Verifier(llm), b, 8, temperature, mss=mss)) for b in (1, 32)}
    speculator = {b: ops.count(ops.speculator_draft(Speculator(ssm), b, [2, 1, 1], temperature, mss=mss))
                  for b in (1, 32)}
    print(f"T={temperature} mss={mss}: verifier step (ops, syncs) {verifier}; speculator <2,1,1> draft {speculator}")
    for counts in (verifier, speculator):
        assert counts[32][0] <= 1.2 * counts[1][0]
        assert counts[1][1] == counts[32][1] == 1


@pytest.mark.parametrize("q_top", [0, -3])
def test_a_speculator_without_room_for_q_is_refused_naming_the_field(q_top):
    with pytest.raises(ValueError, match=f"q_top: must be >= 1, got {q_top}"):
        Speculator(LlamaModel.from_pretrained(MODELS / "ssm-0"), q_top=q_top)
