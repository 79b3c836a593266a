"""Sampling settings, and the keys of a request's random numbers; the draws themselves, on the
device, are `draws.py`'s.

Randomness is counter-based: `stream_key(seed, purpose, ...)` hashes a request's seed with what
the numbers are for (e.g. "verify" and the request's position) into a 32-bit key on the host, and
`draws.uniform(key, *counters)` hashes the key with counters (tree depth, draw index, ...) into a
uniform number on the device. Nothing here needs torch: the manager builds settings and keys, the
verifier and the speculators draw.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import KW_ONLY, dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means no top-k truncation
    top_p: float = 1.0  # 1 means no nucleus truncation
    _: KW_ONLY
    # after top-p, drop the tokens less likely than min_p times the most likely one (vLLM's and
    # transformers' min-p); 0 means none
    min_p: float = 0.0
    seed: int = 0
    # sampled requests: False (default) drafts the SSMs' guesses of the coupled sample and their
    # top-k, and verifies by matching them against it (the same tokens whatever the speculation); True
    # draws the drafts from the SSMs and verifies by the paper's multi-step speculative sampling
    # (acceptance.py), whose tokens depend on the trees drafted
    mss: bool = False
    # what the request has said so far moves its distribution (penalties.py): OpenAI's presence and
    # frequency penalties over the generated tokens, vLLM's repetition penalty over prompt and output,
    # OpenAI's logit bias ((token id, bias) pairs, ascending ids) and vLLM's min_tokens (the request
    # may not end before generating that many)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these tokens may be generated (empty: all)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Its rows' logits depend on the request's own tokens or carry a bias (penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.allowed_token_ids)

    @property
    def sampled_drafts(self) -> bool:
        """Drafts are draws from the SSMs' q, recorded in the tree for MSS; otherwise their guesses of the
        coupled sample and their top-k."""
        return self.mss and not self.greedy

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed: must be in [0, 2**64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty: must be finite and > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: token {token}'s bias must be in [-100, 100], got {bias}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be >= 0, got {self.min_tokens}")


def sample_key(seed: int) -> int:
    """The key of a request's coupled sample: the verifier's (acceptance.py) and the drafters' guesses
    of it (speculator.py) race against the noise of this key and the record position."""
    return stream_key(seed, "sample")


def stream_key(seed: int, *keys: int | str) -> int:
    """A 32-bit key for one request's random numbers for one purpose, e.g. (seed, "verify", position)."""
    h = hashlib.blake2b(digest_size=4)
    h.update(struct.pack("<Q", seed))
    for key in keys:
        h.update(b"\x00" + str(key).encode())
    return int.from_bytes(h.digest(), "little")
