"""Train the tiny test-fixture models on Python source code that every machine with the project has.
(The default LLM is SmolLM2-135M-Instruct; its drafters are trained by scripts/train_models.py.)

Produces, in Hugging Face format (config.json, model.safetensors, tokenizer files):
  models/fixtures/llm    the LLM (Llama architecture, 8 layers)
  models/fixtures/ssm-0  SSM 0 (1 layer), distilled from the LLM's own outputs
  models/fixtures/ssm-1  SSM 1 (1 layer), SSM 0 boost-tuned on the samples SSM 0 gets wrong (SpecInfer section 3;
               `--ssm1-layers 2`: the LLM's first two layers boost-tuned alike)
Each SSM directory also holds draft_vocab.json: the `--draft-vocab` tokens the training corpus uses
most, the only tokens the SSM's LM head keeps when it drafts (specinfer.model.LlamaModel.restrict_vocab).
and models/fixtures/heldout_prompts.jsonl: prompts cut from held-out files that no model saw.

The corpus is every `*.py` of this interpreter's standard library and of the installed packages the
project depends on (its `test` extra included: torch, transformers, numpy, scipy, grpc, protobuf and
their dependencies), test directories excluded, deduplicated by content and split by a hash of each
file's path into train and held-out files. The byte-level BPE is trained on the train files.

Every stage is checkpointed under --work (default `.train/`): run the same command again after an
interruption and it resumes where it stopped. Everything is seeded; on the same interpreter and
package versions a rerun writes the same weights. Nothing is downloaded. (The shipped LLM's first two
cycles ran in fp32, before the autocast, and its third started from their bf16 weights with --llm-from:
a rerun from scratch writes a similar LLM, not the same one.)

The LLM's pretraining is a sequence of cosine cycles (warm restarts, `--llm-steps 1200,1300,3600`), each
with its own warmup and half the previous cycle's peak learning rate: appending a cycle trains an
existing LLM further without redoing the cycles before it. Everything downstream of the LLM (the SSMs'
base, the distillation set, both SSMs) is kept under a directory named after the cycles, so it is
rebuilt from the LLM it belongs to.

    python scripts/train_fixtures.py --out models/fixtures                  # train (hours on 2 CPU cores)
    python scripts/train_fixtures.py --out models/fixtures --evaluate-only  # measure the models in --out
    # train a shipped LLM of cycles 1200,1300 one cycle further, without its checkpoints (the SSMs follow):
    python scripts/train_fixtures.py --out models/fixtures --llm-steps 1200,1300,3600 --llm-from /tmp/llm-1200-1300

The evaluation (held-out loss per byte of text, SSM greedy agreement with the LLM on held-out
continuations, three held-out continuations) is printed and written to --report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sysconfig
import zlib
from importlib import metadata
from pathlib import Path

import torch
from packaging.requirements import Requirement
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specinfer.lookup import ContextIndex
from specinfer.model import DRAFT_VOCAB, read_draft_vocab, spread_vocab
from specinfer.training import optimize

EOS = "<|endoftext|>"
SKIP_DIRS = {"site-packages", "test", "tests", "testing", "idle_test", "__pycache__", "lib2to3"}
MAX_FILE_BYTES = 400_000  # larger sources are generated tables, not code anyone wrote
PROJECT = "specinfer"


# ---------------------------------------------------------------------------------------- corpus

def project_distributions() -> list[metadata.Distribution]:
    """The project's installed dependencies (its `test` extra included), transitively."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [(PROJECT, {"test"})]
    while todo:
        name, extras = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            env_extras = extras or {""}
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in env_extras):
                todo.append((req.name, set(req.extras)))
    seen.pop(PROJECT, None)
    return [seen[k] for k in sorted(seen)]


