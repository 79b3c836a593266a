"""Steps begun behind a step not yet ended (specinfer/verifier.py: `Verifier.follows`, `begin`,
`end`): a verifier on a GPU queues the next plain step, its pending tokens read on the device from
the step before's decision, before it reads that step's verdicts. On the CPU a step is done when it
is begun, so what is checked there is the bookkeeping; on a GPU (bench/gpu_first_run.sh runs these
natively, with CUDA graphs too) steps through graphs really overlap. The tokens, the records and the prefix
cache are those of the same steps run one after another, greedy, seeded sampled and with the
penalties that read the record (decided once the step before has ended), in the eager and the
padded static-buffer forward, with a request joining midway; a step that cannot follow is
refused; and the verifier service leaves a step running only where a plain step could begin behind it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specinfer.graphs import GraphConfig
from specinfer.model import LlamaModel
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree
from specinfer.verifier import Verifier, VerifyRequest
from specinfer_rpc.model_thread import ModelThread
from verifier_svc.servicer import VerifierServicer, _Lane

from .conftest import MODELS

STEPS = 12
SETTINGS = [SamplingParams(),
            SamplingParams(0.8, top_p=0.9, seed=7),
            SamplingParams(1.0, seed=3, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.4,
                           logit_bias=((5, 2.0),)),
            SamplingParams(repetition_penalty=1.5)]
MODES = {"eager": GraphConfig(mode="eager"),
         "static": GraphConfig(mode="static", max_tokens=64, max_batch=8, max_tree=64, max_context=256)}


CUDA = torch.cuda.is_available()
if CUDA:  # where a step really runs while the host begins the next: CUDA graphs (an eager step's inputs come
    MODES["graphs"] = GraphConfig(mode="graphs", max_tokens=64, max_batch=8, max_tree=64, max_context=256)
    # from pageable memory: that copy waits for the step before, so eager steps are checked, not overlapped)


@pytest.fixture(scope="module")
def llm() -> LlamaModel:
    return LlamaModel.from_pretrained(MODELS / "llm", device="cuda" if CUDA else "cpu")


def plain(rid: str, tokens: list[int] = ()) -> VerifyRequest:
    return VerifyRequest(rid, list(tokens), sampling=SETTINGS[int(rid) % len(SETTINGS)], output_start=0)


def batches(prompts: list[list[int]]):
    """Each step's batch: every request's next token, and at step 4 one more request's prompt."""
    for k in range(STEPS):
        batch = [plain(str(i)) for i in range(len(prompts) - 1)]
        if k == 4:
            batch.append(plain(str(len(prompts) - 1), prompts[-1]))
        elif k > 4:
            batch.append(plain(str(len(prompts) - 1)))
        yield batch


def generate(verifier: Verifier, prompts: list[list[int]], chained: bool) -> dict[str, list[int]]:
    out = {str(i): [] for i in range(len(prompts))}
    verifier.step([plain(str(i), p) for i, p in enumerate(prompts[:-1])])
    steps = list(batches(prompts))
    if not chained:
        for batch in steps:
            for req, v in zip(batch, verifier.step(batch)):
                out[req.request_id] += v.tokens
        return out
    begun = verifier.begin(steps[0])
    for batch in steps[1:]:
        assert verifier.follows(begun, batch, [])
        behind = verifier.begin(batch, begun)
        for req, v in zip(begun.batch, verifier.end(begun)):
            out[req.request_id] += v.tokens
        begun = behind
    for req, v in zip(begun.batch, verifier.end(begun)):
        out[req.request_id] += v.tokens
    return out


@pytest.mark.parametrize("mode", MODES)
def test_steps_begun_behind_unended_ones_give_the_tokens_and_records_of_steps_one_after_another(llm, heldout_ids, mode):
    prompts = [p[:40] for p in heldout_ids[:5]]
    one = Verifier(llm, 8192, MODES[mode])
    want = generate(one, prompts, chained=False)
    two = Verifier(llm, 8192, MODES[mode])
    got = generate(two, prompts, chained=True)
    assert got == want
    assert all(len(t) == STEPS for rid, t in want.items() if rid != "4") and len(want["4"]) == STEPS - 4
    for rid, cache in one.caches.items():
        theirs = two.caches[rid]
        assert (theirs.tokens, theirs.length, theirs.indexed, theirs.key) == (cache.tokens, cache.length,
                                                                           cache.indexed, cache.key)
    assert set(one.pool.prefix) == set(two.pool.prefix)


