"""Presence, frequency and repetition penalties, logit bias and min_tokens are exact under
speculation: each tree row is adjusted with the counts of its own path (checked against a plain
per-row reference), greedy output equals plain greedy decoding of the adjusted logits computed
by transformers' model one token at a time, sampled tokens follow the adjusted distribution
(chi-square, with a wrong rule rejected by the same test), and a seed gives the same tokens with
or without speculation."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from specinfer import penalties, verifier
from specinfer.generate import Engine, Mode, Request, validate
from specinfer.draws import probabilities
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree

from .test_greedy import shipped  # noqa: F401 (a fixture: the shipped fixture models and transformers' LLM)
from .test_sampling_exact import ALPHA, P_LLM, P_SSM, MarkovModel, chi_square_pvalue

NEW_TOKENS = 24
PENALIZED = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.4)


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], s: SamplingParams,
              stop_ids=()) -> torch.Tensor:
    """The adjusted logits [V] of one position, plainly, from the definitions in vLLM's order."""
    x = logits.double().clone()
    if s.allowed_token_ids:
        x[[v for v in range(len(x)) if v not in s.allowed_token_ids]] = float("-inf")
    if len(output) < s.min_tokens:
        x[list(stop_ids)] = float("-inf")
    for token, bias in s.logit_bias:
        x[token] += bias
    for v in set(prompt + output):
        x[v] = x[v] / s.repetition_penalty if x[v] > 0 else x[v] * s.repetition_penalty
    for v in set(output):
        x[v] -= s.frequency_penalty * output.count(v) + s.presence_penalty
    return x


def random_tree(rng: random.Random, n: int, vocab: int) -> TokenTree:
    parents = [rng.randrange(-1, u) for u in range(n)]
    return TokenTree([rng.randrange(vocab) for _ in range(n)], parents)


@pytest.mark.parametrize("seed", range(4))
def test_each_tree_row_is_adjusted_with_the_counts_of_its_own_path(seed):
    """Two requests in one batch: a penalized one with a random tree, an untouched plain one."""
    rng, vocab = random.Random(seed), 13
    tree = random_tree(rng, 9, vocab)
    prompt = [rng.randrange(vocab) for _ in range(7)]
    output = [rng.randrange(vocab) for _ in range(3)]
    s = dataclasses.replace(PENALIZED, logit_bias=((2, 1.5), (5, -3.0)), min_tokens=5)
    logits = torch.randn(1 + len(tree) + 1, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    adjusted = logits.clone()
    penalties.adjust_logits(adjusted, [0, 1 + len(tree)], [tree, TokenTree()], [prompt + output, [1, 2]],
                            [len(prompt), 1], [s, SamplingParams()], [[4, 9], []])
    paths = [()] + tree.paths()
    for row, path in enumerate(paths):
        want = reference(logits[row], prompt, output + list(path), s, [4, 9])
        torch.testing.assert_close(adjusted[row].double(), want, rtol=1e-6, atol=1e-5)
    assert torch.equal(adjusted[-1], logits[-1])


def test_min_tokens_leaves_the_end_when_nothing_else_is_allowed():
    """A grammar whose only allowed token ends the request wins over min_tokens."""
    logits = torch.full((1, 5), float("-inf"))
    logits[0, 3] = 0.5
    penalties.adjust_logits(logits, [0], [TokenTree()], [[1, 2]], [2], [SamplingParams(min_tokens=4)], [[3]])
    assert logits[0, 3] == 0.5


def hf_adjusted_greedy(hf, prompt: list[int], n: int, s: SamplingParams, stop_ids: set[int]) -> list[int]:
    """Plain greedy decoding of the adjusted logits, one full forward of transformers' model per token."""
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n:
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(reference(logits, prompt, out, s, sorted(stop_ids)).argmax()))
            if out[-1] in stop_ids:
                break
    return out


SPECULATION = {  # name: (mode, number of SSMs, expansion, context lookup)
    "off": (Mode.INCREMENTAL, 0, None, False),
    "tree": (Mode.TREE, 1, [1, 1, 3, 1, 1, 1, 1, 1], False),
    "merged_and_lookup": (Mode.MERGED, 2, [2, 2, 1, 1], True),
}


@pytest.fixture(scope="module")
def prompts(shipped, heldout_prompts):
    tok = shipped[0]
    return [tok(p["prompt"])["input_ids"] for p in heldout_prompts[:4]]


@pytest.fixture(scope="module")
def penalized(shipped, prompts):
    """The penalized, biased requests and their plain greedy decoding of the adjusted logits."""
    tok, hf, llm, _ = shipped
    s = dataclasses.replace(PENALIZED, logit_bias=((tok.convert_tokens_to_ids("Ġthe"), 1.5),),
                            allowed_token_ids=tuple(t for t in range(llm.cfg.vocab_size) if t % 3))
    reqs = [Request(p, NEW_TOKENS, s) for p in prompts]
    return reqs, [hf_adjusted_greedy(hf, p, NEW_TOKENS, s, set(llm.cfg.eos_token_ids)) for p in prompts]


@pytest.mark.parametrize("name", SPECULATION)
def test_greedy_output_with_penalties_and_bias_is_plain_greedy_decoding_of_the_adjusted_logits(shipped, penalized,
                                                                                                name):
    _, _, llm, ssms = shipped
    mode, n_ssm, expansion, lookup = SPECULATION[name]
    reqs, want = penalized
    gens = Engine(llm, ssms[:n_ssm], mode, expansion, lookup=lookup).generate(reqs)
    assert [g.token_ids for g in gens] == want
    plain = Engine(llm, [], Mode.INCREMENTAL).generate([dataclasses.replace(r, sampling=SamplingParams())
                                                        for r in reqs])
    assert sum(g.token_ids != w for g, w in zip(plain, want)) >= len(reqs) // 2, "the penalties changed little"
    if mode != Mode.INCREMENTAL:
        assert sum(map(sum, (g.accepted for g in gens))) > 0, "no draft token was ever accepted"


