"""The LLM side: tree-based parallel decoding and verification for a batch of requests.

A `Verifier` hosts the LLM and keeps, per request, its token record and LLM KV cache. One `step`
runs one LLM forward over the whole batch: for each request its tokens not yet in the cache (the
prompt on the first step, the previous bonus token afterwards) followed by its draft tree. It then
verifies every tree against the LLM's rows at once on the model's device (acceptance.py; the logits
never leave it, the verdicts come back in one copy), moves the accepted paths' KV entries to
committed slots in one pool operation, drops the rest, and returns the accepted tokens plus the
bonus token.

A request with an empty tree takes a plain incremental step; incremental decoding is this same
path with no speculator at all.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from .graphs import GraphConfig, StepRunner
from .kv_cache import POOL_TOKENS, KVCache, commit_all
from .devices import to_device
from .errors import check_token_ids
from .model import LlamaModel, StepInput, row_starts
from .sampling import SamplingParams
from .tree import TokenTree, check_verifiable
from .acceptance import Verdict, decide_batch, verdicts_of
from .logprobs import MAX_TOP, token_logprobs
from .masks import AllowedTokens
from .penalties import adjust_logits


FEATURE_BYTES = 8 << 20  # features a step returns at most: half the services' 16 MiB messages


@dataclass
class VerifyRequest:
    request_id: str
    new_tokens: list[int]  # tokens to append to the request's record (the whole prompt at first)
    tree: TokenTree = field(default_factory=TokenTree)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    features: bool = False  # return the features of the rows this step commits (for a feature drafter)
    logprobs: bool = False  # return each token's logprob (logprobs.py)
    prompt_logprobs: bool = False  # return those of new_tokens[1:] (a prompt's, at its prefill)
    top_logprobs: int = 0  # with each of them, the most likely tokens there
    allowed: AllowedTokens | None = None  # constrained output: the tokens each row may take (masks.py)
    prefill_only: bool = False  # a chunk of a long record: keep its K/V, decide nothing (no tokens back)
    # the sampling's penalties and min_tokens (penalties.py): the record position of the first generated
    # token, and the tokens min_tokens holds back
    output_start: int = 0
    stop_ids: tuple[int, ...] = ()
    # a step sent before the outcome of the request's step before it: the record's length before that outcome
    # (None: an ordinary step), and the trees drafted ahead for its outcomes (the tokens it emits -> the next
    # tree); `resolve` takes the outcome's tree and sets `chosen` to its index, or where none was drafted for
    # it (-1) marks the request `skipped`: the step leaves it out (`stepped`), and it comes again with a tree
    since: int | None = None
    candidates: list[tuple[tuple[int, ...], TokenTree]] = field(default_factory=list)
    chosen: int = -1
    skipped: bool = False


@dataclass
class Features:
    """The LLM's features (eagle.py) of the rows one step committed: the tokens that were pending
    (the previous bonus token, or the prompt) and the accepted path; the new bonus token's come next step."""

    start: int  # the record position of the first row
    rows: torch.Tensor  # [n, len(layers) * hidden] on the host, in the LLM's dtype


def check_feature_layers(layers, n_layers: int) -> None:
    if not all(0 <= i < n_layers for i in layers):
        raise ValueError(f"feature_layers: {list(layers)} are not all layers of the LLM (0..{n_layers - 1})")


@dataclass
class Begun:
    """A step whose forward pass is queued on the device (`Verifier.begin`) and whose verdicts are
    not read yet (`Verifier.end`)."""

    batch: list[VerifyRequest]
    items: list[StepInput]
    cached: list[int]  # per request, its new tokens found in the prefix cache
    firsts: list[int]  # per item, the record position of its first row
    logits: torch.Tensor | None
    starts: list[int]  # per item, its first row of the logits
    decided: list[int]  # the requests it decides (a prefill-only chunk decides nothing)
    placed: dict[str, int]  # the requests whose pending token the step before decides: where it goes in the record
    roots: list[int] | None = None  # the decision queued on the device (`Verifier._queue`): its root rows,
    out: torch.Tensor | None = None  # and its verdict table
    copied: torch.Tensor | None = None  # (on a GPU) the table's copy on the host, valid once `ready`
    ready: "torch.cuda.Event | None" = None  # (on a GPU) recorded after that copy was queued
    follower: "Begun | None" = None  # the step begun behind this one, before it ended
    started_ns: int = 0  # when its caller began it (perf_counter_ns)

    @functools.cached_property
    def rows(self) -> dict[str, int]:
        """Each decided request's row of the verdict table (its decision's order)."""
        return {self.batch[i].request_id: row for row, i in enumerate(self.decided)}

    @functools.cached_property
    def passes(self) -> set[str]:
        """The requests this step gives exactly one token (no tree): a step begun behind it may take it."""
        return {self.batch[i].request_id for i in self.decided if not len(self.batch[i].tree)}

    @functools.cached_property
    def reads_rows(self) -> bool:
        """Whether ending it reads its logits or features (logprobs, features asked)."""
        return any(r.logprobs or r.prompt_logprobs or r.features for r in self.batch)


