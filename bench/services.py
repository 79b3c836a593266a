"""Throughput through the services: speculation on vs off at several concurrencies, one run.

Starts the verifier and two speculators (one per shipped SSM) once, then for every configuration
a fresh manager, drives a bounded streaming load, and stops the manager, which logs its per-
iteration split (verifier step, slowest speculator, the rest = the manager's own overhead incl.
RPC). Greedy outputs with speculation are checked identical to those without before any figure.

    python bench/services.py --out bench/results/services_cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from specinfer.cli import default_ssms, models_dir
from specinfer.generate import Request
from specinfer_rpc.client import generate_all
from specinfer_rpc.launch import System
from specinfer_rpc.load import run_load


def manager_stats(log: Path) -> dict:
    lines = [l for l in log.read_text().splitlines() if "scheduler stats " in l]
    return json.loads(lines[-1].split("scheduler stats ", 1)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="runs of every configuration, interleaved; medians reported")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--configs", default="off;2,1,1@64;2,1,1@64@static;1,1,3,1,1,1,1,1@64;1,1,3,1,1,1,1,1@64@static",
                   help="';'-separated: 'off' or EXPANSION@TREE_BUDGET[@static] (the manager's defaults; "
                        "@static: without the adaptive controller)")
    p.add_argument("--out", type=Path, default=Path("bench/results/services_cpu"))
    args = p.parse_args()

    tok = Tokenizer.from_file(str(models_dir() / "llm" / "tokenizer.json"))
    prompts = [tok.encode(json.loads(l)["prompt"]).ids for l in open(models_dir() / "heldout_prompts.jsonl")]
    logs = Path(tempfile.mkdtemp(prefix="specinfer-bench-"))
    system = System(log_dir=logs)
    verifier = system.start("verifier", "verifier_svc", ["--port", "0"], 120)
    specs = [system.start(f"speculator-{i}", "speculator_svc", ["--port", "0", "--ssm", str(d), "--threads", "1"], 120)
             for i, d in enumerate(default_ssms())]
    configs = args.configs.split(";")
    levels = [int(c) for c in args.concurrency.split(",")]
    runs: dict[tuple[str, int], list[dict]] = {}
    reference = None
    try:
        managers = {}
        for config in configs:
            flags = ["--port", "0", "--verifier", verifier.address, "--max-batch", "64"]
            if config != "off":
                expansion, budget, *static = config.split("@")
                flags += ["--speculators", ",".join(s.address for s in specs), "--expansion", expansion,
                          "--tree-budget", budget, "--no-adaptive" if static else "--adaptive"]
            for c in levels:
                managers[config, c] = system.start(f"manager-{len(managers)}", "manager_svc", flags, 120)
            outs = [s.token_ids for s in generate_all(managers[config, levels[0]].address,
                                                      [Request(q, 32) for q in prompts[:8]])]
            reference = reference or outs
            assert outs == reference, f"{config}: greedy outputs differ from {configs[0]}"
        # rounds interleave the configurations, so that the machine's drift hits all of them alike
        bar = tqdm(total=args.rounds * len(managers), unit="run")
        for _ in range(args.rounds):
            for (config, c), manager in managers.items():
                report = asyncio.run(run_load(manager.address, prompts, c, duration=1e9,
                                              max_new_tokens=args.max_new_tokens,
                                              max_requests=c * args.requests_per_stream))
                assert not report.errors, report.errors
                runs.setdefault((config, c), []).append(report.summary())
                bar.update()
        bar.close()
    finally:
        system.stop()  # managers log their per-iteration split on the way out
    rows = []
    for (config, c), reports in sorted(runs.items(), key=lambda kv: (kv[0][1], configs.index(kv[0][0]))):
        stats = manager_stats(logs / f"{managers[config, c].name}.log")
        median = {k: statistics.median(r[k] for r in reports) for k in reports[0] if k not in ("concurrency",)}
        rows.append({"config": config, "concurrency": c, **median,
                     "tokens_per_s_runs": [r["tokens_per_s"] for r in reports],
                     **{f"manager_{k}": v for k, v in stats.items()}})

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    meta = {"machine": f"{cpu}, {torch.get_num_threads()} cores visible to torch, Python {platform.python_version()}",
            "command": "python bench/services.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    off = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["config"] == "off"}
    lines = [f"# Through the services ({meta['machine']})", "", f"`{meta['command']}`", "",
             "config = expansion@tree budget (the manager's defaults; @static: no adaptive controller); greedy; ignore_eos; "
             f"{args.max_new_tokens} new tokens per request; medians of {args.rounds} interleaved runs "
             "(tok/s of each run in the JSON); iteration split from the manager over all its runs", "",
             "| config | concurrency | tok/s | vs off | tok/step | TTFT p50/p99 ms | ITL p50/p99 ms | iteration ms | verifier ms | speculator ms | manager overhead ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']} | {r['tokens_per_s'] / off[r['concurrency']]:.2f}x "
                     f"| {r['tokens_per_step']} | {r['ttft_p50_ms']}/{r['ttft_p99_ms']} | {r['itl_p50_ms']}/{r['itl_p99_ms']} "
                     f"| {r['manager_ms_per_iteration']:.1f} | {r['manager_verify_ms']:.1f} | {r['manager_draft_ms']:.1f} "
                     f"| {r['manager_overhead_ms']:.1f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(rows, configs, levels, args.out.with_suffix(".png"), meta["machine"])
    print("\n".join(lines))


def plot(rows: list[dict], configs: list[str], levels: list[int], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        ax1.plot([r["concurrency"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=config)
        ax2.plot([r["concurrency"] for r in mine], [r["tokens_per_step"] for r in mine], marker="o", label=config)
    for ax, title in ((ax1, "tokens/s (median of interleaved runs)"), (ax2, "tokens per verifier step")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend(title="expansion@tree budget", fontsize=8)
    fig.suptitle(f"Through the services, speculation on vs off ({machine})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