def test_min_tokens_holds_back_the_stop_tokens_until_then(shipped, prompts):
    """The stop token is the one plain greedy decoding emits third: with min_tokens 12 it cannot
    come before the 13th token, and the output is plain decoding's with the stop tokens barred."""
    _, hf, llm, ssms = shipped
    mode, n_ssm, expansion, lookup = SPECULATION["merged_and_lookup"]
    plain = Engine(llm, [], Mode.INCREMENTAL).generate([Request(p, 3) for p in prompts])
    reqs = [Request(p, NEW_TOKENS, SamplingParams(min_tokens=12), stop_token_ids=(g.token_ids[2],))
            for p, g in zip(prompts, plain)]
    gens = Engine(llm, ssms[:n_ssm], mode, expansion, lookup=lookup).generate(reqs)
    eos = set(llm.cfg.eos_token_ids)
    for r, g in zip(reqs, gens):
        stops = eos | set(r.stop_token_ids)
        assert not stops & set(g.token_ids[:12])
        assert g.token_ids == hf_adjusted_greedy(hf, r.prompt, NEW_TOKENS, r.sampling, stops)


def test_a_seed_with_penalties_gives_the_same_tokens_whatever_the_speculation(shipped, prompts):
    _, _, llm, ssms = shipped
    s = dataclasses.replace(PENALIZED, temperature=0.8, seed=11, logit_bias=((7, 2.0),))
    runs = [[g.token_ids for g in Engine(llm, ssms[:n_ssm], mode, expansion, lookup=lookup).generate(
        [Request(p, NEW_TOKENS, s, ignore_eos=True) for p in prompts[:2]])]
        for mode, n_ssm, expansion, lookup in SPECULATION.values()]
    assert all(r == runs[0] for r in runs)


MARKOV_PROMPT = [0, 1, 1, 2]
MARKOV_SAMPLING = SamplingParams(temperature=0.9, presence_penalty=1.2, frequency_penalty=0.8, repetition_penalty=2.0,
                                 logit_bias=((3, 0.8),), allowed_token_ids=(0, 1, 3))


def markov_adjusted_exact(P: torch.Tensor, s: SamplingParams, keep: int) -> dict:
    """Exact law of emitted tokens 2 .. keep + 1 (those of the first speculative step) under plain
    sampling from the chain with the adjusted logits at every position."""
    law: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(P.shape[0]), repeat=keep + 1):
        p, last, out = 1.0, MARKOV_PROMPT[-1], []
        for t in seq:
            row = reference(P[last].log(), MARKOV_PROMPT, out, s).float()
            p *= float(probabilities(row[None], s)[0, t])
            last = t
            out.append(t)
        law[seq[1:]] = law.get(seq[1:], 0.0) + p
    return law


def markov_samples(mss: bool, n: int = 6000) -> list[tuple[int, ...]]:
    engine = Engine(MarkovModel(P_LLM), [MarkovModel(P_SSM[0])], Mode.TREE, [2, 2, 2])
    gens = engine.generate([Request(list(MARKOV_PROMPT), 4, dataclasses.replace(MARKOV_SAMPLING, seed=i, mss=mss))
                            for i in range(n)])
    assert sum(g.accepted[0] for g in gens) > 0.3 * n, "drafts were hardly ever accepted"
    return [tuple(g.token_ids[1:4]) for g in gens]


@pytest.mark.parametrize("mss", [True, False], ids=["mss", "coupled"])
def test_sampled_tokens_follow_the_adjusted_distribution(mss):
    assert chi_square_pvalue(markov_samples(mss), markov_adjusted_exact(P_LLM, MARKOV_SAMPLING, 3)) > ALPHA


def test_chi_square_rejects_rows_adjusted_without_their_ancestors(monkeypatch):
    """WRONG on purpose: each tree row counts its own node's token but not its ancestors'."""
    real = penalties.adjust_logits

    def own_token_only(logits, roots, trees, *rest):
        real(logits, roots, [TokenTree(t.tokens, [-1] * len(t)) for t in trees], *rest)

    monkeypatch.setattr(verifier, "adjust_logits", own_token_only)
    assert chi_square_pvalue(markov_samples(True), markov_adjusted_exact(P_LLM, MARKOV_SAMPLING, 3)) < 1e-6


@pytest.mark.parametrize("field,sampling", [
    ("presence_penalty", SamplingParams(presence_penalty=2.5)),
    ("frequency_penalty", SamplingParams(frequency_penalty=float("nan"))),
    ("repetition_penalty", SamplingParams(repetition_penalty=0.0)),
    ("logit_bias", SamplingParams(logit_bias=((3, 101.0),))),
    ("logit_bias", SamplingParams(logit_bias=((1 << 20, 1.0),))),
    ("min_tokens", SamplingParams(min_tokens=-1)),
    ("min_tokens", SamplingParams(min_tokens=9)),
    ("allowed_token_ids", SamplingParams(allowed_token_ids=(1, 1 << 20))),
])
def test_bad_sampling_parameters_are_refused_naming_the_field(field, sampling):
    with pytest.raises(ValueError, match=f"^{field}"):
        validate(Request([1, 2], 8, sampling), 100, 64)
