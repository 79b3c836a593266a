"""Fused elementwise kernels of a Llama decoder layer: the PyTorch references (the Triton kernels
are in fused_triton.py, same contracts).

    add_rms_norm  the residual add and the RMSNorm after it   (x + residual, then input_norm/post_norm)
    rotary_qkv    the fused QKV output split into heads, q and k rotated   (view, rotate, slicing)
    silu_mul      SwiGLU on the fused gate/up output   (chunk, F.silu(gate) * up)

The references compute exactly what transformers' Llama does, dtype handling included (the model
runs them on the CPU; tests/test_fused.py checks them against transformers): like eager PyTorch
they round to the dtype after every op. The kernels load in the dtype, compute in float32 and
round once on store, so in float16 and bfloat16 they differ from the references by an ulp or two
of the output's scale (tests/test_fused.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [N, H] (residual may be None); weight [H]. Returns (normed, summed): summed =
    x + residual (x itself when residual is None), normed = RMSNorm(summed) as Llama
    computes it: in float32, cast back to the dtype, then times the weight in the dtype."""
    summed = x if residual is None else x + residual
    h = summed.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(summed.dtype), summed


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding: x [N, H, D]; cos, sin [N, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_qkv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                         n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, (Hq + 2 Hkv) D]: q heads, then k heads, then v heads; cos, sin [N, 1, D].
    Returns q [N, Hq, D] and k [N, Hkv, D] rotated, v [N, Hkv, D] (views)."""
    n, d = qkv.shape[0], cos.shape[-1]
    heads = qkv.view(n, n_heads + 2 * n_kv_heads, d)
    qk = _rotate(heads[:, : n_heads + n_kv_heads], cos, sin)  # q and k heads rotated at once
    return qk[:, :n_heads], qk[:, n_heads:], heads[:, n_heads + n_kv_heads :]


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2 I]: gate, then up. Returns silu(gate) * up [N, I], as Llama's MLP computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


