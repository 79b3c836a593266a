"""Structured output as users send it: JSON Schema chat requests through the OpenAI gateway with
the openai client, constrained, with speculation off and with the server's default speculation (the
drafters, context lookup and the grammar's own drafts), against the same prompts unconstrained, at
several concurrencies.

Starts the verifier (with the head's feature layers), SSM 0's speculator and the head's, as
`specinfer serve` does on the default LLM, then one manager and its gateway per (setting,
concurrency). Each request is a chat request from `bench/json_schemas.jsonl`, sent with its schema as
the response format (`json_schema`), or without (`free`). Greedy; before timing, the constrained
outputs with speculation must equal those without, and each is checked against its schema. Each
round sends every request at each setting; rounds are interleaved (this machine's speed drifts),
every other one in reverse order, medians reported. Each manager logs its per-iteration split on
exit, among it the constrained requests' grammar time.

`--requests bench/tool_requests.jsonl`: tool calls instead (16 chat requests, each with two tools
and `tool_choice: "required"`, the reply a call the gateway's grammar enforces, gateway_svc/tools.py);
`free` sends them without tools. A call is valid when each call's arguments validate against its
tool's parameters.

`--noisy-neighbour`: a process spinning on one core for the whole run, as another tenant's job on a
shared machine (the services' timings, and so the adaptive controller's, get noisy).

    python -m specinfer_bench.structured --out bench/results/structured_cpu
    python -m specinfer_bench.structured --concurrency 1 --configs off,spec --noisy-neighbour \
        --out bench/results/structured_noisy_cpu
    python -m specinfer_bench.structured --requests bench/tool_requests.jsonl --concurrency 1,4 \
        --out bench/results/tools_cpu
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import openai
from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM, drafter_dirs, served_heads, served_ssms
from specinfer_rpc.launch import System, start_backends

from .report import command_line, machine, write_record
from .services import manager_stats

CONFIGS = {  # name: (constrained, speculation as the client asks it)
    "off": (True, "off"),
    "spec": (True, None),
    "free": (False, None),
}
SCHEMAS = Path(__file__).resolve().parent.parent / "bench" / "json_schemas.jsonl"


def read_schemas(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chat_messages(entry: dict) -> list[dict]:
    return [{"role": "user", "content": entry["prompt"]}]


def chat_body(entry: dict, constrained: bool, max_new_tokens: int) -> dict:
    """The request as an OpenAI chat client sends it: the schema travels as the response format
    (written into the prompt, the small LLM copies the schema itself when unconstrained); a tool
    request's tools with tool_choice "required"."""
    body = {"messages": chat_messages(entry), "max_tokens": max_new_tokens, "temperature": 0}
    if constrained and "tools" in entry:
        body["tools"], body["tool_choice"] = entry["tools"], "required"
    elif constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": entry["name"], "schema": entry["schema"]}}
    return body


async def drive(url: str, entries: list[dict], constrained: bool, speculation: str | None, max_new_tokens: int,
                concurrency: int) -> tuple[dict, list[str]]:
    """Every request through the gateway, `concurrency` streams at a time; the figures and each reply."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    extra = {"speculation": speculation} if speculation else {}
    queue, replies, tokens, steps = list(enumerate(entries)), [""] * len(entries), [0], [0]

    async def stream():
        while queue:
            i, e = queue.pop(0)
            r = await client.chat.completions.create(model=model, **chat_body(e, constrained, max_new_tokens),
                                                     extra_body=extra)
            message = r.choices[0].message  # a call's id is random: its name and arguments are compared
            replies[i] = json.dumps([{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                                     for c in message.tool_calls]) if message.tool_calls else message.content
            tokens[0] += r.usage.completion_tokens
            steps[0] += r.usage.model_extra["speculation"]["verifier_steps"]

    start = time.perf_counter()
    try:
        await asyncio.gather(*(stream() for _ in range(concurrency)))
    finally:
        await client.close()
    seconds = time.perf_counter() - start
    return {"tokens": tokens[0], "seconds": seconds, "tokens_per_s": tokens[0] / seconds,
            "tokens_per_step": tokens[0] / steps[0]}, replies


def check(entries: list[dict], replies: list[str]) -> int:
    """How many replies parse and validate against their schema, or are calls whose arguments validate
    against their tools' parameters (a reply cut by max_new_tokens does not)."""
    valid = 0
    for e, reply in zip(entries, replies):
        try:
            value = json.loads(reply)
            if "tools" in e:
                tools = {t["function"]["name"]: t["function"]["parameters"] for t in e["tools"]}
                if not isinstance(value, list) or not value or any(c["name"] not in tools for c in value):
                    continue
                for c in value:
                    jsonschema.validate(c["arguments"], tools[c["name"]])
            else:
                jsonschema.validate(value, e["schema"])
            valid += 1
        except (json.JSONDecodeError, TypeError, jsonschema.ValidationError):
            pass
    return valid


