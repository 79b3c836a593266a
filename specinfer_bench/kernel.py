"""Tree attention and the verifier step, timed side by side in one run.

1. Attention over a paged KV cache for a ragged batch of trees: our Triton kernel, its PyTorch
   reference (per request: gather pages, SDPA with the tree mask), and PyTorch
   scaled_dot_product_attention on a padded contiguous batch with an explicit boolean mask (what
   one does without a paged tree kernel). Grid: prefix length x tree size x batch size, Llama-3-8B
   attention shapes (32 query heads, 8 KV heads, head dim 128). Reports time and the bandwidth
   achieved on the KV reads against the card's peak.
2. One verifier step (tree attention, verification and all) of a Llama-shaped model with random
   weights (`--model 1b`: 1.2B parameters, Llama-3.2-1B's shape) or the shipped LLM, against tree
   size at several batch sizes, relative to a one-token step.

On CUDA everything runs natively: the kernel and SDPA timed from CUDA graphs, as the runtime runs
attention (`timed_ms`), the reference (which waits on the device) and the verifier step call by call.
Without a GPU the kernel would only run in Triton's interpreter, which says nothing about speed, so
the CPU run times the reference and SDPA on a small grid and the verifier step on the shipped LLM,
and says so.

    python -m specinfer_bench.kernel --out bench/results/kernel_h200            # on a GPU
    python -m specinfer_bench.kernel --out bench/results/kernel_cpu             # CPU: small grid

The kernel runs in its default configuration, or in the one SPECINFER_TREE_ATTENTION_CONFIG names
(a `TileConfig` label, recorded in the results; `specinfer_bench.kernel_sweep` searches them);
`--no-verifier` leaves part 2 out.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from tqdm import tqdm

from specinfer.checkpoints import DEFAULT_LLM
from specinfer.model import LlamaModel, ModelConfig
from specinfer.tree import TokenTree
from specinfer.verifier import Verifier, VerifyRequest
from specinfer_kernels import tree_attention_reference

from .attention_cases import attention_case, card_peak_gbps, kv_bytes, random_tree, sdpa_ms, timed_ms
from .report import _plt, command_line, machine, write_record

GPU_GRID = dict(prefix=[512, 2048, 8192, 16384], tree=[1, 16, 64, 256], batch=[1, 8, 64])
CPU_GRID = dict(prefix=[512, 2048], tree=[1, 16, 64], batch=[1, 8])
LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                       attention_bias=False, output_bias=False, tie_word_embeddings=True,
                       max_position_embeddings=131072, eos_token_ids=())


def grid_cells(grid: dict) -> list[tuple[int, int, int]]:
    return [(p, t, b) for p in grid["prefix"] for t in grid["tree"] for b in grid["batch"]]


def bench_attention(grid: dict, dtype, device, peak: float | None) -> list[dict]:
    cuda = device.type == "cuda"
    rows = []
    for prefix, tree, batch in tqdm(grid_cells(grid), desc="attention"):
        q, k, v, tb = attention_case(prefix, tree, batch, dtype, device)
        row = {"prefix": prefix, "tree": tree, "batch": batch,
               "reference_ms": timed_ms(lambda: tree_attention_reference(q, k, v, tb), cuda),
               "sdpa_mask_ms": sdpa_ms(q, k, v, tb, cuda)}
        if cuda:
            from specinfer_kernels.tree_attention_triton import TOLERANCE, tree_attention_triton
            # checked before it is timed: a fast wrong kernel is no figure (NaN is wrong too)
            error = (tree_attention_triton(q, k, v, tb).float() - tree_attention_reference(q, k, v, tb).float()).abs().max()
            row["kernel_max_error"] = error.item()
            row["kernel_right"] = row["kernel_max_error"] <= TOLERANCE[dtype]
            row["kernel_ms"] = timed_ms(lambda: tree_attention_triton(q, k, v, tb), cuda, graph=True)
            row["kernel_gbps"] = kv_bytes(k, tb) / row["kernel_ms"] / 1e6
            if peak:
                row["kernel_peak_fraction"] = row["kernel_gbps"] / peak
            row["kernel_vs_sdpa"] = row["sdpa_mask_ms"] / row["kernel_ms"]
        rows.append(row)
    return rows


def random_model(cfg: ModelConfig, dtype, device) -> LlamaModel:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(cfg).to(dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def bench_verifier(model: LlamaModel, trees: list[int], batches: list[int], prompt_len: int, cuda: bool) -> list[dict]:
    rng = random.Random(0)
    vocab = model.cfg.vocab_size
    rows = []
    for batch in tqdm(batches, desc="verifier step"):
        verifier = Verifier(model, kv_tokens=batch * (prompt_len + 2048))
        ids = [f"r{i}" for i in range(batch)]
        verifier.step([VerifyRequest(i, [rng.randrange(vocab) for _ in range(prompt_len)]) for i in ids])
        for n in trees:
            # distinct tokens: no token repeats under a parent, as the verifier requires of a draft
            shaped = [TokenTree(rng.sample(range(vocab), n), random_tree(rng, n, 2).parents) for _ in ids]

            def step():
                verifier.step([VerifyRequest(i, [], t) for i, t in zip(ids, shaped)])
                if cuda:
                    torch.cuda.synchronize()
            rows.append({"batch": batch, "tree": n, "step_ms": timed_ms(step, False)})
        base = next(r["step_ms"] for r in rows if r["batch"] == batch and r["tree"] == 0)
        for r in rows:
            if r["batch"] == batch:
                r["vs_one_token"] = r["step_ms"] / base
    return rows


def markdown(meta: dict, attention: list[dict], steps: list[dict]) -> str:
    out = [f"# Tree attention and verifier step: {meta['machine']}", "", f"Command: `{meta['command']}`", "",
           f"dtype {meta['dtype']}; attention shapes: 32 query heads, 8 KV heads, head dim 128, 16-token pages.", ""]
    if meta["note"]:
        out += [meta["note"], ""]
    if meta["config"]:
        out += [f"Kernel configuration: {meta['config']} (a `TileConfig` label).", ""]
    kernel = "kernel_ms" in (attention[0] if attention else {})
    head = ["prefix", "tree", "batch", "reference ms", "SDPA+mask ms"] + (
        ["kernel ms", "kernel vs SDPA", "KV GB/s", "of peak", "max error"] if kernel else [])
    out += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in attention:
        cells = [r["prefix"], r["tree"], r["batch"], f"{r['reference_ms']:.3f}", f"{r['sdpa_mask_ms']:.3f}"]
        if kernel:
            cells += [f"{r['kernel_ms']:.3f}", f"{r['kernel_vs_sdpa']:.2f}x", f"{r['kernel_gbps']:.0f}",
                      f"{r.get('kernel_peak_fraction', float('nan')):.0%}",
                      f"{r['kernel_max_error']:.1e}" + ("" if r["kernel_right"] else " WRONG")]
        out.append("| " + " | ".join(map(str, cells)) + " |")
    if not steps:
        return "\n".join(out) + "\n"
    out += ["", f"Verifier step ({meta['model']}, prompt {meta['prompt_len']} tokens, greedy verification "
            "included; tree 0 = a one-token step):", "", "| batch | tree nodes | step ms | vs one-token step |",
            "| --- | --- | --- | --- |"]
    out += [f"| {r['batch']} | {r['tree']} | {r['step_ms']:.2f} | {r['vs_one_token']:.2f}x |" for r in steps]
    return "\n".join(out) + "\n"


def plot(attention: list[dict], steps: list[dict], path: Path) -> None:
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    batch = min(r["batch"] for r in attention)
    for key, style in (("kernel_ms", "-"), ("reference_ms", "--"), ("sdpa_mask_ms", ":")):
        for prefix in sorted({r["prefix"] for r in attention}):
            pts = [(r["tree"], r[key]) for r in attention if r["prefix"] == prefix and r["batch"] == batch and key in r]
            if pts:
                a.plot(*zip(*pts), style, marker="o", label=f"{key[:-3]} prefix {prefix}")
    a.set(xscale="log", yscale="log", xlabel="tree nodes", ylabel="ms", title=f"attention, batch {batch}")
    a.legend(fontsize=7)
    for bsz in sorted({r["batch"] for r in steps}):
        pts = [(r["tree"], r["vs_one_token"]) for r in steps if r["batch"] == bsz]
        b.plot(*zip(*pts), marker="o", label=f"batch {bsz}")
    b.axhline(1.2, color="grey", linestyle=":")
    b.set(xlabel="tree nodes", ylabel="step time / one-token step", title="verifier step")
    if steps:
        b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specinfer_bench.kernel", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/kernel"))
    p.add_argument("--model", choices=["1b", "shipped"], default=None, help="default: 1b on CUDA, shipped (--llm) on CPU")
    p.add_argument("--llm", default=DEFAULT_LLM, help="the shipped model's checkpoint (default: %(default)s)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--peak-gbps", type=float, default=None, help="memory bandwidth peak (default: by GPU name)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--grid", choices=["full", "small", "quick"], default="full",
                   help="full: the grid above (a smaller one on the CPU); small: 8 attention cells and 3 tree sizes, "
                        "for a GPU's first run (bench/gpu_first_run.sh); quick: the smallest (a smoke run)")
    p.add_argument("--no-verifier", action="store_true", help="the attention table only (no verifier step)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    grid = GPU_GRID if cuda else CPU_GRID
    trees, batches = [0, 1, 4, 16, 64, 128, 256], [1, 8, 32]
    if args.grid == "small":
        grid, trees, batches = dict(prefix=[512, 4096], tree=[1, 64], batch=[1, 16]), [0, 16, 64], [1, 8]
    elif args.grid == "quick":
        grid, trees, batches = dict(prefix=[64], tree=[1, 8], batch=[1, 2]), [0, 8], [1]
    peak = args.peak_gbps or card_peak_gbps()
    meta = {"machine": machine(), "dtype": str(dtype).removeprefix("torch."), "peak_gbps": peak, "model": None,
            "prompt_len": args.prompt_len, "command": command_line("python -m specinfer_bench.kernel", argv),
            "config": None,
            "note": "" if cuda else ("No GPU: the Triton kernel runs only in Triton's interpreter here, which says "
                                     "nothing about its speed, so it is not timed; the GPU figures remain to be measured.")}
    if cuda:
        from specinfer_kernels.tree_attention_triton import default_config
        meta["config"] = str(default_config())
    if cuda:  # the grid's variants compiled side by side first (2-5 s each in one process)
        from .kernel_compile import Precompiler
        with Precompiler() as compile_ahead:
            compile_ahead([default_config()], grid_cells(grid), {}, dtype)
    attention = bench_attention(grid, dtype, device, peak)
    steps = []
    if not args.no_verifier:
        model_kind = args.model or ("1b" if cuda else "shipped")
        model = (random_model(LLAMA_1B, dtype, device) if model_kind == "1b"
                 else LlamaModel.from_pretrained(args.llm, dtype=dtype, device=device))
        meta["model"] = f"{model_kind} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters)"
        steps = bench_verifier(model, trees, batches, args.prompt_len, cuda)
    text = markdown(meta, attention, steps)
    write_record(args.out, {"meta": meta, "attention": attention, "verifier": steps}, text)
    plot(attention, steps, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
