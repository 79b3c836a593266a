"""The draws, as tensor ops on the device: the transforms that turn logits into the distribution a
token is drawn from, and the random numbers the draws use (the settings and the keys: sampling.py).

The same `probabilities` function serves the LLM (p, in verification) and the SSMs (q, in
drafting), so temperature, top-k, top-p and min-p mean exactly the same thing on both sides. It takes
one setting per row, so a whole batch of requests with different settings is one call.

Randomness is counter-based: `sampling.stream_key(seed, purpose, ...)` hashes a request's seed with what
the numbers are for (e.g. "verify" and the request's position) into a 32-bit key on the host, and
`uniform(key, *counters)` hashes the key with counters (tree depth, draw index, ...) into a
uniform number on the device, as tensor ops with no state. A request's draws therefore depend
only on its seed and the counters, never on which other requests share a batch or in what order
the device computes them, and drawing them needs no host round trip.

Coupled sampling (`coupled_sample`, the default for sampled requests): the LLM's token at record
position t is the Gumbel-max sample argmax_v log p_t(v) + G(seed, t, v), written in its
exponential-race form argmax_v p_t(v) / E(seed, t, v) with E = -log u. The noise belongs to the
(seed, position, token), not to a tree node or a batch row, so the token is a function of the seed
and the record alone: whatever was drafted, verification (which then just matches drafts against
it) emits exactly the tokens plain seeded sampling emits. Its result depends on p only through the
order of p(v) / E(v), so rounding of the logits moves it only where two of those nearly tie.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from .devices import to_device
from .sampling import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float32) after temperature, top-k, top-p, then min-p
    (transformers' order), with one setting for every row or one per row.

    Not for greedy settings: greedy decoding takes the argmax of the raw logits.
    """
    assert logits.dim() == 2, logits.shape
    n, vocab = logits.shape
    rows = [params] * n if isinstance(params, SamplingParams) else list(params)
    assert len(rows) == n and not any(p.greedy for p in rows), "one non-greedy setting per row"
    dev = logits.device
    temperature = to_device(torch.tensor([p.temperature for p in rows], dtype=torch.float32), dev)
    scores = logits.float() / temperature[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in rows]
    if any(ks):  # keep the k highest scores (ties with the k-th kept)
        top = scores.topk(max(ks), dim=-1).values
        k = to_device(torch.tensor(ks), dev)
        kth = top.gather(1, (k - 1).clamp(min=0)[:, None]).masked_fill(k[:, None] == 0, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in rows):
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < top_p
        top_p = to_device(torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in rows]), dev)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = _truncated(probs, drop, top_p < 1.0)
    if any(p.min_p > 0.0 for p in rows):
        # a token stays if it is at least min_p times as likely as the most likely one (which stays)
        min_p = to_device(torch.tensor([p.min_p for p in rows], dtype=torch.float32), dev)
        probs = _truncated(probs, probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), min_p > 0.0)
    return probs


