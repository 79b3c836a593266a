"""Train the default LLM's feature drafter, an EAGLE-3 head for SmolLM2-135M-Instruct
(models/smollm2/head-0; specinfer/eagle.py says what the head is).

    python scripts/train_head.py                  # the distillation set, then the head; rerun to resume
    python scripts/train_head.py --stage data     # only the distillation set (scripts/head_data.py)
    python scripts/train_head.py --evaluate-only  # the head's agreement with the LLM on held-out requests

The distillation set is the LLM's greedy replies to code, code-chat and general requests, with the LLM's
features and top-32 distribution at every position, computed once and cached under --work.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_data import features_and_targets, general_requests, replies  # noqa: E402
from train_fixtures import corpus_files, optimize  # noqa: E402
from train_models import cached, chat_request, code_windows, functions, installed_llm  # noqa: E402

from specinfer.checkpoints import BASE, DEFAULT_LLM_FILE, DEFAULT_LLM_INSTALL, checkpoint_dir  # noqa: E402
from specinfer.eagle import EagleHead, HeadConfig, default_layers, save_head  # noqa: E402
from specinfer.generate import Engine, Mode, Request  # noqa: E402
from specinfer.gguf_checkpoint import sha256  # noqa: E402
from specinfer.model import LlamaModel, read_draft_vocab  # noqa: E402
from specinfer.prompts import prompt_ids, read_prompt_file  # noqa: E402
from specinfer.verifier import Verifier, VerifyRequest  # noqa: E402


def distillation_set(args, llm_dir: Path, llm_file: Path) -> dict:
    """{"seqs", "loss_from", "feats", "ids", "probs", "kinds"}: every sequence with the first position
    whose next token is learnt (a chat request's own tokens are context, not targets)."""
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(f"{sha256(llm_file)}-{args.seed}-{args.code}-{args.chat}-{args.general}".encode()).hexdigest()[:12]
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    llm = LlamaModel.from_pretrained(llm_dir)
    engine = Engine(llm, mode=Mode.INCREMENTAL)
    train_files, _ = corpus_files(20)
    rng = random.Random(args.seed)
    code = code_windows(tokenizer, train_files, rng, args.code, 48)
    chat = [prompt_ids(tokenizer, {"messages": chat_request(fn, i)})
            for i, fn in enumerate(functions(train_files, rng, args.chat))]
    asks = cached(work / f"general-{key}.pt", lambda: general_requests(engine, tokenizer, args.general, args.seed))
    general = [prompt_ids(tokenizer, {"messages": [{"role": "user", "content": a}]}) for a in asks]
    seqs, loss_from, kinds = [], [], []
    for kind, prompts, new in (("code", code, 64), ("chat", chat, 96), ("general", general, 128)):
        part = replies(engine, prompts, new, work / f"replies-{kind}-{key}", f"{kind}: the LLM's replies")
        seqs += part
        loss_from += [0 if kind == "code" else len(p) - 1 for p in prompts]
        kinds += [kind] * len(part)
    corpus = code_windows(tokenizer, train_files, random.Random(args.seed + 1000), args.corpus, 256)
    seqs, loss_from, kinds = seqs + corpus, loss_from + [0] * len(corpus), kinds + ["corpus"] * len(corpus)
    engine = llm = None
    hf = LlamaForCausalLM.from_pretrained(llm_dir, dtype=torch.float32).eval()
    layers = default_layers(hf.config.num_hidden_layers)
    n = len(seqs) - len(corpus)  # the replies' features, then the corpus windows', cached apart
    feats, ids, probs = cached(work / f"features-{key}-{'-'.join(map(str, layers))}.pt",
                               lambda: features_and_targets(hf, seqs[:n], layers))
    more = cached(work / f"features-corpus-{args.seed}-{args.corpus}-{'-'.join(map(str, layers))}.pt",
                  lambda: features_and_targets(hf, seqs[n:], layers))
    feats, ids, probs = feats + more[0], ids + more[1], probs + more[2]
    print(f"distillation set: {len(seqs)} sequences, {sum(map(len, seqs)):,} tokens "
          f"({sum(len(s) - f for s, f in zip(seqs, loss_from)):,} learnt)")
    return {"seqs": seqs, "loss_from": loss_from, "feats": feats, "ids": ids, "probs": probs, "kinds": kinds}


# ------------------------------------------------------------------------------------------ the head

def new_head(llm: LlamaModel, vocab: list[int], layers: list[int], intermediate: int) -> EagleHead:
    """A head for `llm`: its embedding (frozen), its LM head's rows of `vocab` and its final norm;
    the layer's hidden half of the attention and its MLP start from the LLM's last layer, the
    rest at random."""
    m = dataclasses.replace(llm.cfg, num_layers=1, intermediate_size=intermediate)
    head = EagleHead(HeadConfig(m, len(vocab), llm.cfg.hidden_size, tuple(layers), False))
    H = m.hidden_size
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1 else torch.ones(p.shape))
        last = llm.layers[-1]
        head.embed.weight.copy_(llm.embed.weight)
        head.lm_head.weight.copy_(llm.lm_head.weight[:, vocab])
        head.norm.weight.copy_(llm.norm.weight)
        L = head.layers[0]
        L.qkv.weight[H:].copy_(last.qkv.weight)
        L.o.weight.copy_(last.o.weight)
        L.input_norm.weight.copy_(last.input_norm.weight)
        L.hidden_norm.weight.copy_(last.input_norm.weight)
        L.post_norm.weight.copy_(last.post_norm.weight)
        if intermediate == llm.cfg.intermediate_size:
            L.gate_up.weight.copy_(last.gate_up.weight)
            L.down.weight.copy_(last.down.weight)
    head.vocab_ids = torch.tensor(vocab)
    head.embed.weight.requires_grad_(False)
    return head


