"""Host work per forward: microseconds of Python preparation and staging (extending the caches,
laying the batch out, filling the bucket's buffer, sending it), excluding the model's own kernels.
On a GPU this is what the CPU must do before it can launch (or replay) a step, so it bounds the
step rate from below whatever the GPU's speed.

Rows: the verifier at batches 1, 8 and 64 with trees of 0, 16 and 64 nodes per request (each
request also brings its last bonus token), and one draft level at the same batches, the levels of
drafts that build 16-node trees (expansion <4, 3>: the root's row, then 4 nodes per request).
Steps go through the graph runner's padded buffers (mode "static": what a CUDA graph would be fed,
the default bucket sizes), or eagerly where no bucket fits. The weights do not matter to the host's
work; the tiny fixture pair keeps the run short.

On a GPU host the CPU only prepares and launches, so `host_us` is measured with the model's forward
replaced by zero logits of the right shape: one zero row, broadcast (the verdicts and drafts that
follow are then meaningless, which the host's work does not depend on). Broadcast, because on a GPU
the logits never pass through the host's memory: zeros filled anew each step (tens of MB at batch
64) evicted the host's caches and cost the next step's preparation up to 1.5x, which a GPU host
would not see. `host_us_after_forward` is the same work right after the model ran on this CPU: its
caches are cold then, which costs 3-5x here.

    python -m specinfer_bench.host --out bench/results/host_cpu
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specinfer.checkpoints import fixtures_dir
from specinfer.devices import resolve_device, resolve_dtype
from specinfer.graphs import GraphConfig, StepRunner
from specinfer.model import LlamaModel
from specinfer.speculator import Speculator
from specinfer.verifier import Verifier

from .ops import speculator_draft, verifier_step
from .report import command_line, machine, write_record

DRAFT_EXPANSION = [4, 3]  # 4 + 12 = 16 nodes


class Timed:
    """Wraps a runner's `prepare`: records its wall time and whether the step was padded to a bucket."""

    def __init__(self, runner: StepRunner):
        self.runner, self.prepare = runner, runner.prepare
        self.seconds: list[float] = []
        self.buckets: list[int | None] = []
        runner.prepare = self

    def __call__(self, items, ids=None):
        start = time.perf_counter()
        out = self.prepare(items, ids)
        self.seconds.append(time.perf_counter() - start)
        self.buckets.append(out[1].capacity.queries if out[1] is not None else None)
        return out

    def reset(self) -> None:
        self.seconds.clear()
        self.buckets.clear()


def skip_forward(model: LlamaModel):
    """Replace the model's forward (only the device's part) by zero logits, one row broadcast (no
    host memory traffic, as on a GPU); returns the undo."""
    row = torch.zeros(1, model.cfg.vocab_size, device=model.device)
    model.run = lambda step: row.expand(step.wanted.shape[0], -1)
    return lambda: delattr(model, "run")


def measure(step, timer: Timed, repeats: int) -> tuple[float, list]:
    """Median microseconds of `prepare` over `repeats` calls of step (after one warm-up), and the buckets used."""
    step()
    timer.reset()
    for _ in range(repeats):
        step()
    return statistics.median(timer.seconds) * 1e6, sorted(set(timer.buckets), key=lambda b: (b is None, b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--trees", default="0,16,64", help="verifier: nodes per request's tree")
    ap.add_argument("--repeats", type=int, default=30, help="steps timed per row (median reported)")
    ap.add_argument("--prompt-len", type=int, default=200, help="each request's context")
    ap.add_argument("--llm", type=Path, default=fixtures_dir() / "llm")
    ap.add_argument("--ssm", type=Path, default=fixtures_dir() / "ssm-0")
    ap.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: cuda when there is a GPU)")
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    graphs = GraphConfig(mode="static")  # a graph's padded inputs, without capturing (the forward is skipped)
    device = resolve_device(args.device)
    llm, ssm = (LlamaModel.from_pretrained(d, resolve_dtype("auto", device), device) for d in (args.llm, args.ssm))
    verifier, speculator = Verifier(llm, 1 << 18, graphs), Speculator(ssm, kv_tokens=1 << 18, graphs=graphs)
    v_timer, s_timer = Timed(verifier.run), Timed(speculator.run)
    batches, trees = [int(x) for x in args.batches.split(",")], [int(x) for x in args.trees.split(",")]
    rows = []
    with tqdm(total=2 * len(batches) * (len(trees) + 1), desc="host work per forward") as bar:
        for b in batches:
            cases = [("verify", t, lambda t=t: verifier_step(verifier, b, t, prompt_len=args.prompt_len), v_timer)
                     for t in trees]
            cases.append(("draft", 16, lambda: speculator_draft(speculator, b, DRAFT_EXPANSION,
                                                                prompt_len=args.prompt_len), s_timer))
            for role, nodes, make, timer in cases:
                figures = {}
                for key in ("host_us", "host_us_after_forward"):
                    undo = skip_forward(timer.runner.model) if key == "host_us" else lambda: None
                    us, used = measure(make(), timer, args.repeats)  # a draft: both its levels
                    undo()
                    figures[key] = round(us, 1)
                    bar.update()
                rows.append({"role": role, "batch": b, "tree_nodes": nodes, **figures, "buckets": used})
    meta = {"command": command_line("python -m specinfer_bench.host", argv), "machine": machine(), "device": str(device),
            "llm": str(args.llm), "ssm": str(args.ssm), "prompt_len": args.prompt_len, "repeats": args.repeats,
            "graphs": graphs.__dict__, "draft_expansion": DRAFT_EXPANSION}
    for r in rows:
        print(r)
    if args.out:
        lines = [f"`{meta['command']}` on {meta['machine']}, models on {device}", "",
                 "Host work per forward (extend the caches, lay out, stage, send), median microseconds of "
                 f"{args.repeats} forwards, requests with {args.prompt_len}-token contexts. Padded to the default "
                 "graph buckets (mode static) where one fits (bucket: its tokens), eager otherwise. A draft row is "
                 "every level of <4, 3> drafts (16-node trees).", "",
                 "host µs: the model's forward skipped, as on a GPU host; after forward: right after the model "
                 "ran on this CPU (cold caches).", "",
                 "| role | batch | tree nodes | host µs | after forward µs | bucket |",
                 "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['role']} | {r['batch']} | {r['tree_nodes']} | {r['host_us']:.0f} | "
                  f"{r['host_us_after_forward']:.0f} | "
                  f"{', '.join('eager' if u is None else str(u) for u in r['buckets'])} |" for r in rows]
        write_record(args.out, {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
