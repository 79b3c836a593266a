"""Throughput through the real services: speculation settings side by side at several concurrencies.

Starts the verifier and one speculator per SSM once (none where every setting is 'off' or @alone; on an
LLM other than the default, only the --ssm named), then one manager per (setting, concurrency),
checks greedy outputs, and drives bounded streaming loads in interleaved rounds, every other
round in reverse order. Each round's load takes the prompt file's next prompts (a run at one stream
takes only two, so every round taking the first ones measured two prompts), the same for every
setting (this machine's speed drifts, and a process that slows as it runs would
favour whichever setting runs first; medians are reported and every run's figure kept). Each row's split of
an iteration comes from its manager's /metrics (`specinfer_engine_*`), read before and after each timed run,
so the greedy check is not in it: the verifier's own step and what the manager waited for its answer (the
difference is the hop: RPC, queues, threads; below zero where plain steps are sent ahead, each running
while the manager does other work), the same for the slowest speculator, and the manager's own work. The
per-shape figures and the controller's choices come from its log, over all its runs.

    python -m specinfer_bench.services --out bench/results/services_cpu
    python -m specinfer_bench.services --llm /tmp/llm-1b --concurrency 1,4,8,16,32,64 --out bench/results/services_h100_llama-1b
    python -m specinfer_bench.services --configs 'off;default' --in-process ...   # what the services' hops cost

Every service picks its device itself (`--device auto`: the GPU when there is one), in `--dtype`. The
greedy reference is the LLM's incremental decoding in this process, on that device in that dtype: in
float32 every setting must reproduce it before it is timed; in bfloat16 a speculative step may flip a
near-tie (divergence.py), so each setting's share of identical tokens is recorded instead.
`--in-process` first runs the same requests through the engine in this process (the manager's
speculative engine over a local verifier and drafters: no RPC, no scheduler), in waves of `concurrency`
requests (the engine batches what it is given; at one stream exactly the services' load); its "off"
gives the reference.
"""

from __future__ import annotations

from specinfer_rpc.openmp import bound_spin

bound_spin()  # before torch is imported: --in-process spins no more than the services do (see openmp.py)

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from manager_svc.__main__ import ManagerConfig
from specinfer.checkpoints import DEFAULT_LLM, default_prompts, drafter_dirs, served_ssms
from specinfer.devices import resolve_device, resolve_dtype
from specinfer.engine import SPLIT_PARTS, Stats, default_tree_budget, split
from specinfer.model import LlamaModel
from specinfer.prompts import read_prompt_file
from specinfer.generate import Engine, Mode, Request
from specinfer.sampling import SamplingParams
from specinfer_rpc.client import generate_all
from specinfer_rpc.launch import System, start_backends
from specinfer_rpc.load import run_load

from .divergence import compare
from .inprocess import load_prompt_ids, reference_greedy
from .report import command_line, in_process_markdown, machine, plot_services, services_markdown, write_record


OPTIONS = {"static", "nolookup", "alone", "mss", "baseline", "head", "logprobs", "sequential", "ahead", "predraft",
           "outcome"}
PREDRAFT_OUTCOMES = 4  # @predraft: the manager's --draft-ahead
LOGPROBS_TOP = 5  # @logprobs: every request asks for its tokens' logprobs with this many alternatives
CHECK_PROMPTS, CHECK_TOKENS = 8, 32  # the greedy check before a setting is timed: these prompts, this many tokens
SPLIT = ("ms_per_iteration", "verify_ms", "verify_wait_ms", "draft_ms", "draft_wait_ms", "overhead_ms", "own_ms",
         "grammar_ms", "mean_batch")  # of specinfer.engine.split


def default_config(device: str) -> str:
    """The manager's own setting as a config: its default expansion and tree budget for a verifier on
    `device` (manager_flags then passes the adaptive controller and context lookup, its defaults too)."""
    defaults = ManagerConfig()
    return f"{','.join(map(str, defaults.expansion))}@{default_tree_budget(device, defaults.tree_budget)}"


