"""Conversions between the core's dataclasses and protobuf: the one place they live."""

from __future__ import annotations

import numpy as np
import torch

from specinfer.grammar import GrammarSpec
from specinfer.logprobs import TokenLogprob
from specinfer.masks import AllowedTokens, words_for
from specinfer.sampling import SamplingParams
from specinfer.tree import DraftGroup, TokenTree, check_groups
from specinfer.verifier import Features

from .v1 import common_pb2, generation_pb2, verifier_pb2


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(pb.temperature, pb.top_k, pb.top_p if pb.HasField("top_p") else 1.0, pb.seed, pb.mss,
                          pb.presence_penalty, pb.frequency_penalty,
                          pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
                          tuple(sorted(pb.logit_bias.items())), pb.min_tokens)


def sampling_to_pb(s: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed, mss=s.mss,
                                     presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                     repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias),
                                     min_tokens=s.min_tokens)


def tree_from_pb(pb: common_pb2.TokenTree) -> TokenTree:
    """Raises ValueError ("tree: ...") when a parent does not precede its child or a draft group names
    a node outside the tree (the verifier checks the rest: `specinfer.tree.check_verifiable`)."""
    groups = [DraftGroup(g.parent, list(g.q_token_ids), list(g.q_probs), list(g.children), g.replacement)
              for g in pb.draft_groups]
    tree = TokenTree(list(pb.token_ids), list(pb.parents), groups)
    check_groups(tree)
    return tree


def tree_to_pb(tree: TokenTree) -> common_pb2.TokenTree:
    return common_pb2.TokenTree(
        token_ids=tree.tokens, parents=tree.parents,
        draft_groups=[common_pb2.DraftGroup(parent=g.parent, q_token_ids=g.q_ids, q_probs=g.q_probs,
                                            children=g.children, replacement=g.replacement) for g in tree.groups])


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


def logprobs_from_pb(entries) -> list[TokenLogprob]:
    return [TokenLogprob(e.token_id, e.logprob, list(zip(e.top_token_ids, e.top_logprobs))) for e in entries]


def allowed_to_pb(a: AllowedTokens | None) -> verifier_pb2.AllowedTokens | None:
    if a is None:
        return None
    return verifier_pb2.AllowedTokens(masks=a.words.astype("<i4", copy=False).tobytes(), index=a.index)


def allowed_from_pb(pb: verifier_pb2.AllowedTokens, vocab_size: int, field: str) -> AllowedTokens:
    """The masks as the verifier checks them (`AllowedTokens.check`); ValueError naming `field` when
    the bytes are not whole masks."""
    width = 4 * words_for(vocab_size)
    if not pb.masks or len(pb.masks) % width:
        raise ValueError(f"{field}: {len(pb.masks)} bytes are not whole masks of {width} bytes (vocabulary {vocab_size})")
    words = np.frombuffer(pb.masks, dtype="<i4").astype(np.int32).reshape(-1, width // 4)
    return AllowedTokens(words, list(pb.index))


def grammar_to_pb(g: GrammarSpec | None) -> generation_pb2.ResponseFormat | None:
    if g is None:
        return None
    return generation_pb2.ResponseFormat(**{g.kind: True if g.kind == "json_object" else g.text})


def grammar_from_pb(pb: generation_pb2.ResponseFormat) -> GrammarSpec | None:
    """The request's grammar (None: unconstrained); the schema, regex or grammar is checked when it
    is compiled."""
    kind = pb.WhichOneof("format")
    if kind is None or (kind == "json_object" and not pb.json_object):
        return None
    return GrammarSpec(kind, "" if kind == "json_object" else getattr(pb, kind), f"response_format.{kind}")
