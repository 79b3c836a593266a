"""A step sent before the outcome of the step before it (`VerifyRequest.since`, `candidates`;
VerifyItem.follows_outcome on the wire): the verifier verifies the tree drafted ahead for the outcome
that step emitted, or skips the request where none was drafted for it (no tokens: it comes again with a
tree). Its tokens are those of the same tree sent after the outcome was known; a step that could not
follow is refused, naming the field."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from manager_svc.clients import verified, verify_request
from specinfer.engine import Check
from specinfer.generate import Engine, LocalVerifier, Mode, Request
from specinfer.model import LlamaModel
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree
from specinfer.verifier import Verifier, VerifyRequest
from specinfer_rpc.convert import tree_to_pb
from specinfer_rpc.model_thread import ModelThread
from specinfer_rpc.v1 import common_pb2, verifier_pb2
from verifier_svc.servicer import VerifierServicer, _Lane, kinds, verify_requests, verify_response

from specinfer_rpc.client import generate_all
from specinfer_rpc.launch import launch

from .conftest import MODELS
from .services import reference_greedy
from .test_metrics import scrape, total

FIRST = TokenTree([5, 6, 7], [-1, 0, -1])  # the step before's tree: nothing the LLM is likely to accept


@pytest.fixture(scope="module")
def llm() -> LlamaModel:
    return LlamaModel.from_pretrained(MODELS / "llm")


def greedy(llm: LlamaModel, record: list[int], n: int) -> list[int]:
    """The LLM's next n greedy tokens after `record` (plain steps of a verifier of its own)."""
    v = Verifier(llm, 4096)
    out = v.step([VerifyRequest("g", list(record))])[0].tokens
    while len(out) < n:
        out += v.step([VerifyRequest("g", [])])[0].tokens
    return out[:n]


def chain(tokens: list[int]) -> TokenTree:
    return TokenTree(list(tokens), list(range(-1, len(tokens) - 1)))


@pytest.mark.parametrize("drafted_for_it", [True, False])
def test_the_tree_drafted_for_the_outcome_is_verified_as_if_sent_after_it(llm, heldout_ids, drafted_for_it):
    """Step k verifies a tree; step k+1, sent without its outcome, carries trees for three outcomes. The
    verifier takes the one whose outcome step k emitted (the LLM's own next tokens, so that they are
    accepted): the tokens equal those of a verifier sent that tree once the outcome was known. With none
    drafted for it, the request is skipped (no tokens, the record as it was), and its next step is as if
    the skipped one had not been sent."""
    prompt = heldout_ids[0][:40]
    v, ref = Verifier(llm, 4096), Verifier(llm, 4096)
    emitted = tuple(v.step([VerifyRequest("r", list(prompt), FIRST)])[0].tokens)
    assert tuple(ref.step([VerifyRequest("r", list(prompt), FIRST)])[0].tokens) == emitted
    right = chain(greedy(llm, list(prompt) + list(emitted), 3))
    candidates = [((emitted[-1] + 1,), chain([9, 9])), (emitted + (0,), chain([8])), (emitted, right)]
    if not drafted_for_it:
        candidates.pop()
    req = VerifyRequest("r", [], since=len(prompt), candidates=candidates)
    got = v.step([req])[0].tokens
    assert req.chosen == (2 if drafted_for_it else -1) and req.skipped == (not drafted_for_it)
    if not drafted_for_it:
        assert got == [] and v.caches["r"].tokens == ref.caches["r"].tokens
        got = v.step([VerifyRequest("r", [], right)])[0].tokens  # sent again, with its tree
    want = ref.step([VerifyRequest("r", [], right)])[0].tokens
    assert got == want and len(got) == 4
    assert v.caches["r"].tokens == ref.caches["r"].tokens


