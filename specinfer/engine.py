"""The speculative iteration, written once: the in-process Engine (generate.py) and the manager's
scheduler (manager_svc) both run `SpeculativeEngine.iteration`.

One iteration over a batch of running requests (`SpeculativeEngine.iteration`, each step a method of
its own: `_plan`, `_draft`, `_constrain`, `_verify`, `_commit_all`):
  1. plan each request's draft: its own expansion config if it fixed one, else the server's, cut to
     the tree budget shared by the batch, at the depth the cost-model controller (controller.py)
     picks for this batch size, down to context lookup's chain first or none; never past
     max_new_tokens (a step emits the accepted path plus one token of the LLM's own);
  2. draft: context lookup's chain from the request's own earlier text (lookup.py), of up to
     `lookup_tokens` tokens, or as deep as the planned tree (0); then every drafter at once (SSMs in
     this process, or speculator services), for every request, or with lookup's chain first only
     for those lookup found nothing for; a constrained request's grammar drafts the tokens it
     forces (grammar.py), and a request with a prediction the chain from it where the output
     follows it (prediction.py), whatever the controller chose, in place of the drafters' trees
     (lookup's chain still joins it); merge each request's trees into one, and drop what its
     grammar forbids;
  3. verify: one batched step; a new request's prompt rides in the same step as the others' trees;
     a constrained request's rows are masked to what its grammar allows there;
     with the controller, a request's prompt step itself is not drafted for (FIRST_TOKEN_FIRST);
  4. commit: append each request's accepted tokens up to EOS, a stop token or max_new_tokens.

A step sent ahead: where every request of a step decodes plainly and so will the next (speculation
off, or the controller chose plain decoding for the batch size; no grammar, no chunked prefill), the
next step needs nothing the answer brings: the verifier already holds the token this step emits. So,
with `steps_ahead` (the manager's, over its client of a verifier service), the engine sends the next
step before awaiting this one, and the verifier starts it the moment this one ends: the hop, the
manager's own work and the verifier's protobuf overlap the steps instead of standing between them
(vLLM's async scheduling does this within one process). The next iteration awaits that step and
sends the one after it; a request admitted meanwhile joins that one. A request that this step
finishes had one step too many computed for it, which is dropped. A request whose step ahead is
dropped unanswered (a failure, a preemption) is resent whole, as after a lost state.

Drafting during verification (`draft_ahead`, the manager's --draft-ahead): a drafter service idles while
the verifier checks its tree. Asked to draft ahead (Draft.ahead), it sends the tree, then drafts the next
trees for the likeliest outcomes of verifying it by its own probabilities, the tokens the step would emit
(an accepted path, then a bonus token) -> the tree after them (speculator.py), while the step runs. When the
verdict's tokens are such an outcome for every drafter a request asks, its next tree is there already: a
batch whose requests all hit leaves without waiting for the drafters, which are told the step and draft
ahead again meanwhile (their trees, the same, are not awaited). A miss waits for the drafters as before.
Any tree is exact under greedy decoding, so a hit changes only when the step leaves. In process the
drafters share the verifier's device: drafting ahead costs there and saves no wait. With a controller,
drafting ahead is one of its choices, priced by the hit rate and what the steps drafting ahead took
(controller.py): the drafters draft ahead only on the steps it chose so.

Steps that leave before the outcome (`outcome_steps`, the manager's --outcome-steps): where every request of
a step verifies a tree of the drafters, which draft ahead, the next step leaves as soon as their trees drafted
ahead are in, before this step's answer, with those trees as each request's candidates (Check.candidates):
for each outcome some drafter drafted ahead for, the trees drafted for it, merged. The verifier verifies the
candidate of the outcome its step before emitted (Verified.candidate), or skips a request none was drafted
for; the drafters are told the outcome as the answer comes, and draft ahead again while the step runs, so the
chain goes on while the batch holds. A skipped request, or one admitted, cancelled or preempted, ends the
chain: the next round drafts as before. So between two steps of a hit the verifier waits for no hop.

Drafters and the verifier are interfaces, so the same iteration drives local models and remote
services. Admission, streaming and metrics belong to whoever runs the engine. A drafter that fails
only costs its trees; a verifier that fails fails the step's requests (errors.py), except when it
lost their state: then their whole records are resent, at most `MAX_RESYNCS` times.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from .controller import Choice, Iteration, SpeculationController
from .errors import VerifierLost, VerifierUnavailable, check_token_ids
from .grammar import FORCED_TOKENS, Constraint, Grammars, GrammarSpec
from .logprobs import MAX_TOP
from .lookup import ContextIndex, chain_outcome, chain_tree
from .masks import AllowedTokens
from .prediction import PREDICTION_TOKENS, START_TOKENS, Prediction
from .sampling import SamplingParams
from .tree import TokenTree, accepted_nodes, depths, fit_expansion, merge, path_along, proposers, tree_size, within

# Why a request on the server's trees has none at its prompt's step, with the controller: its first token
# comes as soon as without speculation, as in vLLM and SGLang. Drafting there put the SSMs' prefill of the
# prompt and the tree's rows before the first token; undrafted, TTFT through the services is that of no
# speculation, at the same tok/s or more (bench/results/services_first_token_ab_cpu.md). A feature drafter
# still gets the prompt's features.
FIRST_TOKEN_FIRST = "the prompt's step: its first token comes first"
MAX_RESYNCS = 2  # times a request's record is resent to a verifier that lost it before it fails
PREFILL_CHUNK = 512  # the services' default chunk of a long record (the manager's, for the verifier; the speculators')
# the server's tree nodes per iteration unless set, by the kind of device the verifier runs on. On a CPU a
# step costs more with every row: the default 2,1,1 tree whole for 1-2 requests, none from 9 streams, where
# plain decoding wins (bench/results/services_defaults_cpu.md). On a GPU 8 requests with 16-node trees (136
# rows) cost 1.42x a step of 8 rows (bench/results/runtime_h200.md), while one stream's trees emitted 5.6
# tokens a step (bench/results/services_h200_7b_budget16_in_process.json): the whole tree up to 42 requests, two
# levels at 64; the controller picks the depth within.
TREE_BUDGETS = {"cpu": 16, "cuda": 256}


def steps_ahead_for(device: str, setting: str = "auto", name: str = "steps_ahead") -> bool:
    """Whether plain steps are sent ahead (module docstring), or the verifier begins a step behind the
    one running (`name` "overlap"): `setting` "on" or "off", or "auto": on for a verifier on a GPU,
    whose host waits while the GPU steps; off on a CPU, where the verifier's threads use every core and
    what the overlap moves beside a step slows the step as much (bench/results/fixtures/steps_ahead_cpu.md).
    ValueError, naming `name`, for another setting."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"{name}: must be auto, on or off, got {setting!r}")
    return setting == "on" or (setting == "auto" and device == "cuda")


def default_tree_budget(device: str, budget: int = 0) -> int:
    """The tree budget: `budget` as set, or where that is 0 the default for a verifier on `device`
    ("cuda", "cpu"; any other kind as a CPU)."""
    return budget or TREE_BUDGETS.get(device, TREE_BUDGETS["cpu"])


async def gather(*aws) -> list:
    """asyncio.gather, except that one awaitable is awaited in place rather than as a task of its
    own: it then runs before whatever the event loop already has ready (the manager's stream writes),
    not after it."""
    return [await aws[0]] if len(aws) == 1 else await asyncio.gather(*aws)


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    id: str = ""
    logprobs: bool = False  # each generated token's logprob (logprobs.py)
    prompt_logprobs: bool = False  # the prompt's tokens' (all but the first), with the first chunk
    top_logprobs: int = 0  # with each of them, the most likely tokens there
    grammar: GrammarSpec | None = None  # constrained output: what the generated text must match (grammar.py)
    priority: int = 0  # scheduling: lower values first (the manager's scheduler; vLLM's extension)
    prediction: tuple[int, ...] = ()  # what the output is expected to repeat, drafted where it does (prediction.py)


@dataclass
class Generation:
    id: str
    token_ids: list[int]  # generated tokens only
    finish_reason: str = ""  # "eos", "stop" or "length"
    steps: int = 0  # LLM forward passes, the first (the prompt's) included
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens at each step
    tree_steps: int = 0  # steps that verified a draft tree
    no_tree_reason: str = ""  # why most of the other steps had none
    logprobs: list | None = None  # of each token, if asked (logprobs.TokenLogprob)
    prompt_logprobs: list | None = None  # of the prompt's tokens but the first, if asked
    # each drafter's own (accepted, drafted) nodes over the request, numbered as Chunk.drafters
    drafters: dict[int, tuple[int, int]] = field(default_factory=dict)
    prediction: tuple[int, int] = (0, 0)  # of its prediction's tokens, those accepted and rejected (prediction.py)

    @property
    def tokens_per_step(self) -> float:
        return len(self.token_ids) / self.steps if self.steps else 0.0


