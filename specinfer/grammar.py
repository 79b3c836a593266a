"""Constrained output (DESIGN section 14): a request's grammar, its state along the committed tokens,
and what it gives each speculative step.

A grammar (a JSON Schema, any JSON object, a regular expression, or a Lark grammar) is compiled by
llguidance for the LLM's tokenizer. llguidance was chosen by measurement over xgrammar
(bench/results/grammar_engines_cpu.md): its compile time stays at a few milliseconds where xgrammar
took seconds on a schema with `maxLength`, it refuses keywords it cannot enforce (xgrammar ignored
`uniqueItems`), accepts every escape inside patterned strings and keeps special tokens out of
strings; its mask costs far less than a step (the same record).

Each step of a constrained request:
  - every node of the drafters' merged tree is checked against its path's grammar state: a node
    whose token the state before it forbids is dropped with its subtree before verification (not
    in MSS trees, whose draws must all stay: the LLM's masked p gives such a draw 0 and rejects it);
  - the grammar drafts: below the root and below each node whose state forces what follows (only
    one continuation is possible: a key, a quote, a brace), the forced tokens, canonically
    tokenized, join the tree as a chain of their own, where the drafters did not already go. Like
    context lookup's chain these drafts cost no model, only verified rows, and the masked LLM always
    accepts them, so they join every step's tree, also where the cost model chose plain decoding
    (engine.py);
  - each row of the step (the root's, then each node's) gets the packed mask of the tokens its
    state allows (masks.py); the verifier decides over the masked logits, so the output is exactly
    constrained decoding without speculation (`Constraint.constrain`);
  - the committed tokens advance the state (`Constraint.advance`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import numpy as np

from .masks import AllowedTokens, words_for
from .tree import DraftGroup, TokenTree

KINDS = ("json_object", "json_schema", "regex", "lark")
FORCED_TOKENS = 16  # the most tokens the grammar adds to a request's tree in a step
# JSON on one line with Python's separators, {"key": value, "other": value}: no free whitespace, so
# that keys and punctuation are forced, which the grammar drafts (in process, 8 schemas: 4.95 tokens
# per step against 2.30 with whitespace as the LLM likes it, bounded to 20 characters a gap;
# bench/results/json_whitespace_cpu.md; unbounded, the fixtures' LLM filled the gap before a closing
# brace with newlines until max_tokens); \u escapes of any character
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "json_allow_general_unicode_escapes": True}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: `kind` one of KINDS, `text` the schema (JSON), the
    regular expression or the Lark grammar ("" for json_object). `field` names it in errors."""

    kind: str
    text: str = ""
    field: str = "response_format"