def test_a_step_that_cannot_follow_an_outcome_is_refused_naming_the_field(llm, heldout_ids):
    prompt = heldout_ids[0][:40]
    v = Verifier(llm, 4096)
    v.step([VerifyRequest("r", list(prompt), FIRST)])
    with pytest.raises(ValueError, match="candidates"):  # it may carry no tokens or tree of its own
        v.step([VerifyRequest("r", [1], since=len(prompt), candidates=[((1,), chain([2]))])])
    with pytest.raises(ValueError, match="record_length"):  # no outcome past that length
        v.step([VerifyRequest("r", [], since=len(v.caches["r"].tokens), candidates=[((1,), chain([2]))])])
    with pytest.raises(ValueError, match="record_length"):  # a request the verifier does not hold
        v.step([VerifyRequest("new", [], since=0)])
    item = verifier_pb2.VerifyItem(request_id="r", record_length=3,
                                   candidates=[common_pb2.OutcomeTree(outcome=[1], tree=tree_to_pb(chain([2])))])
    with pytest.raises(ValueError, match="candidates"):  # candidates on an ordinary step
        verify_requests(verifier_pb2.VerifyRequest(items=[item]), llm.cfg.vocab_size)


@pytest.mark.parametrize("overlap", [False, True])
def test_through_the_service_the_step_after_is_queued_before_the_answer_and_says_which_tree(llm, heldout_ids,
                                                                                           overlap):
    """The servicer takes a stream's two messages in order, the second sent before the first's answer:
    step k (a prompt and a tree; with --overlap, a plain step left running first) and step k+1 with
    candidates. The answers name the candidate verified (VerifyResult.candidate), and the verifier's idle
    time counts it as a hit."""
    prompt = heldout_ids[1][:40]
    verifier = Verifier(llm, 4096)
    servicer = VerifierServicer(verifier, "m", 60.0, ModelThread("test-outcome-verifier"), overlap=overlap)
    servicer.streams = 1
    loop = asyncio.new_event_loop()
    first = list(prompt) + greedy(llm, prompt, 1)  # a plain prefill, then step k: the tree step
    ref = Verifier(llm, 4096)
    ref.step([VerifyRequest("r", list(prompt))])
    emitted = ref.step([VerifyRequest("r", [], FIRST)])[0].tokens
    right = greedy(llm, first + emitted, 2)
    hits = REGISTRY.get_sample_value("specinfer_verifier_idle_seconds_count", {"next": "hit"}) or 0.0

    def message(item: verifier_pb2.VerifyItem) -> tuple[list[VerifyRequest], list[int], list[bool]]:
        request = verifier_pb2.VerifyRequest(items=[item])
        return verify_requests(request, llm.cfg.vocab_size), [item.record_length], kinds(request)

    try:
        lane = _Lane(loop)
        steps = [verifier_pb2.VerifyItem(request_id="r", new_token_ids=prompt, record_length=len(prompt))]
        steps.append(verifier_pb2.VerifyItem(request_id="r", record_length=len(first), tree=tree_to_pb(FIRST)))
        steps.append(verifier_pb2.VerifyItem(
            request_id="r", record_length=len(first), follows_outcome=True,
            candidates=[common_pb2.OutcomeTree(outcome=[emitted[0] + 1], tree=tree_to_pb(chain([3]))),
                        common_pb2.OutcomeTree(outcome=emitted, tree=tree_to_pb(chain(right)))]))
        for item in steps:
            batch, lengths, predrafted = message(item)
            servicer._advance(lane, [], batch, lengths, predrafted)
        servicer._close(lane)
        loop.run_until_complete(asyncio.sleep(0))
        answers = [lane.answers.get_nowait() for _ in range(3)]
    finally:
        loop.close()
    results = [verify_response(*a).results[0] for a in answers]
    assert [list(r.token_ids) for r in results] == [first[len(prompt):], emitted, right + greedy(llm, first + emitted + right, 1)]
    assert [r.candidate for r in results] == [0, 0, 2]
    assert REGISTRY.get_sample_value("specinfer_verifier_idle_seconds_count", {"next": "hit"}) == hits + 1


