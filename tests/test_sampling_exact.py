"""Stochastic verification preserves the LLM's distribution exactly, and a seed repeats tokens.

Each distribution test runs many seeded requests through the real Engine (speculators, merge,
verifier) and compares the emitted tokens with the exact distribution of plain sampling from the
LLM with a chi-square goodness-of-fit test, for both rules: the paper's multi-step speculative
sampling over sampled drafts (`mss`) and coupled matching over top-k drafts led by the drafter's
guess of the coupled sample (the default). A deliberately wrong acceptance rule is rejected by the
same test, so the test has power.

Coupled matching also makes a seeded request's tokens those of plain seeded sampling whatever the
speculation and the batch; keying its noise by batch row instead of by position breaks that, and
the same test sees it.

Two kinds of model:
- `MarkovModel`: next-token logits depend only on the last token (logits = log P[last]). It has the
  model interface the engine uses, so deep trees and many draws are cheap and the exact target is
  a product of matrix rows.
- tiny random Llama checkpoints (vocabulary 6), end to end through the real runner.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specinfer import acceptance
from specinfer.generate import Engine, Mode, Request
from specinfer.graphs import GraphConfig
from specinfer.kv_cache import KVPool
from specinfer.model import DRAFT_VOCAB, LlamaModel
from specinfer.draws import probabilities
from specinfer.sampling import SamplingParams
from specinfer.speculator import Speculator

from .conftest import MODELS, save_random_llama

ALPHA = 1e-3  # a correct rule fails with this probability per test (seeds are fixed, so never flaky)


class MarkovModel:
    device = torch.device("cpu")
    aux_layers = ()

    def __init__(self, P: torch.Tensor):
        self.logits = P.log()
        self.cfg = SimpleNamespace(vocab_size=P.shape[0], eos_token_ids=(), max_position_embeddings=1 << 20)

    def new_pool(self, tokens: int, prefix_cache: bool = True) -> KVPool:
        # one float per slot: room for any test batch
        return KVPool(1, 1, 1, torch.float32, tokens=1 << 22, prefix_cache=prefix_cache)

    def __call__(self, items, ids=None):
        flat = ids.tolist() if ids is not None else [t for it in items for t in it.new_tokens + it.tree_tokens]
        rows, offset = [], 0
        for it in items:
            it.cache.extend(len(it.new_tokens), it.tree_tokens, it.tree_parents)
            n = len(it.new_tokens) + len(it.tree_tokens)
            rows += flat[offset + max(len(it.new_tokens) - 1, 0): offset + n]
            offset += n
        return self.logits[rows]


def random_chain(seed: int, vocab: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (sharpness * torch.randn(vocab, vocab, generator=g)).softmax(-1)


def chi_square_pvalue(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit of observed outcome counts to exact probabilities; cells with an expected
    count under 5 are pooled into one."""
    n = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert set(counts) <= {k for k, p in exact.items() if p > 0}, "an impossible outcome was emitted"
    obs, exp, pool_obs, pool_exp = [], [], 0, 0.0
    for cell, p in exact.items():
        if n * p >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(n * p)
        else:
            pool_obs += counts.get(cell, 0)
            pool_exp += n * p
    if pool_exp > 0:
        obs.append(pool_obs)
        exp.append(pool_exp)
    exp = [e * n / sum(exp) for e in exp]  # absorb float rounding
    return float(chisquare(obs, exp).pvalue)


def markov_exact(P: torch.Tensor, start: int, params: SamplingParams, skip: int, keep: int) -> dict:
    """Exact law of emitted tokens skip+1 .. skip+keep under plain sampling from the chain."""
    T = probabilities(P.log(), params).double()
    v = P.shape[0]
    state = T[start]
    for _ in range(skip):
        state = state @ T  # marginal of the last skipped token
    exact = {}
    for cell in itertools.product(range(v), repeat=keep):
        p = state[cell[0]]
        for a, b in zip(cell, cell[1:]):
            p = p * T[a, b]
        exact[cell] = float(p)
    return exact


