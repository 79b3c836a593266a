"""Tree attention over a paged KV cache as one Triton kernel (FlashAttention-style online softmax).

One program handles BLOCK_M rows of one request's (query, query head) pairs that share a KV head,
over one split of that request's key slots. Pairing the G query heads of a KV head in one tile
makes grouped-query attention read each K/V block once for all G heads. Keys are gathered through
the block table BLOCK_N at a time, so the tile width does not depend on the pool's block size.
The mask is never materialized: a key is visible when it lies below the query's causal limit or
its bit is set in the query's packed ancestor row (see batch.py).

Long prefixes with few queries (decoding) would leave most of a GPU idle, so the key range is
split (flash-decoding): each split writes its partial output and log-sum-exp, and a short
combine step weighs the splits. With one split the kernel writes the output directly.

Triton's CPU interpreter (TRITON_INTERPRET=1) multiplies bfloat16 tiles wrongly in `tl.dot`, so
there, and only there, bfloat16 tiles are widened to float32 right after loading.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .batch import TreeBatch

LOG2E = 1.4426950408889634


@triton.jit
def _tree_attention_kernel(
    Q, K, V, O, LSE,
    tile_request, tile_row,
    block_tables, seq_lens, tree_starts, q_starts, causal, tree_bits,
    scale_log2, split_len, n_words,
    stride_qn, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_os, stride_on, stride_oh,
    stride_ls, stride_ln,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(tile_request + tile)
    q_lo = tl.load(q_starts + b)
    q_hi = tl.load(q_starts + b + 1)
    seq_len = tl.load(seq_lens + b)
    tree_start = tl.load(tree_starts + b)

    rows = tl.load(tile_row + tile) + tl.arange(0, BLOCK_M)  # (query, head-in-group) pairs
    qi = q_lo + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = qi < q_hi
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + qi[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    limit = tl.load(causal + qi, mask=row_ok, other=0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < end
        block = tl.load(block_tables + b * stride_bt + j // BLOCK_SIZE, mask=j_ok, other=0)
        slot = j % BLOCK_SIZE
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(K + block[:, None] * stride_kb + kv_head * stride_kh + slot[:, None] * stride_kt + d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        t = j - tree_start
        in_tree = (t >= 0) & j_ok
        word = tl.load(tree_bits + qi[:, None] * n_words + (t[None, :] >> 5),
                       mask=row_ok[:, None] & in_tree[None, :], other=0)
        bit = (word >> (t[None, :] & 31)) & 1
        visible = ((j[None, :] < limit[:, None]) | (bit != 0)) & j_ok[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + block[:, None] * stride_vb + kv_head * stride_vh + slot[:, None] * stride_vt + d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    empty = l_i == 0.0  # this split saw no visible key for the row
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(O + split * stride_os + qi[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + split * stride_ls + qi * stride_ln + head, lse, mask=row_ok)


def _tiles(batch: TreeBatch, group: int, block_m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, first row) of every tile of BLOCK_M (query, head-in-group) rows; cached per batch."""
    key = ("tiles", group, block_m, str(device))
    cache = batch.__dict__.setdefault("_launch", {})
    if key not in cache:
        requests, first_rows = [], []
        for b in range(batch.n_requests):
            rows = (batch.host_q_starts[b + 1] - batch.host_q_starts[b]) * group
            for r in range(0, rows, block_m):
                requests.append(b)
                first_rows.append(r)
        cache[key] = (torch.tensor(requests, dtype=torch.int32).to(device),
                      torch.tensor(first_rows, dtype=torch.int32).to(device))
    return cache[key]


@functools.lru_cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(programs: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    """Enough key splits to give every SM about two programs, each split at least 4 tiles long."""
    if device.type != "cuda" or programs == 0:
        return 1
    sms = _sm_count(device)
    return max(1, min(math.ceil(2 * sms / programs), math.ceil(max_seq_len / (4 * block_n)), 64))


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TreeBatch,
                          scale: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Same contract as `tree_attention_reference`: q [N, Hq, D]; k_cache, v_cache
    [n_blocks, block_size, Hkv, D]. Returns [N, Hq, D] in q's dtype. `num_splits` overrides the
    split of the key range (tests use it to cover the combine step)."""
    n_q, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert hq % hkv == 0 and k_cache.shape == v_cache.shape and bs == batch.block_size
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    group = hq // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    max_rows = max((batch.host_q_starts[b + 1] - batch.host_q_starts[b] for b in range(batch.n_requests)), default=0)
    block_m = 16 if max_rows * group <= 16 else 64
    block_n = 64
    tile_request, tile_row = _tiles(batch, group, block_m, q.device)
    splits = num_splits or _num_splits(len(tile_request) * hkv, batch.max_seq_len, block_n, q.device)
    split_len = math.ceil(math.ceil(max(batch.max_seq_len, 1) / splits) / block_n) * block_n
    out = torch.empty_like(q)
    o = out[None] if splits == 1 else torch.empty(splits, n_q, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, n_q, hq, dtype=torch.float32, device=q.device)
    if len(tile_request) == 0:
        return out
    grid = (len(tile_request), hkv, splits)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, o, lse,
        tile_request, tile_row,
        batch.block_tables, batch.seq_lens, batch.tree_starts, batch.q_starts, batch.causal, batch.tree_bits,
        scale * LOG2E, split_len, batch.tree_bits.shape[1],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(2), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(2), v_cache.stride(1),
        o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1),
        batch.block_tables.stride(0),
        GROUP=group, BLOCK_SIZE=bs, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        UPCAST=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
    )
    if splits > 1:
        weights = torch.exp2(lse - lse.amax(0, keepdim=True))  # [S, N, Hq]; every row sees itself somewhere
        out.copy_((weights[..., None] * o).sum(0) / weights.sum(0)[..., None])
    return out
