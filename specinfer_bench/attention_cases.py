"""What the attention benchmarks share (`kernel`, `kernel_sweep`, `kernel_compile` import it; none imports
another's internals): a ragged batch of trees over a paged KV cache (`attention_case`), the baseline
(SDPA over the batch padded, with the tree mask), the bytes a call must read, and how a call is timed.

No command of its own: `python -m specinfer_bench.kernel` (and `kernel_sweep`, `kernel_compile`) run it.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from specinfer.tree import TokenTree, dfs_order, reorder
from specinfer_kernels import RequestView, TreeBatch

from .report import median_ms

L2_FLUSH_BYTES = 256 << 20  # written between graphed calls: more than any GPU's L2 (H100, H200: 50 MB)
_FLUSH: list = []  # the buffer written between graphed calls and the ms its write takes alone
# the tile configurations a GPU sweep tries (kernel_sweep) and compiles ahead (kernel_compile); each axis
# holds the default's value, so a pass can always keep it
GPU_AXES = {"block_n": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3, 4], "block_m": [32, 64, 128],
            "per_sm": [1, 2, 4, 8]}
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0}  # HBM/GDDR peak, vendor figures


def random_tree(rng: random.Random, n: int, vocab: int) -> TokenTree:
    tree = TokenTree([rng.randrange(vocab) for _ in range(n)], [rng.randrange(-1, u) for u in range(n)])
    return reorder(tree, dfs_order(tree.parents))


def timed_ms(fn, cuda: bool, graph: bool = False) -> float:
    """Median ms of a call of fn. On CUDA with `graph`: the calls captured in a CUDA graph and replayed,
    as the runtime runs attention, so the GPU's own time without the host's launch cost (a few calls
    of small work are otherwise all launch cost); each call after a write of L2_FLUSH_BYTES, whose own time is taken off,
    so a call reads its inputs from HBM as a step's layers do (each its own K/V). Else one launch
    after another (the slower of host and GPU; triton clears L2 before each). On the CPU: wall time."""
    if cuda:
        import triton.testing
        if graph:
            bench = lambda f: triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median")  # noqa: E731
            if not _FLUSH:  # the buffer, and its write's own time (once a process)
                _FLUSH.append(torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda"))
                _FLUSH.append(bench(_FLUSH[0].zero_))
            flush, flush_ms = _FLUSH
            return max(0.0, bench(lambda: (flush.zero_(), fn())) - flush_ms)
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()  # warm-up
    return median_ms(fn, 7)


def attention_case(prefix: int, tree: int, batch: int, dtype, device, hq=32, hkv=8, d=128, bs=16, fill=torch.randn):
    """A batch of `batch` requests, each a `prefix`-token cache plus a `tree`-node tree (tree=1: one
    new committed token, plain decoding), its pages scattered over the pool. `fill` makes q, K and V
    (torch.empty where only shapes matter: compiling)."""
    rng = random.Random(prefix * 7 + tree * 3 + batch)
    per = -(-(prefix + tree) // bs)
    order = list(range(per * batch))
    rng.shuffle(order)
    views = []
    for b in range(batch):
        blocks = order[b * per:(b + 1) * per]
        if tree == 1:
            views.append(RequestView(blocks, prefix, 1, prefix + 1, [], 0))
        else:
            parents = random_tree(rng, tree, 2).parents
            views.append(RequestView(blocks, prefix, 0, prefix, parents, len(parents)))
    tb = TreeBatch.build(views, bs, device)
    q = fill(tb.host_q_starts[-1], hq, d, dtype=dtype, device=device)
    k = fill(per * batch, bs, hkv, d, dtype=dtype, device=device)
    v = fill(per * batch, bs, hkv, d, dtype=dtype, device=device)
    return q, k, v, tb


def dense_inputs(q, k, v, tb: TreeBatch):
    """The same batch padded and contiguous, with an explicit boolean mask [B, 1, Q, T]."""
    n_q = max(b - a for a, b in zip(tb.host_q_starts, tb.host_q_starts[1:]))
    t_max = tb.max_seq_len
    B, (_, hq, d), hkv = tb.n_requests, q.shape, k.shape[2]
    qd = q.new_zeros(B, hq, n_q, d)
    kd, vd = q.new_zeros(B, hkv, t_max, d), q.new_zeros(B, hkv, t_max, d)
    mask = torch.zeros(B, 1, n_q, t_max, dtype=torch.bool, device=q.device)
    mask[..., 0] = True  # padded query rows see one key (their output is ignored)
    visible = tb.visible(t_max)
    for b, n in enumerate(tb.host_seq_lens):
        a, e = tb.host_q_starts[b], tb.host_q_starts[b + 1]
        blocks = tb.block_tables[b, : -(-n // tb.block_size)]
        qd[b, :, : e - a] = q[a:e].transpose(0, 1)
        kd[b, :, :n] = k[blocks].flatten(0, 1)[:n].transpose(0, 1)
        vd[b, :, :n] = v[blocks].flatten(0, 1)[:n].transpose(0, 1)
        mask[b, 0, : e - a] = visible[a:e]
    return qd, kd, vd, mask


def kv_bytes(k: torch.Tensor, tb: TreeBatch) -> int:
    """What a call must read at least: every request's keys and values, once. (Python integers: the
    lengths' int32 overflows past 2 GiB, at batch 64 from prefix 8192 on.)"""
    return sum(tb.host_seq_lens.tolist()) * k.shape[2] * k.shape[3] * 2 * k.element_size()


def sdpa_ms(q, k, v, tb: TreeBatch, cuda: bool) -> float:
    """The baseline's time: SDPA over the batch padded and contiguous, with the tree mask."""
    qd, kd, vd, mask = dense_inputs(q, k, v, tb)
    return timed_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True), cuda, graph=True)


def card_peak_gbps() -> float | None:
    """The memory bandwidth peak of this process's GPU, by its name (None without a GPU or for another card)."""
    if not torch.cuda.is_available():
        return None
    return next((v for k, v in PEAK_GBPS.items() if k in torch.cuda.get_device_name()), None)
