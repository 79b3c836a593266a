"""Tree attention over a paged KV cache as two Triton kernels: the shared prefix, then the tree.

Every query of a request sees the same committed prefix, slots [0, tree_start): a tree node all of
it, a new committed token causally. Only the tree's own slots need the ancestor bits. So the
attention is cut in two, as cascade (shared-prefix) attention does, and the parts are merged by
their log-sum-exp:

1. `_prefix_kernel`, grid (tiles, KV heads, key splits): a tile is BLOCK_M (query, query head)
   rows of one request sharing a KV head, all of its tree nodes and the G query heads of a KV
   head side by side in the M dimension, so each prefix K/V block is read once per tile for all
   of them, with only a causal compare for a mask. Long prefixes with few rows (decoding) are
   split across programs (flash-decoding); each split leaves its partial output and log-sum-exp.
   The launch has the most splits any request may use; how many a request uses (each at least
   MIN_SPLIT keys) is planned on the device from its real prefix length (`_splits_of`), so a
   request of 100 tokens in a bucket sized for 4096 is one split, and the rest return at once.
2. `_tree_kernel`, grid (tiles, KV heads): the same tiles over the tree slots [tree_start,
   seq_len) with the ancestor bits, then the merge: the tile's own partial state and every prefix
   split's are folded into the output (`_merge`). When a batch has no tree and one split, the
   prefix kernel writes the output itself and this launch is skipped.

Nothing on the host depends on the batch's values: the tile table is computed on the device from
`q_starts` (once per batch, shared by all layers), grids and block sizes come from sizes the
caller knows (`TreeBatch.max_queries`, `max_seq_len`, tensor shapes; a batch built with a
`Capacity` has the same ones every time), and the only allocations are the output and the
partials' workspace. So a call can be captured in a CUDA graph and replayed over new contents.

Tile sizes, warps and stages are one `TileConfig` (SPECINFER_TREE_ATTENTION_CONFIG names another
than the default; `specinfer_bench.kernel_sweep` times them against SDPA).

Triton's CPU interpreter (TRITON_INTERPRET=1) multiplies bfloat16 tiles wrongly in `tl.dot`, so
there, and only there, bfloat16 tiles are widened to float32 right after loading.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from .batch import TreeBatch

LOG2E = 1.4426950408889634
# kernel vs reference, max abs difference on unit-variance inputs: float32 accumulates identically
# up to summation order; fp16/bf16 round P to the input type before P @ V, as FlashAttention does
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CONFIG_VARIABLE = "SPECINFER_TREE_ATTENTION_CONFIG"


@dataclass(frozen=True)
class TileConfig:
    """How both launches tile the work and how Triton compiles them. The defaults are placeholders,
    chosen without a GPU: Hopper's are to come from `specinfer_bench.kernel_sweep`'s figures.

    block_m     the most (query, head-in-group) rows of a tile: a tile takes the fewest of 16, 32, ...
                that hold one request's rows, up to block_m
    block_n     keys per step of the online softmax (a split of a prefix is at least 4 steps long)
    num_warps   warps per program
    num_stages  Triton's software-pipelining depth
    per_sm      programs per SM that key splits aim for (`_num_splits`): more splits of a long prefix
                when few requests decode; the launch's grid, not its compiled variant (LAUNCH_ONLY)

    Its label names it in records and in SPECINFER_TREE_ATTENTION_CONFIG: m64-n64-w4-s3-p2."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    per_sm: int = 2

    LAUNCH_ONLY = ("per_sm",)  # fields that change the grid, not a variant's code (though one split or
    # several decides whether the prefix launch writes the output directly: a variant the other cells compile)

    def __post_init__(self):
        for name, lo, hi, power in (("block_m", 16, 256, True), ("block_n", 16, 256, True),
                                    ("num_warps", 1, 16, True), ("num_stages", 1, 8, False), ("per_sm", 1, 16, True)):
            value = getattr(self, name)
            if not (type(value) is int and lo <= value <= hi and (not power or value & (value - 1) == 0)):
                kind = "a power of two" if power else "an integer"
                raise ValueError(f"tree attention config: {name}={value!r} must be {kind} from {lo} to {hi}")

    def __str__(self) -> str:
        return f"m{self.block_m}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}-p{self.per_sm}"

    @classmethod
    def parse(cls, label: str) -> "TileConfig":
        """From a label such as m64-n128-w8-s2-p4 (m: block_m, n: block_n, w: num_warps, s: num_stages,
        p: per_sm); a part left out keeps its default, so '' is the default."""
        names = {"m": "block_m", "n": "block_n", "w": "num_warps", "s": "num_stages", "p": "per_sm"}
        values = {}
        for part in filter(None, label.strip().split("-")):
            if part[0] not in names or not part[1:].isdigit():
                raise ValueError(f"tree attention config {label!r}: {part!r} is not m<rows>, n<keys>, w<warps>, "
                                 f"s<stages> or p<programs per SM> (e.g. m64-n64-w4-s3-p2)")
            values[names[part[0]]] = int(part[1:])
        return cls(**values)

    def tile_rows(self, rows: int) -> int:
        """BLOCK_M for requests of up to `rows` (query, head) rows."""
        return min(self.block_m, max(16, triton.next_power_of_2(rows)))


