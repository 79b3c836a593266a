"""The paged KV cache: blocks follow use, accepted tree entries are moved (not recomputed), a full
pool refuses a step without changing anything, decoding through the Triton kernel on the paged
cache is the LLM's own greedy decoding, and the manager admits requests within the verifier's
pool."""

from __future__ import annotations

import gc
import threading
import time

import grpc
import pytest
import torch

from manager_svc.__main__ import ManagerConfig
from specinfer.generate import Engine, Mode, Request
from specinfer.engine import default_tree_budget
from specinfer.errors import CacheFull
from specinfer.kv_cache import KVPool, commit_all
from specinfer.model import LlamaModel
from specinfer.tree import TokenTree, tree_size
from specinfer.verifier import Verifier, VerifyRequest
from specinfer_rpc.client import generate_all
from specinfer_rpc.launch import launch
from specinfer_rpc.v1 import verifier_pb2, verifier_pb2_grpc

from .conftest import MODELS
from .services import active_requests, reference_greedy
from .test_greedy import hf_greedy


def test_blocks_are_taken_as_slots_grow_and_given_back():
    pool = KVPool(2, 1, 4, torch.float32, tokens=8 * 16, block_size=16)
    cache = pool.new_cache()
    cache.extend(20, [], [])
    assert len(cache.blocks) == 2 and len(pool.free) == 6
    cache.extend(0, list(range(30)), [-1] * 30)  # a 30-node tree: slots 20..49
    assert len(cache.blocks) == 4
    cache.commit([3])  # one accepted node: 21 slots stay
    assert len(cache.blocks) == 2 and len(pool.free) == 6
    cache.release()
    assert len(pool.free) == 8 and cache.blocks == []
    other = pool.new_cache()
    other.extend(40, [], [])
    del other
    gc.collect()
    assert len(pool.free) == 8, "a dropped cache returns its blocks"


def test_the_pools_table_of_block_tables_holds_every_live_caches_blocks():
    """`KVPool.tables` (what a batch gathers its block tables from) agrees with each cache's own
    list as caches outgrow its rows (8 at first) and columns (64), and a dropped cache's row is
    reused."""
    pool = KVPool(1, 1, 4, torch.float32, tokens=400 * 4, block_size=4)
    caches = [pool.new_cache() for _ in range(12)]
    for i, cache in enumerate(caches):
        cache.extend(3 + 7 * i, [], [])
    caches[-1].extend(0, list(range(250)), [-1] * 250)  # 331 slots: 83 blocks
    caches[-1].commit([4])
    assert len({c.row for c in caches}) == 12 and pool.tables.shape[1] >= 83
    for cache in caches:
        assert pool.tables[cache.row, : len(cache.blocks)].tolist() == cache.blocks
    row = caches[5].row
    del caches[5]
    gc.collect()
    again = pool.new_cache()
    again.extend(9, [], [])
    assert again.row == row and pool.tables[row, :3].tolist() == again.blocks