def manager_flags(config: str, verifier: str, speculators: list[str], heads: list[str] = ()) -> list[str]:
    """'off', or EXPANSION@TREE_BUDGET, each with options @name (@static: without the adaptive
    controller; @nolookup: without the manager's context lookup; @alone: context lookup alone, no
    speculators (what an LLM without a drafter model gets); @mss: sampled requests ask for
    sampled drafts and MSS, a request option the manager's flags do not see; @baseline: the manager
    runs from the --baseline source tree; @head: the feature speculators `heads` draft too; @logprobs:
    the load's requests ask for logprobs, a request option the manager's flags do not see; @sequential and
    @ahead: the manager's --steps-ahead off and on, where its default is auto; @predraft: its --draft-ahead;
    @outcome: with @predraft, its --outcome-steps)."""
    flags = ["--port", "0", "--verifier", verifier, "--max-batch", "64"]
    name, *options = config.split("@")
    if unknown := set(options[1 if name != "off" else 0:]) - OPTIONS:
        raise ValueError(f"--configs {config!r}: unknown option(s) {sorted(unknown)} ({', '.join(sorted(OPTIONS))})")
    if "sequential" in options or "ahead" in options:
        flags += ["--steps-ahead", "off" if "sequential" in options else "on"]
    if "predraft" in options:
        flags += ["--draft-ahead", str(PREDRAFT_OUTCOMES)]
    if "outcome" in options:
        flags += ["--outcome-steps"]
    if name == "off":  # no speculators and no lookup: incremental decoding
        return flags + ["--no-context-lookup"]
    expansion, budget, *options = config.split("@")
    if "head" in options and not heads:
        raise ValueError(f"--configs {config!r}: @head needs --head")
    if "alone" in options and ({"head", "nolookup"} & set(options)):
        raise ValueError(f"--configs {config!r}: @alone is context lookup without speculators")
    speculators = [] if "alone" in options else [*speculators, *heads] if "head" in options else speculators
    if not speculators and "alone" not in options:
        raise ValueError(f"--configs {config!r}: no speculator to draft with (--ssm names an SSM, the default LLM's "
                         "serves unless told otherwise; @head drafts with --head; @alone with context lookup alone)")
    return flags + ["--speculators", ",".join(speculators), "--expansion", expansion, "--tree-budget", budget,
                    "--no-adaptive" if "static" in options else "--adaptive",
                    "--no-context-lookup" if "nolookup" in options else "--context-lookup"]


def check_configs(configs: list[str], ssms: int, heads: int) -> None:
    """Refuse a config that the speculators given cannot run (manager_flags' checks), before any service starts."""
    for config in configs:
        manager_flags(config, "", [""] * ssms, [""] * heads)


def uses_ssms(config: str) -> bool:
    """Whether a config's manager drafts with the SSMs' speculators (not 'off', not @alone)."""
    name, *options = config.split("@")
    return name != "off" and "alone" not in options


def ssms_used(configs: list[str], ssms: list) -> list:
    """The SSMs to start (or load) for these configs: none where every one is 'off' or @alone."""
    return ssms if any(uses_ssms(c) for c in configs) else []


def engine_settings(config: str, ssms: list, device: str) -> dict:
    """Engine keyword arguments for a config in process: 'off', or EXPANSION@TREE_BUDGET with @static,
    @nolookup, @alone, @predraft or @outcome (the others name what only the services do); several SSMs merge their trees,
    as the manager does, and @alone drafts with none of them; a budget of 0 is the manager's default for a
    verifier on `device`."""
    name, *options = config.split("@")
    budget = None if name == "off" else options.pop(0)
    if unknown := set(options) - {"static", "nolookup", "alone", "predraft", "outcome"}:
        raise ValueError(f"--in-process: {config!r}: option(s) {sorted(unknown)} run only through the services")
    if name == "off":
        return {"ssms": [], "mode": Mode.INCREMENTAL}
    ssms = [] if "alone" in options else ssms
    return {"ssms": ssms, "mode": Mode.MERGED if len(ssms) > 1 else Mode.TREE,
            "expansion": [int(k) for k in name.split(",")],
            "tree_budget": default_tree_budget(device, int(budget)), "adaptive": "static" not in options,
            "lookup": "nolookup" not in options, "draft_ahead": PREDRAFT_OUTCOMES if "predraft" in options else 0,
            "outcome_steps": "outcome" in options}