def default_config() -> TileConfig:
    """`TileConfig()`, unless SPECINFER_TREE_ATTENTION_CONFIG holds another's label."""
    return _config_named(os.environ.get(CONFIG_VARIABLE, ""))


@functools.lru_cache
def _config_named(label: str) -> TileConfig:  # parsed once per label: every layer's call asks
    try:
        return TileConfig.parse(label)
    except ValueError as e:
        raise ValueError(f"{CONFIG_VARIABLE}={label!r}: {e}") from None


@triton.jit
def _tile_queries(Q, q_starts, tile_row, tile, b, kv_head, stride_qn, stride_qh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  UPCAST: tl.constexpr):
    """A tile's BLOCK_M (query, head-in-group) rows of request b: their query index, head, which
    rows exist, the [BLOCK_M, BLOCK_D] load mask, and the queries themselves."""
    rows = tl.load(tile_row + tile) + tl.arange(0, BLOCK_M)
    qi = tl.load(q_starts + b) + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = qi < tl.load(q_starts + b + 1)
    d = tl.arange(0, BLOCK_D)
    io_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(Q + qi[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return qi, head, row_ok, io_mask, q


@triton.jit
def _attend(q, qi, row_ok, b, kv_head, lo, hi, limit, tree_start,
            K, V, block_tables, tree_bits, n_words, scale_log2,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bt,
            TREE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax of a tile's rows over key slots lo .. hi-1 of request b. A key is visible
    below the row's causal limit (prefix) or where the row's ancestor bit is set (TREE).
    Returns the unnormalized state (acc [BLOCK_M, BLOCK_D], running max m, sum l), log2 domain.

    TREE: lo is the tree's first slot, so a step's keys are tree slots t0 .. t0 + BLOCK_N - 1 with
    t0 a multiple of BLOCK_N: their bits are the same WORDS words of each row, loaded once per row
    rather than once per row and key. (Skipping a step whose keys no row sees, a branch in the
    loop, stopped Triton 3.6 from pipelining the K/V loads and spilled 232 B on sm_90: not done.)"""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    WORDS: tl.constexpr = (BLOCK_N + 31) // 32  # bit words a step's keys span
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        if TREE:
            t = j - tree_start
            first = (j0 - tree_start) >> 5
            column = (t >> 5) - first  # [BLOCK_N]: which of the step's words holds the key's bit
            word = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
            for w in tl.static_range(WORDS):
                at = qi * n_words + first + w
                bits = tl.load(tree_bits + at, mask=row_ok & (at < (qi + 1) * n_words), other=0)
                word = tl.where(column[None, :] == w, bits[:, None], word)
            visible = (((word >> (t[None, :] & 31)) & 1) != 0) & j_ok[None, :]
        else:
            visible = (j[None, :] < limit[:, None]) & j_ok[None, :]
        block = tl.load(block_tables + b * stride_bt + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)  # large pools
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
        s = tl.where(visible, s * scale_log2, float("-inf"))
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
    return acc, m_i, l_i


@triton.jit
def _splits_of(prefix, n_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """A request's plan for its prefix of `prefix` keys, from its real length on the device: how
    many of the launch's `n_splits` key splits it uses (each at least MIN_SPLIT keys long, at least
    one) and their length (whole BLOCK_N tiles). The other splits' programs return at once."""
    used = tl.minimum(n_splits, tl.maximum(1, tl.cdiv(prefix, MIN_SPLIT)))
    return used, tl.cdiv(tl.cdiv(prefix, used), BLOCK_N) * BLOCK_N


@triton.jit
def _merge(acc, m, l, o_s, lse_s):
    """Fold a normalized partial (output o_s, log2-sum-exp lse_s) into the state (acc, m, l): the
    partial counts as weight 2^lse_s at value o_s. Parts that saw no key (lse -inf) weigh nothing."""
    m_new = tl.maximum(m, lse_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    beta = tl.exp2(lse_s - m_safe)
    return acc * alpha[:, None] + o_s * beta[:, None], m_new, l * alpha + beta


# Integers that change from step to step in an eager step (a padded step's are the capacity's) are
# never specialized on, so a new batch never compiles a new variant (tests/test_specialization.py).
@triton.jit(do_not_specialize=["n_splits", "stride_os", "stride_ls", "stride_ln", "stride_bt"])
def _prefix_kernel(
    Q, K, V, O, LSE,
    tile_request, tile_row,
    block_tables, tree_starts, q_starts, causal,
    scale_log2, n_splits,
    stride_qn, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_os, stride_on, stride_oh,
    stride_ls, stride_ln,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    DIRECT: tl.constexpr, MIN_SPLIT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(tile_request + tile)
    prefix = tl.load(tree_starts + tl.maximum(b, 0))
    used, split_len = _splits_of(prefix, n_splits, BLOCK_N, MIN_SPLIT)
    if (b >= 0) & (split < used):
        qi, head, row_ok, io_mask, q = _tile_queries(Q, q_starts, tile_row, tile, b, kv_head, stride_qn, stride_qh,
                                                     GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, UPCAST)
        d = tl.arange(0, BLOCK_D)
        limit = tl.load(causal + qi, mask=row_ok, other=0)
        lo = split * split_len
        hi = tl.minimum(lo + split_len, prefix)
        acc, m_i, l_i = _attend(q, qi, row_ok, b, kv_head, lo, hi, limit, 0,
                                K, V, block_tables, block_tables, 1, scale_log2,
                                stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bt,
                                False, BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, IEEE, UPCAST)
        empty = l_i == 0.0  # this split saw no visible key for the row
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        tl.store(O + split * stride_os + qi[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                 o.to(O.dtype.element_ty), mask=io_mask)
        if not DIRECT:
            lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
            tl.store(LSE + split * stride_ls + qi * stride_ln + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["n_words", "n_splits", "stride_ps", "stride_ls", "stride_bt"])
def _tree_kernel(
    Q, K, V, O, PO, PLSE,
    tile_request, tile_row,
    block_tables, seq_lens, tree_starts, q_starts, tree_bits,
    scale_log2, n_words, n_splits,
    stride_qn, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_on, stride_oh,
    stride_ps, stride_pn, stride_ph,
    stride_ls, stride_ln,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(tile_request + tile)
    if b >= 0:
        qi, head, row_ok, io_mask, q = _tile_queries(Q, q_starts, tile_row, tile, b, kv_head, stride_qn, stride_qh,
                                                     GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, UPCAST)
        d = tl.arange(0, BLOCK_D)
        tree_start = tl.load(tree_starts + b)
        # a request's queries hold its last slots, up to seq_len, and none sees a slot after its own
        # (a node's ancestors come before it): the tile's keys end at its last query's slot
        seq_len, q_end = tl.load(seq_lens + b), tl.load(q_starts + b + 1)
        hi = tl.minimum(seq_len, seq_len - q_end + tl.max(tl.where(row_ok, qi, 0), 0) + 1)
        acc, m_i, l_i = _attend(q, qi, row_ok, b, kv_head, tree_start, hi, qi, tree_start,
                                K, V, block_tables, tree_bits, n_words, scale_log2,
                                stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bt,
                                True, BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, IEEE, UPCAST)
        used, _ = _splits_of(tree_start, n_splits, BLOCK_N, MIN_SPLIT)
        for s in range(0, used):  # the splits this request's prefix used
            o_s = tl.load(PO + s * stride_ps + qi[:, None] * stride_pn + head[:, None] * stride_ph + d[None, :],
                          mask=io_mask, other=0.0)
            lse_s = tl.load(PLSE + s * stride_ls + qi * stride_ln + head, mask=row_ok, other=float("-inf"))
            acc, m_i, l_i = _merge(acc, m_i, l_i, o_s, lse_s)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a padding query sees nothing: zeros
        tl.store(O + qi[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                 o.to(O.dtype.element_ty), mask=io_mask)


# Whether the kernels run in Triton's CPU interpreter: decided when they were decorated (TRITON_INTERPRET=1 then)
INTERPRETED = not isinstance(_prefix_kernel, triton.runtime.JITFunction)


def _tiles(batch: TreeBatch, group: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, first row) of every tile of BLOCK_M (query, head-in-group) rows, computed on the
    device from q_starts, padded with request -1 up to a bound that depends only on shapes;
    cached on the batch, so all layers of a forward share it."""
    def make():
        q_starts = batch.q_starts
        n_req = q_starts.shape[0] - 1
        rows = (q_starts[1:] - q_starts[:-1]) * group
        count = (rows + block_m - 1) // block_m
        end = torch.cumsum(count, 0, dtype=torch.int32)
        bound = math.ceil(batch.causal.shape[0] * group / block_m) + n_req
        t = torch.arange(bound, dtype=torch.int32, device=q_starts.device)
        request = torch.searchsorted(end, t, right=True, out_int32=True)
        inside = request.clamp(max=max(n_req - 1, 0))
        first = (t - (end - count)[inside]) * block_m
        return torch.where(request < n_req, request, -1), first

    return batch.derived(("tiles", group, block_m), make)


@functools.lru_cache
def _sm_count(gpu_driver, device: int) -> int:
    return gpu_driver.utils.get_device_properties(device)["multiprocessor_count"]


def _num_splits(programs: int, max_seq_len: int, min_split: int, per_sm: int) -> int:
    """The most key splits a request's prefix may use: enough to give every SM about `per_sm`
    programs, each split at least `min_split` keys long. Which of them a request uses is planned on the
    device from its real length (`_splits_of`), so a bucket's bound costs idle programs, not work.
    The SMs are those of the GPU Triton compiles for (its active driver's current device)."""
    if INTERPRETED or programs == 0:
        return 1
    sms = _sm_count(driver.active, driver.active.get_current_device())
    return max(1, min(math.ceil(per_sm * sms / programs), math.ceil(max_seq_len / min_split), 64))


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TreeBatch,
                          scale: float | None = None, num_splits: int | None = None, config: TileConfig | None = None,
                          compiled: dict | None = None) -> torch.Tensor:
    """Same contract as `tree_attention_reference`: q [N, Hq, D]; k_cache, v_cache
    [n_blocks, block_size, Hkv, D]. Returns [N, Hq, D] in q's dtype. `num_splits` overrides the
    most splits of a prefix's key range, then at least one tile long each (tests use it to cover
    the merge). `config`: tiles, warps and stages (default: `default_config()`). `compiled`, when
    given, receives each launched kernel's compiled variant by name ("prefix", "tree"): Triton's
    handle, for its registers, spills and shared memory (None under the interpreter)."""
    n_q, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert hq % hkv == 0 and k_cache.shape == v_cache.shape and bs == batch.block_size
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    if n_q == 0:
        return out
    group = hq // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    config = config or default_config()
    block_m, block_n = config.tile_rows(batch.max_queries * group), config.block_n
    tile_request, tile_row = _tiles(batch, group, block_m)
    min_split = block_n if num_splits else 4 * block_n
    splits = num_splits or _num_splits(len(tile_request) * hkv, batch.max_seq_len, min_split, config.per_sm)
    direct = splits == 1 and not batch.has_tree
    o = out[None] if direct else torch.empty(splits, n_q, hq, d, dtype=torch.float32, device=q.device)
    lse = o if direct else torch.empty(splits, n_q, hq, dtype=torch.float32, device=q.device)
    common = dict(GROUP=group, BLOCK_SIZE=bs, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                  BLOCK_M=block_m, BLOCK_N=block_n, MIN_SPLIT=min_split, IEEE=q.dtype == torch.float32,
                  UPCAST=q.dtype == torch.bfloat16 and INTERPRETED)
    kv_strides = (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1),
                  v_cache.stride(0), v_cache.stride(2), v_cache.stride(1))
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    kernels = {"prefix": _prefix_kernel[(len(tile_request), hkv, splits)](
        q, k_cache, v_cache, o, lse, tile_request, tile_row,
        batch.block_tables, batch.tree_starts, batch.q_starts, batch.causal,
        scale * LOG2E, splits,
        q.stride(0), q.stride(1), *kv_strides,
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        batch.block_tables.stride(0), DIRECT=direct, **common, **launch,
    )}
    if not direct:
        kernels["tree"] = _tree_kernel[(len(tile_request), hkv)](
            q, k_cache, v_cache, out, o, lse, tile_request, tile_row,
            batch.block_tables, batch.seq_lens, batch.tree_starts, batch.q_starts, batch.tree_bits,
            scale * LOG2E, batch.tree_bits.shape[1], splits,
            q.stride(0), q.stride(1), *kv_strides,
            out.stride(0), out.stride(1), o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
            batch.block_tables.stride(0), **common, **launch,
        )
    if compiled is not None:
        compiled.update(kernels)
    return out
