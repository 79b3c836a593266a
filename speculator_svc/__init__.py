"""The speculator service: one or more SSMs behind the internal `Speculator` gRPC API (see servicer.py)."""
