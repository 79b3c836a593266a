"""The core's typed errors. A bad field is a ValueError whose message starts with the field's name
("max_new_tokens: must be > 0, got 0"); a full KV pool is kv_cache.CacheFull. The services map
all of them to status codes in one place (specinfer_rpc/server.py)."""

from __future__ import annotations


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
