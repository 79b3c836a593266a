"""The scheduler carries out the controller's choice: context lookup's chain first asks the
speculators only for requests it finds nothing for, and keeps outputs exact; the SSMs' trees ask
them. The verifier and the speculators here are in-process stand-ins with the clients' interface
(the services tests run the real ones): a "LLM" whose greedy next token repeats the record's token
PERIOD places back, so its continuations loop and context lookup can guess them, and an SSM that
always guesses a token the LLM never emits."""

from __future__ import annotations

import asyncio

import pytest

from manager_svc.scheduler import Scheduler, SlowReader, Stream
from specinfer.controller import PLAIN, Choice, Iteration, SpeculationController
from specinfer.engine import FIRST_TOKEN_FIRST, Record, Request, SpeculativeEngine, Verified, steps_ahead_for
from specinfer.errors import VerifierLost
from specinfer.tree import TokenTree

PERIOD = 5
NEVER = 99  # a token the stand-in LLM never emits


def llm_next(record: list[int]) -> int:
    return record[-PERIOD]


class Verifier:
    """Greedy verification of each request's tree against llm_next: the accepted path, then the
    LLM's own token."""

    def __init__(self):
        self.records: dict[str, list[int]] = {}

    async def verify(self, checks, release):
        for rid in release:
            self.records.pop(rid, None)
        results = []
        for c in checks:
            record = self.records.get(c.request_id, []) + c.new_tokens
            assert len(record) == c.record_length
            out, node = [], -1
            while True:
                t = llm_next(record + out)
                out.append(t)
                node = next((u for u, (tok, p) in enumerate(zip(c.tree.tokens, c.tree.parents))
                             if p == node and tok == t), None)
                if node is None:
                    break
            self.records[c.request_id] = record + out
            results.append(Verified(out))
        return results, 1_000_000

    async def release(self, request_ids):
        for rid in request_ids:
            self.records.pop(rid, None)


class Speculator:
    connected = True
    wants_features = False

    def __init__(self):
        self.calls, self.draft_ns = 0, 0
        self.asked: list[list[str]] = []  # the request ids of each call

    async def draft(self, drafts):
        self.calls += 1
        self.asked.append([d.request_id for d in drafts])
        self.draft_ns = 1000
        return {d.request_id: TokenTree([NEVER] * len(d.expansion), list(range(-1, len(d.expansion) - 1)))
                for d in drafts}

    def release(self, request_id):
        pass

    async def flush(self):
        pass


class Fixed(SpeculationController):
    """Makes one choice whenever trees fit, keeps every drafter drafting it (however rarely it
    agrees), and keeps what it was told."""

    def __init__(self, speculators: bool):
        super().__init__(lookup=True)
        self.speculators, self.steps = speculators, []

    def choose(self, batch_size, full_trees, chained=False):
        return Choice(len(full_trees), self.speculators) if full_trees else PLAIN

    @staticmethod
    def drafter_levels(own, planned, step):
        return planned

    def record(self, step: Iteration) -> None:
        self.steps.append(step)
        super().record(step)


def run(speculators: bool, prompts: list[list[int]], n: int, verifier: Verifier | None = None,
        speculator: Speculator | None = None):
    speculator, controller = speculator or Speculator(), Fixed(speculators)
    engine = SpeculativeEngine(verifier or Verifier(), [speculator], eos=set(), expansion=[1, 1, 1], tree_budget=64,
                               controller=controller, lookup=True, lookup_tokens=3)
    scheduler = Scheduler(engine, max_batch=8, max_queue=8, max_prefill_tokens=4096)
    seqs = [scheduler.submit(Request(p, n), None) for p in prompts]

    async def go():
        while scheduler.running or scheduler.waiting:
            await scheduler.iteration()

    asyncio.run(go())
    return seqs, speculator, controller, engine.stats


def reference(prompt: list[int], n: int) -> list[int]:
    record = list(prompt)
    for _ in range(n):
        record.append(llm_next(record))
    return record[len(prompt):]


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15]]


