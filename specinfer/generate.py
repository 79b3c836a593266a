"""In-process speculative generation: speculators and verifier glued by one batching loop.

Per iteration, for every unfinished request: each speculator drafts a tree (told only the tokens
committed since it last drafted), the trees are merged, the verifier checks them all in one LLM
forward, and the accepted tokens are appended, cut at EOS, a stop token or max_new_tokens.
The first LLM forward of a request is its prefill (prompt only, one token out); every later
forward is a *step*.

Modes: incremental (no speculator), sequence (SSM 0, a chain: expansion <1, ..., 1>),
tree (SSM 0, an expansion config), merged (every SSM with the same config, trees merged).
With `lookup`, a chain of up to `lookup_tokens` tokens drafted from the request's own earlier text
(lookup.py) joins the merge; with no SSM, it is the only drafter. The chain's length is its own, not
the expansion's depth: it costs no model, only verified rows.
The gRPC manager runs the same loop with continuous batching; this one serves the CLI, the tests
and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tqdm import tqdm

from .graphs import GraphConfig
from .lookup import CHAIN_TOKENS, ContextIndex, chain_tree
from .model import LlamaModel, check_token_ids
from .sampling import SamplingParams
from .speculator import DraftRequest, Speculator
from .tree import TokenTree, merge
from .verifier import Verifier, VerifyRequest


class Mode(str, Enum):
    INCREMENTAL = "incremental"
    SEQUENCE = "sequence"
    TREE = "tree"
    MERGED = "merged"


PAPER_EXPANSION = [1, 1, 3, 1, 1, 1, 1, 1]  # SpecInfer's default <1,1,3,1,1,1,1,1>


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    id: str = ""


@dataclass
class Generation:
    id: str
    token_ids: list[int]  # generated tokens only
    finish_reason: str = ""  # "eos", "stop" or "length"
    steps: int = 0  # LLM forward passes after the prefill
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens at each step

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per LLM step, not counting the prefill's token."""
        return (len(self.token_ids) - 1) / self.steps if self.steps else 0.0


def validate(req: Request, vocab_size: int, context: int, max_new_tokens_cap: int | None = None) -> None:
    """Raise ValueError naming the offending field."""
    if not req.prompt:
        raise ValueError("prompt: must not be empty")
    check_token_ids("prompt", req.prompt, vocab_size)
    check_token_ids("stop_token_ids", req.stop_token_ids, vocab_size)
    if req.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens: must be > 0, got {req.max_new_tokens}")
    if max_new_tokens_cap is not None and req.max_new_tokens > max_new_tokens_cap:
        raise ValueError(f"max_new_tokens: {req.max_new_tokens} is over the server's cap {max_new_tokens_cap}")
    if len(req.prompt) + req.max_new_tokens > context:
        raise ValueError(f"max_new_tokens: prompt ({len(req.prompt)}) + max_new_tokens "
                         f"({req.max_new_tokens}) exceeds the context length {context}")
    req.sampling.validate()