def corpus_files(heldout_every: int) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """(name, path) of the corpus's source files split into (train, held-out) by a hash of the name,
    the path relative to the standard library or to site-packages. Files whose bytes repeat an earlier
    file's are dropped."""
    named: dict[str, Path] = {}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib.rglob("*.py"):
        named[f"stdlib/{path.relative_to(stdlib)}"] = path
    for dist in project_distributions():
        for f in dist.files or []:
            if f.suffix == ".py":
                named[str(f)] = Path(dist.locate_file(f))
    train, heldout, hashes = [], [], set()
    for name in sorted(named):
        path = named[name]
        if SKIP_DIRS & set(Path(name).parts[1:-1]) or not path.is_file():
            continue
        data = path.read_bytes()
        digest = hashlib.sha1(data).digest()
        if len(data) > MAX_FILE_BYTES or not data.strip() or digest in hashes:
            continue
        hashes.add(digest)
        (heldout if zlib.crc32(name.encode()) % heldout_every == 0 else train).append((name, path))
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
    tok.train_from_iterator((read(f) for f in files), trainer=trainer, length=len(files))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=None, pad_token=EOS
    )


def tokenize(tokenizer, files: list[Path], eos: int) -> torch.Tensor:
    """The files' tokens, each file followed by EOS, as one uint16 tensor."""
    out = []
    for i in tqdm(range(0, len(files), 256), desc="tokenize", unit_scale=256):
        enc = tokenizer([read(f) for f in files[i : i + 256]])["input_ids"]
        for ids in enc:
            out.append(torch.tensor(ids + [eos], dtype=torch.int32))
    return torch.cat(out).to(torch.uint16)


def heldout_prompts(files: list[tuple[str, Path]], count: int, rng: random.Random) -> list[dict]:
    """Snippets that end with a `def` line's signature (its colon: the newline and the body's
    indentation form one token, so a prompt that ended in a bare newline would ask for a top-level
    line): the model continues the body."""
    candidates = []
    for name, f in files:
        lines = read(f).splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") and i >= 6:
                candidates.append((Path(name).name, "".join(lines[i - 6 : i + 1]).rstrip("\n")))
    rng.shuffle(candidates)
    chosen = sorted(candidates[:count])
    return [{"id": f"heldout-{k:02d}-{name}", "prompt": text} for k, (name, text) in enumerate(chosen)]


# -------------------------------------------------------------------------------------- training

