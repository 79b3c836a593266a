"""Which draft trees the server should verify at the current batch size, from a cost model.

Each iteration the engine (engine.py) may draft with any prefix <k_1..k_m> of the server's expansion config
that fits the tree budget (m = 0: no tree, plain incremental decoding), and, with context lookup on,
with context lookup's chain first (m levels, every level the budget allows): the SSMs draft only for
the requests lookup finds nothing to continue, so a step where it finds a chain for every request
costs no drafting and no RPC. The controller picks the choice that maximizes the expected output of
the whole batch per second (Sequoia's objective, per batch size B):

    B * tokens(m) / (verify(B, rows) + P(asked) draft(m, nodes) + overhead(B, P(asked)))

tokens(m) is what a request emits per step: for the SSMs' trees 1 + sum_{d<=m} P_ssm(accepted >= d);
for lookup's choice (1 - s) (1 + sum_{d<=r} P_chain(accepted >= d)) + s tokens_ssm(m), where s is
the measured share of requests lookup finds nothing for (the SSMs draft their trees instead) and r is
the chain's length (`chain`, or m where that is 0): a chain costs no drafting, only rows, so it may
go deeper than the trees. P(asked) is 1 for the SSMs' trees, 1 - (1 - s)^B for lookup's choice
(the SSMs then draft s B trees). Without drafters (`trees` False: a manager with no speculators, an
engine with no SSM or head) the choices are lookup's chain first and none, and a request lookup
finds nothing for emits its one token.

- P(accepted >= d) is the product of the measured acceptance rates of depths 1..d: of the steps whose
  tree reached depth d and whose accepted path reached depth d-1, the share that accepted a token at
  depth d (the same widths at every depth: prefixes of one expansion config). The SSMs' trees (with
  lookup's chain merged in, counted to their own depth) and lookup's chains are measured apart; a
  chain at every step where lookup found one, whatever the choice (how far the verified tokens agree
  with it), so its figures stay current while the SSMs' trees are chosen. A request that was planned
  a draft and got none (no speculator answered in time) counts as accepting nothing, so the expected
  output covers how often the drafters have something to say.
- verify(B, rows) is the verifier's own step time, fitted to [1, B, rows, trees] (rows: tokens
  verified, tree nodes included; trees: 1 if any request has a tree, since a step without trees can
  take a cheaper path than its row count says); draft(m, nodes) the slowest speculator's own time,
  fitted to [1, m, nodes, fed], from the steps that waited for it (fed: the record tokens a drafter caught up
  on before drafting, predicted at what a held choice feeds, the tokens its requests emitted the step before:
  a look after plain steps feeds every token since, and priced whole it kept trees looking dearer than they
  are held); overhead the rest of a tree step's iteration
  (RPCs, bookkeeping), fitted to [1, B, waited] (waited: 1 if the engine waited for the speculators' trees,
  0 where it did not ask them or every tree was drafted ahead), and a plain step's rest apart,
  fitted to [1, B] (until it has PLAIN_SETTLED samples, the tree steps' rest without drafting stands in).
- A plain step sent ahead of its answer (the engine's steps ahead: a verifier on a GPU) is launched
  behind the one before, so its RPC and the manager's work hide behind the device. Such steps' whole
  iterations have a fit of their own ([1, B]). Where the engine would send the batch's plain steps
  ahead (`choose`'s `chained`), plain decoding held costs what that fit says, or, before it has
  PLAIN_SETTLED samples (plain decoding not held yet: only looks at it, one step at a time), the
  longer of its verifier step and its rest, not their sum (a bound: where the RPC is most of the
  rest, two steps in flight overlap it and held plain decoding comes out faster still).
  How far the sum of the terms of its looks at plain steps undershoots held plain decoding, and how
  fast plain decoding runs one step at a time, on an H200: bench/results/services_h200_7b.md.
- Expected rows and nodes per request of each choice are measured (merging unions the speculators'
  trees, so how many nodes a request verifies depends on how often they agree).

Once a batch size has run SETTLING (32) iterations, its choice is weighed again every REWEIGH (8)
of them while it holds, not at every one (weighing every time was most of the controller's cost, and
of the manager's time an iteration at one request on a CPU), and at the next iteration after
it moved, so that a move one odd step caused is undone as soon as before. Before, the fits are
young and move fast, and every iteration weighs.

A tree must be predicted `margin` (10%) faster than plain decoding to be used: near a tie, costs
the model does not see decide (trees coming back after plain steps: a speculator catches up on their
tokens once; the fits' own error); without the margin, near-tie trees at two streams on a CPU ran below no
speculation.

Drafting ahead (`ahead`: the engine's draft_ahead): each tree choice has a twin on which the drafters,
once they have sent their trees, draft the next ones for the likeliest outcomes while the verifier checks
these (engine.py). Its tokens are its twin's; its cost is measured whole, from the steps that drafted ahead
behind a step that did too (the first cannot hit), fitted to [1, B, rows, waited, waited m] (waited: the
engine waited for a drafter's tree, because some request's outcome was not drafted ahead), and predicted at
waited = 1 - h^B, h the measured share of requests drafted ahead for whose outcome was (Share, from no hit).
Until it has AHEAD_SETTLED such steps, one of which did not wait, it is priced at its twin's cost: a fit of a
handful of samples over five features extrapolates wildly (an empty one predicts nothing: an infinite rate),
and one whose steps all waited cannot tell what waiting costs from the rest (where nothing is drafted ahead:
sampled requests, a head). So it is
chosen where the hits save more than the drafting during the verifier's step costs it: on a drafter with a
device of its own, not where the drafter shares the verifier's cores. A look at it lasts AHEAD_LOOK
iterations, so that it is seen held; the twin's steps count as held behind a step of the same choice only.

Each drafter's own share, per request: the engine measures how deep the LLM accepted each drafter's
tree alone (every speculator, context lookup and the grammar apart), pooled over requests and per
request (pulled towards the pooled figures). On the server's expansion a speculator drafts a level
for a request only while its own path there reaches that deep at least MIN_REACH (10%) of the time
(`drafter_levels`): every level costs verified rows and drafting whatever the other drafters do, so
a drafter that rarely agrees with the LLM on a request's text (an SSM trained on code, on a chat)
stops costing that request while the others keep drafting; a cut-off drafter still drafts one level
for it every PROBE steps, so it wins the request back when the text changes.

All fits are least squares over the most recent `window` steady iterations (no prompt being
prefilled; not a choice's first WARMUP iterations, which pay one-time costs), so the model follows
the machine and the load. On a GPU a verifier step costs about the same for 1 row or 64 and trees
stay on; on a CPU, or when a level of drafting costs more than it wins, the choice drops to lookup's chain first or to none. Trees shrink smoothly as the batch grows, because the rows cost grows with B
while the drafting cost per token does not shrink. Now and then an iteration at a batch size runs a
neighbouring choice instead (a shallower or deeper SSM tree; from none or depth 1, also lookup's chain
first, and from that, none or depth 1; with drafting ahead, a tree's twin and back), so that every estimate
stays current: `explore` iterations after the
choice last moved, then twice as far apart each time while it holds, up to `explore_max`. Exploring
is not free (a speculator that sat out plain steps first catches up on their tokens): at 2-4
concurrent requests on a CPU, where plain decoding wins, a look every 16 iterations cost 10-15%.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np


@dataclass
class Fit:
    """Least squares of y on features x over the last `window` samples (a small ridge keeps it
    defined before the samples span every feature). The normal equations' sums X'X and X'y are kept
    as samples come and go, so a prediction after an update solves one k x k system instead of
    rebuilding the window's arrays (this runs every iteration, on the engine's event loop).

    Robust to stalls: once `settled` samples are in, a sample is taken at most `clip` times what the
    fit predicts for it (the fit as solved at most `refresh` samples before: solving for every sample
    cost more than the rest of the fit). A step that a noisy neighbour or a page fault stalled ten
    times over then moves the fit no more than a step twice as slow would, while the drift of a
    machine's speed (up to 2x) comes through whole, and a larger lasting change at twice the
    prediction a sample. In a simulation with 5% of steps stalled 10x the choices' rate fell to 87% of
    the best choice's unclipped, and stayed at 96% or more clipped (tests/test_controller.py)."""

    window: int = 256
    samples: deque = field(default_factory=deque)
    coef: list[float] | None = None  # solved from the sums (`_solve`), when asked after a change
    # the sums in plain floats: a handful of features and an update per iteration, where numpy's calls cost more
    xtx: list[list[float]] | None = None  # sum of x x' over the window
    xty: list[float] | None = None  # sum of x y over the window
    clip: float = 2.0
    settled: int = 16
    refresh: int = 8  # a sample is clipped against coefficients solved at most this many samples before it
    since: int = 0  # samples added since the coefficients were solved

    def add(self, x: list[float], y: float) -> None:
        if len(self.samples) >= self.settled:
            if self.coef is None or self.since >= self.refresh:
                self._solve()
            y = min(y, self.clip * max(self._predict(x), 1e-9))
        if self.xtx is None:
            self.xtx, self.xty = [[0.0] * len(x) for _ in x], [0.0] * len(x)
        self.samples.append((x, y))
        self._update(x, y, 1.0)
        if len(self.samples) > self.window:
            self._update(*self.samples.popleft(), -1.0)
        self.since += 1

    def _update(self, x: list[float], y: float, sign: float) -> None:
        """The sums plus (sign 1) or minus (-1) one sample's."""
        for row, xi in zip(self.xtx, x):
            w = sign * xi
            for j, xj in enumerate(x):
                row[j] += w * xj
        for i, xi in enumerate(x):
            self.xty[i] += sign * xi * y

    def __call__(self, x: list[float]) -> float:
        if not self.samples:
            return 0.0
        if self.coef is None or self.since:
            self._solve()
        return self._predict(x)

    def _solve(self) -> None:
        a = np.array(self.xtx)
        ridge = 1e-6 * max(1.0, float(np.trace(a)) / len(self.samples))
        a.flat[:: len(a) + 1] += ridge
        self.coef, self.since = np.linalg.solve(a, self.xty).tolist(), 0

    def _predict(self, x: list[float]) -> float:
        # a handful of features, a dozen predictions an iteration: plain floats, not numpy calls
        return max(0.0, sum(c * v for c, v in zip(self.coef, x)))


