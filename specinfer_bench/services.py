"""Throughput through the real services: speculation settings side by side at several concurrencies.

Starts the verifier and one speculator per SSM once, then one manager per (setting, concurrency),
checks greedy outputs, and drives bounded streaming loads in interleaved rounds, every other
round in reverse order. Each round's load takes the prompt file's next prompts (a run at one stream
takes only two, so every round taking the first ones measured two prompts), the same for every
setting (this machine's speed drifts, and a process that slows as it runs would
favour whichever setting runs first; medians are reported and every run's figure kept). Each manager logs its per-
iteration split (verifier step, slowest speculator, the rest = its own overhead incl. RPC) on exit.

    python -m specinfer_bench.services --out bench/results/services_cpu
    python -m specinfer_bench.services --llm /tmp/llm-1b --concurrency 1,4,8,16,32,64 --out bench/results/services_h100_llama-1b

Every service picks its device itself (`--device auto`: the GPU when there is one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM, default_prompts, served_ssms
from specinfer.eagle import head_layers
from specinfer.prompts import read_prompt_file
from specinfer.generate import Request
from specinfer.sampling import SamplingParams
from specinfer_rpc.client import generate_all
from specinfer_rpc.launch import System
from specinfer_rpc.load import run_load

from .report import command_line, machine, plot_services, services_markdown


OPTIONS = {"static", "nolookup", "mss", "baseline", "head", "logprobs"}
LOGPROBS_TOP = 5  # @logprobs: every request asks for its tokens' logprobs with this many alternatives


def manager_flags(config: str, verifier: str, speculators: list[str], heads: list[str] = ()) -> list[str]:
    """'off', or EXPANSION@TREE_BUDGET, each with options @name (@static: without the adaptive
    controller; @nolookup: without the manager's context lookup; @mss: sampled requests ask for
    sampled drafts and MSS, a request option the manager's flags do not see; @baseline: the manager
    runs from the --baseline source tree; @head: the feature speculators `heads` draft too; @logprobs:
    the load's requests ask for logprobs, a request option the manager's flags do not see)."""
    flags = ["--port", "0", "--verifier", verifier, "--max-batch", "64"]
    name, *options = config.split("@")
    if unknown := set(options[1 if name != "off" else 0:]) - OPTIONS:
        raise ValueError(f"--configs {config!r}: unknown option(s) {sorted(unknown)} ({', '.join(sorted(OPTIONS))})")
    if name != "off":
        expansion, budget, *options = config.split("@")
        if "head" in options and not heads:
            raise ValueError(f"--configs {config!r}: @head needs --head")
        speculators = [*speculators, *heads] if "head" in options else speculators
        flags += ["--speculators", ",".join(speculators), "--expansion", expansion, "--tree-budget", budget,
                  "--no-adaptive" if "static" in options else "--adaptive",
                  "--no-context-lookup" if "nolookup" in options else "--context-lookup"]
    return flags


def manager_stats(log: Path) -> dict:
    lines = [l for l in log.read_text().splitlines() if "scheduler stats " in l]
    return json.loads(lines[-1].split("scheduler stats ", 1)[1])


def measure(llm: Path, ssms: list[Path], prompts: list[list[int]], reference: list[list[int]], configs: list[str],
            levels: list[int], requests_per_stream: int, max_new_tokens: int, rounds: int,
            temperature: float = 0.0, baseline: Path | None = None, heads: list[Path] = ()) -> list[dict]:
    """One row per (config, concurrency). `reference`: greedy outputs (32 tokens) of prompts[:len(reference)]
    that every setting must reproduce before it is timed. The load's requests sample at `temperature`
    (0: greedy), seeded. `heads`: feature drafters, each in a speculator of its own, drafting for
    the @head configs (the verifier then keeps their layers' features for every config)."""
    logs = Path(tempfile.mkdtemp(prefix="specinfer-bench-"))
    system = System(log_dir=logs)
    runs: dict[tuple[str, int], list[dict]] = {}
    managers = {}
    try:
        layers = sorted({head_layers(h, llm) for h in heads})
        if len(layers) > 1:
            raise ValueError(f"--head: the heads read different layers of the LLM ({layers})")
        features = [f"--feature-layers={','.join(map(str, layers[0]))}"] if layers else []
        verifier = system.start("verifier", "verifier_svc", ["--port", "0", "--model", str(llm), *features], 120)
        specs = [system.start(f"speculator-{i}", "speculator_svc", ["--port", "0", "--ssm", str(d), "--threads", "1"], 120)
                 for i, d in enumerate(ssms)]
        head_specs = [system.start(f"speculator-head-{i}", "speculator_svc",
                                   ["--port", "0", "--ssm=", "--head", str(h), "--llm", str(llm), "--threads", "1"], 120)
                      for i, h in enumerate(heads)]
        for config in configs:
            flags = manager_flags(config, verifier.address, [s.address for s in specs],
                                  [s.address for s in head_specs]) + ["--tokenizer", str(llm)]
            source = baseline if "baseline" in config.split("@")[1:] else None
            if source is None and "baseline" in config.split("@")[1:]:
                raise ValueError(f"--configs {config!r}: @baseline needs --baseline")
            for c in levels:
                managers[config, c] = system.start(f"manager-{len(managers)}", "manager_svc", flags, 120, source=source)
            outs = generate_all(managers[config, levels[0]].address, [Request(q, 32) for q in prompts[:len(reference)]])
            if [s.token_ids for s in outs] != reference:
                raise SystemExit(f"services {config}: greedy outputs differ from the reference; no figures reported")
        bar = tqdm(total=rounds * len(managers), unit="run", desc="services")
        order = list(managers.items())
        for r in range(rounds):  # interleaved, so that the machine's drift hits all settings alike,
            for (config, c), manager in (order if r % 2 == 0 else order[::-1]):  # in turn first and last
                sampling = SamplingParams(temperature, seed=r, mss="mss" in config.split("@")[1:])
                at = r * c * requests_per_stream % len(prompts)  # this round's prompts: the next ones
                report = asyncio.run(run_load(manager.address, prompts[at:] + prompts[:at], c, duration=1e9,
                                              max_new_tokens=max_new_tokens,
                                              max_requests=c * requests_per_stream, sampling=sampling,
                                              top_logprobs=LOGPROBS_TOP if "logprobs" in config.split("@")[1:] else None))
                if report.errors:
                    raise SystemExit(f"services {config} at {c}: errors {report.errors}")
                runs.setdefault((config, c), []).append(report.summary())
                bar.update()
        bar.close()
    finally:
        system.stop()  # managers log their per-iteration split on the way out
    rows = []
    for (config, c), reports in sorted(runs.items(), key=lambda kv: (kv[0][1], configs.index(kv[0][0]))):
        median = {k: statistics.median(r[k] for r in reports) for k in reports[0] if k != "concurrency"}
        stats = manager_stats(logs / f"{managers[config, c].name}.log")
        rows.append({"config": config, "concurrency": c, **median, "tokens_per_s_runs": [r["tokens_per_s"] for r in reports],
                     **{f"manager_{k}": v for k, v in stats.items()}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="runs of every setting, interleaved; medians reported")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="the load's sampling (0: greedy), seeded")
    p.add_argument("--configs", default="off;2,1,1@64;2,1,1@64@static;1,1,3,1,1,1,1,1@64",
                   help="';'-separated: 'off' or EXPANSION@TREE_BUDGET[@static] (the manager's defaults; "
                        "@static: without the adaptive controller; @head: with the --head speculators; see manager_flags)")
    p.add_argument("--llm", default=DEFAULT_LLM,
                   help="LLM checkpoint (default: %(default)s; e.g. a directory made by specinfer_bench.inflate)")
    p.add_argument("--ssm", type=Path, action="append", default=None, help="SSM checkpoints (default: the served one)")
    p.add_argument("--head", type=Path, action="append", default=[],
                   help="feature drafters (EAGLE-3 heads), each a speculator of its own, drafting for the @head configs")
    p.add_argument("--prompt-file", type=Path, default=default_prompts(), help="JSONL prompts ('prompt' or 'messages')")
    p.add_argument("--baseline", type=Path, default=None,
                   help="another source tree (e.g. a checkout of an earlier commit): configs with @baseline run its manager")
    p.add_argument("--out", type=Path, default=Path("bench/results/services_cpu"))
    args = p.parse_args()
    from .inprocess import load_prompt_ids, reference_greedy

    prompts = load_prompt_ids(args.llm, read_prompt_file(args.prompt_file))

    reference = reference_greedy(args.llm, prompts[:8], 32)
    configs, levels = args.configs.split(";"), [int(c) for c in args.concurrency.split(",")]
    rows = measure(args.llm, args.ssm or served_ssms(), prompts, reference, configs, levels,
                   args.requests_per_stream, args.max_new_tokens, args.rounds, args.temperature, args.baseline,
                   args.head)
    meta = {"machine": machine(), "command": command_line("python -m specinfer_bench.services", None)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    text = services_markdown(rows, meta, args.max_new_tokens, args.rounds, args.temperature)
    args.out.with_suffix(".md").write_text(text)
    plot_services(rows, configs, levels, args.out.with_suffix(".png"), meta["machine"])
    print(text)


if __name__ == "__main__":
    main()
