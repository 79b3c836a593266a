"""Predicted outputs as users send them: edit requests (a function and an instruction to change it)
through the OpenAI gateway with the openai client, the function sent as the prediction (OpenAI's
Predicted Outputs), against the same requests with the server's default speculation alone and with
speculation off; and with another request's function as the prediction (a wrong one: what it costs).

Starts the services as `specinfer serve` does on the default LLM, one manager and gateway per
setting (structured.start_gateways). Greedy; before timing, every setting's replies must equal
speculation off's. Rounds are interleaved (this machine's speed drifts), every other one in reverse
order, medians reported. Usage's completion_tokens_details gives the prediction's tokens drafted
and accepted or rejected.

The requests (`bench/edit_requests.jsonl`) are made by `--make-requests N` from functions of the
corpus's held-out files (scripts/train_fixtures.py: no drafter was trained on them), each with one
of four edits.

    python -m specinfer_bench.predicted --out bench/results/predicted_cpu
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import random
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import openai
from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM
from specinfer_rpc.launch import System

from .report import command_line, machine, write_record
from .structured import start_gateways

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = ROOT / "bench" / "edit_requests.jsonl"
CONFIGS = {  # name: (speculation as the client asks it, the prediction: its own function, another's, none)
    "off": ("off", None),
    "default": (None, None),
    "predicted": (None, "own"),
    "mispredicted": (None, "other"),
}
EDITS = [
    "Rename the function `{name}` to `{name}_v2`.",
    "Add a comment line above each `return` statement saying what it returns.",
    "Remove the docstring.",
    "Rename every local variable `{var}` to `{var}_value`.",
]
REPLY = "Reply with the whole function, changed, in a Python code block, and nothing else."


def make_requests(count: int, seed: int) -> list[dict]:
    """`count` edit requests from functions of 8 to 40 lines (a docstring, at most 1,600 characters)
    of the corpus's held-out files, one per file."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_fixtures import corpus_files, read

    _, heldout = corpus_files(20)
    rng = random.Random(seed)
    rng.shuffle(heldout)
    out = []
    for _, path in heldout:
        try:
            tree = ast.parse(text := read(path))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not ast.get_docstring(node):
                continue
            source = textwrap.dedent(" " * node.col_offset + (ast.get_source_segment(text, node) or ""))
            names = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)})
            if not 8 <= source.count("\n") + 1 <= 40 or len(source) > 1600 or "return" not in source or not names:
                continue
            edit = EDITS[len(out) % len(EDITS)].format(name=node.name, var=names[0])
            out.append({"name": node.name, "edit": edit,
                        "prompt": f"{edit} {REPLY}\n\n```python\n{source}\n```", "prediction": f"```python\n{source}\n```"})
            break
        if len(out) == count:
            break
    return out


