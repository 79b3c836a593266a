"""Tree attention over a paged KV cache and the fused elementwise kernels of a decoder layer: each
Triton kernel behind one function with its PyTorch reference (same contract).

`tree_attention` runs the kernel on CUDA tensors and the reference elsewhere. The environment
variable SPECINFER_TREE_ATTENTION=triton|reference overrides the choice (tests run the kernel on
CPU tensors under TRITON_INTERPRET=1 that way). `add_rms_norm`, `rotary_qkv` (and `rotary_qkv_store`) and `silu_mul`
(references in fused.py, kernels in fused_triton.py) choose the same way, overridden by SPECINFER_FUSED. Triton is imported only when a
kernel is launched, so CPU-only use never compiles anything.
"""

from __future__ import annotations

import os

import torch

from .batch import Capacity, Needs, RequestView, Staging, TreeBatch
from .fused import add_rms_norm_reference, rotary_qkv_reference, silu_mul_reference
from .invariant import tree_attention_invariant
from .reference import tree_attention_reference

__all__ = ["Capacity", "Needs", "RequestView", "Staging", "TreeBatch", "add_rms_norm", "add_rms_norm_reference", "backend", "row_invariant", "rotary_qkv",
           "rotary_qkv_reference", "rotary_qkv_store", "silu_mul", "silu_mul_reference", "tree_attention",
           "tree_attention_reference"]

BACKENDS = ("auto", "triton", "reference")
ATTENTION_BACKENDS = (*BACKENDS, "invariant")  # tree attention's: also the row-invariant one (invariant.py)


def backend(device: torch.device, variable: str = "SPECINFER_TREE_ATTENTION") -> str:
    """'triton', 'reference' (or for tree attention 'invariant'): what the functions that `variable`
    governs (SPECINFER_TREE_ATTENTION: `tree_attention`; SPECINFER_FUSED: the fused elementwise kernels)
    run for tensors on `device`."""
    choice = os.environ.get(variable, "auto")
    allowed = ATTENTION_BACKENDS if variable == "SPECINFER_TREE_ATTENTION" else BACKENDS
    if choice not in allowed:
        raise ValueError(f"{variable}: {choice!r} is not one of {allowed}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return choice


def row_invariant() -> bool:
    """Whether SPECINFER_TREE_ATTENTION=invariant: the forward pass keeps a row's bits whatever the
    shape of its step (attention: invariant.py; projections also pad a one-row product: model.Dense)."""
    return os.environ.get("SPECINFER_TREE_ATTENTION") == "invariant"


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TreeBatch,
                   scale: float | None = None) -> torch.Tensor:
    """q [N, Hq, D]; k_cache, v_cache [n_blocks, block_size, Hkv, D]; see batch.py for which keys
    each query sees. Returns [N, Hq, D] in q's dtype."""
    choice = backend(q.device)
    if choice == "triton":
        from .tree_attention_triton import tree_attention_triton
        return tree_attention_triton(q, k_cache, v_cache, batch, scale)
    if choice == "invariant":
        return tree_attention_invariant(q, k_cache, v_cache, batch, scale)
    return tree_attention_reference(q, k_cache, v_cache, batch, scale)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [N, H] (residual may be None); weight [H]. Returns (normed, summed) in x's dtype:
    summed = x + residual (x itself without a residual), normed = RMSNorm(summed) * weight."""
    if backend(x.device, "SPECINFER_FUSED") == "triton":
        from .fused_triton import add_rms_norm_triton
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
               n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, (Hq + 2 Hkv) D] (the fused QKV projection); cos, sin [N, 1, D]. Returns q [N, Hq, D]
    and k [N, Hkv, D] rotated, v [N, Hkv, D]."""
    if backend(qkv.device, "SPECINFER_FUSED") == "triton":
        from .fused_triton import rotary_qkv_triton
        return rotary_qkv_triton(qkv, cos, sin, n_heads, n_kv_heads)
    return rotary_qkv_reference(qkv, cos, sin, n_heads, n_kv_heads)


def rotary_qkv_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TreeBatch) -> torch.Tensor:
    """`rotary_qkv`, with k and v stored into one layer's pool k_cache, v_cache [n_blocks, block_size,
    Hkv, D] at the batch's write slots, as `TreeBatch.write` stores them, rather than returned: on the
    GPU one kernel, not three. Returns q [N, Hq, D]."""
    if backend(qkv.device, "SPECINFER_FUSED") == "triton":
        from .fused_triton import rotary_qkv_triton
        return rotary_qkv_triton(qkv, cos, sin, n_heads, n_kv_heads, k_cache.view(-1, *k_cache.shape[2:]),
                                 v_cache.view(-1, *v_cache.shape[2:]), batch.write_slots())[0]
    q, k, v = rotary_qkv_reference(qkv, cos, sin, n_heads, n_kv_heads)
    batch.write(k_cache, v_cache, k, v)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2 I] (gate, then up). Returns silu(gate) * up [N, I]."""
    if backend(gate_up.device, "SPECINFER_FUSED") == "triton":
        from .fused_triton import silu_mul_triton
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)
