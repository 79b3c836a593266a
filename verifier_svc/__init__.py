"""The verifier service: the LLM behind the internal `Verifier` gRPC API (see servicer.py)."""
