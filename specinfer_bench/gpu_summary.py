"""The figures a GPU run brings back, a line or two per part, against the goals of its issue: what the
bench/gpu_*.sh scripts print at the end (bench/gpu_lib.sh's `say`), so that a 15-minute lease ends
with a screen that says what passed and what it measured.

    python -m specinfer_bench.gpu_summary runtime WORK/runtime_h100.json
    python -m specinfer_bench.gpu_summary tests WORK/tests.log
    python -m specinfer_bench.gpu_summary sweep WORK/kernel_sweep_h100.json
    python -m specinfer_bench.gpu_summary services WORK/services_h100.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def tests(log: Path) -> list[str]:
    """pytest's last line, and the first failure's name."""
    text = log.read_text(errors="replace")
    last = next((line for line in reversed(text.splitlines()) if re.search(r"\b(passed|failed|error|skipped)\b", line)),
                "no pytest result line")
    first = re.search(r"^(FAILED|ERROR) (\S+)", text, re.M)
    return [f"tests: {last.strip(' =')}" + (f"; first failure: {first.group(2)}" if first else "")]


def runtime(path: Path) -> list[str]:
    """Per model: the one-token step at batch 1 (eager, graphed, GPU busy) and each tree's step against it
    (issue 59: the 1B-class step at most 3 ms with the GPU >= 70% busy, a 64-node tree at most 1.2x)."""
    result = json.loads(path.read_text())
    g = result["meta"]["graphed"]
    busy = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
    lines = []
    for model, temperature in dict.fromkeys((r["model"], r.get("temperature", 0)) for r in result["rows"]):
        rows = {(r["batch"], r["tree"]): r for r in result["rows"]
                if (r["model"], r.get("temperature", 0)) == (model, temperature)}
        label = f"{model} T={temperature:g}" if temperature else model
        for batch in sorted({b for b, _ in rows}):
            base = rows.get((batch, 0))
            if base is None:
                continue
            trees = ", ".join(f"{t}: {rows[batch, t][g]['step_ms'] / base[g]['step_ms']:.2f}x"
                              for t in sorted(t for b, t in rows if b == batch and t))
            lines.append(f"runtime {label} batch {batch}: one token {base['eager']['step_ms']:.2f} ms eager, "
                         f"{base[g]['step_ms']:.2f} ms {g} (busy {busy(base['eager']['gpu_busy'])} / "
                         f"{busy(base[g]['gpu_busy'])}, launches {base['eager']['launches']} / {base[g]['launches']})"
                         + (f"; trees vs one token ({g}): {trees}" if trees else ""))
            if chained := base.get("chained"):
                lines.append(f"  one-token steps begun behind each other ({g}): {chained['step_ms']:.2f} ms a step "
                             f"(busy {busy(chained['gpu_busy'])})")
            if split := base[g].get("gpu_idle_ms"):
                lines.append(f"  idle in its one-token step ({g}): " + ", ".join(f"{k} {v:.2f} ms" for k, v in split.items()))
            largest = max((t for b, t in rows if b == batch), default=0)
            if largest and base[g].get("top_kernels") and rows[batch, largest][g].get("top_kernels"):
                before = {name: ms for name, _, ms in base[g]["top_kernels"]}
                grew = sorted(((ms - before.get(name, 0.0), name) for name, _, ms in rows[batch, largest][g]["top_kernels"]),
                              reverse=True)[:3]
                lines.append(f"  what its {largest}-node tree adds ({g}, costliest kernels): "
                             + ", ".join(f"{name[:48]} +{d:.3f} ms" for d, name in grew))
    return lines


def host(path: Path) -> list[str]:
    """Host microseconds per forward, by role, batch and tree."""
    rows = json.loads(path.read_text())["rows"]
    return ["host us per forward: " + ", ".join(f"{r['role']} b{r['batch']} t{r['tree_nodes']} {r['host_us']:.0f}"
                                                for r in rows)]


def kernel(path: Path) -> list[str]:
    """The kernel against SDPA with the tree mask (issue 62: >= 1.0x in every cell, >= 60% of HBM peak where
    prefix >= 2048 and batch >= 8), and the verifier step's tree cost."""
    result = json.loads(path.read_text())
    cells = [r for r in result["attention"] if "kernel_vs_sdpa" in r]
    lines = []
    if not cells:
        lines.append(f"kernel: not timed ({result['meta']['note'] or 'no kernel rows'})")
    else:
        checked = [r for r in cells if "kernel_right" in r]  # (records before 2026-11-29 did not check)
        wrong = [r for r in checked if not r["kernel_right"]]
        if checked:
            lines.append(f"kernel = reference in {len(checked) - len(wrong)} of {len(checked)} cells" + "".join(
                f"; WRONG at prefix {r['prefix']}, tree {r['tree']}, batch {r['batch']} (max error {r['kernel_max_error']:.2g})"
                for r in wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""))
        worst = min(cells, key=lambda r: r["kernel_vs_sdpa"])
        name = " ".join(filter(None, ["kernel", result["meta"].get("config")]))
        lines.append(f"{name} vs SDPA+mask: >= 1.0x in {sum(r['kernel_vs_sdpa'] >= 1 for r in cells)} of {len(cells)} "
                     f"cells, worst {worst['kernel_vs_sdpa']:.2f}x (prefix {worst['prefix']}, tree {worst['tree']}, "
                     f"batch {worst['batch']}), best {max(r['kernel_vs_sdpa'] for r in cells):.2f}x")
        big = [r for r in cells if r["prefix"] >= 2048 and r["batch"] >= 8 and "kernel_peak_fraction" in r]
        if big:
            lines.append(f"kernel HBM share (prefix >= 2048, batch >= 8): {min(r['kernel_peak_fraction'] for r in big):.0%}"
                         f" to {max(r['kernel_peak_fraction'] for r in big):.0%} of peak")
    for batch in sorted({r["batch"] for r in result["verifier"]}):
        lines.append(f"verifier step batch {batch} vs one token: " + ", ".join(
            f"{r['tree']}: {r['vs_one_token']:.2f}x" for r in result["verifier"] if r["batch"] == batch and r["tree"]))
    return lines


