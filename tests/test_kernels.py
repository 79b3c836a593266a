"""Tree attention over a paged KV cache: the reference means what batch.py says, and the Triton
kernel equals the reference over many shapes: trees of 1 to 512 nodes over prefixes of 0 to 5000
tokens, GQA groups 1 to 8, batches mixing decoding, prefill and trees, padded batches of a fixed
capacity. The comparison catches a wrong causal limit or a wrong ancestor bit, and a launch
depends only on the batch's capacity, never on its values (so it can be captured in a CUDA graph).

Without a GPU the kernel runs on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest before anything imports Triton); with one, natively on CUDA.
"""

from __future__ import annotations

import functools
import random
import re

import pytest
import torch

from specinfer_bench import ops
from specinfer_kernels import Capacity, RequestView, TreeBatch, tree_attention_reference
from specinfer_kernels import reference as reference_module
from specinfer_kernels import tree_attention_triton as kernel_module
from specinfer_kernels.tree_attention_triton import CONFIG_VARIABLE, TOLERANCE, TileConfig, tree_attention_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_parents(rng: random.Random, n: int, shape: str) -> list[int]:
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "wide":
        return [-1] * n
    return [rng.randrange(-1, u) for u in range(n)]


def make_case(seed: int, requests: list[tuple[int, int, int, int, str]], hkv: int, group: int, d: int,
              dtype: torch.dtype, block_size: int = 16, capacity=None, pool_blocks: int = 0):
    """requests: (committed prefix in cache, new committed tokens, old tree nodes in cache, new tree
    nodes, tree shape). Blocks are handed out in a shuffled order, so tables are not contiguous."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-(p + c + o + t) // block_size) for p, c, o, t, _ in requests)
    pool_blocks = max(pool_blocks, need + 3)
    free = list(range(pool_blocks))
    rng.shuffle(free)
    views, trees = [], []
    for prefix, committed, old, new, shape in requests:
        assert not (committed and old)
        parents = random_parents(rng, old + new, shape)
        tree_start = prefix + committed
        blocks = [free.pop() for _ in range(-(-(tree_start + old + new) // block_size))]
        # the queries start at the new committed tokens, or after the tree nodes already cached
        views.append(RequestView(blocks, prefix + old, committed, tree_start, parents, new))
        trees.append(parents)
    n_q = sum(view.n_queries for view in views)
    q = torch.randn(n_q, hkv * group, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(pool_blocks, block_size, hkv, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(pool_blocks, block_size, hkv, d, generator=gen).to(DEVICE, dtype)
    # with a capacity, padding queries follow the same data and write to a block no request holds
    batch = TreeBatch.build(views, block_size, DEVICE, capacity and capacity(free[0]))
    q = torch.cat([q, torch.randn(batch.causal.shape[0] - n_q, hkv * group, d, generator=gen).to(DEVICE, dtype)])
    return q, k, v, batch, views, trees


def dense_attention(q, k_cache, v_cache, view: RequestView, block_size: int, parents_visible) -> torch.Tensor:
    """Plain softmax attention of one request's queries over the keys each may see, spelled out."""
    slots = view.first + view.n_queries
    k = torch.cat([k_cache[b] for b in view.blocks])[:slots].float()  # [n, Hkv, D]
    v = torch.cat([v_cache[b] for b in view.blocks])[:slots].float()
    group = q.shape[1] // k.shape[1]
    out = []
    for i in range(view.n_queries):
        keys = parents_visible(i)
        s = torch.einsum("hd,khd->hk", q[i].float(), k[keys].repeat_interleave(group, 1)) / q.shape[-1] ** 0.5
        out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[keys].repeat_interleave(group, 1)))
    return torch.stack(out)


def test_visible_keys_are_the_prefix_plus_exactly_each_nodes_ancestors_over_many_words():
    """A 300-node tree (10 bit words per query) after a 5-token prefix: the batch's mask is the
    committed prefix plus, over the tree's slots, the ancestor-or-self matrix spelled out."""
    parents = random_parents(random.Random(0), 300, "random")
    batch = TreeBatch.build([RequestView(list(range(20)), 5, 0, 5, parents, 300)], 16)
    want = torch.zeros(300, 305, dtype=torch.bool)
    want[:, :5] = True
    for u in range(300):
        v = u
        while v >= 0:
            want[u, 5 + v] = True
            v = parents[v]
    assert torch.equal(batch.visible(305).cpu(), want)


def test_a_batch_refuses_slots_past_its_blocks_and_committed_tokens_after_its_tree():
    with pytest.raises(ValueError, match="17 slots do not fit 1 blocks of 16"):
        TreeBatch.build([RequestView([0], 10, 7, 17, [], 0)], 16)
    with pytest.raises(ValueError, match="must lie just before its tree"):
        TreeBatch.build([RequestView([0, 1], 10, 2, 14, [-1, 0], 2)], 16)


