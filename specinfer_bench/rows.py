"""The LLM's forward at batch 1 by rows (the bonus token + a tree of rows - 1 nodes), with products
past Dense.PACKED_ROWS rows zero-padded to a row bucket for oneDNN (what serves) against x @ W (MKL)
there, and the process's resident memory after each pass: what a verified tree or a batch of trees
costs as it grows, and what the buckets hold. Side by side in one run, medians.

    python -m specinfer_bench.rows --out bench/results/rows_cpu
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path

from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM
from specinfer.model import Dense, LlamaModel, StepInput

from .report import command_line, machine, median_ms, write_record

ROWS = [1, 2, 4, 8, 12, 17, 24, 33, 40, 49, 65, 97, 129, 193, 257]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def forward_ms(model: LlamaModel, prompt: list[int], rows: int, repeats: int) -> float:
    cache = model.new_pool(len(prompt) + rows + 32).new_cache()
    model([StepInput(cache, prompt[:-1], [], [])])

    def forward():
        model([StepInput(cache, prompt[-1:], [7] * (rows - 1), [-1] * (rows - 1))])
        cache.length -= 1
        cache.drop_tree()
    return median_ms(forward, repeats)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", default=DEFAULT_LLM)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("bench/results/rows_cpu"))
    args = ap.parse_args(argv)
    model = LlamaModel.from_pretrained(args.llm)
    prompt = list(range(100, 100 + args.prompt_len))
    buckets = Dense.ROW_BUCKETS
    rows_out = []
    for rows in tqdm(ROWS, desc="rows"):
        Dense.ROW_BUCKETS = buckets
        padded = forward_ms(model, prompt, rows, args.repeats)
        rss = rss_mb()
        Dense.ROW_BUCKETS = (Dense.PACKED_ROWS,)  # past PACKED_ROWS: x @ W, as before the buckets
        plain = forward_ms(model, prompt, rows, args.repeats)
        rows_out.append({"rows": rows, "buckets_ms": round(padded, 2), "x_at_w_ms": round(plain, 2),
                         "max_rss_mb_after_buckets": round(rss)})
    Dense.ROW_BUCKETS = buckets
    meta = {"command": command_line("python -m specinfer_bench.rows", argv), "machine": machine(), "llm": args.llm,
            "dtype": "float32", "prompt_len": args.prompt_len, "repeats": args.repeats, "buckets": list(buckets),
            "packed_rows": Dense.PACKED_ROWS}
    lines = ["# The LLM's forward by rows", "", f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}  ",
             f"LLM {args.llm}, float32, batch 1 after a {args.prompt_len}-token prompt, medians of {args.repeats}. "
             f"Up to {Dense.PACKED_ROWS} rows both columns are oneDNN's product as it is; past that, `buckets` pads "
             f"to {', '.join(map(str, buckets))} rows for oneDNN, `x @ W` is MKL's product.", "",
             "| rows | buckets ms | x @ W ms | x @ W / buckets | max RSS MB |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['rows']} | {r['buckets_ms']:.1f} | {r['x_at_w_ms']:.1f} | {r['x_at_w_ms'] / r['buckets_ms']:.2f} "
              f"| {r['max_rss_mb_after_buckets']} |" for r in rows_out]
    text = "\n".join(lines) + "\n"
    write_record(args.out, {"meta": meta, "rows": rows_out}, text)
    print(text)


if __name__ == "__main__":
    main()
