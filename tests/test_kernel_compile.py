"""The CUDA path's Triton kernels compile for Hopper (sm_90) on this machine, without a GPU
(`specinfer_bench.kernel_compile`): what a lent GPU's first minutes would otherwise find out. The compiler
runs in a process of its own, because this one runs the kernels in Triton's interpreter, which compiles
nothing."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTION = {"_prefix_kernel", "_tree_kernel"}


def compile_for_hopper(out, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "specinfer_bench.kernel_compile", "--out", str(out), *args],
                          cwd=ROOT, env={**env, "TRITON_DEFAULT_FP_FUSION": "1"}, capture_output=True, text=True,
                          timeout=600)


def test_every_kernel_of_the_cuda_path_compiles_for_hopper_fits_and_runs_its_dots_on_tensor_cores(tmp_path):
    proc = compile_for_hopper(tmp_path / "sm90", "--arch", "90", "--shapes", "smollm2-135m", "--dtypes", "bf16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "sm90.json").read_text())["rows"]
    assert [r for r in rows if "error" in r] == []
    assert {r["kernel"] for r in rows} == ATTENTION | {"_add_rms_norm_kernel", "_rotary_qkv_kernel", "_silu_mul_kernel",
                                                       "_matmul_kernel"}  # (the row-invariant mode's products)
    assert [r["mma"] for r in rows if r["cell"] == "invariant_projection"] == ["wgmma"]  # a bf16 projection's too
    # the figures are the cubins': registers a thread may hold, shared memory a block may use
    assert all(0 < r["regs"] <= 255 and r["fits"] for r in rows)
    attention = [r for r in rows if r["kernel"] in ATTENTION]
    assert all(r["mma"] in ("wgmma", "mma.sync") for r in attention)  # bf16 dots on tensor cores
    assert any(r["mma"] == "wgmma" for r in attention)  # Hopper's own, where a tile is 64 rows
    assert all(r["loads"].get("16B", 0) > 0 for r in attention)  # K/V come in 16-byte loads
    # decoding a long prefix splits its keys over SMs as on a GPU (the stand-in's SM count), so the tree
    # launch that merges the splits is compiled for one-token steps too
    assert ATTENTION <= {r["kernel"] for r in attention if r["cell"].split("x")[1] == "1"}
    report = (tmp_path / "sm90.md").read_text()
    assert report.count("| smollm2-135m | bf16 |") == len(rows)


def test_it_refuses_to_run_in_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "specinfer_bench.kernel_compile", "--out", str(tmp_path / "x")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "without TRITON_INTERPRET=1" in proc.stderr


PRECOMPILE = """
import json, os, sys
import torch
from specinfer_bench.kernel_compile import Precompiler, attention_call, compiled_by, offline
from specinfer_kernels.tree_attention_triton import TileConfig

cache = sys.argv[1]
heads, cells = dict(hq=9, hkv=3, d=64), [(512, 1, 64), (2048, 16, 8)]
configs = [TileConfig(), TileConfig(num_warps=8)]
files = lambda: sorted(os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs)
with Precompiler(2, arch=90) as compile_ahead:
    ahead = compile_ahead(configs, cells, heads, torch.bfloat16)
cached = files()
with offline(90) as stand_in:  # the launches that follow, in this process
    here = [row for c in configs for cell in cells
            for row in compiled_by(stand_in, attention_call(heads, torch.bfloat16, c, cell))]
print(json.dumps({"ahead": ahead, "here": here, "new_files": sorted(set(files()) - set(cached)), "cached": len(cached)}))
"""


def test_variants_compiled_ahead_in_worker_processes_are_the_ones_the_launches_then_load(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PRECOMPILE, str(tmp_path / "cache")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**env, "TRITON_CACHE_DIR": str(tmp_path / "cache"),
                                                       "TRITON_DEFAULT_FP_FUSION": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["cached"] > 0 and [r for r in result["ahead"] + result["here"] if "error" in r] == []
    assert result["new_files"] == []  # every launch found its variant in the cache: nothing compiled again
    figures = lambda rows: sorted((r["kernel"], r["regs"], r["stack"], r["shared"]) for r in rows)
    assert sorted(set(figures(result["here"]))) == sorted(set(figures(result["ahead"])))  # the same cubins


SPLITS = """
import json
from specinfer_bench.kernel_compile import offline
from specinfer_kernels import tree_attention_triton as tat

with offline(90):  # 132 SMs
    print(json.dumps({p: [tat._num_splits(programs, 16384, 256, p) for programs in (16, 160, 1280)] for p in (1, 2, 4, 8)}))
"""


def test_more_programs_per_sm_split_a_long_prefix_more_ways_within_its_length():
    """`per_sm` (a TileConfig field): decoding requests over a 16k prefix get at least per_sm x 132
    programs of key splits where the prefix is long enough (splits of at least 256 keys, at most 64)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SPLITS], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    splits = {int(p): s for p, s in json.loads(proc.stdout.splitlines()[-1]).items()}
    for p, per_programs in splits.items():
        for programs, n in zip((16, 160, 1280), per_programs):
            assert 1 <= n <= 64 and 16384 / n >= 256
            assert n * programs >= p * 132 or n == 64
    assert splits[1][0] < splits[2][0] < splits[4][0] <= splits[8][0]  # one request: more splits as asked
