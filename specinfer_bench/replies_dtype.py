"""What decoding a head's distillation replies in bfloat16 changes (issue 98): the same requests of the
request set decoded greedily by this project's engine in float32 and in bfloat16, batched, back to back:
tokens/s of each, how many replies are identical, and the share of float32's reply tokens before a
reply's first difference.

    python -m specinfer_bench.replies_dtype --out bench/results/replies_dtype_cpu
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specinfer.checkpoints import DEFAULT_LLM, checkpoint_dir, default_requests
from specinfer.generate import Request
from specinfer.head_training import engine_for, weighted_order
from specinfer.model import LlamaModel
from specinfer.prompts import prompt_ids, read_prompt_file

from .divergence import compare
from .report import command_line, machine, write_record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=96, help="the request set's first requests in its training order")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    path = checkpoint_dir(DEFAULT_LLM)
    tokenizer = AutoTokenizer.from_pretrained(path)
    records = weighted_order(read_prompt_file(default_requests()), 0)[: args.requests]
    prompts = [prompt_ids(tokenizer, r) for r in records]
    replies, speed = {}, {}
    engines = {str(dtype): engine_for(LlamaModel.from_pretrained(path, dtype=dtype), prompts, args.new_tokens, len(prompts))
               for dtype in (torch.float32, torch.bfloat16)}
    for _ in range(2):  # alternating, best of 2: the first run of each pays its one-time costs
        for dtype, engine in engines.items():
            start = time.perf_counter()
            gens = engine.generate([Request(p, args.new_tokens, id=str(i)) for i, p in enumerate(prompts)])
            replies[dtype] = [g.token_ids for g in gens]
            tok_s = round(sum(len(g.token_ids) for g in gens) / (time.perf_counter() - start), 1)
            speed[dtype] = max(speed.get(dtype, 0.0), tok_s)
    f32, bf16 = replies["torch.float32"], replies["torch.bfloat16"]
    firsts = [compare(a, b)[1] for a, b in zip(f32, bf16)]
    before = sum(len(a) if f is None else f for a, f in zip(f32, firsts))
    report = {"command": command_line("python -m specinfer_bench.replies_dtype", argv), "machine": machine(),
              "requests": len(records), "new_tokens": args.new_tokens, "tok_s": speed,
              "identical_replies": sum(f is None for f in firsts),
              "share_of_float32_tokens_before_the_first_difference": round(before / sum(map(len, f32)), 3),
              "first_difference": firsts}
    text = (f"`{report['command']}` on {report['machine']}\n\n"
            f"SmolLM2's greedy replies to the request set's first {len(records)} requests (its training order), "
            f"{args.new_tokens} new tokens, all at once, best of 2:\n\n"
            "| dtype | tok/s |\n| --- | --- |\n" + "".join(f"| {k} | {v} |\n" for k, v in speed.items()) +
            f"\nIdentical replies: {report['identical_replies']} / {len(records)}; float32's reply tokens before the "
            f"first difference: {report['share_of_float32_tokens_before_the_first_difference']:.1%}.\n")
    print(text)
    if args.out:
        write_record(args.out, report, text)


if __name__ == "__main__":
    main()
