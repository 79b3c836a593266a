"""Tree-shape search in the spirit of Sequoia: pick the expansion config that maximizes expected
tokens per LLM step per unit of step cost, from measured acceptance rates and measured costs.

Acceptance model (greedy): p[r] is the probability that the LLM's next token is the SSM's r-th
most likely token, measured along the LLM's own greedy continuations. Assuming it is the same at
every depth and independent across depths (Sequoia's positional acceptance assumption), a node
reached through ranks r_1..r_d is on the accepted path with probability p[r_1] * ... * p[r_d], so
for <k_1, ..., k_m>, with S(k) = p[1] + ... + p[k]:

    E[tokens per step] = 1 + sum_{d=1..m} prod_{i=1..d} S(k_i)

Cost model (measured on this machine at batch 1): a step costs the verifier's forward over
1 + n rows (n tree nodes) plus one SSM forward per tree level over that level's parents,

    cost = verify(1 + n) + sum_{d=1..m} draft(width_{d-1})

with verify and draft timed at a grid of row counts and linearly interpolated between them: on a
CPU a step's cost is not linear in its rows (a few rows cost about what one does: per-op overhead
and oneDNN's products, Dense.pack), so a straight line through few sizes would misjudge the small trees.

Run alone: `specinfer bench --search-tree`.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch

from specinfer.model import LlamaModel, StepInput, spread_vocab
from specinfer.tree import tree_size

from .report import median_ms


def expected_tokens_per_step(expansion: list[int], p: list[float]) -> float:
    total, reach = 1.0, 1.0
    for k in expansion:
        reach *= sum(p[:k])
        total += reach
    return total


@torch.no_grad()
def rank_acceptance(llm, ssm, sequences: list[list[int]], starts: list[int], max_rank: int = 8,
                    vocab: list[int] | None = None) -> list[float]:
    """p[r-1] for r = 1..max_rank from teacher-forced forwards of two transformers models over
    sequences (prompt + the LLM's greedy continuation), at positions from starts[i] on; the SSM
    ranks only the tokens of its draft vocabulary `vocab` when it has one, as it does when it drafts."""
    hits, total = [0] * max_rank, 0
    ids_kept = None if vocab is None else torch.tensor(vocab)
    for seq, start in zip(sequences, starts):
        ids = torch.tensor([seq])
        target = llm(ids).logits[0, start - 1 : -1].argmax(-1)  # the LLM's next token at each position
        scores = ssm(ids).logits[0, start - 1 : -1]
        if ids_kept is not None:
            scores = spread_vocab(scores[:, ids_kept], ids_kept, scores.shape[-1])
        ranks = scores.argsort(-1, descending=True)[:, :max_rank]
        match = (ranks == target[:, None]).int()  # [positions, max_rank]
        for r in range(max_rank):
            hits[r] += int(match[:, r].sum())
        total += len(target)
    return [h / total for h in hits]


@dataclass
class CostModel:
    verify: dict[int, float]  # rows in a verifier step (bonus + tree nodes) -> ms
    draft: dict[int, float]  # rows in an SSM level (its parents) -> ms

    def step_ms(self, expansion: list[int]) -> float:
        cost, width = interpolate(self.verify, 1 + tree_size(expansion)), 1
        for k in expansion:
            cost += interpolate(self.draft, width)
            width *= k
        return cost


def interpolate(points: dict[int, float], x: int) -> float:
    """points (size -> ms) at x: linear between the nearest measured sizes, and along the last two
    (first two) beyond the largest (smallest)."""
    xs = sorted(points)
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    (x0, x1), (y0, y1) = (xs[i - 1], xs[i]), (points[xs[i - 1]], points[xs[i]])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


VERIFY_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 33, 65)
DRAFT_ROWS = (1, 2, 3, 4, 6, 8, 16)


def measure_costs(llm: LlamaModel, ssm: LlamaModel, prompt: list[int], repeats: int = 15) -> CostModel:
    """Time forwards at batch 1 after `prompt`: the LLM over the bonus token plus a tree of
    0..64 nodes, the SSM over one tree level of 1..16 rows."""
    def timed(model: LlamaModel, n_new: int, n_tree: int) -> float:
        cache = model.new_pool(len(prompt) + 80).new_cache()
        model([StepInput(cache, prompt[:-1], [], [])])
        new = prompt[-1:] if n_new else []

        def forward():
            model([StepInput(cache, new, [7] * n_tree, [-1] * n_tree)])
            cache.length -= len(new)
            cache.drop_tree()
        return median_ms(forward, repeats)

    return CostModel({r: timed(llm, 1, r - 1) for r in VERIFY_ROWS}, {w: timed(ssm, 0, w) for w in DRAFT_ROWS})


def search(p: list[float], cost: CostModel, max_depth: int = 8, max_width: int = 4,
           max_nodes: int = 64) -> list[dict]:
    """Every non-increasing expansion config within the limits, best tokens per ms first."""
    out = []
    for depth in range(0, max_depth + 1):
        for widths in itertools.combinations_with_replacement(range(max_width, 0, -1), depth):
            expansion = list(widths)
            if tree_size(expansion) > max_nodes:
                continue
            tps = expected_tokens_per_step(expansion, p)
            ms = cost.step_ms(expansion)
            out.append({"expansion": expansion, "tokens_per_step": tps, "step_ms": ms, "tokens_per_ms": tps / ms})
    return sorted(out, key=lambda r: -r["tokens_per_ms"])