def validate(req: Request, vocab_size: int, context: int, max_new_tokens_cap: int | None = None) -> None:
    """Raise ValueError naming the offending field."""
    if not req.prompt:
        raise ValueError("prompt: must not be empty")
    check_token_ids("prompt", req.prompt, vocab_size)
    check_token_ids("stop_token_ids", req.stop_token_ids, vocab_size)
    check_token_ids("logit_bias", [t for t, _ in req.sampling.logit_bias], vocab_size)
    check_token_ids("allowed_token_ids", req.sampling.allowed_token_ids, vocab_size)
    check_token_ids("prediction", req.prediction, vocab_size)
    if len(req.prediction) > context:
        raise ValueError(f"prediction: {len(req.prediction)} tokens, more than the context length {context}")
    if req.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens: must be > 0, got {req.max_new_tokens}")
    if max_new_tokens_cap is not None and req.max_new_tokens > max_new_tokens_cap:
        raise ValueError(f"max_new_tokens: {req.max_new_tokens} is over the server's cap {max_new_tokens_cap}")
    if req.sampling.min_tokens > req.max_new_tokens:
        raise ValueError(f"min_tokens: {req.sampling.min_tokens} is over max_new_tokens ({req.max_new_tokens})")
    if len(req.prompt) + req.max_new_tokens > context:
        raise ValueError(f"max_new_tokens: prompt ({len(req.prompt)}) + max_new_tokens "
                         f"({req.max_new_tokens}) exceeds the context length {context}")
    if not 0 <= req.top_logprobs <= MAX_TOP:
        raise ValueError(f"top_logprobs: from 0 to {MAX_TOP}, got {req.top_logprobs}")
    if req.top_logprobs and not (req.logprobs or req.prompt_logprobs):
        raise ValueError("top_logprobs: only with logprobs or prompt logprobs asked for")
    req.sampling.validate()


@dataclass(frozen=True)
class Record:
    """A request's record, its prompt and then its generated tokens, as those two lists themselves:
    never joined, since a step reads only a tail of it (joining every drafted request's whole record
    each iteration cost in proportion to the records' lengths)."""

    prompt: list[int]
    generated: list[int]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.generated)

    def tail(self, start: int) -> list[int]:
        """record[start:]"""
        return tail(self.prompt, self.generated, start)


def tail(prompt: list[int], generated: list[int], start: int) -> list[int]:
    """(prompt + generated)[start:], without joining them."""
    return prompt[start:] + generated[max(0, start - len(prompt)):]


@dataclass
class Draft:
    """What a drafter needs to draft for one request."""

    request_id: str
    record: Record  # prompt + committed tokens (a view of the request's lists); the last one is the tree's root
    expansion: list[int]
    sampling: SamplingParams
    features: list = field(default_factory=list)  # for feature drafters: the verifier's features of the
    # record's rows since they last drafted for the request, as it returned them (in order)
    ahead: int = 0  # then draft the next trees for this many of the likeliest outcomes of verifying this one


@dataclass
class Check:
    """What the verifier needs for one request's step."""

    request_id: str
    new_tokens: list[int]  # the record's tokens the verifier does not hold yet
    record_length: int  # the record's length with them
    tree: TokenTree
    sampling: SamplingParams
    features: bool = False  # return the features of the rows the step commits (a feature drafter drafts for it)
    logprobs: bool = False  # return the tokens' logprobs
    prompt_logprobs: bool = False  # return those of new_tokens[1:]
    top_logprobs: int = 0  # with this many alternatives each
    allowed: AllowedTokens | None = None  # constrained output: the tokens each row may take (the root's, the tree's)
    prefill_only: bool = False  # new_tokens are a chunk of a long record: the verifier keeps them, decides nothing
    # for the sampling's penalties and min_tokens (penalties.py): where the output begins in the record,
    # and the tokens that would end the request
    output_start: int = 0
    stop_ids: tuple[int, ...] = ()
    predrafted: bool = False  # its tree was drafted before the step it follows was decided (a pre-draft hit)
    # a step sent before the outcome of the request's step before it (its record_length: the record's length
    # before that outcome; no new_tokens, no tree): the trees drafted ahead for its outcomes, the verifier
    # verifies the outcome's (none: a plain step). None: an ordinary step
    candidates: list[tuple[tuple[int, ...], TokenTree]] | None = None


@dataclass
class Verified:
    """The verifier's answer for one request's step."""

    tokens: list[int]  # the accepted path's tokens and the bonus token
    # as the backend has them: in process `verifier.Features` and `logprobs.TokenLogprob`, through the
    # manager the verifier's protobuf, handed on untouched
    features: object | None = None  # the committed rows' features (Check.features)
    logprobs: list | None = None  # of each token (Check.logprobs)
    prompt_logprobs: list | None = None  # of new_tokens[1:] (Check.prompt_logprobs)
    cached_tokens: int = 0  # at a request's first step: of new_tokens, those the verifier's prefix cache held
    candidate: int = -1  # of a step with candidates: the index of the one whose tree was verified (-1: none)


class Drafter(Protocol):
    """Draft trees for many requests at once: an SSM in this process or a speculator service."""

    draft_ns: int  # the drafter's own time in its last draft (0: not known)
    wants_features: bool  # a feature drafter: its drafts carry the LLM's features (Draft.features)

    @property
    def connected(self) -> bool: ...

    async def draft(self, drafts: list[Draft]) -> dict[str, TokenTree]:
        """Trees by request id; a request without one gets none this step."""

    async def drafted_ahead(self) -> dict[str, dict[tuple[int, ...], TokenTree]]:
        """What its last draft drafted ahead (Draft.ahead), waited for: by request, the tokens a verdict would
        emit (an accepted path, then the bonus token) -> the next tree after them."""

    def release(self, request_id: str) -> None:
        """Forget the request (now, or with the next message)."""

    async def flush(self) -> None:
        """Deliver pending releases now."""


class VerifierBackend(Protocol):
    async def verify(self, checks: list[Check], release: list[str], follows: bool = False) -> tuple[list[Verified], int]:
        """Each request's answer and the step's own time in ns, after forgetting the `release`
        requests. Raises VerifierUnavailable or VerifierLost. `follows` (steps sent ahead only): the
        step needs the state the step sent just before it leaves; VerifierLost where that one's may be lost."""

    async def release(self, request_ids: list[str]) -> None: ...


@dataclass
class Chunk:
    """Tokens emitted in one step; the last chunk of a request has its finish reason."""

    tokens: list[int]
    finish_reason: str = ""
    accepted: int = 0  # draft tokens among them
    tree: TokenTree | None = None  # the merged tree the step verified (None: none)
    # for a request that asked for its trees: which drafters proposed each node (bit i: drafter i,
    # context lookup the bit after them, the grammar's forced tokens the next, the request's prediction the
    # next) and the nodes the verifier accepted
    proposers: list[int] = field(default_factory=list)
    accepted_nodes: list[int] = field(default_factory=list)
    # each drafter's own share of the tree, by the numbers of `proposers`' bits: (its nodes the LLM
    # accepted, its nodes), for every drafter that drafted
    drafters: dict[int, tuple[int, int]] = field(default_factory=dict)
    logprobs: list | None = None  # of each token, for a request that asked (logprobs.TokenLogprob)
    prompt_logprobs: list | None = None  # the prompt's (all but its first token), with the first chunk
    prediction: tuple[int, int] = (0, 0)  # of its prediction's tokens (prediction.py), the step's accepted and rejected


def add_tallies(a: dict, b: dict) -> dict:
    """Two tallies of (accepted, drafted) nodes by drafter (Chunk.drafters, summed over steps or runs) as one."""
    return {n: tuple(x + y for x, y in zip(a.get(n, (0, 0)), b.get(n, (0, 0)))) for n in dict.fromkeys([*a, *b])}


