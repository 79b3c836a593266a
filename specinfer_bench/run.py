"""`specinfer bench`: where we stand, measured side by side in one run.

On the held-out prompts with the default LLM and its drafters (or --llm/--ssm/--prompt-file), one request at a time:
transformers' incremental generate (the baseline), transformers' assisted generation with SSM 0
(at its default and at each fixed number of assistant tokens, the best one reported as such), and
ours in-process (incremental, sequence, tree configs and the tree-shape search's pick, alone and with
context lookup merged in, context lookup alone, merged SSMs),
greedy and at T=0.8; then ours through the services at several concurrencies with speculation on
and off. The tree-shape search runs first, on rank acceptance and step costs measured here. Every
greedy output is checked identical to transformers' incremental generate before any figure is
reported. Writes <out>.json, <out>.md and <out>.png.

    specinfer bench --quick                      # under a minute on a 2-core CPU
    specinfer bench --out bench/results/bench_cpu
    specinfer bench --search-tree                # only the tree-shape search
"""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

from specinfer.checkpoints import default_ssms, drafter_dirs, served_ssms
from specinfer.devices import resolve_device
from specinfer.generate import Mode
from specinfer.lookup import CHAIN_TOKENS
from specinfer.model import LlamaModel, read_draft_vocab
from specinfer.prompts import read_prompt_file
from specinfer.tree import tree_size

from . import inprocess, peers, tree_search
from .inprocess import load_prompt_ids
from .report import machine, plot_bench, services_markdown, single_markdown, summarize, write_record


def search_tree(llm_dir: Path, ssm_dir: Path, prompts: list[list[int]], continuations: list[list[int]],
                llm_hf=None, ssm_hf=None) -> dict:
    """Measure rank acceptance and costs, search the expansion configs."""
    llm_hf = llm_hf or peers.load(llm_dir)
    ssm_hf = ssm_hf or peers.load(ssm_dir)
    p = tree_search.rank_acceptance(llm_hf, ssm_hf, [a + b for a, b in zip(prompts, continuations)],
                                    [len(a) for a in prompts], vocab=read_draft_vocab(ssm_dir))
    cost = tree_search.measure_costs(LlamaModel.from_pretrained(llm_dir), LlamaModel.from_pretrained(ssm_dir), prompts[0])
    ranked = tree_search.search(p, cost)
    return {"rank_acceptance": p, "cost_model_ms": vars(cost), "best": ranked[0], "top": ranked[:8]}


def main(args) -> int:
    llm_dir = args.llm
    ssm_dirs = drafter_dirs(args.ssm, False, llm_dir, default_ssms)
    if not ssm_dirs:
        sys.exit("specinfer bench: no SSM: give --ssm (transformers' assisted generation and the tree configs draft "
                 "with one; the default LLM's, trained by scripts/train_models.py, serve only it)")
    n_prompts = args.prompts or (4 if args.quick else 16)
    max_new = args.max_new_tokens or (32 if args.quick else 64)
    levels = [int(c) for c in (args.concurrency or ("1,4" if args.quick else "1,4,16,32")).split(",")]
    prompts = load_prompt_ids(llm_dir, read_prompt_file(args.prompt_file))[:n_prompts]

    llm_hf, ssm_hf = peers.load(llm_dir), peers.load(ssm_dirs[0])
    reference, figures = peers.run(llm_hf, prompts, max_new, 0.0)
    if args.search_tree:
        found = search_tree(llm_dir, ssm_dirs[0], prompts, reference, llm_hf, ssm_hf)
        print_search(found)
        return 0

    single, base = [], {}
    def record(label, temperature, outs, figures, extra=None):
        if temperature == 0 and outs != reference:
            sys.exit(f"{label}: greedy outputs differ from transformers' incremental generate; no figures reported")
        row = summarize(label, temperature, figures, extra)
        base.setdefault(temperature, row["tokens_per_s"])
        row["speedup"] = row["tokens_per_s"] / base[temperature]
        single.append(row)

    llm, ssms = LlamaModel.from_pretrained(llm_dir), [LlamaModel.from_pretrained(d) for d in ssm_dirs]
    configs = [c for c in inprocess.CONFIGS if not args.quick or c[0] in inprocess.QUICK]
    found = search_tree(llm_dir, ssm_dirs[0], prompts, reference, llm_hf, ssm_hf)
    picked = found["best"]["expansion"]
    if picked:
        name = f"ours tree <{','.join(map(str, picked))}>"
        if not any(mode == Mode.TREE and e == picked and not lookup for _, mode, e, lookup in configs):
            configs.append((f"{name} (search's pick)", Mode.TREE, picked, False))
        configs.append((f"{name} + context lookup", Mode.TREE, picked, True))
    configs.append((f"ours context lookup alone <1x{CHAIN_TOKENS}>", Mode.SEQUENCE, [1] * CHAIN_TOKENS, None))
    ks = [2, 4] if args.quick else [1, 2, 3, 4, 6, 8]
    temperatures = [0.0] if args.quick else [0.0, 0.8]
    steps = len(temperatures) * (2 + len(ks) + len(configs))
    bar = tqdm(total=steps, unit="config", desc="one request at a time")
    for t in temperatures:
        outs, figures = (reference, figures) if t == 0 else peers.run(llm_hf, prompts, max_new, t)
        record("transformers generate", t, outs, figures)
        bar.update()
        outs, figures = peers.run(llm_hf, prompts, max_new, t, assistant=ssm_hf)
        record("transformers assisted (default)", t, outs, figures)
        bar.update()
        fixed = []
        for k in ks:
            outs, figures = peers.run(llm_hf, prompts, max_new, t, assistant=ssm_hf, num_assistant_tokens=k)
            fixed.append((summarize("", t, figures)["tokens_per_s"], k, outs, figures))
            bar.update()
        _, k, outs, figures = max(fixed, key=lambda f: f[0])
        record("transformers assisted (best fixed k)", t, outs, figures, {"assistant_tokens": k})
        ssm_hf.generation_config.num_assistant_tokens = None
        ssm_hf.generation_config.num_assistant_tokens_schedule = None
        for label, mode, expansion, lookup in configs:  # lookup None: context lookup alone, no SSM
            outs, figures = inprocess.run(llm, [] if lookup is None else ssms, mode, expansion, prompts, max_new, t,
                                          lookup is not False)
            extra = {"tree_nodes": tree_size(expansion)} if expansion else {}  # lookup alone: its chain
            if lookup:
                extra["lookup_tokens"] = CHAIN_TOKENS  # the chain's nodes come on top of the SSM's tree
            record(label, t, outs, figures, extra or None)
            bar.update()
    bar.close()

    services_rows, rounds = [], 1 if args.quick else 2
    if not args.no_services:
        from .services import default_config, measure

        default = default_config(resolve_device("auto").type)  # where the services put the verifier
        svc_configs = ["off", default] if args.quick else ["off", default, "2,1,1@64", "1,1,3,1,1,1,1,1@64@static"]
        short = [r[:32] for r in reference[:4]]
        services_rows = measure(llm_dir, drafter_dirs(args.ssm, False, llm_dir, served_ssms), prompts, short,
                                svc_configs, levels, requests_per_stream=2 if args.quick else 3,
                                max_new_tokens=max_new, rounds=rounds)
    for r in single:
        if (r["temperature"] == 0 and r["config"].startswith("ours") and "tree_nodes" in r and "merged" not in r["config"]
                and "lookup" not in r["config"]):  # the search's model knows SSM 0 alone
            expansion = next(e for label, _, e, _ in configs if label == r["config"])
            r["predicted_tokens_per_step"] = tree_search.expected_tokens_per_step(expansion, found["rank_acceptance"])

    result = {"command": "specinfer bench " + " ".join(sys.argv[2:]), "machine": machine(), "llm": str(llm_dir),
              "ssms": [str(d) for d in ssm_dirs], "dtype": "float32", "prompts": len(prompts),
              "max_new_tokens": max_new, "single": single, "services": services_rows, "services_rounds": rounds,
              "tree_search": found}
    text = markdown(result)
    write_record(args.out, result, text)
    plot_bench(result, args.out.with_suffix(".png"))
    print(text)
    return 0