def _truncated(probs: torch.Tensor, drop: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """probs [N, V] with the `drop` [N, V] tokens removed and renormalized in the `rows` [N] that set the
    truncation; the other rows stay as they were, so a row does not depend on the others' settings."""
    cut = probs.masked_fill(drop, 0.0)
    return torch.where(rows[:, None], cut / cut.sum(dim=-1, keepdim=True), probs)


def sparsify(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [R, V] -> (ids [R, K], probs [R, K]): each row's K = min(k, V) most likely tokens in
    descending order, renormalized; tokens of zero probability come last with probability 0.

    The result is itself the exact distribution drafts are drawn from, so the sparse pairs are all
    the verifier needs to know about q.
    """
    values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
    return ids, values / values.sum(dim=-1, keepdim=True)


_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _int32(x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Integer values -> int32 with the same low 32 bits (two's complement), on a tensor or on the host."""
    if torch.is_tensor(x):
        return (((x & _M32) ^ 0x80000000) - 0x80000000).to(torch.int32)
    x = np.asarray(x, dtype=np.int64)  # an int32 array too (a word folded on the host): 2**32 - 1 fits
    return (((x & _M32) ^ 0x80000000) - 0x80000000).astype(np.int32)


def _fmix32(x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """MurmurHash3's 32-bit finalizer, a bijection of the 32-bit words that mixes every bit into
    every bit, on int32 tensors or numpy arrays: multiplication wraps modulo 2**32 and right shifts
    are masked to be logical, so the bits equal the unsigned definition on every device and on the
    host (a test checks them)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * -0x7A143595  # 0x85EBCA6B as int32
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * -0x3D4D51CB  # 0xC2B2AE35 as int32
    return x ^ ((x >> 16) & 0xFFFF)


def mix(key: torch.Tensor | np.ndarray, *counters: torch.Tensor | np.ndarray | int) -> torch.Tensor | np.ndarray:
    """32 random bits (int32) per element of the broadcast of `key` and the counters (int64): on
    the device, or the same bits on the host with numpy arrays.

    The counters fold in one at a time, mix(mix(key, a), b) == mix(key, a, b), so counters the host
    knows can be folded into the key there, and the device hashes only the rest."""
    h = _int32(key)
    for c in counters:
        if isinstance(c, int):  # made where the key is: no host-to-device copy
            c = torch.full((), c, dtype=torch.long, device=key.device) if torch.is_tensor(key) else np.full(1, c)
        h = _fmix32(h ^ _fmix32(_int32(c + _GOLDEN)))
    return h


def uniform(key: torch.Tensor, *counters: torch.Tensor | int) -> torch.Tensor:
    """Uniform numbers in (0, 1), float64, one per element of the broadcast of `key` (int64, from
    `stream_key`, or `mix` of one and leading counters) and the counters (non-negative ints below 2**32)."""
    return ((mix(key, *counters).long() & _M32).double() + 0.5) * 2.0**-32


@functools.cache
def _token_words(vocab: int, device: torch.device) -> torch.Tensor:
    """_fmix32 of each token id's counter word, the part of `mix(key, token)` that depends only on
    the token, computed once per vocabulary and device."""
    return _fmix32(_int32(torch.arange(vocab, device=device) + _GOLDEN))


def coupled_noise(word: torch.Tensor, vocab: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """E_v = -log u [..., V] (float32), u the uniform number of (key, position, v), for each word
    `mix(key, position)` (any integer dtype holding the int32 value; the verifier makes them on the
    host with the rest of its table): the noise `coupled_sample` races p against. With `tokens`
    [..., K] (ids below `vocab`), the same numbers for those tokens only, [..., K]: what a drafter
    races its own sparse q against to guess the coupled sample (speculator.py).

    u keeps 23 bits, (2m + 1) / 2**24, so that it and -log u are exact in float32 at both ends."""
    words = _token_words(vocab, word.device)
    bits = _fmix32(word.int()[..., None] ^ (words if tokens is None else words[tokens]))
    u = ((bits >> 8) & 0x7FFFFF).float().add_(0.5).mul_(2.0**-23)  # (2m + 1) / 2**24, exactly
    return u.log_().neg_()


def coupled_sample(p: torch.Tensor, key: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One token per row of p [R, V] (non-negative, any positive total): argmax_v p[v] / E_v with
    E = coupled_noise(mix(key [R], position [R]), V), i.e. a sample with probability p[v] / sum(p)
    made of noise that only the key, the position and the token decide."""
    return (p.float() / coupled_noise(mix(key, position), p.shape[-1])).argmax(dim=-1)


def sample(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of p [R, V] (non-negative, any positive total) by inverting its CDF at
    u [R] in (0, 1): token i with probability p_i / sum(p). Never a token of zero probability."""
    cdf = p.cumsum(dim=-1)
    x = (u * cdf[:, -1])[:, None].to(cdf.dtype)
    return torch.searchsorted(cdf, x).clamp(max=p.shape[-1] - 1)[:, 0]
