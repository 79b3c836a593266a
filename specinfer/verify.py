"""Token tree verification (SpecInfer section 4.3): which path of a draft tree the LLM accepts.

Both rules walk down from the root. At the current node the LLM's next-token distribution (one row
of the tree-decoding output) decides whether one of the node's children is accepted; if one is, the
walk descends into it, otherwise it stops and the LLM emits one token of its own, the *bonus*.
A step therefore emits len(path) + 1 tokens, and the bonus becomes the root of the next tree.

Greedy: accept the child whose token is the LLM's argmax. Output equals incremental greedy
decoding token for token.

Stochastic, multi-step speculative sampling (MSS). p: the LLM's distribution at the node after the
request's sampling transforms. The node's draft groups are tried in order; each draw x from q:
    r ~ U(0, 1);  accept x if r <= p(x) / q(x)
    otherwise     p <- normalize(max(0, p - q))                 (residual)
                  q <- normalize(q with x removed)              (only for draws without replacement)
If every draw is rejected the bonus is sampled from the final p. Every emitted token then follows
the LLM's own distribution exactly, for i.i.d. draws (replacement), for sequential draws without
replacement from one q (as in SpecTr / Sequoia), and for any mix of groups from several SSMs,
because each draw's q is exactly the distribution it was drawn from given the draws before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TokenTree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, the root's child first
    tokens: list[int]  # the accepted nodes' tokens followed by the bonus token


def _verdict(tree: TokenTree, path: list[int], bonus: int) -> Verdict:
    return Verdict(path, [tree.tokens[u] for u in path] + [bonus])


def verify_greedy(tree: TokenTree, argmax: list[int]) -> Verdict:
    """argmax[0]: the LLM's argmax after the root; argmax[1 + u]: after node u."""
    assert len(argmax) == len(tree) + 1
    path, u = [], -1
    while True:
        target = argmax[u + 1]
        child = tree.child_with_token(u, target)
        if child is None:
            return _verdict(tree, path, target)
        path.append(child)
        u = child


def verify_stochastic(tree: TokenTree, probs: torch.Tensor, gen: torch.Generator) -> Verdict:
    """probs [1 + n, V]: the LLM's transformed distribution after the root (row 0) and after each
    node u (row 1 + u). gen: the request's verification generator."""
    assert probs.shape[0] == len(tree) + 1, (probs.shape, len(tree))
    path, u = [], -1
    while True:
        p = probs[u + 1].double()
        accepted = None
        for group in tree.groups_of(u):
            q = torch.zeros_like(p)
            q[group.q_ids] = torch.tensor(group.q_probs, dtype=p.dtype)
            for child in group.children:
                x = tree.tokens[child]
                r = torch.rand((), generator=gen, dtype=torch.float64)
                if r * q[x] <= p[x]:
                    accepted = child
                    break
                p = _normalized(torch.clamp(p - q, min=0.0), fallback=p)
                if not group.replacement:
                    q[x] = 0.0
                    q = _normalized(q, fallback=q)
            if accepted is not None:
                break
        if accepted is None:
            bonus = int(torch.multinomial(p, 1, generator=gen))
            return _verdict(tree, path, bonus)
        path.append(accepted)
        u = accepted


def _normalized(v: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    # The residual has zero mass only when p <= q everywhere, in which case the draw is accepted
    # with probability 1; rounding can still get here, and then p is left as it was.
    s = v.sum()
    return v / s if s > 0 else fallback
