"""Fused elementwise kernels (specinfer_kernels/fused.py, fused_triton.py): each Triton kernel equals its
PyTorch reference over many shapes, and each reference is exactly what transformers' Llama
computes (its RMSNorm, its rotary embedding), so the fused path cannot drift from the model.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest before anything imports Triton); with one, natively on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from specinfer_kernels import (
    add_rms_norm,
    add_rms_norm_reference,
    backend,
    rotary_qkv,
    rotary_qkv_reference,
    rotary_qkv_store,
    silu_mul,
    silu_mul_reference,
)
from specinfer_kernels import RequestView, TreeBatch, fused_triton
from specinfer_kernels.fused_triton import (
    add_rms_norm_triton,
    rotary_qkv_triton,
    silu_mul_triton,
)

from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# max |kernel - reference| / max |reference|. The kernels round once from float32, the references
# after every op in the dtype (add_rms_norm twice, rotate three times), so in half precision they
# differ by at most two ulps of the output's scale (eps is one ulp at 1.0); in float32 only
# summation order and rsqrt differ. Triton's interpreter truncates float32 -> bfloat16 casts where
# GPUs round to nearest even, which costs add_rms_norm up to one more ulp there.
TOLERANCE = {torch.float32: 1e-5,
             torch.float16: 2 * torch.finfo(torch.float16).eps,
             torch.bfloat16: (3 if INTERPRETED else 2) * torch.finfo(torch.bfloat16).eps}
EPS = 1e-5
HEAD_LAYOUTS = [(4, 2, 16), (8, 1, 64), (2, 2, 80)]  # (Hq, Hkv, D)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def rotary_angles(n: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, 1, D] for random positions, built as LlamaModel.prepare builds them."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (n,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE, dtype)[:, None], emb.sin().to(DEVICE, dtype)[:, None]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    err = (actual.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err <= TOLERANCE[expected.dtype], f"{expected.dtype}: error {err:.3g} of the output's scale"


# ---- the kernels equal the references ---------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["no_residual", "residual"])
@pytest.mark.parametrize("hidden", [256, 200])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_add_rms_norm_kernel_equals_reference(n, hidden, with_residual, dtype):
    x = randn(n, hidden, dtype=dtype, seed=n, scale=3.0)
    residual = randn(n, hidden, dtype=dtype, seed=n + 1) if with_residual else None
    weight = 1 + randn(hidden, dtype=dtype, seed=n + 2, scale=0.5)
    normed, summed = add_rms_norm_triton(x, residual, weight, EPS)
    ref_normed, ref_summed = add_rms_norm_reference(x, residual, weight, EPS)
    assert_close(normed, ref_normed)
    assert_close(summed, ref_summed)
    if not with_residual:
        assert summed is x


@pytest.mark.parametrize("dtype", [
    torch.float32, torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        INTERPRETED, reason="Triton's interpreter truncates float32 -> bfloat16 casts (GPUs round to nearest even)")),
], ids=str)
def test_add_rms_norm_kernel_sum_is_exactly_x_plus_residual(dtype):
    x, residual = randn(33, 200, dtype=dtype, seed=0), randn(33, 200, dtype=dtype, seed=1)
    _, summed = add_rms_norm_triton(x, residual, randn(200, dtype=dtype, seed=2), EPS)
    assert torch.equal(summed, x + residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", HEAD_LAYOUTS)
@pytest.mark.parametrize("n", [1, 7, 33])
def test_rotary_qkv_kernel_equals_reference(n, hq, hkv, d, dtype):
    qkv = randn(n, (hq + 2 * hkv) * d, dtype=dtype, seed=n)
    cos, sin = rotary_angles(n, d, dtype, seed=n)
    q, k, v = rotary_qkv_triton(qkv, cos, sin, hq, hkv)
    ref_q, ref_k, ref_v = rotary_qkv_reference(qkv, cos, sin, hq, hkv)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert_close(q, ref_q)
    assert_close(k, ref_k)
    assert torch.equal(v, ref_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", HEAD_LAYOUTS)
def test_rotary_qkv_store_kernel_writes_k_and_v_to_the_write_slots_the_reference_writes(hq, hkv, d, dtype, monkeypatch):
    """The kernel that stores k and v straight into the pool (one launch for rotary and the two index
    copies) leaves the pool as the reference and `TreeBatch.write` leave it, slot for slot, in pages
    scattered over the pool, and every slot it should not write untouched."""
    bs = 4
    views = [RequestView([5, 2], 3, 2, 5, [], 0),  # two committed tokens across a page boundary
             RequestView([0, 7, 3], 9, 0, 9, [-1, 0, 0], 3)]  # a three-node tree in its last page
    batch = TreeBatch.build(views, bs, DEVICE)
    n = sum(v.n_queries for v in views)
    qkv = randn(n, (hq + 2 * hkv) * d, dtype=dtype, seed=hq)
    cos, sin = rotary_angles(n, d, dtype, seed=d)
    pools = {}
    for choice in ("triton", "reference"):
        monkeypatch.setenv("SPECINFER_FUSED", choice)
        k_cache, v_cache = (randn(8, bs, hkv, d, dtype=dtype, seed=s) for s in (1, 2))
        pools[choice] = (rotary_qkv_store(qkv, cos, sin, hq, hkv, k_cache, v_cache, batch.renew()), k_cache, v_cache)
    (q, k, v), (ref_q, ref_k, ref_v) = pools["triton"], pools["reference"]
    written = torch.zeros(8 * bs, dtype=torch.bool)
    written[batch.write_slots().cpu()] = True
    assert int(written.sum()) == n
    assert_close(q, ref_q)
    assert_close(k.view(8 * bs, hkv, d)[written.to(DEVICE)], ref_k.view(8 * bs, hkv, d)[written.to(DEVICE)])
    assert torch.equal(v, ref_v) and torch.equal(k.view(8 * bs, hkv, d)[~written.to(DEVICE)],
                                                 ref_k.view(8 * bs, hkv, d)[~written.to(DEVICE)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [160, 768])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_silu_mul_kernel_equals_reference(n, inter, dtype):
    gate_up = randn(n, 2 * inter, dtype=dtype, seed=n, scale=2.0)
    assert_close(silu_mul_triton(gate_up), silu_mul_reference(gate_up))


def test_kernels_read_rows_through_their_strides():
    """Inputs whose rows are not back to back (views of wider tensors) give the same outputs."""
    n, hidden, (hq, hkv, d), inter = 7, 200, HEAD_LAYOUTS[2], 160
    x = randn(n, 2 * hidden, dtype=torch.float32, seed=0)[:, :hidden]
    residual = randn(n, 3 * hidden, dtype=torch.float32, seed=1)[:, hidden : 2 * hidden]
    weight = randn(hidden, dtype=torch.float32, seed=2)
    for out, ref in zip(add_rms_norm_triton(x, residual, weight, EPS), add_rms_norm_reference(x, residual, weight, EPS)):
        assert_close(out, ref)
    width = (hq + 2 * hkv) * d
    qkv = randn(n, width + 16, dtype=torch.float32, seed=3)[:, :width]
    cos, sin = rotary_angles(n, 2 * d, torch.float32, seed=4)
    cos, sin = cos[..., :d], sin[..., d:]  # row stride 2D; arbitrary angles are fine for equality
    for out, ref in zip(rotary_qkv_triton(qkv, cos, sin, hq, hkv), rotary_qkv_reference(qkv, cos, sin, hq, hkv)):
        assert_close(out, ref)
    gate_up = randn(n, 2 * inter + 8, dtype=torch.float32, seed=5)[:, 4 : 4 + 2 * inter]
    assert_close(silu_mul_triton(gate_up), silu_mul_reference(gate_up))


def test_an_empty_batch_gives_empty_outputs():
    x = torch.empty(0, 64, device=DEVICE)
    normed, summed = add_rms_norm_triton(x, x, torch.ones(64, device=DEVICE), EPS)
    assert normed.shape == summed.shape == (0, 64)
    q, k, v = rotary_qkv_triton(torch.empty(0, 4 * 16, device=DEVICE), *(torch.empty(0, 1, 16, device=DEVICE),) * 2, 2, 1)
    assert q.shape == (0, 2, 16) and k.shape == v.shape == (0, 1, 16)
    assert silu_mul_triton(torch.empty(0, 32, device=DEVICE)).shape == (0, 16)


# ---- the references are what transformers' Llama computes ----------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_reference_is_llamas_rmsnorm_of_the_sum(dtype):
    norm = LlamaRMSNorm(200, EPS)
    norm.weight.data = 1 + 0.5 * torch.randn(200, generator=torch.Generator().manual_seed(0))
    norm = norm.to(DEVICE, dtype).requires_grad_(False)
    x, residual = randn(7, 200, dtype=dtype, seed=1, scale=3.0), randn(7, 200, dtype=dtype, seed=2)
    normed, summed = add_rms_norm_reference(x, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(summed, x + residual) and torch.equal(normed, norm(x + residual))
    normed, summed = add_rms_norm_reference(x, None, norm.weight, norm.variance_epsilon)
    assert summed is x and torch.equal(normed, norm(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", HEAD_LAYOUTS)
def test_rotary_qkv_reference_is_llamas_split_and_rotary_embedding(hq, hkv, d, dtype):
    n = 7
    qkv = randn(n, (hq + 2 * hkv) * d, dtype=dtype, seed=0)
    cos, sin = rotary_angles(n, d, dtype, seed=1)
    heads = qkv.view(n, hq + 2 * hkv, d)
    q, k, v = rotary_qkv_reference(qkv, cos, sin, hq, hkv)
    want_q, want_k = apply_rotary_pos_emb(heads[:, :hq], heads[:, hq: hq + hkv], cos[:, 0], sin[:, 0], unsqueeze_dim=1)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, heads[:, hq + hkv :])


# ---- the tolerances catch real mistakes -------------------------------------------------------

def swapped_halves(qkv, cos, sin, hq, hkv):
    """rotary_qkv with rotate's halves the wrong way round: cat(x1, -x2) instead of cat(-x2, x1)."""
    d = cos.shape[-1]
    x = qkv.view(qkv.shape[0], -1, d)[:, : hq + hkv]
    rotated = torch.cat((x[..., : d // 2], -x[..., d // 2 :]), dim=-1)
    qk = x * cos + rotated * sin
    return qk[:, :hq], qk[:, hq:]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tolerances_reject_plausible_mistakes(dtype):
    x, residual, weight = (randn(7, 200, dtype=dtype, seed=s) for s in range(3))
    with pytest.raises(AssertionError):  # the residual forgotten
        assert_close(add_rms_norm_reference(x, None, weight, EPS)[0], add_rms_norm_reference(x, residual, weight, EPS)[0])
    hq, hkv, d = HEAD_LAYOUTS[0]
    qkv, (cos, sin) = randn(7, (hq + 2 * hkv) * d, dtype=dtype, seed=3), rotary_angles(7, d, dtype, seed=4)
    for wrong, right in zip(swapped_halves(qkv, cos, sin, hq, hkv), rotary_qkv_reference(qkv, cos, sin, hq, hkv)):
        with pytest.raises(AssertionError):
            assert_close(wrong, right)
    gate_up = randn(7, 320, dtype=dtype, seed=5)
    up, gate = gate_up.chunk(2, dim=-1)
    with pytest.raises(AssertionError):  # gate and up the wrong way round
        assert_close(F.silu(gate) * up, silu_mul_reference(gate_up))


# ---- dispatch ---------------------------------------------------------------------------------

def test_SPECINFER_FUSED_chooses_kernel_or_reference(monkeypatch):
    monkeypatch.setattr(fused_triton, "add_rms_norm_triton", lambda *args: "kernel")
    monkeypatch.setattr(fused_triton, "rotary_qkv_triton", lambda *args: "kernel")
    monkeypatch.setattr(fused_triton, "silu_mul_triton", lambda *args: "kernel")
    x, (cos, sin) = torch.randn(3, 64), rotary_angles(3, 16, torch.float32, seed=0)
    calls = (lambda: add_rms_norm(x, x, torch.ones(64), EPS), lambda: rotary_qkv(x, cos.cpu(), sin.cpu(), 2, 1),
             lambda: silu_mul(x))
    monkeypatch.delenv("SPECINFER_FUSED", raising=False)
    assert backend(torch.device("cuda"), "SPECINFER_FUSED") == "triton"
    assert not any(isinstance(call(), str) for call in calls)  # auto: the reference on the CPU
    monkeypatch.setenv("SPECINFER_FUSED", "triton")
    assert all(call() == "kernel" for call in calls)
    monkeypatch.setenv("SPECINFER_FUSED", "reference")
    assert backend(torch.device("cuda"), "SPECINFER_FUSED") == "reference"
    monkeypatch.setenv("SPECINFER_FUSED", "fast")
    with pytest.raises(ValueError, match="SPECINFER_FUSED"):
        silu_mul(x)


def test_the_references_run_without_importing_triton():
    code = ("import sys, torch, specinfer_kernels as k\n"
            "x = torch.randn(3, 64)\n"
            "k.add_rms_norm(x, x, torch.ones(64), 1e-5); k.silu_mul(x)\n"
            "k.rotary_qkv(x, torch.ones(3, 1, 16), torch.zeros(3, 1, 16), 2, 1)\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n")
    env = {key: value for key, value in os.environ.items() if key != "SPECINFER_FUSED"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