class Engine:
    def __init__(self, llm: LlamaModel, ssms: list[LlamaModel] = (), mode: Mode = Mode.TREE,
                 expansion: list[int] | None = None, replacement: bool = False, graphs: GraphConfig = GraphConfig(),
                 lookup: bool = False, lookup_tokens: int = CHAIN_TOKENS):
        mode = Mode(mode)
        if lookup_tokens < 1:
            raise ValueError(f"lookup_tokens: must be >= 1, got {lookup_tokens}")
        if mode != Mode.INCREMENTAL and not ssms and not lookup:
            raise ValueError(f"mode {mode.value} needs at least one SSM (or context lookup)")
        if any(s.cfg.vocab_size != llm.cfg.vocab_size for s in ssms):
            raise ValueError("LLM and SSMs must share a tokenizer (vocab sizes differ)")
        self.llm = llm
        self.expansion = list(expansion if expansion is not None else PAPER_EXPANSION)
        if mode == Mode.SEQUENCE:
            self.expansion = [1] * len(self.expansion)
        used = {Mode.INCREMENTAL: [], Mode.SEQUENCE: ssms[:1], Mode.TREE: ssms[:1], Mode.MERGED: list(ssms)}[mode]
        self.speculators = [Speculator(m, index=i, graphs=graphs) for i, m in enumerate(used)]
        self.verifier = Verifier(llm, graphs=graphs)
        self.replacement = replacement
        self.lookup = lookup and mode != Mode.INCREMENTAL
        self.lookup_tokens = lookup_tokens

    def generate(self, requests: list[Request], progress: bool = False) -> list[Generation]:
        for r in requests:
            validate(r, self.llm.cfg.vocab_size, self.llm.cfg.max_position_embeddings)
        ids = [r.id or str(i) for i, r in enumerate(requests)]
        if len(set(ids)) != len(ids):
            raise ValueError("id: request ids must be unique")
        verifier = self.verifier
        eos = set(self.llm.cfg.eos_token_ids)
        out = {i: Generation(i, []) for i in ids}
        told = {(s, i): 0 for s in range(len(self.speculators)) for i in ids}  # tokens sent so far
        contexts = {i: ContextIndex() for i in ids} if self.lookup else {}
        live = dict(zip(ids, requests))
        bar = tqdm(total=sum(r.max_new_tokens for r in requests), disable=not progress, unit="tok")

        batch = [VerifyRequest(i, r.prompt, TokenTree(), r.sampling) for i, r in live.items()]
        first = True
        while live:
            verdicts = verifier.step(batch)
            for v, vr in zip(verdicts, batch):
                gen, req = out[vr.request_id], live[vr.request_id]
                if not first:
                    gen.steps += 1
                    gen.accepted.append(len(v.path))
                before = len(gen.token_ids)
                gen.finish_reason = append_tokens(gen.token_ids, req, v.tokens, eos)
                bar.update(len(gen.token_ids) - before)
                if gen.finish_reason:
                    del live[vr.request_id]
                    verifier.release(vr.request_id)
                    for s in self.speculators:
                        s.release(vr.request_id)
            first = False
            trees = self._draft(live, out, told, contexts)
            batch = [VerifyRequest(i, [], trees[i], r.sampling) for i, r in live.items()]
        bar.close()
        return [out[i] for i in ids]

    def _draft(self, live: dict[str, Request], out: dict[str, Generation], told: dict,
               contexts: dict[str, ContextIndex]) -> dict[str, TokenTree]:
        per_request: dict[str, list[TokenTree]] = {i: [] for i in live}
        # never draft past max_new_tokens: a step emits the accepted path plus one bonus token
        room = {i: req.max_new_tokens - len(out[i].token_ids) - 1 for i, req in live.items()}
        for s, spec in enumerate(self.speculators):
            batch = []
            for i, req in live.items():
                generated = out[i].token_ids
                new = record_from(req, generated, told[s, i])
                told[s, i] = len(req.prompt) + len(generated)
                batch.append(DraftRequest(i, new, self.expansion[:room[i]], req.sampling, self.replacement))
            for dr, tree in zip(batch, spec.draft(batch)):
                per_request[dr.request_id].append(tree)
        for i, ctx in contexts.items():
            if i in live:
                ctx.extend(record_from(live[i], out[i].token_ids, len(ctx.tokens)))
                if draft := ctx.draft(min(self.lookup_tokens, room[i])):
                    per_request[i].append(chain_tree(draft, live[i].sampling.sampled_drafts))
        return {i: (TokenTree() if not trees else trees[0] if len(trees) == 1 else merge(trees))
                for i, trees in per_request.items()}


def record_from(req: Request, generated: list[int], start: int) -> list[int]:
    """The request's record (prompt + generated tokens) from index `start` on, without building the
    whole record."""
    return req.prompt[start:] + generated[max(0, start - len(req.prompt)):]


def append_tokens(out: list[int], req: Request, tokens: list[int], eos: set[int]) -> str:
    """Append a step's tokens to the request's generated tokens `out`, up to and including the
    first that finishes the request; return the finish reason ("eos", "stop", "length") or ""."""
    for t in tokens:
        out.append(t)
        if t in eos and not req.ignore_eos:
            return "eos"
        if t in req.stop_token_ids:
            return "stop"
        if len(out) >= req.max_new_tokens:
            return "length"
    return ""
