"""In-process comparison of decoding modes on the held-out prompts, side by side in one run.

For each mode (incremental, sequence, tree configs, merged) and temperature: mean tokens per LLM
step, wall-clock tokens/s at batch 1 (one prompt at a time, the latency setting speculation is
for), and the speedup over incremental decoding at the same temperature. Greedy outputs of every
mode are checked identical to incremental decoding before anything is reported.

    python bench/modes.py --max-new-tokens 128 --out bench/results/modes_cpu

writes modes_cpu.json, modes_cpu.md and modes_cpu.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from specinfer.cli import default_ssms, models_dir
from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel
from specinfer.sampling import SamplingParams

CONFIGS = [  # (label, mode, expansion)
    ("incremental", Mode.INCREMENTAL, []),
    ("sequence <1x8>", Mode.SEQUENCE, [1] * 8),
    ("tree <1,1,3,1,1,1,1,1>", Mode.TREE, [1, 1, 3, 1, 1, 1, 1, 1]),
    ("tree <2,2,2,1,1,1,1,1>", Mode.TREE, [2, 2, 2, 1, 1, 1, 1, 1]),
    ("tree <3,2,2,1,1,1,1,1>", Mode.TREE, [3, 2, 2, 1, 1, 1, 1, 1]),
    ("merged 2 SSMs <1,1,3,1,1,1,1,1>", Mode.MERGED, [1, 1, 3, 1, 1, 1, 1, 1]),
    ("merged 2 SSMs <2,2,2,1,1,1,1,1>", Mode.MERGED, [2, 2, 2, 1, 1, 1, 1, 1]),
    # shallow shapes: on a 2-core CPU an SSM level costs ~1/3 of an LLM step (see README)
    ("sequence <1x4>", Mode.SEQUENCE, [1] * 4),
    ("tree <2,1,1>", Mode.TREE, [2, 1, 1]),
    ("tree <2,1,1,1>", Mode.TREE, [2, 1, 1, 1]),
]


def machine() -> str:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, Python {platform.python_version()}"


def run_config(llm, ssms, mode, expansion, prompts, max_new, temperature):
    engine = Engine(llm, ssms, mode, expansion)
    outs, elapsed = [], 0.0
    for i, p in enumerate(prompts):
        req = Request(p, max_new, SamplingParams(temperature, seed=i), id=str(i))
        start = time.perf_counter()
        outs.append(engine.generate([req])[0])
        elapsed += time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in outs)
    steps = sum(g.steps for g in outs)
    depth = max(expansion, default=0) and len(expansion)
    accepted_at = [0] * depth  # steps whose accepted path reached depth d+1
    for g in outs:
        for a in g.accepted:
            for d in range(a):
                accepted_at[d] += 1
    return outs, {
        "tokens": tokens,
        "steps": steps,
        "tokens_per_step": (tokens - len(outs)) / steps,
        "seconds": elapsed,
        "tokens_per_second": tokens / elapsed,
        "acceptance_by_depth": [a / steps for a in accepted_at],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", type=Path, default=models_dir() / "llm")
    ap.add_argument("--ssm", type=Path, action="append", default=None)
    ap.add_argument("--prompts", type=Path, default=models_dir() / "heldout_prompts.jsonl")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--out", type=Path, default=Path("bench/results/modes_cpu"))
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.llm)
    llm = LlamaModel.from_pretrained(args.llm)
    ssms = [LlamaModel.from_pretrained(d) for d in (args.ssm or default_ssms())]
    prompts = [tok(json.loads(l)["prompt"])["input_ids"] for l in open(args.prompts) if l.strip()]
    prompts = prompts[: args.limit or None]
    engine_warmup = Engine(llm, ssms, Mode.MERGED)
    engine_warmup.generate([Request(prompts[0], 8)])

    rows = []
    runs = [(t, c) for t in map(float, args.temperatures.split(",")) for c in CONFIGS]
    for temperature, (label, mode, expansion) in tqdm(runs, desc="configs"):
        outs, stats = run_config(llm, ssms, mode, expansion, prompts, args.max_new_tokens, temperature)
        if temperature == 0:
            if mode == Mode.INCREMENTAL:
                reference = [g.token_ids for g in outs]
            elif [g.token_ids for g in outs] != reference:
                sys.exit(f"{label}: greedy output differs from incremental decoding; no figures reported")
        rows.append({"config": label, "temperature": temperature, **stats})
    for r in rows:
        base = next(b for b in rows if b["temperature"] == r["temperature"] and b["config"] == "incremental")
        r["speedup_vs_incremental"] = r["tokens_per_second"] / base["tokens_per_second"]

    result = {"command": " ".join(["python"] + sys.argv), "machine": machine(), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "batch_size": 1, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    plot(result, args.out.with_suffix(".png"))
    print(markdown(result))


def markdown(result) -> str:
    lines = [f"Command: `{result['command']}`  ",
             f"Machine: {result['machine']}  ",
             f"{result['prompts']} held-out prompts, {result['max_new_tokens']} new tokens each, batch size 1. "
             "Greedy outputs of every mode were checked identical to incremental decoding.", "",
             "| config | T | tokens/step | tokens/s | speedup vs incremental | acceptance by depth |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"]) or "-"
        lines.append(f"| {r['config']} | {r['temperature']:g} | {r['tokens_per_step']:.2f} | "
                     f"{r['tokens_per_second']:.1f} | {r['speedup_vs_incremental']:.2f}x | {acc} |")
    return "\n".join(lines) + "\n"


def plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in result["rows"]})
    labels = [c[0] for c in CONFIGS]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(temps)
    for k, t in enumerate(temps):
        by = {r["config"]: r for r in result["rows"] if r["temperature"] == t}
        xs = [i + k * width for i in range(len(labels))]
        axes[0].bar(xs, [by[l]["tokens_per_step"] for l in labels], width, label=f"T={t:g}")
        axes[1].bar(xs, [by[l]["speedup_vs_incremental"] for l in labels], width, label=f"T={t:g}")
    for ax, title in zip(axes, ["tokens per LLM step", "wall-clock speedup vs incremental (batch 1)"]):
        ax.set_xticks([i + width * (len(temps) - 1) / 2 for i in range(len(labels))])
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend()
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle(f"SpecInfer decoding modes, {result['prompts']} held-out prompts x {result['max_new_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