def markdown(result: dict) -> str:
    lines = ["# specinfer bench", "", f"Command: `{result['command']}`  ", f"Machine: {result['machine']}  ",
             f"{result['prompts']} held-out prompts, {result['max_new_tokens']} new tokens each. Every greedy output "
             "was checked identical to transformers' incremental generate before these figures were written.", "",
             "## One request at a time (transformers serves one at a time)", "",
             "Tokens per LLM forward counts the prefill forward too, for every system alike.", ""]
    lines += single_markdown(result["single"])
    predicted = [r for r in result["single"] if "predicted_tokens_per_step" in r]
    if predicted:
        lines += ["", "Tree-search model check (greedy, prefill excluded from the prediction):", "",
                  "| config | predicted tokens/step | measured tokens/forward |", "| --- | --- | --- |"]
        lines += [f"| {r['config']} | {r['predicted_tokens_per_step']:.2f} | {r['tokens_per_step']:.2f} |" for r in predicted]
    if result["services"]:
        svc = services_markdown(result["services"], {"machine": result["machine"], "command": result["command"]},
                                result["max_new_tokens"], result["services_rounds"]).split("\n", 4)[4]
        lines += ["", "## Through the services", "", svc]
    found = result["tree_search"]
    lines += ["", "## Tree-shape search", "", "Rank acceptance p[r] (LLM's greedy token = SSM's r-th token): "
              + ", ".join(f"{x:.3f}" for x in found["rank_acceptance"]), "",
              f"Cost model (ms, batch 1; rows: ms): {cost_text(found['cost_model_ms'])}", "",
              "| expansion | expected tokens/step | modelled step ms | tokens per ms |", "| --- | --- | --- | --- |"]
    lines += [f"| {','.join(map(str, r['expansion'])) or 'none'} | {r['tokens_per_step']:.2f} | {r['step_ms']:.1f} "
              f"| {r['tokens_per_ms']:.3f} |" for r in found["top"]]
    return "\n".join(lines) + "\n"


def cost_text(cost: dict) -> str:
    return "; ".join(f"{part} " + ", ".join(f"{rows}: {ms:.2f}" for rows, ms in table.items())
                     for part, table in cost.items())


def print_search(found: dict) -> None:
    best = found["best"]
    print("rank acceptance:", ", ".join(f"{x:.3f}" for x in found["rank_acceptance"]))
    print("cost model (ms, rows: ms):", cost_text(found["cost_model_ms"]))
    for r in found["top"]:
        print(f"  {','.join(map(str, r['expansion'])) or 'none':<20} {r['tokens_per_step']:.2f} tokens/step  "
              f"{r['step_ms']:.1f} ms  {r['tokens_per_ms']:.3f} tokens/ms")
    expansion = ",".join(map(str, best["expansion"]))
    print(f"best expansion: {expansion or 'none (speculation does not pay here)'}")
    if expansion:
        print(f"use it: specinfer serve --manager-arg=--expansion={expansion}   (or SPECINFER_EXPANSION={expansion})")