def soft_loss(head: EagleHead, outs, index: torch.Tensor, ids, probs, mask, weight: float) -> torch.Tensor:
    """Training-time test's loss: over steps k, weight^k x the cross-entropy of the head's
    distribution over its draft vocabulary against the LLM's top-32 (its part in the draft
    vocabulary, renormalized) at the step's target positions. ids, probs, mask [B, T]."""
    total, norm = 0.0, 0.0
    n = outs[0].shape[1]
    for k, out in enumerate(outs):
        pos = torch.arange(n) + 1 + k  # the LLM row whose next token step k's node predicts
        ok = (pos < ids.shape[1])
        pos = pos.clamp(max=ids.shape[1] - 1)
        b, j = ((mask[:, pos] * ok) > 0).nonzero(as_tuple=True)  # the rows learnt: the LM head runs on these only
        tid = index[ids[b, pos[j]].long()]  # [rows, 32]
        tp = probs[b, pos[j]].float() * (tid >= 0)
        tp = tp / tp.sum(-1, keepdim=True).clamp(min=1e-9)
        logp = head.lm_head(head.norm(out[b, j])[0]).float().log_softmax(-1)  # [rows, Vd]
        ce = -(tp * logp.gather(-1, tid.clamp(min=0))).sum(-1)
        total = total + weight ** k * ce.mean()
        norm += weight ** k
    return total / norm


def batch_of(data: dict, rows: list[int], noise: float, gen: torch.Generator):
    """Padded features (with uniform noise of `noise` x each row's RMS), tokens, targets and loss mask."""
    pad = lambda xs, v: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=v)  # noqa: E731
    feats = pad([data["feats"][r].float() for r in rows], 0.0)
    if noise:
        rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
        feats = feats + (torch.rand(feats.shape, generator=gen) * 2 - 1) * noise * rms
    tokens = pad([torch.tensor(data["seqs"][r]) for r in rows], 0)
    mask = pad([(torch.arange(len(data["seqs"][r])) >= data["loss_from"][r]).float() for r in rows], 0.0)
    return feats, tokens, pad([data["ids"][r] for r in rows], 0), pad([data["probs"][r] for r in rows], 0.0), mask


def train(args, data: dict, llm: LlamaModel, llm_file: Path) -> None:
    counts = torch.bincount(torch.cat([torch.tensor(s[f:]) for s, f, k in zip(data["seqs"], data["loss_from"], data["kinds"])
                                       if k != "corpus"]), minlength=llm.cfg.vocab_size)  # what the LLM writes
    vocab = sorted(counts.argsort(descending=True, stable=True)[: args.draft_vocab].tolist())
    layers = default_layers(llm.cfg.num_layers)
    head = new_head(llm, vocab, layers, llm.cfg.intermediate_size)
    index = torch.full((llm.cfg.vocab_size,), -1, dtype=torch.long)
    index[torch.tensor(vocab)] = torch.arange(len(vocab))
    gen = torch.Generator().manual_seed(args.seed)
    order = sorted(range(len(data["seqs"])), key=lambda r: len(data["seqs"][r]))  # batches of like lengths

    def loss():
        start = int(torch.randint(0, len(order) - args.batch + 1, (1,), generator=gen))
        feats, tokens, ids, probs, mask = batch_of(data, order[start: start + args.batch], args.noise, gen)
        return soft_loss(head, head.chains(feats, tokens, args.ttt), index, ids, probs, mask, 0.8)

    steps = args.epochs * len(order) // args.batch
    recipe = (f"c{args.corpus}-v{args.draft_vocab}-t{args.ttt}-e{args.epochs}-b{args.batch}-n{args.noise:g}"
              f"-lr{args.lr:g}")
    optimize(head, loss, steps, args.lr, 0.0, (0.9, 0.95), gen, args.work / f"head-{recipe}.ckpt", "head (TTT)",
             autocast=False)
    save_head(args.out / args.name, llm.cfg, {k: v.detach().to(torch.bfloat16) for k, v in head.published().items()},
              vocab, layers, llm.cfg.intermediate_size)
    (args.out / args.name / BASE).write_text(json.dumps(
        {"file": DEFAULT_LLM_FILE, "package": DEFAULT_LLM_INSTALL.split()[-1], "sha256": sha256(llm_file),
         "tensors": []}, indent=2) + "\n")


