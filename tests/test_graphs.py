"""The CUDA-graph path (specinfer/graphs.py): steps padded to a bucket's capacity in persistent
buffers give what the eager forward gives. On the CPU the padded static-buffer path runs without
a graph (mode "static"); on CUDA the captured graphs themselves are checked.

- Verifier steps (prefill, trees, steps too large for any bucket) and speculator drafts (greedy
  and sampled) through static buffers give the eager logits (float32: within 1e-5 of their scale) and trees.
- The same with the Triton kernels (tree attention and the fused layer kernels) under the
  interpreter on a small model.
- Greedy generation through static buffers equals the LLM alone (tests/test_greedy.py), and the
  chi-square test passes through them (tests/test_sampling_exact.py).
- On CUDA: graph replays give the eager logits for the same verifier steps, and greedy outputs
  through graphs equal eager outputs on the held-out prompts (float32).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from specinfer.generate import Engine, Mode, Request
from specinfer import graphs
from specinfer.graphs import GraphConfig, StepRunner, bucket_sizes, graph_pool
from specinfer.model import Layout, LlamaModel
from specinfer.sampling import SamplingParams
from specinfer.speculator import DraftRequest, Speculator
from specinfer.tree import TokenTree
from specinfer.verifier import Verifier, VerifyRequest
from specinfer_bench import ops
from specinfer_bench.attention_cases import random_tree

from .conftest import MODELS
from .test_device_steps import same_tree

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's kernels: CUDA, or the interpreter on the CPU
STATIC = GraphConfig(mode="static", max_tokens=64, max_batch=4, max_tree=64, max_context=256)


class Recording(Verifier):
    """A verifier that keeps every forward pass's logits."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits = []

    def forward(self, items):
        out = super().forward(items)
        self.logits.append(out.clone())
        return out


def padded_steps(model: LlamaModel, monkeypatch) -> list[int]:
    """Record the capacity (its token count) of every step `model` lays out padded."""
    seen, prepare = [], model.prepare

    def spy(layout, ids=None, capacity=None, staging=None):
        if capacity is not None:
            seen.append(capacity.queries)
        return prepare(layout, ids, capacity, staging)
    monkeypatch.setattr(model, "prepare", spy)
    return seen


