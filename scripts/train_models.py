"""Train the shipped default models on the Python standard library's own source code.

Produces, in Hugging Face format (config.json, model.safetensors, tokenizer files):
  models/llm    the LLM (Llama architecture, ~11M parameters)
  models/ssm-0  SSM 0, distilled from the LLM's own outputs
  models/ssm-1  SSM 1, boost-tuned on the samples SSM 0 gets wrong (SpecInfer section 3)
and models/heldout_prompts.jsonl: prompts cut from standard-library files that no model saw.

The corpus is every `*.py` of this interpreter's standard library (tests excluded), split by a hash
of the file's path into train and held-out files. Everything is seeded; on the same interpreter and
package versions a rerun writes the same weights. Nothing is downloaded.

    python scripts/train_models.py --out models
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import zlib
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


def corpus_files(heldout_every: int) -> tuple[list[Path], list[Path]]:
    """Standard-library source files split into (train, held-out) by a hash of the relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]):
            continue
        (heldout if zlib.crc32(str(rel).encode()) % heldout_every == 0 else train).append(path)
    return train, heldout


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator((read(f) for f in files), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=None, pad_token=EOS
    )


def heldout_prompts(files: list[Path], count: int, rng: random.Random) -> list[dict]:
    """Snippets that end just after a `def` line's signature: the model continues the body."""
    candidates = []
    for f in files:
        lines = read(f).splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") and i >= 6:
                candidates.append((f.name, "".join(lines[i - 6 : i + 1])))
    rng.shuffle(candidates)
    chosen = sorted(candidates[:count])
    return [{"id": f"heldout-{k:02d}-{name}", "prompt": text} for k, (name, text) in enumerate(chosen)]