@dataclass(frozen=True)
class Choice:
    """What the server drafts for its requests in one iteration."""

    depth: int  # levels of the server's expansion config (0: no tree, plain decoding)
    speculators: bool = True  # the SSMs draft (with context lookup merged in when on); False: lookup's chain first
    ahead: bool = False  # and while the verifier checks their trees, they draft the next ones (the engine's draft_ahead)

    @property
    def trees(self) -> "Choice":
        """The choice whose trees this one verifies (drafting ahead changes when they are drafted, not what)."""
        return replace(self, ahead=False) if self.ahead else self


PLAIN = Choice(0)


@dataclass
class Iteration:
    """What one steady iteration did and cost, for the controller."""

    batch_size: int
    choice: Choice  # what the server drafted for its requests this iteration
    rows: int  # tokens the verifier checked, tree nodes included
    trees: bool  # whether any request had a tree
    draft_levels: int  # deepest tree asked of the speculators (0: no draft call)
    draft_nodes: int  # nodes the slowest speculator drafted
    seconds: float  # the whole iteration
    verify_s: float  # the verifier's own step time
    draft_s: float  # the slowest speculator's own time
    # per request drafted for on the server's choice: (accepted draft tokens, depth of its plan), and
    # the nodes of its merged tree (0 and 0 where nothing was found to draft)
    accepted: list[tuple[int, int]] = field(default_factory=list)
    tree_nodes: list[int] = field(default_factory=list)
    asked: list[bool] = field(default_factory=list)  # and whether the SSMs drafted for it
    # and with context lookup on, its chain's (tokens the verified ones agree with, the chain's room),
    # None where lookup found none (lookup.chain_outcome)
    chains: list[tuple[int, int] | None] = field(default_factory=list)
    ahead: bool = False  # a plain step sent ahead of its answer: `seconds` is what it added behind the one before
    # drafting ahead: of the requests some drafter drafted ahead for, whether every drafter asked had drafted
    # their realised outcome (a hit); and whether the engine waited for a drafter's tree this step
    predrafts: list[bool] = field(default_factory=list)
    waited: bool = True
    draft_fed: int = 0  # record tokens a drafter caught up on before drafting (the most of any drafter)


