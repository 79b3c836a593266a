"""Triton compiles one variant of a kernel per specialization key: every constexpr's value, and for
the other arguments their type, whether an integer equals 1 or is divisible by 16, and whether a
pointer is 16-byte aligned (unless the kernel marks the argument `do_not_specialize`). A key not
seen before is a compile: seconds of stall on the model thread while serving.

Every launch of the five kernels (tree attention's two, the three fused layer kernels) is recorded
here with its key, computed by Triton's own `native_specialize_impl`, and not run (its output is
not looked at), over 100 random batches:
- padded to one capacity (a graph's bucket): the warm-up's keys are all there ever are;
- eager, of any size: the keys differ only in the tile sizes chosen from the batch's shape
  (BLOCK_M, DIRECT) and in whether a layer has a residual, a handful of variants each compiled once.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from triton.backends import BaseBackend
from triton.runtime.jit import native_specialize_impl

from specinfer.graphs import GraphConfig, StepRunner
from specinfer.model import LlamaModel, StepInput
from specinfer_bench.attention_cases import random_tree
from specinfer_kernels import fused_triton, tree_attention_triton

from .conftest import MODELS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = [(tree_attention_triton, "_prefix_kernel"), (tree_attention_triton, "_tree_kernel"),
           (fused_triton, "_add_rms_norm_kernel"), (fused_triton, "_rotary_qkv_kernel"), (fused_triton, "_silu_mul_kernel")]
TILE_CHOICES = {"BLOCK_M", "DIRECT", "HAS_RESIDUAL"}  # constexprs chosen per batch shape, from a fixed few


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch's key."""

    def __init__(self, kernel):
        fn = kernel.fn
        self.name, self.signature = fn.__name__, inspect.signature(fn)
        dns = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize") or []
        self.fixed = set(dns)
        self.keys: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            params = self.signature.parameters
            bound = self.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
            key = []
            for name, param in params.items():
                value = bound.arguments[name]
                if "constexpr" in str(param.annotation):
                    key.append((name, value))
                else:
                    key.append((name, native_specialize_impl(BaseBackend, value, False, name not in self.fixed, True)))
            self.keys.append(tuple(key))
        return launch


@pytest.fixture
def recorders(monkeypatch):
    monkeypatch.setenv("SPECINFER_TREE_ATTENTION", "triton")
    monkeypatch.setenv("SPECINFER_FUSED", "triton")
    out = {}
    for module, name in KERNELS:
        out[name] = Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, out[name])
    return out


def random_batch(rng: random.Random, caches, tokens: tuple[int, int], vocab: int) -> list[StepInput]:
    """Up to len(caches) requests over fresh prefixes of random lengths, each a prefill chunk or a
    decode step with a random tree (maybe empty), with lo..hi tokens in all."""
    while True:
        sizes = [rng.randint(1, 24) for _ in range(rng.randint(1, len(caches)))]
        if tokens[0] <= sum(sizes) <= tokens[1]:
            break
    items = []
    for cache, size in zip(caches, sizes):
        cache.release()
        cache.tokens = [rng.randrange(vocab) for _ in range(rng.randint(size, 400))]
        cache.length = len(cache.tokens) - 1
        if rng.random() < 0.3:  # a prefill chunk
            cache.length = len(cache.tokens) - size
            items.append(StepInput(cache, cache.pending, [], []))
        else:
            parents = random_tree(rng, size - 1, rng.randint(1, 4)).parents
            items.append(StepInput(cache, cache.pending, [rng.randrange(vocab) for _ in parents], parents))
    return items


def run_batches(runner: StepRunner, n: int, tokens: tuple[int, int], seed: int) -> None:
    rng = random.Random(seed)
    caches = [runner.pool.new_cache() for _ in range(7)]
    for _ in range(n):
        runner(random_batch(rng, caches, tokens, runner.model.cfg.vocab_size))


def test_a_capacitys_kernels_never_specialize_anew_over_100_random_batches(recorders):
    llm = LlamaModel.from_pretrained(MODELS / "llm", device=DEVICE)
    config = GraphConfig(mode="static", max_tokens=64, max_batch=8, max_tree=64, max_context=512)
    runner = StepRunner(llm, llm.new_pool(8192), config)
    run_batches(runner, 1, (57, 64), seed=0)  # the bucket of 64 tokens: what warming up compiles
    warm = {name: set(r.keys) for name, r in recorders.items()}
    assert {name: len(keys) for name, keys in warm.items()} == {**dict.fromkeys(warm, 1), "_add_rms_norm_kernel": 2}, \
        "one variant per kernel and capacity (the norm: with and without a residual)"
    run_batches(runner, 100, (57, 64), seed=1)
    assert runner.eager_steps == 0
    assert {name: set(r.keys) for name, r in recorders.items()} == warm
    assert all(len(r.keys) > 100 for r in recorders.values())


def test_eager_steps_of_any_size_only_vary_the_tile_sizes(recorders):
    llm = LlamaModel.from_pretrained(MODELS / "llm", device=DEVICE)
    runner = StepRunner(llm, llm.new_pool(8192), GraphConfig(mode="eager"))
    run_batches(runner, 100, (1, 150), seed=2)
    for name, r in recorders.items():
        shapes = {tuple(part for part in key if part[0] not in TILE_CHOICES) for key in r.keys}
        assert len(shapes) == 1, f"{name}: {len(shapes)} variants beyond the tile sizes"
        assert len(set(r.keys)) <= 6, name  # BLOCK_M 16/32/64 x DIRECT, or HAS_RESIDUAL
