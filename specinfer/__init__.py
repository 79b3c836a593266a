"""SpecInfer core: token trees, sampling, verification and a tree-decoding model runner (no gRPC)."""