def per_kernel(resources: dict, key: str) -> str:
    """A sweep record's most `key` (n_regs, n_spills, shared) as 'prefix/tree' kernel, shared memory in
    KiB, - where unknown (the interpreter compiles nothing; a direct launch has no tree kernel)."""
    return "/".join("-" if resources.get(k, {}).get(key) is None else
                    f"{resources[k][key] / 1024:.0f}" if key == "shared" else str(resources[k][key])
                    for k in ("prefix", "tree"))


def sweep(path: Path, most: int = 12) -> list[str]:
    """specinfer_bench.kernel_sweep's configurations, best first (at most `most`): cells won against SDPA,
    worst and best ratio, registers, spills and shared memory (prefix/tree kernel); the best one named."""
    result = json.loads(path.read_text())
    meta, records = result["meta"], result["configs"]
    lines = [f"sweep: {len(records)} configs on {len(result['cells'])} cells in {meta['elapsed_s']:.0f} s "
             f"({meta['stopped']}); best: {meta['best'] or 'none'} (default {meta['default']})"]
    for r in records[:most]:
        # "wrong", or "failed: " and the error's type
        bad = sorted({": ".join(c["status"].split(": ")[:2]) for c in r["cells"] if c["status"] != "ok"})
        ratios = f", worst {r['worst']:.2f}x, best {r['best']:.2f}x" if "worst" in r else ""
        ratios += f", HBM >= {r['hbm_share']:.0%}" if "hbm_share" in r else ""
        res = r["resources"]
        lines.append(f"  {r['config']}: {r['wins']}/{len(result['cells'])} >= 1.0x{ratios}; regs {per_kernel(res, 'n_regs')}, "
                     f"spills {per_kernel(res, 'n_spills')}, shared {per_kernel(res, 'shared')} KiB"
                     + (f"; {', '.join(bad)}" if bad else "" if r["complete"] else "; cut by the budget"))
    if len(records) > most:
        lines.append(f"  (+{len(records) - most} more in the JSON)")
    return lines


