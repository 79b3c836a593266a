"""Tree attention's configurations (`TileConfig`: rows and keys of a tile, warps, stages, programs per
SM that key splits aim for) timed against SDPA with the tree mask on the cells that decide its goals,
to choose the default on a GPU (issue 62: >= 1.0x SDPA in every cell, >= 60% of HBM peak where
prefix >= 2048 and batch >= 8).

The search goes one axis at a time from the default: an axis's values are tried with the others at
the best so far, and a better one replaces it (better: more cells >= 1.0x, then a higher geometric
mean of its ratios to SDPA); passes repeat until one changes nothing or the time budget
(`--seconds`) runs out, which stops the sweep cleanly with what it has (a configuration cut short
counts as incomplete). On a GPU the configurations an axis is about to try are first compiled side by side
in worker processes (`kernel_compile.Precompiler`: compiling them one by one would spend the budget
compiling, bench/results/kernel_compile_sm90.md), then timed one by one from Triton's cache. Each variant's output on a cell is checked against the reference before it is
timed: a wrong one is recorded as wrong, not timed; one that does not compile or launch (shared
memory, registers) is recorded with Triton's error. Every compiled variant's registers, spills and
shared memory come from Triton's handle (null under the interpreter, which compiles nothing).

Cells (prefix, tree, batch) in Llama-3-8B attention shapes, as `specinfer_bench.kernel` builds
them: HBM bandwidth (16384, 1, 64), (8192, 16, 8), (2048, 64, 8); latency at batch 1 (512, 1, 1),
(2048, 16, 1); 256-node trees (16384, 256, 8), (512, 256, 64). Without a GPU the same code runs in
Triton's interpreter on two tiny cells and two configurations: it checks the plumbing, its times
say nothing.

    python -m specinfer_bench.kernel_sweep --seconds 150 --out bench/results/kernel_sweep_h100   # on a GPU
    python -m specinfer_bench.kernel_sweep --out /tmp/kernel_sweep_cpu                          # the plumbing
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if __name__ == "__main__" and not torch.cuda.is_available():  # run without a GPU, before anything imports Triton:
    os.environ.setdefault("TRITON_INTERPRET", "1")               # the kernel runs in its interpreter (imported, the
                                                                 # importer's setting stands: kernel_compile's has none)

import triton  # noqa: E402

from specinfer_kernels import tree_attention_reference  # noqa: E402
from specinfer_kernels.tree_attention_triton import TOLERANCE, TileConfig, tree_attention_triton  # noqa: E402

from .attention_cases import GPU_AXES, attention_case, card_peak_gbps, kv_bytes, sdpa_ms, timed_ms  # noqa: E402
from .gpu_summary import per_kernel  # noqa: E402
from .report import command_line, machine, write_record  # noqa: E402

GPU_CELLS = [(16384, 1, 64), (8192, 16, 8), (2048, 64, 8), (512, 1, 1), (2048, 16, 1), (16384, 256, 8), (512, 256, 64)]
CPU_CELLS = [(40, 1, 1), (24, 6, 2)]
GPU_HEADS = dict(hq=32, hkv=8, d=128)  # Llama-3-8B
CPU_HEADS = dict(hq=4, hkv=2, d=32)
CPU_AXES = {"block_n": [32, 64]}


@dataclass
class Cell:
    """One batch of the grid, ready: its inputs, the reference's output and SDPA's time."""

    prefix: int
    tree: int
    batch: int
    inputs: tuple  # q, k_cache, v_cache, TreeBatch
    want: torch.Tensor  # the reference's output
    sdpa_ms: float
    kv_bytes: int

    @property
    def key(self) -> dict:
        return {"prefix": self.prefix, "tree": self.tree, "batch": self.batch}


def prepare(cells: list[tuple[int, int, int]], heads: dict, dtype, device) -> list[Cell]:
    cuda = device.type == "cuda"
    out = []
    for prefix, tree, batch in cells:
        q, k, v, tb = attention_case(prefix, tree, batch, dtype, device, **heads)
        out.append(Cell(prefix, tree, batch, (q, k, v, tb), tree_attention_reference(q, k, v, tb),
                        sdpa_ms(q, k, v, tb, cuda), kv_bytes(k, tb)))
    return out


def resources(handle) -> dict | None:
    """A compiled variant's registers per thread, spilled registers and shared memory in bytes, from
    Triton's handle (None under the interpreter; a figure this Triton does not expose is None)."""
    if handle is None:
        return None
    shared = getattr(getattr(handle, "metadata", None), "shared", getattr(handle, "shared", None))
    return {"n_regs": getattr(handle, "n_regs", None), "n_spills": getattr(handle, "n_spills", None), "shared": shared}


