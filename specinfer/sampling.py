"""Sampling settings, the transforms that turn logits into the distribution a token is drawn from,
and the random numbers the draws use.

The same `probabilities` function serves the LLM (p, in verification) and the SSMs (q, in
drafting), so temperature, top-k and top-p mean exactly the same thing on both sides. It takes
one setting per row, so a whole batch of requests with different settings is one call.

Randomness is counter-based: `stream_key(seed, purpose, ...)` hashes a request's seed with what
the numbers are for (e.g. "verify" and the request's position) into a 32-bit key on the host, and
`uniform(key, *counters)` hashes the key with counters (tree depth, draw index, ...) into a
uniform number on the device, as tensor ops with no state. A request's draws therefore depend
only on its seed and the counters, never on which other requests share a batch or in what order
the device computes them, and drawing them needs no host round trip.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
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


def probabilities(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float32) after temperature, top-k, then top-p, with
    one setting for every row or one per row.

    Not for greedy settings: greedy decoding takes the argmax of the raw logits.
    """
    assert logits.dim() == 2, logits.shape
    n, vocab = logits.shape
    rows = [params] * n if isinstance(params, SamplingParams) else list(params)
    assert len(rows) == n and not any(p.greedy for p in rows), "one non-greedy setting per row"
    dev = logits.device
    temperature = torch.tensor([p.temperature for p in rows], dtype=torch.float32).to(dev, non_blocking=True)
    scores = logits.float() / temperature[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in rows]
    if any(ks):  # keep the k highest scores (ties with the k-th kept)
        top = scores.topk(max(ks), dim=-1).values
        k = torch.tensor(ks).to(dev, non_blocking=True)
        kth = top.gather(1, (k - 1).clamp(min=0)[:, None]).masked_fill(k[:, None] == 0, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in rows):
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < top_p
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in rows]).to(dev, non_blocking=True)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        cut = probs.masked_fill(drop, 0.0)
        # rows without top-p stay as they were, so a row does not depend on the others' settings
        probs = torch.where(top_p[:, None] < 1.0, cut / cut.sum(dim=-1, keepdim=True), probs)
    return probs


def sparsify(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [R, V] -> (ids [R, K], probs [R, K]): each row's K = min(k, V) most likely tokens in
    descending order, renormalized; tokens of zero probability come last with probability 0.

    The result is itself the exact distribution drafts are drawn from, so the sparse pairs are all
    the verifier needs to know about q.
    """
    values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
    return ids, values / values.sum(dim=-1, keepdim=True)


_M32 = 0xFFFFFFFF


def stream_key(seed: int, *keys: int | str) -> int:
    """A 32-bit key for one request's random numbers for one purpose, e.g. (seed, "verify", position)."""
    h = hashlib.blake2b(digest_size=4)
    h.update(struct.pack("<q", seed))
    for key in keys:
        h.update(b"\x00" + str(key).encode())
    return int.from_bytes(h.digest(), "little")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), in 16-bit halves so nothing overflows."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer: a bijection of [0, 2**32) that mixes every bit into every bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform(key: torch.Tensor, *counters: torch.Tensor | int) -> torch.Tensor:
    """Uniform numbers in (0, 1), float64, one per element of the broadcast of `key` (int64, from
    `stream_key`) and the counters (non-negative ints below 2**32)."""
    h = key
    for c in counters:
        if isinstance(c, int):  # made on the device: no host-to-device copy
            c = torch.full((), c, dtype=torch.long, device=key.device)
        h = _fmix32(h ^ _fmix32((c + 0x9E3779B9) & _M32))
    return (h.double() + 0.5) * 2.0**-32


def sample(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of p [R, V] (non-negative, any positive total) by inverting its CDF at
    u [R] in (0, 1): token i with probability p_i / sum(p). Never a token of zero probability."""
    cdf = p.cumsum(dim=-1)
    x = (u * cdf[:, -1])[:, None].to(cdf.dtype)
    return torch.searchsorted(cdf, x).clamp(max=p.shape[-1] - 1)[:, 0]