@dataclass(eq=False)
class Sequence:
    """A running request: its token record (prompt + committed tokens), the single source of truth."""

    request: Request
    expansion: list[int] | None  # None: the server's, within the tree budget; [] none; else fixed
    want_trees: bool = False  # each chunk names its tree's proposers and accepted nodes
    generated: list[int] = field(default_factory=list)
    finish_reason: str = ""
    done: bool = False  # finished, cancelled or failed: the engine skips it
    steps: int = 0  # verifier steps, the first (prefill) included
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted at each step
    tree_steps: int = 0  # steps that verified a draft tree
    no_tree: collections.Counter = field(default_factory=collections.Counter)  # why the other steps had none
    verifier_has: int = 0  # tokens of the record the verifier holds
    resyncs: int = 0
    context: ContextIndex = field(default_factory=ContextIndex)  # its record, indexed for context lookup
    features: list = field(default_factory=list)  # the verifier's features the feature drafters have not had yet
    constraint: Constraint | None = None  # the grammar's state after the committed tokens (request.grammar)
    by_drafter: dict = field(default_factory=dict)  # drafter number -> its own acceptance on this request (controller.py)
    cached_tokens: int = 0  # of its prompt, the tokens whose KV entries the verifier's prefix cache held
    preemptions: int = 0  # times its state was dropped everywhere to make room, and its record prefilled again
    prediction: Prediction | None = None  # where its output stands in request.prediction, if it has one
    last_tokens: tuple[int, ...] = ()  # what its last step emitted: the outcome its trees drafted ahead are keyed by
    drafter_has: dict = field(default_factory=dict)  # drafter number -> record tokens it had at its last draft for it

    def __post_init__(self):
        if self.request.prediction:
            self.prediction = Prediction(self.request.prediction)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def record(self) -> Record:
        return Record(self.request.prompt, self.generated)

    @property
    def length(self) -> int:
        """len(record)"""
        return len(self.request.prompt) + len(self.generated)

    def tokens_from(self, i: int) -> list[int]:
        """record[i:]"""
        return tail(self.request.prompt, self.generated, i)


@dataclass
class Stats:
    """Where the iterations' time went, by (batch size, levels verified: the deepest draft tree in
    the step, whoever drafted it, 0 for a plain step): e.g. whether the few tree steps of a load
    that mostly decodes plainly cost more than they win. (A step whose only drafts are context
    lookup's chains or the grammar's forced tokens asks the drafters nothing, yet verifies a tree.)"""

    shapes: dict = field(default_factory=dict)  # (batch size, levels verified) -> [iterations, wall time]
    verify_s: float = 0.0  # of the wall time, the verifier's step (its own figure)
    draft_s: float = 0.0  # of the wall time, the slowest drafter's tree building (its own figure)
    grammar_s: float = 0.0  # of the wall time, constrained requests' grammars: masks, pruning, forced drafts, states
    # of the wall time, what the engine spent awaiting the verifier's answer and the drafters' trees: their
    # own time above, and the hops to them and back (RPC, queues, threads); the rest is the engine's own work
    verify_wait_s: float = 0.0
    draft_wait_s: float = 0.0
    # drafting during verification, per request and step: a hit, its tree was drafted ahead for the outcome of
    # its last step (a step after the answer: by every drafter asked; one sent before the outcome: by some), or a
    # miss, some drafter drafted ahead for that step and not for its outcome; of the misses after the answer,
    # those some drafter drafted the outcome for (waiting for the others' trees; an outcome step takes them)
    predraft_hits: int = 0
    predraft_misses: int = 0
    predraft_partial: int = 0

    def add(self, batch_size: int, levels: int, busy_s: float, verify_s: float, draft_s: float,
            grammar_s: float = 0.0, verify_wait_s: float = 0.0, draft_wait_s: float = 0.0) -> None:
        shape = self.shapes.setdefault((batch_size, levels), [0, 0.0])
        shape[0] += 1
        shape[1] += busy_s
        self.verify_s += verify_s
        self.draft_s += draft_s
        self.grammar_s += grammar_s
        self.verify_wait_s += verify_wait_s
        self.draft_wait_s += draft_wait_s

    def counters(self) -> dict[str, float]:
        """The running totals (what the manager's /metrics exports): iterations, requests over them
        (batched) and seconds by part (all, verifier_step, verifier_wait, drafting, drafting_wait,
        grammar). The shapes are copied first: the manager's /metrics reads them from another thread."""
        shapes = list(self.shapes.items())
        return {"iterations": sum(k for _, (k, _) in shapes), "batched": sum(b * k for (b, _), (k, _) in shapes),
                "all": sum(t for _, (_, t) in shapes), "verifier_step": self.verify_s,
                "verifier_wait": self.verify_wait_s, "drafting": self.draft_s, "drafting_wait": self.draft_wait_s,
                "grammar": self.grammar_s, "predraft_hits": self.predraft_hits, "predraft_misses": self.predraft_misses}

    def summary(self) -> dict:
        return {**split(self.counters()),
                "by_batch_and_levels": {f"{b}x{m}": {"iterations": k, "ms": round(1e3 * t / k, 2)}
                                        for (b, m), (k, t) in sorted(self.shapes.items())}}


def split(counters: dict[str, float]) -> dict:
    """Per iteration, from `Stats.counters` (or the difference of two readings): the mean batch and
    the ms of the whole iteration and of each part. `overhead_ms` is what is neither the verifier's
    nor the slowest drafter's own time; `own_ms` what the engine did not spend awaiting them: its own
    work (a wait less the awaited one's own time is the hop to it and back, below zero where a step
    sent ahead ran while the engine did other work)."""
    n = max(counters["iterations"], 1)
    ms = {part: 1e3 * counters[part] / n for part in SPLIT_PARTS}
    return {"iterations": int(counters["iterations"]), "mean_batch": counters["batched"] / n,
            "ms_per_iteration": ms["all"], "verify_ms": ms["verifier_step"], "draft_ms": ms["drafting"],
            "grammar_ms": ms["grammar"], "overhead_ms": ms["all"] - ms["verifier_step"] - ms["drafting"],
            "verify_wait_ms": ms["verifier_wait"], "draft_wait_ms": ms["drafting_wait"],
            "own_ms": ms["all"] - ms["verifier_wait"] - ms["drafting_wait"]}


SPLIT_PARTS = ("all", "verifier_step", "verifier_wait", "drafting", "drafting_wait", "grammar")


@dataclass
class Ahead:
    """A plain step sent before the step it follows was answered."""

    call: asyncio.Future  # the verify call: (answers, step ns)
    seqs: list[Sequence]
    preemptions: list[int]  # each one's count when sent: a request preempted since gets no commit
    choice: Choice  # the controller's, for the batch size it was sent at
    rows: int
    steady: bool  # every request's previous step was in flight (no prefill rode along)
    release: list[str]  # the requests the step's message freed
    why: list[str]  # why each request has no tree this step (Sequence.no_tree)


def merged_trees(trees: dict[int, TokenTree]) -> TokenTree:
    """One request's trees by drafter as one: a single tree as it is, several merged."""
    return next(iter(trees.values())) if len(trees) == 1 else merge(list(trees.values()))


@dataclass
class Following:
    """A step sent before the outcome of the step before it (`outcome_steps`): each request's candidates,
    the trees drafted ahead for that step's likely outcomes, merged over the drafters."""

    call: asyncio.Future  # the verify call: (answers, step ns)
    seqs: list[Sequence]
    preemptions: list[int]  # each one's count when sent: a request preempted since gets no commit
    plans: list[list[int]]  # the expansion each was drafted on (its drafters are told the outcome on it)
    candidates: list[list[tuple[tuple[int, ...], TokenTree, dict[int, TokenTree]]]]  # (outcome, tree, by drafter)


@dataclass
class Round:
    """One iteration's work as it passes from step to step (`SpeculativeEngine.iteration`)."""

    start: float  # time.perf_counter() at the iteration's start
    batch: list[Sequence]  # the requests stepped (and drafted for), chunked prefills apart
    chunked: list[Sequence]  # records going in chunks, each alone, this step
    chunks: dict[str, int]  # request -> tokens of its chunk
    steady: bool  # every request's record was on the verifier at the start (a step the controller learns from)
    choice: Choice
    fits: int  # requests whose whole trees fit the tree budget
    predicted: dict[str, list[int]]  # request -> the chain it drafts from its prediction
    # drafted: each request's merged tree, the trees it merged by drafter number, the expansion it was
    # planned, lookup's chain and room; the deepest tree asked, the nodes asked, the requests asked, the wait
    trees: dict[str, TokenTree] = field(default_factory=dict)
    sources: dict[str, dict[int, TokenTree]] = field(default_factory=dict)
    plans: dict[str, list[int]] = field(default_factory=dict)
    chains: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    levels: int = 0
    nodes: int = 0
    fed: int = 0  # record tokens the drafter that caught up on most fed before drafting (controller's Iteration)
    asked: set[str] = field(default_factory=set)
    drafted: float = 0.0
    predrafted: set[str] = field(default_factory=set)  # requests whose drafters' trees were all drafted ahead
    tried: set[str] = field(default_factory=set)  # requests some drafter drafted ahead for (hit or missed)
    # constrained: each constrained request's allowed tokens per row and its forced tokens; the grammar's time
    allowed: dict[str, AllowedTokens] = field(default_factory=dict)
    forced: dict[str, tuple[int, ...]] = field(default_factory=dict)
    grammar_s: float = 0.0
    # verified: what was sent, the releases it carried, the wait for its answer, the slowest drafter's ns
    checks: list[Check] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    waited: float = 0.0
    draft_ns: int = 0


