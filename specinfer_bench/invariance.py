"""Which operations of the verifier's forward pass give a row other bits by the shape of the step it is
in, on this CPU (issue 96, row-invariant verification): the probes a fix is designed from.

    python -m specinfer_bench.invariance --out bench/results/invariance_cpu

1. The model (float32): a position computed in a plain one-row step against the same position as a
   node of a tree step, as a row of a batch beside another request, and as a row of a prompt of 300
   rows; for each, the first operation whose output row differs, bit for bit, and the logits' largest
   difference.
2. PyTorch's x @ W (MKL on x86), A @ B with B row-major: whether row 0 of the product is the same
   bits for every row count M >= 2 (and for M = 1), for more columns, in a batched product, and
   whether the sum over k is a sequential chain: zeros appended to, or inserted among, the k terms
   leave it unchanged, up to which k.
3. oneDNN's product with a packed weight (`Dense`): row 0 for row counts 1-600.
4. Elementwise ops: whether an element gets other bits in the tail of a vectorized loop.
5. What row-invariant attention costs (SPECINFER_TREE_ATTENTION=invariant against the reference, back
   to back, best of 2): the default LLM's forward pass in the steps a CPU serves, and `specinfer generate`
   of the shipped general requests, speculation on and off with each attention, whose outputs must be
   identical with the invariant one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from specinfer import model as model_module
from specinfer.checkpoints import DEFAULT_LLM, checkpoint_dir
from specinfer.model import Dense, LlamaModel, StepInput
from specinfer_kernels.invariant import blas_keeps_rows

from .report import command_line, machine, write_record

OPS = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")


def recorded(model: LlamaModel, items: list[StepInput], row: int) -> list[tuple[str, torch.Tensor]]:
    """(operation, its output's row `row`) for every operation of a forward over `items`, in order; the
    logits last (row `row` of the LM head's rows)."""
    out: list[tuple[str, torch.Tensor]] = []
    hooks = [getattr(block, op).register_forward_hook(
        lambda _m, _i, o, name=f"layer {i} {op}": out.append((name, (o[0] if isinstance(o, tuple) else o)[row].clone())))
        for i, block in enumerate(model.layers) for op in OPS]
    original = model_module.tree_attention

    def attend(*args, **kw):
        o = original(*args, **kw)
        out.append((f"layer {sum(n.endswith('qkv') for n, _ in out) - 1} attention", o[row].clone()))
        return o

    model_module.tree_attention = attend
    try:
        logits = model(items)
    finally:
        model_module.tree_attention = original
        for h in hooks:
            h.remove()
    return out, logits


def first_difference(a, b) -> dict:
    (ops_a, logits_a), (ops_b, logits_b) = a, b
    first = next((na for (na, x), (_, y) in zip(ops_a, ops_b) if not torch.equal(x, y)), None)
    return {"first_differing_op": first, "logits_max_abs_diff": float((logits_a - logits_b).abs().max())}


def model_probe(model: LlamaModel, seed: int = 0) -> dict:
    """The position after a prompt of 37 tokens and a path of 3: plain decoding against the other shapes."""
    rng = random.Random(seed)
    V = model.cfg.vocab_size
    prompt, path = [rng.randrange(V) for _ in range(37)], [rng.randrange(V) for _ in range(4)]
    pool = model.new_pool(8192)

    def plain_last():
        c = pool.new_cache()
        model([StepInput(c, prompt, [], [])])
        for t in path[:-1]:
            model([StepInput(c, [t], [], [])])
        rows = recorded(model, [StepInput(c, [path[-1]], [], [])], 0)
        return rows[0], rows[1][0:1]

    plain = plain_last()
    toks, parents, prev = [], [], -1
    for t in path:  # each path node after two siblings, so that it sits at other rows and slots
        for _ in range(2):
            toks.append(rng.randrange(V))
            parents.append(prev)
        toks.append(t)
        parents.append(prev)
        prev = len(toks) - 1
    n = len(prompt) + len(toks)
    tree_ops, tree_logits = recorded(model, [StepInput(pool.new_cache(), prompt, toks, parents)], n - 1)
    tree = (tree_ops, tree_logits[len(toks): len(toks) + 1])
    c = pool.new_cache()
    model([StepInput(c, prompt + path[:-1], [], [])])
    other = pool.new_cache()
    model([StepInput(other, [rng.randrange(V) for _ in range(50)], [], [])])
    batch_ops, batch_logits = recorded(model, [StepInput(c, [path[-1]], [], []),
                                               StepInput(other, [rng.randrange(V)], toks[:6], parents[:6])], 0)
    batch = (batch_ops, batch_logits[0:1])
    long_prompt = prompt + path + [rng.randrange(V) for _ in range(300 - n)]
    chunk_ops, chunk_logits = recorded(model, [StepInput(pool.new_cache(), long_prompt, [], [], every_row=True)],
                                       len(prompt) + len(path) - 1)
    chunk = (chunk_ops, chunk_logits[len(prompt) + len(path) - 1: len(prompt) + len(path)])
    return {"tree node": first_difference(plain, tree), "beside another request": first_difference(plain, batch),
            "row of a 300-row prompt": first_difference(plain, chunk)}


@contextlib.contextmanager
def attention(name: str):
    """SPECINFER_TREE_ATTENTION=name inside the block."""
    old = os.environ.get("SPECINFER_TREE_ATTENTION")
    os.environ["SPECINFER_TREE_ATTENTION"] = name
    try:
        yield
    finally:
        os.environ.pop("SPECINFER_TREE_ATTENTION") if old is None else os.environ.update(SPECINFER_TREE_ATTENTION=old)


def invariant_probe(models: dict[str, LlamaModel]) -> dict:
    """`model_probe` with the invariant attention (where it refuses to run: why, for every case)."""
    if (broken := blas_keeps_rows("cpu", torch.float32)) is not None:
        case = {"first_differing_op": f"refused: {broken}", "logits_max_abs_diff": float("nan")}
        return {ref: dict.fromkeys(("tree node", "beside another request", "row of a 300-row prompt"), case) for ref in models}
    with attention("invariant"):
        return {ref: model_probe(m) for ref, m in models.items()}


def sequential_up_to(gen: torch.Generator, ks=(64, 128, 256, 384, 512, 768, 1024, 2048), n: int = 65) -> dict:
    """For each k: whether p @ v's row 0 keeps its bits with 100 zero terms appended, and with 32 zero
    terms inserted among its last 32 (a tree's non-ancestors among its ancestors)."""
    out = {}
    for k in ks:
        p, v = torch.rand(4, k, generator=gen), torch.randn(k, n, generator=gen)
        ref = (p @ v)[0]
        appended = torch.equal((torch.cat([p, p.new_zeros(4, 100)], 1) @ torch.cat([v, torch.randn(100, n, generator=gen)]))[0], ref)
        at = torch.cat([torch.arange(k - 32), k - 32 + 2 * torch.arange(32)])
        pz, vz = p.new_zeros(4, k + 32), torch.randn(k + 32, n, generator=gen)
        pz[:, at], vz[at] = p, v
        out[k] = {"zeros appended": appended, "zeros inserted": torch.equal((pz @ vz)[0], ref)}
    return out


def gemm_probe(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(300, 64, generator=gen), torch.randn(64, 512, generator=gen)
    ref = (a[:2] @ b)[0]
    batched_a, batched_b = torch.randn(5, 300, 64, generator=gen), torch.randn(5, 64, 512, generator=gen)
    batched_a[0, :2], batched_b[0] = a[:2], b
    return {
        "row 0 equal for every M in 2..300": all(torch.equal((a[:m] @ b)[0], ref) for m in range(2, 301)),
        "row 0 equal at M = 1": torch.equal((a[:1] @ b)[0], ref),
        "row 0 equal with more columns": torch.equal((a[:2] @ torch.cat([b, torch.randn(64, 77, generator=gen)], 1))[0, :512], ref),
        "row 0 equal in a batched product": all(torch.equal(torch.bmm(batched_a[:, :m], batched_b)[0, 0], ref) for m in (2, 3, 17, 64)),
        "A @ B^T (B^T a transposed view) row 0 equal for every M in 2..64":
            all(torch.equal((a[:m] @ b.t().contiguous().t())[0], (a[:2] @ b.t().contiguous().t())[0]) for m in range(2, 65)),
        "sum over k a sequential chain": sequential_up_to(gen),
    }


def dense_probe(model: LlamaModel, seed: int = 0) -> dict:
    """In the row-invariant mode (past the last row bucket: slices of it; by default x @ W, whose rows differ)."""
    dense: Dense = model.layers[0].down
    x = torch.randn(600, dense.weight.shape[0], generator=torch.Generator().manual_seed(seed))
    with attention("invariant"):
        return _dense_rows(dense, x)


def _dense_rows(dense: Dense, x: torch.Tensor) -> dict:
    alone = dense(x[:1])
    return {"packed": dense.packed is not None,
            "row counts (1..600) where row 0 differs from row 0 alone": [m for m in range(1, 601) if not torch.equal(dense(x[:m])[:1], alone)]}


def elementwise_probe(seed: int = 0) -> dict:
    """For each op: in how many of 600 runs of 31 elements (shorter than two vectors: all in the loop's
    tail) an element differs from the same element computed in a long tensor's vectorized part."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(seed)) * 6
    ops = {"exp": torch.exp, "silu": torch.nn.functional.silu, "rsqrt (of abs)": lambda t: torch.rsqrt(t.abs()),
           "cos": torch.cos, "sin": torch.sin, "sigmoid": torch.sigmoid}
    out = {}
    for name, f in ops.items():
        full = f(x)
        out[name] = sum(not torch.equal(f(x[i: i + 31].clone()), full[i: i + 31]) for i in range(0, 600 * 31, 31))
    return out


def steps(model: LlamaModel, rng: random.Random) -> dict:
    """Named forward passes of the shapes a CPU serves, each a function making one more such step."""
    V = model.cfg.vocab_size
    pool = model.new_pool(16384)
    tokens = lambda n: [rng.randrange(V) for _ in range(n)]  # noqa: E731

    def caches(n: int, lengths: tuple[int, int]):
        out = [pool.new_cache() for _ in range(n)]
        for c in out:
            model([StepInput(c, tokens(rng.randrange(*lengths)), [], [])])
        return out

    one, many = caches(1, (300, 301)), caches(32, (100, 200))
    tree16 = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11]

    def tree_step(cs, parents):
        out = model([StepInput(c, tokens(1), tokens(len(parents)), parents) for c in cs])
        for c in cs:
            c.commit([0])
        return out

    def prompt():
        c = pool.new_cache()
        model([StepInput(c, tokens(512), [], [])])
        c.release()

    return {"1 stream, plain step, context 300": lambda: model([StepInput(one[0], tokens(1), [], [])]),
            "1 stream, tree of 16, context 300": lambda: tree_step(one, tree16),
            "32 streams, plain step, contexts 100-200": lambda: model([StepInput(c, tokens(1), [], []) for c in many]),
            "32 streams, trees of 4, contexts 100-200": lambda: tree_step(many, [-1, 0, 0, 1]),
            "a prompt of 512 tokens": prompt}


def forward_cost(model: LlamaModel, repeats: int = 2) -> dict:
    """ms per forward pass of each of `steps`, reference and invariant attention back to back, best of `repeats`."""
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(repeats):
        for kind in ("reference", "invariant"):
            with attention(kind):
                for name, step in steps(model, random.Random(0)).items():
                    n = 6 if "prompt" in name else 16
                    step()
                    start = time.perf_counter()
                    for _ in range(n):
                        step()
                    times.setdefault(name, {}).setdefault(kind, []).append((time.perf_counter() - start) / n * 1e3)
    return {name: {a: round(min(t), 2) for a, t in by.items()} for name, by in times.items()}


def generate_cost(prompts: str, new_tokens: int, repeats: int = 2) -> dict:
    """`specinfer generate` of `prompts` (all at once), speculation on (the default) and off, with each
    attention, back to back: tok/s (best of `repeats`) and whether each pair's outputs are identical."""
    runs: dict[str, dict] = {}
    for _ in range(repeats):
        for kind in ("reference", "invariant"):
            for mode in ("tree", "incremental"):
                cmd = [sys.executable, "-m", "specinfer_cli", "generate", "--prompt-file", prompts, "--max-new-tokens",
                       str(new_tokens), "--json", "--mode", mode]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                      env={**os.environ, "SPECINFER_TREE_ATTENTION": kind})
                summary = [line for line in proc.stderr.splitlines() if " tok/s" in line][-1]
                tok_s = float(summary.split(" tok/s")[0].rsplit("(", 1)[1])
                run = runs.setdefault(f"{kind}, {mode}", {"tok_s": 0.0})
                run["tok_s"] = max(run["tok_s"], tok_s)
                run["outputs"] = [json.loads(line)["token_ids"] for line in proc.stdout.splitlines()]
    out = {k: {"tok_s": v["tok_s"]} for k, v in runs.items()}
    for kind in ("reference", "invariant"):
        on, off = runs[f"{kind}, tree"]["outputs"], runs[f"{kind}, incremental"]["outputs"]
        out[f"{kind}, tree"]["requests identical to off"] = f"{sum(a == b for a, b in zip(on, off))} / {len(on)}"
    return out


def markdown(report: dict) -> str:
    lines = [f"`{report['command']}` on {report['machine']}", "",
             "## The model: the first operation whose row differs from a plain one-row step, bit for bit", "",
             "| attention | LLM | the position computed as | first differing operation | logits' largest difference |",
             "| --- | --- | --- | --- | --- |"]
    for kind, key in (("reference", "model"), ("invariant", "model, invariant attention")):
        for llm, cases in report[key].items():
            for case, r in cases.items():
                lines.append(f"| {kind} | {llm} | {case} | {r['first_differing_op'] or 'none'} | "
                             f"{r['logits_max_abs_diff']:.2e} |")
    g = report["gemm"]
    lines += ["", "## x @ W (MKL), B row-major", "", "| property | holds |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in g.items() if not isinstance(v, dict)]
    lines += ["", "| k terms | zeros appended: same bits | zeros inserted: same bits |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v['zeros appended']} | {v['zeros inserted']} |" for k, v in g["sum over k a sequential chain"].items()]
    d = report["dense"]
    lines += ["", f"## Dense (oneDNN, packed: {d['packed']}), in the row-invariant mode", "",
              f"Row counts 1-600 where row 0 differs from row 0 alone: {d['row counts (1..600) where row 0 differs from row 0 alone'] or 'none'}",
              "", "## Elementwise: runs of 31 elements (a loop's tail) that differ from the vectorized part, of 600", "",
              "| op | runs differing |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in report["elementwise"].items()]
    if "forward_ms" in report:
        lines += ["", "## Cost: ms per forward pass of the default LLM (float32), best of 2, back to back", "",
                  "| step | reference | invariant | invariant / reference |", "| --- | --- | --- | --- |"]
        lines += [f"| {k} | {v['reference']} | {v['invariant']} | {v['invariant'] / v['reference']:.2f}x |"
                  for k, v in report["forward_ms"].items()]
        g = report["generate"]
        lines += ["", f"## Cost: `specinfer generate` of {g['prompts']} ({g['new_tokens']} new tokens, all requests at once), "
                  "best of 2", "", "| attention, mode | tok/s | requests identical to speculation off |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['tok_s']} | {v.get('requests identical to off', '')} |" for k, v in g["runs"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", action="append", default=None,
                    help="checkpoint to probe, repeatable (default: the fixture LLM and the default LLM)")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--cost", action="store_true", help="also time row-invariant attention against the reference")
    ap.add_argument("--prompts", default="models/smollm2/general_prompts.jsonl", help="for --cost's generate runs")
    ap.add_argument("--new-tokens", type=int, default=64, help="for --cost's generate runs")
    args = ap.parse_args(argv)
    llms = args.llm or ["models/fixtures/llm", "SmolLM2-135M-Instruct"]
    models = {ref: LlamaModel.from_pretrained(checkpoint_dir(ref)) for ref in llms}
    isa = ", ".join(f"{name}: {'yes' if f() else 'no'}" for name, f in (
        ("AVX-512", torch.cpu._is_avx512_supported), ("AMX", torch.cpu._is_amx_tile_supported)))
    report = {"command": command_line("python -m specinfer_bench.invariance", argv), "machine": f"{machine()} ({isa})",
              "model": {ref: model_probe(m) for ref, m in models.items()},
              "model, invariant attention": invariant_probe(models), "gemm": gemm_probe(),
              "dense": dense_probe(next(iter(models.values()))), "elementwise": elementwise_probe()}
    if args.cost:
        report["forward_ms"] = forward_cost(LlamaModel.from_pretrained(checkpoint_dir(DEFAULT_LLM)))
        report["generate"] = {"prompts": args.prompts, "new_tokens": args.new_tokens,
                              "runs": generate_cost(args.prompts, args.new_tokens)}
    text = markdown(report)
    print(text)
    if args.out:
        write_record(args.out, report, text)


if __name__ == "__main__":
    main()
