"""Distilled data against a head's agreement (issue 98): heads trained by `specinfer train-head` on more or
fewer of the LLM's replies, side by side: each one's reply tokens, training steps, and first-token agreement
and mean accepted chain on every held-out set its report scored, as a table and a plot.

    python -m specinfer_bench.head_volume --report head-0=H0.json --report 'head-1 (quarter)=Q.json' ... \\
        --out bench/results/head_volume_cpu

Each REPORT is `specinfer train-head --report` output (a trained head's; `--score-only`'s has no training
figures: give them after the path as `:REPLY_TOKENS:STEPS`, e.g. head-0's from models/README.md), scored on
this machine. `--earlier OUT.json` takes an earlier table's rows first, as they were, each with the machine
it was made on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .report import _plt, command_line, machine, save_panel, write_record


def load(spec: str, machine_text: str) -> dict:
    """One head's row from LABEL=PATH[:REPLY_TOKENS:STEPS], scored on `machine_text`."""
    label, rest = spec.split("=", 1)
    path, *figures = rest.split(":")
    report = json.loads(Path(path).read_text())
    tokens, steps = (int(f) for f in figures) if figures else (report["reply_tokens"], report["steps"])
    return {"head": label, "reply_tokens": tokens, "steps": steps, "machine": machine_text, "agreement": report["agreement"]}


def earlier(path: Path) -> list[dict]:
    """The rows of an earlier table (its OUT.json), each with the machine it was made on."""
    made = json.loads(path.read_text())
    return [{**r, "machine": r.get("machine", made["machine"])} for r in made["rows"]]


def markdown(rows: list[dict], command: str, machine_text: str) -> str:
    sets = list(rows[0]["agreement"])
    lines = [f"# A head's agreement against its distilled data ({machine_text})", "", f"`{command}`", "",
             "First-token agreement with the LLM's greedy continuations of the held-out requests (teacher-forced on "
             "its features; mean accepted length of a chain of 4 drafts in brackets)", "",
             "| head | reply tokens | steps | " + " | ".join(sets) + " | scored on |",
             "| --- | --- | --- | " + " | ".join("---" for _ in sets) + " | --- |"]
    for r in rows:
        cells = [f"{a['first_token']:.1%} ({a['chain4_mean']:.2f})" for a in (r["agreement"][s] for s in sets)]
        lines.append(f"| {r['head']} | {r['reply_tokens']:,} | {r['steps']:,} | " + " | ".join(cells)
                     + f" | {r['machine'].split(',')[0]} |")
    return "\n".join(lines) + "\n"


def head_of(row: dict) -> str:
    """The head a row is a checkpoint of: its label's first word ("head-1, quarter" -> "head-1")."""
    return row["head"].split()[0].rstrip(",")


def plot(rows: list[dict], path: Path, machine_text: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    heads = list(dict.fromkeys(head_of(r) for r in rows))  # a line per head (its data's checkpoints), a marker each
    for k, name in enumerate(rows[0]["agreement"]):
        for j, head in enumerate(heads):
            mine = [r for r in rows if head_of(r) == head]
            xs = [r["reply_tokens"] for r in mine]
            ys = [100 * r["agreement"][name]["first_token"] for r in mine]
            ax.plot(xs, ys, marker="osD^v"[j % 5], color=f"C{k}", label=f"{name}, {head}")
            for r, x, y in zip(mine, xs, ys):
                ax.annotate(r["head"], (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_xscale("log")
    save_panel(fig, ax, path, f"distilled data against agreement\n{machine_text}", "the LLM's reply tokens trained on",
               "first-token agreement, %", legend_size=7)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", action="append", required=True, help="LABEL=PATH[:REPLY_TOKENS:STEPS], repeatable")
    ap.add_argument("--earlier", type=Path, default=None, help="an earlier table's OUT.json: its rows first, as they were")
    ap.add_argument("--out", type=Path, required=True, help="write OUT.json, OUT.md and OUT.png")
    args = ap.parse_args(argv)
    command, machine_text = command_line("python -m specinfer_bench.head_volume", argv), machine()
    rows = (earlier(args.earlier) if args.earlier else []) + [load(spec, machine_text) for spec in args.report]
    text = markdown(rows, command, machine_text)
    write_record(args.out, {"command": command, "machine": machine_text, "rows": rows}, text)
    plot(rows, args.out.with_suffix(".png"), machine_text)
    print(text)


if __name__ == "__main__":
    main()
