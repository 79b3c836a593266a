"""The SSM side: expansion-based token tree construction for a batch of requests, on the SSM's device.

A `Speculator` hosts one SSM and keeps, per request, the tokens it has been told were committed
and an SSM KV cache. `draft` grows every request's tree one level at a time with one batched SSM
forward per level: level 1 comes from the row of the last committed token (the root), level i+1
from the rows of level i's nodes, each node attending to the committed prefix and its ancestors.

Greedy: a node at depth i gets the top-k_i tokens as children. Sampled requests verified by
coupled matching: the same, except that a node's first child is the SSM's guess of the LLM's coupled
sample, its q raced against the noise the verifier's sample races p against (`_guess_first`).
Sampled drafts (requests verified by MSS): a node at depth i gets k_i draws from q, the SSM's distribution after the request's
sampling transforms, truncated to its `q_top` most likely tokens and renormalized; draws are
sequential without replacement by default (drawn at once as the top k_i of log q + Gumbel noise,
which is the same law), i.i.d. with replacement on request (k_i inverse-CDF draws). The draws and q
are recorded in the tree (DraftGroup) for the verifier.

Per level, every frontier row of every request goes through one forward, one top-k, one guess of
the coupled sample and one sampling operation (each over the rows it applies to); the drawn tokens
stay on the device and are the next level's input. A fixed expansion gives every request a static
tree shape: every node gets exactly k_i children (a draw past the support of q, possible without
replacement, is a *dead* node: computed like the others, dropped from the tree). The finished trees
cross to the host in one copy; there, dead nodes are dropped and repeated draws of one token under
one parent (with replacement) become one node whose children are the union of the repeats'
children, each repeat's draws kept as their own group.

Dynamic trees (EAGLE-2, arXiv 2406.16858; `Speculator(dynamic=True)`), for requests with top-k
drafts (greedy, or sampled and verified by coupled matching): the expansion <k_1, ..., k_m> is read
as a budget, not a shape: depth m, level widths w_i = k_1 ... k_i, N = w_1 + ... + w_m nodes. Each
frontier row proposes its top K = min(max w_i, DYNAMIC_TOP) tokens, scored by path log-probability
under the drafter (a coupled request's guess, proposed first, as if it were the likeliest); a
level's w_{i+1} best candidates are the next frontier (so a forward has the rows the fixed tree's
would), and the tree is the N best candidates of all levels (closed under parents:
a child never scores above its parent, and ties go to the older node). Choosing needs the scores on
the host: one small copy per level, which fixed trees do not make.

Long records are fed in chunks (`prefill_chunk`, as the engine chunks the verifier's prefill): a
request with more pending tokens than a chunk (a long prompt, a request resumed after preemption,
one drafted for again after many plain steps) feeds a chunk per draft, in the same first forward as
the other requests' roots, and gets an empty tree until it has caught up. So a long prompt costs
the batch's other requests at most a chunk's forward per draft, and once caught up it drafts the
tree a drafter fed the record whole drafts.

Drafting during verification (`draft_ahead`, engine.py): once a tree is handed over, the drafter drafts
the next step's trees for the likeliest outcomes of verifying it, greedy requests on fixed trees. An
outcome is a path of the tree accepted and then a bonus token that is none of its end's children; its
log-probability by the drafter is the path's plus the token's there. One forward feeds the tree's last
level (its rows give the bonus tokens after a whole path), the outcomes are ranked on the host, and each
outcome's bonus token becomes a new node under its path's end in the same scratch tree, grown in the
request's expansion one batched forward a level, as the tree was. So the tree sent and the trees ahead
share one cache: when the step's outcome is one of them, the next draft keeps the KV of the accepted
path and its tree is the one drafted ahead.

Losing a speculator's state only costs speed: the next `draft` recomputes whatever it is missing.
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .graphs import GraphConfig, StepRunner
from .kv_cache import POOL_TOKENS, KVCache, commit_all
from .errors import check_token_ids
from .model import LlamaModel, StepInput
from .devices import to_device
from .draws import coupled_noise, mix, probabilities, sparsify, uniform
from .sampling import SamplingParams, sample_key, stream_key
from .tree import DraftGroup, TokenTree, merge

DYNAMIC_TOP = 16  # a dynamic tree's candidates per frontier row at most


@dataclass
class DraftRequest:
    request_id: str
    new_tokens: list[int]  # tokens committed since this speculator last heard of the request
    expansion: list[int]  # <k_1, ..., k_m>; empty: no tree
    sampling: SamplingParams = field(default_factory=SamplingParams)
    replacement: bool = False  # stochastic drafts: i.i.d. draws instead of draws without replacement
    drafter: int = 0  # tells apart the drafters of one request (e.g. speculator services) so their draws are independent
    features: list = field(default_factory=list)  # a feature drafter's input: the LLM's `verifier.Features` since last time
    ahead: int = 0  # `draft_ahead`: the likeliest outcomes of verifying its tree to draft the next trees for


@dataclass
class _Row:
    """One frontier node of one request at one level: its row in the level's logits."""

    request: int  # index in the batch
    node: int  # the node whose children it draws (-1: the root), a raw tree index
    index: int  # its index among the request's rows at this level (a counter of its random numbers)


