"""Tables and plots of the benchmark results.

No command of its own: every benchmark writes its tables and plots through it.
"""

from __future__ import annotations

import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from .gpu_summary import split_cells


def median_ms(fn, repeats: int) -> float:
    """Median wall time of `fn` over repeated calls, in ms (the machine is noisy)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def command_line(prog: str, argv: list[str] | None) -> str:
    """The command that ran a benchmark, as recorded beside its results."""
    return f"{prog} {shlex.join(sys.argv[1:] if argv is None else argv)}".rstrip()


def write_record(out: Path, result, text: str | None = None) -> None:
    """A benchmark's record beside `out`: OUT.json (its figures; what JSON cannot hold written as text) and,
    given `text`, OUT.md (its report), their folder made."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if text is not None:
        out.with_suffix(".md").write_text(text)


def machine() -> str:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return f"{cpu}, {torch.get_num_threads()} torch threads{gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def summarize(label: str, temperature: float, figures: dict, extra: dict | None = None) -> dict:
    """A row for one request-at-a-time configuration."""
    secs = figures["request_seconds"]
    total = sum(secs)
    pct = statistics.quantiles(secs, n=100, method="inclusive") if len(secs) > 1 else [secs[0]] * 99
    return {"config": label, "temperature": temperature, "tokens": figures["tokens"], "forwards": figures["forwards"],
            "tokens_per_step": figures["tokens"] / figures["forwards"], "tokens_per_s": figures["tokens"] / total,
            "ms_per_token": 1e3 * total / figures["tokens"], "latency_p50_ms": 1e3 * pct[49],
            "latency_p99_ms": 1e3 * pct[98], "acceptance_by_depth": figures.get("acceptance_by_depth", []),
            **(extra or {})}


def single_markdown(rows: list[dict]) -> list[str]:
    lines = ["| config | T | tokens per LLM forward | tok/s | vs transformers generate | ms/token | "
             "request p50/p99 ms | acceptance by depth |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"]) or "-"
        label = f"{r['config']}: k={r['assistant_tokens']}" if "assistant_tokens" in r else r["config"]
        lines.append(f"| {label} | {r['temperature']:g} | {r['tokens_per_step']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['ms_per_token']:.2f} | {r['latency_p50_ms']:.0f}/{r['latency_p99_ms']:.0f} "
                     f"| {acc} |")
    return lines


def services_markdown(rows: list[dict], meta: dict, max_new_tokens: int, rounds: int, temperature: float = 0.0) -> str:
    off = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["config"] == "off"}
    lines = [f"# Through the services ({meta['machine']})", "", f"`{meta['command']}`", "",
             "config = expansion@tree budget (the manager's defaults; @static: no adaptive controller; "
             "@nolookup: no context lookup; @alone: context lookup alone, no speculators; @head: the --head feature speculators draft too; @logprobs: every request asks for its tokens' logprobs, top 5; @baseline: the manager of the --baseline source tree; @mss: sampled drafts verified by MSS instead of the guess of the coupled sample and top-k drafts matched "
             "against it; @ahead, @sequential: plain steps sent ahead, or not, whatever the verifier's "
             "device; @predraft: drafting during verification, the manager's --draft-ahead 4, where its controller prices it faster); " + (f"T={temperature:g}, seeded; " if temperature else "greedy; ") +
             ("ignore_eos" if meta.get("ignore_eos", True) else "natural stops (each request ends where the LLM ends its reply)")
             + f"; {max_new_tokens} new tokens per request at most; each round the prompt file's next prompts; medians of {rounds} interleaved runs (tok/s of "
             "each run in the JSON); an iteration's split from the manager's metrics over the timed runs: the "
             "verifier's own step, its hop (what the manager waited for the answer beyond that: RPC, queues, threads; "
             "below 0 where plain steps are sent ahead), "
             "the slowest speculator's own drafting, the speculators' hop, and the manager's own work; the verifier's "
             "idle time between two steps of a request (from the end of one to the beginning of the next), by what the "
             "next step was: plain, a tree drafted after the verdict (miss), a pre-drafted tree (hit)", "",
             "| config | concurrency | tok/s | vs off | tok/step | TTFT p50/p99 ms | ITL p50/p99 ms | request p50/p99 ms "
             "| iteration ms | verifier ms | verifier hop ms | speculator ms | speculator hop ms | manager own ms "
             "| verifier idle ms: plain / miss / hit | pre-draft hits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        vs = f"{r['tokens_per_s'] / off[r['concurrency']]:.2f}x" if r["concurrency"] in off else "-"
        idle = r.get("verifier_idle_ms", {})
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {vs} | {r['tokens_per_step']:.2f} "
                     f"| {r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} "
                     f"| {r['latency_p50_ms']:.0f}/{r['latency_p99_ms']:.0f} | {split_cells(r, 'manager')} "
                     f"| {' / '.join(f'{idle[k]:.2f}' if k in idle else '-' for k in ('plain', 'miss', 'hit'))} "
                     f"| {predraft_cell(r, 'manager')} |")
    return "\n".join(lines) + "\n"


