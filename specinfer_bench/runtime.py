"""One step of the runtime, eager and graphed: wall time, the GPU's busy share, launches and host
synchronizations, per model, batch size and tree size.

Each step runs through its model's `StepRunner` (specinfer/graphs.py) twice over, in mode "eager"
(the model's own forward) and in the graphed mode: "graphs" on CUDA (one captured CUDA graph per
bucket of 1, 2, 3, ... 8, 10, 12, ... tokens, replayed), "static" on the CPU, which stands in for it: the same
padded persistent buffers and one host-to-device copy, but no graph, so it shows what padding to a
bucket costs and cannot show the launch overhead a graph saves.

Models: `llm` (the shipped LLM), `llm-1b` (the shipped LLM inflated to Llama-3.2-1B's shape with
`inflate --preset llama-1b`, in a temporary directory) and `ssm` (ssm-0). The step:
- LLM: one `Verifier.step` over `batch` requests, each verifying a fresh random tree of `tree`
  nodes (a fixed shape per row, fresh random tokens every step; tree 0: a plain one-token step),
  greedy or sampled at each of `--temperatures` (sampled: coupled matching, the default rule,
  whose decide then draws the coupled sample of every row).
  Each row starts from fresh requests prefilled with `--prompt-len` random tokens. Random drafts
  are almost never accepted, so a step commits the bonus token and rarely more: the context grows
  by about one token per step (`context_growth` records it), never without bound.
- SSM: one `Speculator.draft` with a fixed expansion, each request told one new token (the
  context grows by exactly that token per draft): tree 0 = <1> (one forward of one row per
  request: a plain one-token step), 16 = <4,1,1,1> (16 nodes; level forwards of 1, 4, 4, 4 rows
  per request), 64 = <4,4,1,1,1> (68 nodes; 1, 4, 16, 16, 16 rows).

Per step and mode:
- step ms: the median wall time of `--repeats` steps, the modes alternating step by step (on CUDA
  each step ends with a synchronize);
- GPU busy (CUDA only, null on the CPU): the device time of every CUDA activity torch.profiler
  records in one step (kernels, copies), over the step's median wall time;
- launches: on CUDA the kernel and graph launches of one step (cudaLaunchKernel, cuLaunchKernel,
  cudaGraphLaunch runtime and driver calls); on the CPU the aten ops one step dispatches
  (`ops.count`), the proxy for launches that holds there;
- syncs: host synchronizations of one step (`ops.count`);
- GPU idle (CUDA only): the ms of a step the GPU sat idle (step less busy), split by what the host
  was doing then: in the verifier's forward (staging, launching), its decide (acceptance, logits
  to the host) or elsewhere ("other"), by the shares a profiled step gives (`idle`); and its
  costliest kernels (name, launches, ms: `top_kernels`, in the JSON), which say what a tree adds.

bfloat16 on CUDA, float32 on the CPU. The CPU run measures the 1B-class model at batch 1 with trees
0 and 16 only (2.5 minutes in all on a quiet 2-core VM, 9 GB of memory at most; the JSON lists
the rest under `skipped`).

    python -m specinfer_bench.runtime --out bench/results/runtime_h100     # on a GPU
    python -m specinfer_bench.runtime --out bench/results/runtime_cpu      # CPU: "static" for "graphs"
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM, fixtures_dir, served_ssms
from specinfer.devices import resolve_device
from specinfer.graphs import GraphConfig, StepRunner
from specinfer.model import LlamaModel, ModelConfig
from specinfer.speculator import Speculator
from specinfer.tree import tree_size
from specinfer.verifier import Verifier, VerifyRequest

from .inflate import PRESETS, inflate
from .ops import count, prefill, speculator_draft, verifier_step
from .report import _plt, command_line, machine, median_ms, write_record

MODELS = ("llm", "llm-1b", "ssm")
SSM_EXPANSIONS = {0: [1], 16: [4, 1, 1, 1], 64: [4, 4, 1, 1, 1]}  # tree size -> the SSM's draft
CPU_ONLY = {"llm-1b": ({1}, {0, 16})}  # model -> (batches, trees) the CPU run measures of it
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
# the phases of a verifier's step whose host time a profiled step tells apart (the rest: "other"), by its methods
PHASES = {"forward": ("forward",), "decide": ("_decision", "_verdicts")}
TOP_KERNELS = 12  # the costliest kinds of device work a row records
CONTEXT_MARGIN = 256  # slots per request beyond prompt and tree: the growth a row's steps may add
CHAINED = 8  # one-token steps in a run of steps begun behind each other


def device_activity(fn, owner) -> tuple[int, float, dict[str, float], list]:
    """(kernel and graph launches, ms the GPU spent on kernels and copies, where it sat idle: `idle`,
    its costliest kernels: `top_kernels`) in one call of fn, with the owner's PHASES timed apart; the
    kernels a replayed graph runs are traced one by one."""
    with phase_ranges(owner), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    events = prof.events()
    return *activity(events), idle(events), top_kernels(events)


@contextmanager
def phase_ranges(owner):
    """The owner's PHASES methods (those it has) inside profiler ranges named phase.PHASE meanwhile."""
    names = [(phase, name) for phase, methods in PHASES.items() for name in methods if hasattr(owner, name)]
    for phase, name in names:
        def ranged(*args, _method=getattr(owner, name), _phase=phase, **kwargs):
            with record_function(f"phase.{_phase}"):
                return _method(*args, **kwargs)
        setattr(owner, name, ranged)  # an instance attribute, over the class's method
    try:
        yield
    finally:
        for _, name in names:
            delattr(owner, name)