def test_a_step_that_cannot_take_the_token_of_the_step_before_does_not_follow_it(llm, heldout_ids):
    verifier = Verifier(llm, 8192, MODES["eager"])
    prompts = [p[:20] for p in heldout_ids[:2]]
    verifier.step([plain(str(i), p) for i, p in enumerate(prompts)])
    begun = verifier.begin([plain("0"), plain("1")])
    assert verifier.follows(begun, [plain("0")], [])  # a request may leave
    assert verifier.follows(begun, [plain("0"), plain("1"), plain("2", [1, 2, 3])], [])  # or join
    assert not verifier.follows(begun, [plain("0", [4]), plain("1")], [])  # tokens of its own: its record moves
    # a tree of its own (ending the step before drops its scratch tree)
    assert not verifier.follows(begun, [VerifyRequest("0", [], TokenTree([3], [-1])), plain("1")], [])
    assert not verifier.follows(begun, [plain("0")], ["1"])  # one of the step's requests released
    assert not verifier.follows(begun, [], [])
    with pytest.raises(ValueError, match="cannot begin before the step it follows ends"):
        verifier.begin([plain("0", [4])], begun)
    records = {rid: list(c.tokens) for rid, c in verifier.caches.items()}
    with pytest.raises(ValueError, match="request 9: nothing to decode"):  # refused before any record changes
        verifier.begin([plain("0"), plain("9")], begun)
    assert {rid: c.tokens for rid, c in verifier.caches.items()} == records and begun.follower is None
    verifier.end(begun)

    asks = verifier.begin([plain("0"), VerifyRequest("1", [], logprobs=True)])  # ending it reads its logits
    assert asks.reads_rows and not verifier.follows(asks, [plain("0")], [])
    verifier.end(asks)
    tree = verifier.begin([plain("0"), VerifyRequest("1", [], TokenTree([3, 4], [-1, 0]))])  # its token count is open
    assert verifier.follows(tree, [plain("0")], []) and not verifier.follows(tree, [plain("1")], [])
    behind = verifier.begin([plain("0")], tree)
    assert not verifier.follows(tree, [plain("0")], [])  # one step behind another at most
    assert not verifier.follows(behind, [plain("0")], [])  # nor behind one whose decision waits for that one
    verifier.end(tree)
    verifier.end(behind)


def test_the_service_leaves_a_step_running_only_where_a_plain_step_could_begin_behind_it(llm, heldout_ids):
    """With --overlap, a step whose requests each get one token is left running for the stream's next
    step to begin behind it; a step whose every request verifies a tree (a speculative step: its
    manager needs the answer before it sends more) is ended where it is begun, its answer queued at
    once, while one manager's stream is open. With another open, it is left running, so that the model
    thread stays free to launch that manager's steps. The answers are the verifier's own, in order."""
    prompt = heldout_ids[0]
    verifier = Verifier(llm, 4096, GraphConfig(mode="eager"))
    servicer = VerifierServicer(verifier, "m", 60.0, ModelThread("test-verifier"), overlap=True)
    servicer.streams = 1
    loop = asyncio.new_event_loop()

    def tree() -> VerifyRequest:  # a speculative step's: request 0's record, a 3-node tree below it
        return VerifyRequest("0", [], TokenTree([5, 6, 7], [-1, 0, -1]), output_start=0)

    try:
        lane = _Lane(loop)
        begun = servicer._advance(lane, [], [plain("0", prompt)], [len(prompt)], [False])
        assert begun is not None and lane.running is begun  # the prefill's one token: a step may follow
        assert servicer._advance(lane, [], [tree()], [len(prompt) + 1], [False]) is None  # the prefill ended first
        assert lane.running is None and not servicer.running
        loop.run_until_complete(asyncio.sleep(0))  # the answers put from "the model thread" (here: this one)
        answers = [lane.answers.get_nowait() for _ in range(2)]
        assert lane.answers.empty()
        servicer.streams = 2  # another manager's stream open: the tree step is left running
        length = len(prompt) + 1 + len(answers[1][1][0].tokens)
        begun = servicer._advance(lane, [], [tree()], [length], [False])
        assert begun is not None and lane.running is begun
        servicer._close(lane, begun)
        loop.run_until_complete(asyncio.sleep(0))
        answers.append(lane.answers.get_nowait())
        assert lane.answers.empty()
    finally:
        loop.close()
    assert [len(batch) for batch, _, _ in answers] == [1, 1, 1] and len(answers[0][1][0].tokens) == 1
    assert all(1 <= len(a[1][0].tokens) <= 3 for a in answers[1:])  # an accepted path (at most 2 deep) and one token
    assert verifier.caches["0"].tokens[len(prompt):] == [t for a in answers for t in a[1][0].tokens]