def predraft_cell(r: dict, who: str) -> str:
    """The share of request steps whose trees were all drafted ahead, of those drafted ahead for ("-": none)."""
    hits, misses = r.get(f"{who}_predraft_hits", 0), r.get(f"{who}_predraft_misses", 0)
    return f"{hits / (hits + misses):.0%} of {hits + misses:.0f}" if hits + misses else "-"


def in_process_markdown(result: dict) -> str:
    """specinfer_bench.services' result: the greedy check of every setting (its share of the reference's
    tokens), and the same requests in process beside the services (--in-process)."""
    services, in_process, check = result["rows"], result.get("in_process", []), result["greedy_check"]
    shares = lambda rows, where: [f"{where} {r['config']} {r['identical_share']:.1%}"  # noqa: E731
                                  for r in rows if r["concurrency"] == rows[0]["concurrency"]]
    lines = ["", f"Greedy check ({result['dtype']}), each setting's share of the reference's tokens ({check['prompts']} "
             f"prompts x {check['tokens']} tokens): " + ", ".join(shares(services, "services") + shares(in_process, "in process")), ""]
    if in_process:
        by = {(r["config"], r["concurrency"]): r["tokens_per_s"] for r in services}
        lines += ["## The same requests in process (the engine, no RPC, no scheduler; waves of `concurrency` requests)", "",
                  "The same split; in process the drafters run one after another, so their \"hop\" is the time of all "
                  "but the slowest.", "",
                  "| config | concurrency | tok/s | services / in process | tok/step | iteration ms | verifier ms | "
                  "verifier hop ms | speculator ms | speculator hop ms | engine own ms | pre-draft hits |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in in_process:
            vs = by.get((r["config"], r["concurrency"]))
            vs = "-" if vs is None else f"{vs / r['tokens_per_s']:.2f}x"
            lines.append(f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {vs} | {r['tokens_per_step']:.2f} | "
                         f"{split_cells(r, 'engine')} | {predraft_cell(r, 'engine')} |")
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_panel(fig, ax, path: Path, title: str, xlabel: str, ylabel: str, legend_size: int = 8) -> None:
    """A one-panel figure's labels, grid and legend, written to `path`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _throughput_panel(ax, rows: list[dict], configs: list[str], levels: list[int], baselines: dict[str, float]) -> None:
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        ax.plot([r["concurrency"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=f"services {config}")
    for k, (label, value) in enumerate(baselines.items()):
        ax.axhline(value, linestyle="--", color=f"C{len(configs) + k}", linewidth=1, label=f"{label} (one at a time)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_title("tokens/s vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_services(rows: list[dict], configs: list[str], levels: list[int], path: Path, machine_text: str) -> None:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    _throughput_panel(ax1, rows, configs, levels, {})
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        ax2.plot([r["concurrency"] for r in mine], [r["tokens_per_step"] for r in mine], marker="o", label=config)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(levels, [str(c) for c in levels])
    ax2.set_xlabel("concurrent streams")
    ax2.set_title("tokens per verifier step")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"Through the services, speculation settings ({machine_text})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_bench(result: dict, path: Path) -> None:
    """Four panels: tokens/s vs concurrency; tokens per step by mode; acceptance by depth;
    speedup vs tree size."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    greedy = [r for r in result["single"] if r["temperature"] == 0]
    sampled = [r for r in result["single"] if r["temperature"] > 0]
    if result["services"]:
        configs = list(dict.fromkeys(r["config"] for r in result["services"]))
        levels = sorted({r["concurrency"] for r in result["services"]})
        base = {r["config"]: r["tokens_per_s"] for r in greedy if r["config"].startswith("transformers")}
        _throughput_panel(axes[0, 0], result["services"], configs, levels, base)
    ax = axes[0, 1]
    labels = [r["config"] for r in greedy]
    ax.barh(range(len(greedy)), [r["tokens_per_step"] for r in greedy], height=0.4, label="greedy")
    by_label = {r["config"]: r for r in sampled}
    ax.barh([i + 0.4 for i, l in enumerate(labels) if l in by_label],
            [by_label[l]["tokens_per_step"] for l in labels if l in by_label], height=0.4, label="T=0.8")
    ax.set_yticks([i + 0.2 for i in range(len(labels))], labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_title("tokens per LLM forward, by mode")
    ax.legend()
    ax.grid(alpha=0.3, axis="x")
    ax = axes[1, 0]
    for r in greedy:
        if r["acceptance_by_depth"]:
            ax.plot(range(1, len(r["acceptance_by_depth"]) + 1), r["acceptance_by_depth"], marker="o", label=r["config"])
    ax.set_xlabel("tree depth d")
    ax.set_ylabel("share of steps accepting >= d draft tokens")
    ax.set_title("acceptance by depth (greedy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    trees = [r for r in greedy if "tree_nodes" in r]
    ax.scatter([r["tree_nodes"] for r in trees], [r["speedup"] for r in trees])
    for r in trees:
        ax.annotate(r["config"].replace("ours ", ""), (r["tree_nodes"], r["speedup"]), fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("tree nodes verified per step")
    ax.set_ylabel("tok/s vs transformers generate")
    ax.set_title("speedup vs tree size (greedy, one request at a time)")
    ax.grid(alpha=0.3)
    fig.suptitle(f"specinfer bench: {result['prompts']} held-out prompts x {result['max_new_tokens']} tokens "
                 f"({result['machine']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
