"""Sampling settings and the transforms that turn logits into the distribution a token is drawn from.

The same `probabilities` function serves the LLM (p, in verification) and the SSMs (q, in
drafting), so temperature, top-k and top-p mean exactly the same thing on both sides.

Randomness is per request and per purpose: `request_generator(seed, *keys)` derives an independent
generator from the request's seed and a key such as ("verify", position). Nothing depends on
which other requests share a batch, so the same seed gives the same output in any batch.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means no top-k truncation
    top_p: float = 1.0  # 1 means no nucleus truncation
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float32) after temperature, top-k, then top-p.

    Not for greedy settings: greedy decoding takes the argmax of the raw logits.
    """
    assert logits.dim() == 2, logits.shape
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = scores.topk(params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < top_p
        drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sparsify(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [R, V] -> (ids [R, K], probs [R, K]): each row's K = min(k, V) most likely tokens in
    descending order, renormalized; tokens of zero probability come last with probability 0.

    The result is itself the exact distribution drafts are drawn from, so the sparse pairs are all
    the verifier needs to know about q.
    """
    values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
    return ids, values / values.sum(dim=-1, keepdim=True)


def request_generator(seed: int, *keys: int | str) -> torch.Generator:
    """A CPU generator for one request and one purpose, e.g. ("verify", position)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", seed))
    for key in keys:
        h.update(b"\x00" + str(key).encode())
    return torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") & ((1 << 63) - 1))
