"""A feature drafter: an EAGLE-3 head (eagle.py) drafting token trees from the LLM's own features.

`FeatureSpeculator` is a `Speculator` whose model is the head: the same batched level-by-level tree
growth, top-k or sampled children and DraftGroups for MSS, so it drafts for every kind of request an
SSM drafts for. What differs is each row's input:
  - the head's KV cache holds pairs (eagle.py), one behind the record: its tokens are record[1:],
    pair j at position j. A draft first feeds the pairs the record has gained since the last draft,
    each with fc(the LLM's features of token j), the last of them being the root's pair;
  - a tree node's row reads, as its hidden vector, its parent row's output.
The head's KV of a tree is never kept: the accepted tokens come back with the LLM's features, which
the head's own outputs only approximated, so they are fed again as pairs.

Drafting ahead (`Speculator.draft_ahead`) works as an SSM's, with one difference: the LLM's features of an
outcome's accepted path come only with the verdict, so the rows below an outcome read the head's own outputs,
as a tree node's row does: the bonus token's row reads its path end's output (every forward's outputs are kept
for it until the trees ahead are grown). A hit's tree is then not the one the head drafts after the verdict.

Features arrive with the tokens they belong to, a `verifier.Features` per verify step (the committed
rows: the previous bonus token and the accepted path, or the prompt). A pair whose features never came
(a speculator that restarted, a step it missed) is fed zeros: the head then drafts worse for that
request, and exactness is untouched, since the verifier checks whatever is drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .eagle import EagleHead
from .kv_cache import POOL_TOKENS, KVCache, commit_all
from .errors import check_token_ids
from .model import StepInput
from .speculator import DraftRequest, Speculator
from .graphs import GraphConfig


@dataclass
class _Known:
    """What the drafter knows of one request: its record and the features of record positions
    `start`, `start + 1`, ... (older ones are fed already)."""

    record: list[int] = field(default_factory=list)
    start: int = 0
    rows: torch.Tensor | None = None  # [n, len(layers) * H_llm]

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Keep the features of positions start.. (a resent prompt may repeat known ones)."""
        if self.rows is None or start < self.start:
            self.start, self.rows = start, rows
            return
        end = self.start + len(self.rows)
        if start > end:  # a gap: the positions between were never sent
            self.rows = torch.cat([self.rows, rows.new_zeros(start - end, rows.shape[1])])
        self.rows = torch.cat([self.rows[: start - self.start], rows])

    def of(self, first: int, last: int, width: int, dtype, device) -> torch.Tensor:
        """Features of positions first..last-1 ([last - first, width]), zeros where unknown."""
        out = torch.zeros(last - first, width, dtype=dtype, device=device)
        if self.rows is not None:
            lo, hi = max(first, self.start), min(last, self.start + len(self.rows))
            if lo < hi:
                out[lo - first: hi - first] = self.rows[lo - self.start: hi - self.start].to(device, dtype)
        return out

    def forget_before(self, position: int) -> None:
        if self.rows is not None and position > self.start:
            self.rows = self.rows[position - self.start:]
            self.start = position


