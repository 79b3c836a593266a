"""Row-invariant verification (SPECINFER_TREE_ATTENTION=invariant, `specinfer_kernels/invariant.py`): a
position's logits are the same bits however the step that computes it is shaped: a one-row step, a row of
a prompt or of a chunk of it, a node of a tree of any shape, beside other requests. float32 on a CPU;
natively on CUDA in bfloat16 where a GPU is lent, the products then `invariant_matmul.py`'s. Where this
CPU's BLAS does not keep what the backend relies on, the backend refuses to run, naming why."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from specinfer.eagle import EagleHead
from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel, StepInput
from specinfer.sampling import SamplingParams
from specinfer_kernels import invariant
from specinfer_kernels.invariant import blas_keeps_rows, tree_attention_invariant
from specinfer_kernels.invariant_matmul import invariant_matmul
from specinfer_kernels.reference import tree_attention_reference
from specinfer_kernels.tree_attention_triton import TOLERANCE

from .conftest import MODELS
from .test_feature_drafter import write_random_head
from .test_kernels import CASES, DEVICE, make_case, random_parents

DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the dtype each device serves in
BROKEN = blas_keeps_rows(DEVICE, torch.float32)  # None where the backend runs (it sums in float32)
ATTENTION_ATOL = 2e-6 if DTYPE == torch.float32 else TOLERANCE[DTYPE]  # against the reference's order of sums


def load(name: str) -> LlamaModel:
    return LlamaModel.from_pretrained(MODELS / name, dtype=DTYPE, device=DEVICE)


@pytest.fixture
def llm(monkeypatch) -> LlamaModel:
    monkeypatch.setenv("SPECINFER_TREE_ATTENTION", "invariant")
    return load("llm")


def refused(run) -> bool:
    """Where the BLAS does not keep rows: `run` raises, naming why (True: nothing more to check)."""
    if BROKEN is None:
        return False
    with pytest.raises(RuntimeError, match="row-invariant tree attention is not available here"):
        run()
    return True


def every_row(model: LlamaModel, tokens: list[int], chunk: int | None = None) -> torch.Tensor:
    """The logits after each token of `tokens` [len, V], as one prompt (or in chunks of `chunk` rows)."""
    cache = model.new_pool(4096).new_cache()
    chunk = chunk or len(tokens)
    return torch.cat([model([StepInput(cache, tokens[i: i + chunk], [], [], every_row=True)])
                      for i in range(0, len(tokens), chunk)])


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_a_prompts_rows_are_the_bits_of_one_row_steps(llm, chunk):
    """A prompt's logits, row by row, as one prompt (300 rows: past the projections' largest row bucket) and
    in chunks of 64, 7 and 1 rows (100 rows: one-row steps are slow)."""
    tokens = [random.Random(chunk).randrange(llm.cfg.vocab_size) for _ in range(100 if chunk == 1 else 300)]
    if refused(lambda: every_row(llm, tokens)):
        return
    assert torch.equal(every_row(llm, tokens, chunk), every_row(llm, tokens))


@pytest.mark.parametrize("seed", range(4))
def test_every_tree_node_in_a_batch_has_the_bits_of_its_path_as_a_prompt(llm, seed):
    """Requests with random prefixes, a bonus token or none, and trees of random shapes, in one step:
    each node's logits are bit for bit the last row of its path decoded as a prompt of its own."""
    rng = random.Random(seed)
    shapes = [(rng.randrange(1, 150), random_parents(rng, rng.randrange(1, 40), rng.choice(["chain", "wide", "random"])))
              for _ in range(4)]
    assert_nodes_are_their_paths(llm, rng, shapes)


# three branches from the tree's start, the second deep: a step of SmolLM2's with context lookup's chain merged in
BRANCHES = [-1, 0, 1, -1, 3, 4, 4, 6, 7, 8, 9, 10, -1, 12, 13]


@pytest.mark.parametrize("before_the_end", [2, 3, 6])
def test_a_tree_whose_branches_cross_a_chunks_end_has_the_bits_of_its_paths(llm, before_the_end):
    """A tree that starts `before_the_end` positions before a chunk of the invariant attention's keys ends
    (invariant.CHUNK), so that its branches cross into the next chunk at different nodes, and the chunk's keys
    are not one run of the request's slots: each node's logits are its path's as a prompt. (Before keys were
    placed by their order in the chunk, the nodes past the end attended to other keys, and greedy speculation
    with context lookup emitted other tokens than plain decoding.) Beside it, a request whose tree does the
    same at the second chunk's end."""
    rng = random.Random(before_the_end)
    assert_nodes_are_their_paths(llm, rng, [(invariant.CHUNK - before_the_end, BRANCHES),
                                            (2 * invariant.CHUNK - before_the_end, BRANCHES)])