def test_the_engines_backends_carry_the_candidates_and_say_which_tree_was_verified(llm, heldout_ids):
    """In process (LocalVerifier) and on the wire (the manager's verify_request and verified), a Check with
    candidates is a step that follows the outcome, and the answer's candidate is the index verified."""
    prompt = heldout_ids[2][:40]
    local = LocalVerifier(Verifier(llm, 4096))
    greedy_sampling = SamplingParams()
    answer, _ = asyncio.run(local.verify([Check("r", list(prompt), len(prompt), FIRST, greedy_sampling)], []))
    emitted = tuple(answer[0].tokens)
    candidates = [((emitted[-1] + 1,), chain([4])), (emitted, chain(greedy(llm, list(prompt) + list(emitted), 2)))]
    check = Check("r", [], len(prompt), TokenTree(), greedy_sampling, candidates=candidates)
    answer, _ = asyncio.run(local.verify([check], []))
    assert answer[0].candidate == 1 and len(answer[0].tokens) == 3
    message = verify_request("m-", [check], [])
    item = message.items[0]
    assert item.follows_outcome and [tuple(c.outcome) for c in item.candidates] == [o for o, _ in candidates]
    assert not verify_request("m-", [replace(check, candidates=None)], []).items[0].follows_outcome
    response = verifier_pb2.VerifyResponse(results=[verifier_pb2.VerifyResult(request_id="m-r", token_ids=[1], candidate=2)])
    assert verified([check], response)[0].candidate == 1


@pytest.mark.parametrize("together", [1, 4])
def test_steps_that_leave_before_the_outcome_give_the_llms_greedy_tokens(llm, heldout_ids, together):
    """In process, a fixed tree, drafting ahead: each step after the first leaves with the trees drafted
    ahead as candidates before the step before is answered; the tokens are the LLM's own, and some steps
    took the tree drafted for their outcome."""
    ssm = LlamaModel.from_pretrained(MODELS / "ssm-0")
    requests = [Request(p[:48], 24) for p in heldout_ids[:4]]
    alone = Engine(llm, mode=Mode.INCREMENTAL).generate(requests)
    engine = Engine(llm, [ssm], Mode.TREE, [2, 1, 1], draft_ahead=4, outcome_steps=True)
    out = [g for i in range(0, 4, together) for g in engine.generate(requests[i: i + together])]
    assert [g.token_ids for g in out] == [g.token_ids for g in alone]
    stats = engine.engine.stats
    assert stats.predraft_hits > 0


def test_through_the_services_steps_leave_before_the_outcome_and_give_the_llms_tokens(heldout_ids):
    """Real services, `--draft-ahead 4 --outcome-steps`, a fixed tree: one stream at a time and six at once
    give the LLM's greedy tokens; steps took the tree drafted for their outcome (the verifier's idle time
    counts them as hits) and others were skipped and sent again."""
    system = launch(MODELS / "llm", [MODELS / "ssm-0"], speculators=1, port=0,
                    manager_args=["--draft-ahead", "4", "--outcome-steps"])
    prompts = heldout_ids[:6]
    try:
        one = [generate_all(system.manager.address, [Request(p, 48)], "2,1,1")[0] for p in prompts[:3]]
        many = generate_all(system.manager.address, [Request(p, 48) for p in prompts], "2,1,1")
        m, v = scrape(system.manager.metrics), scrape(system.by_name("verifier").metrics)
    finally:
        system.stop()
    reference = reference_greedy(prompts, 48)
    assert [s.token_ids for s in one] == reference[:3] and [s.token_ids for s in many] == reference
    assert total(m, "specinfer_predraft_hits_total") > 0 and total(m, "specinfer_predraft_misses_total") > 0
    assert total(v, "specinfer_verifier_idle_seconds_count", next="hit") > 0