def measure(config: TileConfig, cells: list[Cell], deadline: float, peak: float | None) -> dict:
    """One configuration on the cells in turn, until the deadline: each checked, then timed if right."""
    rows = []
    for cell in cells:
        if time.monotonic() > deadline:
            break
        q, k, v, tb = cell.inputs
        row, compiled = dict(cell.key), {}
        try:
            got = tree_attention_triton(q, k, v, tb, config=config, compiled=compiled)
        except Exception as e:  # a variant that does not compile or launch is a result, not a crash
            rows.append({**row, "status": f"failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"})
            continue
        row["kernels"] = {name: resources(handle) for name, handle in compiled.items()}
        row["max_error"] = (got.float() - cell.want.float()).abs().max().item()
        if not row["max_error"] <= TOLERANCE[q.dtype]:  # NaN is wrong too
            rows.append({**row, "status": "wrong"})
            continue
        ms = timed_ms(lambda: tree_attention_triton(q, k, v, tb, config=config), q.is_cuda, graph=True)
        row.update(status="ok", ms=ms, vs_sdpa=cell.sdpa_ms / ms, gbps=cell.kv_bytes / ms / 1e6)
        if peak:
            row["peak_fraction"] = row["gbps"] / peak
        rows.append(row)
    return tally(config, rows, len(cells))


def tally(config: TileConfig, rows: list[dict], n_cells: int) -> dict:
    """A configuration's record: its cells, how many it wins against SDPA, its worst, best and
    geometric-mean ratio, its least share of HBM peak where prefix >= 2048 and batch >= 8, and the most
    registers, spills and shared memory of its variants per kernel."""
    ratios = [r["vs_sdpa"] for r in rows if r["status"] == "ok"]
    most: dict[str, dict] = {}
    for r in rows:
        for name, figures in (r.get("kernels") or {}).items():
            if figures:
                mine = most.setdefault(name, {})
                for key, value in figures.items():
                    if value is not None:
                        mine[key] = max(mine.get(key, value), value)
    complete, right = len(rows) == n_cells, all(r["status"] == "ok" for r in rows)
    record = {"config": str(config), "complete": complete, "right": right, "eligible": complete and right,
              "wins": sum(x >= 1.0 for x in ratios), "resources": most, "cells": rows}
    if ratios:
        record.update(worst=min(ratios), best=max(ratios), geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)))
    shares = [r["peak_fraction"] for r in rows if "peak_fraction" in r and r["prefix"] >= 2048 and r["batch"] >= 8]
    if shares:  # the goal's cells: the least share of HBM peak among them
        record["hbm_share"] = min(shares)
    return record


def rank(record: dict) -> tuple:
    """Which record is better: eligible (complete, right on every cell) first, then the most cells won, then
    the highest geometric mean."""
    return record["eligible"], record["wins"], record.get("geomean", 0.0)


def search(axes: dict[str, list[int]], cells: list[Cell], deadline: float, peak: float | None,
           ahead=lambda configs: None) -> tuple[list[dict], bool]:
    """Coordinate descent from the default (module docstring). Returns every configuration's record,
    best first, and whether the budget stopped the search. `ahead(configs)` compiles the configurations
    an axis is about to try, side by side (`kernel_compile.Precompiler`), before they are timed one by one."""
    records: dict[str, dict] = {}
    cut = False

    def run(config: TileConfig) -> dict | None:
        nonlocal cut
        if str(config) not in records:
            if time.monotonic() > deadline:
                cut = True
                return None
            records[str(config)] = measure(config, cells, deadline, peak)
        return records[str(config)]

    current = TileConfig()
    ahead([current])
    run(current)
    changed = True
    while changed and not cut:
        changed = False
        for axis, values in axes.items():
            trials = [dataclasses.replace(current, **{axis: v}) for v in values]
            ahead([c for c in trials if str(c) not in records])
            tried = [r for r in map(run, trials) if r and r["eligible"]]
            best = max(tried, key=rank, default=None)
            mine = records.get(str(current))
            if best and (mine is None or rank(best) > rank(mine)):
                changed |= best["config"] != str(current)
                current = TileConfig.parse(best["config"])
    cut |= any(not r["complete"] for r in records.values())
    return sorted(records.values(), key=rank, reverse=True), cut