def test_a_tree_of_two_long_branches_across_two_chunks_has_the_bits_of_its_paths(llm):
    """Two chains of 100 nodes from the tree's start, 28 positions before a chunk's end: both chunks they cross
    branch, and each has a cell for each of the two paths, read by the nodes on it."""
    chain = list(range(-1, 99))
    two = chain + [-1] + [100 + p for p in chain[1:]]
    assert_nodes_are_their_paths(llm, random.Random(5), [(invariant.CHUNK - 28, two)])


def assert_nodes_are_their_paths(llm: LlamaModel, rng: random.Random, shapes: list[tuple[int, list[int]]]) -> None:
    """One step of requests of (prefix length, tree parents), random tokens, half of the prefixes already in the
    cache but for their last token: each tree node's logits are bit for bit its path's as a prompt of its own."""
    if refused(lambda: every_row(llm, [0, 1])):
        return
    V = llm.cfg.vocab_size
    pool = llm.new_pool(8192)
    items, paths = [], []
    for length, parents in shapes:
        prefix = [rng.randrange(V) for _ in range(length)]
        cache = pool.new_cache()
        llm([StepInput(cache, prefix[:-1], [], [])]) if len(prefix) > 1 and rng.random() < 0.5 else None
        new = prefix[cache.length:]
        tokens = [rng.randrange(V) for _ in parents]
        items.append(StepInput(cache, new, tokens, parents))
        for u in range(len(parents)):
            path = []
            while u >= 0:
                path.append(tokens[u])
                u = parents[u]
            paths.append(prefix + path[::-1])
    out = llm(items)
    node_rows = torch.cat([out[sum(it.n_rows for it in items[:i]) + 1: sum(it.n_rows for it in items[: i + 1])]
                           for i in range(len(items))])
    for row, path in zip(node_rows, paths):
        assert torch.equal(row, every_row(llm, path)[-1])


def test_greedy_speculation_at_16_streams_is_the_bits_of_plain_decoding_alone(llm):
    prompts = [[random.Random(i).randrange(llm.cfg.vocab_size) for _ in range(5 + 3 * i)] for i in range(16)]
    requests = [Request(p, 16, id=str(i)) for i, p in enumerate(prompts)]
    plain = Engine(llm, mode=Mode.INCREMENTAL)
    if refused(lambda: plain.generate(requests[:1])):
        return
    alone = [plain.generate([r])[0] for r in requests]
    ssms = [load(name) for name in ("ssm-0", "ssm-1")]
    together = Engine(llm, ssms=ssms, mode=Mode.MERGED, expansion=[2, 2, 1], lookup=True).generate(requests)
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert sum(g.tree_steps for g in together) > 0


def test_greedy_and_seeded_outputs_with_every_drafter_and_the_prefix_cache_are_plain_decodings(llm, tmp_path):
    """16 requests at once, greedy and seeded sampling, each four sharing a 48-token prefix that an earlier
    request left in the prefix cache, drafted by both SSMs, a head and context lookup: each one's tokens are
    those of plain decoding, the request alone on a fresh engine."""
    rng = random.Random(7)
    V = llm.cfg.vocab_size
    prefixes = [[rng.randrange(V) for _ in range(48)] for _ in range(4)]
    requests = [Request(prefixes[i % 4] + [rng.randrange(V) for _ in range(rng.randrange(3, 11))], 16,
                        SamplingParams(0.9, seed=i) if i % 2 else SamplingParams(), id=str(i)) for i in range(16)]
    if refused(lambda: Engine(llm, mode=Mode.INCREMENTAL).generate(requests[:1])):
        return
    alone = [Engine(llm, mode=Mode.INCREMENTAL).generate([r])[0] for r in requests]
    write_random_head(tmp_path / "head", llm.cfg, seed=0, scale=4.0)
    head = EagleHead.from_pretrained(tmp_path / "head", llm.cfg, llm.embed.weight, DTYPE, DEVICE)
    ssms = [load(name) for name in ("ssm-0", "ssm-1")]
    engine = Engine(llm, ssms=ssms, mode=Mode.MERGED, expansion=[2, 2, 1], lookup=True, heads=[head])
    engine.generate([replace(r, id="first " + r.id) for r in requests[:4]])  # leaves the prefixes in the cache
    cached, step = [], engine.verifier.step
    engine.verifier.step = lambda batch: [cached.append(v.cached_tokens) or v for v in step(batch)]
    together = engine.generate(requests)
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert sum(cached) >= 16 * 32 and sum(g.tree_steps for g in together) > 0


