"""Predicted outputs (specinfer/prediction.py): whatever the prediction, the output is the LLM's own
(greedy, and seeded sampling's tokens); a prediction that holds is drafted in chains that double up
to the engine's cap, and the usage counts what was drafted from it."""

from __future__ import annotations

import random

import pytest

from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel
from specinfer.prediction import PREDICTION_TOKENS, START_TOKENS, Prediction
from specinfer.sampling import SamplingParams
from specinfer_rpc.client import generate_all

from .conftest import MODELS
from .services import reference_greedy, seeded_reference

NEW = 48


def committed(p: Prediction, out: list[int], emitted: list[int], verified: list[int] | None = None) -> list[int]:
    """Commit a step that drafted p's chain (at most 16) and emitted `emitted` (its verified tokens
    `verified`, by default the emitted ones); the chain it drafted."""
    chain = p.draft(16)
    out += emitted
    p.commit(emitted, out, chain, verified or emitted)
    return chain


def test_the_cursor_follows_the_output_takes_a_substitution_and_finds_its_place_after_an_insertion():
    pred = [10, 11, 12, 13, 14, 15, 16, 17, 14, 18, 19, 20, 21, 22]
    p, out = Prediction(pred), []
    assert p.draft(16) == [10, 11]  # slow start
    assert p.commit([10, 11, 12], out := [10, 11, 12], [10, 11], [10, 11, 12]) == (2, 0)  # the step's counts
    assert (p.cursor, p.accepted, p.rejected) == (3, 2, 0)
    assert p.draft(16) == [13, 14, 15, 16]  # a chain held whole: the next is twice as long
    committed(p, out, [13, 40], verified=[13, 40])  # 14 became 40: taken as a substitution
    assert (p.cursor, p.accepted, p.rejected) == (5, 3, 3)
    assert p.draft(3) == [15, 16, 17]  # the rest of the prediction, as if 40 had been predicted
    assert p.draft(16) == [15, 16, 17, 40]  # the same word elsewhere: renamed too
    committed(p, out, [15, 16, 17, 40, 18])
    assert p.cursor == 10 and p.mark == 10
    committed(p, out, [77, 78])  # an insertion: two tokens the prediction does not have: lost
    assert p.cursor is None and p.draft(16) == []
    assert p.swaps == {14: 40}  # 77 was taken for a substitution of 19 until 78 showed it was not
    committed(p, out, [20])
    assert p.cursor is None  # one token is not enough to be found again by
    committed(p, out, [21])  # the output comes back: found again after the mark
    assert p.cursor == 13 and p.draft(16) == [22]


def test_the_place_found_is_the_first_at_or_past_the_mark_and_a_longer_match_wins():
    pred = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 5]
    p, out = Prediction(pred), []
    committed(p, out, [1, 2, 3, 9, 1, 2])  # followed to position 6 (the mark)
    committed(p, out, [50])
    committed(p, out, [51])  # lost
    assert p.cursor is None
    committed(p, out, [1, 2])  # [1, 2] occurs at 0, 4, 8: the first at or past the mark
    assert p.cursor == 10
    q, out = Prediction(pred), []
    committed(q, out, [60, 61, 9, 1, 2, 3])  # lost at once; [9, 1, 2, 3] is longest at 7
    assert q.cursor == 11 and q.swaps == {}


def greedy_engine() -> Engine:
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    return Engine(llm, [LlamaModel.from_pretrained(MODELS / "ssm-0")], Mode.TREE, [2, 1, 1], lookup=True,
                  adaptive=True, tree_budget=16)