def append_tokens(out: list[int], req: Request, tokens: list[int], eos: set[int]) -> str:
    """Append a step's tokens to the request's generated tokens `out`, up to and including the
    first that finishes the request; return the finish reason ("eos", "stop", "length") or ""."""
    for t in tokens:
        out.append(t)
        if t in eos and not req.ignore_eos:
            return "eos"
        if t in req.stop_token_ids:
            return "stop"
        if len(out) >= req.max_new_tokens:
            return "length"
    return ""


class SpeculativeEngine:
    def __init__(self, verifier: VerifierBackend, drafters: list[Drafter], eos: set[int], expansion: list[int],
                 tree_budget: int | None = None, controller: SpeculationController | None = None,
                 lookup: bool = False, lookup_tokens: int = 0, grammars: Grammars | None = None,
                 prefill_chunk: int = 0, steps_ahead: bool = False, prediction_tokens: int = PREDICTION_TOKENS["cpu"],
                 draft_ahead: int = 0, outcome_steps: bool = False):
        if lookup_tokens < 0:
            raise ValueError(f"lookup_tokens: must be >= 0, got {lookup_tokens}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk: must be >= 0, got {prefill_chunk}")
        self.verifier = verifier
        self.drafters = drafters
        self.eos = eos
        self.expansion = expansion  # the server's expansion config
        self.tree_budget = tree_budget  # nodes per batch of the server's trees (None: not limited)
        self.controller = controller  # None: always the server's whole trees (within the budget)
        self.lookup = lookup  # context lookup joins the drafters' trees (proposer number len(drafters))
        self.lookup_tokens = lookup_tokens  # 0: as deep as the request's planned tree (what the controller models)
        self.grammars = grammars  # compiles requests' grammars (None: constrained requests are refused)
        # a record longer than this goes to the verifier in chunks of it, one a step, beside the other
        # requests' steps, so a long prompt does not stall them for its whole prefill (0: whole)
        self.prefill_chunk = prefill_chunk
        # plain steps are sent ahead (module docstring): the backend must send a step when its `verify`
        # call starts, before the call's first await, and answer steps in order (the manager's client does)
        self.steps_ahead = steps_ahead
        self.prediction_tokens = prediction_tokens  # the longest chain drafted from a request's prediction
        # drafting during verification: the drafters draft each tree's next trees for this many of the likeliest
        # outcomes of verifying it, and a step whose outcome they drafted for leaves without waiting for them
        self.draft_ahead = draft_ahead
        self.launched: list[asyncio.Future] = []  # drafter calls not waited for (Draft.ahead)
        self.verifier_release: set[str] = set()  # sent with the next verify call
        self.ahead: Ahead | None = None  # the step sent ahead, in flight
        # with drafting ahead, the next step leaves with the trees drafted ahead as candidates before the outcome
        # of this one is known, and the verifier takes the outcome's (module docstring)
        self.outcome_steps = outcome_steps and draft_ahead > 0
        self.following: Following | None = None  # such a step, in flight
        self.chosen: tuple[int, Choice] | None = None  # the controller's choice for the next step (batch size, choice)
        self.stats = Stats()

    def constraint(self, request: Request) -> Constraint | None:
        """The request's grammar state at the start of its output (None: unconstrained); ValueError
        naming the field when it does not compile. Called before the request takes any state."""
        if request.grammar is None:
            return None
        if self.grammars is None:
            raise ValueError(f"{request.grammar.field}: this engine has no tokenizer to compile grammars with")
        return self.grammars.compile(request.grammar)

    @property
    def wants_features(self) -> bool:
        """A feature drafter drafts: the verifier returns features for the requests it drafts for
        (asked each iteration: a speculator service says what it is when it connects)."""
        return any(d.wants_features for d in self.drafters)

    # -- what a request may cost ------------------------------------------------------------
    def max_tree(self, seq: Sequence) -> int:
        """The most nodes a merged draft tree of the request can have (merging unions the trees)."""
        expansion = seq.expansion if seq.expansion is not None else (
            fit_expansion(self.expansion, self.tree_budget) if self.tree_budget is not None else self.expansion)
        chain = (self.lookup_tokens or len(expansion)) if self.lookup and expansion else 0
        forced = FORCED_TOKENS if seq.request.grammar is not None and seq.expansion != [] else 0  # as iteration does
        predicted = min(self.prediction_tokens, len(seq.request.prediction)) if seq.expansion != [] else 0
        return tree_size(expansion) * len(self.drafters) + chain + forced + predicted

    # -- releasing state --------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """Free a finished request's state on the verifier (with the next step) and the drafters."""
        self.verifier_release.add(request_id)
        for d in self.drafters:
            d.release(request_id)

    def preempt(self, seq: Sequence) -> None:
        """Drop a running request's state on the verifier and the drafters (to make room for
        others); its record stays, and its next step prefills the whole record again."""
        self.release(seq.id)
        seq.verifier_has = 0
        seq.features = []
        seq.drafter_has = {}
        seq.preemptions += 1

    async def flush(self) -> None:
        """Deliver pending releases now (when no step is coming to carry them)."""
        if (ahead := self._drop_ahead()) is not None:  # answered before the releases: the verifier keeps
            await asyncio.wait([ahead.call])             # no state a step ahead made after them
        if (following := self.following) is not None:
            self._drop_following()
            await asyncio.wait([following.call])
        launched, self.launched = self.launched, []
        if launched:  # drafts not waited for go before the drafters' releases
            await asyncio.wait(launched)
        if self.verifier_release:
            ids = sorted(self.verifier_release)
            self.verifier_release.clear()
            try:
                await self.verifier.release(ids)
            except VerifierUnavailable:
                pass  # a verifier that is down holds nothing
        await gather(*(d.flush() for d in self.drafters))

    # -- the iteration ----------------------------------------------------------------------
    async def iteration(self, batch: list[Sequence]) -> list[tuple[Sequence, Chunk | Exception]]:
        """One step of every request in `batch`: each one's chunk, or the error it failed with.
        Requests marked done meanwhile (cancelled) are skipped. Its steps are plan, draft, constrain,
        verify, then what the step cost told the controller, the commit and the statistics."""
        start = time.perf_counter()
        if self.ahead is not None:
            return await self._answer_ahead(batch, start)
        if self.following is not None:
            return await self._answer_following(batch, start)
        r = self._plan(batch, start)
        await self._draft(r)
        if not self._drop_cancelled(r):
            return []
        self._constrain(r)
        try:
            verified, step_ns = await self._verify(r)
        except (VerifierLost, VerifierUnavailable) as e:
            return self._failed(r.batch + r.chunked, r.release, e)
        self._tell_controller(r, verified, step_ns)
        out = self._commit_all(r, verified)
        verified_levels = max((max(depths(c.tree.parents)) for c in r.checks if len(c.tree)), default=0)
        self.stats.add(len(r.batch), verified_levels, time.perf_counter() - start, step_ns / 1e9, r.draft_ns / 1e9,
                       r.grammar_s, r.waited, r.drafted)
        return out

    def _plan(self, batch: list[Sequence], start: float) -> Round:
        """Plan: the long records that go in chunks (each sent alone; drafted for and decided at their
        last chunk), the controller's choice for the others, and the requests that draft from their
        prediction."""
        steady = all(s.verifier_has == s.length for s in batch)
        chunks = {s.id: n for s in batch if (n := self._chunk(s))} if self.prefill_chunk else {}
        chunked = [s for s in batch if s.id in chunks] if chunks else []
        if chunks:
            batch = [s for s in batch if s.id not in chunks]
        full_trees = self._full_trees(len(batch))
        # (a step with a prompt's chunk, or a request drafting on an expansion of its own, is never sent ahead;
        # without steps ahead, _chains ends the test before any loop over the batch)
        chained = not chunks and self._chains(batch) and not any(s.expansion for s in batch)
        choice = self._choose(len(batch), full_trees, chained)
        return Round(start, batch, chunked, chunks, steady, choice, len(full_trees), self._predicted(batch))

    async def _draft(self, r: Round) -> None:
        """Draft: the drafters' trees merged with context lookup's chains (`_drafted_trees`), and each
        prediction's chain merged in."""
        r.trees, r.sources, r.plans, r.chains, (r.levels, r.nodes, r.fed, r.asked, r.drafted, r.predrafted, r.tried) = \
            await self._drafted_trees(r.batch, r.choice, r.fits, r.predicted)
        for s in r.batch:
            if chain := r.predicted.get(s.id):
                own = chain_tree(chain, s.request.sampling.sampled_drafts)
                r.trees[s.id] = merge([r.trees[s.id], own]) if s.id in r.trees else own
                r.sources.setdefault(s.id, {})[self.prediction_source] = own

    def _drop_cancelled(self, r: Round) -> bool:
        """The requests cancelled while drafting leave the round (their draft may have reached a drafter
        after the release: released there again); whether any request is left."""
        for s in r.batch:
            if s.done:
                for d in self.drafters:
                    d.release(s.id)
        r.batch = [s for s in r.batch if not s.done]
        r.chunked = [s for s in r.chunked if not s.done] if r.chunks else []
        return bool(r.batch or r.chunked)

    def _constrain(self, r: Round) -> None:
        """Constrain: each constrained request's allowed tokens per row and the nodes its grammar drafted.
        A forced token is the only one its state allows, so the masked LLM always accepts it: it is
        drafted whatever the controller chose (unless the request turned speculation off), one verified
        row a token."""
        start = time.perf_counter()
        for s in r.batch:
            if s.constraint is not None:
                tree, r.allowed[s.id], r.forced[s.id] = s.constraint.constrain(
                    r.trees.pop(s.id, TokenTree()), FORCED_TOKENS if s.expansion != [] else 0, self._room(s),
                    s.request.sampling.sampled_drafts)
                if len(tree):
                    r.trees[s.id] = tree
        r.grammar_s = time.perf_counter() - start

    async def _verify(self, r: Round) -> tuple[list[Verified], int]:
        """Verify: one step of the round's trees and prefill chunks (a plain step sends the next one
        ahead behind it: module docstring); the answers and the step's ns. Raises what the verifier
        failed with."""
        # features for the steps that speculate for the request (also where context lookup's chain
        # stood in for the drafters: the head's next draft needs these rows; a prefill that speculates
        # brings the prompt's), and for plain steps where a tree may come soon (`_features_soon`): a feature
        # drafter feeds zeros for the rows of the others (it drafts worse there, never wrongly); a step
        # that drafts from the request's prediction asks none, unless it is the prefill (the prompt's)
        features, soon = self.wants_features, not r.choice.depth and self._features_soon(len(r.batch))
        r.checks = [self._check(s, r.trees.get(s.id, TokenTree()),
                                features and (s.id in r.plans or soon and s.expansion is None)
                                and (s.id not in r.predicted or not s.steps),
                                r.allowed.get(s.id), predrafted=s.id in r.predrafted)
                    for s in r.batch]
        r.checks += [Check(s.id, s.tokens_from(s.verifier_has)[: r.chunks[s.id]], s.verifier_has + r.chunks[s.id],
                           TokenTree(), s.request.sampling, prefill_only=True) for s in r.chunked]
        r.release = self._releasing()
        call = self.verifier.verify(r.checks, r.release)
        if self.steps_ahead and not r.trees and not r.chunked and not r.allowed:
            call = asyncio.ensure_future(call)  # sent first: the step ahead follows it
            self.ahead = self._send_ahead(r.batch, {s.id for s in r.batch})
        elif self._may_follow(r.batch, all(s.id in r.trees for s in r.batch) and not r.chunked and not r.allowed
                              and not r.predicted and (self.controller is None or r.choice.ahead
                                                       or all(s.expansion is not None for s in r.batch))):
            call = asyncio.ensure_future(call)
            self.following = await self._follow(r.batch, [r.plans[s.id] for s in r.batch])
        waited = time.perf_counter()
        verified, step_ns = await call
        r.waited = time.perf_counter() - waited
        for s, v in zip(r.chunked, verified[len(r.batch):]):
            s.verifier_has += r.chunks[s.id]
            if not s.steps:
                s.cached_tokens += v.cached_tokens
        # the slowest drafter's own time this iteration (0: none was asked)
        r.draft_ns = max((d.draft_ns for d in self.drafters if d.connected), default=0) if r.levels else 0
        return verified, step_ns

    def _tell_controller(self, r: Round, verified: list[Verified], step_ns: int) -> None:
        """What the round's choice cost and gave, for the controller (steady rounds only: no prefill rode
        along). A prediction's chain lengthens the accepted path past what the server's trees planned:
        such requests are left out."""
        if self.controller is None or not r.steady:
            return
        on_server = [(s, v.tokens) for s, v in zip(r.batch, verified)
                     if s.expansion is None and s.id in r.plans and s.id not in r.predicted]
        self.controller.record(Iteration(
            batch_size=len(r.batch), choice=r.choice, rows=sum(len(c.new_tokens) + len(c.tree) for c in r.checks),
            trees=bool(r.trees), draft_levels=r.levels, draft_nodes=r.nodes, draft_fed=r.fed,
            seconds=time.perf_counter() - r.start, verify_s=step_ns / 1e9, draft_s=r.draft_ns / 1e9,
            accepted=[(len(t) - 1 if s.id in r.trees else 0, len(r.plans[s.id])) for s, t in on_server],
            tree_nodes=[len(r.trees.get(s.id, ())) for s, _ in on_server],
            asked=[s.id in r.asked for s, _ in on_server],
            chains=[chain_outcome(*r.chains[s.id], t) if s.id in r.chains else None for s, t in on_server],
            predrafts=[s.id in r.predrafted for s, _ in on_server if s.id in r.tried], waited=r.drafted > 0))

    def _commit_all(self, r: Round, verified: list[Verified]) -> list[tuple[Sequence, Chunk]]:
        """Commit: each request's accepted tokens (its features kept for its next draft), and each
        drafter's own outcome per request for the controller."""
        out, outcomes = [], {}  # drafter number -> (accepted depth, tree depth) of its tree alone, per request
        for s, v in zip(r.batch, verified):
            if v.features is not None:
                s.features.append(v.features)
            if s.done:  # cancelled while the step ran
                continue
            out.append((s, self._commit(s, v, r.trees.get(s.id), r.sources.get(s.id, {}), r.forced.get(s.id, ()),
                                        outcomes)))
        if self.controller is not None:
            self.controller.record_drafters(outcomes)
        return out

    async def _answer_ahead(self, batch: list[Sequence], start: float) -> list[tuple[Sequence, Chunk | Exception]]:
        """An iteration whose step was sent ahead: send the next one ahead if it may be (the batch's
        requests, those admitted since included), then commit this one's answers."""
        ahead, self.ahead = self.ahead, None
        in_flight = {s.id for s, n in zip(ahead.seqs, ahead.preemptions) if not s.done and s.preemptions == n}
        self.ahead = self._send_ahead([s for s in batch if not s.done], in_flight)
        waited = time.perf_counter()
        try:
            verified, step_ns = await ahead.call
        except (VerifierLost, VerifierUnavailable) as e:
            return self._failed([s for s in ahead.seqs if s.id in in_flight], ahead.release, e)
        waited = time.perf_counter() - waited
        out, outcomes = [], {}
        for s, n, v, why in zip(ahead.seqs, ahead.preemptions, verified, ahead.why):
            if not s.done and s.preemptions == n:  # else cancelled, or preempted and to be resent whole
                if v.features is not None:
                    s.features.append(v.features)
                s.no_tree[why] += 1
                out.append((s, self._commit(s, v, None, {}, (), outcomes)))
        if self.controller is not None and ahead.steady:
            self.controller.record(Iteration(
                batch_size=len(ahead.seqs), choice=ahead.choice, rows=ahead.rows, trees=False, draft_levels=0,
                draft_nodes=0, seconds=time.perf_counter() - start, verify_s=step_ns / 1e9, draft_s=0.0, ahead=True))
        self.stats.add(len(ahead.seqs), 0, time.perf_counter() - start, step_ns / 1e9, 0.0, verify_wait_s=waited)
        return out

    def _may_follow(self, seqs: list[Sequence], trees: bool) -> bool:
        """Whether the next step of these requests may leave before this one's outcome (`outcome_steps`):
        a step where every request verifies a tree of the drafters alone (no grammar, prediction or prompt
        chunk, whose next steps need the answer). A head's trees drafted ahead read its own outputs for the
        features not known yet; each step still brings the LLM's features of its rows for its next draft."""
        return (self.outcome_steps and trees
                and not any(s.constraint is not None or s.prediction is not None for s in seqs))

    async def _follow(self, seqs: list[Sequence], plans: list[list[int]]) -> Following:
        """Once the drafters' trees drafted ahead for the step in flight are in (through the services, during
        that step), the next step with them as candidates: for each outcome some drafter drafted ahead for, the
        trees drafted for it merged (a drafter that missed it only costs its tree: without a candidate the
        verifier would skip the request, and its step would wait for every drafter)."""
        drafted, candidates, checks = await self._drafted_ahead(), [], []
        for s, plan in zip(seqs, plans):
            ahead = [drafted[i].get(s.id, {}) for i in range(len(self.drafters))]
            options = []
            for key in sorted(set().union(*ahead)):  # an outcome some drafter drafted for: the trees drafted for it
                trees = {i: within(a[key], len(plan)) for i, a in enumerate(ahead) if key in a}
                options.append((key, merged_trees(trees), trees))
            candidates.append(options)
            checks.append(Check(s.id, [], s.length, TokenTree(), s.request.sampling, self.wants_features,
                                output_start=len(s.request.prompt), stop_ids=self._stop_ids(s.request),
                                candidates=[(k, t) for k, t, _ in options]))
        sent = asyncio.ensure_future(self.verifier.verify(checks, [], follows=True))
        sent.add_done_callback(lambda c: c.cancelled() or c.exception())  # a dropped one's error is no news
        return Following(sent, list(seqs), [s.preemptions for s in seqs], plans, candidates)

    async def _answer_following(self, batch: list[Sequence], start: float) -> list[tuple[Sequence, Chunk | Exception]]:
        """An iteration whose step left before the outcome of the one before: the drafters are told that
        outcome (their trees drafted ahead for it are this step's, and they draft ahead again meanwhile), the
        next step follows this one if it may (the same requests: one admitted meanwhile, or gone, ends the
        chain), then this one's answers are committed with the tree each request's outcome took (a request
        none was drafted for was skipped: nothing to commit, it goes again with a tree)."""
        f, self.following = self.following, None
        live = [s for s, n in zip(f.seqs, f.preemptions) if not s.done and s.preemptions == n]
        plans = {s.id: p for s, p in zip(f.seqs, f.plans)}
        # the outcome of the step before is known: a request it was drafted for takes that tree now, the others
        # are skipped by the verifier and go again with a tree (the chain ends)
        hit = {s.id for s, options in zip(f.seqs, f.candidates) if s.last_tokens in {k for k, _, _ in options}}
        drafts = [Draft(s.id, s.record, plans[s.id], s.request.sampling, s.features, self.draft_ahead)
                  for s in live if s.id in hit]
        self.launched += [asyncio.ensure_future(d.draft(drafts)) for d in self.drafters if drafts]
        for s in live:  # the feature drafters have had these (a drafter that fails loses them)
            if s.id in hit:
                s.features = []
        same = {s.id for s in batch if not s.done} == {s.id for s in live} == hit & {s.id for s in live}
        if live and same and self._may_follow(live, True):
            self.following = await self._follow(live, [plans[s.id] for s in live])
        waited = time.perf_counter()
        try:
            verified, step_ns = await f.call
        except (VerifierLost, VerifierUnavailable) as e:
            return self._failed(live, [], e)
        waited = time.perf_counter() - waited
        out, outcomes = [], {}
        for s, n, options, v in zip(f.seqs, f.preemptions, f.candidates, verified):
            if s.done or s.preemptions != n:  # cancelled, or preempted and to be resent whole
                continue
            if v.candidate < 0:  # skipped: nothing ran for it
                self.stats.predraft_misses += 1
                continue
            _, tree, sources = options[v.candidate]
            if v.features is not None:
                s.features.append(v.features)
            self.stats.predraft_hits += 1
            out.append((s, self._commit(s, v, tree, sources, (), outcomes)))
        if self.controller is not None:
            self.controller.record_drafters(outcomes)
        self.stats.add(len(f.seqs), max((len(p) for p in f.plans), default=0), time.perf_counter() - start,
                       step_ns / 1e9, 0.0, verify_wait_s=waited)
        return out

    def _drop_following(self) -> None:
        """Forget the step that left before an outcome without its answer: its requests are resent whole."""
        f, self.following = self.following, None
        self._resend_whole(f.seqs if f is not None else ())

    def _resend_whole(self, seqs: list[Sequence]) -> None:
        """What the verifier holds of these requests is not known (a step of theirs was dropped unanswered):
        release it, and send each live one's whole record next step."""
        for s in seqs:
            if not s.done:
                s.verifier_has = 0
                self.verifier_release.add(s.id)

    def _send_ahead(self, seqs: list[Sequence], in_flight: set[str]) -> Ahead | None:
        """Send the requests' next step now if it is plain for every one of them and needs nothing the
        steps in flight answer (`in_flight`: the requests with a plain step in flight, whose verifier
        then holds one token more than their record); None where it is not sent."""
        if not seqs or not self._chains(seqs, in_flight):
            return None
        fits = len(full_trees := self._full_trees(len(seqs)))
        choice = self._choose(len(seqs), full_trees, True)
        plans = {s.id: self._planned(s, choice) for s in seqs}
        if (self.drafters or self.lookup) and any(plans.values()):
            self.chosen = (len(seqs), choice)  # the next iteration drafts on it
            return None
        # a request whose step in flight is its last is left out (it would emit past max_new_tokens)
        sent = [s for s in seqs if s.id not in in_flight or len(s.generated) + 1 < s.request.max_new_tokens]
        if not sent:
            self.chosen = (len(seqs), choice)
            return None
        features = self._features_soon(len(seqs))  # the batch size the choice was made for
        checks = [self._check(s, features=features and s.expansion is None, ahead=s.id in in_flight) for s in sent]
        release = self._releasing()
        call = asyncio.ensure_future(self.verifier.verify(checks, release, follows=True))
        call.add_done_callback(lambda c: c.cancelled() or c.exception())  # a dropped one's error is no news
        return Ahead(call, sent, [s.preemptions for s in sent], choice, sum(len(c.new_tokens) for c in checks),
                     all(s.id in in_flight for s in sent), release,
                     ["no drafters configured" if plans[s.id] else self._why_no_plan(s, len(seqs), fits)
                      for s in sent])

    def _drop_ahead(self) -> Ahead | None:
        """Forget the step sent ahead without its answer: its requests are resent whole (what the
        verifier holds of them is not known) and the releases it carried are sent again."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        self._resend_whole(ahead.seqs)
        self.verifier_release.update(ahead.release)
        return ahead

    def _chains(self, seqs: list[Sequence], in_flight: set[str] = frozenset()) -> bool:
        """Whether these requests' plain steps would be sent ahead: steps ahead on, and none needs the
        answer before its next step (a grammar's state, a prediction's chain) or has a prompt left to
        prefill (`in_flight`: requests with a plain step in flight, whose record that step completes)."""
        return self.steps_ahead and not any(
            s.constraint is not None or (s.prediction is not None and s.expansion != [] and s.prediction.drafting)
            or (s.id not in in_flight and self._chunk(s)) for s in seqs)

    def _choose(self, batch_size: int, full_trees: list[int], chains: bool) -> Choice:
        """The server's choice for a step of `batch_size` requests: the one made for it when a step
        ahead was weighed and not sent, else the controller's now (without one: the whole trees);
        chains: the batch's plain steps would be sent ahead (the controller prices plain decoding so)."""
        chosen, self.chosen = self.chosen, None
        if chosen is not None and chosen[0] == batch_size:
            return chosen[1]
        if self.controller is None:
            return Choice(len(full_trees))
        return self.controller.choose(batch_size, full_trees, chains)

    def _features_soon(self, batch_size: int) -> bool:
        """Whether a plain step of this batch asks the LLM's features of its rows: a feature drafter drafts on
        the server's trees soon (SpeculationController.drafts_soon; without a controller, plain steps are the
        requests' own choice)."""
        return self.wants_features and self.controller is not None and self.controller.drafts_soon(batch_size)

    def _check(self, s: Sequence, tree: TokenTree | None = None, features: bool = False,
               allowed: AllowedTokens | None = None, ahead: bool = False, predrafted: bool = False) -> Check:
        """The request's step: the record's tokens the verifier lacks, or (`ahead`: its plain step in
        flight leaves the verifier one token past the record) none."""
        return Check(s.id, [] if ahead else s.tokens_from(s.verifier_has), s.length + ahead, tree or TokenTree(),
                     s.request.sampling,
                     features, s.request.logprobs, s.request.prompt_logprobs and not s.steps and not ahead,
                     s.request.top_logprobs, allowed, output_start=len(s.request.prompt),
                     stop_ids=self._stop_ids(s.request), predrafted=predrafted)

    def _releasing(self) -> list[str]:
        """The requests to free with the step sent now."""
        release = sorted(self.verifier_release)
        self.verifier_release.clear()
        return release

    def _commit(self, s: Sequence, v: Verified, tree: TokenTree | None, sources: dict[int, TokenTree],
                forced: list[int], outcomes: dict[int, list[tuple[int, int]]]) -> Chunk:
        tokens = v.tokens
        s.last_tokens = tuple(tokens)
        s.verifier_has = s.length + len(tokens)
        if not s.steps:
            s.cached_tokens += v.cached_tokens
        s.steps += 1
        s.tree_steps += tree is not None
        before = len(s.generated)
        s.finish_reason = append_tokens(s.generated, s.request, tokens, self.eos)
        emitted = s.generated[before:]
        predicted = (0, 0)
        if s.prediction is not None:  # what the verifier checked of its chain (not what a grammar pruned)
            own = sources.get(self.prediction_source)
            chain = own.tokens[:len(path_along(tree, own.tokens))] if own is not None and tree is not None else []
            predicted = s.prediction.commit(emitted, s.generated, chain, tokens)
        if s.constraint is not None:
            advance_start = time.perf_counter()
            s.constraint.advance(emitted)
            self.stats.grammar_s += time.perf_counter() - advance_start
        accepted = len(emitted) - (len(emitted) == len(tokens))  # the bonus token is not a draft
        s.accepted.append(accepted)
        chunk = Chunk(emitted, s.finish_reason, accepted, tree,
                      logprobs=v.logprobs[: len(emitted)] if s.request.logprobs else None,
                      prompt_logprobs=v.prompt_logprobs, prediction=predicted)
        if tree is None:
            return chunk
        for i, own in sources.items():  # how deep the LLM accepted each drafter's tree alone
            hit = len(path_along(own, tokens[:-1]))
            chunk.drafters[i] = (hit, len(own))
            if i < len(self.drafters):  # a speculator's: its own figures and the pooled ones
                outcome = (hit, max(depths(own.parents)))
                outcomes.setdefault(i, []).append(outcome)
                if i in s.by_drafter:
                    s.by_drafter[i].record([outcome])
        if forced:
            path = path_along(tree, tokens[:-1])
            chunk.drafters[self.grammar_source] = (len(set(path) & set(forced)), len(forced))
        if s.want_trees:
            chunk.proposers, chunk.accepted_nodes = proposers(tree, sources), accepted_nodes(tree, tokens)
            for u in forced:  # the grammar's drafts: the bit after context lookup's
                chunk.proposers[u] |= 1 << self.grammar_source
        return chunk

    # The drafter numbers of the engine's own drafters (Chunk.proposers' bits, Chunk.drafters' keys),
    # after the speculators': context lookup's, a grammar's forced tokens', a request's prediction's.
    @property
    def lookup_source(self) -> int:
        return len(self.drafters)

    @property
    def grammar_source(self) -> int:
        return len(self.drafters) + 1

    @property
    def prediction_source(self) -> int:
        return len(self.drafters) + 2

    def _predicted(self, batch: list[Sequence]) -> dict[str, list[int]]:
        """Each request's chain from its prediction this step, where it has one: drafted whatever the
        controller chose (the client said what to expect), unless the request turned speculation off;
        within the batch's share of the tree budget, so that a crowd's chains cost what its trees may."""
        longest = self.prediction_tokens if self.tree_budget is None else min(
            self.prediction_tokens, max(START_TOKENS, self.tree_budget // max(len(batch), 1)))
        return {s.id: chain for s in batch if s.prediction is not None and s.expansion != []
                and (chain := s.prediction.draft(min(longest, self._room(s))))}

    def _failed(self, batch: list[Sequence], release: list[str], error: VerifierLost | VerifierUnavailable
                ) -> list[tuple[Sequence, Chunk | Exception]]:
        """A step failed: the step sent ahead of it is dropped, the releases it carried go again (a
        queued step may fail before they were applied), and its requests are resent whole (the
        verifier lost their state) or fail."""
        self._drop_ahead()
        self._drop_following()
        self.verifier_release.update(release)
        if isinstance(error, VerifierLost):
            return self._resync(batch, error)
        return [(s, error) for s in batch]

    def _resync(self, batch: list[Sequence], error: VerifierLost) -> list[tuple[Sequence, Chunk | Exception]]:
        """The verifier lost request state: resend whole records next step (the step emitted nothing)."""
        failed = []
        for s in batch:
            s.resyncs += 1
            if s.resyncs > MAX_RESYNCS:
                failed.append((s, VerifierUnavailable(f"verifier keeps losing state: {error}")))
            else:
                s.verifier_has = 0
                self.verifier_release.add(s.id)
        return failed

    def _full_trees(self, batch_size: int) -> list[int]:
        """Nodes of one drafter's tree for each depth of the server's expansion config that fits
        the tree budget at this batch size (the depths the controller may choose from)."""
        fits = self.expansion if self.tree_budget is None else fit_expansion(
            self.expansion, self.tree_budget // max(batch_size, 1))
        return [tree_size(fits[:m]) for m in range(1, len(fits) + 1)]

    def _chunk(self, seq: Sequence) -> int:
        """Tokens of its record the request's step sends without deciding (a chunk of a long record:
        a prompt, or a preempted request's record); 0: the step sends the rest and decides."""
        return self.prefill_chunk if seq.length - seq.verifier_has > self.prefill_chunk else 0

    def _stop_ids(self, req: Request) -> tuple[int, ...]:
        """The tokens that would end the request, which its min_tokens holds back (none without one)."""
        if not req.sampling.min_tokens:
            return ()
        return tuple(sorted(set(req.stop_token_ids) | (set() if req.ignore_eos else self.eos)))

    @staticmethod
    def _room(seq: Sequence) -> int:
        """Draft tokens the request can still use: a step emits the accepted path plus one token."""
        return max(0, seq.request.max_new_tokens - len(seq.generated) - 1)

    def _planned(self, seq: Sequence, choice: Choice) -> list[int]:
        """The request's expansion config this step: its own if fixed, else the server's first
        `choice.depth` levels."""
        expansion = self.expansion[: choice.depth] if seq.expansion is None else seq.expansion
        return expansion[: self._room(seq)]

    def _why_no_plan(self, seq: Sequence, batch_size: int, fits: int) -> str:
        """Why `_planned` gave the request no tree this step, in words for its usage report (`fits`:
        how many levels of the server's expansion the tree budget allows at this batch size)."""
        if seq.expansion == []:
            return "speculation off for this request"
        if not self._room(seq):
            return "the last token needs no draft"
        if not self.expansion:
            return "the server's default expansion is empty"
        if not fits:
            return (f"the tree budget ({self.tree_budget} nodes) over {batch_size} requests is smaller than the "
                    f"expansion's first level ({self.expansion[0]})")
        return f"the cost model predicts plain decoding faster at batch size {batch_size}"

    @staticmethod
    def _asks(seq: Sequence, choice: Choice, chain: list[int] | None) -> bool:
        """Whether the drafters draft for the request this step: always for a fixed expansion (the
        server's choice is for the server's trees), else when the server's choice uses them, or when
        it chose lookup's chain first and lookup found none for the request (the SSMs stand in)."""
        return choice.speculators or seq.expansion is not None or not chain

    async def _drafted_trees(self, batch: list[Sequence], choice: Choice, fits: int, predicted: dict[str, list[int]]
                     ) -> tuple[
            dict[str, TokenTree], dict[str, dict[int, TokenTree]], dict[str, list[int]],
            dict[str, tuple[list[int], int]], tuple[int, int, int, set[str], float, set[str], set[str]]]:
        """Each request's merged draft tree (none for a request that gets no tree this step), the
        trees it merged by drafter number (context lookup's: the number after the drafters'), the
        expansion config each request was planned (at its prompt's step too, undrafted there: it then
        asks the prompt's features for a feature drafter), with context lookup on the chain it found
        for each (maybe none) and the most tokens it could have drafted, and the deepest tree asked of
        the drafters (0: they were not asked), the nodes asked in all, the record tokens caught up on
        (`_caught_up`), the requests they were asked for, the seconds spent awaiting their trees, the
        requests whose trees were all drafted ahead and those some drafter drafted ahead for. A request
        in `predicted` drafts from its prediction this step, merged with lookup's chain: the drafters are
        not asked for it, and no reason for having no tree is counted for it."""
        drafting, first = [], {}  # first: those planned a tree at their prompt's step, undrafted (FIRST_TOKEN_FIRST)
        # the drafters draft ahead on the server's trees where the controller chose so (without one, and on a
        # request's own expansion: always, if asked to)
        ahead = self.draft_ahead if self.controller is None or choice.ahead else 0
        for s in batch:
            if ((plan := self._planned(s, choice)) and self.controller is not None and s.expansion is None and not s.steps
                    and s.id not in predicted):
                first[s.id] = plan
                s.no_tree[FIRST_TOKEN_FIRST] += 1
            elif plan:
                drafting.append((s, Draft(s.id, s.record, plan, s.request.sampling, s.features,
                                          self.draft_ahead if s.expansion is not None else ahead)))
            elif s.id not in predicted:
                s.no_tree[self._why_no_plan(s, len(batch), fits)] += 1
        if not drafting or not (self.drafters or self.lookup):
            for s, _ in drafting:  # a constrained request's grammar may still draft (iteration)
                if s.id not in predicted:
                    s.no_tree["no drafters configured"] += 1
            return {}, {}, {**first, **{s.id: d.expansion for s, d in drafting}}, {}, (0, 0, 0, set(), 0.0, set(), set())
        chains = {}  # context lookup's (and its room), found before the drafters are asked (it costs no RPC)
        if self.lookup:
            for s, d in drafting:
                s.context.extend(d.record.tail(len(s.context.tokens)))
                room = min(self.lookup_tokens or len(d.expansion), self._room(s))
                chains[s.id] = (s.context.draft(room), room)
        asked = ([d for s, d in drafting
                  if s.id not in predicted and self._asks(s, choice, chains.get(s.id, ([], 0))[0])]
                 if self.drafters else [])
        seqs = {s.id: s for s, _ in drafting}
        each = [self._drafts_for(i, asked, seqs) for i in range(len(self.drafters))]
        drafted_ahead = await self._drafted_ahead()
        hits = ([self._hits(drafted_ahead[i], drafts, seqs) for i, drafts in enumerate(each)] if self.draft_ahead
                else [{} for _ in each])  # (off: no loop over the batch for it)
        calls = [i for i, drafts in enumerate(each) if drafts]  # lookup found a chain for every request: none
        # a drafter whose every tree was drafted ahead is not waited for: it is told the step and drafts ahead
        # again meanwhile (its trees, the same, are not needed)
        waits = [i for i in calls if len(hits[i]) < len(each[i])]
        self.launched += [asyncio.ensure_future(self.drafters[i].draft(each[i])) for i in calls if i not in waits]
        answers = [dict(h) for h in hits]
        drafted = time.perf_counter()
        for i, answer in zip(waits, await gather(*(self.drafters[i].draft(each[i]) for i in waits))):
            answers[i] = {**answer, **hits[i]}
        drafted = time.perf_counter() - drafted if waits else 0.0
        predrafted, tried = self._count_predrafts(each, drafted_ahead, hits) if self.draft_ahead else (set(), set())
        asked_ids = {d.request_id for drafts in each for d in drafts}
        fed = [{d.request_id for d in drafts} for drafts, drafter in zip(each, self.drafters) if drafter.wants_features]
        for s, _ in drafting:  # the feature drafters have had these (a drafter that failed lost them)
            if s.id in asked_ids and all(s.id in ids for ids in fed):
                s.features = []
        merged, sources = {}, {}
        for s, d in drafting:
            trees = {i: a[s.id] for i, a in enumerate(answers) if len(a.get(s.id, ())) > 0}
            if chain := chains.get(s.id, ([], 0))[0]:
                trees[self.lookup_source] = chain_tree(chain, s.request.sampling.sampled_drafts)
            if not trees:
                if s.id in predicted:
                    continue
                s.no_tree["no drafter sent a tree in time" if s.id in asked_ids else
                          "the drafters rarely agree with the LLM on this request (cut off until a probe)"
                          if asked else "context lookup found no earlier occurrence to continue"] += 1
                continue
            merged[s.id] = merged_trees(trees)
            sources[s.id] = trees
        asked_for = (max((len(d.expansion) for drafts in each for d in drafts), default=0),
                     max((sum(tree_size(d.expansion) for d in drafts) for drafts in each), default=0),
                     self._caught_up(each, seqs), asked_ids, drafted, predrafted, tried)
        return merged, sources, {**first, **{s.id: d.expansion for s, d in drafting}}, chains, asked_for

    async def _drafted_ahead(self) -> list[dict[str, dict[tuple[int, ...], TokenTree]]]:
        """Each drafter's trees drafted ahead during the last step (the calls not waited for then, now done)."""
        if not self.draft_ahead:
            return [{} for _ in self.drafters]
        launched, self.launched = self.launched, []
        if launched:
            await asyncio.wait(launched)
        return await gather(*(d.drafted_ahead() for d in self.drafters))

    @staticmethod
    def _hits(ahead: dict[str, dict[tuple[int, ...], TokenTree]], drafts: list[Draft], seqs: dict[str, Sequence]
              ) -> dict[str, TokenTree]:
        """The requests of `drafts` whose drafter drafted a tree ahead for what their last step emitted, as
        deep as asked now (drafted ahead on a shallower plan, it misses): it, to that depth."""
        out = {}
        for d in drafts:
            tree = ahead.get(d.request_id, {}).get(seqs[d.request_id].last_tokens)
            if tree is not None and max(depths(tree.parents), default=0) >= len(d.expansion):
                out[d.request_id] = within(tree, len(d.expansion))
        return out

    def _count_predrafts(self, each: list[list[Draft]], ahead: list[dict], hits: list[dict[str, TokenTree]]
                         ) -> tuple[set[str], set[str]]:
        """The requests every drafter asked had drafted ahead for, and those some drafter drafted ahead for
        the request's last step (Stats: hits, and misses where the outcome was not among its)."""
        asked: dict[str, list[int]] = {}
        for i, drafts in enumerate(each):
            for d in drafts:
                asked.setdefault(d.request_id, []).append(i)
        hit = {rid for rid, by in asked.items() if all(rid in hits[i] for i in by)}
        tried = {rid for rid, by in asked.items() if any(rid in ahead[i] for i in by)}
        self.stats.predraft_hits += len(hit)
        self.stats.predraft_misses += len(tried - hit)
        self.stats.predraft_partial += sum(any(rid in hits[i] for i in asked[rid]) for rid in tried - hit)
        return hit, tried

    @staticmethod
    def _caught_up(each: list[list[Draft]], seqs: dict[str, Sequence]) -> int:
        """The most record tokens a drafter feeds before drafting this step, over the drafters (`each`: their
        drafts): held on trees, a request's accepted path and bonus token; after plain steps or steps it was
        cut off from the request, every token since (the controller prices the catching up apart). Each request
        then counts as fed to the drafters that draft for it."""
        most = 0
        for i, drafts in enumerate(each):
            fed = 0
            for d in drafts:
                s = seqs[d.request_id]
                fed += s.length - s.drafter_has.get(i, 0)
                s.drafter_has[i] = s.length
            most = max(most, fed)
        return most

    def _drafts_for(self, drafter: int, asked: list[Draft], seqs: dict[str, Sequence]) -> list[Draft]:
        """What drafter number `drafter` drafts this step: for requests on the server's expansion, as
        many levels as its own acceptance on each request earns (SpeculationController.drafter_levels),
        none where it earns none; requests with a fixed expansion get it whole."""
        if self.controller is None:
            return asked
        out = []
        for d in asked:
            s = seqs[d.request_id]
            if s.expansion is not None:
                out.append(d)
                continue
            own = s.by_drafter.setdefault(drafter, self.controller.own(drafter))
            if m := self.controller.drafter_levels(own, len(d.expansion), s.steps):
                out.append(d if m == len(d.expansion) else replace(d, expansion=d.expansion[:m]))
        return out
