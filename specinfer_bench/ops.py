"""Host work per step: aten ops dispatched and host synchronizations per verifier step and per
speculator draft, at several batch sizes, on the shipped models (and, beside them, the step's
median wall time on this machine).

On a GPU every aten op is (at least) one kernel launch issued from Python, so ops per step is the
proxy for launch overhead that holds on any device, and it must not grow with the batch. A host
synchronization is an op that makes the host wait for the device: reading a tensor's values
(`.item()`, `.tolist()`, a copy to the CPU: `aten::_local_scalar_dense`, `aten::_to_copy` to the
CPU), or an op whose output size depends on values (`aten::nonzero`, boolean-mask indexing). On
the CPU they cost nothing, but they are counted the same way.

    python -m specinfer_bench.ops --out bench/results/ops_cpu
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specinfer.checkpoints import DEFAULT_LLM, served_ssms
from specinfer.model import LlamaModel
from specinfer.sampling import SamplingParams
from specinfer.speculator import DraftRequest, Speculator
from specinfer.tree import DraftGroup, TokenTree
from specinfer.verifier import Verifier, VerifyRequest

from .attention_cases import random_tree
from .report import command_line, machine, median_ms, write_record

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::resolve_neg")  # item(); value-sized outputs; tolist(), numpy()


def count(fn) -> tuple[int, int]:
    """(aten ops, host synchronizations) dispatched by one call of fn."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events() if e.name.startswith("aten::")]
    syncs = sum(n in SYNC_OPS for n in names)
    return len(names), syncs


def verifier_step(verifier: Verifier, batch: int, tree: int, temperature: float = 0.0, prompt_len: int = 32,
                  rng: random.Random | None = None, mss: bool = False):
    """A function that runs one verifier step over `batch` fresh requests (the verifier's earlier
    ones released; random `prompt_len`-token prompts, prefilled here), each with a tree of the same
    `tree`-node shape and fresh random tokens; trees for MSS (`mss`) get one draft group per node. Random
    drafts are almost never accepted: a step adds about one token per request."""
    rng = rng or random.Random(batch)
    vocab = verifier.model.cfg.vocab_size
    params = prefill(verifier, batch, temperature, prompt_len, rng, mss)
    shape = random_tree(random.Random(0), tree, 2).parents

    def step():
        trees = [TokenTree(rng.sample(range(vocab), len(shape)), shape) for _ in range(batch)]  # one node per path
        if params[0].sampled_drafts:
            for t in trees:
                t.groups = [DraftGroup(p, [tok], [1.0], [u], False) for u, (tok, p) in enumerate(zip(t.tokens, t.parents))]
        verifier.step([VerifyRequest(str(i), [], trees[i], params[i]) for i in range(batch)])
    return step


def prefill(verifier: Verifier, batch: int, temperature: float, prompt_len: int, rng: random.Random,
            mss: bool = False) -> list[SamplingParams]:
    """Release the verifier's requests and prefill `batch` fresh ones, "0", "1", ..., with random
    `prompt_len`-token prompts, sampled at `temperature` (seeded by index); their settings."""
    vocab = verifier.model.cfg.vocab_size
    for rid in list(verifier.caches):
        verifier.release(rid)
    params = [SamplingParams(temperature, seed=i, mss=mss) for i in range(batch)]
    verifier.step([VerifyRequest(str(i), [rng.randrange(vocab) for _ in range(prompt_len)], TokenTree(), params[i])
                   for i in range(batch)])
    return params


def speculator_draft(spec: Speculator, batch: int, expansion: list[int], temperature: float = 0.0,
                     prompt_len: int = 32, rng: random.Random | None = None, mss: bool = False):
    """A function that runs one draft of `expansion` trees for `batch` fresh requests (the
    speculator's earlier ones released), each told one new random token (their random
    `prompt_len`-token prompts are drafted from once here)."""
    rng = rng or random.Random(batch)
    vocab = spec.model.cfg.vocab_size
    for rid in list(spec.caches):
        spec.release(rid)
    params = [SamplingParams(temperature, seed=i, mss=mss) for i in range(batch)]
    spec.draft([DraftRequest(str(i), [rng.randrange(vocab) for _ in range(prompt_len)], expansion, params[i])
                for i in range(batch)])
    return lambda: spec.draft([DraftRequest(str(i), [rng.randrange(vocab)], expansion, params[i])
                               for i in range(batch)])


def measure(step, repeats: int) -> tuple[int, int, float]:
    """(aten ops, host synchronizations, median ms) of one step."""
    ops, syncs = count(step)
    return ops, syncs, median_ms(step, repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tree", type=int, default=8, help="verifier: nodes per request's tree")
    ap.add_argument("--expansion", default="2,1,1", help="speculator: expansion config")
    ap.add_argument("--repeats", type=int, default=10, help="steps timed per row (median reported)")
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    ap.add_argument("--llm", default=DEFAULT_LLM, help="LLM checkpoint (default: %(default)s)")
    ap.add_argument("--ssm", default=next(iter(served_ssms()), None), help="SSM checkpoint (default: the served SSM)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    llm = LlamaModel.from_pretrained(args.llm)
    ssm = LlamaModel.from_pretrained(args.ssm)
    expansion = [int(k) for k in args.expansion.split(",")]
    rows = []
    for temperature, mss in ((0.0, False), (0.8, False), (0.8, True)):  # greedy, coupled matching, MSS
        for b in [int(x) for x in args.batches.split(",")]:
            v_ops, v_syncs, v_ms = measure(verifier_step(Verifier(llm), b, args.tree, temperature, mss=mss), args.repeats)
            s_ops, s_syncs, s_ms = measure(speculator_draft(Speculator(ssm), b, expansion, temperature, mss=mss),
                                           args.repeats)
            rows.append({"temperature": temperature, "mss": mss, "batch": b, "verifier_ops": v_ops, "verifier_syncs": v_syncs,
                         "verifier_ms": v_ms, "speculator_ops": s_ops, "speculator_syncs": s_syncs,
                         "speculator_ms": s_ms})
            print(rows[-1], flush=True)
    meta = {"command": command_line("python -m specinfer_bench.ops", argv), "machine": machine(),
            "tree": args.tree, "expansion": expansion}
    if args.out:
        lines = [f"`{meta['command']}` on {meta['machine']}", "",
                 f"Verifier step: {args.tree}-node trees; speculator: one <{args.expansion}> draft per request.", "",
                 "Times are medians of wall time on this machine (noisy; the counts are exact).", "",
                 "T=0.8 rows: coupled matching over top-k drafts led by the guess of the coupled sample (the default), and MSS over sampled drafts.", "",
                 ("| T | rule | batch | verifier ops | verifier syncs | verifier ms | speculator ops "
                  "| speculator syncs | speculator ms |"),
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        rule = lambda r: "greedy" if not r["temperature"] else "MSS" if r["mss"] else "coupled"
        lines += [f"| {r['temperature']:g} | {rule(r)} | {r['batch']} | {r['verifier_ops']} | {r['verifier_syncs']} | "
                  f"{r['verifier_ms']:.2f} | {r['speculator_ops']} | {r['speculator_syncs']} | {r['speculator_ms']:.2f} |"
                  for r in rows]
        write_record(args.out, {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