def edited(tokens: list[int], rng: random.Random) -> list[int]:
    """`tokens` with a token replaced, a span inserted and a span deleted."""
    out = list(tokens)
    out[len(out) // 5] = (out[len(out) // 5] + 1) % 64
    out[len(out) // 2:len(out) // 2] = [rng.randrange(64) for _ in range(5)]
    del out[3 * len(out) // 4:3 * len(out) // 4 + 4]
    return out


def slow_start_steps(n: int, cap: int) -> int:
    """Steps a prediction equal to the output takes to emit n tokens: each emits its chain and the
    LLM's own token; the first chain is START_TOKENS long, each next one twice the last, up to `cap`."""
    steps, done, run = 0, 0, START_TOKENS
    while done < n:
        chain = min(run, cap, n - done - 1)
        done, steps, run = done + chain + 1, steps + 1, max(run, 2 * chain)
    return steps


def test_greedy_output_with_any_prediction_is_the_llms_own(heldout_ids):
    prompts = heldout_ids[:4]
    want = reference_greedy(prompts, NEW, ignore_eos=True)
    rng = random.Random(0)
    engine = greedy_engine()
    predictions = {"the output": want, "edited": [edited(w, rng) for w in want],
                   "random": [[rng.randrange(64) for _ in range(NEW)] for _ in want],
                   "another prompt's output": want[1:] + want[:1], "none": [()] * len(want)}
    source = engine.engine.prediction_source
    for name, preds in predictions.items():
        gens = engine.generate([Request(p, NEW, ignore_eos=True, prediction=tuple(pr))
                                for p, pr in zip(prompts, preds)])
        assert [g.token_ids for g in gens] == want, name
        if name == "the output":  # every chain held: no rejected node, and the chains doubled (within the
            for g in gens:        # batch's share of the tree budget, 16 nodes; the other drafters may add more)
                hit, drafted = g.drafters[source]
                assert hit == drafted > 0
                assert g.steps <= slow_start_steps(NEW, min(PREDICTION_TOKENS["cpu"], max(START_TOKENS, 16 // 4)))
    mixed = engine.generate([Request(p, NEW, ignore_eos=True, prediction=tuple(pr))
                             for p, pr in zip(prompts, [want[0], (), predictions["edited"][2], ()])])
    assert [g.token_ids for g in mixed] == want


def test_speculation_off_drafts_nothing_from_the_prediction(heldout_ids):
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    want = reference_greedy(heldout_ids[:1], 24, ignore_eos=True)[0]
    g = Engine(llm, mode=Mode.INCREMENTAL).generate([Request(heldout_ids[0], 24, ignore_eos=True,
                                                             prediction=tuple(want))])[0]
    assert g.token_ids == want and g.steps == 24 and not g.drafters


@pytest.mark.parametrize("temperature", [0.8, 1.0])
def test_a_seed_gives_plain_seeded_samplings_tokens_with_any_prediction(heldout_ids, temperature):
    engine = greedy_engine()
    for i, prompt in enumerate(heldout_ids[:3]):
        sampling = SamplingParams(temperature, top_p=0.95, seed=11 + i)
        plain = seeded_reference(Request(prompt, 32, sampling, ignore_eos=True))
        for pred in (plain, edited(plain, random.Random(i)), reference_greedy([prompt], 32, ignore_eos=True)[0]):
            got = engine.generate([Request(prompt, 32, sampling, ignore_eos=True, prediction=tuple(pred))])[0]
            assert got.token_ids == plain


def test_through_the_services_the_output_is_the_llms_own_and_usage_counts_the_prediction(system, heldout_ids):
    prompts = heldout_ids[4:8]
    want = reference_greedy(prompts, NEW, ignore_eos=True)
    rng = random.Random(1)
    for preds, whole in ((want, True), ([edited(w, rng) for w in want], False)):
        streams = generate_all(system.manager.address, [Request(p, NEW, ignore_eos=True, prediction=tuple(pr))
                                                        for p, pr in zip(prompts, preds)])
        assert [s.token_ids for s in streams] == want
        for s in streams:
            u = s.usage
            assert u.accepted_draft_tokens == NEW - u.verifier_steps
            if whole:  # the prediction is the output: every drafted token accepted
                assert u.rejected_prediction_tokens == 0 and u.accepted_prediction_tokens > NEW / 2
            else:
                assert u.rejected_prediction_tokens > 0 and 0 < u.accepted_prediction_tokens <= u.accepted_draft_tokens
    plain = generate_all(system.manager.address, [Request(prompts[0], NEW, ignore_eos=True)])[0]
    assert plain.usage.accepted_prediction_tokens == plain.usage.rejected_prediction_tokens == 0
