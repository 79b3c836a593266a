"""Products whose every row has the same bits whatever the product's row count, the rows beside it, or its
place in a batch of products: the CUDA side of row-invariant verification (issue 96; `invariant.py`
is the attention, `model.Dense` the projections and the LM head).

cuBLAS chooses its kernel, its tiles and whether to split the sum over K by the shape it is given, so a
row of x W gets other bits at another row count (a tree step against a plain step). This kernel has
one tiling for every shape: BLOCK_M x BLOCK_N tiles of the output, each program summing all of K in
BLOCK_K blocks, in order, into one float32 accumulator. A row's sum is then the same sequence of the
same instructions on the same values wherever the row falls; the row count only changes how many
programs run. The row count is not specialized on (Triton compiles other code for a count of 1 or a
multiple of 16), and the tiling depends on the inputs' dtype alone.

float32 tiles multiply in IEEE float32 (not TF32), half-precision tiles on the tensor cores; on Triton's
CPU interpreter bfloat16 tiles are widened to float32 first, as in `tree_attention_triton.py`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .tree_attention_triton import INTERPRETED

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by dtype: one tiling per dtype, never by shape
TILING = {torch.float32: (64, 64, 32, 4, 3), torch.float16: (64, 64, 64, 4, 3), torch.bfloat16: (64, 64, 64, 4, 3)}


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (+ bias) in a's dtype, accumulated in float32: a [..., M, K], b [K, N] or [..., K, N] with a's
    leading dimensions (any strides: a transposed view reads as it is); bias [N] with a 2-D b."""
    if a.dtype != b.dtype or a.dtype not in TILING:
        raise TypeError(f"invariant_matmul: a is {a.dtype}, b is {b.dtype}; both must be one of {list(TILING)}")
    *lead, M, K = a.shape
    N = b.shape[-1]
    if b.shape[-2] != K or (b.dim() > 2 and tuple(b.shape[:-2]) != tuple(lead)):
        raise ValueError(f"invariant_matmul: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if bias is not None and (b.dim() != 2 or bias.shape != (N,)):
        raise ValueError(f"invariant_matmul: a bias [{N}] goes with a 2-D b, got {tuple(bias.shape)}")
    B = math.prod(lead)
    a3 = a.reshape(B, M, K)
    b3 = b.expand(B, K, N) if b.dim() == 2 else b.reshape(B, K, N)  # a shared b: batch stride 0
    c = torch.empty(B, M, N, dtype=a.dtype, device=a.device)
    if c.numel():
        block_m, block_n, block_k, warps, stages = TILING[a.dtype]
        m_blocks = triton.cdiv(M, block_m)
        _matmul_kernel[(B * m_blocks, triton.cdiv(N, block_n))](
            a3, b3, bias if bias is not None else c, c, M, N, K, m_blocks,
            a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1), b3.stride(2),
            c.stride(0), c.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
            IEEE=a.dtype == torch.float32, UPCAST=a.dtype == torch.bfloat16 and INTERPRETED,
            num_warps=warps, num_stages=stages)
    return c.view(*lead, M, N)


@triton.jit(do_not_specialize=["M", "m_blocks"])
def _matmul_kernel(A, B, BIAS, C, M, N, K, m_blocks,
                   stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cb, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of one product of the batch; all of K summed here, block by block."""
    pid = tl.program_id(0)
    batch = (pid // m_blocks).to(tl.int64)
    rm = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + batch * stride_ab + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptr = B + batch * stride_bb + rk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
        b = tl.load(b_ptr, mask=(rk[:, None] + k < K) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptr += BLOCK_K * stride_ak
        b_ptr += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)
    c_ptr = C + batch * stride_cb + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))
