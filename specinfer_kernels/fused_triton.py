"""The fused elementwise kernels in Triton (references and contracts: fused.py).

Each kernel is one launch over rows whose grid and block sizes come from tensor shapes only; it
never synchronizes with the host and allocates nothing besides its outputs, so a CUDA graph can
capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def _add_rms_norm_kernel(X, R, W, OUT, SUM, eps,
                         stride_xn, stride_rn, stride_on, stride_sn,
                         H: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One row per program: SUM = X + R (when HAS_RESIDUAL), OUT = W * RMSNorm(X + R)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK)
    ok = h < H
    x = tl.load(X + n * stride_xn + h, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + n * stride_rn + h, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # rounded as `x + residual`
        tl.store(SUM + n * stride_sn + h, x, mask=ok)
    s = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
    normed = (s * rstd).to(X.dtype.element_ty).to(tl.float32)  # the model casts before the weight
    w = tl.load(W + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + n * stride_on + h, (w * normed).to(OUT.dtype.element_ty), mask=ok)




def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `add_rms_norm_reference`; one program per row."""
    n, hidden = x.shape
    assert weight.shape == (hidden,) and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(0) == 1
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
    normed = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    if n == 0:
        return normed, summed
    r = x if residual is None else residual  # an unread stand-in without a residual
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(n,)](
        x, r, weight, normed, summed, eps,
        x.stride(0), r.stride(0), normed.stride(0), summed.stride(0),
        H=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 512)),
    )
    return normed, summed


@triton.jit
def _rotary_qkv_kernel(QKV, COS, SIN, Q, K, V, ROWS,
                       stride_xn, stride_cn, stride_sn, stride_qn, stride_kn, stride_vn,
                       HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROWS: tl.constexpr):
    """BLOCK_H heads of one token per program: q and k heads rotated, v heads copied; q stored to
    row n of Q, k and v to row ROWS[n] of K and V (HAS_ROWS: a KV pool's slots), else row n."""
    n = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        kv_row = tl.load(ROWS + n)
    else:
        kv_row = n
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # head in the fused row
    d = tl.arange(0, BLOCK_D)[None, :]
    HALF = HEAD_DIM // 2
    d_ok = d < HEAD_DIM
    ok = (h < HQ + 2 * HKV) & d_ok
    row = QKV + n * stride_xn + h * HEAD_DIM
    x = tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
    partner = tl.load(row + (d + HALF) % HEAD_DIM, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(COS + n * stride_cn + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(SIN + n * stride_sn + d, mask=d_ok, other=0.0).to(tl.float32)
    rotated = x * cos + tl.where(d < HALF, -partner, partner) * sin  # rotate(): cat(-x2, x1)
    out = tl.where(h < HQ + HKV, rotated, x).to(Q.dtype.element_ty)
    tl.store(Q + n * stride_qn + h * HEAD_DIM + d, out, mask=ok & (h < HQ))
    tl.store(K + kv_row * stride_kn + (h - HQ) * HEAD_DIM + d, out, mask=ok & (h >= HQ) & (h < HQ + HKV))
    tl.store(V + kv_row * stride_vn + (h - HQ - HKV) * HEAD_DIM + d, out, mask=ok & (h >= HQ + HKV))




def rotary_qkv_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
                      k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                      rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `rotary_qkv_reference`, but q, k and v are new contiguous tensors; or, given
    k, v [M, Hkv, D] (a KV pool's slots) and rows [N] (int64), token n's k and v are stored to row
    rows[n] of those, which are returned."""
    n, d = qkv.shape[0], cos.shape[-1]
    heads = n_heads + 2 * n_kv_heads
    assert qkv.shape == (n, heads * d) and d % 2 == 0 and qkv.stride(1) == 1
    assert cos.shape == sin.shape == (n, 1, d) and cos.stride(2) == sin.stride(2) == 1
    assert cos.dtype == sin.dtype == qkv.dtype
    q = torch.empty((n, n_heads, d), dtype=qkv.dtype, device=qkv.device)
    if rows is None:
        k = torch.empty((n, n_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty((n, n_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
    else:
        assert rows.shape == (n,) and rows.dtype == torch.int64
        for t in (k, v):
            assert t.shape[1:] == (n_kv_heads, d) and t.stride(1) == d and t.stride(2) == 1 and t.dtype == qkv.dtype
    if n == 0:
        return q, k, v
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // block_d))  # tiles of at most 4096 elements
    _rotary_qkv_kernel[(n, -(-heads // block_h))](
        qkv, cos, sin, q, k, v, q if rows is None else rows,  # (an unread stand-in without rows)
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), k.stride(0), v.stride(0),
        HQ=n_heads, HKV=n_kv_heads, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, HAS_ROWS=rows is not None,
        num_warps=4,
    )
    return q, k, v


@triton.jit
def _silu_mul_kernel(GATE_UP, OUT, stride_gn, stride_on, INTER: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK columns of one row per program: OUT = silu(gate) * up in float32."""
    n = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < INTER
    gate = tl.load(GATE_UP + n * stride_gn + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + n * stride_gn + INTER + i, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(OUT + n * stride_on + i, out.to(OUT.dtype.element_ty), mask=ok)




def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as `silu_mul_reference`; the output is a new contiguous tensor."""
    n, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(1) == 1
    inter = two_i // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(n, -(-inter // block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4,
    )
    return out
