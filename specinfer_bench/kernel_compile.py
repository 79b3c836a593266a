"""The CUDA path's Triton kernels compiled for a GPU on a machine without one: what a lent GPU's first
minutes would otherwise find out (issues 59 and 62).

Triton compiles for any target it is told to: Python to TTIR, TTGIR, LLVM IR, PTX, then its bundled
`ptxas` to a cubin. Only loading and launching need the GPU. `offline(arch)` makes Triton's active
driver a stand-in for a GPU of that architecture whose launches do nothing, so the kernels' own host
code (`tree_attention_triton`, the fused kernels) runs unchanged on CPU tensors and every launch
compiles its real variant: the same constexprs, specializations and launch options a GPU would get.
From each cubin it reads registers per thread and the stack frame (where spilled registers go,
`cuobjdump -res-usage`), shared memory from Triton's metadata, whether it fits the architecture,
and from the PTX which matrix instructions the dots became (wgmma on Hopper, mma.sync, or FMA loops)
and how wide its global loads are (16-byte loads and cp.async are what reach HBM bandwidth).

It uses whichever Triton is installed: the GPU image's (3.6 on the lent H100) is the one whose
figures predict the GPU's, so run it with that Triton on the path as well as this project's:

    python -m specinfer_bench.kernel_compile --out bench/results/kernel_compile_sm90
    PYTHONPATH=/tmp/triton36:$PWD python -m specinfer_bench.kernel_compile --configs sweep ...

Times are this machine's compile times (the GPU machine's CPU compiles; a kernel that takes
half a minute here costs the tests part that much there). Nothing here runs a kernel: whether a
variant is right and how fast it is stay the GPU's to say (tests/test_kernels.py, kernel_sweep).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import itertools
import json
import sys
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter compiles nothing: the kernels must be real JIT functions
    raise SystemExit("specinfer_bench.kernel_compile compiles for a GPU: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from specinfer_kernels.fused_triton import add_rms_norm_triton, rotary_qkv_triton, silu_mul_triton  # noqa: E402
from specinfer_kernels.invariant import CHUNK  # noqa: E402
from specinfer_kernels.invariant_matmul import invariant_matmul  # noqa: E402
from specinfer_kernels.tree_attention_triton import TileConfig, default_config, tree_attention_triton  # noqa: E402

from .attention_cases import GPU_AXES, attention_case  # noqa: E402
from .report import command_line, machine, write_record  # noqa: E402

# shared memory a block may use (CUDA's sharedMemPerBlockOptin) and SMs, per compute capability
ARCHES = {80: dict(name="A100", max_shared_mem=166912, multiprocessor_count=108),
          90: dict(name="H100/H200", max_shared_mem=232448, multiprocessor_count=132)}


@dataclass(frozen=True)
class Shapes:
    """A model's attention and MLP shapes: what its launches specialize on."""

    name: str
    hq: int
    hkv: int
    d: int
    hidden: int
    intermediate: int


SHAPES = {s.name: s for s in (Shapes("smollm2-135m", 9, 3, 64, 576, 1536),    # the default LLM
                              Shapes("llama-3-8b", 32, 8, 128, 4096, 14336),  # kernel_sweep's and kernel's cells
                              Shapes("llama-2-7b", 32, 32, 128, 4096, 11008))}  # issue 61's 7B class, no GQA
