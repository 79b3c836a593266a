"""Token tree verification (SpecInfer section 4.3): which path of each draft tree the LLM accepts,
for a whole batch at once, as tensor operations on the device that holds the logits.

Every rule walks down from the root. At the current node the LLM's next-token distribution (one row
of the tree-decoding output) decides whether one of the node's children is accepted; if one is, the
walk descends into it, otherwise it stops and the LLM emits one token of its own, the *bonus*.
A step therefore emits len(path) + 1 tokens, and the bonus becomes the root of the next tree.

Greedy: accept the child whose token is the LLM's argmax. Output equals incremental greedy
decoding token for token. Batched: node u matches when its token is the argmax at its parent; it
is accepted when it and all its ancestors match (one gather along each node's chain of ancestors,
laid out on the host); the deepest accepted node's argmax is the bonus.

Coupled (sampled requests, the default): the same walk with the LLM's coupled sample
(draws.coupled_sample, keyed by the request's seed and the record position) in place of the
argmax: accept the child whose token equals it, else it is the bonus. Output equals plain seeded
sampling token for token, whatever was drafted. A child is accepted with probability p(its token),
so for drafts that are an SSM's top-k (deterministic) a node accepts with p(x_1) + ... + p(x_k),
which is what MSS gives point-mass proposals. The noise is no secret of the verifier's: a drafter
races its own q against it and drafts that guess first (speculator.py), which is the LLM's token
wherever q is close to p, also where p is flat. Batched: the coupled sample of every row of every
tree at once, then the greedy rule's matching with it in place of the argmax. The noise belongs to the
request and the position a row predicts, so it is made once per request and depth of its tree. The ops
dispatched grow with neither the batch nor the depth (on a GPU, launches are what a step of small
kernels costs); the work is elementwise over the trees' rows [M, V].

Stochastic, multi-step speculative sampling (MSS; sampled requests with `mss` set). p: the LLM's
distribution at the node after the request's sampling transforms. The node's draft groups are tried in order; each draw x from q:
    r ~ U(0, 1);  accept x if r <= p(x) / q(x)
    otherwise     p <- normalize(max(0, p - q))                 (residual)
                  q <- normalize(q with x removed)              (only for draws without replacement)
If every draw is rejected the bonus is sampled from the final p. Every emitted token then follows
the LLM's own distribution exactly, for i.i.d. draws (replacement), for sequential draws without
replacement from one q (as in SpecTr / Sequoia), and for any mix of groups from several SSMs,
because each draw's q is exactly the distribution it was drawn from given the draws before it.
Batched: every request walks at once; the loops run over tree depth and over the draws of one
node (both bounded by the tree shape, not by the batch), each step a few ops over [B, V].
r and the bonus come from the counter-based generator (draws.uniform) keyed by the request's
seed and position, counted by depth and draw, so a request's tokens do not depend on its batch.

Only the verdicts leave the device: per request the accepted nodes and the bonus, one copy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from .devices import to_device
from .draws import coupled_noise, mix, probabilities, sample, uniform
from .sampling import SamplingParams, sample_key, stream_key
from .tree import TokenTree, depths

BONUS_DRAW = 1 << 16  # the draw counter of the bonus token (real draws of a node count from 0)


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, the root's child first
    tokens: list[int]  # the accepted nodes' tokens followed by the bonus token
    features: "Features | None" = None  # the committed rows' features, for a request that asked (verifier.py)
    logprobs: list | None = None  # of each token (logprobs.TokenLogprob), for a request that asked
    prompt_logprobs: list | None = None  # of the step's new committed tokens but the first, for a request that asked
    cached_tokens: int = 0  # of a new request's tokens, those whose K/V came from the prefix cache (kv_cache.py)


def verify_batch(trees: list[TokenTree], logits: torch.Tensor, row_starts: list[int],
                 sampling: list[SamplingParams], positions: list[int]) -> list[Verdict]:
    """logits [R, V]: request b's rows are row_starts[b] (after the root) and row_starts[b] + 1 + u
    (after node u). positions[b]: the request's record length, which keys its random numbers.
    Returns each request's verdict after one copy of the verdicts to the host."""
    return verdicts_of(trees, decide_batch(trees, logits, row_starts, sampling, positions))