def _ratio(r: dict | None) -> str:
    return "-" if r is None or r.get("status") != "ok" else f"{r['ms']:.3f} ({r['vs_sdpa']:.2f}x)"


def markdown(result: dict) -> str:
    meta, records = result["meta"], result["configs"]
    out = [f"# Tree attention configurations: {meta['machine']}", "", f"Command: `{meta['command']}`", "",
           f"dtype {meta['dtype']}; heads {meta['heads']}; triton {meta['triton']}; {len(records)} configurations "
           f"in {meta['elapsed_s']:.0f} s ({meta['stopped']}); best: {meta['best'] or 'none'}; default: {meta['default']}.",
           "Each cell's output is checked against the reference (max abs error within the tests' tolerance) before "
           "it is timed; ratio = SDPA with the tree mask / the kernel (> 1: the kernel is faster).", ""]
    if meta["note"]:
        out += [meta["note"], ""]
    out += ["| config | cells >= 1.0x | worst | geomean | best | least HBM share (prefix >= 2048, batch >= 8) "
            "| regs prefix/tree | spills | shared KiB | status |", "|" + " --- |" * 10]
    for r in records:
        bad = sorted({c["status"] for c in r["cells"] if c["status"] != "ok"})
        status = "; ".join(bad) or ("ok" if r["complete"] else f"cut after {len(r['cells'])} cells")
        cells = [r["config"], f"{r['wins']} of {len(r['cells'])}", *(f"{r[k]:.2f}x" if k in r else "-" for k in
                 ("worst", "geomean", "best")), f"{r['hbm_share']:.0%}" if "hbm_share" in r else "-",
                 per_kernel(r["resources"], "n_regs"), per_kernel(r["resources"], "n_spills"),
                 per_kernel(r["resources"], "shared"), status]
        out.append("| " + " | ".join(cells) + " |")
    by_config = {r["config"]: {(c["prefix"], c["tree"], c["batch"]): c for c in r["cells"]} for r in records}
    out += ["", "Per cell, ms (ratio to SDPA):", "", "| prefix | tree | batch | SDPA ms | default | best | fastest here |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for cell in result["cells"]:
        key = (cell["prefix"], cell["tree"], cell["batch"])
        timed = [(rows[key]["ms"], name) for name, rows in by_config.items() if rows.get(key, {}).get("status") == "ok"]
        fastest = min(timed, default=None)
        default, best = (_ratio(by_config.get(meta[name], {}).get(key)) for name in ("default", "best"))
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {cell['sdpa_ms']:.3f} | {default} | {best} | "
                   + (f"{fastest[1]}: {_ratio(by_config[fastest[1]][key])}" if fastest else "-") + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specinfer_bench.kernel_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/kernel_sweep"))
    p.add_argument("--seconds", type=float, default=150.0, help="time budget, set-up included (default: %(default)s)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = p.parse_args(argv)
    start = time.monotonic()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    cells, heads, axes = (GPU_CELLS, GPU_HEADS, GPU_AXES) if cuda else (CPU_CELLS, CPU_HEADS, CPU_AXES)
    peak = card_peak_gbps()
    prepared = prepare(cells, heads, dtype, device)
    with contextlib.ExitStack() as stack:
        ahead = lambda configs: None
        if cuda:  # compiling takes 2-5 s a variant in one process: the GPU machine's cores compile an axis at once
            from .kernel_compile import Precompiler
            compile_ahead = stack.enter_context(Precompiler())
            ahead = lambda configs: compile_ahead(configs, cells, heads, dtype)
        records, cut = search(axes, prepared, start + args.seconds, peak, ahead)
    best = records[0] if records and records[0]["eligible"] else None
    meta = {"machine": machine(), "command": command_line("python -m specinfer_bench.kernel_sweep", argv),
            "dtype": args.dtype, "heads": heads, "triton": triton.__version__, "peak_gbps": peak,
            "seconds": args.seconds, "elapsed_s": time.monotonic() - start,
            "stopped": "stopped by the budget" if cut else "search done", "axes": axes,
            "default": str(TileConfig()), "best": best and best["config"],
            "note": "" if cuda else ("No GPU: the kernel ran in Triton's interpreter on tiny cells; these times and "
                                     "ratios check the plumbing and say nothing about speed.")}
    result = {"meta": meta, "cells": [{**c.key, "sdpa_ms": c.sdpa_ms, "kv_bytes": c.kv_bytes} for c in prepared],
              "configs": records}
    text = markdown(result)
    write_record(args.out, result, text)
    print(text)


if __name__ == "__main__":
    main()