async def drive(url: str, entries: list[dict], speculation: str | None, prediction: str | None,
                max_new_tokens: int) -> tuple[dict, list[str]]:
    """Every request through the gateway, one at a time; the figures and each reply."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    replies, tokens, steps, accepted, rejected = [], 0, 0, 0, 0
    start = time.perf_counter()
    try:
        for i, e in enumerate(entries):
            extra = {"speculation": speculation} if speculation else {}
            kw = {}
            if prediction is not None:
                kw["prediction"] = {"type": "content", "content": (
                    e if prediction == "own" else entries[(i + 1) % len(entries)])["prediction"]}
            r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": e["prompt"]}],
                                                     max_tokens=max_new_tokens, temperature=0, extra_body=extra, **kw)
            replies.append(r.choices[0].message.content)
            tokens += r.usage.completion_tokens
            steps += r.usage.model_extra["speculation"]["verifier_steps"]
            if prediction is not None:
                accepted += r.usage.completion_tokens_details.accepted_prediction_tokens
                rejected += r.usage.completion_tokens_details.rejected_prediction_tokens
    finally:
        await client.close()
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tokens_per_step": tokens / steps,
            "accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected}, replies


def measure(llm: str, entries: list[dict], configs: list[str], max_new_tokens: int, rounds: int) -> list[dict]:
    system = System(log_dir=Path(tempfile.mkdtemp(prefix="specinfer-predicted-")))
    runs = {}
    try:
        _, gateways = start_gateways(system, llm, configs)
        reference = None
        for config in configs:  # exactness before any figure
            _, replies = asyncio.run(drive(gateways[config].url, entries, *CONFIGS[config], max_new_tokens))
            reference = reference or replies
            if replies != reference:
                raise SystemExit(f"{config}: replies differ from {configs[0]}'s; no figures reported")
        bar = tqdm(total=rounds * len(configs), unit="run", desc="predicted")
        for r in range(rounds):
            for config in (configs if r % 2 == 0 else configs[::-1]):
                figures, _ = asyncio.run(drive(gateways[config].url, entries, *CONFIGS[config], max_new_tokens))
                runs.setdefault(config, []).append(figures)
                bar.update()
        bar.close()
    finally:
        system.stop()
    return [{"config": c, **{k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]},
             "tokens_per_s_runs": [r["tokens_per_s"] for r in runs[c]]} for c in configs]


def markdown(rows: list[dict], meta: dict) -> str:
    base = {r["config"]: r["tokens_per_s"] for r in rows}
    lines = [f"`{meta['command']}` on {meta['machine']}", "",
             f"{meta['requests']} edit requests (`{meta['file']}`: a held-out function and an instruction) through the "
             "OpenAI gateway with the openai client, one at a time, greedy, at most "
             f"{meta['max_new_tokens']} tokens; medians of {meta['rounds']} interleaved rounds. off: speculation off; "
             "default: the server's default speculation (SSM 0, the head, context lookup); predicted: the same with "
             "the request's function as the prediction; mispredicted: with the next request's function as the "
             "prediction. Every setting's replies identical to off's.", "",
             "| config | tok/s | vs off | vs default | tokens/step | prediction tokens accepted / rejected |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        pred = (f"{r['accepted_prediction_tokens']:.0f} / {r['rejected_prediction_tokens']:.0f}"
                if CONFIGS[r["config"]][1] else "")
        lines.append(f"| {r['config']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['off']:.2f}x | "
                     f"{r['tokens_per_s'] / base['default']:.2f}x | {r['tokens_per_step']:.2f} | {pred} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["config"] for r in rows]
    axes[0].bar(names, [r["tokens_per_s"] for r in rows])
    axes[1].bar(names, [r["tokens_per_step"] for r in rows])
    for ax, title in zip(axes, ("tokens/s", "tokens per LLM step")):
        ax.set_title(title)
    fig.suptitle("Edit requests through the gateway: the function as the prediction, or not")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llm", default=DEFAULT_LLM)
    p.add_argument("--requests", type=Path, default=REQUESTS)
    p.add_argument("--make-requests", type=int, default=0, metavar="N",
                   help="write N edit requests from the corpus's held-out files to --requests, then stop")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)} (off and default always run)")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/predicted_cpu"))
    args = p.parse_args()
    if args.make_requests:
        entries = make_requests(args.make_requests, seed=0)
        args.requests.write_text("".join(json.dumps(e) + "\n" for e in entries))
        print(f"{len(entries)} requests written to {args.requests}")
        return
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: {', '.join(sorted(unknown))} not among {', '.join(CONFIGS)}")
    configs = sorted({"off", "default", *args.configs.split(",")}, key=list(CONFIGS).index)
    entries = [json.loads(line) for line in args.requests.read_text().splitlines() if line.strip()]
    rows = measure(args.llm, entries, configs, args.max_new_tokens, args.rounds)
    meta = {"machine": machine(), "command": command_line("python -m specinfer_bench.predicted", None),
            "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "requests": len(entries),
            "file": str(args.requests.resolve().relative_to(ROOT)) if args.requests.resolve().is_relative_to(ROOT)
            else str(args.requests)}
    text = markdown(rows, meta)
    write_record(args.out, {**meta, "rows": rows}, text)
    plot(rows, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