def run(llm, ssms, mode, expansion, params, n, replacement=False, prompt=(0,), new_tokens=4, graphs=GraphConfig(),
        lookup=False, mss=True):
    engine = Engine(llm, ssms, mode, expansion, replacement, graphs, lookup)
    reqs = [Request(list(prompt), new_tokens, dataclasses.replace(params, seed=s, mss=mss)) for s in range(n)]
    return engine.generate(reqs)


def test_the_transforms_are_transformers_warpers_row_by_row():
    """Temperature, top-k, top-p and min-p, each row with its own settings in one batch: each row's
    distribution is that of transformers' warpers with the row's settings, in generate's order."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    grid = list(itertools.product((0.7, 1.5), (0, 5), (1.0, 0.8), (0.0, 0.2))) * 3
    settings = [SamplingParams(t, k, p, min_p=m) for t, k, p, m in grid]
    base = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 1.5
    logits = base.repeat_interleave(16, dim=0)  # each of 3 rows under each of the 16 settings
    ours = probabilities(logits, settings)
    for row, (t, k, p, m) in enumerate(grid):
        scores = TemperatureLogitsWarper(t)(None, logits[row: row + 1])
        if k:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = TopPLogitsWarper(p)(None, scores)
        if m:
            scores = MinPLogitsWarper(m)(None, scores)
        torch.testing.assert_close(ours[row: row + 1], scores.softmax(-1), rtol=0, atol=1e-6)
    kept = (ours > 0).sum(-1).view(3, 2, 2, 2, 2)  # [logits, temperature, top-k, top-p, min-p]
    assert (kept[..., 1] <= kept[..., 0]).all() and (kept[:, :, 0, 0, 1] < kept[:, :, 0, 0, 0]).all()


V = 4
P_LLM = random_chain(0, V, 1.5)
P_SSM = [random_chain(1, V, 1.5), random_chain(2, V, 1.5)]
T08 = SamplingParams(temperature=0.8)

LOOKUP_PROMPT = (1, 2, 3, 0, 2, 1, 3, 0)  # every token occurs before the last: context lookup always drafts

VARIANTS = {
    # name: (mode, number of SSMs, expansion, draws with replacement, sampling, context lookup)
    "with_replacement": (Mode.TREE, 1, [2, 2, 2], True, T08, False),
    "without_replacement": (Mode.TREE, 1, [3, 2, 2], False, T08, False),
    "merged_two_ssms": (Mode.MERGED, 2, [2, 2, 2], False, T08, False),
    "merged_with_replacement": (Mode.MERGED, 2, [2, 1, 2], True, T08, False),
    "sequence": (Mode.SEQUENCE, 1, [1, 1, 1], False, T08, False),
    "top_k_top_p": (Mode.MERGED, 2, [2, 2, 2], False, SamplingParams(temperature=1.3, top_k=3, top_p=0.8), False),
    "min_p": (Mode.TREE, 1, [2, 2, 2], False, SamplingParams(temperature=1.3, min_p=0.3), False),
    "tree_and_context_lookup": (Mode.TREE, 1, [2, 1, 2], False, T08, True),
    "merged_with_replacement_and_context_lookup": (Mode.MERGED, 2, [1, 2, 1], True, T08, True),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_markov_emitted_tokens_follow_the_llm_distribution(name):
    """With context lookup, its point-mass drafts join the merge (the prompt makes it draft at every step)."""
    mode, n_ssm, expansion, replacement, params, lookup = VARIANTS[name]
    llm, ssms = MarkovModel(P_LLM), [MarkovModel(P) for P in P_SSM[:n_ssm]]
    gens = run(llm, ssms, mode, expansion, params, n=6000, replacement=replacement,
               prompt=LOOKUP_PROMPT if lookup else (0,), lookup=lookup)
    # token 1 comes from the prefill; tokens 2-4 from the first speculative step (depth <= 2)
    assert sum(g.accepted[0] for g in gens) > 0.3 * len(gens), "drafts were hardly ever accepted"
    samples = [tuple(g.token_ids[1:4]) for g in gens]
    assert chi_square_pvalue(samples, markov_exact(P_LLM, 0, params, skip=1, keep=3)) > ALPHA


def no_residual(p, q):
    """WRONG on purpose: after a rejection the next draft is tested against p, not the residual."""
    return p


def test_chi_square_rejects_a_rule_without_the_residual_update(monkeypatch):
    monkeypatch.setattr(acceptance, "_residual", no_residual)
    llm, ssms = MarkovModel(P_LLM), [MarkovModel(P) for P in P_SSM]
    gens = run(llm, ssms, Mode.MERGED, [2, 2, 2], T08, n=6000)
    samples = [tuple(g.token_ids[1:4]) for g in gens]
    assert chi_square_pvalue(samples, markov_exact(P_LLM, 0, T08, skip=1, keep=3)) < 1e-6


COUPLED = {  # name: (mode, number of SSMs, expansion, sampling, context lookup)
    "off": (Mode.INCREMENTAL, 0, [], T08, False),
    "tree": (Mode.TREE, 1, [3, 2, 2], T08, False),
    "merged_two_ssms": (Mode.MERGED, 2, [2, 2, 2], T08, False),
    "top_k_top_p": (Mode.MERGED, 2, [2, 2, 2], SamplingParams(temperature=1.3, top_k=3, top_p=0.8), False),
    "min_p": (Mode.TREE, 1, [2, 2, 2], SamplingParams(temperature=1.3, min_p=0.3), False),
    "tree_and_context_lookup": (Mode.TREE, 1, [2, 1, 2], T08, True),
}


@pytest.mark.parametrize("name", COUPLED)
def test_coupled_matching_emits_the_llm_distribution(name):
    mode, n_ssm, expansion, params, lookup = COUPLED[name]
    llm, ssms = MarkovModel(P_LLM), [MarkovModel(P) for P in P_SSM[:n_ssm]]
    gens = run(llm, ssms, mode, expansion, params, n=6000, prompt=LOOKUP_PROMPT if lookup else (0,), lookup=lookup,
               mss=False)
    if n_ssm or lookup:
        assert sum(g.accepted[0] for g in gens) > 0.3 * len(gens), "drafts were hardly ever accepted"
    samples = [tuple(g.token_ids[1:4]) for g in gens]
    assert chi_square_pvalue(samples, markov_exact(P_LLM, 0, params, skip=1, keep=3)) > ALPHA


SETTINGS = {  # name: (mode, number of SSMs, expansion, context lookup)
    "off": (Mode.INCREMENTAL, 0, [], False),
    "sequence": (Mode.SEQUENCE, 1, [1, 1, 1, 1], False),
    "tree_2_2_1": (Mode.TREE, 1, [2, 2, 1], False),
    "tree_4_2": (Mode.TREE, 1, [4, 2], False),
    "merged": (Mode.MERGED, 2, [1, 1, 3, 1, 1, 1, 1, 1], False),
    "merged_and_lookup": (Mode.MERGED, 2, [2, 1, 1], True),
    "lookup_alone": (Mode.TREE, 0, [2, 1, 1], True),
}


def seeded_tokens(llm, ssms, settings=SETTINGS) -> dict[tuple[str, str], list[int]]:
    """One seeded sampled request's tokens, alone and among 16 others (greedy, sampled, MSS, other
    seeds and prompts), under each speculation setting."""
    mine = Request([1, 2, 3, 1, 2], 40, SamplingParams(0.8, top_p=0.95, seed=7), ignore_eos=True, id="mine")
    crowd = [Request([i % 4, (i * 3) % 4, 1], 20 + i, SamplingParams(0.0 if i % 3 == 0 else 1.0, top_k=i % 4, seed=i,
                                                                      mss=i % 3 == 2), ignore_eos=True, id=str(i))
             for i in range(16)]
    out = {}
    for name, (mode, n_ssm, expansion, lookup) in settings.items():
        engine = Engine(llm, ssms[:n_ssm], mode, expansion, lookup=lookup)
        out[name, "alone"] = engine.generate([mine])[0].token_ids
        out[name, "crowd"] = next(g.token_ids for g in engine.generate(crowd[:9] + [mine] + crowd[9:]) if g.id == "mine")
    return out


@pytest.mark.parametrize("models", ["markov", "llama"])
def test_a_seed_gives_the_same_tokens_whatever_the_speculation_and_the_batch(models):
    """Coupled matching: plain seeded sampling's tokens (speculation off, alone) under every
    setting, alone and in a crowd; another seed gives others."""
    if models == "markov":
        llm, ssms = MarkovModel(P_LLM), [MarkovModel(P) for P in P_SSM]
        settings = SETTINGS
    else:  # the real runner (KV cache, tree attention): one setting of each kind of drafting
        llm, ssms = LlamaModel.from_pretrained(MODELS / "llm"), [LlamaModel.from_pretrained(MODELS / f"ssm-{i}")
                                                                 for i in range(2)]
        settings = {k: SETTINGS[k] for k in ("off", "sequence", "tree_4_2", "merged_and_lookup")}
    out = seeded_tokens(llm, ssms, settings)
    plain = out["off", "alone"]
    assert len(plain) == 40 and all(tokens == plain for tokens in out.values()), \
        {k: v for k, v in out.items() if v != plain}
    other = Engine(llm, ssms, Mode.MERGED, [2, 2, 2]).generate(
        [Request([1, 2, 3, 1, 2], 40, SamplingParams(0.8, top_p=0.95, seed=8), ignore_eos=True)])[0].token_ids
    assert other != plain


def test_noise_keyed_by_batch_row_instead_of_position_breaks_the_seed(monkeypatch):
    """WRONG on purpose: the coupled sample's noise keyed by the row it has in the batch."""
    real = acceptance.mix
    monkeypatch.setattr(acceptance, "mix", lambda key, position: real(key, np.arange(len(key))))
    out = seeded_tokens(MarkovModel(P_LLM), [MarkovModel(P) for P in P_SSM],
                        {k: SETTINGS[k] for k in ("off", "tree_2_2_1")})
    assert out["off", "alone"] != out["off", "crowd"]