@dataclass
class Acceptance:
    """Measured probability that a draft token is accepted at depth d given its parent was, for one
    kind of drafter, decayed by `forget` per recorded step and pulled towards `prior` (towards what
    `pooled` measures at d, where set: one request's figures pulled towards all requests')."""

    prior: float
    prior_weight: float
    forget: float
    reached: dict[int, float] = field(default_factory=dict)  # depth d -> steps whose path could accept at d (decayed)
    hit: dict[int, float] = field(default_factory=dict)  # depth d -> of those, steps that did
    pooled: "Acceptance | None" = None

    def at(self, d: int) -> float:
        prior = self.prior if self.pooled is None else self.pooled.at(d)
        return (self.hit.get(d, 0.0) + prior * self.prior_weight) / (self.reached.get(d, 0.0) + self.prior_weight)

    def reach(self, m: int) -> float:
        """The chance that a path of this drafter is accepted at least m deep."""
        p = 1.0
        for d in range(1, m + 1):
            p *= self.at(d)
        return p

    def expected_tokens(self, m: int) -> float:
        """Tokens a request emits per step with drafts of depth m: the bonus token plus the expected
        accepted path length."""
        total, p = 1.0, 1.0
        for d in range(1, m + 1):
            p *= self.at(d)
            total += p
        return total

    def record(self, accepted: list[tuple[int, int]]) -> None:
        for table in (self.reached, self.hit):
            for d in table:
                table[d] *= self.forget
        for a, depth in accepted:
            for d in range(1, min(a + 1, depth) + 1):
                self.reached[d] = self.reached.get(d, 0.0) + 1
                self.hit[d] = self.hit.get(d, 0.0) + (a >= d)