def decide_batch(trees: list[TokenTree], logits: torch.Tensor, row_starts: list[int],
                 sampling: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """`verify_batch`'s work on the device, queued and not waited for: [B, 1 + n] long, each
    request's bonus token, then a flag per tree node (on its accepted path)."""
    n = max((len(t) for t in trees), default=0)
    dev = logits.device
    parts = {_greedy: [], _coupled: [], _stochastic: []}
    for b, s in enumerate(sampling):
        parts[_greedy if s.greedy else _stochastic if s.mss else _coupled].append(b)
    rules = [(part, rule) for rule, part in parts.items() if part]
    # [B, bonus + accepted flags]; when the whole batch follows one rule, that rule's output as it is
    out = torch.zeros(len(trees), 1 + n, dtype=torch.long, device=dev) if len(rules) != 1 else None
    for part, rule in rules:
        keys = [sample_key(sampling[b].seed) for b in part] if rule is _coupled else None
        table = _build([trees[b] for b in part], [row_starts[b] for b in part], n, dev, [positions[b] for b in part], keys)
        decided = rule(table, logits, [sampling[b] for b in part], [positions[b] for b in part])
        if out is None:
            out = decided
        else:
            out[to_device(torch.tensor(part), dev)] = decided
    return out


def verdicts_of(trees: list[TokenTree], out: torch.Tensor) -> list[Verdict]:
    """The verdicts of `decide_batch`'s output, after one copy to the host."""
    verdicts = []
    for tree, row in zip(trees, out.cpu().tolist()):  # the step's one synchronization
        path = [u for u in range(len(tree)) if row[1 + u]]  # a chain, so index order is root first
        verdicts.append(Verdict(path, [tree.tokens[u] for u in path] + [row[0]]))
    return verdicts


@dataclass
class _Table:
    """Trees padded to n nodes; node -1 (the root) is column 0 of `rows`, node u column u + 1. Laid
    out on the host (numpy, a few calls per tree level whatever the batch) and sent in one copy."""

    tokens: torch.Tensor  # [B, n] (padding: -1, never a token)
    parents: torch.Tensor  # [B, n] (padding: -1)
    rows: torch.Tensor  # [B, 1 + n] logits row of the root and of each node (padding: the root's)
    chain: torch.Tensor  # [B, n, levels] each node's column, then its ancestors' (0: none left)
    trees: list[TokenTree]
    depth: int  # the deepest node's depth
    coupled: "_Rows | None" = None  # with keys: what the coupled rule needs


@dataclass
class _Rows:
    """The trees' rows without padding (M: each tree's root, then its nodes) and the sampling keys."""

    real: torch.Tensor  # [M] their logits rows
    at: torch.Tensor  # [B, 1 + n] each table column's place among them (padding: its root's)
    level: torch.Tensor  # [M] each one's noise row: its request's, at its depth (the root's: 0)
    owner: list[int]  # [M] the request of each
    word: torch.Tensor  # [L] the noise rows' words: each request's sampling key, once per depth of its tree,
    # with the record position that depth's rows predict (draws.mix, made on the host)


def _build(trees: list[TokenTree], row_starts: list[int], n: int, dev, positions: list[int],
           keys: list[int] | None = None) -> _Table:
    """The table of the trees, and with `keys` (the coupled rule's) its `_Rows`."""
    B = len(trees)
    tokens, parents = np.full((B, n), -1, dtype=np.int64), np.full((B, n), -1, dtype=np.int64)
    for b, t in enumerate(trees):
        if t.tokens:
            tokens[b, : len(t)] = t.tokens
            parents[b, : len(t)] = t.parents
    # each node's chain of ancestors, one column per level, as indices into the flat [B * n] nodes
    request, chain = np.arange(B)[:, None], np.zeros((B, n, 1), dtype=np.int64)
    if n:
        offset = request * n
        up = np.append(np.where(parents >= 0, parents + offset, -1), -1)  # [B * n + 1]: index -1 stays -1
        cols, cur = [], np.arange(B * n)
        while cur.max() >= 0:
            cols.append(cur)
            cur = up[cur]
        up_chain = np.stack(cols, axis=1).reshape(B, n, len(cols))
        chain = np.where(up_chain >= 0, up_chain - offset[:, :, None] + 1, 0)  # columns of `_match`'s table
    sizes = np.array([len(t) for t in trees], dtype=np.int64)
    node_depths = (chain > 0).sum(axis=2) * (np.arange(n) < sizes[:, None])  # padding: 0
    depth = int(node_depths.max(initial=0))
    column = np.arange(1 + n)
    kept = column <= sizes[:, None]  # [B, 1 + n]: the root and the tree's nodes
    rows = np.asarray(row_starts, dtype=np.int64)[:, None] + np.where(kept, column, 0)
    parts = [tokens, parents, rows, chain]
    if keys is not None:  # every request's rows, and one noise row per request and depth it has
        place = np.cumsum(kept.ravel()).reshape(B, 1 + n) - 1
        row_depths = np.concatenate([np.zeros((B, 1), dtype=np.int64), node_depths], axis=1)
        levels = row_depths.max(axis=1) + 1  # [B]
        first = np.cumsum(levels) - levels
        ahead = np.arange(levels.sum()) - np.repeat(first, levels)  # each noise row's depth
        parts += [rows[kept], np.where(kept, place, place[:, :1]), (first[:, None] + row_depths)[kept],
                  mix(np.repeat(np.array(keys, dtype=np.int64), levels),
                      np.repeat(np.array(positions, dtype=np.int64), levels) + ahead).astype(np.int64)]
    flat = to_device(torch.from_numpy(np.concatenate([p.ravel() for p in parts])), dev)
    ends = list(itertools.accumulate(p.size for p in parts))
    sent = [flat[a:b].view(p.shape) for a, b, p in zip([0, *ends], ends, parts)]
    coupled = None
    if keys is not None:
        real, at, level, word = sent[4:]
        coupled = _Rows(real, at, level, np.repeat(np.arange(B), sizes + 1).tolist(), word)
    return _Table(*sent[:4], trees, depth, coupled)


def _match(t: _Table, target: torch.Tensor) -> torch.Tensor:
    """target [B, 1 + n]: the token the LLM takes after the root and after each node. Node u matches
    when its token is the target at its parent; it is accepted when it and all its ancestors match
    (one gather along `chain`, whatever the depth); the deepest accepted node's target is the bonus.
    Returns [B, 1 + n]: the bonus, then each node's accepted flag."""
    B, n, d = t.chain.shape
    if not n:  # no tree in the batch: the bonus is the target at the root
        return target[:, :1]
    match = t.tokens == target.gather(1, t.parents + 1)  # [B, n]
    settled = torch.cat([torch.ones_like(match[:, :1]), match], dim=1)  # column 0: no node left, true
    ok = settled.gather(1, t.chain.view(B, n * d)).view(B, n, d).all(dim=2)  # [B, n]
    # parents come before children, so the accepted path's deepest node has its largest index
    deepest = (ok.long() * torch.arange(1, n + 1, device=ok.device)).amax(dim=1, keepdim=True)
    return torch.cat([target.gather(1, deepest), ok.long()], dim=1)


def _greedy(t: _Table, logits: torch.Tensor, sampling, positions) -> torch.Tensor:
    return _match(t, logits.argmax(dim=-1)[t.rows])  # the LLM's argmax after the root and each node


def _coupled(t: _Table, logits: torch.Tensor, sampling: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """Every row's coupled sample at once (ops do not grow with the depth): a row's noise is its
    request's key at the record position the row predicts, so a request's rows of one depth share
    one noise row, made once (a request without a tree: one)."""
    r = t.coupled
    p = probabilities(logits[r.real], [sampling[b] for b in r.owner])  # [M, V]
    noise = coupled_noise(r.word, logits.shape[1])  # [L, V]
    return _match(t, (p / noise[r.level]).argmax(dim=-1)[r.at])


@dataclass
class _Walk:
    """Every request's walk down its tree at once: the current node, the accepted nodes, whether
    it has stopped and, once it has, the bonus token."""

    batch: torch.Tensor  # [B] 0..B-1
    cur: torch.Tensor  # [B] the current node + 1 (0: the root)
    accepted: torch.Tensor  # [B, n] bool
    done: torch.Tensor  # [B] bool
    bonus: torch.Tensor  # [B]

    @classmethod
    def start(cls, B: int, n: int, dev) -> "_Walk":
        zeros = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=dev)
        return cls(torch.arange(B, device=dev), zeros(B), zeros(B, n, dtype=torch.bool), zeros(B, dtype=torch.bool),
                   zeros(B))

    def rows(self, t: _Table) -> torch.Tensor:
        """The logits rows of the current nodes."""
        return t.rows[self.batch, self.cur]

    def advance(self, child: torch.Tensor, bonus: torch.Tensor) -> None:
        """child [B]: the current node's accepted child (-1: none; then `bonus` [B] ends the walk)."""
        took = (child >= 0) & ~self.done
        stop = ~self.done & ~took
        self.bonus = torch.where(stop, bonus, self.bonus)
        self.accepted |= took[:, None] & (torch.arange(self.accepted.shape[1], device=child.device) == child[:, None])
        self.cur = torch.where(took, child + 1, self.cur)
        self.done |= stop

    def verdicts(self) -> torch.Tensor:
        return torch.cat([self.bonus[:, None], self.accepted.long()], dim=1)


def _stochastic(t: _Table, logits: torch.Tensor, sampling: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    dev = logits.device
    B, n = t.tokens.shape
    draws = _Draws.build(t, dev)
    keys = [stream_key(s.seed, "verify", pos) for s, pos in zip(sampling, positions)]
    key = to_device(torch.tensor(keys, dtype=torch.long), dev)
    walk = _Walk.start(B, n, dev)
    for depth in range(t.depth + 1):
        p = probabilities(logits[walk.rows(t)], sampling).double()  # [B, V] at the current nodes
        q_ids = torch.zeros(B, draws.q_ids.shape[1], dtype=torch.long, device=dev)
        q = torch.zeros(B, draws.q_ids.shape[1], dtype=torch.float64, device=dev)
        child = torch.full((B,), -1, dtype=torch.long, device=dev)
        start = draws.start.gather(1, walk.cur[:, None])[:, 0]
        count = draws.count.gather(1, walk.cur[:, None])[:, 0]
        widest = draws.widest[depth]
        counters = to_device(torch.tensor([*range(widest), BONUS_DRAW]), dev)
        r = uniform(key[:, None], depth, counters)  # [B, widest + 1]: each draw's r, then the bonus's
        for j in range(widest):
            live = (j < count) & ~walk.done & (child < 0)
            d = (start + j).clamp(max=draws.child.shape[1] - 1)[:, None]
            g, x_node, first = draws.group.gather(1, d)[:, 0], draws.child.gather(1, d)[:, 0], draws.first.gather(1, d)
            x = t.tokens.gather(1, x_node[:, None]).clamp(min=0)  # [B, 1] (padding: any token, not live)
            q_ids = torch.where(first, draws.q_ids[g], q_ids)  # a group's first draw: q is the group's
            q = torch.where(first, draws.q_probs[g], q)
            qx = (q * (q_ids == x)).sum(dim=1)
            px = p.gather(1, x)[:, 0]
            take = live & (r[:, j] * qx <= px)
            child = torch.where(take, x_node, child)
            reject = (live & ~take)[:, None]
            p = torch.where(reject, _residual(p, torch.zeros_like(p).scatter_add(1, q_ids, q)), p)
            without = q.masked_fill(q_ids == x, 0.0)
            left = without.sum(dim=1, keepdim=True)
            q = torch.where(reject & ~draws.replacement[g][:, None] & (left > 0), without / left, q)
        walk.advance(child, sample(p, r[:, -1]))
    return walk.verdicts()


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) per row of [B, V]. Its mass is zero only when p <= q everywhere
    (then the draw was certain to be accepted); rounding can still get there, and then p stays."""
    residual = (p - q).clamp(min=0.0)
    mass = residual.sum(dim=1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)


@dataclass
class _Draws:
    """Every draw of every tree, per request in the order MSS tries them: by node, then by group
    (in the tree's group order), then in draw order. Draws of node u+1's column are
    start[b, u + 1] .. start + count - 1."""

    child: torch.Tensor  # [B, M] the drawn node
    group: torch.Tensor  # [B, M] its group (row of q_ids / q_probs)
    first: torch.Tensor  # [B, M] bool: the first draw of its group
    start: torch.Tensor  # [B, 1 + n]
    count: torch.Tensor  # [B, 1 + n]
    q_ids: torch.Tensor  # [G, K] each group's sparse q (padding: id 0, probability 0)
    q_probs: torch.Tensor  # [G, K] float64
    replacement: torch.Tensor  # [G] bool
    widest: list[int]  # per depth (the root's: 0), the most draws of one node there

    @classmethod
    def build(cls, t: _Table, dev) -> "_Draws":
        n = t.tokens.shape[1]
        child, group, first, start, count = [], [], [], [], []
        q_ids, q_probs, replacement = [[0]], [[0.0]], [False]  # group 0: padding
        widest = [0] * (1 + t.depth)
        for tree in t.trees:
            by_node: list[list] = [[] for _ in range(1 + n)]
            for g in tree.groups:
                gi = len(q_ids)
                q_ids.append(g.q_ids)
                q_probs.append(g.q_probs)
                replacement.append(g.replacement)
                by_node[g.parent + 1] += [(c, gi, i == 0) for i, c in enumerate(g.children)]
            flat = [d for node in by_node for d in node]
            child.append([c for c, _, _ in flat])
            group.append([g for _, g, _ in flat])
            first.append([f for _, _, f in flat])
            count.append([len(node) for node in by_node])
            for d, c in zip([0, *depths(tree.parents)], count[-1]):
                widest[d] = max(widest[d], c)
            start.append([0, *itertools.accumulate(count[-1][:-1])])
        m = max(1, max(map(len, child)))
        k = max(map(len, q_ids))
        pad = lambda rows, w, v: [r + [v] * (w - len(r)) for r in rows]
        to = lambda x, dtype=torch.long: to_device(torch.tensor(x, dtype=dtype), dev)
        return cls(to(pad(child, m, 0)), to(pad(group, m, 0)), to(pad(first, m, False), torch.bool),
                   to(start), to(count), to(pad(q_ids, k, 0)), to(pad(q_probs, k, 0.0), torch.float64),
                   to(replacement, torch.bool), widest)