@pytest.mark.parametrize("mss", [True, False], ids=["mss", "coupled"])
def test_same_seed_same_tokens_whatever_the_batch(mss):
    """Both rules, with the same trees."""
    llm, ssms = MarkovModel(P_LLM), [MarkovModel(P) for P in P_SSM]
    engine = Engine(llm, ssms, Mode.MERGED, [2, 2, 2])
    req = lambda seed: Request([1, 2], 24, SamplingParams(0.9, seed=seed, mss=mss))
    alone = engine.generate([req(42)])[0].token_ids
    crowd = engine.generate([req(1), req(42), req(7)])[1].token_ids
    again = engine.generate([req(42)])[0].token_ids
    assert alone == crowd == again
    assert engine.generate([req(43)])[0].token_ids != alone


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """(HF LLM, LLM, SSMs, the same SSMs drafting from a draft vocabulary of 4 of the 6 tokens)."""
    root = tmp_path_factory.mktemp("vocab6")
    hf = save_random_llama(root / "llm", 10, vocab=6, hidden=32, logit_scale=40.0)
    for i in range(2):
        for name in (f"ssm-{i}", f"drafting-ssm-{i}"):
            save_random_llama(root / name, 11 + i, vocab=6, hidden=16, layers=1, logit_scale=40.0)
        (root / f"drafting-ssm-{i}" / DRAFT_VOCAB).write_text(json.dumps({"token_ids": [0, 2, 3, 5]}))
    load = lambda name: LlamaModel.from_pretrained(root / name)  # noqa: E731
    return hf, load("llm"), [load(f"ssm-{i}") for i in range(2)], [load(f"drafting-ssm-{i}") for i in range(2)]