@pytest.mark.parametrize("case", list(CASES))
def test_invariant_attention_is_attention(case):
    """The same attention as the reference (another order of its sums), on the kernel tests' batches."""
    q, k, v, batch, _, _ = make_case(hash(case) % 1000, CASES[case], hkv=2, group=2, d=32, dtype=DTYPE)
    if refused(lambda: tree_attention_invariant(q, k, v, batch)):
        return
    torch.testing.assert_close(tree_attention_invariant(q, k, v, batch), tree_attention_reference(q, k, v, batch),
                               atol=ATTENTION_ATOL, rtol=0)


@pytest.mark.parametrize("case", ["ragged_batch", "long_prefix", "tree_256"])
def test_invariant_attention_on_the_triton_products_is_attention(case, monkeypatch):
    """The attention with every product `invariant_matmul`'s, as on CUDA (here under Triton's interpreter
    on a CPU): its views of keys, values and rows reach the kernel as it reads them."""
    monkeypatch.setattr(invariant, "_matmul", invariant_matmul)
    q, k, v, batch, _, _ = make_case(hash(case) % 1000, CASES[case], hkv=2, group=2, d=32, dtype=DTYPE)
    torch.testing.assert_close(tree_attention_invariant(q, k, v, batch), tree_attention_reference(q, k, v, batch),
                               atol=ATTENTION_ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_matmul_is_the_product(dtype):
    """x W + b with a 2-D weight, a batch of products with a transposed view (q K^T), and a batch against one
    shared matrix, each against PyTorch's product of the same values in float32."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, dtype)  # noqa: E731
    x, w, bias, q, k = rand(70, 96), rand(96, 80), rand(80), rand(3, 2, 9, 32), rand(3, 2, 130, 32)
    tol = {"atol": 2e-5, "rtol": 0} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1e-2}
    f = lambda t: t.float()  # noqa: E731
    torch.testing.assert_close(f(invariant_matmul(x, w, bias)), f(x) @ f(w) + f(bias), **tol)
    torch.testing.assert_close(f(invariant_matmul(q, k.mT)), f(q) @ f(k).mT, **tol)
    torch.testing.assert_close(f(invariant_matmul(q, k[0, 0].mT)), f(q) @ f(k[0, 0]).mT, **tol)
    assert invariant_matmul(x[:0], w).shape == (0, 80)
    with pytest.raises(TypeError, match="a is torch.float32, b is torch.float64"):
        invariant_matmul(x.float(), w.double())


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton's CPU interpreter multiplies tiles in numpy, whose BLAS sums a "
                                              "row by its place in the tile; the kernel's own property is the GPU's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_of_invariant_matmul_has_its_bits_at_any_row_count_and_place(dtype):
    g = torch.Generator().manual_seed(1)
    x, w = (torch.randn(*shape, generator=g).to(DEVICE, dtype) for shape in ((300, 576), (576, 1536)))
    full = invariant_matmul(x, w)
    for n in (1, 2, 7, 16, 64, 65, 129):
        assert torch.equal(invariant_matmul(x[:n], w), full[:n])
        assert torch.equal(invariant_matmul(x.roll(n, 0), w), full.roll(n, 0))
    assert torch.equal(torch.cat([invariant_matmul(row[None], w) for row in x]), full)


def test_where_the_blas_does_not_keep_rows_the_backend_refuses_naming_why(monkeypatch):
    q, k, v, batch, _, _ = make_case(0, CASES["ragged_batch"], hkv=2, group=2, d=32, dtype=torch.float32)
    monkeypatch.setattr(invariant, "blas_keeps_rows", lambda *_: "a row of a product gets other bits by the rows beside it")
    with pytest.raises(RuntimeError, match="not available here: a row of a product gets other bits by the rows"):
        tree_attention_invariant(q, k, v, batch)