def divergence(path: Path) -> list[str]:
    """Per dtype (and attention, where several ran): the share of greedy tokens with speculation equal to
    those without, and tokens/s without and with it."""
    summary = json.loads(path.read_text())["summary"]
    return ["divergence: " + "; ".join(f"{d} {s['identical_share']:.1%} of tokens identical, {s['identical_prompts']} of "
                                       f"{s['prompts']} prompts whole, {s.get('plain_tok_s')} / "
                                       f"{s.get('speculative_tok_s')} tok/s off / on" for d, s in summary.items())]


GOALS = {"vs_off_1": 2.5, "vs_off_64": 1.2, "vs_in_process_1": 1.1}  # issue 95's, on a 7B-class LLM


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def split_cells(r: dict, who: str) -> str:
    """An iteration's split (specinfer.engine.split) as table cells: the whole, the verifier's own step and
    its hop, the slowest drafter's own time and the drafters' hop, the engine's own work ("-" for what
    a record from before the waits were kept does not have)."""
    g = lambda k: r.get(f"{who}_{k}")  # noqa: E731
    hop = lambda wait, own: None if g(wait) is None else g(wait) - g(own)  # noqa: E731
    return " | ".join("-" if v is None else f"{v:.1f}" for v in (
        g("ms_per_iteration"), g("verify_ms"), hop("verify_wait_ms", "verify_ms"), g("draft_ms"),
        hop("draft_wait_ms", "draft_ms"), g("own_ms")))


def streams(where: str, at: dict[str, dict], c: int, split: str) -> str:
    """One stream count's line: off's tok/s, every other setting against it (against the goals through
    the services, at 1 and 64 streams) and its tokens per step, and each setting's ms per iteration
    (split_cells): the whole, the verifier's step and its hop, the slowest speculator's and the
    speculators' hop, the manager's (engine's) own."""
    off, goal = at.get("off"), GOALS.get(f"vs_off_{c}") if where == "services" else None
    figures = []
    if off:
        figures.append(f"off {off['tokens_per_s']:.1f} tok/s")
        for config, r in at.items():
            vs = r["tokens_per_s"] / off["tokens_per_s"]
            if config != "off":
                control = {"sequential", "ahead"} & set(config.split("@"))  # off or on with steps ahead: no goal
                figures.append(f"{config} {r['tokens_per_s']:.1f} = {vs:.2f}x off"
                               + (f" at {r['tokens_per_step']:.2f} tok/step" if r.get("tokens_per_step") else "")
                               + (f" (goal >= {goal}x: {met(vs >= goal)})" if goal and not control else ""))
    parts = "; ".join(f"{config} {split_cells(r, split).replace(' | ', '/')}" for config, r in at.items())
    behind = ", ".join(f"{config} {r['verifier_begun_behind']:.0f}" for config, r in at.items() if "verifier_begun_behind" in r)
    return (f"  {where} {c} stream{'s' * (c > 1)}: " + ", ".join(figures)
            + f"; ms per iteration all/verifier/its hop/speculator/its hop/{split} own: {parts}"
            + (f"; verifier steps begun behind the running one, per run: {behind}" if behind else ""))


def predrafts(where: str, at: dict[str, dict], c: int, who: str) -> str | None:
    """One stream count's drafting during verification: per setting that drafted ahead, the share of request
    steps drafted ahead for that hit, and (through the services) the verifier's mean idle ms between two
    steps of a request by what the next step was; None where no setting drafted ahead."""
    cells = []
    for config, r in at.items():
        hits, misses = r.get(f"{who}_predraft_hits", 0), r.get(f"{who}_predraft_misses", 0)
        if hits + misses:
            idle = r.get("verifier_idle_ms", {})
            cells.append(f"{config} {hits / (hits + misses):.0%} of {hits + misses:.0f} hit"
                         + (" (verifier idle ms " + ", ".join(f"{k} {v:.2f}" for k, v in idle.items()) + ")" if idle else ""))
    return f"  {where} {c} stream{'s' * (c > 1)}, drafted ahead: " + "; ".join(cells) if cells else None


