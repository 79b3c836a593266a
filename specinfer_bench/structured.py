"""Structured output through the real services: JSON Schema requests, constrained, with speculation
off and with the server's default speculation (the drafters, context lookup and the grammar's own
drafts), against the same prompts unconstrained, at several concurrencies.

Starts the verifier (with the head's feature layers), SSM 0's speculator and the head's, as
`specinfer serve` does on the default LLM, then one manager per (setting, concurrency). Each
request is a chat request from `bench/json_schemas.jsonl`, sent with its schema as the response
format (`json_schema`), or without (`free`). Greedy; before timing, the
constrained outputs with speculation must equal those without and each must parse and validate.
Each round sends every request at each setting; rounds are interleaved (this machine's speed
drifts), every other one in reverse order, medians reported. Each manager logs its
per-iteration split on exit, among it the constrained requests' grammar time.

    python -m specinfer_bench.structured --out bench/results/structured_cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import jsonschema
from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM, served_heads, served_ssms
from specinfer.eagle import head_layers
from specinfer.generate import Request
from specinfer.grammar import GrammarSpec
from specinfer_rpc.client import connect, generate, request_pb
from specinfer_rpc.launch import System

from .inprocess import load_prompt_ids
from .report import command_line, machine
from .services import manager_stats

CONFIGS = {  # name: (constrained, speculation as the client asks it)
    "off": (True, "off"),
    "spec": (True, None),
    "free": (False, None),
}
SCHEMAS = Path(__file__).resolve().parent.parent / "bench" / "json_schemas.jsonl"


def read_schemas(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chat_records(entries: list[dict]) -> list[dict]:
    """Each entry's request as a chat message; the schema travels as the response format, as OpenAI's
    clients send it (written into the prompt, the small LLM copies the schema itself when unconstrained)."""
    return [{"messages": [{"role": "user", "content": e["prompt"]}]} for e in entries]


def requests_for(prompts: list[list[int]], entries: list[dict], constrained: bool, max_new_tokens: int) -> list[Request]:
    return [Request(p, max_new_tokens, grammar=GrammarSpec("json_schema", json.dumps(e["schema"])) if constrained
                    else None, id=f"{e['name']}-{i}") for i, (p, e) in enumerate(zip(prompts, entries))]


async def drive(address: str, requests: list[Request], speculation: str | None, concurrency: int) -> tuple[dict, list]:
    """Every request, `concurrency` streams at a time; the figures and each request's stream."""
    stub = connect(address)
    queue, streams = list(enumerate(requests)), [None] * len(requests)

    async def stream():
        while queue:
            i, r = queue.pop(0)
            streams[i] = await generate(stub, request_pb(r, speculation), timeout=900)

    start = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    tokens = sum(len(s.token_ids) for s in streams)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_step": tokens / sum(s.usage.verifier_steps for s in streams)}, streams


def check(entries: list[dict], streams: list, decode) -> int:
    """How many outputs parse and validate against their schema (a reply cut by max_new_tokens does not)."""
    valid = 0
    for e, s in zip(entries, streams):
        try:
            jsonschema.validate(json.loads(decode(s.token_ids)), e["schema"])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return valid