def identical_share(what: str, outputs: list[list[int]], reference: list[list[int]], exact: bool) -> float:
    """The mean share of positions where each output holds its reference's token (divergence.compare);
    where the dtype is `exact` (float32) anything but all of them stops the run."""
    if outputs == reference:
        return 1.0
    if exact:
        raise SystemExit(f"{what}: greedy outputs differ from the reference; no figures reported")
    return statistics.mean(compare(want, got)[0] for want, got in zip(reference, outputs))


def release(device: torch.device) -> None:
    """Give back what dropped models and engines held on the device (before the services load theirs)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def in_process(llm: LlamaModel, ssms: list[LlamaModel], prompts: list[list[int]], configs: list[str], levels: list[int],
               requests_per_stream: int, max_new_tokens: int, temperature: float,
               exact: bool, ignore_eos: bool = True) -> tuple[list[list[int]], list[dict]]:
    """The services' first round in this process (see the module): per config one engine, checked greedy
    against the reference first, then per concurrency c, `requests_per_stream` waves of c requests taking
    the prompts in the load's order, sampled as its first round's. Returns the reference ('off's greedy
    outputs) and one row per (config, concurrency) with the engine's per-iteration split (engine_*:
    verifier step, slowest drafter, the rest). A config with @sequential or @ahead is its config without them here
    (the engine in process never sends a step ahead), so it is not run again."""
    if "off" not in configs:
        raise ValueError("--in-process: its 'off' is the reference; give 'off' in --configs")
    reference, rows = [], []
    for config in sorted((c for c in configs if not {"sequential", "ahead"} & set(c.split("@")[1:])),
                         key=lambda c: c != "off"):
        engine = Engine(llm, **engine_settings(config, ssms, llm.device.type))
        outs = [g.token_ids for g in engine.generate([Request(q, CHECK_TOKENS) for q in prompts[:CHECK_PROMPTS]])]
        reference = reference or outs
        share = identical_share(f"in process {config}", outs, reference, exact)
        for c in levels:
            engine.engine.stats = Stats()  # this concurrency's iterations only
            tokens = steps = 0
            start = time.perf_counter()
            for wave in range(requests_per_stream):
                done = engine.generate([Request(prompts[(wave * c + i) % len(prompts)], max_new_tokens,
                                                SamplingParams(temperature, seed=0), ignore_eos=ignore_eos)
                                        for i in range(c)])
                tokens += sum(len(g.token_ids) for g in done)
                steps += sum(g.steps for g in done)
            seconds = time.perf_counter() - start
            parts = split(engine.engine.stats.counters())
            rows.append({"config": config, "concurrency": c, "seconds": round(seconds, 2), "tokens": tokens,
                         "tokens_per_s": round(tokens / seconds, 1), "tokens_per_step": round(tokens / steps, 3),
                         "identical_share": share, **{f"engine_{k}": parts[k] for k in SPLIT},
                         "engine_predraft_hits": engine.engine.stats.predraft_hits,
                         "engine_predraft_misses": engine.engine.stats.predraft_misses})
        del engine
        release(llm.device)
    return reference, rows


IDLE_KINDS = ("plain", "miss", "hit")  # specinfer_verifier_idle_seconds' labels: what a request's next step was


def verifier_counters(metrics: str) -> dict[str, float]:
    """From the verifier's /metrics URL: its count of steps begun behind a running one (--overlap), and its
    idle time between two steps of a request, seconds and steps, by what the next step was."""
    text = urllib.request.urlopen(metrics, timeout=10).read().decode()
    out = dict.fromkeys(["begun_behind", *(f"idle_{k}_{x}" for k in IDLE_KINDS for x in ("s", "n"))], 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "specinfer_verifier_steps_begun_behind_total":
                out["begun_behind"] += s.value
            elif s.name in ("specinfer_verifier_idle_seconds_sum", "specinfer_verifier_idle_seconds_count"):
                out[f"idle_{s.labels['next']}_{'s' if s.name.endswith('sum') else 'n'}"] += s.value
    return out


def idle_ms(counters: dict[str, float]) -> dict[str, float]:
    """The verifier's mean idle ms between two steps of a request, by what the next step was (where any was)."""
    return {k: round(1e3 * counters[f"idle_{k}_s"] / counters[f"idle_{k}_n"], 3)
            for k in IDLE_KINDS if counters[f"idle_{k}_n"]}