def llama_exact(hf, prompt: list[int], params: SamplingParams, keep: int) -> dict:
    """Exact law of generated tokens 2..keep+1 by enumerating every sequence with transformers."""
    v = hf.config.vocab_size
    seqs = [list(s) for s in itertools.product(range(v), repeat=keep)]  # tokens 1..keep
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + s for s in seqs])).logits[:, len(prompt) - 1:]
    T = [probabilities(logits[:, i], params).double() for i in range(keep + 1)]  # row r: after s[:i]
    # law of (x2..x_keep, x_{keep+1}): sum over x1 of p(x1..x_keep) * p(x_{keep+1} | x1..x_keep)
    exact = {}
    for r, s in enumerate(seqs):
        p = T[0][r, s[0]]
        for i in range(1, keep):
            p = p * T[i][r, s[i]]
        for nxt in range(v):
            cell = tuple(s[1:]) + (nxt,)
            exact[cell] = exact.get(cell, 0.0) + float(p * T[keep][r, nxt])
    return exact


# the padded static-buffer path of CUDA graphs (without a graph: this runs on the CPU), with
# buckets large enough for 3000 requests at once
STATIC = GraphConfig(mode="static", max_tokens=65536, max_batch=4096, max_tree=32, max_context=32)


@pytest.mark.parametrize("mode,replacement,graphs,drafting,mss", [
    (Mode.TREE, True, GraphConfig(), False, True), (Mode.TREE, False, GraphConfig(), False, True),
    (Mode.MERGED, False, GraphConfig(), False, True), (Mode.MERGED, False, STATIC, False, True),
    (Mode.MERGED, False, GraphConfig(), True, True), (Mode.MERGED, False, GraphConfig(), False, False)],
    ids=["tree-replacement", "tree", "merged", "merged-static-buffers", "merged-draft-vocabulary", "merged-coupled"])