def controller(row: dict) -> str:
    """A manager's adaptive controller at its load's own batch size (else the one it ran most): how often it
    made each choice, what it predicted each would give (why the load ran with the trees it did), and what
    each choice it ran there gave."""
    at = row["manager_controller"]
    b = str(row["concurrency"])
    if b not in at:
        b = max(at, key=lambda k: sum(at[k]["chosen"].values()))
    chosen = ", ".join(f"{c} x{n}" for c, n in at[b]["chosen"].items())
    gave = at[b].get("realized_tok_s", {})  # (logs before it was kept have none)
    predicted = ", ".join(f"{c} {r:.0f}" + (f" (gave {gave[c]:.0f})" if c in gave else "")
                          for c, r in at[b]["predicted_tok_s"].items())
    return (f"  controller, {row['config']} at {row['concurrency']} streams, batch {b}: chose {chosen}; "
            f"predicted tok/s {predicted}")


def services(path: Path) -> list[str]:
    """Through the services (specinfer_bench.services --in-process): per stream count speculation off and
    the manager's default against it, through the services and in process, the services against in
    process at one stream (what the hops cost), and the greedy check (GOALS: issue 95's, greedy), and where a setting drafted ahead, its hit rate and the verifier's idle time."""
    result = json.loads(path.read_text())
    rows, inproc = result.get("rows", []), result.get("in_process", [])
    lines = [f"services: {result['dtype']}, the manager's default {result['default_config']}, "
             f"{result['max_new_tokens']} new tokens x {result['requests_per_stream']} requests per stream"
             + ("" if result.get("ignore_eos", True) else " (at most: natural stops)")
             + ("" if rows else "; no services rows (see services.log)")]
    for where, mine, split in (("services", rows, "manager"), ("in process", inproc, "engine")):
        for c in sorted({r["concurrency"] for r in mine}):
            at = {r["config"]: r for r in mine if r["concurrency"] == c}
            lines += [line for line in (streams(where, at, c, split), predrafts(where, at, c, split)) if line]
    lines += [controller(r) for r in rows if r.get("manager_controller")]
    by = {(r["config"], r["concurrency"]): r["tokens_per_s"] for r in rows}
    hops = [(r["config"], by[r["config"], 1] / r["tokens_per_s"]) for r in inproc if (r["config"], r["concurrency"]) in by
            and r["concurrency"] == 1]
    if hops:
        goal = GOALS["vs_in_process_1"]
        lines.append("  services / in process at 1 stream: " + ", ".join(
            f"{config} {x:.2f}x (goal >= {goal}x: {met(x >= goal)})" for config, x in hops))
    checked = [(where, r) for where, mine in (("services", rows), ("in process", inproc)) for r in mine
               if r["concurrency"] == mine[0]["concurrency"]]
    if checked:
        check = result["greedy_check"]
        lines.append(f"  greedy vs off ({result['dtype']}, {check['prompts']} prompts x {check['tokens']} tokens), "
                     "share of identical tokens: "
                     + ", ".join(f"{where} {r['config']} {r['identical_share']:.1%}" for where, r in checked))
    return lines


PARTS = {"tests": tests, "runtime": runtime, "host": host, "kernel": kernel, "sweep": sweep, "divergence": divergence,
         "services": services}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in PARTS:
        print(f"usage: python -m specinfer_bench.gpu_summary {{{','.join(PARTS)}}} PATH", file=sys.stderr)
        return 2
    path = Path(argv[1])
    if not path.exists():
        print(f"{argv[0]}: no result ({path.name} missing)")
        return 0
    for line in PARTS[argv[0]](path):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
