"""Conversions between the core's dataclasses and protobuf: the one place they live."""

from __future__ import annotations

from specinfer.sampling import SamplingParams
from specinfer.tree import DraftGroup, TokenTree, check_groups

from .v1 import common_pb2


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(pb.temperature, pb.top_k, pb.top_p if pb.HasField("top_p") else 1.0, pb.seed, pb.mss)


def sampling_to_pb(s: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed, mss=s.mss)


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