def on_device(e) -> bool:
    """A device event (kernel, copy, memset) of a profile, not an annotation spanning kernels counted already."""
    return e.device_type == DeviceType.CUDA and not e.is_user_annotation


def activity(events) -> tuple[int, float]:
    """(launches, ms of GPU work) of a profile's events: the host's launch calls, and the time of the
    device's events (one stream, no overlap)."""
    launches = sum(e.name in LAUNCH_CALLS for e in events)
    return launches, sum(e.time_range.elapsed_us() for e in events if on_device(e)) / 1e3


def top_kernels(events, n: int = TOP_KERNELS) -> list[tuple[str, int, float]]:
    """The device's n costliest kinds of work in the step: (name, count, ms), by total time."""
    total, count = {}, {}
    for e in events:
        if on_device(e):
            total[e.name] = total.get(e.name, 0.0) + e.time_range.elapsed_us()
            count[e.name] = count.get(e.name, 0) + 1
    return [(name, count[name], round(us / 1e3, 4)) for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:n]]


def idle(events) -> dict[str, float]:
    """Of the time the GPU sat idle within the host's span of the step, the share during each phase's
    range (PHASES, as `phase_ranges` names them) and outside them ("other"): what kept it waiting."""
    host = [e.time_range for e in events if e.device_type == DeviceType.CPU]
    shares = dict.fromkeys((*PHASES, "other"), 0.0)
    if not host:
        return shares
    start, end = min(r.start for r in host), max(r.end for r in host)
    gaps, at = [], start
    for s, t in sorted((e.time_range.start, e.time_range.end) for e in events if on_device(e)):
        if s > at:
            gaps.append((at, min(s, end)))
        at = max(at, t)
    gaps.append((at, end))
    phases = [(e.name.removeprefix("phase."), e.time_range) for e in events
              if e.device_type == DeviceType.CPU and e.name.startswith("phase.")]
    for a, b in gaps:
        inside = 0.0
        for name, r in phases:
            overlap = max(0.0, min(b, r.end) - max(a, r.start))
            shares[name] += overlap
            inside += overlap
        shares["other"] += max(0.0, b - a - inside)
    total = sum(shares.values())
    return {k: v / total for k, v in shares.items()} if total else shares


def synchronized(fn):
    """fn, then wait for the GPU to finish what it launched."""
    def run():
        fn()
        torch.cuda.synchronize()
    return run


