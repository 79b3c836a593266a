"""Conversions between the core's dataclasses and protobuf that every service makes (no torch: the
manager and the gateway run without it); those only the model services make are model_convert.py's."""

from __future__ import annotations

import functools

import numpy as np

from specinfer.grammar import GrammarSpec
from specinfer.masks import AllowedTokens, words_for
from specinfer.sampling import SamplingParams
from specinfer.tree import DraftGroup, TokenTree, check_groups

from .v1 import common_pb2, generation_pb2, verifier_pb2


# Servers read a request's sampling parameters in every step, and clients send the same few settings
# over and over: each distinct small setting is converted and validated once, and the result shared
# (frozen, compared by value). A large one (long token lists in logit_bias or allowed_token_ids, or
# fields this version does not know) is converted every time, so that no memo holds large keys.
MEMO_BYTES = 256  # a message larger than this is not memoized
MEMO_TOKENS = 32  # nor a setting listing more tokens than this


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    if pb.ByteSize() > MEMO_BYTES:
        return _sampling(pb)
    return _sampling_of(pb.SerializeToString(deterministic=True))


@functools.lru_cache(maxsize=1024)
def _sampling_of(data: bytes) -> SamplingParams:
    return _sampling(common_pb2.SamplingParams.FromString(data))


def _sampling(pb: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(pb.temperature, pb.top_k, pb.top_p if pb.HasField("top_p") else 1.0, min_p=pb.min_p,
                          seed=pb.seed, mss=pb.mss, presence_penalty=pb.presence_penalty,
                          frequency_penalty=pb.frequency_penalty,
                          repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
                          logit_bias=tuple(sorted(pb.logit_bias.items())), min_tokens=pb.min_tokens,
                          allowed_token_ids=tuple(sorted(set(pb.allowed_token_ids))))


def _memoized(s: SamplingParams) -> bool:
    return (len(s.logit_bias) + len(s.allowed_token_ids) <= MEMO_TOKENS
            and type(s.logit_bias) is tuple and type(s.allowed_token_ids) is tuple)  # hashable


def validated(s: SamplingParams) -> SamplingParams:
    """s, or an equal instance, once `s.validate()` has passed (ValueError naming the field otherwise)."""
    if not _memoized(s):
        s.validate()
        return s
    return _validated(s)


@functools.lru_cache(maxsize=1024)
def _validated(s: SamplingParams) -> SamplingParams:  # a ValueError is raised again each time: nothing is kept
    s.validate()
    return s


def sampling_to_pb(s: SamplingParams) -> common_pb2.SamplingParams:
    """The message for s. A memoized one is shared: pass it on into a message (which copies it), never
    change it."""
    return _sampling_pb_of(s) if _memoized(s) else _sampling_pb(s)


@functools.lru_cache(maxsize=1024)
def _sampling_pb_of(s: SamplingParams) -> common_pb2.SamplingParams:
    return _sampling_pb(s)


def _sampling_pb(s: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                     seed=s.seed, mss=s.mss,
                                     presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                     repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias),
                                     min_tokens=s.min_tokens, allowed_token_ids=s.allowed_token_ids)


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
