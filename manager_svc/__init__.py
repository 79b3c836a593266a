"""The manager service: the public `Generation` API, continuous batching over the speculators
and the verifier (see scheduler.py)."""
