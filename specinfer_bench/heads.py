"""Feature drafter against token drafter, in process, one request at a time, greedy, side by side in
one run: on the default LLM's held-out code prompts and chat requests, and on general requests unlike
either drafter's training (models/smollm2/general_prompts.jsonl).

    python -m specinfer_bench.heads --out bench/results/heads_cpu

Each configuration drafts with the cost-model controller choosing each step's depth of its expansion,
as `specinfer generate` and the manager do, unless marked "fixed" (its whole expansion every step).
Each adaptive row is set against the best fixed row of its set (incremental decoding is a fixed
setting too), and each drafter's own accepted and drafted nodes are shown. Every configuration's
greedy outputs must equal incremental decoding's, or no figure is reported.

The adaptive default against fixed settings, on the held-out code and chat and the general requests:

    python -m specinfer_bench.heads --configs "$(python -m specinfer_bench.heads --list adaptive)" \
        --out bench/results/adaptive_cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM, checkpoint_dir, default_heads, default_ssms, models_dir
from specinfer.eagle import EagleHead
from specinfer.engine import add_tallies
from specinfer.generate import Mode
from specinfer.model import LlamaModel
from specinfer.prompts import read_prompt_file

from .inprocess import load_prompt_ids, run
from .report import _plt, command_line, machine, summarize, write_record

# label -> (SSM 0, the head, mode, expansion, context lookup, dynamic trees, adaptive)
CONFIGS = {
    "incremental": (False, False, Mode.INCREMENTAL, [], False, False, False),
    "SSM 0 <2,1> + lookup": (True, False, Mode.TREE, [2, 1], True, False, True),
    "SSM 0 dynamic <2,1,1> + lookup": (True, False, Mode.TREE, [2, 1, 1], True, True, True),
    "head <2,1,1,1> + lookup": (False, True, Mode.TREE, [2, 1, 1, 1], True, False, True),
    "head <4,2,1,1,1>": (False, True, Mode.TREE, [4, 2, 1, 1, 1], False, False, True),
    "head <4,2,1,1,1> + lookup": (False, True, Mode.TREE, [4, 2, 1, 1, 1], True, False, True),
    "head dynamic <4,2,1,1,1> + lookup": (False, True, Mode.TREE, [4, 2, 1, 1, 1], True, True, True),
    "SSM 0 <2,1> + head <2,1> + lookup": (True, True, Mode.TREE, [2, 1], True, False, True),
    "SSM 0 + head dynamic <2,1,1> + lookup": (True, True, Mode.TREE, [2, 1, 1], True, True, True),
    # the server's default (`specinfer serve`: SSM 0, the head, lookup, <2,1,1>, adaptive) and fixed settings
    "default: SSM 0 + head <2,1,1> + lookup": (True, True, Mode.TREE, [2, 1, 1], True, False, True),
    "SSM 0 + head <2,1,1> + lookup, fixed": (True, True, Mode.TREE, [2, 1, 1], True, False, False),
    "SSM 0 + head <2,1> + lookup, fixed": (True, True, Mode.TREE, [2, 1], True, False, False),
    "SSM 0 <2,1,1> + lookup, fixed": (True, False, Mode.TREE, [2, 1, 1], True, False, False),
    "head <2,1,1,1> + lookup, fixed": (False, True, Mode.TREE, [2, 1, 1, 1], True, False, False),
    "lookup alone, fixed": (False, False, Mode.TREE, [1], True, False, False),
}
SELECTIONS = {  # --list NAME: a set of labels for --configs
    "adaptive": ["incremental", "default: SSM 0 + head <2,1,1> + lookup", "SSM 0 + head <2,1,1> + lookup, fixed",
                 "SSM 0 + head <2,1> + lookup, fixed", "SSM 0 <2,1,1> + lookup, fixed", "head <2,1,1,1> + lookup, fixed",
                 "lookup alone, fixed"],
}


def drafter_names(use_ssm: bool, use_head: bool) -> list[str]:
    """The in-process engine's drafters by number (Chunk.drafters): SSM 0, the head, then context lookup."""
    return ["SSM 0"] * use_ssm + ["head"] * use_head + ["lookup"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, default=None, help="the head (default: models/smollm2/head-1)")
    ap.add_argument("--prompts", type=int, default=32, help="requests of each set, at most")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", default=";".join(list(CONFIGS)[:9]), help="labels of CONFIGS, separated by ';'")
    ap.add_argument("--list", choices=SELECTIONS, help="print a selection of labels for --configs, and exit")
    ap.add_argument("--out", type=Path, default=Path("bench/results/heads_cpu"))
    args = ap.parse_args(argv)
    if args.list:
        print(";".join(SELECTIONS[args.list]))
        return 0
    unknown = [label for label in args.configs.split(";") if label not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    llm_dir = checkpoint_dir(DEFAULT_LLM)
    llm = LlamaModel.from_pretrained(llm_dir)
    heads = [args.head] if args.head else default_heads()
    if not heads:
        sys.exit("no head: give --head (the default LLM's head is trained by `specinfer train-head`)")
    head = EagleHead.from_pretrained(heads[0], llm.cfg, llm.embed.weight)
    ssm = LlamaModel.from_pretrained(default_ssms()[0])
    records = read_prompt_file(models_dir() / "smollm2" / "prompts.jsonl")
    sets = {"code": [r for r in records if "prompt" in r], "chat": [r for r in records if "messages" in r],
            "general": read_prompt_file(models_dir() / "smollm2" / "general_prompts.jsonl")}
    labels = args.configs.split(";")
    result = {"command": command_line("python -m specinfer_bench.heads", argv), "machine": machine(),
              "llm": DEFAULT_LLM, "head": str(heads[0]), "dtype": "float32", "max_new_tokens": args.max_new_tokens,
              "sets": {}}
    warm = load_prompt_ids(llm_dir, sets["code"][:1])
    for label in labels:  # the first forwards of each row count build oneDNN's kernels: not measured
        use_ssm, use_head, mode, expansion, lookup, dynamic, adaptive = CONFIGS[label]
        run(llm, [ssm] if use_ssm else [], mode, expansion, warm, 16, 0.0, lookup, heads=[head] if use_head else [],
            adaptive=adaptive, dynamic=dynamic)
    bar = tqdm(total=len(sets) * len(labels), unit="config")
    raw = {}
    for name, recs in sets.items():
        prompts = load_prompt_ids(llm_dir, recs)[: args.prompts]
        reference = None
        for label in labels:
            use_ssm, use_head, mode, expansion, lookup, dynamic, adaptive = CONFIGS[label]
            outs, figures = run(llm, [ssm] if use_ssm else [], mode, expansion, prompts, args.max_new_tokens, 0.0,
                                lookup, heads=[head] if use_head else [], adaptive=adaptive, dynamic=dynamic)
            reference = outs if reference is None else reference
            if outs != reference:
                sys.exit(f"{name}, {label}: greedy outputs differ from incremental decoding; no figures reported")
            raw.setdefault(name, {})[label] = (len(prompts), figures)
            bar.update()
    bar.close()
    raw["all held-out (code + chat)"] = {label: (raw["code"][label][0] + raw["chat"][label][0],
                                                 merged(raw["code"][label][1], raw["chat"][label][1])) for label in labels}
    for name, by_label in raw.items():
        rows = [summarize(label, 0.0, figures, {
            "adaptive": CONFIGS[label][6],
            "drafters": {drafter_names(*CONFIGS[label][:2])[int(n)]: hit_drafted
                         for n, hit_drafted in sorted(figures["drafters"].items())}})
                for label, (_, figures) in by_label.items()]
        best_fixed = max((r["tokens_per_s"] for r in rows if not r["adaptive"]), default=None)
        for row in rows:
            row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
            if row["adaptive"] and best_fixed:
                row["of_best_fixed"] = row["tokens_per_s"] / best_fixed
        result["sets"][name] = {"prompts": next(iter(by_label.values()))[0], "rows": rows}
    text = markdown(result)
    write_record(args.out, result, text)
    plot(result, args.out.with_suffix(".png"))
    print(text)
    return 0


def merged(a: dict, b: dict) -> dict:
    """Two runs' figures as one run's."""
    depth = max(len(a["acceptance_by_depth"]), len(b["acceptance_by_depth"]))
    at = lambda f, d: f["acceptance_by_depth"][d] * f["forwards"] if d < len(f["acceptance_by_depth"]) else 0.0  # noqa: E731
    forwards = a["forwards"] + b["forwards"]
    return {"tokens": a["tokens"] + b["tokens"], "forwards": forwards,
            "request_seconds": a["request_seconds"] + b["request_seconds"],
            "acceptance_by_depth": [(at(a, d) + at(b, d)) / forwards for d in range(depth)],
            "drafters": add_tallies(a["drafters"], b["drafters"])}


def markdown(result: dict) -> str:
    lines = [f"# Feature drafter against token drafter, in process ({result['machine']})", "",
             f"`{result['command']}`", "",
             f"{result['llm']}, {result['dtype']}, greedy, one request at a time, {result['max_new_tokens']} new tokens; "
             "outputs identical to incremental decoding in every row; the controller picks each step's depth "
             "(rows marked fixed: the whole expansion every step). vs best fixed: an adaptive row's tok/s over the best "
             "fixed row's of the set (incremental included). Each drafter: its own nodes the LLM accepted / drafted "
             "(a node proposed by two drafters counts for both).", ""]
    for name, s in result["sets"].items():
        lines += [f"## {name} ({s['prompts']} requests)", "",
                  "| config | tokens per LLM step | tok/s | vs incremental | vs best fixed | each drafter: accepted / drafted "
                  "| acceptance by depth |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in s["rows"]:
            acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"]) or "-"
            best = f"{100 * r['of_best_fixed']:.0f}%" if "of_best_fixed" in r else "-"
            drafters = ", ".join(f"{k} {a}/{d}" for k, (a, d) in r["drafters"].items()) or "-"
            lines.append(f"| {r['config']} | {r['tokens_per_step']:.2f} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup']:.2f}x | {best} | {drafters} | {acc} |")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = _plt()
    sets = list(result["sets"])
    labels = [r["config"] for r in result["sets"][sets[0]]["rows"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        for ax, key in zip(axes, ("tokens_per_step", "speedup")):
            ax.bar([k + i * width for k in range(len(sets))],
                   [next(r[key] for r in result["sets"][s]["rows"] if r["config"] == label) for s in sets],
                   width, label=label)
    for ax, title in zip(axes, ("tokens per LLM step", "tok/s vs incremental")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(sets))], sets)
        ax.set_title(title)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{result['llm']}: feature drafter (EAGLE-3 head) vs SSM 0, in process, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