@contextlib.contextmanager
def noisy_neighbour(on: bool):
    """A process spinning on one core (the first this process may use) while the block runs."""
    if not on:
        yield
        return
    core = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def start_gateways(system: System, llm: str, keys: list) -> tuple[dict, dict]:
    """The services as `specinfer serve` runs them (on the default LLM the verifier with the head's
    feature layers, SSM 0's speculator and the head's; on another, context lookup alone), then a
    manager and its gateway for each of `keys` (a manager's controller learns from its own requests
    only): (managers, gateways) by key."""
    ssms = drafter_dirs(None, False, llm, served_ssms)
    verifier, specs = start_backends(system, llm, ssms, len(ssms), drafter_dirs(None, False, llm, served_heads))
    managers, gateways = {}, {}
    for key in keys:
        name = "-".join(map(str, key)) if isinstance(key, tuple) else str(key)
        managers[key] = system.start(
            f"manager-{name}", "manager_svc",
            ["--port", "0", "--verifier", verifier.address, "--tokenizer", llm, "--max-batch", "64",
             "--speculators", ",".join(s.address for s in specs)], 120)
        gateways[key] = system.start(f"gateway-{name}", "gateway_svc",
                                     ["--port", "0", "--manager", managers[key].address, "--tokenizer", llm], 120,
                                     http="http")
    return managers, gateways


def measure(llm: str, entries: list[dict], configs: list[str], levels: list[int], max_new_tokens: int, rounds: int,
            neighbour: bool) -> tuple[list[dict], dict]:
    logs = Path(tempfile.mkdtemp(prefix="specinfer-structured-"))
    system = System(log_dir=logs)
    runs, valid = {}, {}
    try:
        managers, gateways = start_gateways(system, llm, [(config, c) for config in configs for c in levels])
        with noisy_neighbour(neighbour):
            outputs = {}
            for config in ("off", "spec"):  # exactness before any figure
                constrained, speculation = CONFIGS[config]
                _, replies = asyncio.run(drive(gateways[config, levels[0]].url, entries, constrained, speculation,
                                               max_new_tokens, levels[0]))
                outputs[config] = replies
                valid[config] = check(entries, replies)
            if outputs["spec"] != outputs["off"]:
                raise SystemExit("constrained outputs differ with speculation; no figures reported")
            bar = tqdm(total=rounds * len(gateways), unit="run", desc="structured")
            order = list(gateways.items())
            for r in range(rounds):
                for (config, c), gateway in (order if r % 2 == 0 else order[::-1]):
                    constrained, speculation = CONFIGS[config]
                    figures, _ = asyncio.run(drive(gateway.url, entries, constrained, speculation, max_new_tokens, c))
                    runs.setdefault((config, c), []).append(figures)
                    bar.update()
            bar.close()
    finally:
        system.stop()  # managers log their per-iteration split on the way out
    rows = []
    for (config, c), reports in sorted(runs.items(), key=lambda kv: (kv[0][1], list(CONFIGS).index(kv[0][0]))):
        stats = manager_stats(logs / f"{managers[config, c].name}.log")
        rows.append({"config": config, "concurrency": c,
                     **{k: statistics.median(r[k] for r in reports) for k in reports[0]},
                     "tokens_per_s_runs": [r["tokens_per_s"] for r in reports],
                     **{f"manager_{k}": v for k, v in stats.items() if k != "by_batch_and_levels"}})
    return rows, {"valid": valid, "requests": len(entries)}