def engine_counters(metrics: str) -> dict[str, float]:
    """A manager's engine counters from its /metrics URL."""
    return counters_from_text(urllib.request.urlopen(metrics, timeout=10).read().decode())


def counters_from_text(text: str) -> dict[str, float]:
    """`Stats.counters` as manager_svc.metrics.EngineSplit exports them, read back from /metrics text
    (zeros where none are exported yet)."""
    names = {"specinfer_engine_iterations_total": "iterations", "specinfer_engine_batched_requests_total": "batched",
             "specinfer_predraft_hits_total": "predraft_hits", "specinfer_predraft_misses_total": "predraft_misses"}
    out = dict.fromkeys((*names.values(), *SPLIT_PARTS), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                out[names[s.name]] = s.value
            elif s.name == "specinfer_engine_seconds_total":
                out[s.labels["part"]] = s.value
    return out


def manager_stats(log: Path) -> dict:
    """A manager's last scheduler stats from its log, with its adaptive controller's (`controller`: per batch
    size, the choices made and every option's predicted rate) where it logged them."""
    lines = log.read_text().splitlines()
    last = lambda tag: next((json.loads(l.split(tag, 1)[1]) for l in reversed(lines) if tag in l), None)  # noqa: E731
    stats = last("scheduler stats ")
    if (controller := last("controller stats ")) is not None:
        stats["controller"] = controller
    return stats


def measure(llm: Path, ssms: list[Path], prompts: list[list[int]], reference: list[list[int]], configs: list[str],
            levels: list[int], requests_per_stream: int, max_new_tokens: int, rounds: int,
            temperature: float = 0.0, baseline: Path | None = None, heads: list[Path] = (), dtype: str = "auto",
            exact: bool = True, log_dir: Path | None = None, ignore_eos: bool = True) -> list[dict]:
    """One row per (config, concurrency). `reference`: greedy outputs (CHECK_TOKENS tokens) of
    prompts[:len(reference)] that every setting must reproduce before it is timed, where `exact`; otherwise
    each row has the setting's share of identical tokens. The load's requests sample at `temperature`
    (0: greedy), seeded. `heads`: feature drafters, each in a speculator of its own, drafting for
    the @head configs (the verifier then keeps their layers' features for every config). The services run
    their models in `dtype` and log to `log_dir` (default: a temporary directory). ignore_eos False: the load's
    requests stop where the LLM ends its reply (natural stops), not at max_new_tokens."""
    check_configs(configs, len(ssms), len(heads))
    ssms = ssms_used(configs, ssms)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="specinfer-bench-"))
    system = System(log_dir=logs)
    runs: dict[tuple[str, int], list[dict]] = {}
    timed: dict[tuple[str, int], dict[str, float]] = {}  # each manager's engine counters over its timed runs
    idle: dict[tuple[str, int], dict[str, float]] = {}  # the verifier's idle counters over each one's timed runs
    managers, shares = {}, {}
    try:
        start = time.perf_counter()
        verifier, specs = start_backends(system, llm, ssms, len(ssms), heads,
                                         ["--port", "0", "--dtype", dtype, "--metrics-port", "0"])
        head_specs = specs[len(ssms):]
        specs = specs[:len(ssms)]
        print(f"services: the verifier and {len(specs) + len(head_specs)} speculators serving after "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        for config in configs:
            flags = manager_flags(config, verifier.address, [s.address for s in specs],
                                  [s.address for s in head_specs]) + ["--tokenizer", str(llm), "--metrics-port", "0"]
            source = baseline if "baseline" in config.split("@")[1:] else None
            if source is None and "baseline" in config.split("@")[1:]:
                raise ValueError(f"--configs {config!r}: @baseline needs --baseline")
            for c in levels:
                managers[config, c] = system.start(f"manager-{len(managers)}", "manager_svc", flags, 120, source=source)
            outs = generate_all(managers[config, levels[0]].address,
                                [Request(q, CHECK_TOKENS) for q in prompts[:len(reference)]])
            shares[config] = identical_share(f"services {config}", [s.token_ids for s in outs], reference, exact)
        bar = tqdm(total=rounds * len(managers), unit="run", desc="services")
        order = list(managers.items())
        for r in range(rounds):  # interleaved, so that the machine's drift hits all settings alike,
            for (config, c), manager in (order if r % 2 == 0 else order[::-1]):  # in turn first and last
                sampling = SamplingParams(temperature, seed=r, mss="mss" in config.split("@")[1:])
                at = r * c * requests_per_stream % len(prompts)  # this round's prompts: the next ones
                seen, before = verifier_counters(verifier.metrics), engine_counters(manager.metrics)
                report = asyncio.run(run_load(manager.address, prompts[at:] + prompts[:at], c, duration=1e9,
                                              max_new_tokens=max_new_tokens,
                                              max_requests=c * requests_per_stream, sampling=sampling,
                                              top_logprobs=LOGPROBS_TOP if "logprobs" in config.split("@")[1:] else None,
                                              ignore_eos=ignore_eos))
                if report.errors:
                    raise SystemExit(f"services {config} at {c}: errors {report.errors}")
                now = verifier_counters(verifier.metrics)
                runs.setdefault((config, c), []).append(
                    {**report.summary(), "verifier_begun_behind": now["begun_behind"] - seen["begun_behind"]})
                for totals, after, was in ((timed, engine_counters(manager.metrics), before), (idle, now, seen)):
                    total = totals.setdefault((config, c), dict.fromkeys(was, 0.0))
                    for k, v in after.items():
                        total[k] += v - was[k]
                bar.update()
        bar.close()
    finally:
        system.stop()  # managers log their per-iteration split on the way out
    rows = []
    for (config, c), reports in sorted(runs.items(), key=lambda kv: (kv[0][1], configs.index(kv[0][0]))):
        median = {k: statistics.median(r[k] for r in reports) for k in reports[0] if k != "concurrency"}
        # the split over the timed runs only, from a manager that exports it (a --baseline tree's may not: its log's then)
        timed_split = split(timed[config, c])
        stats = manager_stats(logs / f"{managers[config, c].name}.log")
        if timed_split["iterations"]:
            stats.update(timed_split, predraft_hits=timed[config, c]["predraft_hits"],
                         predraft_misses=timed[config, c]["predraft_misses"])
        rows.append({"config": config, "concurrency": c, **median, "tokens_per_s_runs": [r["tokens_per_s"] for r in reports],
                     "identical_share": shares[config], "verifier_idle_ms": idle_ms(idle[config, c]),
                     **{f"manager_{k}": v for k, v in stats.items()}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="runs of every setting, interleaved; medians reported")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="the load's requests stop where the LLM ends its reply (natural stops; default: ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0, help="the load's sampling (0: greedy), seeded")
    p.add_argument("--configs", default="off;2,1,1@64;2,1,1@64@static;1,1,3,1,1,1,1,1@64",
                   help="';'-separated: 'off', 'default' (the manager's defaults; 'default@predraft' and the like with options) "
                        "or EXPANSION@TREE_BUDGET[@static] "
                        "(@static: without the adaptive controller; @head: with the --head speculators; @alone: context "
                        "lookup alone, no speculators; see manager_flags)")
    p.add_argument("--llm", default=DEFAULT_LLM,
                   help="LLM checkpoint (default: %(default)s; e.g. a directory made by specinfer_bench.inflate)")
    p.add_argument("--ssm", type=Path, action="append", default=None,
                   help="SSM checkpoints (default: the served one on the default LLM, none on another)")
    p.add_argument("--head", type=Path, action="append", default=[],
                   help="feature drafters (EAGLE-3 heads), each a speculator of its own, drafting for the @head configs")
    p.add_argument("--prompt-file", type=Path, default=default_prompts(), help="JSONL prompts ('prompt' or 'messages')")
    p.add_argument("--baseline", type=Path, default=None,
                   help="another source tree (e.g. a checkout of an earlier commit): configs with @baseline run its manager")
    p.add_argument("--dtype", default="auto", help="the services' and the reference's (auto: bfloat16 on CUDA, else float32)")
    p.add_argument("--in-process", action="store_true",
                   help="first the same requests through the engine in this process (see the module)")
    p.add_argument("--log-dir", type=Path, default=None, help="the services' logs (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=Path("bench/results/services_cpu"))
    args = p.parse_args()
    device = resolve_device("auto")  # where the services' models go (--device auto)
    dtype = resolve_dtype(args.dtype, device)
    exact = dtype in (torch.float32, torch.float64)
    prompts = load_prompt_ids(args.llm, read_prompt_file(args.prompt_file))
    configs = [default_config(device.type) + c.removeprefix("default") if c.split("@")[0] == "default" else c
               for c in args.configs.split(";")]
    levels, ssms = [int(c) for c in args.concurrency.split(",")], drafter_dirs(args.ssm, False, args.llm, served_ssms)
    try:
        check_configs(configs, len(ssms), len(args.head))
    except ValueError as e:
        p.error(str(e))
    result = {"machine": machine(), "command": command_line("python -m specinfer_bench.services", None),
              "dtype": str(dtype).removeprefix("torch."), "default_config": default_config(device.type),
              "max_new_tokens": args.max_new_tokens, "requests_per_stream": args.requests_per_stream,
              "ignore_eos": not args.stop_at_eos, "greedy_check": {"prompts": CHECK_PROMPTS, "tokens": CHECK_TOKENS}}
    save = lambda text=None: write_record(args.out, result, text)  # noqa: E731
    start = time.perf_counter()
    llm = LlamaModel.from_pretrained(args.llm, dtype=dtype, device=device)
    if args.in_process:
        drafters = [LlamaModel.from_pretrained(d, dtype=dtype, device=device) for d in ssms_used(configs, ssms)]
        loaded = time.perf_counter()
        reference, result["in_process"] = in_process(llm, drafters, prompts, configs, levels, args.requests_per_stream,
                                                     args.max_new_tokens, args.temperature, exact, not args.stop_at_eos)
        print(f"in process: the models loaded in {loaded - start:.0f} s, the engines built and run in "
              f"{time.perf_counter() - loaded:.0f} s", flush=True)
        save()  # kept should the services not finish
        del drafters
    else:
        reference = reference_greedy(llm, prompts[:CHECK_PROMPTS], CHECK_TOKENS)
    del llm
    release(device)
    result["rows"] = rows = measure(args.llm, ssms, prompts, reference, configs, levels, args.requests_per_stream,
                                    args.max_new_tokens, args.rounds, args.temperature, args.baseline, args.head,
                                    args.dtype, exact, args.log_dir, not args.stop_at_eos)
    text = services_markdown(rows, result, args.max_new_tokens, args.rounds, args.temperature)
    text += in_process_markdown(result)
    save(text)
    plot_services(rows, configs, levels, args.out.with_suffix(".png"), result["machine"])
    print(text)


if __name__ == "__main__":
    main()