@dataclass
class _Grown:
    """What a draft leaves for `Speculator._ahead`: the caches, the levels grown, their candidates, the raw
    trees, and which requests draft ahead."""

    caches: list[KVCache]
    levels: list
    candidates: list[tuple[torch.Tensor, torch.Tensor]]
    raw: list[TokenTree]
    ahead: list[bool]


class Speculator:
    wants_features = False  # a feature drafter's subclass reads the LLM's features (feature_drafter.py)
    drafts_ahead = True  # drafts for the outcomes of the verification of its trees (`draft_ahead`)

    def __init__(self, model: LlamaModel, index: int = 0, q_top: int = 32, kv_tokens: int = POOL_TOKENS,
                 graphs: GraphConfig = GraphConfig(), progress: bool = False, dynamic: bool = False,
                 prefill_chunk: int = 0):
        """dynamic: EAGLE-2's dynamic trees for requests with top-k drafts; prefill_chunk: the most
        pending tokens a draft feeds per request (0: all of them); see above."""
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk: must be >= 0, got {prefill_chunk}")
        if q_top < 1:
            raise ValueError(f"q_top: must be >= 1, got {q_top}")
        self.model = model
        self.dynamic = dynamic
        self.prefill_chunk = prefill_chunk
        self.pool = model.new_pool(kv_tokens)
        self.run = StepRunner(model, self.pool, graphs, progress)  # the model's forward, graphed where it can be
        self.index = index  # keeps each SSM's random draws independent of the others'
        self.q_top = q_top
        self.caches: dict[str, KVCache] = {}

    def release(self, request_id: str) -> None:
        """Forget the request; its committed full blocks stay for later requests that start alike
        (kv_cache.py), indexed now that nothing writes to them again."""
        cache = self.caches.pop(request_id, None)
        if cache is not None:
            cache.register()
            cache.release()

    def _sync(self, batch: list[DraftRequest]) -> list[KVCache]:
        """Record new tokens and keep the KV of the part of each last tree they confirm (all moved
        at once); the root (the last token) always stays pending, so the first forward yields its
        row, also when nothing new came since the last draft (then the same tree comes again)."""
        for r in batch:  # all checked before any state changes
            check_token_ids(f"new_token_ids (request {r.request_id})", r.new_tokens, self.model.cfg.vocab_size)
            if not r.new_tokens and not (r.request_id in self.caches and self.caches[r.request_id].tokens):
                raise ValueError(f"request {r.request_id}: no tokens to draft from")
        caches = []
        for r in batch:
            cache = self.caches.get(r.request_id)
            new = cache is None
            if new:
                cache = self.caches[r.request_id] = self.pool.new_cache()
            cache.tokens.extend(r.new_tokens)
            if new:
                cache.share_prefix()  # blocks an earlier request with the same leading tokens left (kv_cache.py)
            caches.append(cache)
        commit_all(caches, [c.matching_path(c.tokens[c.length: -1]) for c in caches])
        for c in caches:
            if c.length == len(c.tokens):  # the root's K/V is cached but its row is needed again
                c.length -= 1
        return caches

    def _fed(self, cache: KVCache) -> int:
        """The pending tokens a draft feeds the cache: all of them, or a chunk when more are pending
        (the request then gets no tree)."""
        pending = len(cache.pending)
        return min(pending, self.prefill_chunk) if self.prefill_chunk else pending

    @torch.no_grad()
    def draft(self, batch: list[DraftRequest]) -> list[TokenTree]:
        return self._draft(batch, False)[0]

    @torch.no_grad()
    def draft_ahead(self, batch: list[DraftRequest]
                    ) -> tuple[list[TokenTree], Callable[[], list[dict[tuple[int, ...], TokenTree]]]]:
        """`draft`'s trees, and what drafts ahead once they are handed over: each request's next trees for
        the `ahead` likeliest outcomes of verifying its tree (drafting during verification, module
        docstring), the tokens that step would emit (an accepted path, then the LLM's bonus token) -> the
        tree below them, in the request's expansion. For greedy requests on fixed trees (others get none).
        Call it before the next draft."""
        trees, grown = self._draft(batch, True)
        return trees, functools.partial(self._ahead, batch, grown)

    def _draft(self, batch: list[DraftRequest], ahead: bool) -> tuple[list[TokenTree], "_Grown"]:
        caches = self._sync(batch)
        fed = [self._fed(c) for c in caches]
        behind = [n < len(c.pending) for n, c in zip(fed, caches)]  # fed a chunk: their roots get no children
        keys = [stream_key(r.sampling.seed, "draft", r.drafter, self.index, len(c.tokens))
                if r.sampling.sampled_drafts else None for r, c in zip(batch, caches)]
        # requests verified by coupled matching: their sample's key and the position the root's children take
        couple = [(sample_key(r.sampling.seed), self._record_length(r.request_id, c))
                  if not (r.sampling.greedy or r.sampling.sampled_drafts) else None for r, c in zip(batch, caches)]
        dynamic = [_Dynamic(r.expansion) if self.dynamic and key is None and r.expansion and not b else None
                   for r, key, b in zip(batch, keys, behind)]
        ahead = [bool(ahead and self.drafts_ahead and r.ahead and r.expansion and r.sampling.greedy) and not b
                 and d is None for r, b, d in zip(batch, behind, dynamic)]
        outcomes = max((r.ahead for r, a in zip(batch, ahead) if a), default=0)
        size = [0] * len(batch)  # nodes of each request's tree so far (level order, dead ones included)
        rows = [_Row(i, -1, 0) for i, r in enumerate(batch) if r.expansion]
        items = [StepInput(caches[row.request], caches[row.request].pending[: fed[row.request]], [], [])
                 for row in rows]
        levels, candidates = self._levels(batch, caches, rows, items, size, behind, dynamic, keys, couple, outcomes)
        trees, raw = self._finish(batch, caches, levels, dynamic)
        return trees, _Grown(caches, levels, candidates, raw, ahead)

    def _levels(self, batch: list[DraftRequest], caches: list[KVCache], rows: list[_Row], items: list[StepInput],
                size: list[int], behind: list[bool], dynamic: list["_Dynamic | None"], keys: list[int | None],
                couple: list[tuple[int, int] | None], outcomes: int = 0) -> tuple[list, list]:
        """Grow the trees from the frontier `rows` (fed by `items`), one batched forward per level, to the
        depth of each request's expansion: the levels' (rows, k, children), and with `outcomes` each level's
        rows' top k + `outcomes` tokens and their log-probabilities (`_candidates`). `size`: each request's
        raw nodes so far, counted on."""
        ids, levels, candidates, depth = None, [], [], 0
        while rows:
            logits = self._forward(items, ids)  # [len(rows), V]: one row per frontier node
            self._fed_rows(rows)
            k = [0 if behind[row.request] else dynamic[row.request].top if dynamic[row.request]
                 else batch[row.request].expansion[depth] for row in rows]
            children = self._expand(logits, rows, k, batch, keys, depth)
            self._guess_first(children[0], logits, rows, batch, couple, depth)
            levels.append((rows, k, children))
            if outcomes:
                candidates.append(_candidates(logits, max(k) + outcomes))
            kmax = children[0].shape[1]
            scores = _path_scores(logits, children[0], [i for i, row in enumerate(rows) if dynamic[row.request]])
            for ri, s in scores.items():  # a guess of the coupled sample (first) scores as the likeliest child
                if couple[rows[ri].request] is not None:
                    s[0] = max(s)
            new: dict[int, list[tuple[int, int]]] = {}  # request -> (row, child) of its new nodes, in order
            for ri, (row, kr) in enumerate(zip(rows, k)):
                new.setdefault(row.request, []).extend((ri, j) for j in range(kr))
            nxt, picks, parents = [], [], {}
            for r, nodes in new.items():
                last = depth + 1 == len(batch[r].expansion)
                d = dynamic[r]
                if d:
                    chosen = d.level(depth, [(rows[ri].node, size[r] + u, scores[ri][j])
                                             for u, (ri, j) in enumerate(nodes)], last)
                else:
                    chosen = [] if last else range(len(nodes))
                for index, u in enumerate(chosen):
                    ri, j = nodes[u]
                    nxt.append(_Row(r, size[r] + u, index))
                    picks.append(ri * kmax + j)
                    # a fixed tree's cache holds all its nodes in order; a dynamic one's, those fed
                    parents.setdefault(r, []).append(d.slot(rows[ri].node) if d else rows[ri].node)
                if d:
                    d.feed([size[r] + u for u in chosen])
                size[r] += len(nodes)
            drawn_ids = children[0].flatten()
            picked = None if len(picks) == drawn_ids.numel() else \
                torch.tensor(picks, dtype=torch.long).to(logits.device, non_blocking=True)
            ids = drawn_ids if picked is None else drawn_ids[picked]
            self._follow(picked, kmax)
            items = [StepInput(caches[r], [], [0] * len(p), p) for r, p in parents.items()]
            rows, depth = nxt, depth + 1
        return levels, candidates

    @torch.no_grad()
    def _ahead(self, batch: list[DraftRequest], g: "_Grown") -> list[dict[tuple[int, ...], TokenTree]]:
        """The trees below each `ahead` request's likeliest outcomes (`draft_ahead`). The tree's
        last level is fed (one forward: each leaf's row, the bonus tokens after a whole path), the outcomes
        ranked by the drafter's log-probability of their tokens (a path's nodes, then a bonus token that is
        none of the node's children), and each outcome's bonus token grown as a new node under its path's
        end, in the scratch tree beside the tree sent (so that the step after a hit keeps its KV)."""
        out: list[dict[tuple[int, ...], TokenTree]] = [{} for _ in batch]
        reqs = [i for i, a in enumerate(g.ahead) if a]
        if not reqs:
            return out
        leaves = {i: list(range(len(g.caches[i].tree), len(g.raw[i]))) for i in reqs}
        self._reading([(i, g.raw[i].parents[u]) for i in reqs for u in leaves[i]])
        logits = self._forward([StepInput(g.caches[i], [], [g.raw[i].tokens[u] for u in leaves[i]],
                                          [g.raw[i].parents[u] for u in leaves[i]]) for i in reqs], None)
        self._fed_rows([_Row(i, u, 0) for i in reqs for u in leaves[i]])
        outcomes = max(batch[i].ahead for i in reqs)
        parts = g.candidates + [_candidates(logits, outcomes)]
        ids = torch.cat([t.flatten() for t, _ in parts]).tolist()  # the pre-draft's synchronization and copies
        logq = torch.cat([q.flatten() for _, q in parts]).tolist()
        widths = [(level_rows, t.shape[1]) for (level_rows, _, _), (t, _) in zip(g.levels, g.candidates)]
        widths.append(([_Row(i, u, 0) for i in reqs for u in leaves[i]], outcomes))
        q: dict[int, dict[int, list[tuple[int, float]]]] = {i: {} for i in reqs}  # request -> node -> its top tokens
        at = 0
        for level, width in widths:
            for row in level:
                if g.ahead[row.request]:
                    q[row.request][row.node] = list(zip(ids[at: at + width], logq[at: at + width]))
                at += width
        size = [len(t) for t in g.raw]
        start, items, keys = [], [], {}
        for i in reqs:
            picks = _likeliest(g.raw[i], q[i], batch[i].ahead)
            paths = g.raw[i].paths()
            for j, (u, b) in enumerate(picks):
                keys[i, size[i] + j] = (paths[u] if u >= 0 else ()) + (b,)
                start.append(_Row(i, size[i] + j, j))
            g.raw[i].tokens += [b for _, b in picks]
            g.raw[i].parents += [u for u, _ in picks]
            items.append(StepInput(g.caches[i], [], [b for _, b in picks], [u for u, _ in picks]))
            size[i] += len(picks)
        sub = [r if g.ahead[i] else replace(r, expansion=[]) for i, r in enumerate(batch)]
        none = [None] * len(batch)
        self._reading([(row.request, g.raw[row.request].parents[row.node]) for row in start])
        levels, _ = self._levels(sub, g.caches, start, items, size, [False] * len(batch), none, none, none)
        self._grow_raw(sub, g.caches, levels, none, g.raw)
        for (i, node), key in keys.items():
            out[i][key] = _below(g.raw[i], node)
        return out

    def _forward(self, items: list[StepInput], ids: torch.Tensor | None) -> torch.Tensor:
        """One level's forward: logits [R, V]."""
        return self.run(items, ids)

    def _record_length(self, request_id: str, cache: KVCache) -> int:
        """The request's record length after `_sync`: the position its root's children take."""
        return len(cache.tokens)

    def _guess_first(self, tokens: torch.Tensor, logits: torch.Tensor, rows: list[_Row], batch: list[DraftRequest],
                     couple: list[tuple[int, int] | None], depth: int) -> None:
        """A row of a request verified by coupled matching takes its guess of the LLM's coupled sample
        as its first child, then its top-k without it: tokens [R, kmax] changed in place. The
        verifier's token is argmax_v p(v) / E_v with noise E that only the request's key, the
        position and v decide (draws.coupled_sample); the guess is argmax_v q(v) / E_v over the
        drafter's q (the request's sampling transforms, its q_top most likely tokens) with the same
        noise, so it is the LLM's token wherever q is close to p, also where p is flat and its top
        token is not (a top-k draft matches with probability p(token) alone)."""
        at = [i for i, row in enumerate(rows) if couple[row.request] is not None]
        if not at:
            return
        word = mix(np.array([couple[rows[i].request][0] for i in at]),
                   np.array([couple[rows[i].request][1] + depth for i in at]))  # the noise of the children's position
        sent = to_device(torch.from_numpy(np.concatenate([at, word]).astype(np.int64)), logits.device)  # one copy
        index, word = sent[: len(at)], sent[len(at):]
        q = probabilities(logits[index], [batch[rows[i].request].sampling for i in at])
        q_probs, q_ids = q.topk(min(self.q_top, q.shape[1]), dim=-1)  # [C, K], as the verifier's p: unnormalized
        guess = q_ids.gather(1, (q_probs / coupled_noise(word, q.shape[1], q_ids)).argmax(dim=1, keepdim=True))
        top = tokens[index]
        both = torch.cat([guess, top], dim=1)
        repeat = torch.cat([torch.zeros_like(guess, dtype=torch.bool), top == guess], dim=1)
        order = torch.argsort(repeat.int(), dim=1, stable=True)[:, : top.shape[1]]  # the guess, then the rest
        tokens[index] = both.gather(1, order)

    def _follow(self, picked: torch.Tensor | None, kmax: int) -> None:
        """The next level's rows are the children `picked` (indices into this level's [R, kmax]
        children, None: all of them): what a subclass whose rows carry more than a token keeps."""

    def _fed_rows(self, rows: list[_Row]) -> None:
        """The forward just run had these rows (its outputs in this order): what a subclass whose rows carry
        more than a token keeps of them while it drafts ahead."""

    def _reading(self, parents: list[tuple[int, int]]) -> None:
        """The next forward's rows are tree nodes under these (request, node) (-1: the root's row), not the
        children `_follow` picked (drafting ahead feeds the leaves, then each outcome's bonus token): for a
        subclass whose rows carry more than a token."""

    def _expand(self, logits: torch.Tensor, rows: list[_Row], k: list[int], batch: list[DraftRequest],
                keys: list[int | None], depth: int) -> tuple[torch.Tensor, ...]:
        """Children of every row at once: (tokens [R, kmax], drawn [R, kmax] bool (False: past the
        support of q), q_ids [S, K], q_probs [S, K]) with S the rows of requests with sampled drafts."""
        dev = logits.device
        to = lambda x, dtype=torch.long: torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)
        R, kmax = len(rows), max(k)
        drawn = torch.ones(R, kmax, dtype=torch.bool, device=dev)
        greedy = [i for i, row in enumerate(rows) if keys[row.request] is None]
        sampled = [i for i, row in enumerate(rows) if keys[row.request] is not None]
        q_ids = q_probs = torch.zeros(0, self.q_top, device=dev)
        if not sampled:  # every row greedy: its top kmax, no indexing
            return logits.topk(kmax, dim=-1).indices, drawn, q_ids, q_probs
        tokens = torch.zeros(R, kmax, dtype=torch.long, device=dev)
        if greedy:
            g = to(greedy)
            tokens[g] = logits[g].topk(kmax, dim=-1).indices
        s = to(sampled)
        q_ids, q_probs = sparsify(probabilities(logits[s], [batch[rows[i].request].sampling for i in sampled]),
                                  self.q_top)  # [S, K]
        # (key, depth, row index) folded on the host: the device hashes only the draw counters
        key = to(mix(np.array([keys[rows[i].request] for i in sampled]), depth,
                     np.array([rows[i].index for i in sampled])).tolist())[:, None]
        n = q_probs.shape[1]
        q = q_probs.double()
        u = uniform(key, torch.arange(n + kmax, device=dev))  # [S, n + kmax]
        # without replacement: the top kmax of log q + Gumbel noise, in order (Plackett-Luce)
        ordered = (q.log() - torch.log(-torch.log(u[:, :n]))).topk(min(kmax, n), dim=-1).indices
        if n < kmax:
            ordered = torch.cat([ordered, ordered[:, :1].expand(-1, kmax - n)], dim=1)
        # with replacement: kmax inverse-CDF draws
        iid = torch.searchsorted(q.cumsum(-1), u[:, n:] * q.sum(-1, keepdim=True)).clamp(max=n - 1)
        replace = to([batch[rows[i].request].replacement for i in sampled], torch.bool)[:, None]
        pos = torch.where(replace, iid, ordered)
        tokens[s] = q_ids.gather(1, pos)
        valid = q_probs.gather(1, pos) > 0
        if n < kmax:
            valid &= replace | (torch.arange(kmax, device=dev) < n)
        drawn[s] = valid
        return tokens, drawn, q_ids, q_probs

    def _finish(self, batch: list[DraftRequest], caches: list[KVCache], levels: list,
                dynamic: list[_Dynamic | None]) -> tuple[list[TokenTree], list[TokenTree]]:
        """Each request's tree: its nodes drawn, under drawn parents, and of a dynamic tree the kept ones;
        and its raw tree (`_grow_raw`)."""
        raw, alive = self._grow_raw(batch, caches, levels, dynamic, [TokenTree() for _ in batch])
        return [merge([_subtree(tree, [u for u in range(len(tree)) if live[u]])]) for tree, live in zip(raw, alive)], raw

    def _grow_raw(self, batch: list[DraftRequest], caches: list[KVCache], levels: list,
                  dynamic: list[_Dynamic | None], raw: list[TokenTree]) -> tuple[list[TokenTree], list[list[bool]]]:
        """Copy every level's draws to the host at once and add them to each request's raw tree (every
        candidate in level order, -1 where not drawn), its scratch tree's tokens set to them; the raw
        trees, and whether each node is alive (drawn under drawn parents, and kept)."""
        alive: list[list[bool]] = [[True] * len(tree) for tree in raw]
        if not levels:
            return raw, alive
        parts = []
        for _, _, (tokens, drawn, q_ids, q_probs) in levels:
            parts += [tokens.flatten(), drawn.flatten().long(), q_ids.flatten().long(),
                      q_probs.double().flatten().view(torch.int64)]
        values = torch.cat(parts).cpu().tolist()  # the draft's one synchronization and copy
        chunks, at = [], 0
        for part in parts:
            chunks.append(values[at: at + part.numel()])
            at += part.numel()
        keep = [d.keep() if d else None for d in dynamic]
        for level, (rows, k, (tokens, _, q_ids, _)) in enumerate(levels):
            tok, ok, qi, bits = chunks[4 * level: 4 * level + 4]
            qp = struct.unpack(f"<{len(bits)}d", struct.pack(f"<{len(bits)}q", *bits))  # float64 bits back
            kmax, width = tokens.shape[1], q_ids.shape[1]
            s = 0
            for ri, (row, kr) in enumerate(zip(rows, k)):
                tree, live, kept = raw[row.request], alive[row.request], keep[row.request]
                children = []
                for j in range(kr):
                    good = bool(ok[ri * kmax + j]) and (row.node < 0 or tree.tokens[row.node] >= 0)
                    tree.tokens.append(tok[ri * kmax + j] if good else -1)
                    tree.parents.append(row.node)
                    live.append(good and (kept is None or len(tree.tokens) - 1 in kept))
                    if live[-1]:
                        children.append(len(tree.tokens) - 1)
                req = batch[row.request]
                if req.sampling.sampled_drafts:
                    ids, probs = qi[s * width:(s + 1) * width], qp[s * width:(s + 1) * width]
                    support = sum(p > 0 for p in probs)
                    if children:
                        tree.groups.append(DraftGroup(row.node, ids[:support], list(probs[:support]), children,
                                                      req.replacement))
                    s += 1
        for cache, tree, d in zip(caches, raw, dynamic):
            # the cache holds the nodes that went through the SSM (of a fixed tree all but the last
            # level, of a dynamic one those fed); a dead node's token (-1) never matches a committed token
            cache.tree.tokens[:] = [tree.tokens[u] for u in d.fed] if d else tree.tokens[: len(cache.tree)]
        return raw, alive