@dataclass
class Share:
    """A measured share of outcomes that were true, decayed by `forget` per recorded step and pulled
    towards `prior`."""

    prior: float
    prior_weight: float
    forget: float
    true: float = 0.0
    seen: float = 0.0

    def __call__(self) -> float:
        return (self.true + self.prior * self.prior_weight) / (self.seen + self.prior_weight)

    def record(self, outcomes: list[bool]) -> None:
        self.true = self.true * self.forget + sum(outcomes)
        self.seen = self.seen * self.forget + len(outcomes)


REWEIGH = 8  # iterations a batch size keeps the model's choice before weighing the choices' rates again
SETTLING = 32  # ... once it has run this many: before, its fits are young and every iteration weighs


@dataclass
class Looks:
    """A batch size's schedule of looks at a neighbouring choice."""

    iterations: int = 0  # iterations planned at this batch size
    best: Choice | None = None  # the choice the model made last
    weighed: int = -REWEIGH  # the iteration it was made at (the choices' rates weighed)
    trees: list[int] | None = None  # the full trees it was made for
    chained: bool = False  # and whether plain steps would be sent ahead then
    gap: int = 0  # iterations between looks now
    next_look: int = 0  # the iteration of the next look
    count: int = 0  # looks so far (taking the neighbours in turn)
    run: int = 0  # iterations left of a look at drafting ahead (AHEAD_LOOK)
    looking: Choice | None = None  # and the choice it looks at


PLAIN_SETTLED = 4  # a plain step's rest, and plain steps sent ahead, have their own fits from this many samples
WARMUP = 2  # a choice's first iterations pay one-time costs (kernels loaded or compiled for its paths and
# shapes, buffers grown): their costs are left out of the fits (see SpeculationController.record)
FEATURE_LEAD = 8  # plain iterations before a look at a tree that bring the LLM's features for a feature drafter
MIN_REACH = 0.1  # a drafter drafts a level for a request while its own path reaches that deep this often
PROBE = 8  # a drafter cut off from a request drafts one level for it every PROBE steps
AHEAD_LOOK = 3  # iterations of a look at drafting ahead: its first cannot hit (nothing was drafted ahead for it)
AHEAD_SETTLED = 10  # steps drafting ahead behind another before their fit prices it (twice its features)