@pytest.mark.parametrize("committed,old,new,shape", [
    (5, 0, 0, "chain"),  # prefill
    (1, 0, 9, "random"),  # the bonus token plus a tree
    (0, 0, 12, "random"),
    (0, 6, 5, "random"),  # an SSM's next level over an earlier one
])
def test_reference_is_attention_over_each_nodes_causal_path(committed, old, new, shape):
    prefix, bs = 21, 16
    q, k, v, batch, views, trees = make_case(1, [(prefix, committed, old, new, shape)], hkv=2, group=2, d=16,
                                             dtype=torch.float32, block_size=bs)
    view, parents = views[0], trees[0]
    tree_start = prefix + committed

    def visible(i: int) -> list[int]:
        if i < committed:
            return list(range(prefix + i + 1))  # causal
        u, path = old + i - committed, []
        while u >= 0:
            path.append(tree_start + u)
            u = parents[u]
        return list(range(tree_start)) + sorted(path)

    want = dense_attention(q.cpu(), k.cpu(), v.cpu(), view, bs, visible)
    got = tree_attention_reference(q, k, v, batch).float().cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_reference_attends_unlike_requests_apart_and_gives_each_the_rows_it_gets_alone():
    """A prompt's 200-row chunk on an 800-token record beside decoding requests with trees: the
    reference calls the chunk apart from the small requests (padded with them, each would pay the
    chunk's rows times its keys), and every request's rows are those it gets in a batch of its own;
    a batch of like requests stays one call."""
    requests = [(35, 1, 0, 4, "chain"), (600, 200, 0, 0, "chain"), (40, 1, 0, 8, "random"),
                (50, 0, 3, 5, "random"), (20, 1, 0, 0, "chain")]
    q, k, v, batch, views, _ = make_case(3, requests, hkv=2, group=2, d=16, dtype=torch.float32)
    plan = reference_module._plan(batch)
    assert sorted(g.B for g in plan) == [1, 4], [(g.B, g.M, g.L) for g in plan]
    got = tree_attention_reference(q, k, v, batch)
    start = 0
    for view in views:
        n = view.n_queries
        alone = tree_attention_reference(q[start:start + n], k, v, TreeBatch.build([view], 16, DEVICE))
        torch.testing.assert_close(got[start:start + n], alone, atol=1e-5, rtol=0)
        start += n
    _, _, _, alike, _, _ = make_case(4, [(30 + i, 1, 0, 6, "random") for i in range(6)], hkv=2, group=2, d=16,
                                     dtype=torch.float32)
    assert len(reference_module._plan(alike)) == 1


