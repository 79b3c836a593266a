"""Sampled requests, seeded: coupled matching over the drafters' guesses of the coupled sample and
their top-k (the default; "top-k drafts" in the tables) against the paper's multi-step speculative
sampling over sampled drafts, and no speculation, in process and through the services, side by side
in one run.

    python -m specinfer_bench.sampled --out bench/results/sampled_cpu

In process: one request at a time, the CLI's in-process default (SSM 0's tree <2,1> merged with
context lookup's chain), interleaved rounds. Through the services: `specinfer_bench.services` with
the manager's defaults (2,1,1@16, adaptive, context lookup) and the same with MSS (@mss), against
off. Both report tokens/s and tokens per LLM step (the prompt's step included).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM, default_prompts, drafter_dirs, served_ssms
from specinfer.generate import Mode
from specinfer.model import LlamaModel
from specinfer.prompts import read_prompt_file

from . import inprocess, services
from .report import command_line, machine, services_markdown, write_record

SETTINGS = {  # name: (mode, MSS)
    "off": (Mode.INCREMENTAL, False),
    "coupled matching, top-k drafts": (Mode.TREE, False),
    "MSS, sampled drafts": (Mode.TREE, True),
}


def in_process(llm_ref, ssm_dir: Path, prompts: list[list[int]], expansion: list[int], max_new_tokens: int,
               temperature: float, rounds: int) -> list[dict]:
    llm, ssm = LlamaModel.from_pretrained(llm_ref), LlamaModel.from_pretrained(ssm_dir)
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    order = list(SETTINGS.items())
    bar = tqdm(total=rounds * len(order), unit="run", desc="in process")
    for r in range(rounds):  # interleaved, every other round reversed: the machine's drift hits all alike
        for name, (mode, mss) in (order if r % 2 == 0 else order[::-1]):
            _, fig = inprocess.run(llm, [ssm], mode, [] if mode == Mode.INCREMENTAL else expansion, prompts,
                                   max_new_tokens, temperature, lookup=mode != Mode.INCREMENTAL, mss=mss)
            runs[name].append({"tokens_per_s": fig["tokens"] / sum(fig["request_seconds"]),
                               "tokens_per_step": fig["tokens"] / fig["forwards"]})
            bar.update()
    bar.close()
    off = statistics.median(x["tokens_per_s"] for x in runs["off"])
    rows = []
    for name, xs in runs.items():
        tps = statistics.median(x["tokens_per_s"] for x in xs)
        rows.append({"setting": name, "tokens_per_s": tps, "vs_off": tps / off,
                     "tokens_per_step": statistics.median(x["tokens_per_step"] for x in xs),
                     "tokens_per_s_runs": [x["tokens_per_s"] for x in xs]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llm", default=DEFAULT_LLM, help="LLM checkpoint (default: %(default)s)")
    p.add_argument("--ssm", type=Path, default=None, help="SSM checkpoint (default: the served one of the default LLM)")
    p.add_argument("--prompt-file", type=Path, default=default_prompts(), help="JSONL prompts ('prompt' or 'messages')")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts in process (the services use all)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--rounds", type=int, default=2, help="runs of every setting, interleaved; medians reported")
    p.add_argument("--expansion", default="2,1", help="in process: SSM 0's expansion config")
    p.add_argument("--concurrency", default="1,4,16", help="through the services")
    p.add_argument("--configs", default="off;2,1,1@16;2,1,1@16@mss", help="through the services (specinfer_bench.services)")
    p.add_argument("--no-services", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/results/sampled_cpu"))
    args = p.parse_args()
    ssm = next(iter(drafter_dirs(None if args.ssm is None else [args.ssm], False, args.llm, served_ssms)), None)
    if ssm is None:
        p.error("--ssm: name the SSM to sample with (the default LLM's serves only it)")
    prompts = inprocess.load_prompt_ids(args.llm, read_prompt_file(args.prompt_file))
    expansion = [int(k) for k in args.expansion.split(",")]
    meta = {"machine": machine(), "command": command_line("python -m specinfer_bench.sampled", None),
            "llm": str(args.llm), "ssm": str(ssm), "dtype": "float32", "temperature": args.temperature,
            "max_new_tokens": args.max_new_tokens, "rounds": args.rounds}
    rows = in_process(args.llm, ssm, prompts[:args.prompts], expansion, args.max_new_tokens, args.temperature,
                      args.rounds)
    lines = [f"# Sampled requests at T={args.temperature:g}, seeded ({meta['machine']})", "", f"`{meta['command']}`", "",
             f"In process, one request at a time, {args.prompts} prompts x {args.max_new_tokens} tokens, "
             f"SSM 0 <{args.expansion}> merged with context lookup; medians of {args.rounds} interleaved rounds "
             f"(float32):", "", "| setting | tok/s | vs off | tok/step |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['setting']} | {r['tokens_per_s']:.1f} | {r['vs_off']:.2f}x | {r['tokens_per_step']:.2f} |"
              for r in rows]
    result = {**meta, "in_process": rows}
    if not args.no_services:
        configs, levels = args.configs.split(";"), [int(c) for c in args.concurrency.split(",")]
        reference = inprocess.reference_greedy(LlamaModel.from_pretrained(args.llm), prompts[:4], 32)
        result["services"] = services.measure(args.llm, [ssm], prompts, reference, configs, levels, 4,
                                              args.max_new_tokens, args.rounds, args.temperature)
        lines += ["", services_markdown(result["services"], meta, args.max_new_tokens, args.rounds, args.temperature)
                  .replace("# Through the services", "## Through the services")]
    text = "\n".join(lines) + "\n"
    write_record(args.out, result, text)
    print(text)


if __name__ == "__main__":
    main()