class SpeculationController:
    def __init__(self, explore: int = 16, window: int = 256, prior: float = 0.5, prior_weight: float = 2.0,
                 forget: float = 0.99, explore_max: int = 64, margin: float = 0.1, lookup: bool = False,
                 chain: int = 0, trees: bool = True, ahead: bool = False):
        if not (trees or lookup):
            raise ValueError("a controller needs something to choose: drafters' trees or context lookup's chain")
        self.explore, self.explore_max = explore, explore_max
        self.margin = margin  # drafting must be predicted this much faster than plain decoding
        self.lookup = lookup  # lookup's chain first is a choice
        self.trees = trees  # drafters draft trees (False: no drafter, lookup's chain or none are the choices)
        self.chain = chain  # lookup's longest chain (0: as deep as the trees)
        self.ahead = ahead and trees  # the drafters may draft ahead: each tree choice has a twin that does
        self.verify, self.draft, self.overhead = Fit(window), Fit(window), Fit(window)
        self.plain_rest, self.plain_ahead = Fit(window), Fit(window)  # a plain step's rest; one sent ahead, whole
        self.held_ahead = Fit(window)  # a step drafting ahead behind another that did, whole
        self.predraft = Share(0.0, prior_weight, forget)  # of the requests drafted ahead for, the share hit
        self.last: Choice | None = None  # the choice of the step recorded last
        self.chained: dict[int, bool] = {}  # batch size -> whether its plain steps would be sent ahead (last told)
        # the SSMs' trees (True) and lookup's chains (False), measured apart
        self.acceptance = {k: Acceptance(prior, prior_weight, forget) for k in (True, False)}
        self.nodes: dict[Choice, float] = {}  # choice -> mean merged tree nodes per request
        # of the requests drafted for, the share whose lookup found nothing (on its choice the SSMs draft those)
        self.fallback = Share(prior, prior_weight, forget)
        self.looks: dict[int, Looks] = {}  # batch size -> its schedule of looks at a neighbour
        self.seen: dict[Choice, int] = {}  # choice -> iterations run at it (its first WARMUP warm-up)
        # each drafter's own tree (drafter number -> how deep the LLM accepted the drafter's tree alone),
        # over all requests; a request's own figures (`own`) are pulled towards these
        self.prior, self.forget = prior, forget
        self.by_drafter: dict[int, Acceptance] = {}
        self.made: dict[int, dict[Choice, int]] = {}  # batch size -> choice -> iterations it was chosen
        # batch size -> choice -> its recorded steps' [count, tokens, seconds, verifier s, drafting s]
        self.ran: dict[int, dict[Choice, list[float]]] = {}
        self.full_trees: dict[int, list[int]] = {}  # batch size -> the full trees it last allowed

    def pooled(self, drafter: int) -> Acceptance:
        return self.by_drafter.setdefault(drafter, Acceptance(self.prior, 2.0, self.forget))

    def own(self, drafter: int) -> Acceptance:
        """A new request's figures for a drafter, worth 4 of its steps of the drafter's pooled ones."""
        return Acceptance(self.prior, 4.0, self.forget, pooled=self.pooled(drafter))

    @staticmethod
    def drafter_levels(own: Acceptance, planned: int, step: int) -> int:
        """How many of the `planned` levels a drafter drafts for a request at its step `step`: as
        deep as the request's own figures give the drafter's path at least MIN_REACH to be accepted
        that far. Each level costs verified rows whatever the other drafters do, so a drafter that
        rarely agrees with the LLM on this request's text stops costing them; cut off, it still drafts
        one level every PROBE steps, so a request whose text changes can win it back."""
        m = 0
        while m < planned and own.reach(m + 1) >= MIN_REACH:
            m += 1
        return m or (min(planned, 1) if step % PROBE == 0 else 0)

    def record_drafters(self, outcomes: dict[int, list[tuple[int, int]]]) -> None:
        """One step's (accepted depth, tree depth) of each drafter's own tree, per request it drafted for."""
        for drafter, accepted in outcomes.items():
            if accepted:
                self.pooled(drafter).record(accepted)

    def choices(self, top: int) -> list[Choice]:
        """In order: none, lookup's chain first (every level), the SSMs' trees of depth 1..top (with
        drafters), and (drafting ahead on) the same trees drafted ahead."""
        if top == 0:
            return [PLAIN]
        trees = [Choice(m) for m in range(1, top + 1)] if self.trees else []
        return [PLAIN] + ([Choice(top, False)] if self.lookup else []) + trees + \
            ([replace(c, ahead=True) for c in trees] if self.ahead else [])

    def tree_nodes(self, choice: Choice, full_tree: int) -> float:
        if not choice.depth:
            return 0.0
        return self.nodes.get(choice.trees, float(full_tree if choice.speculators else choice.depth))

    def rate(self, batch_size: int, choice: Choice, full_tree: int, chained: bool = False) -> float:
        """Predicted tokens per second of the batch (full_tree: nodes of one speculator's tree of the
        choice's depth; chained: its plain steps would be sent ahead)."""
        tokens, *seconds = self.terms(batch_size, choice, full_tree, chained)
        return batch_size * tokens / max(sum(seconds), 1e-9)

    def terms(self, batch_size: int, choice: Choice, full_tree: int,
              chained: bool = False) -> tuple[float, float, float, float]:
        """The model's terms for a choice: tokens a request emits per step, and the seconds of a step's
        verifier step, drafting (times the chance the SSMs are asked at all) and the rest (for plain
        steps sent ahead, what a step takes beyond its verifier step)."""
        m = choice.depth
        share = (1.0 if choice.speculators else self.fallback()) if m else 0.0  # of the requests, drafted by the SSMs
        asked = 1.0 - (1.0 - share) ** batch_size if self.trees else 0.0  # the chance that the SSMs are asked at all
        nodes = self.tree_nodes(choice, full_tree)
        rows = batch_size * (1 + nodes)
        verify = self.verify([1.0, batch_size, rows, float(m > 0)])
        if choice.ahead and (len(self.held_ahead.samples) < AHEAD_SETTLED
                             or all(x[3] for x, _ in self.held_ahead.samples)):  # not measured yet: as its twin
            return self.terms(batch_size, choice.trees, full_tree, chained)
        # held, a drafter catches up on what each request it drafts for emitted the step before
        fed = batch_size * share * self.acceptance[True].expected_tokens(m) if m else 0.0
        if choice.ahead:  # the engine waits for the drafters unless every request's tree was drafted ahead
            miss = 1.0 - self.predraft() ** batch_size
            whole = self.held_ahead([1.0, batch_size, rows, miss, miss * m])
            draft = miss * self.draft([1.0, m, batch_size * full_tree, fed])
            return self.expected_tokens(choice, share), verify, draft, whole - verify - draft
        if m:
            draft = asked * self.draft([1.0, m, batch_size * share * full_tree, fed]) if asked else 0.0
            return self.expected_tokens(choice, share), verify, draft, self.overhead([1.0, batch_size, asked])
        if chained and len(self.plain_ahead.samples) >= PLAIN_SETTLED:
            return 1.0, verify, 0.0, self.plain_ahead([1.0, batch_size]) - verify  # (below 0 where the fits differ)
        if len(self.plain_rest.samples) >= PLAIN_SETTLED:
            rest = self.plain_rest([1.0, batch_size])
        else:  # no plain steps seen yet (or too few): the tree steps' rest without drafting stands in
            rest = self.overhead([1.0, batch_size, 0.0])
        return 1.0, verify, 0.0, max(rest - verify, 0.0) if chained else rest

    def expected_tokens(self, choice: Choice, share: float) -> float:
        """Tokens a request emits per step on this choice (share: of lookup's, the requests the SSMs draft
        for; without drafters, those it finds nothing for get no draft: their own token)."""
        ssm = self.acceptance[True].expected_tokens(choice.depth) if self.trees else 1.0
        if choice.speculators:
            return ssm
        return (1.0 - share) * self.acceptance[False].expected_tokens(self.chain or choice.depth) + share * ssm

    def choose(self, batch_size: int, full_trees: list[int], chained: bool = False) -> Choice:
        """What the server drafts this iteration; full_trees[m-1] is the node count of one
        speculator's tree of depth m, for every depth the tree budget allows at this batch size;
        chained: the engine would send this batch's plain steps ahead of their answers."""
        self.chained[batch_size] = chained
        choice = self._choose(batch_size, full_trees)
        made = self.made.setdefault(batch_size, {})
        made[choice] = made.get(choice, 0) + 1
        self.full_trees[batch_size] = full_trees
        return choice

    def _choose(self, batch_size: int, full_trees: list[int]) -> Choice:
        options = self.choices(len(full_trees))
        if len(options) == 1:  # no tree fits the budget at this batch size: nothing to weigh
            return PLAIN
        for c in options:  # measure every choice a couple of times first, after its warm-up
            if self.seen.get(c, 0) < WARMUP + 2:
                return c
        look = self.looks.setdefault(batch_size, Looks())
        look.iterations += 1
        if look.run and look.looking in options:  # a look at drafting ahead goes on
            look.run -= 1
            return look.looking
        look.run = 0
        chained = self.chained[batch_size]
        if (look.iterations > SETTLING and look.iterations - look.weighed < REWEIGH and look.trees == full_trees
                and look.chained == chained):
            best = options.index(look.best)  # the rates move little from one iteration to the next
        else:
            rates = [self.rate(batch_size, c, full_trees[c.depth - 1] if c.depth else 0, chained) for c in options]
            best = max(range(len(options)), key=rates.__getitem__)
            if rates[best] < (1 + self.margin) * rates[0]:  # a near tie: costs the model does not see decide it
                best = 0
            # a choice that moved is weighed again at the next iteration, so that one odd step (a stall)
            # moves it for one iteration, as when every iteration was weighed, not for REWEIGH
            moved = look.best is not None and look.best != options[best]
            look.weighed, look.trees, look.chained = look.iterations - (REWEIGH if moved else 0), full_trees, chained
        if look.best != options[best]:  # the choice moved: look around often again
            look.best, look.gap, look.next_look = options[best], self.explore, look.iterations + self.explore
        elif look.iterations >= look.next_look:  # a neighbour, each in turn
            look.gap = min(2 * look.gap, self.explore_max)
            look.next_look = look.iterations + look.gap
            look.count += 1
            near = self.neighbours(options, best)
            c = near[(look.count - 1) % len(near)]
            if c.ahead:
                look.run, look.looking = AHEAD_LOOK - 1, c
            return c
        return options[best]

    def drafts_soon(self, batch_size: int) -> bool:
        """Whether a tree may be drafted at this batch size within FEATURE_LEAD iterations: its choice drafts,
        it is still measuring its choices, or its next look comes that soon. A feature drafter (a head) drafts
        from the LLM's features of the tokens before, and where a step brought none it feeds zeros: at a look
        after a stretch of plain steps it then drafted worse than it would held, and the controller, having
        measured its trees at looks, kept decoding plainly (bench/results/services_general_head_features_cpu.md).
        Plain steps pay for the features only before a look."""
        look = self.looks.get(batch_size)
        return (look is None or look.best is None or look.best.depth > 0
                or look.next_look - look.iterations <= FEATURE_LEAD)

    def summary(self) -> dict:
        """Per batch size: how often each choice was made, each choice's predicted tokens per second of
        the batch now, and what each choice run there gave over all its recorded steps (tokens per
        second of their own time; a request on an expansion of its own or a prediction counts one
        token), for a log line: why a load ran with the trees it did. Beside them, the terms of each:
        tokens a request got per step, and ms a step of the verifier, the drafting and the rest,
        predicted and as they came, so that a wrong choice shows which term misled it (for plain steps
        sent ahead, the rest is what a step took beyond its verifier step: below 0 where the step ran
        behind the one before)."""
        def label(c: Choice) -> str:
            return "none" if not c.depth else f"{'trees' if c.speculators else 'lookup'} {c.depth}" + \
                (" ahead" if c.ahead else "")

        def predicted(b: int) -> dict[Choice, tuple[float, float, float, float]]:
            full, chained = self.full_trees[b], self.chained.get(b, False)
            return {c: self.terms(b, c, full[c.depth - 1] if c.depth else 0, chained) for c in self.choices(len(full))}

        def came(b: int, n: int, tokens: int, seconds: float, verify: float, draft: float) -> list[float]:
            per_step = (verify, draft, seconds - verify - draft)
            return [round(tokens / (n * b), 3), *(round(1e3 * t / n, 3) for t in per_step)]

        out = {}
        for b, made in sorted(self.made.items()):
            terms, ran = predicted(b), self.ran.get(b, {})
            out[str(b)] = {
                "chosen": {label(c): n for c, n in sorted(made.items(), key=lambda kv: -kv[1])},
                "predicted_tok_s": {label(c): round(b * t[0] / max(sum(t[1:]), 1e-9), 1) for c, t in terms.items()},
                "realized_tok_s": {label(c): round(r[1] / r[2], 1) for c, r in ran.items() if r[2] > 0},
                "predicted_terms": {label(c): [round(t[0], 3), *(round(1e3 * x, 3) for x in t[1:])]
                                    for c, t in terms.items()},
                "realized_terms": {label(c): came(b, *r) for c, r in ran.items()}}
        return out

    def neighbours(self, options: list[Choice], i: int) -> list[Choice]:
        """The choices a look from options[i] alternates between: the next shallower and the next
        deeper SSM tree (none counting as depth 0), lookup's chain first beside none and depth 1
        (and, from it, those two), and a tree's twin drafted ahead (from it: the same trees drafted after
        the verdict, and its shallower and deeper twins), so that from any choice every kind of draft is
        still looked at."""
        c = options[i]
        if c.ahead:
            twins = [o for o in options if o.ahead]
            j = twins.index(c)
            near = [c.trees] + twins[max(j - 1, 0) : j] + twins[j + 1 : j + 2]
            return near + [o for o in self.neighbours(options, options.index(c.trees)) if o not in near and o != c]
        ssm = [o for o in options if (o.speculators or not o.depth) and not o.ahead]  # none, depth 1..top
        lookup = [o for o in options if not o.speculators and o.depth]
        if c in lookup:
            return ssm[:2]
        j = ssm.index(c)
        near = ssm[max(j - 1, 0) : j] + ssm[j + 1 : j + 2]
        if c.depth <= 1:
            near += lookup
        if self.ahead and c.depth:
            near.append(replace(c, ahead=True))
        return near or [c]

    def record(self, step: Iteration) -> None:
        """The iteration's costs into the fits, its acceptance into the figures. A choice's first
        WARMUP iterations record their acceptance only: a path's first steps in a process may pay for
        loading or compiling its kernels (a Triton variant compiles in seconds) or growing buffers.
        Taken as a step's cost before the fits have `settled` enough samples to clip against, such a
        step enters whole, and the drafting fit, which hears only from steps that wait for drafting, then
        keeps it in its window for as long as it holds the choice on plain decoding. A step drafting ahead
        enters its own fit only, and only behind a step of the same choice (the first of a run cannot hit);
        the hits and misses of any step go to the hit share."""
        self.seen[step.choice] = self.seen.get(step.choice, 0) + 1
        held = step.choice.ahead and self.last == step.choice
        self.last = step.choice
        ran = self.ran.setdefault(step.batch_size, {}).setdefault(step.choice, [0, 0, 0.0, 0.0, 0.0])
        for i, v in enumerate((1, step.batch_size + sum(a for a, _ in step.accepted),  # each request's token and
                               step.seconds, step.verify_s, step.draft_s)):           # its accepted drafts
            ran[i] += v
        waited = step.draft_levels > 0 and step.waited  # the engine waited for a drafter's tree
        if held and self.seen[step.choice] > WARMUP:  # drafting ahead behind a step that did: what it took, whole
            self.held_ahead.add([1.0, step.batch_size, step.rows, float(waited), waited * step.choice.depth],
                                step.seconds)
        elif not step.choice.ahead and self.seen[step.choice] > WARMUP:
            self.verify.add([1.0, step.batch_size, step.rows, float(step.trees)], step.verify_s)
            if waited:
                self.draft.add([1.0, step.draft_levels, step.draft_nodes, step.draft_fed], step.draft_s)
            if step.trees:
                self.overhead.add([1.0, step.batch_size, float(waited)],
                                  max(0.0, step.seconds - step.verify_s - step.draft_s))
            elif step.ahead:  # a plain step sent ahead: what it took, its rest hidden behind the step before
                self.plain_ahead.add([1.0, step.batch_size], step.seconds)
            else:
                self.plain_rest.add([1.0, step.batch_size], max(0.0, step.seconds - step.verify_s - step.draft_s))
        if step.predrafts:
            self.predraft.record(step.predrafts)
        if not step.choice.depth or not step.accepted:
            return
        self.acceptance[True].record([a for a, asked in zip(step.accepted, step.asked) if asked]
                                     if not step.choice.speculators else step.accepted)
        if self.lookup:
            self.acceptance[False].record([c for c in step.chains if c is not None])
            self.fallback.record([c is None for c in step.chains])
        mean_nodes = sum(step.tree_nodes) / len(step.tree_nodes)
        old = self.nodes.get(step.choice.trees)
        self.nodes[step.choice.trees] = mean_nodes if old is None else 0.9 * old + 0.1 * mean_nodes