def measure(steps: dict[str, object], owners: dict[str, object], repeats: int, cuda: bool) -> dict[str, dict]:
    """Per mode: step ms (modes alternating step by step), GPU busy, launches, syncs; on CUDA the ms the
    GPU sat idle in a step, split by what its owner's host was doing then (the profiled step's shares of
    the idle time, applied to the unprofiled step's: the profiler slows the host)."""
    out = {}
    for mode, step in steps.items():
        for _ in range(2):  # warm-up: kernels compiled, buffers touched
            step()
        ops, syncs = count(step)
        launches, busy_ms, shares, top = device_activity(step, owners[mode]) if cuda else (ops, None, None, None)
        out[mode] = {"launches": launches, "syncs": syncs, "busy_ms": busy_ms, "shares": shares, "top_kernels": top}
    times = {mode: [] for mode in steps}
    for _ in range(repeats):
        for mode, step in steps.items():
            times[mode].append(median_ms(step, 1))
    for mode, figures in out.items():
        figures["step_ms"] = statistics.median(times[mode])
        busy_ms, shares = figures.pop("busy_ms"), figures.pop("shares")
        figures["gpu_busy"] = None if busy_ms is None else busy_ms / figures["step_ms"]
        figures["gpu_idle_ms"] = None if shares is None else {
            k: round(v * max(0.0, figures["step_ms"] - busy_ms), 4) for k, v in shares.items()}
    return out


def chained_steps(verifier: Verifier, batch: int, temperature: float, prompt_len: int, rng: random.Random):
    """A function that runs CHAINED one-token steps over `batch` fresh requests (prefilled here with
    random prompts), each begun behind the one before before that one ends (`Verifier.follows`), as a
    verifier serving a manager that sends steps ahead runs them, then waits for the device."""
    params = prefill(verifier, batch, temperature, prompt_len, rng)

    def run():
        steps = lambda: [VerifyRequest(str(i), [], sampling=params[i]) for i in range(batch)]  # noqa: E731
        begun = verifier.begin(steps())
        for _ in range(CHAINED - 1):
            behind = verifier.begin(steps(), begun)
            verifier.end(begun)
            begun = behind
        verifier.end(begun)
        if verifier.model.device.type == "cuda":
            torch.cuda.synchronize()
    return run


def measure_chained(verifier: Verifier, batch: int, temperature: float, prompt_len: int, repeats: int,
                    rng: random.Random, cuda: bool) -> dict:
    """Per step of a run of CHAINED steps begun behind each other (`chained_steps`, the graphed mode):
    ms (median of `repeats` runs) and, on CUDA, the GPU's busy share."""
    run = chained_steps(verifier, batch, temperature, prompt_len, rng)
    run()  # warm-up
    busy_ms = device_activity(run, verifier)[1] if cuda else None
    step_ms = statistics.median(median_ms(run, 1) for _ in range(repeats)) / CHAINED
    return {"step_ms": step_ms, "gpu_busy": None if busy_ms is None else busy_ms / CHAINED / step_ms}


def bucket(runner: StepRunner, tokens: int) -> int | None:
    """Tokens the graphed mode pads a forward of `tokens` tokens to (None: it runs eagerly)."""
    return next((b.capacity.queries for b in runner.buckets if b.capacity.queries >= tokens), None)


