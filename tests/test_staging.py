"""The host's preparation of a step (specinfer_kernels/batch.py `Staging`, `TreeBatch.pack`; model.py `Layout.stage`).

- On a GPU a bucket's inputs live twice, pinned on the host and at fixed addresses on the device,
  and a padded step sends only what it uses: every per-query and per-request field, the tree bits
  of its queries and the block-table rows of its requests. The rest of the device buffer keeps
  whatever an earlier, larger step left there. Mirrored staging on the CPU (a device buffer of its
  own, filled only by `send`) shows that this is enough: steps that shrink and grow through the
  same buckets give the eager logits.
- Every field starts 16-byte aligned (Triton specializes on pointer alignment).
- A tree node's position is the committed length - 1 + its depth, read off its ancestor bits.
"""

from __future__ import annotations

import random

import pytest
import torch

from specinfer.graphs import GraphConfig, StepRunner
from specinfer.model import Layout, LlamaModel, StepInput
from specinfer_bench.attention_cases import random_tree
from specinfer_kernels import Capacity, Staging

from .conftest import MODELS
from .test_graphs import STATIC, verifier_steps


def test_a_mirrored_staging_sends_enough_for_steps_that_shrink_and_grow(heldout_ids, monkeypatch):
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    prompts = heldout_ids[:3]
    want = verifier_steps(llm, GraphConfig(mode="eager"), prompts)
    sent = []
    init = StepRunner.__init__

    def mirrored(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for bucket in self.buckets:
            bucket.staging = Staging(bucket.staging.shapes, "cpu", mirror=True)
            send = bucket.staging.send
            bucket.staging.send = lambda ranges, send=send: sent.append(ranges) or send(ranges)
    monkeypatch.setattr(StepRunner, "__init__", mirrored)
    for _ in range(2):  # the second time every bucket holds an earlier step's leftovers
        got = verifier_steps(llm, STATIC, prompts)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()
    assert sent and all(len(r) == 2 for r in sent), "two ranges: the small fields and tree bits, the block tables"


def test_fields_start_16_byte_aligned_and_views_keep_their_addresses():
    shapes = {"a": (3,), "b": (5, 3), "c": (7,), "d": (2, 2)}
    staging = Staging(shapes, "cpu")
    views = staging.send([(0, staging.total)])
    assert all(v.data_ptr() % 16 == 0 for v in views.values())
    assert {k: tuple(v.shape) for k, v in views.items()} == shapes
    staging.host()["c"][:] = 7
    again = staging.send([])
    assert all(again[k].data_ptr() == views[k].data_ptr() for k in shapes) and again["c"].tolist() == [7] * 7


def test_positions_of_tree_nodes_are_the_committed_length_less_one_plus_their_depth():
    llm = LlamaModel.from_pretrained(MODELS / "ssm-0")
    runner = StepRunner(llm, llm.new_pool(4096), STATIC)
    rng = random.Random(3)
    caches = [runner.pool.new_cache() for _ in range(3)]
    items = []
    for cache, (prompt, nodes) in zip(caches, [(5, 0), (7, 12), (4, 30)]):
        cache.tokens = list(range(prompt))
        parents = random_tree(rng, nodes, 5).parents
        items.append(StepInput(cache, cache.pending, [1] * nodes, parents))
    step, bucket, _ = runner.prepare(items)
    want = []
    for cache, item in zip(caches, items):
        depth = {-1: 0}
        for u, p in enumerate(item.tree_parents):
            depth[u] = depth[p] + 1
        want += list(range(len(item.new_tokens))) + [cache.length - 1 + depth[u] for u in range(len(item.tree_parents))]
    assert bucket is not None and step.positions[: len(want)].tolist() == want
    assert torch.equal(step.positions[len(want):], torch.zeros_like(step.positions[len(want):]))


def test_a_reused_buffer_holds_the_padding_wherever_the_step_has_none():
    """A padded step rewrites only the padding rows an earlier, larger step used (`Staging.claim`):
    after steps that shrink and grow through one buffer, and after a large one refused halfway (a
    parent after its child), every row past the step's own is padding, exactly as in a fresh buffer
    (no keys, writes to the trash block, token 0, LM-head row 0)."""
    llm = LlamaModel.from_pretrained(MODELS / "ssm-0")
    pool = llm.new_pool(4096)
    cap = Capacity(96, 5, 16, 2, pool.reserve())
    staging = Staging(Layout.empty(pool).shapes(cap), "cpu")
    rng = random.Random(5)
    refused = [(2, 0), (3, 60)]  # its last node's parent comes after it
    for batch in ([(5, 0), (7, 30), (4, 40)], [(3, 6)], refused, [(9, 0), (2, 12), (6, 3)], [(1, 0)]):
        items = []
        for prompt, nodes in batch:
            cache = pool.new_cache()
            cache.tokens = list(range(prompt))
            parents = random_tree(rng, nodes, 3).parents
            if batch is refused and nodes:
                parents[-1] = nodes
            items.append(StepInput(cache, cache.pending, [1] * nodes, parents))
        layout = llm.layout(items)
        if batch is refused:
            with pytest.raises(ValueError, match="parents must precede children"):
                llm.prepare(layout, capacity=cap, staging=staging)
            continue
        llm.prepare(layout, capacity=cap, staging=staging)
        n, b, rows, out = len(layout.tokens), len(items), layout.n_rows, staging.arrays
        assert out["causal"][n:].tolist() == [0] * (cap.queries - n)
        assert out["write_blocks"][n:].tolist() == [cap.trash_block] * (cap.queries - n)
        assert out["write_offsets"][n:].tolist() == [j % pool.block_size for j in range(n, cap.queries)]
        assert out["query_requests"][n:].tolist() == [cap.requests - 1] * (cap.queries - n)
        assert out["seq_lens"][b:].tolist() == out["tree_starts"][b:].tolist() == [0] * (cap.requests - b)
        assert out["q_starts"][b + 1:].tolist() == [n] * (cap.requests - b - 1) + [cap.queries]
        assert out["ids"][n:].tolist() == out["positions"][n:].tolist() == [0] * (cap.queries - n)
        assert out["wanted"][rows:].tolist() == [0] * (cap.queries - rows)
