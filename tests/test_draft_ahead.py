"""Drafting during verification (`Speculator.draft_ahead`): after a tree is handed over, the drafter drafts
the next step's trees for the likeliest outcomes of verifying it. Each outcome's tree is the tree a fresh
drafter grows after the outcome's tokens; the outcomes are the likeliest by the drafter's own
probabilities (reference: plain forwards of each path, no cache, no batching); after a hit the drafter's
next draft is the tree it drafted ahead (the KV it kept is right); and its state is released whole."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel
from specinfer.sampling import SamplingParams
from specinfer.speculator import DraftRequest, Speculator
from specinfer.tree import TokenTree
from specinfer_rpc.client import connect, generate_all, request_pb
from specinfer_rpc.launch import launch

from .conftest import MODELS
from .services import reference_greedy
from .test_dynamic_tree import last_logits, paths
from .test_faults import read_rest
from .test_metrics import scrape, total


@pytest.fixture(scope="module")
def ssm():
    return LlamaModel.from_pretrained(MODELS / "ssm-0")


def likeliest_outcomes(model: LlamaModel, record: list[int], tree: TokenTree, n: int) -> list[tuple[int, ...]]:
    """The n likeliest (accepted path, bonus token) of a tree by the drafter's log-probabilities from plain
    forwards: a path's tokens, then a token that is none of its end's children."""
    scored = []
    for path in [()] + sorted(paths(tree)):
        logq = last_logits(model, record + list(path)).log_softmax(-1)
        logp = sum(last_logits(model, record + list(path[:i])).log_softmax(-1)[t].item() for i, t in enumerate(path))
        children = {p[-1] for p in paths(tree) if len(p) == len(path) + 1 and p[:-1] == path}
        best = logq.topk(n + len(children))
        scored += [(logp + lq, path + (b,)) for b, lq in zip(best.indices.tolist(), best.values.tolist())
                   if b not in children]
    return [key for _, key in sorted(scored, key=lambda s: -s[0])[:n]]


@pytest.mark.parametrize("expansion", [[2, 1, 1], [1, 1, 1, 1], [3, 2]])
def test_each_outcome_tree_is_what_a_fresh_drafter_grows_after_its_tokens(ssm, heldout_ids, expansion):
    records = [p[:40] for p in heldout_ids[:3]]
    batch = [DraftRequest(f"r{i}", r, expansion, ahead=5) for i, r in enumerate(records)]
    trees, later = Speculator(ssm).draft_ahead(batch)
    ahead = later()
    fresh = Speculator(ssm).draft([DraftRequest(f"r{i}", r, expansion) for i, r in enumerate(records)])
    assert [paths(t) for t in trees] == [paths(t) for t in fresh]  # the trees sent are `draft`'s
    for i, (record, tree) in enumerate(zip(records, trees)):
        assert len(ahead[i]) == 5
        assert list(ahead[i]) == likeliest_outcomes(ssm, record, tree, 5)
        for key, grown in ahead[i].items():
            alone = Speculator(ssm).draft([DraftRequest("x", record + list(key), expansion)])[0]
            assert paths(grown) == paths(alone), key


def test_after_a_hit_the_next_draft_is_the_tree_drafted_ahead_and_state_is_released_whole(ssm, heldout_ids):
    spec = Speculator(ssm)
    free = spec.pool.available
    records = [p[:30] for p in heldout_ids[3:7]]
    batch = [DraftRequest(f"r{i}", r, [2, 1, 1], ahead=4) for i, r in enumerate(records)]
    for _ in range(3):  # outcome j of each request realised, then its next step drafted ahead again
        ahead = spec.draft_ahead(batch)[1]()
        hits = [list(a.items())[i % len(a)] for i, a in enumerate(ahead)]
        batch = [DraftRequest(r.request_id, list(key), r.expansion, ahead=4) for r, (key, _) in zip(batch, hits)]
        nxt = spec.draft([DraftRequest(r.request_id, r.new_tokens, r.expansion) for r in batch])
        assert [paths(t) for t in nxt] == [paths(tree) for _, tree in hits]
        batch = [DraftRequest(r.request_id, [], r.expansion, ahead=4) for r in batch]  # nothing new: the same tree again
    for r in batch:
        spec.release(r.request_id)
    assert spec.pool.available == free


def test_only_greedy_requests_on_fixed_trees_draft_ahead(ssm, heldout_ids):
    sampled = SamplingParams(temperature=0.8, seed=1, mss=True)
    batch = [DraftRequest("greedy", heldout_ids[0][:20], [2, 1], ahead=3),
             DraftRequest("sampled", heldout_ids[1][:20], [2, 1], sampled, ahead=3),
             DraftRequest("coupled", heldout_ids[2][:20], [2, 1], SamplingParams(temperature=0.8, seed=1), ahead=3),
             DraftRequest("none", heldout_ids[3][:20], [], ahead=3),
             DraftRequest("not asked", heldout_ids[4][:20], [2, 1])]
    trees, later = Speculator(ssm).draft_ahead(batch)
    assert [len(a) for a in later()] == [3, 0, 0, 0, 0]
    assert [len(t) for t in trees] == [4, 4, 4, 0, 4]
    assert all(len(a) == 0 for a in Speculator(ssm, dynamic=True).draft_ahead(batch)[1]())


def test_greedy_output_drafting_ahead_is_the_llms_and_its_hits_are_the_trees_drafted_after_the_verdict(ssm, heldout_ids):
    """In process, with a fixed tree: the same tokens as the LLM alone, and the same accepted drafts per step
    as drafting after each verdict (a hit's tree is the one drafting then gives), many steps hitting."""
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    requests = [Request(p[:48], 24) for p in heldout_ids[:4]]
    alone = Engine(llm, mode=Mode.INCREMENTAL).generate(requests)
    runs, stats = {}, {}
    for n in (0, 4):
        engine = Engine(llm, [ssm], Mode.TREE, [2, 1, 1], draft_ahead=n)
        runs[n], stats[n] = engine.generate(requests), engine.engine.stats
    for a, after, before in zip(alone, runs[0], runs[4]):
        assert a.token_ids == after.token_ids == before.token_ids
        assert after.accepted == before.accepted
    steps = sum(g.steps for g in runs[4])
    assert stats[0].predraft_hits == stats[0].predraft_misses == 0
    assert 0 < stats[4].predraft_hits and stats[4].predraft_hits + stats[4].predraft_misses < steps


def test_with_the_controller_the_drafters_draft_ahead_only_on_the_steps_it_chose_so(ssm, heldout_ids):
    """The adaptive engine: drafting ahead is a choice (each tree choice's twin), which the controller tries
    before weighing it; the tokens are the LLM's. A controller without that choice has nothing drafted
    ahead, though the engine is asked to draft ahead."""
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    requests = [Request(p[:48], 32) for p in heldout_ids[:2]]
    alone = Engine(llm, mode=Mode.INCREMENTAL).generate(requests)
    for priced in (True, False):
        engine = Engine(llm, [ssm], Mode.TREE, [2, 1, 1], adaptive=True, draft_ahead=4)
        engine.engine.controller.ahead = priced
        out, stats = [engine.generate([r])[0] for r in requests], engine.engine.stats
        assert [g.token_ids for g in out] == [g.token_ids for g in alone]
        made = engine.engine.controller.made[1]
        assert any(c.ahead for c in made) == priced, made
        assert (stats.predraft_hits + stats.predraft_misses > 0) == priced, made


@pytest.fixture(scope="module")
def ahead_system():
    system = launch(MODELS / "llm", [MODELS / "ssm-0"], speculators=1, port=0, manager_args=["--draft-ahead", "4"])
    yield system
    system.stop()


def test_through_the_services_drafting_ahead_gives_the_llms_tokens_and_hits_skip_the_drafters(ahead_system,
                                                                                               heldout_ids):
    """Real services, a fixed tree: one stream at a time (where a hit leaves without the speculator) and six
    at once give the LLM's greedy tokens; the manager counts hits and misses, and the verifier's idle time
    has steps whose tree was drafted ahead."""
    address, prompts = ahead_system.manager.address, heldout_ids[:6]
    one = [generate_all(address, [Request(p, 48)], "2,1,1")[0] for p in prompts[:3]]
    many = generate_all(address, [Request(p, 48) for p in prompts], "2,1,1")
    reference = reference_greedy(prompts, 48)
    assert [s.token_ids for s in one] == reference[:3]
    assert [s.token_ids for s in many] == reference
    m, v = scrape(ahead_system.manager.metrics), scrape(ahead_system.by_name("verifier").metrics)
    hits, misses = total(m, "specinfer_predraft_hits_total"), total(m, "specinfer_predraft_misses_total")
    assert hits > 0 and misses > 0
    assert total(v, "specinfer_verifier_idle_seconds_count", next="hit") == hits
    assert total(v, "specinfer_verifier_idle_seconds_count", next="miss") >= misses


@pytest.mark.parametrize("outcome_steps", [[], ["--outcome-steps"]], ids=["after-the-answer", "before-the-outcome"])
def test_a_speculator_killed_while_it_drafts_ahead_loses_nothing(heldout_ids, outcome_steps):
    """The speculator is killed mid-chain: its drafts ahead (and, with --outcome-steps, a step that left with
    them as candidates) are dropped, and every request goes on to the LLM's greedy tokens."""
    system = launch(MODELS / "llm", [MODELS / "ssm-0"], speculators=1, port=0,
                    manager_args=["--draft-ahead", "4", *outcome_steps])
    prompts = heldout_ids[:4]
    try:
        async def go():
            stub = connect(system.manager.address)
            calls = [stub.Generate(request_pb(Request(p, 48), "2,1,1"), timeout=300) for p in prompts]
            firsts = await asyncio.gather(*(c.read() for c in calls))
            os.kill(system.by_name("speculator-0").process.pid, signal.SIGKILL)
            rests = await asyncio.gather(*(read_rest(c) for c in calls))
            return [list(f.token_ids) + r for f, r in zip(firsts, rests)]

        assert asyncio.run(go()) == reference_greedy(prompts, 48)
    finally:
        system.stop()