def verifier_steps(llm: LlamaModel, graphs: GraphConfig, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prefill, then three steps of random trees (0 to 40 nodes) for every request; the logits."""
    rng = random.Random(0)
    verifier = Recording(llm, 8192, graphs)
    verifier.step([VerifyRequest(str(i), p) for i, p in enumerate(prompts)])
    for size in ([5, 0, 12], [1, 3, 0], [40, 2, 7]):
        trees = [TokenTree(rng.sample(range(llm.cfg.vocab_size), len(s.parents)), s.parents)  # one node per path
                 for s in (random_tree(rng, n, 3) for n in size)]
        verifier.step([VerifyRequest(str(i), [], t) for i, t in enumerate(trees)])
    return verifier.logits


def test_static_buffers_give_the_eager_logits_for_verifier_steps(heldout_ids, monkeypatch):
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    prompts = heldout_ids[:3]
    want = verifier_steps(llm, GraphConfig(mode="eager"), prompts)
    padded = padded_steps(llm, monkeypatch)
    got = verifier_steps(llm, STATIC, prompts)
    assert sum(map(len, prompts)) > 64, "the prefill fits no bucket: it runs eagerly"
    tokens = [5 + 0 + 12 + 3, 1 + 3 + 0 + 3, 40 + 2 + 7 + 3]  # each tree step: the nodes and 3 bonus tokens
    assert padded == [min(b for b in bucket_sizes(STATIC.max_tokens) if b >= n) for n in tokens], "the next bucket up"
    for g, w in zip(got, want, strict=True):
        # relative to the logits' scale: padded matmuls have more rows, so BLAS sums in another order
        assert g.shape == w.shape and (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=5, mss=True),
                                      SamplingParams(temperature=0.8, top_p=0.9, seed=5)], ids=["greedy", "mss", "coupled"])
def test_static_buffers_give_the_eager_trees_for_speculator_drafts(heldout_ids, sampling, monkeypatch):
    ssm = LlamaModel.from_pretrained(MODELS / "ssm-0")
    expansions = [[2, 1, 1], [1, 1, 3, 1], [3, 2], []]
    first = [DraftRequest(str(i), p, e, sampling) for i, (p, e) in enumerate(zip(heldout_ids[:4], expansions))]
    trees = {}
    for mode in ("eager", "static"):
        spec = Speculator(ssm, graphs=GraphConfig(**{**STATIC.__dict__, "mode": mode}))
        padded = padded_steps(ssm, monkeypatch)
        a = spec.draft(first)
        more = [t.tokens[:1] + [7] if len(t) else [7] for t in a]
        trees[mode] = a + spec.draft([DraftRequest(str(i), m, e, sampling) for i, (m, e) in enumerate(zip(more, expansions))])
        monkeypatch.undo()
    assert len(padded) >= 6, "the levels after the prefill are padded"
    assert all(same_tree(s, e) for s, e in zip(trees["static"], trees["eager"], strict=True))
    assert any(len(t) for t in trees["static"])


def test_static_buffers_with_the_triton_kernels_give_the_reference_logits(tiny_pair, monkeypatch):
    """Tree attention and the fused layer kernels over padded buffers, on the device where the
    kernels run: a GPU, or the CPU under Triton's interpreter (conftest.py)."""
    _, llm_dir, _ = tiny_pair
    llm = LlamaModel.from_pretrained(llm_dir, device=DEVICE)
    prompts = [[5, 9, 2, 7, 1], [3, 3], [8, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11]]
    monkeypatch.setenv("SPECINFER_TREE_ATTENTION", "reference")
    monkeypatch.setenv("SPECINFER_FUSED", "reference")
    want = verifier_steps(llm, GraphConfig(mode="eager"), prompts)
    monkeypatch.setenv("SPECINFER_TREE_ATTENTION", "triton")
    monkeypatch.setenv("SPECINFER_FUSED", "triton")
    got = verifier_steps(llm, STATIC, prompts)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= 1e-4


def test_graphs_need_a_cuda_device_and_modes_are_named():
    llm = LlamaModel.from_pretrained(MODELS / "ssm-0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'graphs' needs a CUDA device and the Triton tree attention"):
            StepRunner(llm, llm.new_pool(1024), GraphConfig(mode="graphs"))
    with pytest.raises(ValueError, match="graph mode 'fast' is not one of"):
        StepRunner(llm, llm.new_pool(1024), GraphConfig(mode="fast"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_give_the_eager_logits_for_verifier_steps(heldout_ids):
    """The captured graphs themselves (mode "graphs", float32): the same steps as on the CPU, each
    replayed over its bucket's buffers, give the eager forward's logits within 1e-5 of their scale."""
    llm = LlamaModel.from_pretrained(MODELS / "llm", device="cuda")
    prompts = heldout_ids[:3]
    want = verifier_steps(llm, GraphConfig(mode="eager"), prompts)
    got = verifier_steps(llm, GraphConfig(mode="graphs", max_tokens=64, max_batch=4, max_tree=64, max_context=256),
                         prompts)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_greedy_outputs_through_cuda_graphs_equal_eager_outputs(heldout_ids):
    """float32 (IEEE dots in the attention kernel, no TF32): padding changes block sizes and key
    splits, which bf16 rounding could turn into a different argmax now and then. The second graphed
    engine is built after the first is gone, with it the graph pool's last graph (see the next test)."""
    llm = LlamaModel.from_pretrained(MODELS / "llm", device="cuda")
    ssms = [LlamaModel.from_pretrained(MODELS / f"ssm-{i}", device="cuda") for i in range(2)]
    requests = [Request(p, 64) for p in heldout_ids]
    outputs = []
    for mode in ("eager", "graphs", "graphs"):
        engine = Engine(llm, ssms, Mode.MERGED, [2, 1, 1], graphs=GraphConfig(mode=mode))
        outputs.append([g.token_ids for g in engine.generate(requests)])
        del engine
        gc.collect()
    assert outputs[1] == outputs[2] == outputs[0]


def test_graphs_share_a_pool_while_one_captured_in_it_lives_and_get_a_new_one_after(monkeypatch):
    """PyTorch frees a graph pool with the last graph captured in it, and asserts on a capture into
    it after that (seen on an H200: an engine built after another was dropped). Handles are faked:
    the property is which handle a capture gets."""
    handles = iter(range(1, 100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(graphs, "_POOLS", {})
    device = torch.device("cuda", 0)

    class Graph:
        pass

    first, second = Graph(), Graph()
    pool = graph_pool(device, first)
    assert graph_pool(device, second) == pool
    del first
    gc.collect()
    third = Graph()
    assert graph_pool(device, third) == pool, "the second graph still lives in the pool"
    del second, third
    gc.collect()
    assert graph_pool(device, Graph()) not in (pool, None)


def test_a_step_of_padding_only_writes_nothing_a_request_holds():
    """What a graph is captured over: every query is padding; the pool's request blocks keep their
    K/V and only the trash block changes."""
    llm = LlamaModel.from_pretrained(MODELS / "ssm-0")
    verifier = Verifier(llm, 1024, STATIC)
    verifier.step([VerifyRequest("a", list(range(1, 40)))])
    bucket = verifier.run.buckets[-1]
    verifier.pool.k[:, bucket.capacity.trash_block] = 0  # the prefill's padding wrote there already
    before = verifier.pool.k.clone()
    layout = Layout.empty(verifier.pool)
    logits = llm.run(llm.prepare(layout, capacity=bucket.capacity, staging=bucket.staging))
    changed = (verifier.pool.k != before).flatten(2).any(-1).any(0).nonzero().flatten().tolist()  # blocks
    # ssm-0 drafts from its draft vocabulary: its other tokens' logits are -inf by design
    assert torch.isfinite(logits[:, llm.vocab_ids]).all() and changed == [bucket.capacity.trash_block]
    assert verifier.pool.n_blocks == verifier.pool.k.shape[1] - 1, "the trash block is not offered to requests"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_through_static_buffers_synchronizes_once(heldout_ids, temperature):
    """The SSM's whole draft for a fixed expansion is a sequence of padded steps (replayed graphs
    on CUDA) with no host synchronization until the finished trees are copied out."""
    spec = Speculator(LlamaModel.from_pretrained(MODELS / "ssm-0"), graphs=STATIC)
    batch = [DraftRequest(str(i), p, [2, 2, 1], SamplingParams(temperature, seed=i, mss=True))
             for i, p in enumerate(heldout_ids[:4])]
    spec.draft(batch)  # prefill
    again = [DraftRequest(r.request_id, [5], r.expansion, r.sampling) for r in batch]
    assert ops.count(lambda: spec.draft(again))[1] == 1
