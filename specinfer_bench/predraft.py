"""How often drafting during verification hits (issue 95): in process, the default LLM and its SSM (or head) on
a fixed tree, greedy, each kind of held-out request (code prompts, chat requests, general requests) decoded with the
drafter drafting ahead for N outcomes of each step, N = 0 (drafting after each verdict) and the N given: the
share of request steps whose tree was drafted ahead for the outcome the step before emitted (with two drafters: by
both, and by either, whose tree a step sent before the outcome takes), tokens per step,
and whether the tokens are those of N = 0 (they must be), with a plot of the hit rate against N. In process the drafter shares the verifier's
device, so time is not what this measures: through the services, `python -m specinfer_bench.services
--configs '...@predraft'`. A head drafts ahead from its own outputs where the LLM's features of the accepted path
are not known yet, so its trees drafted ahead are not those it drafts after the verdict: tokens per step against
N = 0 say what that costs it.

    python -m specinfer_bench.predraft --out bench/results/predraft_hits_cpu
    python -m specinfer_bench.predraft --drafter head --out bench/results/predraft_head_cpu
    python -m specinfer_bench.predraft --drafter both --out bench/results/predraft_both_cpu
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM, default_heads, default_heldout, default_ssms
from specinfer.eagle import EagleHead
from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel
from specinfer.prompts import read_prompt_file

from .inprocess import load_prompt_ids
from .report import _plt, command_line, machine, save_panel, write_record

HIT_GOAL = 0.6  # issue 95's hit rate on code and chat


def kinds() -> dict[str, list[dict]]:
    """The default LLM's held-out requests by kind."""
    code_chat, general = (read_prompt_file(f) for f in default_heldout())
    return {"code": [r for r in code_chat if "prompt" in r], "chat": [r for r in code_chat if "messages" in r],
            "general": general}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outcomes", default="1,2,4,8", help="N: outcomes drafted ahead per step, comma-separated")
    ap.add_argument("--expansion", default="2,1,1")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", choices=["ssm", "head", "both"], default="ssm",
                    help="SSM 0, the shipped head alone, or both (the manager's default drafters)")
    ap.add_argument("--out", type=Path, required=True, help="write OUT.json, OUT.md and OUT.png")
    args = ap.parse_args(argv)
    both = args.drafter == "both"
    llm = LlamaModel.from_pretrained(DEFAULT_LLM)
    path = default_heads()[0]
    ssms = [LlamaModel.from_pretrained(default_ssms()[0])] if args.drafter != "head" else []
    heads = [EagleHead.from_pretrained(path, llm.cfg, llm.embed.weight)] if args.drafter != "ssm" else []
    drafters = {"ssms": ssms, "heads": heads}
    name = {"ssm": "SSM 0", "head": path.name, "both": f"SSM 0 and {path.name}"}[args.drafter]
    expansion, outcomes = [int(k) for k in args.expansion.split(",")], [int(n) for n in args.outcomes.split(",")]
    rows = []
    for kind, records in tqdm(kinds().items(), desc="kinds"):
        requests = [Request(p, args.max_new_tokens) for p in load_prompt_ids(DEFAULT_LLM, records)]
        reference = None
        for n in [0, *outcomes]:
            engine = Engine(llm, mode=Mode.TREE, expansion=expansion, draft_ahead=n, **drafters)
            gens = engine.generate(requests)
            tokens = [g.token_ids for g in gens]
            reference = reference or tokens
            stats = engine.engine.stats
            tried = stats.predraft_hits + stats.predraft_misses
            rows.append({"kind": kind, "requests": len(requests), "outcomes": n, "hits": stats.predraft_hits,
                         "drafted_ahead_steps": tried, "hit_rate": round(stats.predraft_hits / tried, 3) if tried else None,
                         "either_rate": (round((stats.predraft_hits + stats.predraft_partial) / tried, 3)
                                         if tried and both else None),
                         "tokens_per_step": round(sum(map(len, tokens)) / sum(g.steps for g in gens), 3),
                         "tokens_as_without": tokens == reference})
    command = command_line("python -m specinfer_bench.predraft", argv)
    lines = [f"# Drafting during verification: hits in process ({machine()})", "", f"`{command}`", "",
             f"SmolLM2 and {name}, tree {args.expansion} every step (no controller, no context lookup), greedy, "
             f"{args.max_new_tokens} new tokens; a hit: the step's tree was drafted ahead for the outcome of the "
             "step before" + (" by both drafters (either: by one of them at least, the tree a step sent before the "
                              "outcome takes)" if both else "")
             + "; steps drafted ahead for: those after a step with a tree (not a request's first)", "",
             "| requests | outcomes drafted ahead | hit rate | " + ("either's | " if both else "")
             + "hits / steps drafted ahead for | tokens per step | tokens as drafting after each verdict |",
             "| --- " * (7 if both else 6) + "|"]
    percent = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    for r in rows:
        either = f"{percent(r['either_rate'])} | " if both else ""
        lines.append(f"| {r['kind']} ({r['requests']}) | {r['outcomes']} | {percent(r['hit_rate'])} | {either}{r['hits']} / "
                     f"{r['drafted_ahead_steps']} | {r['tokens_per_step']:.2f} | {'yes' if r['tokens_as_without'] else 'NO'} |")
    write_record(args.out, {"command": command, "machine": machine(), "rows": rows}, "\n".join(lines) + "\n")
    plot(rows, args.out.with_suffix(".png"), f"{name}, {machine()}")
    print("\n".join(lines))


def plot(rows: list[dict], path: Path, machine_text: str) -> None:
    """The hit rate against the outcomes drafted ahead per step, a line per kind of request."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind and r["hit_rate"] is not None]
        line, = ax.plot([r["outcomes"] for r in mine], [100 * r["hit_rate"] for r in mine], marker="o", label=kind)
        if mine and mine[0]["either_rate"] is not None:
            ax.plot([r["outcomes"] for r in mine], [100 * r["either_rate"] for r in mine], marker="o", linestyle=":",
                    color=line.get_color(), label=f"{kind}: either drafter's tree")
    ax.axhline(100 * HIT_GOAL, linestyle="--", color="grey", linewidth=1, label="issue 95's goal (code, chat)")
    ax.set_xscale("log", base=2)
    save_panel(fig, ax, path, f"drafting during verification: hit rate\n{machine_text}", "outcomes drafted ahead per step",
               "steps whose tree was drafted ahead, %")


if __name__ == "__main__":
    main()