class FeatureSpeculator(Speculator):
    wants_features = True

    def __init__(self, head: EagleHead, index: int = 0, q_top: int = 32, kv_tokens: int = POOL_TOKENS,
                 progress: bool = False, dynamic: bool = False, prefill_chunk: int = 0):
        # the head runs eagerly: its rows carry hidden vectors beside their tokens, which the
        # padded buffers of a captured graph do not hold
        super().__init__(head, index, q_top, kv_tokens, GraphConfig(mode="eager"), progress, dynamic, prefill_chunk)
        self.head = head
        self.width = len(head.head_cfg.layers) * head.head_cfg.target_hidden_size
        self.known: dict[str, _Known] = {}
        self._hidden: torch.Tensor | None = None  # [N, H] the next forward's rows' hidden vectors
        self._out: torch.Tensor | None = None  # [R, H] the last forward's outputs
        self._kept: list[tuple[list, torch.Tensor]] | None = None  # drafting ahead: each forward's rows, outputs

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.known.pop(request_id, None)

    def _draft(self, batch: list[DraftRequest], ahead: bool):
        """Trees as `Speculator._draft`; none for a request of fewer than two tokens (no pair yet). Drafting
        ahead, every forward's outputs are kept until `_ahead` has read them."""
        known = lambda r: len(self.known[r.request_id].record) if r.request_id in self.known else 0
        self._kept = [] if ahead else None
        return super()._draft([r if len(r.new_tokens) + known(r) >= 2 else replace(r, expansion=[]) for r in batch],
                              ahead)

    def _ahead(self, batch, g):
        try:
            return super()._ahead(batch, g)
        finally:
            self._kept = None

    def _sync(self, batch: list[DraftRequest]) -> list[KVCache]:
        """Take the new tokens and features, drop the last tree, and set the hidden vectors of the
        pairs to feed: the record's new pairs (a chunk of them when more are pending), or the root's
        again when nothing new came."""
        for r in batch:  # all checked before any state changes
            check_token_ids(f"new_token_ids (request {r.request_id})", r.new_tokens, self.model.cfg.vocab_size)
            known = self.known.get(r.request_id)
            length = len(r.new_tokens) + (len(known.record) if known else 0)
            for f in r.features:
                if f.rows.dim() != 2 or f.rows.shape[1] != self.width or f.start < 0:
                    raise ValueError(f"features (request {r.request_id}): rows of {self.width} values from "
                                     f"position >= 0 expected, got shape {tuple(f.rows.shape)} from {f.start}")
                if f.start + len(f.rows) > length:
                    raise ValueError(f"features (request {r.request_id}): rows for positions {f.start}.."
                                     f"{f.start + len(f.rows) - 1}, and the record has {length} tokens")
        caches, hidden = [], []
        for r in batch:
            known = self.known.setdefault(r.request_id, _Known())
            cache = self.caches.get(r.request_id)
            new = cache is None
            if new:
                cache = self.caches[r.request_id] = self.pool.new_cache()
            known.record += r.new_tokens
            for f in r.features:
                known.add(f.start, f.rows)
            commit_all([cache], [[]])  # the last tree's K/V go: its rows read the head's own outputs
            cache.tokens.extend(known.record[len(cache.tokens) + 1:])
            if new:  # blocks an earlier request with the same leading tokens left (their features its own)
                cache.share_prefix()
            if cache.length == len(cache.tokens):  # nothing new: the root's row is needed again
                cache.length -= 1
            if r.expansion:  # its pairs are fed now (a chunk of them when far behind); the root's may be fed again
                end = cache.length + self._fed(cache)
                hidden.append(known.of(cache.length, end, self.width, self.head.dtype, self.head.device))
                known.forget_before(end - 1)
            else:
                known.forget_before(cache.length)
            caches.append(cache)
        self._hidden = self.head.fc(torch.cat(hidden)) if hidden else None
        return caches

    def _record_length(self, request_id: str, cache: KVCache) -> int:
        return len(self.known[request_id].record)  # the cache holds pairs: one token fewer

    def _forward(self, items: list[StepInput], ids: torch.Tensor | None) -> torch.Tensor:
        logits, self._out = self.head(items, ids, self._hidden)
        return logits

    def _follow(self, picked: torch.Tensor | None, kmax: int) -> None:
        """Each child's row reads its parent row's output."""
        self._hidden = self._out.repeat_interleave(kmax, 0) if picked is None else self._out[picked // kmax]

    def _fed_rows(self, rows: list) -> None:
        if self._kept is not None:
            self._kept.append((rows, self._out))

    def _reading(self, parents: list[tuple[int, int]]) -> None:
        """Each row reads its parent's output, from whichever forward of this draft computed it: the head's own
        prediction of the LLM's features there, which come only with the verdict."""
        at, base = {}, 0
        for rows, _ in self._kept:
            at.update(((row.request, row.node), base + i) for i, row in enumerate(rows))
            base += len(rows)
        index = torch.tensor([at[p] for p in parents], dtype=torch.long, device=self.head.device)
        self._hidden = torch.cat([out for _, out in self._kept])[index]