class _Dynamic:
    """One request's dynamic tree while it grows: the path scores of its candidates."""

    def __init__(self, expansion: list[int]):
        self.widths = list(itertools.accumulate(expansion, lambda a, b: a * b))  # w_1 .. w_m
        self.top = min(max(self.widths), DYNAMIC_TOP)
        self.score: dict[int, float] = {-1: 0.0}  # node -> log-probability of its path (the root's: 0)
        self.fed: list[int] = []  # the nodes that went through the model, in its cache's order
        self._slots: dict[int, int] = {-1: -1}  # node -> its index in the cache's scratch tree

    def feed(self, nodes: list[int]) -> None:
        for u in nodes:
            self._slots[u] = len(self.fed)
            self.fed.append(u)

    def slot(self, node: int) -> int:
        return self._slots[node]

    def level(self, depth: int, candidates: list[tuple[int, int, float]], last: bool) -> list[int]:
        """Score a level's candidates (parent, node, log-probability); the positions among them of
        the next frontier, in order (none after the last level)."""
        for parent, node, logp in candidates:
            self.score[node] = self.score[parent] + logp
        if last:
            return []
        best = sorted(range(len(candidates)), key=lambda u: (-self.score[candidates[u][1]], u))
        return sorted(best[: self.widths[depth]])  # as many as the fixed tree has at the candidates' depth

    def keep(self) -> set[int]:
        nodes = sorted((u for u in self.score if u >= 0), key=lambda u: (-self.score[u], u))
        return set(nodes[: sum(self.widths)])