def batches(data: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
        yield torch.stack([data[s : s + seq_len] for s in starts.tolist()])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def optimize(model, loss_of_step, steps, lr, weight_decay, betas, desc):
    """AdamW with warmup + cosine decay; loss_of_step() draws its own batch and returns the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
    model.train()
    bar = tqdm(range(steps), desc=desc)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        loss = loss_of_step()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


def train_lm(model, data, steps, seq_len, batch, lr, gen, desc):
    """Plain next-token pretraining on the corpus."""
    it = batches(data, seq_len, batch, gen)

    def loss():
        x = next(it)
        return model(input_ids=x, labels=x).loss

    optimize(model, loss, steps, lr, 0.1, (0.9, 0.95), desc)


@torch.no_grad()
def distillation_set(llm, data, count, prompt_len, new_tokens, top_k, gen):
    """The LLM's own continuations of corpus windows (half greedy, half sampled at T=0.8), with the
    LLM's top-k next-token distribution at every position as soft targets."""
    starts = torch.randint(0, data.numel() - prompt_len, (count,), generator=gen)
    prompts = torch.stack([data[s : s + prompt_len] for s in starts.tolist()])
    seqs = []
    for i in tqdm(range(0, count, 64), desc="LLM continuations"):
        chunk = prompts[i : i + 64]
        sample = (i // 64) % 2 == 1
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        out = llm.generate(
            input_ids=chunk,
            attention_mask=torch.ones_like(chunk),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=sample,
            temperature=0.8 if sample else None,
            top_k=None,
            top_p=None,
            pad_token_id=0,
        )
        seqs.append(out)
    seqs = torch.cat(seqs)
    probs, ids = [], []
    for i in tqdm(range(0, count, 32), desc="LLM soft targets"):
        p = llm(input_ids=seqs[i : i + 32]).logits.float().softmax(-1)
        v, k = p.topk(top_k, dim=-1)
        probs.append((v / v.sum(-1, keepdim=True)).half())
        ids.append(k.int())
    return seqs, torch.cat(ids), torch.cat(probs)


def distill(ssm, seqs, ids, probs, weight, epochs, batch, lr, gen, desc):
    """Minimize cross-entropy of the SSM against the LLM's sparse next-token distribution, at the
    positions where `weight` is 1 (all of them for SSM 0; the ones SSM 0 gets wrong for SSM 1)."""

    def loss():
        rows = torch.randint(0, len(seqs), (batch,), generator=gen)
        logp = ssm(input_ids=seqs[rows]).logits.float().log_softmax(-1)  # [B, T, V]
        ce = -(probs[rows].float() * logp.gather(-1, ids[rows].long())).sum(-1)  # [B, T]
        w = weight[rows]
        return (ce * w).sum() / w.sum().clamp(min=1)

    optimize(ssm, loss, epochs * math.ceil(len(seqs) / batch), lr, 0.0, (0.9, 0.999), desc)


@torch.no_grad()
def agrees(ssm, seqs, ids) -> torch.Tensor:
    """1.0 where the SSM's argmax equals the LLM's argmax (the first of its top-k ids)."""
    out = []
    for i in range(0, len(seqs), 64):
        out.append(ssm(input_ids=seqs[i : i + 64]).logits.argmax(-1) == ids[i : i + 64, :, 0])
    return torch.cat(out).float()


def save(model, tokenizer, path: Path):
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    model.float()
    tokenizer.save_pretrained(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--llm-steps", type=int, default=420)
    ap.add_argument("--ssm-steps", type=int, default=600)
    ap.add_argument("--distill-samples", type=int, default=1536)
    ap.add_argument("--distill-epochs", type=int, default=6)
    ap.add_argument("--heldout-every", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    train_files, heldout_files = corpus_files(args.heldout_every)
    print(f"corpus: {len(train_files)} train files, {len(heldout_files)} held-out files")
    tokenizer = train_tokenizer(train_files, args.vocab_size)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = []
    for f in tqdm(train_files, desc="tokenize"):
        ids.extend(tokenizer(read(f))["input_ids"] + [eos])
    data = torch.tensor(ids, dtype=torch.long)
    print(f"train tokens: {data.numel():,}")

    args.out.mkdir(parents=True, exist_ok=True)
    prompts = heldout_prompts(heldout_files, 32, random.Random(args.seed))
    with open(args.out / "heldout_prompts.jsonl", "w") as fh:
        for p in prompts:
            fh.write(json.dumps(p) + "\n")

    common = dict(
        vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, rope_theta=10000.0,
    )
    llm_cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=3,
                          num_attention_heads=8, num_key_value_heads=4, **common)
    ssm_cfg = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, **common)

    llm = LlamaForCausalLM(llm_cfg)
    train_lm(llm, data, args.llm_steps, 256, 16, 2e-3, gen, "LLM pretraining")
    save(llm, tokenizer, args.out / "llm")

    base = LlamaForCausalLM(ssm_cfg)
    train_lm(base, data, args.ssm_steps, 256, 16, 3e-3, gen, "SSM base pretraining")
    seqs, top_ids, top_probs = distillation_set(llm, data, args.distill_samples, 64, 64, 64, gen)
    everywhere = torch.ones(seqs.shape, dtype=torch.float)

    ssm0 = LlamaForCausalLM(ssm_cfg)
    ssm0.load_state_dict(base.state_dict())
    distill(ssm0, seqs, top_ids, top_probs, everywhere, args.distill_epochs, 32, 2e-3, gen, "SSM 0 distillation")
    marked = agrees(ssm0, seqs, top_ids)  # SpecInfer's "marked" samples: SSM 0 already right

    ssm1 = LlamaForCausalLM(ssm_cfg)
    ssm1.load_state_dict(base.state_dict())
    distill(ssm1, seqs, top_ids, top_probs, 1 - marked, args.distill_epochs, 32, 2e-3, gen, "SSM 1 boost-tuning")
    hit1 = agrees(ssm1, seqs, top_ids)
    print(f"greedy agreement with the LLM on the distillation set: SSM 0 {marked.mean():.3f}, "
          f"SSM 1 {hit1.mean():.3f}, SSM 1 where SSM 0 misses {(hit1 * (1 - marked)).sum() / (1 - marked).sum():.3f}, "
          f"either {torch.maximum(marked, hit1).mean():.3f}")
    save(ssm0, tokenizer, args.out / "ssm-0")
    save(ssm1, tokenizer, args.out / "ssm-1")
    for name in ("llm", "ssm-0", "ssm-1"):
        n = sum(p.numel() for p in {"llm": llm, "ssm-0": ssm0, "ssm-1": ssm1}[name].parameters())
        print(f"{name}: {n / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
