"""Context lookup: a drafter without a model, proposing what followed the request's own earlier text.

Code repeats itself (names, call patterns, whole lines), and a small LLM's greedy continuations loop.
A one-layer SSM cannot copy from its context (that takes two layers: one to find where the current
token occurred before, one to read what came next), so it misses exactly these tokens. Context
lookup ("prompt lookup decoding") drafts them: the tokens that followed the latest earlier
occurrence of the record's last n tokens (the longest n <= max_n that occurred before), as a chain,
continued through its own draft when it reaches the end of the record (a loop goes on looping).
Its tree is merged with the SSMs' trees like any other drafter's.

Under sampling each drafted token is a draw from a point mass (q = 1 on that token): multi-step
speculative sampling then accepts it with probability p(x) and otherwise goes on with p without x,
which keeps the LLM's distribution exactly; being deterministic, the draft is independent of every
SSM's draws.

A `ContextIndex` holds one request's record and, for every n-gram in it (n <= max_n), where the
token after its latest occurrence stands: updated as tokens are committed, so a draft costs one
dictionary lookup per n and a few list reads, whatever the record's length.
"""

from __future__ import annotations

from .tree import DraftGroup, TokenTree

CHAIN_TOKENS = 8  # the longest chain drafted per step by default: rows are all a chain costs, and it is often right for long
MAX_N = 3  # the longest suffix looked up (longer ones agreed no more often with the fixture LLM's continuations)


class ContextIndex:
    def __init__(self, max_n: int = MAX_N):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            i = len(self.tokens)
            for n in range(1, min(self.max_n, i) + 1):  # the n-grams ending just before t now have a next token
                self.after[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(t)

    def draft(self, depth: int) -> list[int]:
        """Up to `depth` tokens that follow the record's longest suffix seen before (none if even
        its last token is new)."""
        rec = self.tokens
        for n in range(min(self.max_n, len(rec)), 0, -1):
            j = self.after.get(tuple(rec[len(rec) - n:]))
            if j is not None:
                out: list[int] = []
                for k in range(depth):  # past the record's end, the draft's own tokens
                    out.append(rec[j + k] if j + k < len(rec) else out[j + k - len(rec)])
                return out
        return []


def chain_tree(tokens: list[int], groups: bool) -> TokenTree:
    """The draft `tokens` as a chain below the root; with `groups` (for MSS) each node is recorded
    as a draw from the point mass on its token."""
    parents = list(range(-1, len(tokens) - 1))
    draws = [DraftGroup(p, [t], [1.0], [u], False) for u, (t, p) in enumerate(zip(tokens, parents))] if groups else []
    return TokenTree(list(tokens), parents, draws)


def chain_outcome(chain: list[int], room: int, tokens: list[int]) -> tuple[int, int] | None:
    """How a step went for a request's chain, as the controller measures it: (the chain's tokens
    the verified `tokens` (accepted path, then the LLM's own token) agree with, the most tokens the
    chain could have held), or None where lookup found no chain."""
    if not chain:
        return None
    return agreed(chain, tokens), room


def agreed(chain: list[int], tokens: list[int]) -> int:
    """How many of a chain's tokens the verified `tokens` (accepted path, then the LLM's own token)
    agree with, from the first."""
    n = 0
    for drafted, verified in zip(chain, tokens[:-1]):
        if drafted != verified:
            break
        n += 1
    return n
