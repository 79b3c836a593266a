"""Bitwise exact through the services: every request's greedy tokens with the manager's default speculation
equal its tokens with speculation off, at 1 and at 16 streams, run twice (issue 96's goal), on the default
LLM in float32, with row-invariant attention (SPECINFER_TREE_ATTENTION=invariant in every service) and,
back to back, with a CPU's default attention (`reference`), which gives the tokens/s the invariance costs.

The requests: the held-out general questions (models/smollm2/general_prompts.jsonl) and the fixtures'
held-out code windows (models/fixtures/heldout_prompts.jsonl: code none of the drafters trained on), up to
512 new tokens each, stopping where the LLM ends its reply. For each attention, one system (`specinfer
serve`'s: SSM 0 and head-1 as speculators), then in turn: off at 1 stream (the reference tokens), the
default at 1 and at 16 streams, off at 16 streams, and the default at 1 and 16 again (`--repeats`). A run at
16 streams sends the requests in waves of 16 at once, so each wave's steps batch them together.

    python -m specinfer_bench.exactness --out bench/results/exactness_cpu     # the goal's run: hours on a CPU
    python -m specinfer_bench.exactness --limit 2 --max-new-tokens 8 --repeats 1 --out /tmp/x   # the plumbing

Results are written after every run (OUT.json, OUT.md), so a run stopped part way keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM, models_dir, served_heads, served_ssms
from specinfer.generate import Request
from specinfer.prompts import read_prompt_file
from specinfer_rpc.client import generate_all
from specinfer_rpc.launch import launch

from .divergence import compare
from .inprocess import load_prompt_ids
from .report import command_line, machine, write_record

ATTENTIONS = ("invariant", "reference")


def prompt_files() -> list[Path]:
    return [models_dir() / "smollm2" / "general_prompts.jsonl", models_dir() / "fixtures" / "heldout_prompts.jsonl"]


def plan(repeats: int) -> list[tuple[str, int]]:
    """The runs of one system, in order: (speculation, streams); off at 1 stream first (the reference)."""
    return [("off", 1), ("default", 1), ("default", 16), ("off", 16)] + [("default", 1), ("default", 16)] * (repeats - 1)


def run(address: str, prompts: list[list[int]], speculation: str, streams: int, max_new_tokens: int,
        bar: tqdm) -> tuple[list[list[int]], float]:
    """Every prompt's tokens, `streams` requests at a time, and the run's seconds."""
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), streams):
        wave = [Request(p, max_new_tokens) for p in prompts[i: i + streams]]
        outs += [list(s.token_ids) for s in generate_all(address, wave, None if speculation == "default" else speculation)]
        bar.update(len(wave))
    return outs, time.perf_counter() - start


def against(reference: list[list[int]], outs: list[list[int]], ids: list[str]) -> dict:
    """How many requests are identical to the reference, and the first that is not: its id, first differing
    position and tokens there."""
    firsts = [compare(a, b)[1] for a, b in zip(reference, outs)]
    bad = [(i, f) for i, f in enumerate(firsts) if f is not None]
    out = {"identical": len(firsts) - len(bad), "of": len(firsts)}
    if bad:
        i, f = bad[0]
        out["first_difference"] = {"request": ids[i], "position": f, "off": reference[i][f: f + 1],
                                   "this": outs[i][f: f + 1]}
    return out


def markdown(report: dict) -> str:
    lines = [f"# Bitwise exact through the services ({report['machine']})", "", f"`{report['command']}`", "",
             f"{report['requests']} requests (general questions and held-out code), at most {report['max_new_tokens']} "
             "new tokens each, stopping at the end of the reply; greedy, float32; the manager's default speculation "
             "('default') or none ('off'); each run against off at 1 stream with the same attention", "",
             "| attention | speculation | streams | tok/s | tokens | identical to off | first difference |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["runs"]:
        first = r.get("first_difference")
        lines.append(f"| {r['attention']} | {r['speculation']} | {r['streams']} | {r['tok_s']:.1f} | {r['tokens']} | "
                     f"{r['identical']} / {r['of']} | "
                     + (f"{first['request']} at token {first['position']}: {first['this']} for {first['off']}" if first
                        else "-") + " |")
    rates = {}
    for r in report["runs"]:
        rates.setdefault((r["speculation"], r["streams"]), {}).setdefault(r["attention"], []).append(r["tok_s"])
    pairs = [(k, v) for k, v in rates.items() if len(v) == 2]
    if pairs:
        lines += ["", "Invariant attention's tok/s against the default's (each setting's best run):", "",
                  "| speculation | streams | invariant / reference |", "| --- | --- | --- |"]
        lines += [f"| {s} | {c} | {max(v['invariant']) / max(v['reference']):.3f}x |" for (s, c), v in pairs]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--limit", type=int, default=0, help="the first N requests of each prompt file (0: all)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of the default at each stream count")
    ap.add_argument("--attentions", default=",".join(ATTENTIONS))
    ap.add_argument("--out", type=Path, default=Path("bench/results/exactness_cpu"))
    args = ap.parse_args(argv)
    records = [r for f in prompt_files() for r in read_prompt_file(f)[: args.limit or None]]
    prompts, ids = load_prompt_ids(DEFAULT_LLM, records), [r["id"] for r in records]
    report = {"machine": machine(), "command": command_line("python -m specinfer_bench.exactness", argv),
              "requests": len(prompts), "max_new_tokens": args.max_new_tokens, "runs": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = plan(args.repeats)
    bar = tqdm(total=len(args.attentions.split(",")) * len(runs) * len(prompts), unit="req", desc="requests")
    for attention in args.attentions.split(","):
        os.environ["SPECINFER_TREE_ATTENTION"] = attention  # every service the system starts
        system = launch(DEFAULT_LLM, served_ssms(), 1, port=0, dtype="float32", heads=served_heads())
        try:
            reference = None
            for speculation, streams in runs:
                outs, seconds = run(system.manager.address, prompts, speculation, streams, args.max_new_tokens, bar)
                reference = reference or outs
                tokens = sum(map(len, outs))
                report["runs"].append({"attention": attention, "speculation": speculation, "streams": streams,
                                       "tokens": tokens, "seconds": round(seconds, 1), "tok_s": round(tokens / seconds, 2),
                                       **against(reference, outs, ids)})
                write_record(args.out, report, markdown(report))
        finally:
            system.stop()
    bar.close()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
