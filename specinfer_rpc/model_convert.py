"""Conversions between the core's dataclasses and protobuf that only the model services make: the
LLM's features (FeatureRows: the verifier writes them, a feature speculator reads them; the manager
hands them on as protobuf) and tokens' logprobs (the verifier writes them)."""

from __future__ import annotations

import numpy as np
import torch

from specinfer.logprobs import TokenLogprob
from specinfer.verifier import Features

from .v1 import common_pb2

# the wire's dtypes: (enum value, the numpy dtype of their bits, little-endian)
FEATURE_DTYPES = {torch.float32: (common_pb2.FEATURE_DTYPE_FLOAT32, torch.float32, "<f4"),
                  torch.bfloat16: (common_pb2.FEATURE_DTYPE_BFLOAT16, torch.int16, "<i2")}


def features_to_pb(f: Features) -> common_pb2.FeatureRows:
    """Little-endian rows in the verifier's dtype (float32 on a float32 verifier, else bfloat16)."""
    rows = f.rows if f.rows.dtype in FEATURE_DTYPES else f.rows.to(torch.bfloat16)
    enum, bits, wire = FEATURE_DTYPES[rows.dtype]
    data = rows.contiguous().view(bits).numpy().astype(wire, copy=False).tobytes()
    return common_pb2.FeatureRows(start=f.start, rows=rows.shape[0], width=rows.shape[1], dtype=enum, data=data)


def features_from_pb(pb: common_pb2.FeatureRows, field: str) -> Features:
    """Raises ValueError naming `field` when the rows are not what they say they are."""
    dtype = next((d for d, (enum, _, _) in FEATURE_DTYPES.items() if enum == pb.dtype), None)
    if dtype is None:
        raise ValueError(f"{field}: dtype {pb.dtype} is not FEATURE_DTYPE_FLOAT32 or FEATURE_DTYPE_BFLOAT16")
    _, bits, wire = FEATURE_DTYPES[dtype]
    size = np.dtype(wire).itemsize
    if pb.start < 0 or pb.rows < 0 or pb.width <= 0 or len(pb.data) != pb.rows * pb.width * size:
        raise ValueError(f"{field}: {len(pb.data)} bytes for {pb.rows} rows of {pb.width} {str(dtype)[6:]} values "
                         f"from position {pb.start}")
    native = np.frombuffer(pb.data, dtype=wire).astype(np.dtype(wire).newbyteorder("="))
    rows = torch.from_numpy(native).view(dtype).view(pb.rows, pb.width)
    if not torch.isfinite(rows).all():
        raise ValueError(f"{field}: a value is not finite")
    return Features(pb.start, rows)


def logprobs_to_pb(entries: list[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob, top_token_ids=[t for t, _ in e.top],
                                    top_logprobs=[lp for _, lp in e.top]) for e in entries]