# (prefix, tree, batch): the launch variants serving meets. Decoding at a wide batch takes one key split
# and writes its output directly; one long request decodes over many splits, merged by the tree launch;
# trees of 16 and 64 nodes tile their rows in 16-row and full tiles.
CELLS = [(512, 1, 64), (16384, 1, 1), (2048, 16, 8), (2048, 64, 8)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _cuobjdump() -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def cubin_figures(cubin: bytes) -> dict:
    """From a cubin of one kernel (cuobjdump -res-usage -sass): registers per thread, its stack frame
    (spilled registers live there) and local-memory instructions, what its matrix products run on
    (HGMMA: Hopper's wgmma; HMMA: mma.sync; neither: FMA loops), and its global loads by bytes per
    instruction, cp.async included (static counts: a loop body counts once)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    if not (regs and stack):
        raise RuntimeError(f"cuobjdump said nothing of registers or stack: {text[:300]!r}")
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text, re.M))
    loads: collections.Counter = collections.Counter()
    for op, n in ops.items():
        if op.startswith(("LDG.", "LDGSTS.")):
            size = re.search(r"\.(128|64|U16|S16|U8|S8)\b", op)
            loads[{"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}[size.group(1)] if size else 4] += n
    base = lambda op: op.split(".")[0]
    mma = ("wgmma" if any(base(op) == "HGMMA" for op in ops) else
           "mma.sync" if any(base(op) == "HMMA" for op in ops) else "fma")
    return {"regs": int(regs.group(1)), "stack": int(stack.group(1)),
            "local_ops": sum(n for op, n in ops.items() if base(op) in ("LDL", "STL")), "mma": mma,
            "loads": {f"{k}B": loads[k] for k in sorted(loads, reverse=True)}}


class _Utils:
    def __init__(self, properties: dict, loaded: list[dict]):
        self.properties, self.loaded = properties, loaded
        self.figures: dict[str, dict] = {}  # by compiled kernel: Triton loads one again at every launch here
        self.loading = None  # the hash of the kernel being loaded (the launcher is made just before)

    def get_device_properties(self, device):
        return self.properties

    def load_binary(self, name, kernel, shared, device):
        # (no module handle, so a launch finds the kernel unloaded and loads it again: a variant is recorded once)
        figures = self.figures.get(self.loading)
        if figures is None:
            figures = self.figures[self.loading] = cubin_figures(kernel)
            self.loaded.append({"kernel": name, **figures, "shared": shared,
                                "fits": shared <= self.properties["max_shared_mem"]})
        return None, None, figures["regs"], figures["stack"], 1024  # module, function, registers, spills, threads

    def unload_module(self, module):
        pass


class OfflineDriver:
    """Triton's driver interface for a GPU that is not there: compiling targets `arch`, loading a kernel
    records its cubin's figures in `loaded`, launching does nothing."""

    def __init__(self, arch: int, properties: dict | None = None):
        self.target = GPUTarget("cuda", arch, 32)
        self.loaded: list[dict] = []
        self.utils = _Utils(properties or {**{k: v for k, v in ARCHES[arch].items() if k != "name"},
                                           "max_num_regs": 65536, "warpSize": 32}, self.loaded)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def launcher_cls(self, src, metadata):
        self.utils.loading = metadata.hash  # Triton's cache key of the variant whose binary it loads next
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def offline(arch: int, properties: dict | None = None):
    """Within: Triton compiles for `arch` (a GPU with `properties`, as Triton's driver reports them: SMs,
    shared memory; by default ARCHES'), launches nothing, and the driver yielded collects every kernel
    variant loaded (the first launch of each)."""
    stand_in, previous = OfflineDriver(arch, properties), getattr(driver, "_active", None)  # `driver.active` makes one
    driver.set_active(stand_in)
    try:
        yield stand_in
    finally:
        driver.set_active(previous)


def compiled_by(stand_in: OfflineDriver, call) -> list[dict]:
    """Runs `call` and returns the variants it compiled, each with its share of the call's time; a call
    that fails to compile is one row with Triton's error."""
    before, start = len(stand_in.loaded), time.perf_counter()
    try:
        call()
    except Exception as e:  # a variant that does not compile is this tool's finding, not its crash
        return [{"kernel": "-", "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}]
    rows = stand_in.loaded[before:]
    for row in rows:
        row["compile_s"] = (time.perf_counter() - start) / len(rows)
    return rows


def attention_call(heads: dict, dtype, config: TileConfig, cell: tuple[int, int, int]):
    """Tree attention on `attention_case`'s batch for `cell` (prefix, tree, batch), on CPU tensors whose
    values are never read (a 16k-token batch of 64 is gigabytes: untouched, they take no memory)."""
    q, k, v, tb = attention_case(*cell, dtype, "cpu", fill=torch.empty, **heads)
    return lambda: tree_attention_triton(q, k, v, tb, config=config)


def _compile_cell(arch: int, properties: dict, heads: dict, dtype: str, config: str, cell: tuple) -> list[dict]:
    with offline(arch, properties) as stand_in:  # a worker of `Precompiler`, in a process of its own
        return compiled_by(stand_in, attention_call(heads, getattr(torch, dtype), TileConfig.parse(config), cell))


class Precompiler:
    """Tree attention's variants compiled for this process's GPU in worker processes side by side, into
    Triton's disk cache, where the launches that follow find them: one process compiles one variant at a
    time (2-5 s each at head dim 128), so a sweep of configurations would spend its budget compiling. The
    workers build the same batches on CPU tensors (`attention_case`), with the GPU's target, SM count and
    shared memory, so each compiles the variant the GPU's launch asks for."""

    def __init__(self, workers: int = 8, arch: int | None = None):
        """For this process's GPU, or without one for `arch` (ARCHES' properties)."""
        import concurrent.futures
        import multiprocessing

        if arch is None:
            major, minor = torch.cuda.get_device_capability()
            self.arch = 10 * major + minor
            self.properties = dict(driver.active.utils.get_device_properties(torch.cuda.current_device()))
        else:
            self.arch, self.properties = arch, None
        self.pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))

    def __call__(self, configs: list[TileConfig], cells: list[tuple[int, int, int]], heads: dict, dtype) -> list[dict]:
        """Every (configuration, cell) compiled; returns their variants' rows. A failure is a row too, a lost
        worker's included: compiling ahead only saves time, the launches compile what it missed."""
        name = str(dtype).removeprefix("torch.")
        jobs = []
        for config in configs:
            for cell in cells:
                try:
                    jobs.append(self.pool.submit(_compile_cell, self.arch, self.properties, heads, name, str(config),
                                                 tuple(cell)))
                except Exception as e:  # a pool whose worker died refuses new jobs
                    jobs.append(e)
        rows = []
        for job in jobs:
            try:
                if isinstance(job, Exception):
                    raise job
                rows += job.result()
            except Exception as e:
                rows.append({"kernel": "-", "error": f"not compiled ahead: {type(e).__name__}: {e}"})
        return rows

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.pool.shutdown(cancel_futures=True)


def fused_calls(shapes: Shapes, dtype) -> dict:
    """The fused elementwise kernels of a decoder layer at the model's widths."""
    n, heads = 8, shapes.hq + 2 * shapes.hkv
    x, weight = torch.zeros(n, shapes.hidden, dtype=dtype), torch.zeros(shapes.hidden, dtype=dtype)
    cos = torch.zeros(n, 1, shapes.d, dtype=dtype)
    qkv, gate_up = torch.zeros(n, heads * shapes.d, dtype=dtype), torch.zeros(n, 2 * shapes.intermediate, dtype=dtype)
    pool = torch.zeros(64, shapes.hkv, shapes.d, dtype=dtype)  # a layer's KV pool, its slots flat
    return {"add_rms_norm": lambda: add_rms_norm_triton(x, x, weight, 1e-5),
            "rms_norm": lambda: add_rms_norm_triton(x, None, weight, 1e-5),
            "rotary_qkv": lambda: rotary_qkv_triton(qkv, cos, cos, shapes.hq, shapes.hkv),
            "rotary_qkv_store": lambda: rotary_qkv_triton(qkv, cos, cos, shapes.hq, shapes.hkv, pool, pool,
                                                          torch.zeros(n, dtype=torch.int64)),
            "silu_mul": lambda: silu_mul_triton(gate_up)}


def invariant_calls(shapes: Shapes, dtype) -> dict:
    """The row-invariant mode's products (`invariant_matmul`): a projection at the model's widths in its
    dtype, and the attention's two products of cells (float32 whatever the model's dtype)."""
    x, w = torch.zeros(8, shapes.hidden, dtype=dtype), torch.zeros(shapes.hidden, 2 * shapes.intermediate, dtype=dtype)
    q, k = torch.zeros(4, shapes.hkv, 8, shapes.d), torch.zeros(4, shapes.hkv, CHUNK, shapes.d)
    p, v = torch.zeros(4, shapes.hkv, 8, CHUNK), torch.zeros(4, shapes.hkv, CHUNK, shapes.d + 1)
    return {"invariant_projection": lambda: invariant_matmul(x, w),
            "invariant_scores": lambda: invariant_matmul(q, k.mT),
            "invariant_values": lambda: invariant_matmul(p, v)}


def configs(which: str) -> list[TileConfig]:
    """default: the configuration serving uses; sweep: every combination of kernel_sweep's axes that
    compiles a kernel of its own (an axis of the grid alone, `TileConfig.LAUNCH_ONLY`, keeps its default)."""
    if which == "default":
        return [default_config()]
    axes = {name: values for name, values in GPU_AXES.items() if name not in TileConfig.LAUNCH_ONLY}
    return [TileConfig(**dict(zip(axes, values))) for values in itertools.product(*axes.values())]


def survey(arch: int, shapes: list[Shapes], dtypes: list[str], tile_configs: list[TileConfig],
           progress=lambda done, total: None) -> list[dict]:
    """Every launch variant of the given shapes, dtypes and configurations, compiled for `arch`: one row
    per variant (or per call that failed), labelled with what produced it."""
    jobs = [("attention", s, dt, c, cell) for s in shapes for dt in dtypes for c in tile_configs for cell in CELLS]
    layer = {"fused": fused_calls, "invariant": invariant_calls}
    jobs += [(kind, s, dt, None, name) for kind, calls in layer.items() for s in shapes for dt in dtypes
             for name in calls(s, DTYPES[dt])]
    rows = []
    with offline(arch) as stand_in:
        for i, (kind, s, dt, config, what) in enumerate(jobs):
            call = (attention_call(dict(hq=s.hq, hkv=s.hkv, d=s.d), DTYPES[dt], config, what) if kind == "attention"
                    else layer[kind](s, DTYPES[dt])[what])
            label = {"shapes": s.name, "dtype": dt, "config": str(config) if config else "-",
                     "cell": "x".join(map(str, what)) if kind == "attention" else what}
            rows += [{**label, **row} for row in compiled_by(stand_in, call)]
            progress(i + 1, len(jobs))
    return rows


def replay(arch: int, launches: Path, progress=lambda done, total: None) -> list[dict]:
    """Launches recorded by `specinfer_bench.launch_recorder`, each made again with the stand-in driver
    (a tensor argument as a `MockTensor` of its dtype): the kernels' own specialization decides which of
    them are one variant, so the rows are the variants a GPU's run of those tests compiles."""
    records = list(dict.fromkeys(launches.read_text().splitlines()))  # the same launch twice compiles once
    tensor = lambda v: triton.runtime.jit.MockTensor(getattr(torch, v["dtype"])) if isinstance(v, dict) else v
    rows = []
    with offline(arch) as stand_in:
        for i, line in enumerate(records):
            r = json.loads(line)
            kernel = getattr(importlib.import_module(r["module"]), r["name"])
            args, kwargs = [tensor(a) for a in r["args"]], {k: tensor(v) for k, v in r["kwargs"].items()}
            dtypes = sorted({a["dtype"] for a in r["args"] if isinstance(a, dict) and "float" in a["dtype"]})
            label = {"shapes": "recorded", "dtype": "/".join(dtypes), "cell": f"launch {i + 1}",
                     "config": f"w{kwargs.get('num_warps', 4)}-s{kwargs.get('num_stages', 3)}"}
            rows += [{**label, **row} for row in compiled_by(stand_in, lambda: kernel[(1,)](*args, **kwargs))]
            progress(i + 1, len(records))
    return rows


def findings(rows: list[dict]) -> list[str]:
    """What a reader should know first: what compiling costs, then failures, variants that do not fit, spill,
    or miss the tensor cores."""
    cost: dict[str, list] = {}
    for r in rows:
        if "error" not in r:
            mine = cost.setdefault(r["kernel"], [0, 0.0])
            mine[0], mine[1] = mine[0] + 1, mine[1] + r["compile_s"]
    out = [f"{sum(n for n, _ in cost.values())} variants, {sum(t for _, t in cost.values()):.0f} s of compiling on one "
           "core here: " + ", ".join(f"{k} {n} ({t:.0f} s)" for k, (n, t) in sorted(cost.items()))]
    out += [f"{r['shapes']} {r['dtype']} {r['config']} {r['cell']}: does not compile: {r['error']}"
           for r in rows if "error" in r]
    ok = [r for r in rows if "error" not in r]
    out += [f"{r['shapes']} {r['dtype']} {r['config']} {r['cell']} {r['kernel']}: {r['shared']} B of shared memory, "
            f"more than a block may use" for r in ok if not r["fits"]]
    spills = [r for r in ok if r["stack"] > 0]
    for (kernel, dtype), group in itertools.groupby(sorted(spills, key=lambda r: (r["kernel"], r["dtype"])),
                                                    key=lambda r: (r["kernel"], r["dtype"])):
        group = list(group)
        worst = max(group, key=lambda r: r["stack"])
        out.append(f"{kernel} {dtype}: {len(group)} variant{'s' * (len(group) > 1)} spill{'s' * (len(group) == 1)}; worst {worst['stack']} B of stack, "
                   f"{worst['regs']} registers ({worst['shapes']} {worst['config']} {worst['cell']})")
    fma = sorted({(r["kernel"], r["dtype"]) for r in ok if r["kernel"] in ("_prefix_kernel", "_tree_kernel")
                  and r["mma"] == "fma"})
    out += [f"{kernel} {dtype}: dots run as FMA loops, not on tensor cores" for kernel, dtype in fma]
    return out


def markdown(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    out = [f"# Triton kernels compiled for sm_{meta['arch']} ({meta['gpu']}) without a GPU", "",
           f"Command: `{meta['command']}`", "",
           f"Triton {meta['triton']}, torch {meta['torch']}; compiled on {meta['machine']}; {len(rows)} variants "
           f"in {meta['elapsed_s']:.0f} s. Nothing ran: registers, stack (spills), shared memory and instructions "
           f"come from each variant's cubin (`specinfer_bench/kernel_compile.py`).", "", "## Findings", ""]
    out += [f"- {line}" for line in meta["findings"]]
    if len(meta["findings"]) == 1:
        out.append("- every variant compiles, fits and keeps its registers")
    out += ["", "## Variants", "",
            "| shapes | dtype | config | cell or call | kernel | regs | stack B | shared KiB | fits | dots | global loads "
            "(bytes x count) | compile s |", "|" + " --- |" * 12]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['shapes']} | {r['dtype']} | {r['config']} | {r['cell']} | - | | | | | | {r['error']} | |")
            continue
        loads = " ".join(f"{k}x{v}" for k, v in r["loads"].items())
        out.append(f"| {r['shapes']} | {r['dtype']} | {r['config']} | {r['cell']} | {r['kernel']} | {r['regs']} | "
                   f"{r['stack']} | {r['shared'] / 1024:.1f} | {'yes' if r['fits'] else 'NO'} | {r['mma']} | {loads} | "
                   f"{r['compile_s']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specinfer_bench.kernel_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, choices=sorted(ARCHES), default=90, help="compute capability (default: %(default)s)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="models' shapes, of " + ", ".join(SHAPES))
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="of bf16, fp16, fp32 (default: %(default)s)")
    p.add_argument("--configs", choices=["default", "sweep"], default="default",
                   help="tree attention's configuration, or every one kernel_sweep may try")
    p.add_argument("--launches", type=Path, help="compile these recorded launches instead (specinfer_bench.launch_recorder)")
    p.add_argument("--out", type=Path, default=Path("bench/results/kernel_compile"),
                   help="writes OUT.json and OUT.md (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        shapes = [SHAPES[name] for name in args.shapes.split(",")]
        dtypes = args.dtypes.split(",")
        unknown = [d for d in dtypes if d not in DTYPES]
        if unknown:
            raise KeyError(unknown[0])
    except KeyError as e:
        p.error(f"unknown {e.args[0]!r} in --shapes or --dtypes")
    from tqdm import tqdm

    start = time.perf_counter()
    with tqdm(desc=f"compiling for sm_{args.arch}", unit="call", file=sys.stderr) as bar:
        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)
        rows = (replay(args.arch, args.launches, progress) if args.launches else
                survey(args.arch, shapes, dtypes, configs(args.configs), progress))
    meta = {"command": command_line("python -m specinfer_bench.kernel_compile", argv), "arch": args.arch,
            "gpu": ARCHES[args.arch]["name"], "triton": triton.__version__, "torch": torch.__version__,
            "machine": machine(), "elapsed_s": time.perf_counter() - start, "findings": findings(rows)}
    result = {"meta": meta, "rows": rows}
    write_record(args.out, result, markdown(result))
    print("\n".join(meta["findings"]))
    print(f"wrote {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