def load(name: str, dtype: torch.dtype, device: torch.device, llm, ssm) -> LlamaModel:
    """One of MODELS: `llm`, `ssm`, or the 1B-class LLM inflated from the fixture LLM (whose shape the
    presets fit) into a temporary directory and loaded from there."""
    if name == "llm-1b":
        src = fixtures_dir() / "llm"
        cfg = ModelConfig.from_dir(src)
        hidden, intermediate, layers = PRESETS["llama-1b"]
        with tempfile.TemporaryDirectory() as tmp:
            inflate(src, Path(tmp), hidden, max(1, hidden // (cfg.num_heads * cfg.head_dim)), intermediate, layers)
            return LlamaModel.from_pretrained(tmp, dtype, device)
    return LlamaModel.from_pretrained(ssm if name == "ssm" else llm, dtype, device)


def bench_model(name: str, model: LlamaModel, cases: list[tuple[int, int, float]], modes: list[str], sizes: dict,
                prompt_len: int, repeats: int, bar) -> tuple[list[dict], int]:
    """Rows of one model over its (batch, tree, temperature) cases, and the bytes its captured graphs hold."""
    cuda = model.device.type == "cuda"
    kv_tokens = (sizes["max_batch"] + 1) * sizes["max_context"]
    owners = {m: (Speculator(model, kv_tokens=kv_tokens, graphs=GraphConfig(m, **sizes), progress=True) if name == "ssm"
                  else Verifier(model, kv_tokens, GraphConfig(m, **sizes), progress=True)) for m in modes}
    graphed = owners[modes[1]].run
    rows = []
    for batch, tree, temperature in cases:
        steps, start = {}, {}
        for mode, owner in owners.items():
            rng = random.Random(1000 * batch + tree)  # the same requests and trees in every mode
            step = (speculator_draft(owner, batch, SSM_EXPANSIONS[tree], temperature, prompt_len, rng)
                    if name == "ssm" else verifier_step(owner, batch, tree, temperature, prompt_len, rng))
            steps[mode] = synchronized(step) if cuda else step
            start[mode] = sum(len(c.tokens) for c in owner.caches.values())
        figures = measure(steps, owners, repeats, cuda)
        n_steps = 3 + cuda + repeats  # warm-up, counted, profiled on CUDA, timed
        growth = [sum(len(c.tokens) for c in owner.caches.values()) - start[m] for m, owner in owners.items()]
        longest = max(len(c.tokens) for owner in owners.values() for c in owner.caches.values())
        assert longest + sizes["max_tree"] + 1 <= sizes["max_context"], "the context outgrew the graphs' capacity"
        if name == "ssm":
            expansion = SSM_EXPANSIONS[tree]
            nodes, tokens = tree_size(expansion), [batch * math.prod(expansion[:d]) for d in range(len(expansion))]
        else:
            expansion, nodes, tokens = None, tree, [batch * (1 + tree)]
        if name != "ssm" and not tree:  # steady decoding: each step begun behind the one before
            figures["chained"] = measure_chained(owners[modes[1]], batch, temperature, prompt_len, repeats, rng, cuda)
        rows.append({"model": name, "batch": batch, "tree": tree, "temperature": temperature, "expansion": expansion, "nodes": nodes,
                     "tokens": tokens, "padded_tokens": [bucket(graphed, n) for n in tokens],
                     "context_growth": max(growth) / (batch * n_steps), **figures,
                     "graphed_vs_eager": figures[modes[1]]["step_ms"] / figures["eager"]["step_ms"]})
        bar.update()
    return rows, graphed.graph_bytes


def markdown(result: dict) -> str:
    meta, g = result["meta"], result["meta"]["graphed"]
    busy = lambda x: "-" if x is None else f"{x:.0%}"
    out = [f"# One runtime step, eager vs {g} ({meta['machine']})", "", f"`{meta['command']}`", "",
           f"dtype {meta['dtype']}; prompts of {meta['prompt_len']} random tokens; medians of {meta['repeats']} steps "
           f"per mode, the modes alternating. {meta['note']}", "",
           f"Launches: {meta['launches']}. Syncs: host synchronizations per step. tokens: per forward (the SSM: per "
           "level), padded to: the bucket the graphed mode pads them to. Growth: context tokens added per request "
           "per step.", "",
           "SSM trees are drafts of fixed expansions: " + ", ".join(f"{t}: <{','.join(map(str, e))}>"
                                                                    for t, e in SSM_EXPANSIONS.items()) + ".", "",
           "T: the requests' temperature (0: greedy; sampled: coupled matching).", "",
           "| model | batch | tree | T | nodes | tokens | padded to | eager ms | " + g + " ms | " + g + " / eager | "
           "launches eager / " + g + " | syncs eager / " + g + " | GPU busy eager / " + g + " | growth |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        e, s = r["eager"], r[g]
        out.append(f"| {r['model']} | {r['batch']} | {r['tree']} | {r['temperature']:g} | {r['nodes']} | "
                   f"{','.join(map(str, r['tokens']))} | "
                   f"{','.join(str(p or 'eager') for p in r['padded_tokens'])} | {e['step_ms']:.2f} | "
                   f"{s['step_ms']:.2f} | {r['graphed_vs_eager']:.2f} | {e['launches']} / {s['launches']} | "
                   f"{e['syncs']} / {s['syncs']} | {busy(e['gpu_busy'])} / {busy(s['gpu_busy'])} | "
                   f"{r['context_growth']:.2f} |")
    waits = [r for r in result["rows"] if r[g].get("gpu_idle_ms")]
    if waits:
        out += ["", f"Where the GPU waits, {g}: the ms of a step it sat idle, by what the host was doing then (the "
                "verifier's forward: staging and launching; decide: acceptance, logits to the host; other: the rest "
                "of the step, validation and cache bookkeeping included; shares from a profiled step).", "",
                "| model | batch | tree | T | step ms | idle ms | " + " | ".join(f"{p} ms" for p in (*PHASES, "other")) + " |",
                "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in (*PHASES, "other")) + " |"]
        for r in waits:
            split = r[g]["gpu_idle_ms"]
            out.append(f"| {r['model']} | {r['batch']} | {r['tree']} | {r['temperature']:g} | {r[g]['step_ms']:.2f} | "
                       f"{sum(split.values()):.2f} | "
                       + " | ".join(f"{split[p]:.2f}" for p in (*PHASES, "other")) + " |")
    chained = [r for r in result["rows"] if "chained" in r]
    if chained:
        out += ["", f"Steady decoding, {g}: runs of {CHAINED} one-token steps, each begun behind the one before "
                "before that one's verdicts are read (a verifier with --overlap on, serving a manager that sends steps "
                "ahead), against one step at a time.", "",
                "| model | batch | T | one step ms | begun behind ms a step | ratio | GPU busy one / behind |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in chained:
            c = r["chained"]
            out.append(f"| {r['model']} | {r['batch']} | {r['temperature']:g} | {r[g]['step_ms']:.2f} | {c['step_ms']:.2f} | "
                       f"{c['step_ms'] / r[g]['step_ms']:.2f} | {busy(r[g]['gpu_busy'])} / {busy(c['gpu_busy'])} |")
    out += ["", "Models: " + "; ".join(f"{k}: {v['parameters'] / 1e6:.1f}M parameters, {v['layers']} layers, hidden "
                                      f"{v['hidden']}, graphs hold {v['graph_bytes'] / 2**20:.0f} MiB"
                                      for k, v in meta["models"].items())]
    if result["skipped"]:
        out += ["", "Skipped: " + "; ".join(f"{s['model']} batch {s['batch']} tree {s['tree']} T {s['temperature']:g}"
                                            for s in result["skipped"]) + f" ({result['skipped'][0]['reason']})."]
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = _plt()
    g, rows = result["meta"]["graphed"], result["rows"]
    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        lines = sorted({(r["batch"], r["temperature"]) for r in rows if r["model"] == name})
        for i, (batch, temperature) in enumerate(lines):
            mine = [r for r in rows if r["model"] == name and (r["batch"], r["temperature"]) == (batch, temperature)]
            for mode, style in (("eager", "-"), (g, "--")):
                ax.plot([r["tree"] for r in mine], [r[mode]["step_ms"] for r in mine], style, marker="o",
                        color=f"C{i}", label=f"batch {batch}{f' T={temperature:g}' if temperature else ''} {mode}")
        ax.set(yscale="log", xlabel="tree nodes per request" + (" (SSM: expansion)" if name == "ssm" else ""),
               ylabel="step ms", title=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"one step, eager (solid) vs {g} (dashed): {result['meta']['machine']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specinfer_bench.runtime", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json, OUT.md and OUT.png")
    ap.add_argument("--device", default="auto", help="auto (cuda if there is a GPU), cpu or cuda")
    ap.add_argument("--models", default=",".join(MODELS), help=f"some of {','.join(MODELS)}")
    ap.add_argument("--llm", default=DEFAULT_LLM, help="the model 'llm' names (default: %(default)s)")
    ap.add_argument("--ssm", default=next(iter(served_ssms()), None), help="the model 'ssm' names (default: the served SSM)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--trees", default="0,16,64",
                    help=f"nodes per request's tree ({sorted(SSM_EXPANSIONS)} for the SSM)")
    ap.add_argument("--temperatures", default="0", help="the requests' temperatures, each a row (0: greedy; sampled: "
                    "coupled matching)")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps per mode and row (median reported)")
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    names = args.models.split(",")
    batches, trees = [int(b) for b in args.batches.split(",")], [int(t) for t in args.trees.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if set(names) - set(MODELS):
        ap.error(f"--models: {sorted(set(names) - set(MODELS))} not among {','.join(MODELS)}")
    if "ssm" in names and set(trees) - set(SSM_EXPANSIONS):
        ap.error(f"--trees: the SSM drafts trees of {sorted(SSM_EXPANSIONS)} nodes only")
    cases, skipped = {}, []
    for name in names:
        allowed = CPU_ONLY.get(name) if not cuda else None
        cases[name] = [(b, t, T) for b in batches for t in trees for T in temperatures
                       if not allowed or (b in allowed[0] and t in allowed[1])]
        skipped += [{"model": name, "batch": b, "tree": t, "temperature": T, "reason": "CPU run: the 1B-class model "
                     "at batch 1 with trees 0 and 16 only, so that the run takes about 5 minutes"}
                    for b in batches for t in trees for T in temperatures if (b, t, T) not in cases[name]]
    graphed = "graphs" if cuda else "static"
    max_tree = max([1, *trees, *(tree_size(SSM_EXPANSIONS[t]) for t in trees if "ssm" in names)])
    sizes = {"max_tokens": 2 ** math.ceil(math.log2(max(batches) * (1 + max_tree))), "max_batch": max(batches),
             "max_tree": max_tree, "max_context": args.prompt_len + max_tree + 1 + CONTEXT_MARGIN}
    torch.manual_seed(0)
    rows, models = [], {}
    bar = tqdm(total=sum(map(len, cases.values())), desc="rows", unit="row")
    for name in names:
        if not cases[name]:
            continue
        model = load(name, dtype, device, args.llm, args.ssm)
        found, graph_bytes = bench_model(name, model, cases[name], ["eager", graphed], sizes, args.prompt_len,
                                         args.repeats, bar)
        rows += found
        c = model.cfg
        models[name] = {"parameters": sum(p.numel() for p in model.parameters()), "layers": c.num_layers,
                        "hidden": c.hidden_size, "graph_bytes": graph_bytes}
        del model
    bar.close()
    meta = {"command": command_line("python -m specinfer_bench.runtime", argv), "machine": machine(),
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "graphed": graphed,
            "launches": ("CUDA kernel and graph launches per step (runtime and driver launch calls, torch.profiler)"
                         if cuda else "aten ops per step, the CPU proxy for kernel launches"),
            "note": ("" if cuda else "No GPU: mode \"static\" (padded persistent buffers, no graph) stands in for "
                     "CUDA graphs; it shows what padding to a bucket costs and cannot show launch overhead. GPU busy: "
                     "not measured."),
            "prompt_len": args.prompt_len, "repeats": args.repeats, "graph_config": sizes,
            "ssm_expansions": SSM_EXPANSIONS, "models": models}
    result = {"meta": meta, "rows": rows, "skipped": skipped}
    text = markdown(result)
    write_record(args.out, result, text)
    plot(result, args.out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