def measure(llm: str, entries: list[dict], levels: list[int], max_new_tokens: int, rounds: int) -> tuple[list[dict], dict]:
    from transformers import AutoTokenizer

    from specinfer.checkpoints import checkpoint_dir

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(llm))
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    prompts = load_prompt_ids(llm, chat_records(entries))
    logs = Path(tempfile.mkdtemp(prefix="specinfer-structured-"))
    system = System(log_dir=logs)
    managers, runs, valid = {}, {}, {}
    try:
        heads = served_heads()
        layers = ",".join(map(str, head_layers(heads[0], llm)))
        verifier = system.start("verifier", "verifier_svc", ["--port", "0", "--model", llm, f"--feature-layers={layers}"],
                                120)
        specs = [system.start("speculator-0", "speculator_svc", ["--port", "0", "--ssm", str(served_ssms()[0]),
                                                                 "--threads", "1"], 120),
                 system.start("speculator-head-0", "speculator_svc", ["--port", "0", "--ssm=", "--head", str(heads[0]),
                                                                      "--llm", llm, "--threads", "1"], 120)]
        for config in CONFIGS:
            for c in levels:
                managers[config, c] = system.start(
                    f"manager-{config}-{c}", "manager_svc",
                    ["--port", "0", "--verifier", verifier.address, "--tokenizer", llm, "--max-batch", "64",
                     "--speculators", ",".join(s.address for s in specs)], 120)
        outputs = {}
        for config in ("off", "spec"):  # exactness before any figure
            constrained, speculation = CONFIGS[config]
            _, streams = asyncio.run(drive(managers[config, levels[0]].address,
                                           requests_for(prompts, entries, constrained, max_new_tokens), speculation,
                                           levels[0]))
            outputs[config] = [s.token_ids for s in streams]
            valid[config] = check(entries, streams, decode)
        if outputs["spec"] != outputs["off"]:
            raise SystemExit("constrained outputs differ with speculation; no figures reported")
        bar = tqdm(total=rounds * len(managers), unit="run", desc="structured")
        order = list(managers.items())
        for r in range(rounds):
            for (config, c), manager in (order if r % 2 == 0 else order[::-1]):
                constrained, speculation = CONFIGS[config]
                figures, _ = asyncio.run(drive(manager.address, requests_for(prompts, entries, constrained, max_new_tokens),
                                               speculation, c))
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
    lines = [f"`{meta['command']}` on {meta['machine']}", "",
             f"{meta['requests']} JSON Schema chat requests (`bench/json_schemas.jsonl`), greedy, at most "
             f"{meta['max_new_tokens']} tokens; medians of {meta['rounds']} interleaved rounds. off: constrained, "
             "speculation off; spec: constrained, the server's default speculation (SSM 0, the head, context lookup, "
             "the grammar's forced tokens); free: the same prompts without the response format, default speculation. "
             f"Constrained outputs that parse and validate: off {meta['valid']['off']}, spec {meta['valid']['spec']} "
             f"of {meta['requests']} (the rest cut by max_new_tokens); outputs with speculation identical to off.", "",
             "| config | streams | tok/s | vs off | tokens/step | manager ms/iteration | grammar ms/iteration | grammar share |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        share = r["manager_grammar_ms"] / r["manager_ms_per_iteration"] if r["manager_ms_per_iteration"] else 0.0
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / off[r['concurrency']]:.2f}x | {r['tokens_per_step']:.2f} | "
                     f"{r['manager_ms_per_iteration']:.1f} | {r['manager_grammar_ms']:.2f} | {100 * share:.1f}% |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(CONFIGS)
    for i, config in enumerate(CONFIGS):
        mine = {r["concurrency"]: r for r in rows if r["config"] == config}
        xs = [j + i * width for j in range(len(levels))]
        axes[0].bar(xs, [mine[c]["tokens_per_s"] for c in levels], width, label=config)
        axes[1].bar(xs, [mine[c]["tokens_per_step"] for c in levels], width, label=config)
    for ax, title in zip(axes, ("tokens/s", "tokens per LLM step")):
        ax.set_xticks([j + width for j in range(len(levels))], [f"{c} streams" for c in levels])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("JSON Schema requests through the services (off/spec: constrained; free: not)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llm", default=DEFAULT_LLM)
    p.add_argument("--schemas", type=Path, default=SCHEMAS, help="JSONL: name, prompt, schema (and an example)")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/structured_cpu"))
    args = p.parse_args()
    entries = read_schemas(args.schemas)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows, found = measure(args.llm, entries, levels, args.max_new_tokens, args.rounds)
    meta = {"machine": machine(), "command": command_line("python -m specinfer_bench.structured", None),
            "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, **found}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(markdown(rows, meta))
    plot(rows, args.out.with_suffix(".png"))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