class Verifier:
    chains = True  # a step may begin behind one not yet ended (`follows`)

    def __init__(self, model: LlamaModel, kv_tokens: int = POOL_TOKENS, graphs: GraphConfig = GraphConfig(),
                 progress: bool = False, feature_layers: tuple[int, ...] = (), feature_bytes: int = FEATURE_BYTES,
                 prefix_cache: bool = True):
        """feature_layers: the layers whose entering residual stream a request may ask for (`Features`);
        feature_bytes: the most a step returns of them (see `_attach_features`); prefix_cache: keep
        finished requests' full blocks for later prompts that start alike (kv_cache.py)."""
        self.model = model
        self.feature_layers = tuple(feature_layers)
        self.feature_bytes = feature_bytes
        if feature_layers:  # before the runner captures graphs of the forward
            check_feature_layers(feature_layers, model.cfg.num_layers)
            if model.aux_layers and model.aux_layers != self.feature_layers:
                raise ValueError(f"feature_layers: the model already keeps the features of layers {model.aux_layers}")
            model.aux_layers = self.feature_layers
        self.pool = model.new_pool(kv_tokens, prefix_cache=prefix_cache)
        self.run = StepRunner(model, self.pool, graphs, progress)  # the model's forward, graphed where it can be
        self.caches: dict[str, KVCache] = {}

    def release(self, request_id: str) -> None:
        cache = self.caches.pop(request_id, None)
        if cache is not None:
            cache.release()

    def _check_room(self, batch: list[VerifyRequest], takes: set[str]) -> None:
        """Raise CacheFull, before anything changes, if the pool cannot hold the step (`takes`: the
        requests whose pending token the step before decides)."""
        need = 0
        for req in batch:
            cache = self.caches.get(req.request_id)
            slots = (len(cache.tokens) if cache else 0) + (req.request_id in takes) + len(req.new_tokens) + len(req.tree)
            need += cache.blocks_to_grow(slots) if cache else self.pool.blocks_for(slots)
        self.pool.check_room(need)

    def step(self, batch: list[VerifyRequest]) -> list[Verdict]:
        self.resolve(batch)
        run = stepped(batch)
        return with_skipped(batch, self.end(self.begin(run)) if run else [])

    def resolve(self, batch: list[VerifyRequest]) -> None:
        """Each request with candidates takes the tree of the one whose outcome is what its step before
        emitted, the record past `since` (none: it is `skipped`), once that step has ended."""
        for req in batch:
            if req.since is None:
                continue
            if req.new_tokens or len(req.tree):
                raise ValueError(f"candidates (request {req.request_id}): a step chosen by the outcome of the one "
                                 f"before takes no new_token_ids or tree")
            cache = self.caches.get(req.request_id)
            emitted = tuple(cache.tokens[req.since:]) if cache is not None and 0 <= req.since < len(cache.tokens) else None
            if emitted is None:
                raise ValueError(f"record_length (request {req.request_id}): the verifier holds "
                                 f"{len(cache.tokens) if cache else 0} tokens, no outcome past {req.since}")
            req.chosen = next((i for i, (outcome, _) in enumerate(req.candidates) if tuple(outcome) == emitted), -1)
            req.tree = req.candidates[req.chosen][1] if req.chosen >= 0 else TokenTree()
            req.since, req.candidates, req.skipped = None, [], req.chosen < 0

    def follows(self, after: "Begun", batch: list[VerifyRequest], released: list[str]) -> bool:
        """Whether `batch` may begin behind the step `after` before that one ends (`begin`): `after`'s
        decision is queued, every request of both asks no new tokens and no tree and takes the one
        token `after` decides for it (`after` ending commits no tree of its own: its scratch is
        theirs now), none of `after`'s requests is released, and `after` reads nothing more of its
        logits or features when it ends (a step begun behind it overwrites them)."""
        mine = {req.request_id for req in after.batch}
        if (not batch or not self.chains or after.out is None or after.follower is not None or after.reads_rows
                or not mine.isdisjoint(released)):
            return False
        return all(not req.new_tokens and not len(req.tree) and req.since is None and req.request_id in after.passes
                   for req in batch if req.request_id in mine)

    def begin(self, batch: list[VerifyRequest], after: "Begun | None" = None) -> "Begun":
        """Check the batch, extend the caches and queue its forward pass (and, unless it follows a step
        not yet ended, its decision) on the device; `end` reads its verdicts. With `after` (see
        `follows`), the requests of both take as their pending token the token `after` decides, from
        the device: a step begun while the one before still runs on a GPU."""
        if not batch:  # e.g. a message that only releases requests
            return Begun([], [], [], [], None, [], [], {})
        if after is not None and not self.follows(after, batch, []):
            raise ValueError("this batch cannot begin before the step it follows ends")
        self.resolve(batch)
        takes = {req.request_id for req in batch if after is not None and req.request_id in after.passes}
        vocab = self.model.cfg.vocab_size
        for req in batch:
            check_token_ids(f"new_token_ids (request {req.request_id})", req.new_tokens, vocab)
            if not 0 <= req.top_logprobs <= MAX_TOP:
                raise ValueError(f"top_logprobs (request {req.request_id}): from 0 to {MAX_TOP}, got {req.top_logprobs}")
            check_token_ids(f"tree (request {req.request_id})", req.tree.tokens, vocab)
            check_token_ids(f"logit_bias (request {req.request_id})", [t for t, _ in req.sampling.logit_bias], vocab)
            check_token_ids(f"allowed_token_ids (request {req.request_id})", req.sampling.allowed_token_ids, vocab)
            check_token_ids(f"stop_token_ids (request {req.request_id})", req.stop_ids, vocab)
            for g in req.tree.groups:
                check_token_ids(f"tree (request {req.request_id}): q_token_ids", g.q_ids, vocab)
            try:
                check_verifiable(req.tree)
            except ValueError as e:
                raise ValueError(f"{e} (request {req.request_id})") from None
            if req.allowed is not None:
                req.allowed.check(1 + len(req.tree), vocab, f"allowed (request {req.request_id})")
            if req.prefill_only and (len(req.tree) or req.features or req.logprobs or req.prompt_logprobs
                                     or req.allowed is not None):
                raise ValueError(f"prefill_only (request {req.request_id}): a chunk decides nothing, so it takes "
                                 f"no tree, features, logprobs or allowed tokens")
            cache = self.caches.get(req.request_id)
            if not req.new_tokens and req.request_id not in takes and (cache is None or cache.length == len(cache.tokens)):
                raise ValueError(f"request {req.request_id}: nothing to decode (empty prompt?)")
        if any(r.features for r in batch) and not self.feature_layers:
            raise ValueError("features: this verifier keeps no features (started without feature layers)")
        self._check_room(batch, takes)
        items, cached, placed = [], [], {}
        for req in batch:
            cache = self.caches.get(req.request_id)
            new = cache is None
            if new:
                cache = self.caches[req.request_id] = self.pool.new_cache()
            # a record's leading blocks that other requests hold or held, at its first step or a later
            # chunk of a record whose blocks so far all came from there (a prompt whose logprobs are
            # asked computes its rows)
            shares = (new or cache.length == cache.indexed * self.pool.block_size) and len(req.new_tokens) > 1
            if req.request_id in takes:  # a stand-in until `after` ends; the forward reads the real one on the device
                placed[req.request_id] = len(cache.tokens)
                cache.tokens.append(0)
            cache.tokens.extend(req.new_tokens)
            cached.append(cache.share_prefix() if shares and not req.prompt_logprobs else 0)
            items.append(StepInput(cache, cache.pending, req.tree.tokens, req.tree.parents, req.prompt_logprobs))
        firsts = [it.cache.length for it in items]  # the record position of each item's first row
        if placed:
            at = [0, *itertools.accumulate(len(it.new_tokens) + len(it.tree_tokens) for it in items)]
            dst = [at[i] for i, req in enumerate(batch) if req.request_id in placed]
            src = [after.rows[req.request_id] for req in batch if req.request_id in placed]
            dev = self.model.device
            logits = self.run(items, fill=(to_device(torch.tensor(dst), dev), after.out[to_device(torch.tensor(src), dev), 0]))
        else:
            logits = self.forward(items)
        decided = [i for i, req in enumerate(batch) if not req.prefill_only]
        begun = Begun(batch, items, cached, firsts, logits, row_starts(items), decided, placed)
        if after is not None:
            after.follower = begun  # decided when `after` ends: its records hold the real tokens then
        elif self.chains:
            self._queue(begun)
        return begun

    def _queue(self, begun: "Begun") -> None:
        """Queue the step's decision on the device (read by `end`), and mark when it is done."""
        batch, starts = begun.batch, begun.starts
        at = begun.decided
        if not at:
            return
        begun.roots, begun.out = self._decision([batch[i] for i in at], begun.logits, [starts[i] for i in at])
        if begun.out.is_cuda:  # its copy to the host queued now, ahead of whatever begins behind it on the stream
            begun.copied = begun.out.to("cpu", non_blocking=True)  # (into pinned memory)
            begun.ready = torch.cuda.Event(blocking=True)  # (its waiters sleep rather than spin)
            begun.ready.record()

    def end(self, begun: "Begun") -> list[Verdict]:
        """Wait for the step's verdicts and commit them: the accepted paths' K/V, the tokens to the
        records (or in place of the stand-ins of the step begun behind it, which is then decided)."""
        batch, at = begun.batch, begun.decided
        chosen = [batch[i] for i in at]
        starts = [begun.starts[i] for i in at]
        if begun.out is None:
            decided = self.decide(chosen, begun.logits, starts) if at else []
        else:
            if begun.ready is not None:  # not `out.cpu()`: that would wait for a step begun behind this one
                begun.ready.synchronize()
            decided = self._verdicts(chosen, begun.logits, starts, begun.roots,
                                     begun.out if begun.copied is None else begun.copied)
        verdicts = [Verdict([], []) for _ in batch]  # a chunk's verdict is empty: nothing decided, no token pending
        for i, v in zip(at, decided):
            verdicts[i] = v
        if any(r.features for r in batch):
            self._attach_features(batch, begun.items, verdicts, begun.firsts)
        for verdict, n in zip(verdicts, begun.cached):
            verdict.cached_tokens = n
        caches = [item.cache for item in begun.items]
        commit_all(caches, [v.path for v in verdicts])
        placed = begun.follower.placed if begun.follower is not None else {}
        for req, cache, verdict in zip(batch, caches, verdicts):
            if req.request_id in placed:
                cache.tokens[placed[req.request_id]], = verdict.tokens
            else:
                cache.tokens.extend(verdict.tokens)
            cache.register()
        if begun.follower is not None:
            self._queue(begun.follower)
        return verdicts

    def _attach_features(self, batch: list[VerifyRequest], items: list[StepInput], verdicts: list[Verdict],
                         firsts: list[int]) -> None:
        """Give each verdict that asked for them its committed rows' features, in one copy to the host.
        A step returns at most `feature_bytes` of them: the accepted paths' and previous bonus tokens'
        always, and of each prompt its newest rows within an equal share of the rest (a drafter
        feeds the older positions without features: it drafts worse there, never wrongly)."""
        asked = [i for i, req in enumerate(batch) if req.features]
        width = len(self.feature_layers) * self.model.cfg.hidden_size * self.model.dtype.itemsize
        steady = sum(len(verdicts[i].path) + (len(items[i].new_tokens) == 1) for i in asked)
        prompts = sum(len(items[i].new_tokens) > 1 for i in asked)
        share = max(0, self.feature_bytes // width - steady) // max(prompts, 1)
        starts = [0, *itertools.accumulate(len(it.new_tokens) + len(it.tree_tokens) for it in items)]
        index, counts, skipped = [], [], []
        for i in asked:
            at, n_new = starts[i], len(items[i].new_tokens)
            skip = max(0, n_new - share) if n_new > 1 else 0
            rows = list(range(at + skip, at + n_new)) + [at + n_new + u for u in verdicts[i].path]
            index += rows
            counts.append(len(rows))
            skipped.append(skip)
        rows = self.feature_rows(index).split(counts)
        for i, skip, r in zip(asked, skipped, rows):
            verdicts[i].features = Features(firsts[i] + skip, r)

    def feature_rows(self, index: list[int]) -> torch.Tensor:
        """The features of the step's rows `index`, [len(index), len(feature_layers) * hidden] on the host."""
        return self.run.features[torch.tensor(index, device=self.run.features.device)].cpu()

    def forward(self, items: list[StepInput]) -> torch.Tensor | None:
        """The LLM's logits [R, V] on its device, 1 + n_tree rows per item (a model-parallel
        verifier: None on the ranks that do not hold them)."""
        return self.run(items)

    def decide(self, batch: list[VerifyRequest], logits: torch.Tensor, starts: list[int]) -> list[Verdict]:
        """Each request's accepted path and tokens, from its rows of the logits (starting at starts)
        masked to the tokens each row may take (constrained requests), and the logprobs asked for
        (a constrained request's over its masked rows: the distribution its tokens come from)."""
        return self._verdicts(batch, logits, starts, *self._decision(batch, logits, starts))

    def _decision(self, batch: list[VerifyRequest], logits: torch.Tensor, starts: list[int]) -> tuple[list[int], torch.Tensor]:
        """`decide`'s work on the device, queued: each request's root row, and the verdict table."""
        roots = [s + (len(r.new_tokens) - 1 if r.prompt_logprobs and r.new_tokens else 0) for r, s in zip(batch, starts)]
        masked = [i for i, r in enumerate(batch) if r.allowed is not None]
        apply_masks(logits, [range(roots[i], roots[i] + 1 + len(batch[i].tree)) for i in masked],
                    [batch[i].allowed for i in masked])
        adjust_logits(logits, roots, [r.tree for r in batch], [self.caches[r.request_id].tokens for r in batch],
                      [r.output_start for r in batch], [r.sampling for r in batch], [r.stop_ids for r in batch])
        return roots, decide_batch([r.tree for r in batch], logits, roots, [r.sampling for r in batch],
                                   [len(self.caches[r.request_id].tokens) for r in batch])

    def _verdicts(self, batch: list[VerifyRequest], logits: torch.Tensor, starts: list[int], roots: list[int],
                  out: torch.Tensor) -> list[Verdict]:
        """`decide`'s verdicts from its queued work, read in one copy, with the logprobs asked for."""
        verdicts = verdicts_of([r.tree for r in batch], out)
        asked = [i for i, r in enumerate(batch) if r.logprobs or r.prompt_logprobs]
        if not asked:
            return verdicts
        rows, tokens, tops = [], [], []
        for i in asked:
            r, root, v = batch[i], roots[i], verdicts[i]
            if r.prompt_logprobs:
                rows += range(starts[i], root)
                tokens += r.new_tokens[1:]
            if r.logprobs:
                rows += [root] + [root + 1 + u for u in v.path]
                tokens += v.tokens
            tops += [r.top_logprobs] * (len(rows) - len(tops))
        entries = token_logprobs(logits, rows, tokens, tops)
        at = 0
        for i in asked:
            r, v = batch[i], verdicts[i]
            if r.prompt_logprobs:
                n = roots[i] - starts[i]
                v.prompt_logprobs, at = entries[at: at + n], at + n
            if r.logprobs:
                n = len(v.tokens)
                v.logprobs, at = entries[at: at + n], at + n
        return verdicts


def stepped(batch: list[VerifyRequest]) -> list[VerifyRequest]:
    """The requests a step runs: those `resolve` did not skip."""
    return [req for req in batch if not req.skipped]


def with_skipped(batch: list[VerifyRequest], verdicts: list[Verdict]) -> list[Verdict]:
    """The verdicts of `stepped(batch)`, with an empty one (no tokens) for each request skipped."""
    ran = iter(verdicts)
    return [Verdict([], []) if req.skipped else next(ran) for req in batch]


def apply_masks(logits: torch.Tensor, rows: list[list[int]], allowed: list[AllowedTokens]) -> None:
    """Set to -inf, in place, the logits [R, V] of the tokens each row may not take: request i's rows
    rows[i] (its root's, then its nodes') take allowed[i]'s masks. One host-to-device copy of the
    distinct masks and one masked write, whatever the batch."""
    if not allowed:
        return
    dev, vocab = logits.device, logits.shape[1]
    table = to_device(torch.from_numpy(np.concatenate([a.words for a in allowed])), dev)
    offsets = np.cumsum([0] + [len(a.words) for a in allowed[:-1]])
    which = to_device(torch.tensor([o + k for o, a in zip(offsets, allowed) for k in a.index]), dev)
    at = to_device(torch.tensor([r for rs in rows for r in rs]), dev)
    bits = (table[:, :, None] >> torch.arange(32, device=dev, dtype=torch.int32)) & 1  # [K, W, 32]
    ok = bits.reshape(len(table), -1)[:, :vocab].bool()  # [K, V]
    logits[at] = logits[at].masked_fill(~ok[which], float("-inf"))
