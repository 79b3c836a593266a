"""The model-parallel verifier's step latency and decode throughput against the single process.

For each layout (tp x pp) the verifier is built as the service builds it (rank 0 here, the other
ranks in their own processes), then timed on one prefill and on steady decoding steps: batch 1 and
8 of one new token each, and batch 1 with a 16-node tree. Tokens/s is requests x new tokens per
step / step time (the tree step's accepted tokens depend on the drafts, so it reports time only).

    python -m specinfer_bench.parallel --out bench/results/parallel_cpu
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specinfer.checkpoints import fixtures_dir
from specinfer.devices import resolve_device
from specinfer.kv_cache import POOL_TOKENS
from specinfer.model import LlamaModel
from specinfer.tree import TokenTree
from specinfer.verifier import Verifier, VerifyRequest
from verifier_svc.workers import ParallelVerifier

from .report import command_line, machine, median_ms, write_record

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def measure(verifier, prompt_len: int, repeats: int) -> dict:
    rng = random.Random(0)
    vocab = verifier.model.cfg.vocab_size
    out = {}
    for batch in (1, 8):
        ids = [f"b{batch}-{i}" for i in range(batch)]
        start = time.perf_counter()
        verifier.step([VerifyRequest(i, [rng.randrange(vocab) for _ in range(prompt_len)]) for i in ids])
        out[f"prefill_b{batch}_ms"] = 1e3 * (time.perf_counter() - start)
        out[f"decode_b{batch}_ms"] = median_ms(lambda: verifier.step([VerifyRequest(i, []) for i in ids]), repeats)
        out[f"decode_b{batch}_tok_s"] = batch * 1e3 / out[f"decode_b{batch}_ms"]
        if batch == 1:
            tree = TokenTree([rng.randrange(vocab) for _ in range(16)], [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
            out["tree16_b1_ms"] = median_ms(lambda: verifier.step([VerifyRequest(ids[0], [], tree)]), repeats)
        for i in ids:
            verifier.release(i)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specinfer_bench.parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/parallel"))
    p.add_argument("--llm", default=str(fixtures_dir() / "llm"),
                   help="LLM checkpoint (default: the fixture LLM; SmolLM2's 3 KV heads split over no tp > 1 but 3)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (and for the single process)")
    args = p.parse_args(argv)
    device = resolve_device("auto")
    torch.set_num_threads(args.threads)
    rows = []
    for tp, pp in tqdm(LAYOUTS, desc="layouts"):
        if tp * pp == 1:
            verifier = Verifier(LlamaModel.from_pretrained(args.llm, device=device))
        else:
            verifier = ParallelVerifier(args.llm, tp, pp, torch.float32, device, POOL_TOKENS, args.threads)
        rows.append({"tp": tp, "pp": pp, **measure(verifier, args.prompt_len, args.repeats)})
        if tp * pp > 1:
            verifier.close()
    meta = {"machine": machine(), "threads_per_rank": args.threads, "prompt_len": args.prompt_len, "llm": str(args.llm),
            "command": command_line("python -m specinfer_bench.parallel", argv)}
    base = rows[0]
    lines = [f"# Model-parallel verifier step: {meta['machine']}", "", f"Command: `{meta['command']}`", "",
             f"{args.threads} torch thread(s) per rank, prompt {args.prompt_len} tokens, float32, medians of "
             f"{args.repeats} steps.", "",
             "| tp | pp | ranks | prefill b1 ms | decode b1 ms | tok/s b1 | decode b8 ms | tok/s b8 | 16-node tree b1 ms | "
             "decode b8 vs single |", "|" + " --- |" * 10]
    for r in rows:
        lines.append(f"| {r['tp']} | {r['pp']} | {r['tp'] * r['pp']} | {r['prefill_b1_ms']:.1f} | {r['decode_b1_ms']:.2f} | "
                     f"{r['decode_b1_tok_s']:.0f} | {r['decode_b8_ms']:.2f} | {r['decode_b8_tok_s']:.0f} | "
                     f"{r['tree16_b1_ms']:.2f} | {base['decode_b8_ms'] / r['decode_b8_ms']:.2f}x |")
    write_record(args.out, {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