def batches(data: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
        yield torch.stack([data[s : s + seq_len] for s in starts.tolist()]).long()


def train_lm(model, data, steps, seq_len, batch, lr, gen, ckpt, desc):
    """Plain next-token pretraining on the corpus."""
    it = batches(data, seq_len, batch, gen)

    def loss():
        x = next(it)
        return model(input_ids=x, labels=x).loss

    optimize(model, loss, steps, lr, 0.1, (0.9, 0.95), gen, ckpt, desc)


@torch.no_grad()
def continuations(llm, prompts: torch.Tensor, new_tokens: int, sample_every_other: bool, gen) -> torch.Tensor:
    """The LLM's continuations of equal-length prompts, 64 at a time: greedy, or alternately greedy
    and sampled at T=0.8."""
    seqs = []
    for i in tqdm(range(0, len(prompts), 64), desc="LLM continuations"):
        chunk = prompts[i : i + 64]
        sample = sample_every_other and (i // 64) % 2 == 1
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        seqs.append(llm.generate(
            input_ids=chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=sample, temperature=0.8 if sample else None,
            top_k=None, top_p=None, pad_token_id=0,
        ))
    return torch.cat(seqs)


@torch.no_grad()
def distillation_set(llm, data, count, gen, cache: Path, prompt_len=64, new_tokens=64, top_k=32):
    """The LLM's own continuations of `count` corpus windows (half greedy, half sampled at T=0.8), with
    the LLM's top-k next-token distribution at every position as soft targets; kept in `cache`-{count}.pt."""
    cached = cache.with_name(f"{cache.name}-{count}.pt")
    if cached.exists():
        return torch.load(cached)
    starts = torch.randint(0, data.numel() - prompt_len, (count,), generator=gen)
    prompts = torch.stack([data[s : s + prompt_len] for s in starts.tolist()]).long()
    seqs = continuations(llm, prompts, new_tokens, True, gen)
    probs, ids = [], []
    for i in tqdm(range(0, count, 32), desc="LLM soft targets"):
        p = llm(input_ids=seqs[i : i + 32]).logits.float().softmax(-1)
        v, k = p.topk(top_k, dim=-1)
        probs.append((v / v.sum(-1, keepdim=True)).half())
        ids.append(k.int())
    out = seqs, torch.cat(ids), torch.cat(probs)
    torch.save(out, cached)
    return out


def distill(ssm, seqs, ids, probs, weight, epochs, batch, lr, gen, ckpt, desc):
    """Minimize cross-entropy of the SSM against the LLM's sparse next-token distribution, at the
    positions where `weight` is 1 (all of them for SSM 0; the ones SSM 0 gets wrong for SSM 1)."""

    def loss():
        rows = torch.randint(0, len(seqs), (batch,), generator=gen)
        logp = ssm(input_ids=seqs[rows]).logits.float().log_softmax(-1)  # [B, T, V]
        ce = -(probs[rows].float() * logp.gather(-1, ids[rows].long())).sum(-1)  # [B, T]
        w = weight[rows]
        return (ce * w).sum() / w.sum().clamp(min=1)

    optimize(ssm, loss, epochs * math.ceil(len(seqs) / batch), lr, 0.0, (0.9, 0.999), gen, ckpt, desc)


@torch.no_grad()
def top_tokens(model, seqs, vocab: torch.Tensor | None = None, k: int = 1) -> torch.Tensor:
    """The model's k most likely next tokens [..., k] at every position of `seqs` (among the token ids
    `vocab` only, when given: what a drafter with that draft vocabulary proposes)."""
    out = []
    for i in range(0, len(seqs), 64):
        logits = model(input_ids=seqs[i : i + 64]).logits
        if vocab is not None:
            logits = spread_vocab(logits[..., vocab], vocab, logits.shape[-1])
        out.append(logits.topk(k, dim=-1).indices)
    return torch.cat(out)


def argmax_tokens(model, seqs, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The model's most likely next token at every position of `seqs` (within `vocab`, when given)."""
    return top_tokens(model, seqs, vocab)[..., 0]


def agrees(ssm, seqs, llm_top1, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """1.0 where the SSM's argmax (within `vocab`, when given) equals the LLM's argmax at the same position."""
    return (argmax_tokens(ssm, seqs, vocab) == llm_top1).float()


def lookup_agrees(seq: torch.Tensor, llm_top1: torch.Tensor, positions: range) -> torch.Tensor:
    """1.0 at each of `positions` where context lookup's first drafted token (specinfer.lookup) given
    the sequence up to there equals the LLM's argmax."""
    ctx, out = ContextIndex(), []
    tokens = seq.tolist()
    ctx.extend(tokens[: positions.start])
    for i in positions:
        ctx.extend(tokens[i : i + 1])
        out.append(float(ctx.draft(1) == [int(llm_top1[i])]))
    return torch.tensor(out)


def frequent_tokens(data: torch.Tensor, k: int, vocab_size: int) -> list[int]:
    """The k token ids that occur most often in `data`, in increasing order (a draft vocabulary)."""
    counts = torch.bincount(data.long(), minlength=vocab_size)
    return sorted(counts.argsort(descending=True, stable=True)[:k].tolist())


def without(ids: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The sparse distributions (ids, probs) [..., K] with `tokens` [...] removed and renormalized (a
    distribution that holds nothing else keeps its shape and sums to 0)."""
    rest = probs.float() * (ids != tokens[..., None])
    return (rest / rest.sum(-1, keepdim=True).clamp(min=1e-12)).to(probs.dtype)


def sharpened(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sparse distributions `probs` [..., K] at a lower temperature: raised to 1/T and renormalized
    (T=1: unchanged). A drafter is judged by its argmax; sharper targets put more of its capacity there."""
    if temperature == 1.0:
        return probs
    p = probs.float().clamp(min=1e-12) ** (1.0 / temperature)
    return (p / p.sum(-1, keepdim=True)).to(probs.dtype)


def truncated(source, cfg: LlamaConfig) -> LlamaForCausalLM:
    """A model of `cfg` (the source's width, as many layers or fewer) that starts from the source's
    embedding, its first layers and its final norm: a copy when `cfg` is the source's."""
    model = LlamaForCausalLM(cfg)
    missing = model.load_state_dict(source.state_dict(), strict=False).missing_keys
    assert not missing, missing
    return model


@torch.no_grad()
def calibration(model, seqs, ids, probs, vocab: torch.Tensor | None, windows: int = 512) -> float:
    """The factor on a drafter's logits that maximizes the share of drafts speculative sampling
    accepts at T=1, sum_x min(p(x), q(x)), against the LLM's top-k distributions `probs` (not
    sharpened) on the first `windows` windows, q being the drafter's softmax over its draft vocabulary.
    Sharper targets raise the argmax agreement, and leave the logits too large for sampling."""
    logits = torch.cat([model(input_ids=seqs[i : i + 64]).logits.float() for i in range(0, windows, 64)])
    if vocab is not None:
        logits = spread_vocab(logits[..., vocab], vocab, logits.shape[-1])
    p = probs[:windows].float()
    accepted = lambda s: torch.minimum(p, (s * logits).softmax(-1).gather(-1, ids[:windows].long())).sum(-1).mean()  # noqa: E731
    return max((round(0.3 + 0.05 * k, 2) for k in range(25)), key=accepted)


def save(model, tokenizer, path: Path, vocab: list[int] | None = None, scale: float = 1.0):
    """The model rounded to bf16 (in place, so that what follows uses what ships), its tokenizer and,
    for a drafter, its draft vocabulary. `scale` multiplies the final norm's weight in what ships,
    hence the logits (a drafter's calibration; its argmax stays)."""
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    with torch.no_grad():
        norm = model.model.norm.weight
        kept = norm.clone()
        norm.mul_(scale)
        model.save_pretrained(path, safe_serialization=True)
        norm.copy_(kept)
    model.float()
    tokenizer.save_pretrained(path)
    if vocab is not None:
        (path / DRAFT_VOCAB).write_text(json.dumps({"token_ids": vocab}) + "\n")


# ------------------------------------------------------------------------------------ evaluation

@torch.no_grad()
def nats_per_byte(model, tokenizer, texts: list[str], window: int = 256) -> float:
    """Next-token loss on whole texts in nats per UTF-8 byte: each text starts after an EOS and is cut
    into windows that overlap by one token, so every token is predicted exactly once."""
    eos = tokenizer.eos_token_id
    nll, nbytes = 0.0, 0
    for text in tqdm(texts, desc="held-out loss", leave=False):
        ids = torch.tensor([eos] + tokenizer(text)["input_ids"])
        nbytes += len(text.encode())
        for s in range(0, len(ids) - 1, window):
            x = ids[s : s + window + 1][None]
            logp = model(input_ids=x[:, :-1]).logits.float().log_softmax(-1)
            nll -= logp.gather(-1, x[:, 1:, None]).sum().item()
    return nll / nbytes


@torch.no_grad()
def agreements(models_: dict, tokenizer, prompts: list[str], vocabs: dict, new_tokens: int, seed: int
               ) -> tuple[dict, list[torch.Tensor]]:
    """Greedy agreement with the LLM's greedy continuations of `prompts`: of each SSM within its draft
    vocabulary, of both merged, of context lookup and of each with lookup merged in; and the
    continuations."""
    greedy, top1 = [], []
    for p in prompts:
        ids = torch.tensor([tokenizer(p)["input_ids"]])
        seq = continuations(models_["llm"], ids, new_tokens, False, torch.Generator().manual_seed(seed))
        greedy.append(seq)
        top1.append(models_["llm"](input_ids=seq).logits.argmax(-1))
    hits, guesses, report = {}, {}, {}
    llm_next = torch.cat([t[0, -new_tokens - 1 : -1] for t in top1])
    for n in ("ssm-0", "ssm-1"):
        # positions whose next token is a generated one: from the prompt's last token on; the SSM
        # proposes from its draft vocabulary, as it does when it drafts
        guesses[n] = torch.cat([top_tokens(models_[n], s, vocabs[n], 2)[0, -new_tokens - 1 : -1] for s in greedy])
        hits[n] = (guesses[n][:, 0] == llm_next).float()
    if vocabs["ssm-0"] is not None:
        report["llm_greedy_in_draft_vocab"] = round(torch.isin(llm_next, vocabs["ssm-0"]).float().mean().item(), 4)
    report["agreement_ssm-0"] = round(hits["ssm-0"].mean().item(), 4)
    report["agreement_ssm-1"] = round(hits["ssm-1"].mean().item(), 4)
    report["agreement_merged"] = round(torch.maximum(hits["ssm-0"], hits["ssm-1"]).mean().item(), 4)
    # what SSM 1 adds, against what a complement could: of SSM 0's misses, the share SSM 1's argmax
    # catches, the share where it repeats SSM 0's wrong guess, and the share SSM 0's second choice catches
    miss = hits["ssm-0"] == 0
    report["ssm-0_misses_caught_by_ssm-1"] = round(hits["ssm-1"][miss].mean().item(), 4)
    report["ssm-0_misses_repeated_by_ssm-1"] = round((guesses["ssm-1"][:, 0] == guesses["ssm-0"][:, 0])[miss].float().mean().item(), 4)
    report["ssm-0_misses_caught_by_its_second_choice"] = round((guesses["ssm-0"][:, 1] == llm_next)[miss].float().mean().item(), 4)
    lookup = torch.cat([lookup_agrees(s[0], t[0], range(s.shape[1] - new_tokens - 1, s.shape[1] - 1)) for s, t in zip(greedy, top1)])
    report["agreement_context_lookup"] = round(lookup.mean().item(), 4)
    report["agreement_ssm-0_or_context_lookup"] = round(torch.maximum(hits["ssm-0"], lookup).mean().item(), 4)
    report["agreement_merged_or_context_lookup"] = round(
        torch.maximum(torch.maximum(hits["ssm-0"], hits["ssm-1"]), lookup).mean().item(), 4)
    return report, greedy


def evaluate(out: Path, heldout: list[tuple[str, Path]], eval_bytes: int, new_tokens: int, seed: int) -> dict:
    """Held-out loss per byte (the LLM, SSM 0), split into standard-library and package files; greedy
    agreement of each SSM, of both merged, and of each with context lookup merged in (a chain drafted
    from the sequence's own earlier tokens, specinfer/lookup.py) with the LLM's greedy continuations
    of the 32 held-out prompts in `out` and of 160 others."""
    tokenizer = AutoTokenizer.from_pretrained(out / "llm")
    models_ = {n: LlamaForCausalLM.from_pretrained(out / n, dtype=torch.float32).eval() for n in ("llm", "ssm-0", "ssm-1")}
    order = sorted(heldout, key=lambda nf: hashlib.sha1(nf[0].encode()).digest())
    report: dict = {"parameters": {n: sum(p.numel() for p in m.parameters()) for n, m in models_.items()},
                    "layers": {n: m.config.num_hidden_layers for n, m in models_.items()},
                    "bytes_bf16": sum((out / n / "model.safetensors").stat().st_size for n in models_)}
    for group in ("stdlib", "packages"):
        texts, size = [], 0
        for name, path in order:
            if (name.startswith("stdlib/")) == (group == "stdlib") and size < eval_bytes:
                texts.append(read(path))
                size += len(texts[-1].encode())
        report[f"heldout_{group}_bytes"] = size
        for n in ("llm", "ssm-0"):
            report[f"{n}_nats_per_byte_{group}"] = round(nats_per_byte(models_[n], tokenizer, texts), 4)
    vocabs = {n: None if (v := read_draft_vocab(out / n)) is None else torch.tensor(v) for n in ("ssm-0", "ssm-1")}
    report["draft_vocab"] = {n: None if v is None else len(v) for n, v in vocabs.items()}
    prompts = [json.loads(line)["prompt"] for line in open(out / "heldout_prompts.jsonl")]
    figures, greedy = agreements(models_, tokenizer, prompts, vocabs, new_tokens, seed)
    report.update(figures)
    # a steadier figure: 160 held-out prompts drawn with another seed (10,240 positions, the 32's: 2,048)
    other = [p["prompt"] for p in heldout_prompts(heldout, 160, random.Random(123 + seed))]
    report["on_160_other_prompts"] = agreements(models_, tokenizer, other, vocabs, new_tokens, seed)[0]
    report["samples"] = [{"prompt": prompts[k], "continuation": tokenizer.decode(greedy[k][0, -new_tokens:])}
                         for k in range(3)]
    return report


# ------------------------------------------------------------------------------------------ main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models/fixtures"))
    ap.add_argument("--work", type=Path, default=Path(".train"), help="checkpoints and the tokenized corpus")
    ap.add_argument("--report", type=Path, default=Path("bench/results/fixtures/models_cpu.json"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--llm-steps", type=lambda v: [int(x) for x in v.split(",")], default=[1200, 1300, 3600],
                    help="steps of each cosine cycle of LLM pretraining, comma-separated")
    ap.add_argument("--llm-from", type=Path, default=None,
                    help="start from the LLM (and tokenizer) in this directory, taken as the result of every "
                         "--llm-steps cycle but the last: trains a shipped LLM further without its checkpoints")
    ap.add_argument("--ssm-steps", type=int, default=300)
    ap.add_argument("--distill-samples", type=lambda v: [int(x) for x in v.split(",")], default=[16384, 8192, 16384, 16384],
                    help="LLM windows both SSMs are trained on, in sets generated and cached one by one, "
                         "comma-separated: appending a set adds windows without regenerating the others")
    ap.add_argument("--distill-epochs", type=int, default=6)
    ap.add_argument("--distill-temperature", type=float, default=0.5,
                    help="temperature the LLM's top-k targets are sharpened to for both SSMs (1: as the LLM gives them)")
    ap.add_argument("--boost-epochs", type=int, default=2, help="epochs of SSM 1's boost-tuning from SSM 0")
    ap.add_argument("--ssm1-layers", type=int, choices=(1, 2), default=1,
                    help="SSM 1's layers: 1 starts it from SSM 0; 2 from the LLM's first two layers (two "
                         "layers can copy from the context, where most of SSM 0's misses are)")
    ap.add_argument("--draft-vocab", type=int, default=3072,
                    help="tokens the SSMs draft from: the corpus's most frequent (the vocabulary size: all)")
    ap.add_argument("--heldout-every", type=int, default=20)
    ap.add_argument("--eval-bytes", type=int, default=400_000, help="held-out text per group to measure")
    ap.add_argument("--evaluate-only", action="store_true", help="measure the models in --out, train nothing")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)

    train_files, heldout_files = corpus_files(args.heldout_every)
    print(f"corpus: {len(train_files)} train files, {len(heldout_files)} held-out files "
          f"({sum(p.stat().st_size for _, p in train_files) / 1e6:.1f} MB of train text)")
    if not args.evaluate_only:
        train(args, work, train_files, heldout_files)
    report = evaluate(args.out, heldout_files, args.eval_bytes, 64, args.seed)
    print(json.dumps(report, indent=2))
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")


def train(args, work: Path, train_files, heldout_files):
    if (work / "tokenizer" / "tokenizer.json").exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(work / "tokenizer")
    else:
        tokenizer = (train_tokenizer([p for _, p in train_files], args.vocab_size) if args.llm_from is None
                     else PreTrainedTokenizerFast.from_pretrained(args.llm_from))
        tokenizer.save_pretrained(work / "tokenizer")
    eos = tokenizer.convert_tokens_to_ids(EOS)
    if not (work / "train_tokens.pt").exists():
        torch.save(tokenize(tokenizer, [p for _, p in train_files], eos), work / "train_tokens.pt")
    data = torch.load(work / "train_tokens.pt")
    print(f"train tokens: {data.numel():,}")
    vocab = frequent_tokens(data, args.draft_vocab, len(tokenizer)) if args.draft_vocab < len(tokenizer) else None

    args.out.mkdir(parents=True, exist_ok=True)
    prompts = heldout_prompts(heldout_files, 32, random.Random(args.seed))
    with open(args.out / "heldout_prompts.jsonl", "w") as fh:
        for p in prompts:
            fh.write(json.dumps(p) + "\n")

    common = dict(
        vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, rope_theta=10000.0,
        hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
    )
    llm_cfg = LlamaConfig(num_hidden_layers=8, **common)
    ssm_cfg = LlamaConfig(num_hidden_layers=1, **common)
    seeded = lambda stage: torch.Generator().manual_seed(args.seed * 1000 + stage)  # noqa: E731

    if args.llm_from is None:
        llm, done = LlamaForCausalLM(llm_cfg), 0
    else:
        llm, done = LlamaForCausalLM.from_pretrained(args.llm_from, dtype=torch.float32), len(args.llm_steps) - 1
        assert llm.config.num_hidden_layers == llm_cfg.num_hidden_layers and len(tokenizer) == llm.config.vocab_size
    for k, steps in enumerate(args.llm_steps[done:], start=done):
        ckpt = work / ("llm.ckpt" if k == 0 else f"llm-cycle{k + 1}.ckpt")
        train_lm(llm, data, steps, 256, 16, 2.5e-3 / 2**k, seeded(1 if k == 0 else 10 + k), ckpt,
                 f"LLM pretraining, cycle {k + 1}/{len(args.llm_steps)}")
    save(llm, tokenizer, args.out / "llm")
    work = work / ("after-llm-" + "-".join(map(str, args.llm_steps)))  # what follows depends on this LLM
    work.mkdir(exist_ok=True)

    # the SSMs' base: the LLM's embedding, first layer and final norm, pretrained further on its own
    base = truncated(llm, ssm_cfg)
    train_lm(base, data, args.ssm_steps, 256, 16, 2e-3, seeded(2), work / "ssm-base.ckpt", "SSM base pretraining")
    # the distillation windows, set by set (set 2 keeps the seed it had when SSM 1 alone trained on it)
    sets = [distillation_set(llm, data, n, seeded(3 if k == 0 else 5 + k), work / ("distill" if k == 0 else f"distill-{k + 1}"))
            for k, n in enumerate(args.distill_samples)]
    seqs, top_ids, top_probs = (torch.cat(part) for part in zip(*sets))
    targets = sharpened(top_probs, args.distill_temperature)
    everywhere = torch.ones(seqs.shape, dtype=torch.float)
    recipe = "+".join(map(str, args.distill_samples)) + f"x{args.distill_epochs}"  # the SSMs' checkpoints belong to their recipe
    if args.distill_temperature != 1.0:
        recipe += f"-T{args.distill_temperature:g}"

    ssm0 = truncated(base, ssm_cfg)
    distill(ssm0, seqs, top_ids, targets, everywhere, args.distill_epochs, 32, 2e-3, seeded(4),
            work / f"ssm-0-{recipe}.ckpt", "SSM 0 distillation")
    draft_vocab = None if vocab is None else torch.tensor(vocab)
    save(ssm0, tokenizer, args.out / "ssm-0", vocab, calibration(ssm0, seqs, top_ids, top_probs, draft_vocab))  # rounded to bf16 in place: SSM 1 complements the SSM 0 that ships
    guess0 = argmax_tokens(ssm0, seqs)
    marked = (guess0 == top_ids[..., 0]).float()  # SpecInfer's "marked" samples: SSM 0 already right

    # Boost-tuning: SSM 1 starts from SSM 0 (--ssm1-layers 2: from the LLM's first two layers) and is
    # fine-tuned on the samples SSM 0 gets wrong, towards the LLM's distribution without SSM 0's guess
    # there: a merged tree already holds that guess, so SSM 1 is worth most where it proposes the LLM's
    # token among the others.
    if args.ssm1_layers == 1:
        ssm1, source = truncated(ssm0, ssm_cfg), "ssm-0"
    else:
        ssm1, source = truncated(llm, LlamaConfig(num_hidden_layers=args.ssm1_layers, **common)), f"llm-{args.ssm1_layers}-layers"
    distill(ssm1, seqs, top_ids, without(top_ids, targets, guess0), 1 - marked, args.boost_epochs, 32, 2e-3,
            seeded(5), work / f"ssm-1-from-{source}-{recipe}-boost{args.boost_epochs}.ckpt", "SSM 1 boost-tuning")
    hit1 = agrees(ssm1, seqs, top_ids[..., 0])
    print(f"greedy agreement with the LLM on the distillation set: SSM 0 {marked.mean():.3f}, "
          f"SSM 1 {hit1.mean():.3f}, SSM 1 where SSM 0 misses {(hit1 * (1 - marked)).sum() / (1 - marked).sum():.3f}, "
          f"either {torch.maximum(marked, hit1).mean():.3f}")
    save(ssm1, tokenizer, args.out / "ssm-1", vocab, calibration(ssm1, seqs, top_ids, top_probs, draft_vocab))


if __name__ == "__main__":
    main()
