"""The core's typed errors. A bad field is a ValueError whose message starts with the field's name
("max_new_tokens: must be > 0, got 0"); a full KV pool is CacheFull. The services map
all of them to status codes in one place (specinfer_rpc/server.py). `check_token_ids` is the check
every side makes of the token ids it is sent."""

from __future__ import annotations


class CacheFull(RuntimeError):
    """The KV pool has fewer free blocks than a step needs; nothing was changed (kv_cache.py)."""


class Overloaded(Exception):
    """Too many requests are waiting: try again later."""


class AlreadyRunning(Exception):
    """A request with this id is already running or waiting."""


class VerifierUnavailable(Exception):
    """The verifier cannot be reached or failed the step: the step's requests fail."""


class VerifierLost(Exception):
    """The verifier no longer holds some request's state (it restarted): records are resent whole."""


class Failed(Exception):
    """The request failed for a reason logged where it happened (e.g. a bug in one iteration)."""


def check_token_ids(field: str, ids, vocab_size: int) -> None:
    """Raise ValueError naming `field` if a token id is outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