def entries(pool: KVPool, cache, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V entries [layers, len(slots), Hkv, D] of a cache's slots."""
    at = cache.pool_slots(slots)
    return tuple(x.view(x.shape[0], -1, *x.shape[3:])[:, at].clone() for x in (pool.k, pool.v))


def test_commit_moves_accepted_entries_across_blocks_for_many_caches_at_once():
    pool = KVPool(2, 2, 4, torch.float32, tokens=12 * 4, block_size=4)
    pool.k.copy_(torch.randn_like(pool.k))
    pool.v.copy_(torch.randn_like(pool.v))
    caches, paths, want, kept = [], [[2, 3, 5, 6], [0, 1]], [], []
    for prefix in (6, 3):
        cache = pool.new_cache()
        cache.extend(prefix, [], [])
        cache.extend(0, [1, 2, 3, 4, 5, 6, 7], [-1, 0, -1, 2, 3, 3, 5])  # slots prefix .. prefix + 6
        caches.append(cache)
    for cache, path in zip(caches, paths):
        want.append(entries(pool, cache, [cache.length + u for u in path]))
        kept.append(entries(pool, cache, range(cache.length)))
    commit_all(caches, paths)
    for cache, path, prefix, w, k in zip(caches, paths, (6, 3), want, kept):
        assert cache.length == prefix + len(path) and len(cache.tree) == 0
        got = entries(pool, cache, range(prefix, prefix + len(path)))
        assert torch.equal(got[0], w[0]) and torch.equal(got[1], w[1])
        assert torch.equal(entries(pool, cache, range(prefix))[0], k[0])


@pytest.fixture(scope="module")
def llm():
    return LlamaModel.from_pretrained(MODELS / "llm")


def test_full_pool_refuses_a_step_and_changes_nothing(llm):
    verifier = Verifier(llm, kv_tokens=4 * 16)
    verifier.step([VerifyRequest("a", list(range(1, 40)))])  # 39 slots (+1 bonus token pending): 3 of 4 blocks
    free, record = list(verifier.pool.free), list(verifier.caches["a"].tokens)
    with pytest.raises(CacheFull, match="needs 2 more blocks"):
        verifier.step([VerifyRequest("a", [], TokenTree(list(range(5, 15)), [-1] * 10)),
                       VerifyRequest("b", [1, 2, 3])])
    assert verifier.pool.free == free and verifier.caches["a"].tokens == record and "b" not in verifier.caches
    verifier.release("a")
    assert verifier.pool.available == 4 and len(verifier.pool.cached) == 2  # a's two full blocks stay cached
    verifier.step([VerifyRequest("b", [1, 2, 3])])


def greedy_steps(verifier: Verifier, rid: str, prompt: list[int], steps: int, computed: list) -> list[int]:
    """A request's greedy tokens over `steps` steps, each with a two-node chain drafted from the
    previous step's tokens (some accepted, some not); `computed` gets each step's computed rows."""
    forward = verifier.forward
    verifier.forward = lambda items: computed.append([len(it.new_tokens) + len(it.tree_tokens) for it in items]) \
        or forward(items)
    out = verifier.step([VerifyRequest(rid, prompt)])[0].tokens
    for _ in range(steps):
        out += verifier.step([VerifyRequest(rid, [], TokenTree([out[-1], out[-1]], [-1, 0]))])[0].tokens
    verifier.forward = forward
    return out


def test_a_prompt_live_requests_hold_is_taken_from_their_blocks_not_computed_again(llm, heldout_ids):
    prompt = heldout_ids[0][:40]  # two full blocks of 16, then 8 tokens
    alone = greedy_steps(Verifier(llm), "x", prompt, 6, [])
    verifier = Verifier(llm)
    pool, free = verifier.pool, len(verifier.pool.free)
    rows = []
    assert greedy_steps(verifier, "a", prompt, 6, rows) == alone
    assert rows[0] == [40]
    rows.clear()
    assert greedy_steps(verifier, "b", prompt, 6, rows) == alone  # what it would have computed, bit for bit
    assert rows[0] == [8]  # its first 32 tokens came from a's blocks
    a, b = verifier.caches["a"], verifier.caches["b"]
    assert b.blocks[:2] == a.blocks[:2] and list(pool.holders[a.blocks[:2]]) == [2, 2]
    other = heldout_ids[0][:16] + heldout_ids[1][:24]  # the same first block only
    rows.clear()
    greedy_steps(verifier, "c", other, 0, rows)
    assert rows[0] == [24] and verifier.caches["c"].blocks[0] == a.blocks[0]
    rows.clear()
    verifier.step([VerifyRequest("d", prompt, prompt_logprobs=True)])  # its prompt's rows are asked for
    verifier.release("d")
    verifier.release("a")
    assert list(pool.holders[b.blocks[:2]]) == [2, 1]  # b still reads them (and c the first)
    rows.clear()
    greedy_steps(verifier, "e", prompt, 0, rows)
    assert rows[0] == [8]
    for rid in ("b", "c", "e"):
        verifier.release(rid)
    assert pool.available == free and set(pool.cached) == set(pool.held) == set(pool.prefix.values())


def test_a_finished_requests_blocks_serve_later_prompts_until_a_step_needs_them(llm, heldout_ids):
    """The prefix cache across requests: a released request's full blocks stay indexed, a later
    prompt that starts alike takes them (reported as cached tokens) and decodes exactly what it
    would have alone; they are evicted only when a step finds no free block, least recently used
    first and a request's deepest block before the ones that lead to it; off, nothing is kept."""
    prompt = heldout_ids[0][:40]  # two full blocks, then 8 tokens
    alone = greedy_steps(Verifier(llm, prefix_cache=False), "x", prompt, 6, [])
    verifier = Verifier(llm)
    rows = []
    assert greedy_steps(verifier, "a", prompt, 6, rows) == alone
    verifier.release("a")
    rows.clear()
    assert greedy_steps(verifier, "b", prompt, 6, rows) == alone  # what it would have computed, bit for bit
    assert rows[0] == [8] and verifier.pool.hit_tokens == 32 and verifier.pool.queried_tokens == 80
    verifier.release("b")
    assert verifier.step([VerifyRequest("c", prompt)])[0].cached_tokens == 32

    verifier = Verifier(llm, kv_tokens=8 * 16)
    pool = verifier.pool
    verifier.step([VerifyRequest("c", prompt)])  # 40 slots: three blocks, two of them full
    leading, second = verifier.caches["c"].blocks[:2]
    verifier.release("c")
    assert list(pool.cached) == [second, leading] and len(pool.free) == 6  # given back last block first
    other = (heldout_ids[1] + heldout_ids[2] + heldout_ids[3])[: 6 * 16 + 8]
    assert len(other) == 6 * 16 + 8
    verifier.step([VerifyRequest("d", other)])  # 7 blocks: the 6 free, 1 evicted
    assert list(pool.cached) == [leading] and second not in pool.held
    verifier.release("d")
    assert verifier.step([VerifyRequest("e", prompt)])[0].cached_tokens == 16  # its first block is still there
    verifier.release("e")
    assert pool.available == 8

    off = Verifier(llm, prefix_cache=False)
    off.step([VerifyRequest("a", prompt)])
    off.release("a")
    assert not off.pool.cached and not off.pool.prefix and off.step([VerifyRequest("b", prompt)])[0].cached_tokens == 0


def test_a_hash_hit_whose_tokens_differ_is_not_shared(llm, heldout_ids):
    prompt = heldout_ids[0][:40]
    verifier = Verifier(llm)
    verifier.step([VerifyRequest("a", prompt)])
    block = verifier.caches["a"].blocks[0]
    key, before, tokens = verifier.pool.held[block]
    verifier.pool.held[block] = (key, before, (tokens[0] + 1,) + tokens[1:])  # as if another prompt hashed alike
    rows = []
    greedy_steps(verifier, "b", prompt, 0, rows)
    assert rows[0] == [40]


def test_greedy_decoding_through_the_triton_kernel_matches_the_llm(monkeypatch, heldout_ids):
    """The model with the kernel as its attention (in Triton's interpreter when there is no GPU)
    emits exactly the tokens of transformers' incremental greedy decoding, and frees every block."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(MODELS / "llm", dtype=torch.float32).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton needs CUDA tensors unless interpreted
    llm = LlamaModel.from_pretrained(MODELS / "llm", device=device)
    ssm = LlamaModel.from_pretrained(MODELS / "ssm-0", device=device)
    prompts = heldout_ids[:2]
    want = [hf_greedy(hf, p, 12, eos=llm.cfg.eos_token_ids[0]) for p in prompts]
    import specinfer_kernels.tree_attention_triton as kernel_module
    calls = []
    kernel = kernel_module.tree_attention_triton
    monkeypatch.setattr(kernel_module, "tree_attention_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setenv("SPECINFER_TREE_ATTENTION", "triton")
    engine = Engine(llm, [ssm], Mode.TREE, [2, 1, 1])
    gens = engine.generate([Request(p, 12) for p in prompts])
    assert [g.token_ids for g in gens] == want
    assert calls and sum(sum(g.accepted) for g in gens) > 0, "the kernel ran and trees were accepted"
    assert engine.verifier.pool.available == engine.verifier.pool.n_blocks  # free, or kept by the prefix cache


def test_manager_takes_blocks_on_demand_preempts_when_the_pool_overflows_and_stays_exact(heldout_ids):
    """A verifier with a small pool: the manager admits requests by the blocks they hold now, so it
    runs more at once than reserving prompt + max_new_tokens would allow; when their growth
    overflows the pool it preempts, and the preempted requests resume, their outputs exact, their
    recompute served by the prefix cache; every block is back afterwards. A request that could
    never fit is refused with INVALID_ARGUMENT naming max_new_tokens."""
    prompts, new = heldout_ids[:6], 100
    defaults = ManagerConfig()
    tree = min(tree_size(defaults.expansion), default_tree_budget("cpu")) * 3  # each of two speculators and context lookup
    needs = [-(-(len(p) + new + tree) // 16) * 16 for p in prompts]
    kv = 2 * max(needs)
    system = launch(MODELS / "llm", [MODELS / "ssm-0", MODELS / "ssm-1"], speculators=2, port=0,
                    verifier_args=["--kv-cache-tokens", str(kv)])
    try:
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            streams=generate_all(system.manager.address, [Request(p, new) for p in prompts])))
        worker.start()
        most = 0
        while worker.is_alive():
            most = max(most, active_requests(system)["verifier"])
            time.sleep(0.05)
        streams = result["streams"]
        assert [s.token_ids for s in streams] == reference_greedy(prompts, new)
        assert most > kv // min(needs)
        assert sum(s.usage.preemptions for s in streams) > 0
        with grpc.insecure_channel(system.by_name("verifier").address) as channel:
            info = verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10)
        assert info.kv_cache_tokens == kv and info.kv_block_size == 16
        assert info.device == "cpu" and info.active_requests == 0 and info.kv_cache_free_tokens == kv and info.kv_cache_cached_tokens > 0
        with pytest.raises(grpc.RpcError) as e:
            generate_all(system.manager.address, [Request(prompts[0], kv)])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("max_new_tokens:")
    finally:
        system.stop()
