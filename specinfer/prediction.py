"""Predicted outputs: a drafter without a model, proposing the text the client expects the reply to repeat.

OpenAI's Predicted Outputs: a client that knows most of the reply (a file it asks to have edited, a
document to revise, last turn's answer to amend) sends it with the request as its prediction. Where
the output follows the prediction, the prediction's next tokens are drafted as a chain, which the LLM
verifies like any draft: the output is exactly what it would be without the prediction, only sooner.

A `Prediction` keeps a cursor, where in the prediction the output stands (at first its start). A
committed token that is the prediction's token at the cursor moves it on. One that is not, right
after one that was, is taken as a substitution (a renamed word, another indent): the cursor moves on
as well, and the prediction's token is drafted as the output's from then on, wherever it stands
(the same word renamed everywhere), until the output takes the prediction's own token there again.
Any other token loses the cursor. Lost, it is found again from the output's last tokens, as context
lookup finds its chains: after the output's longest suffix (MIN_N <= n <= MAX_N) that occurs in the
prediction, at its first occurrence that starts at or past `mark` (how far the output has followed
the prediction: an edit replaced a span, and the output goes on with what comes after it), else at
its first occurrence.

Chains grow and shrink as TCP's window does: the first is START_TOKENS long, one accepted whole makes
the next twice as long (up to the engine's cap, `PREDICTION_TOKENS`), and a lost cursor halves it
(down to START_TOKENS). A prediction that holds soon fills the cap; one that does not, or a place
found by coincidence, costs few rows.

Usage counts as OpenAI's `completion_tokens_details`: `accepted` drafted tokens the LLM accepted,
`rejected` drafted tokens it did not (verified, so paid for, and not in the output). Prediction
tokens never drafted count in neither.
"""

from __future__ import annotations

import bisect

from .lookup import agreed

# the longest chain drafted per step, by the kind of device the verifier runs on: a CPU step of 17 rows
# costs 1.37x a step of one (bench/results/rows_cpu.md), a GPU step of a 64-node tree 1.24x at batch 1
# (bench/results/runtime_h200.md)
PREDICTION_TOKENS = {"cpu": 16, "cuda": 64}
START_TOKENS = 2  # the first chain, and the shortest after a lost cursor halved it
MAX_N = 4  # the longest suffix of the output looked up in the prediction
MIN_N = 2  # and the shortest: one token is found in too many places (an indent, a bracket, `return`)


def prediction_tokens(device: str) -> int:
    """The longest chain for a verifier on `device` ("cuda", "cpu"; any other kind as a CPU)."""
    return PREDICTION_TOKENS.get(device, PREDICTION_TOKENS["cpu"])


class Prediction:
    def __init__(self, tokens: list[int] | tuple[int, ...]):
        self.tokens = list(tokens)
        self.cursor: int | None = 0  # where the output stands in the prediction (None: lost)
        self.mark = 0  # how far the output has followed the prediction token by token
        self.sure = True  # the output's last token was the prediction's at the cursor (or nothing yet)
        self.swaps: dict[int, int] = {}  # the prediction's token -> the output's in its place, where they differed
        self.swapped: tuple[int, int | None] | None = None  # a substitution not confirmed yet: (token, swap before)
        self.run = START_TOKENS  # the next chain's length
        self.accepted = 0
        self.rejected = 0
        self.after: dict[tuple[int, ...], list[int]] | None = None  # n-gram -> the index after each occurrence

    @property
    def drafting(self) -> bool:
        """Whether the cursor stands somewhere with a token after it (the next step drafts)."""
        return self.cursor is not None and self.cursor < len(self.tokens)

    def draft(self, limit: int) -> list[int]:
        """The chain this step: the prediction's next tokens from the cursor, at most `limit`."""
        if not self.drafting or limit <= 0:
            return []
        return [self.swaps.get(t, t) for t in self.tokens[self.cursor:self.cursor + min(self.run, limit)]]

    def commit(self, emitted: list[int], generated: list[int], chain: list[int], verified: list[int]
               ) -> tuple[int, int]:
        """A step's outcome: `emitted` its tokens appended to the output (`generated`, them included),
        `chain` what it verified of the prediction's draft (maybe nothing), `verified` the LLM's
        accepted path and own token (emitted may end sooner, at the end of the request). Returns the
        step's (accepted, rejected) prediction tokens."""
        held = agreed(chain, verified)
        step = (min(held, len(emitted)), len(chain) - held)
        self.accepted += step[0]
        self.rejected += step[1]
        if chain and held == len(chain):
            self.run = max(self.run, 2 * len(chain))
        for t in emitted:
            if not self.drafting:
                self.cursor = None
                continue
            own = self.tokens[self.cursor]
            if t == self.swaps.get(own, own) or t == own:
                if t == own:
                    self.swaps.pop(own, None)
                self.cursor += 1
                self.mark = max(self.mark, self.cursor)
                self.sure, self.swapped = True, None
            elif self.sure:  # a substitution (a renamed word, another indent): the rest may follow, and
                self.swapped = (own, self.swaps.get(own))
                self.swaps[own] = t  # the same word elsewhere may be renamed too
                self.cursor += 1
                self.sure = False
            else:
                if self.swapped is not None:  # it was an insertion, not a substitution
                    own, before = self.swapped
                    if before is None:
                        self.swaps.pop(own, None)
                    else:
                        self.swaps[own] = before
                self.cursor, self.swapped = None, None
        if self.cursor is None:
            self.cursor = self._find(generated)
            self.sure = self.cursor is not None  # found by the output's last tokens: a substitution may follow
            self.run = max(START_TOKENS, self.run // 2)
        return step

    def _find(self, generated: list[int]) -> int | None:
        """Where the output stands in the prediction, from its last tokens (None: nowhere)."""
        if self.after is None:  # built when first needed: most predictions that hold are never lost
            self.after = {}
            for i in range(len(self.tokens)):
                for n in range(1, min(MAX_N, i + 1) + 1):
                    self.after.setdefault(tuple(self.tokens[i + 1 - n:i + 1]), []).append(i + 1)
        for n in range(min(MAX_N, len(generated)), MIN_N - 1, -1):
            ends = self.after.get(tuple(generated[len(generated) - n:]))
            if ends:
                i = bisect.bisect_left(ends, self.mark + n)  # an occurrence that starts at or past the mark
                return ends[i] if i < len(ends) else ends[0]
        return None