def test_llama_emitted_tokens_follow_the_llm_distribution(tiny_vocab, mode, replacement, graphs, drafting, mss):
    """MSS, and coupled matching (last); drafting from a draft vocabulary too: q is zero outside it,
    the LLM's law is unchanged."""
    hf, llm, ssms, drafting_ssms = tiny_vocab
    ssms = drafting_ssms if drafting else ssms
    params = SamplingParams(temperature=0.9)
    prompt = [1, 4, 2]
    gens = run(llm, ssms, mode, [2, 2], params, n=3000, replacement=replacement, prompt=prompt, new_tokens=4,
               graphs=graphs, mss=mss)
    samples = [tuple(g.token_ids[1:4]) for g in gens]
    assert chi_square_pvalue(samples, llama_exact(hf, prompt, params, keep=3)) > ALPHA


def drafts_kept(ssm) -> float:
    """Of the drafts of the chain <1, 1, 1> for sampled requests verified by coupled matching (200
    seeds), the share the verifier accepted."""
    gens = run(MarkovModel(P_LLM), [ssm], Mode.TREE, [1, 1, 1], SamplingParams(1.0), n=200, new_tokens=16, mss=False)
    accepted, drafted = (sum(g.drafters[0][i] for g in gens) for i in (0, 1))
    return accepted / drafted


def test_a_drafter_guesses_the_coupled_sample_with_the_verifiers_noise(monkeypatch):
    """A drafter whose q is the LLM's p guesses every coupled sample (the same noise, keyed by the
    request and the position), so every draft of a chain is accepted, though the sample is often
    not the most likely token. Top-k drafts (no guess), and a guess keyed by the wrong position,
    keep far fewer: the test has power."""
    assert drafts_kept(MarkovModel(P_LLM)) == 1.0
    with monkeypatch.context() as m:
        m.setattr(Speculator, "_guess_first", lambda *args: None)
        top = drafts_kept(MarkovModel(P_LLM))
    with monkeypatch.context() as m:  # WRONG on purpose: the noise of the position after the child's
        m.setattr(Speculator, "_record_length", lambda self, request_id, cache: len(cache.tokens) + 1)
        shifted = drafts_kept(MarkovModel(P_LLM))
    assert top < 0.8 and shifted < 0.8, (top, shifted)
    # an SSM unlike the LLM: its guess is still a draft like any other, and the tokens stay the
    # LLM's (the chi-square tests above run with guesses too)
    assert 0 < drafts_kept(MarkovModel(P_SSM[0])) < 1
