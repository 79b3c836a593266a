"""Exactness per dtype: greedy output with speculation against the same engine without it.

In float32, greedy output with speculation is identical to the LLM alone (the tests assert it). In
bfloat16 a speculative step computes a position with other row counts, another split of the
attention sum (prefix and tree parts, merged) and K/V that were moved rather than recomputed, so
where the LLM's two best logits nearly tie, the argmax can differ from a plain step's. That is the
contract vLLM and SGLang keep too; this measures how often it bites: per prompt, the share of
positions whose token equals the incremental engine's (positions up to the shorter output), and
the first position where they differ.

`--attentions auto,invariant` runs it once per tree-attention backend (SPECINFER_TREE_ATTENTION): with
`invariant` every position's logits are meant to be the same bits in any step (issue 96), so every
prompt should be identical in every dtype. Each run also times both engines (after one warm-up request,
which compiles what it needs), so the tokens/s of one backend can be set beside another's.

    python -m specinfer_bench.divergence --out bench/results/divergence_cpu
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM, default_prompts, default_ssms, drafter_dirs
from specinfer.devices import DTYPES, resolve_device
from specinfer.generate import Engine, Mode, Request
from specinfer.graphs import GraphConfig
from specinfer.model import LlamaModel
from specinfer.prompts import read_prompt_file

from .inprocess import load_prompt_ids
from .report import command_line, machine, write_record


def compare(plain: list[int], spec: list[int]) -> tuple[float, int | None]:
    """(share of identical tokens over the shorter output, first differing position or None)."""
    n = min(len(plain), len(spec))
    first = next((i for i in range(n) if plain[i] != spec[i]), None if len(plain) == len(spec) else n)
    return (sum(a == b for a, b in zip(plain, spec)) / n if n else 1.0), first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", default=DEFAULT_LLM)
    ap.add_argument("--ssm", type=Path, action="append", default=None,
                    help="repeatable (default: the default LLM's drafters; none on another LLM: context lookup alone)")
    ap.add_argument("--prompt-file", type=Path, default=default_prompts())
    ap.add_argument("--prompts", type=int, default=8, help="first N prompts of the file")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attentions", default=os.environ.get("SPECINFER_TREE_ATTENTION", "auto"),
                    help="tree-attention backends to run, comma-separated (SPECINFER_TREE_ATTENTION: auto, triton, "
                         "reference, invariant; default: the variable's)")
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    ssm_dirs = drafter_dirs(args.ssm, False, args.llm, default_ssms)
    prompts = load_prompt_ids(args.llm, read_prompt_file(args.prompt_file)[: args.prompts])
    requests = [Request(p, args.max_new_tokens) for p in prompts]
    rows, speed = [], {}
    runs = [(a, d) for a in args.attentions.split(",") for d in args.dtypes.split(",")]
    for attention, name in tqdm(runs, desc="attentions and dtypes"):
        os.environ["SPECINFER_TREE_ATTENTION"] = attention
        key = name if "," not in args.attentions else f"{attention} {name}"
        dtype = DTYPES[name]
        llm = LlamaModel.from_pretrained(args.llm, dtype=dtype, device=device)
        ssms = [LlamaModel.from_pretrained(d, dtype=dtype, device=device) for d in ssm_dirs]
        outputs = {}
        for mode in (Mode.INCREMENTAL, Mode.MERGED):
            engine = Engine(llm, ssms, mode, graphs=GraphConfig(), adaptive=mode != Mode.INCREMENTAL, lookup=not ssms)
            engine.generate(requests[:1])  # compiles and captures what it needs
            start = time.perf_counter()
            outputs[mode] = [g.token_ids for g in engine.generate(requests)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            speed[key, mode.value] = sum(map(len, outputs[mode])) / (time.perf_counter() - start)
        for i, (plain, spec) in enumerate(zip(outputs[Mode.INCREMENTAL], outputs[Mode.MERGED])):
            share, first = compare(plain, spec)
            rows.append({"dtype": key, "prompt": i, "tokens": len(plain), "identical_share": round(share, 4),
                         "first_divergence": first})
        del llm, ssms
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = {"command": command_line("python -m specinfer_bench.divergence", argv), "machine": machine(),
            "device": str(device), "llm": str(args.llm), "ssms": [str(d) for d in ssm_dirs],
            "max_new_tokens": args.max_new_tokens, "attentions": args.attentions}
    summary = {}
    for name in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == name]
        summary[name] = {"identical_prompts": sum(r["first_divergence"] is None for r in mine), "prompts": len(mine),
                         "identical_share": round(sum(r["identical_share"] for r in mine) / len(mine), 4),
                         "plain_tok_s": round(speed[name, Mode.INCREMENTAL.value], 1),
                         "speculative_tok_s": round(speed[name, Mode.MERGED.value], 1)}
        print(name, summary[name])
    if args.out:
        lines = [f"`{meta['command']}` on {meta['machine']}, device {device}", "",
                 f"Greedy output of {'merged-SSM speculation' if ssm_dirs else 'context lookup alone, no SSM,'} "
                 "(the controller's trees) against the same engine "
                 f"without speculation, {args.max_new_tokens} new tokens per prompt.", "",
                 "| dtype | prompts identical | identical tokens (mean share) | tok/s plain | tok/s speculative |",
                 "| --- | --- | --- | --- | --- |"]
        lines += [f"| {k} | {v['identical_prompts']} / {v['prompts']} | {v['identical_share']:.1%} | "
                  f"{v['plain_tok_s']} | {v['speculative_tok_s']} |" for k, v in summary.items()]
        lines += ["", "tok/s: all prompts at once, after one warm-up request; one run each, so a small difference "
                  "is noise."]
        lines += ["", "| dtype | prompt | tokens | identical share | first divergence |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['dtype']} | {r['prompt']} | {r['tokens']} | {r['identical_share']:.1%} | "
                  f"{'-' if r['first_divergence'] is None else r['first_divergence']} |" for r in rows]
        write_record(args.out, {"meta": meta, "summary": summary, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
