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
import hashlib
import random
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_data import features_and_targets, general_requests, replies  # noqa: E402
from train_fixtures import corpus_files  # noqa: E402
from train_models import chat_request, code_windows, functions  # noqa: E402

from specinfer.checkpoints import DEFAULT_LLM, checkpoint_dir, default_llm_file  # noqa: E402
from specinfer.eagle import default_layers  # noqa: E402
from specinfer.generate import Engine, Mode  # noqa: E402
from specinfer.gguf_checkpoint import sha256  # noqa: E402
from specinfer.model import LlamaModel  # noqa: E402
from specinfer.prompts import prompt_ids  # noqa: E402


def cached(path: Path, make):
    if path.exists():
        return torch.load(path)
    value = make()
    torch.save(value, path)
    return value


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
    engine = llm = None
    hf = LlamaForCausalLM.from_pretrained(llm_dir, dtype=torch.float32).eval()
    layers = default_layers(hf.config.num_hidden_layers)
    feats, ids, probs = cached(work / f"features-{key}-{'-'.join(map(str, layers))}.pt",
                               lambda: features_and_targets(hf, seqs, layers))
    print(f"distillation set: {len(seqs)} sequences, {sum(map(len, seqs)):,} tokens "
          f"({sum(len(s) - f for s, f in zip(seqs, loss_from)):,} learnt)")
    return {"seqs": seqs, "loss_from": loss_from, "feats": feats, "ids": ids, "probs": probs, "kinds": kinds}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models/smollm2"))
    ap.add_argument("--work", type=Path, default=Path(".train/head"), help="the distillation set and checkpoints")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--code", type=int, default=512, help="code windows to continue")
    ap.add_argument("--chat", type=int, default=512, help="code-chat requests to answer")
    ap.add_argument("--general", type=int, default=768, help="general requests the LLM writes, then answers")
    ap.add_argument("--stage", choices=("data", "all"), default="all")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    try:
        llm_file = default_llm_file()
    except FileNotFoundError as e:
        raise SystemExit(str(e))
    llm_dir = checkpoint_dir(DEFAULT_LLM)
    data = distillation_set(args, llm_dir, llm_file)
    if args.stage == "data":
        return


if __name__ == "__main__":
    main()