def markdown(rows: list[dict], meta: dict) -> str:
    off = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["config"] == "off"}
    what, without = (("tool-call chat requests, each with its tools and tool_choice \"required\"", "the tools")
                     if meta["tools"] else ("JSON Schema chat requests", "the response format"))
    lines = [f"`{meta['command']}` on {meta['machine']}", "",
             f"{meta['requests']} {what} (`{meta['schemas']}`) through the OpenAI gateway "
             "with the openai client, greedy, at most "
             f"{meta['max_new_tokens']} tokens; medians of {meta['rounds']} interleaved rounds. off: constrained, "
             "speculation off; spec: constrained, the server's default speculation (SSM 0, the head, context lookup, "
             "the grammar's forced tokens)"
             + (f"; free: the same prompts without {without}, default speculation. "
                if any(r["config"] == "free" for r in rows) else ". ")
             + 
             f"Constrained outputs that parse and validate: off {meta['valid']['off']}, spec {meta['valid']['spec']} "
             f"of {meta['requests']} (the rest cut by max_new_tokens); outputs with speculation identical to off."
             + (" **Noisy neighbour**: a process spinning on one of the 2 cores for the whole run." if meta["neighbour"]
                else ""), "",
             "| config | streams | tok/s | vs off | tokens/step | manager ms/iteration | grammar ms/iteration | grammar share |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        share = r["manager_grammar_ms"] / r["manager_ms_per_iteration"] if r["manager_ms_per_iteration"] else 0.0
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / off[r['concurrency']]:.2f}x | {r['tokens_per_step']:.2f} | "
                     f"{r['manager_ms_per_iteration']:.1f} | {r['manager_grammar_ms']:.2f} | {100 * share:.1f}% |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, tools: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        mine = {r["concurrency"]: r for r in rows if r["config"] == config}
        xs = [j + i * width for j in range(len(levels))]
        axes[0].bar(xs, [mine[c]["tokens_per_s"] for c in levels], width, label=config)
        axes[1].bar(xs, [mine[c]["tokens_per_step"] for c in levels], width, label=config)
    for ax, title in zip(axes, ("tokens/s", "tokens per LLM step")):
        ax.set_xticks([j + width for j in range(len(levels))], [f"{c} streams" for c in levels])
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"{'Tool-call' if tools else 'JSON Schema'} requests through the services (off/spec: constrained; free: not)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llm", default=DEFAULT_LLM)
    p.add_argument("--requests", type=Path, default=SCHEMAS,
                   help="JSONL: name, prompt and schema (and an example), or name, prompt and tools")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)} (off and spec always run)")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--noisy-neighbour", action="store_true", help="a process spinning on one core for the whole run")
    p.add_argument("--out", type=Path, default=Path("bench/results/structured_cpu"))
    args = p.parse_args()
    entries = read_schemas(args.requests)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: {', '.join(sorted(unknown))} not among {', '.join(CONFIGS)}")
    configs = sorted({"off", "spec", *args.configs.split(",")}, key=list(CONFIGS).index)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows, found = measure(args.llm, entries, configs, levels, args.max_new_tokens, args.rounds, args.noisy_neighbour)
    meta = {"machine": machine(), "command": command_line("python -m specinfer_bench.structured", None),
            "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "neighbour": args.noisy_neighbour,
            "schemas": os.path.relpath(args.requests), "tools": "tools" in entries[0], **found}
    text = markdown(rows, meta)
    write_record(args.out, {**meta, "rows": rows}, text)
    plot(rows, args.out.with_suffix(".png"), meta["tools"])
    print(text)


if __name__ == "__main__":
    main()
