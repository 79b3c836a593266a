"""Tree attention over a paged KV cache: the Triton kernel and its PyTorch reference (same contract).

`tree_attention` runs the kernel on CUDA tensors and the reference elsewhere. The environment
variable SPECINFER_TREE_ATTENTION=triton|reference overrides the choice (tests run the kernel on
CPU tensors under TRITON_INTERPRET=1 that way). The Triton module is imported only when the kernel
is launched, so CPU-only use never compiles anything.
"""

from __future__ import annotations

import os

import torch

from .batch import RequestView, TreeBatch
from .reference import tree_attention_reference

__all__ = ["RequestView", "TreeBatch", "tree_attention", "tree_attention_reference", "backend"]

BACKENDS = ("auto", "triton", "reference")


def backend(device: torch.device) -> str:
    """'triton' or 'reference': what `tree_attention` runs for tensors on `device`."""
    choice = os.environ.get("SPECINFER_TREE_ATTENTION", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"SPECINFER_TREE_ATTENTION: {choice!r} is not one of {BACKENDS}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return choice


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TreeBatch,
                   scale: float | None = None) -> torch.Tensor:
    """q [N, Hq, D]; k_cache, v_cache [n_blocks, block_size, Hkv, D]; see batch.py for which keys
    each query sees. Returns [N, Hq, D] in q's dtype."""
    if backend(q.device) == "triton":
        from .tree_attention_triton import tree_attention_triton
        return tree_attention_triton(q, k_cache, v_cache, batch, scale)
    return tree_attention_reference(q, k_cache, v_cache, batch, scale)