# ------------------------------------------------------------------------------------ evaluation

@torch.no_grad()
def evaluate(args, llm: LlamaModel, tokenizer) -> dict:
    """The head's agreement with the LLM on its greedy continuations of held-out requests, teacher-
    forced on the LLM's features: depth 1 (the first drafted token is the LLM's next token) and the
    mean length of the chain of 4 that is right from its start (what a chain of 4 would get accepted);
    SSM 0's first token beside it."""
    head = EagleHead.from_pretrained(args.out / args.name, llm.cfg, llm.embed.weight)
    ssm_dir = checkpoint_dir(args.out / "ssm-0")
    ssm = LlamaForCausalLM.from_pretrained(ssm_dir, dtype=torch.float32).eval()
    ssm_vocab = torch.tensor(read_draft_vocab(ssm_dir))
    engine = Engine(llm, mode=Mode.INCREMENTAL)
    verifier = Verifier(llm, feature_layers=head.head_cfg.layers)
    report = {"head": args.name, "draft_vocab": head.head_cfg.draft_vocab_size, "layers": list(head.head_cfg.layers)}
    sets = {"code": [r for r in read_prompt_file(args.out / "prompts.jsonl") if "prompt" in r],
            "chat": [r for r in read_prompt_file(args.out / "prompts.jsonl") if "messages" in r],
            "general": read_prompt_file(args.out / "general_prompts.jsonl")}
    for kind, records in sets.items():
        prompts = [prompt_ids(tokenizer, r) for r in records]
        gens = engine.generate([Request(p, 64, id=str(i)) for i, p in enumerate(prompts)])
        first, chain, ssm_first, n = 0, 0, 0, 0
        for i, (p, g) in enumerate(zip(prompts, gens)):
            s = p + g.token_ids
            (v,) = verifier.step([VerifyRequest(str(i), s, features=True)])
            verifier.release(str(i))
            feats, tokens = v.features.rows[None], torch.tensor([s])
            outs = head.chains(feats, tokens, 4)
            roots = torch.arange(len(p) - 2, len(s) - 2)  # pair j predicts token j + 2: the reply's tokens
            hits = torch.stack([head.lm_logits(o[0, roots]).argmax(-1) == tokens[0, (roots + 2 + k).clamp(max=len(s) - 1)]
                                for k, o in enumerate(outs)])  # [4, roots]
            hits &= (roots + 2 + torch.arange(4)[:, None]) < len(s)
            first += int(hits[0].sum())
            chain += int(hits.int().cumprod(0).sum())
            rows = ssm(input_ids=tokens).logits[0, len(p) - 1: len(s) - 1, ssm_vocab]  # row q predicts token q + 1
            ssm_first += int((ssm_vocab[rows.argmax(-1)] == tokens[0, len(p):]).sum())
            n += len(roots)
        report[kind] = {"prompts": len(prompts), "positions": n, "head_first_token": round(first / n, 4),
                        "head_chain4_accepted_mean": round(chain / n, 3), "ssm0_first_token": round(ssm_first / n, 4)}
        print(kind, report[kind], flush=True)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models/smollm2"))
    ap.add_argument("--work", type=Path, default=Path(".train/head"), help="the distillation set and checkpoints")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--code", type=int, default=512, help="code windows to continue")
    ap.add_argument("--chat", type=int, default=512, help="code-chat requests to answer")
    ap.add_argument("--general", type=int, default=768, help="general requests the LLM writes, then answers")
    ap.add_argument("--corpus", type=int, default=0, help="also windows of 256 tokens of the corpus itself (no reply; "
                                                         "the shipped head has none)")
    ap.add_argument("--name", default="head-0", help="the head's directory under --out")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head drafts from: those the replies use most")
    ap.add_argument("--ttt", type=int, default=3, help="training-time test: steps of each chain the head is trained on")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=0.1, help="uniform noise on the features, times each row's RMS")
    ap.add_argument("--report", type=Path, default=Path("bench/results/head_cpu.json"))
    ap.add_argument("--stage", choices=("data", "all"), default="all")
    ap.add_argument("--evaluate-only", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    llm_file, llm_dir = installed_llm()
    if not args.evaluate_only:
        data = distillation_set(args, llm_dir, llm_file)
        if args.stage == "data":
            return
        train(args, data, LlamaModel.from_pretrained(llm_dir), llm_file)
    report = evaluate(args, LlamaModel.from_pretrained(llm_dir), AutoTokenizer.from_pretrained(llm_dir))
    report["recipe"] = {k: getattr(args, k) for k in ("code", "chat", "general", "corpus", "draft_vocab", "ttt", "epochs",
                                                      "batch", "lr", "noise")}
    print(json.dumps(report, indent=2))
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
