"""Allowed-token masks: which tokens each row of a request's step may take (constrained output,
DESIGN section 14). The verifier applies them to its logits before it decides (greedy argmax, the
coupled sample or MSS then see the masked distribution), so output is exactly constrained decoding
whatever was drafted; it knows nothing of grammars, only of masks.

A mask is packed as grammar engines fill it: bit j of int32 word i allows token 32 i + j. A tree's
rows repeat few masks (inside a JSON string every row allows the same set), so a step carries each
distinct mask once and, per row, which one it takes: the root's row first, then each node's.
The manager builds masks, the verifier applies them (`verifier.apply_masks`); nothing here needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def words_for(vocab_size: int) -> int:
    """int32 words of one packed mask over the vocabulary."""
    return (vocab_size + 31) // 32


@dataclass
class AllowedTokens:
    words: np.ndarray  # [K, words_for(V)] int32: the distinct masks
    index: list[int]  # [1 + n] each row's mask: the root's, then tree node u's at u + 1

    @classmethod
    def from_rows(cls, rows: np.ndarray) -> "AllowedTokens":
        """From one packed mask per row [1 + n, W], each distinct one kept once, in order of first use."""
        first: dict[bytes, int] = {}  # each distinct mask's bytes -> its index (hashing: microseconds a row)
        index = [first.setdefault(row.tobytes(), len(first)) for row in rows]
        keep = [index.index(k) for k in range(len(first))]
        return cls(np.ascontiguousarray(rows[keep], dtype=np.int32), index)

    def check(self, rows: int, vocab_size: int, field: str) -> None:
        """Raise ValueError naming `field` unless it fits a step of `rows` rows over the vocabulary and
        every mask allows some token (a row with none has no distribution to decide from)."""
        w = words_for(vocab_size)
        if self.words.ndim != 2 or self.words.shape[1] != w:
            raise ValueError(f"{field}: masks of {w} int32 words each expected (vocabulary {vocab_size}), "
                             f"got shape {list(self.words.shape)}")
        if len(self.index) != rows:
            raise ValueError(f"{field}: {len(self.index)} row entries for {rows} rows (the root's and the tree's)")
        if any(not 0 <= k < len(self.words) for k in self.index):
            raise ValueError(f"{field}: a row names a mask outside the {len(self.words)} given")
        tail = vocab_size - 32 * (w - 1)  # bits of the last word that are tokens
        spare = np.int64(-1) << tail if tail < 32 else np.int64(0)
        if np.any(self.words[:, -1].astype(np.int64) & spare & 0xFFFFFFFF):
            raise ValueError(f"{field}: a mask allows tokens past the vocabulary ({vocab_size})")
        if not np.all(self.words.any(axis=1)):
            raise ValueError(f"{field}: a mask allows no token")