class Grammars:
    """Compiles grammars for one tokenizer (built once: a few hundred ms)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.eos = list(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos)

    def compile(self, spec: GrammarSpec) -> "Constraint":
        """A fresh state of `spec` at the start of the output; ValueError naming `spec.field` when it
        does not compile (a schema keyword llguidance cannot enforce, a bad pattern, ...)."""
        if spec.kind not in KINDS:
            raise ValueError(f"{spec.field}: unknown kind {spec.kind!r} (one of {', '.join(KINDS)})")
        if spec.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif spec.kind == "json_schema":
            try:
                schema = json.loads(spec.text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{spec.field}: the schema is not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{spec.field}: a JSON Schema is an object (or true/false)")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif spec.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.text)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(spec.text)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{spec.field}: does not compile: {matcher.get_error()}")
        return Constraint(matcher, words_for(self.vocab_size), self.eos)


class Constraint:
    """A request's grammar state after its committed tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, eos: list[int]):
        self.matcher = matcher
        self.words = words
        stopped = np.zeros(words, dtype=np.uint32)  # once the grammar has ended: EOS alone
        for t in eos:
            stopped[t >> 5] |= np.uint32(1 << (t & 31))
        self.stopped = stopped.view(np.int32)

    def mask(self) -> np.ndarray:
        """The tokens the current state allows, packed."""
        if self.matcher.is_stopped():
            return self.stopped
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)[: self.words].copy()

    def forced(self) -> list[int]:
        """The tokens the current state forces next, canonically tokenized."""
        return [] if self.matcher.is_stopped() else self.matcher.compute_ff_tokens()

    def advance(self, tokens: list[int]) -> None:
        """The step's committed tokens (the verifier allowed each; after the grammar's end only EOS
        comes, which ends the request)."""
        for t in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"grammar: committed token {t} is not allowed: {self.matcher.get_error()}")

    def constrain(self, tree: TokenTree, extend: int, room: int, sampled: bool) -> tuple[TokenTree, AllowedTokens, list[int]]:
        """The step's tree and its rows' masks: the drafters' `tree` without what the grammar forbids,
        with up to `extend` forced tokens added (none deeper than `room`); the masks of the root's
        row, then each node's; and the nodes the grammar added. In an MSS tree (`sampled`: draft
        groups) every draw stays, a forbidden node and its subtree taking the mask of the state
        above them, and added nodes are draws from the point mass on their token. The state is back
        where it was."""
        walk = _Walk(self)
        tokens, parents, groups, rows = [], [], [], [self.mask()]
        new = {-1: -1}  # the drafters' node -> its index in the step's tree
        valid = {-1}  # step nodes whose path the grammar allows
        forced = {-1: self.forced()} if extend else {}  # step node -> the tokens forced after it
        for u, (token, p) in enumerate(zip(tree.tokens, tree.parents)):
            if p not in new:  # below a pruned node
                continue
            q = new[p]
            if q not in valid or not _allows(rows[q + 1], token):
                if not sampled:
                    continue
                new[u] = len(tokens)  # kept, never accepted: the last allowed state's mask
                rows.append(rows[q + 1])
            else:
                new[u] = v = len(tokens)
                walk.to(parents + [q], tokens + [token], v)
                rows.append(self.mask())
                valid.add(v)
                if extend:
                    forced[v] = self.forced()
            tokens.append(token)
            parents.append(q)
        for g in tree.groups:
            groups.append(DraftGroup(new[g.parent], g.q_ids, g.q_probs, [new[c] for c in g.children], g.replacement))
        depth = {-1: 0}
        for v, q in enumerate(parents):
            depth[v] = depth[q] + 1
        added = []
        for v, chain in forced.items():
            if not chain or any(parents[c] == v and tokens[c] == chain[0] for c in range(len(tokens))):
                continue  # nothing forced, or the drafters went there (the node below has its own)
            at = v
            for token in chain[: min(extend - len(added), room - depth[v])]:
                u = len(tokens)
                walk.to(parents + [at], tokens + [token], u)
                tokens.append(token)
                parents.append(at)
                rows.append(self.mask())
                depth[u] = depth[at] + 1
                if sampled:
                    groups.append(DraftGroup(at, [token], [1.0], [u], False))
                added.append(at := u)
        walk.to(parents, tokens, -1)
        return TokenTree(tokens, parents, groups), AllowedTokens.from_rows(np.stack(rows)), added


def _allows(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


class _Walk:
    """Moves a constraint's matcher between the states of a tree's nodes: back to the common
    ancestor (rollback), then down (consume). Tokens after the grammar's end (EOS again) are not
    consumed."""

    def __init__(self, constraint: Constraint):
        self.matcher = constraint.matcher
        self.path: list[int] = []  # the nodes the matcher stands after, root's child first
        self.consumed: list[bool] = []

    def to(self, parents: list[int], tokens: list[int], u: int) -> None:
        """To the state after node u (-1: the root) of the tree given by `parents` and `tokens`."""
        target = []
        while u >= 0:
            target.append(u)
            u = parents[u]
        target.reverse()
        common = 0
        while common < min(len(self.path), len(target)) and self.path[common] == target[common]:
            common += 1
        if undo := sum(self.consumed[common:]):
            self.matcher.rollback(undo)
        del self.path[common:], self.consumed[common:]
        for v in target[common:]:
            self.path.append(v)
            self.consumed.append(not self.matcher.is_stopped())
            if self.consumed[-1]:
                self.matcher.consume_token(tokens[v])