CASES = {
    "decode_batch1": [(40, 1, 0, 0, "chain")],
    "prefix0_prefill": [(0, 7, 0, 0, "chain")],
    "prefix1_tree1": [(1, 0, 0, 1, "chain")],
    "chain": [(33, 1, 0, 8, "chain")],
    "wide": [(17, 0, 0, 24, "wide")],
    "block_boundaries": [(15, 1, 0, 1, "chain"), (16, 0, 0, 16, "random"), (31, 1, 0, 2, "wide")],
    "long_prefix": [(700, 0, 0, 5, "random")],
    "tree_256": [(10, 1, 0, 256, "random")],
    "ssm_levels": [(9, 0, 12, 20, "random"), (3, 0, 2, 4, "wide")],
    "ragged_batch": [(0, 5, 0, 0, "chain"), (100, 1, 0, 31, "random"), (1, 0, 0, 1, "chain"),
                     (64, 0, 0, 3, "chain"), (250, 1, 0, 0, "chain")],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_reference(case, dtype):
    q, k, v, batch, _, _ = make_case(hash(case) % 1000, CASES[case], hkv=2, group=2, d=32, dtype=dtype)
    want = tree_attention_reference(q, k, v, batch)
    got = tree_attention_triton(q, k, v, batch)
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("hkv,group,d", [(4, 1, 16), (1, 8, 64), (2, 4, 80), (3, 3, 32)])
def test_kernel_equals_reference_across_head_layouts(hkv, group, d):
    """MHA, GQA ratios 1..8, and head dims that are not powers of two."""
    q, k, v, batch, _, _ = make_case(7, CASES["ragged_batch"], hkv, group, d, torch.float16)
    got = tree_attention_triton(q, k, v, batch)
    assert (got.float() - tree_attention_reference(q, k, v, batch).float()).abs().max().item() <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("splits", [2, 5])
def test_split_key_ranges_combine_exactly(splits):
    """Flash-decoding splits (some of which see no key of a short request) combine to the same output."""
    q, k, v, batch, _, _ = make_case(3, [(300, 1, 0, 6, "random"), (2, 0, 0, 3, "chain")], 2, 2, 32, torch.float32)
    got = tree_attention_triton(q, k, v, batch, num_splits=splits)
    assert (got - tree_attention_reference(q, k, v, batch)).abs().max().item() <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_kernel_reads_any_block_size(block_size):
    q, k, v, batch, _, _ = make_case(5, CASES["block_boundaries"], 2, 2, 32, torch.float32, block_size)
    got = tree_attention_triton(q, k, v, batch)
    assert (got - tree_attention_reference(q, k, v, batch)).abs().max().item() <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("prefix", [0, 1, 15, 16, 17, 5000])
@pytest.mark.parametrize("nodes", [1, 64, 256, 512])
def test_kernel_equals_reference_over_trees_and_prefixes(nodes, prefix):
    """A tree of `nodes` random nodes (a bonus token before it when there is a prefix) over a
    committed prefix; the dtype cycles so that each one meets large and small cases."""
    dtype = [torch.float32, torch.float16, torch.bfloat16][(nodes + prefix) % 3]
    q, k, v, batch, _, _ = make_case(nodes + prefix, [(prefix, int(prefix > 0), 0, nodes, "random")], 1, 2, 32, dtype)
    got = tree_attention_triton(q, k, v, batch)
    assert (got.float() - tree_attention_reference(q, k, v, batch).float()).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_kernel_equals_reference_for_gqa_groups(group, dtype):
    """Grouped-query attention with 1, 4 and 8 query heads per KV head over the mixed batch."""
    q, k, v, batch, _, _ = make_case(group, CASES["ragged_batch"], 2, group, 64, dtype)
    got = tree_attention_triton(q, k, v, batch)
    assert (got.float() - tree_attention_reference(q, k, v, batch).float()).abs().max().item() <= TOLERANCE[dtype]


def test_a_tile_config_other_than_the_default_gives_the_references_output(monkeypatch):
    """Smaller tiles than a request's rows (several tiles per request), fewer keys per step, other
    warps and stages: the same attention, whether passed or named by the environment variable."""
    q, k, v, batch, _, _ = make_case(6, [(40, 1, 0, 20, "random"), (3, 0, 0, 2, "chain")], 2, 2, 32, torch.float32)
    want = tree_attention_reference(q, k, v, batch)
    config = TileConfig(block_m=16, block_n=32, num_warps=2, num_stages=2, per_sm=4)
    compiled = {}
    got = tree_attention_triton(q, k, v, batch, config=config, compiled=compiled)
    assert (got - want).abs().max().item() <= TOLERANCE[torch.float32]
    assert set(compiled) == {"prefix", "tree"}  # their handles (None under the interpreter)
    monkeypatch.setenv(CONFIG_VARIABLE, str(config))
    assert TileConfig.parse(str(config)) == config and str(config) == "m16-n32-w2-s2-p4"
    assert torch.equal(tree_attention_triton(q, k, v, batch), got)


@pytest.mark.parametrize("block_n", [16, 32, 128])
def test_tree_steps_of_any_width_read_the_right_bit_words_and_end_at_each_tiles_last_node(block_n):
    """The tree launch loads each row's bit words once per step of block_n keys (half a word, one,
    four) and ends each tile's keys at its last node: a 300-node tree (10 words) in 16-row tiles,
    beside an old tree growing 20 new nodes, gives the reference's rows."""
    q, k, v, batch, _, _ = make_case(block_n, [(70, 1, 0, 300, "random"), (9, 0, 12, 20, "random")], 2, 2, 32,
                                     torch.float32)
    got = tree_attention_triton(q, k, v, batch, config=TileConfig(block_m=16, block_n=block_n))
    assert (got - tree_attention_reference(q, k, v, batch)).abs().max().item() <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("label,reason", [
    ("m48", "block_m=48 must be a power of two from 16 to 256"),
    ("n8", "block_n=8 must be a power of two from 16 to 256"),
    ("w3", "num_warps=3 must be a power of two"),
    ("s0", "num_stages=0 must be an integer from 1 to 8"),
    ("m64-x4", "'x4' is not m<rows>, n<keys>, w<warps>, s<stages> or p<programs per SM>"),
])
def test_an_invalid_tile_config_is_refused_with_its_reason(label, reason, monkeypatch):
    with pytest.raises(ValueError, match=re.escape(reason)):
        TileConfig.parse(label)
    monkeypatch.setenv(CONFIG_VARIABLE, label)
    q, k, v, batch, _, _ = make_case(1, CASES["prefix1_tree1"], 1, 1, 16, torch.float32)
    with pytest.raises(ValueError, match=f"{CONFIG_VARIABLE}='{label}': .*{re.escape(reason)}"):
        tree_attention_triton(q, k, v, batch)


def test_the_comparison_catches_a_wrong_causal_limit_and_a_wrong_ancestor_bit():
    """Power: a kernel that got one causal limit or one ancestor bit wrong would differ from the
    reference by far more than the tolerance."""
    q, k, v, batch, _, _ = make_case(2, [(40, 3, 0, 0, "chain"), (20, 1, 0, 12, "chain")], 2, 2, 32, torch.float32)
    want = tree_attention_reference(q, k, v, batch)
    causal = batch.causal.clone()
    causal[1] -= 1  # the second new committed token of the prefill misses itself
    bits = batch.tree_bits.clone()
    bits[-1, 0] &= ~1  # the deepest node of the chain misses its first ancestor
    for wrong in (dict(causal=causal), dict(tree_bits=bits)):
        mutant = TreeBatch(**{**batch.__dict__, **wrong, "_derived": {}})
        assert (tree_attention_triton(q, k, v, mutant) - want).abs().max().item() > 100 * TOLERANCE[torch.float32]


def capacity(trash: int) -> Capacity:
    return Capacity(queries=64, requests=6, blocks=24, words=2, trash_block=trash)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_padded_batch_of_fixed_capacity_gives_the_same_rows(dtype):
    """Padded to a Capacity (empty request slots, padding queries writing to a trash block), the
    kernel and the reference give the real rows the unpadded batch gives, and zeros or finite
    values in the padding rows."""
    requests = [(30, 1, 0, 9, "random"), (5, 0, 0, 4, "wide"), (200, 1, 0, 0, "chain")]
    q, k, v, batch, _, _ = make_case(4, requests, 2, 2, 32, dtype)
    qp, kp, vp, padded, _, _ = make_case(4, requests, 2, 2, 32, dtype, capacity=capacity)
    n = q.shape[0]
    assert qp.shape[0] == 64 and padded.has_tree and padded.max_seq_len == 24 * 16
    assert torch.equal(qp[:n], q) and torch.equal(padded.causal[:n], batch.causal)
    want = tree_attention_reference(q, k, v, batch).float()
    for fn in (tree_attention_triton, tree_attention_reference):
        got = fn(qp, kp, vp, padded).float()
        assert (got[:n] - want).abs().max().item() <= TOLERANCE[dtype]
        assert torch.isfinite(got[n:]).all()
    assert not tree_attention_triton(qp, kp, vp, padded)[n:].any(), "padding queries see no key"


class Recorder:
    """Stands in for a Triton kernel: records each launch's grid and arguments."""

    def __init__(self, launches: list):
        self.launches = launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
            self.launches.append((grid, shapes, kwargs))
        return launch


def test_a_launch_depends_only_on_the_capacity_and_never_waits_for_the_device(monkeypatch):
    """Two different batches of one capacity launch the same grids with the same sizes and
    constants, and the call makes no host synchronization: it can run inside a CUDA graph."""
    launches = []
    monkeypatch.setattr(kernel_module, "_prefix_kernel", Recorder(launches))
    monkeypatch.setattr(kernel_module, "_tree_kernel", Recorder(launches))
    seen, syncs = [], []
    for requests in ([(30, 1, 0, 9, "random"), (200, 1, 0, 0, "chain")],
                     [(3, 0, 0, 20, "wide"), (7, 5, 0, 0, "chain"), (100, 1, 0, 30, "random"), (1, 0, 0, 1, "chain")]):
        q, k, v, batch, _, _ = make_case(9, requests, 2, 4, 32, torch.float16, capacity=capacity, pool_blocks=40)
        launches.clear()
        syncs.append(ops.count(functools.partial(tree_attention_triton, q, k, v, batch))[1])
        seen.append(list(launches))
    assert len(seen[0]) == 2 and seen[0] == seen[1] and syncs == [0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_call_replays_over_new_batch_contents():
    q, k, v, batch, _, _ = make_case(11, [(30, 1, 0, 9, "random"), (5, 0, 0, 4, "wide")], 2, 2, 32,
                                     torch.bfloat16, capacity=capacity, pool_blocks=40)
    tree_attention_triton(q, k, v, batch)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention_triton(q, k, v, batch)
    q2, k2, v2, batch2, _, _ = make_case(12, [(60, 1, 0, 20, "random"), (2, 0, 0, 1, "chain")], 2, 2, 32,
                                         torch.bfloat16, capacity=capacity, pool_blocks=40)
    for mine, new in [(q, q2), (k, k2), (v, v2)] + [(getattr(batch, f), getattr(batch2, f)) for f in (
            "block_tables", "seq_lens", "tree_starts", "q_starts", "causal", "tree_bits")]:
        mine.copy_(new)
    graph.replay()
    n = batch2.host_q_starts[-2]
    want = tree_attention_reference(q2, k2, v2, batch2).float()
    assert (out[:n].float() - want[:n]).abs().max().item() <= TOLERANCE[torch.bfloat16]