def test_lookup_first_asks_the_speculators_only_where_it_finds_nothing_and_stays_exact():
    seqs, speculator, controller, stats = run(False, PROMPTS, 30)
    assert [s.generated for s in seqs] == [reference(p, 30) for p in PROMPTS]
    # the prompt's step drafts nothing (FIRST_TOKEN_FIRST), and from the next one lookup finds the loop for
    # every request: the speculators are never asked (test_the_ssms_trees...: asked where the SSMs' trees are chosen)
    assert speculator.asked == []
    assert controller.steps and all(s.draft_levels == s.draft_nodes == s.draft_s == 0 and not any(s.asked)
                                    for s in controller.steps)
    # the loop is guessed: after the prefill (whose last token is new: no chain), three chain tokens
    # accepted per step, plus the LLM's own
    assert all(s.steps <= 1 + -(-29 // 4) for s in seqs), [s.steps for s in seqs]
    assert controller.acceptance[False].at(1) > 0.9 and controller.acceptance[True].reached == {}
    # the iteration split counts the chains' steps by the levels they verified, not as plain steps
    shapes = stats.summary()["by_batch_and_levels"]
    assert set(shapes) == {"2x0", "2x3"}
    assert shapes["2x3"]["iterations"] == sum(s.trees for s in controller.steps) > 0


def test_the_ssms_trees_ask_the_speculators_with_lookup_merged_in():
    seqs, speculator, controller, _ = run(True, PROMPTS, 30)
    assert [s.generated for s in seqs] == [reference(p, 30) for p in PROMPTS]
    asked = sum(s.draft_levels > 0 for s in controller.steps)
    assert asked >= len(controller.steps) - 1  # all but a last step with one token to go
    assert speculator.calls == asked  # not at the prompt's step (FIRST_TOKEN_FIRST), which the controller never records
    # the SSMs' trees, with lookup's right chain merged in, are accepted; and the chain is measured on its
    # own at these steps too (every step where lookup found one), so lookup's choice stays priced
    assert controller.acceptance[True].at(1) > 0.9 and controller.acceptance[False].at(3) > 0.9
    assert controller.fallback() < 0.2


class Recording(Verifier):
    """Keeps every step's checks: (request id, new tokens, tree nodes, features asked)."""

    def __init__(self):
        super().__init__()
        self.steps: list[list[tuple[str, int, int, bool]]] = []

    async def verify(self, checks, release):
        self.steps.append([(c.request_id, len(c.new_tokens), len(c.tree), c.features) for c in checks])
        return await super().verify(checks, release)


class FeatureSpeculator(Speculator):
    wants_features = True


def test_with_the_controller_a_prompts_step_drafts_nothing_but_brings_the_prompts_features():
    """The first token comes as soon as without speculation (FIRST_TOKEN_FIRST): with the controller,
    at a request's prompt step no drafter is asked for it and no tree is verified, yet a feature
    drafter gets the prompt's features; from its next step it drafts, and its output is the LLM's. A
    request that fixed its expansion drafts at its prompt's step too, as every request does without
    the controller."""
    for controlled in (True, False):
        verifier, speculator = Recording(), FeatureSpeculator()
        engine = SpeculativeEngine(verifier, [speculator], eos=set(), expansion=[1, 1], tree_budget=64,
                                   controller=Fixed(True) if controlled else None, lookup=False)
        scheduler = Scheduler(engine, max_batch=8, max_queue=8, max_prefill_tokens=4096)
        server, fixed = (scheduler.submit(Request(p, 12, id=name), e)
                         for p, name, e in ((PROMPTS[0], "server", None), (PROMPTS[1], "fixed", [1])))

        async def go():
            while scheduler.running or scheduler.waiting:
                await scheduler.iteration()

        asyncio.run(go())
        assert [server.generated, fixed.generated] == [reference(p, 12) for p in PROMPTS]
        first = {rid: (new, nodes, features) for rid, new, nodes, features in verifier.steps[0]}
        assert first["server"] == (len(PROMPTS[0]), 0 if controlled else 2, True)  # the prompt's features
        assert first["fixed"] == (len(PROMPTS[1]), 1, True)
        assert speculator.asked[0] == (["fixed"] if controlled else ["server", "fixed"])
        # its drafts never hold: a token a step, each with a tree but the prompt's (controlled) and the last one's
        assert "server" in speculator.asked[1] and server.steps == 12 and server.tree_steps == 12 - 1 - controlled
        assert server.no_tree[FIRST_TOKEN_FIRST] == (1 if controlled else 0) and not fixed.no_tree[FIRST_TOKEN_FIRST]


class Remote(Verifier):
    """A verifier `hop` seconds away: what the engine waits for is more than the step it is told of."""

    async def verify(self, checks, release):
        await asyncio.sleep(0.004)
        return await super().verify(checks, release)


class RemoteSpeculator(Speculator):
    async def draft(self, drafts):
        await asyncio.sleep(0.002)
        return await super().draft(drafts)


def test_the_iteration_split_holds_what_the_engine_waited_for_apart_from_its_own_work():
    seqs, speculator, controller, stats = run(True, PROMPTS, 12, Remote(), RemoteSpeculator())
    assert [s.generated for s in seqs] == [reference(p, 12) for p in PROMPTS]
    c = stats.counters()
    assert c["iterations"] == len(controller.steps) + 1  # and the prefill's
    assert c["verifier_step"] == pytest.approx(1e-3 * c["iterations"])  # the stand-in's 1 ms a step
    assert c["verifier_wait"] >= 0.004 * c["iterations"]  # each step's sleep, inside its wait
    assert c["drafting"] == pytest.approx(1e-6 * speculator.calls)  # its own 1 us a call...
    assert c["drafting_wait"] >= 0.002 * speculator.calls  # ...inside what the engine waited
    assert c["all"] > c["verifier_wait"] + c["drafting_wait"]  # the rest is the engine's own work


def test_a_stream_left_unread_past_the_cap_gets_its_chunks_then_resource_exhausted():
    """A client that reads nothing: its stream queues at most max_unread chunks, then the request
    is cancelled (its verifier state released) and the stream ends with SlowReader, which the
    servicer answers RESOURCE_EXHAUSTED; a stream that is read is untouched."""
    verifier = Verifier()
    engine = SpeculativeEngine(verifier, [], eos=set(), expansion=[], tree_budget=None, controller=None,
                               lookup=False, lookup_tokens=0)
    scheduler = Scheduler(engine, max_batch=8, max_queue=8, max_prefill_tokens=4096, max_unread=3)
    slow, read = (scheduler.submit(Request(p, 10), None) for p in PROMPTS)
    got = []

    async def go():
        while scheduler.running or scheduler.waiting:
            await scheduler.iteration()
            await asyncio.sleep(0)  # the loop's next pass delivers the chunks to the streams
            while not read.events.empty():
                got.extend(read.events.get_nowait().tokens)

    asyncio.run(go())
    events = [slow.events.get_nowait() for _ in range(slow.events.qsize())]
    assert [len(e.tokens) for e in events[:3]] == [1, 1, 1] and isinstance(events[3], SlowReader)
    assert len(events) == 4 and "3 chunks unread" in str(events[3])
    # released on the verifier with the next step (the read stream's), not held while unread
    assert slow.done and slow.id not in scheduler.running and slow.id not in verifier.records and read.id in verifier.records
    assert got == reference(PROMPTS[1], 10) and read.finish_reason == "length"


def test_prompts_that_start_alike_wait_one_step_for_the_first_ones_prefill():
    """Requests whose prompts share their first KV block with one admitted in the same iteration
    wait one step, then come in together: the verifier then gives them the blocks that first prefill
    holds (kv_cache.py) instead of computing the prompt again; prompts that differ, or fit in one
    block, come in at once."""
    verifier = Verifier()
    engine = SpeculativeEngine(verifier, [], eos=set(), expansion=[], tree_budget=None, controller=None,
                               lookup=False, lookup_tokens=0)
    scheduler = Scheduler(engine, max_batch=8, max_queue=8, max_prefill_tokens=4096, kv_block_size=8)
    shared = list(range(1, 11))
    seqs = [scheduler.submit(Request(p, 3), None) for p in (shared, shared + [11], [9] * 9, shared, [1, 2, 3, 4, 5])]
    admitted = []

    async def go():
        while scheduler.running or scheduler.waiting:
            before = set(scheduler.running)
            await scheduler.iteration()
            admitted.append(sorted(seqs.index(s) for s in seqs if s.steps and s.id not in before and s.steps == 1))

    asyncio.run(go())
    assert admitted[:2] == [[0], [1, 2, 3, 4]]  # FIFO: the second waits, and those behind it with it
    assert [s.generated for s in seqs] == [reference(s.request.prompt, 3) for s in seqs]


class PoolVerifier(Verifier):
    """The stand-in with a KV pool of `blocks` blocks of `block_size` slots: a step whose requests'
    records and trees need more fails the test (the real verifier would refuse it, CacheFull)."""

    def __init__(self, blocks: int, block_size: int):
        super().__init__()
        self.blocks, self.block_size, self.most = blocks, block_size, 0

    async def verify(self, checks, release):
        for rid in release:
            self.records.pop(rid, None)
        slots = {rid: len(r) for rid, r in self.records.items()}
        slots.update((c.request_id, c.record_length + len(c.tree)) for c in checks)
        need = sum(-(-n // self.block_size) for n in slots.values())
        assert need <= self.blocks, f"a step needs {need} blocks of {self.blocks}"
        self.most = max(self.most, len(checks))
        return await super().verify(checks, [])


def serve_all(scheduler: Scheduler, submit_later=()) -> dict[str, int]:
    """Run the scheduler until every request is done; `submit_later`: (iteration, submit) pairs,
    each called before that iteration. Returns the iteration each request ended in."""
    later, ended = dict(submit_later), {}

    async def go():
        i = 0
        while scheduler.running or scheduler.waiting or later:
            if i in later:
                later.pop(i)()
            running = list(scheduler.running.values())
            await scheduler.iteration()
            ended.update((s.id, i) for s in running if s.done)
            i += 1
        await scheduler.engine.flush()

    asyncio.run(go())
    return ended


def pooled(blocks: int, max_batch: int, turn_tokens: int = 0, speculate: bool = True):
    verifier = PoolVerifier(blocks, 8)
    engine = SpeculativeEngine(verifier, [Speculator()] if speculate else [], eos=set(),
                               expansion=[1, 1] if speculate else [], tree_budget=None, controller=None,
                               lookup=speculate, lookup_tokens=2)
    return verifier, Scheduler(engine, max_batch=max_batch, max_queue=64, max_prefill_tokens=4096,
                               kv_tokens=blocks * 8, kv_block_size=8, kv_watermark=0.0, turn_tokens=turn_tokens)


def test_blocks_on_demand_run_more_requests_than_reservations_and_preemption_keeps_outputs_exact():
    """Requests take verifier KV blocks as they grow: 12 requests that could each reach 9 blocks run
    8 at a time on a pool of 40 blocks (reserving max_new_tokens up front would run 4); when their
    growth overflows the pool the newest is preempted, resumes from its record, and every output is
    exactly the LLM's; no step ever needs more blocks than the pool has, and every request's state
    is released at the end."""
    verifier, scheduler = pooled(blocks=40, max_batch=8)
    prompts = [[i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6] for i in range(1, 120, 10)]
    seqs = [scheduler.submit(Request(p, 60), None) for p in prompts]
    serve_all(scheduler)
    assert [s.generated for s in seqs] == [reference(p, 60) for p in prompts]
    assert verifier.most == 8 > 40 // -(-(7 + 60 + scheduler.engine.max_tree(seqs[0])) // 8)
    assert sum(s.preemptions for s in seqs) > 0 and all(s.finish_reason == "length" for s in seqs)
    assert not verifier.records and not scheduler.running and not scheduler.waiting


def test_a_request_that_could_never_fit_the_pool_is_refused_or_fitted_when_unset():
    _, scheduler = pooled(blocks=10, max_batch=8)
    tree = scheduler.engine.max_tree(Stream(Request([1] * 7, 1), None))
    with pytest.raises(ValueError, match="^max_new_tokens:"):
        scheduler.submit(Request([1] * 7, 80 - 7 - tree + 1), None)
    fitted = scheduler.submit(Request([1] * 7, 1000), None, fit_max_new_tokens=True)
    assert fitted.request.max_new_tokens == 80 - 7 - tree


def test_a_short_request_takes_a_turn_from_long_ones_and_priority_goes_first():
    """A full batch of two long requests: with fair turns, a short request that arrives takes the
    place of the long one that has had the most, finishes, and the long one resumes where it was;
    without, it waits for a long one to end, unless it has a better (lower) priority; every output
    is exact."""
    longs = [[1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15, 16]]
    short = [20, 21, 22, 23, 24, 25, 26]

    def short_ends(turn_tokens: int, priority: int = 0) -> tuple[int, int]:
        """The iteration the short request ended in after arriving at iteration 10, and the longs'
        preemptions."""
        _, scheduler = pooled(blocks=100, max_batch=2, turn_tokens=turn_tokens, speculate=False)
        seqs = [scheduler.submit(Request(p, 40), None) for p in longs]
        late = []
        ended = serve_all(scheduler, [(10, lambda: late.append(
            scheduler.submit(Request(short, 4, priority=priority), None)))])
        assert [s.generated for s in seqs] == [reference(p, 40) for p in longs]
        assert late[0].generated == reference(short, 4)
        return ended[late[0].id], sum(s.preemptions for s in seqs)

    assert short_ends(turn_tokens=0) == (40 + 3, 0)  # behind the longs' 40 steps (one token each)
    assert short_ends(turn_tokens=8) == (10 + 3, 1)  # at once: its 4 tokens in 4 steps
    assert short_ends(turn_tokens=0, priority=-1) == (10 + 3, 1)
    assert short_ends(turn_tokens=0, priority=1) == (40 + 3, 0)


def test_a_drafts_record_is_the_prompt_then_the_generated_tokens_read_from_any_point():
    """What a drafter is told is a tail of the record (`Record.tail`), never the record joined whole."""
    prompt, generated = [5, 6, 7], [8, 9]
    record = Record(prompt, generated)
    assert len(record) == 5 and all(record.tail(i) == (prompt + generated)[i:] for i in range(7))
    generated.append(10)  # a view of the request's own lists: a committed token is in it
    assert len(record) == 6 and record.tail(4) == [9, 10]


class Queued(PoolVerifier):
    """The stand-in as a backend that queues steps (as the manager's client of a verifier service): a
    step is computed when its call starts, in the order the calls start, and answered a few loop
    passes later, so the engine sends plain steps ahead. `lose_at`: the step (1-based) whose answer
    is a lost state, as a restarted verifier's: it forgets every request (the step sent ahead of it,
    computed before, is then dropped by the engine unanswered)."""

    def __init__(self, blocks: int = 10_000, block_size: int = 8, lose_at: int = 0):
        super().__init__(blocks, block_size)
        self.lose_at, self.lost_upto = lose_at, 0
        self.sent = self.in_flight = self.most_in_flight = 0

    async def verify(self, checks, release, follows=False):
        self.sent += 1
        number = self.sent
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            answer = await super().verify(checks, release)  # no await inside: computed now, in call order
            for _ in range(3):
                await asyncio.sleep(0)
            if number == self.lose_at:
                self.records.clear()
                self.lost_upto = self.sent
            if number <= self.lost_upto:
                raise VerifierLost(f"step {number}: the verifier restarted")
            return answer
        finally:
            self.in_flight -= 1


def queued_scheduler(verifier: Queued, speculate: bool = False, max_batch: int = 8, kv_blocks: int = 0):
    engine = SpeculativeEngine(verifier, [Speculator()] if speculate else [], eos=set(),
                               expansion=[1, 1] if speculate else [], tree_budget=None, controller=None,
                               lookup=speculate, lookup_tokens=2, steps_ahead=True)
    return Scheduler(engine, max_batch=max_batch, max_queue=64, max_prefill_tokens=4096, kv_tokens=kv_blocks * 8,
                     kv_block_size=8, kv_watermark=0.0)


def expected(req: Request) -> list[int]:
    out = reference(req.prompt, req.max_new_tokens)
    stop = next((i for i, t in enumerate(out) if t in req.stop_token_ids), None)
    return out if stop is None else out[: stop + 1]


def test_plain_steps_are_sent_ahead_and_every_output_stays_exact():
    """Speculation off, over a backend that queues steps: each plain step is sent before the one it
    follows is answered (two in flight), a request admitted meanwhile joins the next one, a request
    ending on a stop token or its length has its step ahead dropped, and every output is exactly the
    LLM's; at the end the verifier holds nothing. With the drafters' trees nothing is sent ahead."""
    for speculate in (False, True):
        verifier = Queued()
        scheduler = queued_scheduler(verifier, speculate)
        requests = [Request([1, 2, 3, 4, 5, 6, 7], 30), Request([10, 11, 12, 13, 14, 15], 9),
                    Request([20, 21, 22, 23, 24, 25, 26], 40, stop_token_ids=[23])]
        seqs = [scheduler.submit(r, None) for r in requests]
        late = []
        serve_all(scheduler, [(5, lambda: late.append(scheduler.submit(Request([30, 31, 32, 33, 34], 12), None)))])
        for s in seqs + late:
            assert s.generated == expected(s.request), speculate
        assert [s.finish_reason for s in seqs + late] == ["length", "length", "stop", "length"]
        assert verifier.most_in_flight == (1 if speculate else 2)
        assert not verifier.records and not scheduler.running
        # every step's reason for having no tree is counted, the steps sent ahead's too
        assert all(sum(s.no_tree.values()) + s.tree_steps == s.steps for s in seqs + late)


def test_the_controller_is_told_which_batches_plain_steps_would_be_sent_ahead():
    """Plain steps go ahead only where no request needs an answer first: the controller prices plain
    decoding as steps sent ahead for those batches, one step at a time for the others (a request
    drafting from its prediction) and everywhere without steps ahead."""
    class Told(SpeculationController):
        def __init__(self):
            super().__init__()
            self.told = []

        def choose(self, batch_size, full_trees, chained=False):
            self.told.append(chained)
            return PLAIN

    prompt = [1, 2, 3, 4, 5, 6, 7]
    for steps_ahead, prediction, want in ((True, (), {True}), (True, tuple(reference(prompt, 40)), {False}),
                                          (False, (), {False})):
        controller = Told()
        engine = SpeculativeEngine(Queued(), [Speculator()], eos=set(), expansion=[1, 1], tree_budget=64,
                                   controller=controller, lookup=True, lookup_tokens=2, steps_ahead=steps_ahead)
        scheduler = Scheduler(engine, max_batch=8, max_queue=8, max_prefill_tokens=4096)
        seqs = [scheduler.submit(Request(prompt, 12, prediction=prediction), None)]
        serve_all(scheduler)
        assert seqs[0].generated == reference(prompt, 12)
        assert set(controller.told[1:]) == want, (steps_ahead, prediction, controller.told)  # (the first: a prefill)


def test_a_step_ahead_survives_preemption_cancellation_and_a_lost_verifier():
    """Preempted while its step ahead is in flight (the pool runs out), the request is resent whole
    and its output stays exact, and no step needs more blocks than the pool has (the step ahead's
    token counted); a request cancelled meanwhile is released; a verifier that loses its state
    under two steps in flight gets every record again."""
    verifier = Queued(blocks=40)
    scheduler = queued_scheduler(verifier, kv_blocks=40)
    prompts = [[i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6] for i in range(1, 120, 10)]
    seqs = [scheduler.submit(Request(p, 60), None) for p in prompts]
    serve_all(scheduler, [(20, lambda: scheduler.cancel(seqs[0]))])
    assert verifier.most_in_flight == 2 and sum(s.preemptions for s in seqs) > 0
    assert seqs[0].done and 0 < len(seqs[0].generated) < 60
    assert [s.generated for s in seqs[1:]] == [reference(p, 60) for p in prompts[1:]]
    assert not verifier.records

    verifier = Queued(lose_at=12)
    scheduler = queued_scheduler(verifier)
    seqs = [scheduler.submit(Request(p, 30), None) for p in prompts[:3]]
    serve_all(scheduler)
    assert [s.generated for s in seqs] == [reference(p, 30) for p in prompts[:3]]
    assert verifier.lost_upto == 12 and all(s.resyncs == 1 for s in seqs) and not verifier.records


def test_steps_are_sent_ahead_by_default_only_for_a_verifier_on_a_gpu():
    assert steps_ahead_for("cuda") and not steps_ahead_for("cpu")
    assert steps_ahead_for("cpu", "on") and not steps_ahead_for("cuda", "off")
    with pytest.raises(ValueError, match="^steps_ahead: must be auto, on or off, got 'yes'"):
        steps_ahead_for("cuda", "yes")
