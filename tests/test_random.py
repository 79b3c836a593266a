"""The counter-based random numbers (specinfer/sampling.py): the hash is MurmurHash3's finalizer
bit for bit, the uniforms are uniform, and the coupled sample follows p and is a function of
(key, position, p) alone."""

from __future__ import annotations

import random

import numpy as np
import torch
from scipy.stats import chisquare, kstest

from specinfer.draws import _fmix32, _int32, coupled_noise, coupled_sample, mix, uniform
from specinfer.sampling import stream_key

M32 = 0xFFFFFFFF


def fmix32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def test_the_int32_hash_is_the_unsigned_definition_bit_for_bit():
    rng = random.Random(0)
    # word boundaries, and enough values for the vectorized loop plus a scalar tail
    xs = [0, 1, 0x7FFFFFFF, 0x80000000, M32, 0x9E3779B9] + [rng.randrange(1 << 32) for _ in range(1029)]
    want = [fmix32_reference(x) for x in xs]
    assert (_fmix32(_int32(torch.tensor(xs))).long() & M32).tolist() == want
    assert (_fmix32(_int32(np.array(xs))).astype(np.int64) & M32).tolist() == want, "on the host (numpy)"


def test_the_words_mixed_on_the_host_are_the_devices_bit_for_bit():
    rng = random.Random(1)
    keys = [0, M32, stream_key(5, "sample")] + [rng.randrange(1 << 32) for _ in range(500)]
    positions = [0, 1 << 31, 7] + [rng.randrange(1 << 20) for _ in range(500)]
    host = mix(np.array(keys), np.array(positions))
    assert host.dtype == np.int32
    assert host.tolist() == mix(torch.tensor(keys), torch.tensor(positions)).tolist()


def test_counters_folded_into_the_key_on_the_host_give_the_same_uniforms():
    keys = np.array([stream_key(s, "draft") for s in range(6)])[:, None]
    index = np.arange(6)[:, None]
    assert np.array_equal(mix(mix(keys, 3), index), mix(keys, 3, index)), "folds on the host"
    folded = torch.from_numpy(mix(keys, 3, index).astype(np.int64))  # what the host sends
    counters = torch.arange(40)
    assert torch.equal(uniform(folded, counters), uniform(torch.from_numpy(keys), 3, torch.from_numpy(index), counters))


def test_uniforms_are_uniform_and_depend_only_on_key_and_counters():
    key = torch.tensor([stream_key(3, "test")])
    u = uniform(key, 5, torch.arange(20000))
    assert 0 < u.min() and u.max() < 1
    assert kstest(u.numpy(), "uniform").pvalue > 1e-3
    assert torch.equal(u[123:124], uniform(key, 5, torch.tensor([123])))
    assert not torch.equal(u, uniform(key, 6, torch.arange(20000)))


def test_the_coupled_sample_follows_p_and_ignores_the_batch_and_the_scale():
    p = torch.tensor([0.45, 0.3, 0.15, 0.1, 0.0])
    n = 20000
    key = torch.full((n,), stream_key(1, "sample"))
    tokens = coupled_sample(p.expand(n, -1), key, torch.arange(n))  # one draw per position
    counts = torch.bincount(tokens, minlength=5)
    assert counts[4] == 0, "a token of zero probability"
    assert chisquare(counts[:4].numpy(), (n * p[:4]).numpy()).pvalue > 1e-3
    # the same (key, position) in another batch, order and scale of p: the same token
    rows = torch.tensor([17, 3, 9000, 5])
    again = coupled_sample(7.0 * p.expand(4, -1), key[rows], rows)
    assert torch.equal(again, tokens[rows])


def test_the_noise_of_some_tokens_is_the_whole_rows_at_those_tokens():
    """What a drafter races its sparse q against (speculator.py) is the verifier's noise, bit for bit."""
    word = mix(np.array([stream_key(3, "sample"), stream_key(9, "sample")]), np.array([40, 41]))
    word = torch.from_numpy(word)
    whole = coupled_noise(word, 5000)
    ids = torch.tensor([[4999, 0, 17, 17], [3, 2500, 1, 4000]])
    assert torch.equal(coupled_noise(word, 5000, ids), whole.gather(1, ids))