def _path_scores(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int]) -> dict[int, list[float]]:
    """Log-probabilities of the drafted children `tokens` [R, kmax] of the rows `rows`, on the host."""
    if not rows:
        return {}
    at = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    values = logits[at].float().log_softmax(-1).gather(1, tokens[at]).cpu().tolist()
    return dict(zip(rows, values))


def _candidates(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `n` most likely tokens [R, n] and their log-probabilities [R, n] (float32)."""
    top = logits.topk(min(n, logits.shape[-1]), dim=-1)
    return top.indices, top.values.float() - logits.float().logsumexp(-1, keepdim=True)


def _likeliest(tree: TokenTree, q: dict[int, list[tuple[int, float]]], n: int) -> list[tuple[int, int]]:
    """The `n` likeliest outcomes of verifying `tree` by the drafter's log-probabilities `q` (node, -1 for
    the root -> its most likely tokens): (u, b), the path to node u accepted and b, none of u's children,
    the LLM's bonus token; its log-probability is the path's and b's at u. Likeliest first, ties in order."""
    logp, children = {-1: 0.0}, {-1: set()}
    for u, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
        at = dict(q[p])
        logp[u] = logp[p] + at.get(t, min(at.values()))  # a child ranked past the list ties its last
        children[u] = set()
        children[p].add(t)
    scored = [(logp[u] + lq, u, b) for u in (-1, *range(len(tree))) for b, lq in q[u] if b not in children[u]]
    return [(u, b) for _, u, b in sorted(scored, key=lambda c: -c[0])[:n]]


def _below(tree: TokenTree, node: int) -> TokenTree:
    """The nodes under `node`, renumbered as a tree whose root is `node` (DFS order, as `merge` gives)."""
    new, tokens, parents = {node: -1}, [], []
    for u in range(node + 1, len(tree)):
        if tree.parents[u] in new:
            new[u] = len(tokens)
            tokens.append(tree.tokens[u])
            parents.append(new[tree.parents[u]])
    return merge([TokenTree(tokens, parents)])


def _subtree(tree: TokenTree, keep: list[int]) -> TokenTree:
    """The nodes `keep` (closed under parents, in order) renumbered from 0."""
    new = {u: i for i, u in enumerate(keep)}
    new[-1] = -1
    return TokenTree([tree.tokens[u] for u in keep], [new[tree.parents[u]] for u in keep],
                     [DraftGroup(new[g.parent], g.q_ids, g.q_probs, [new[c] for c in g.children], g.replacement)
                      for g in tree.groups])
