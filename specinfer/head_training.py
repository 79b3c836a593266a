"""Training a feature head (an EAGLE-3 head, `eagle.py`) for any Llama-family LLM this project loads:
`specinfer train-head`.

Terms:
  request   a prompt record (`prompts.py`): from a prompt file, or written by the LLM itself
            (`head_requests.py`).
  reply     the LLM's own reply to a request, generated with this project's engine (greedy, or sampled
            at --temperature), batched; stored as token ids, the request's own tokens being context, not
            targets.
  targets   at every position of a request + reply, the LLM's features (the residual stream entering
            the head's layers) and its top-32 next-token distribution, taken from the LLM's forward
            during training (online: never stored).
  agreement on the LLM's greedy continuations of held-out requests, teacher-forced on its features: how
            often the head's first drafted token is the LLM's next token, and the mean length of a chain
            of 4 drafts that is right from its start.

Training is EAGLE-3's training-time test (`EagleHead.chains`: from every position a chain of `ttt`
drafts, each fed the head's own output; weights 1, 0.8, 0.64, ...), soft cross-entropy against the LLM's
top-32 within the draft vocabulary (the tokens the replies use most), uniform noise on the features;
from a head made as `new_head` says, or from a trained head going on (`--init`, its vocabulary kept).
Everything a run makes lives in the output directory: the head (the published layout `--head` loads),
`agreement.json`, and `train/` (requests, replies, draft vocabulary, the training state, the loss per
step), so that a rerun continues where a run stopped. The replies may live elsewhere (`--replies`, e.g. a
file committed beside the LLM): a gzip file of JSON lines {"id": request id, "reply": token ids}, one gzip
member appended per batch, so that a run stopped mid-write loses only its last batch.

Replies are decoded in the fastest dtype the device offers (`generation_dtype`): bfloat16 on a GPU or on a
CPU with AMX, float32 elsewhere. bfloat16's greedy replies part from float32's after some tokens (near
ties); they are still the LLM's text, and the targets the head learns, the LLM's distributions at every
position, are computed in the training dtype from whatever the sequence is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoints import checkpoint_dir, llm_file, write_base
from .devices import resolve_dtype
from .eagle import EagleHead, HeadConfig, default_layers, save_head
from .generate import Engine, Mode, Request
from .head_requests import written_requests
from .kv_cache import BLOCK_SIZE
from .model import LlamaModel
from .prompts import prompt_ids, read_prompt_file
from .sampling import SamplingParams
from .training import optimize

TOP_K = 32  # the LLM's next-token distribution is kept to its top 32
CHAIN = 4  # agreement: the chain of drafts scored
KIND_WEIGHTS = {"general": 2.0}  # requests of a kind (id `kind-n`) come this much earlier in the order (others 1)


@dataclass
class HeadRun:
    """One `specinfer train-head` run (the CLI's flags)."""

    llm: str
    out: Path
    requests: Path | None = None  # a prompt file; None: only the LLM's own
    count: int = 0  # requests taken from the file (0: all)
    write: int = 0  # requests the LLM writes itself
    heldout: list[Path] = field(default_factory=list)  # prompt files to score agreement on
    new_tokens: int = 128  # of each reply
    temperature: float = 0.0  # of the replies (0: greedy)
    generate_batch: int = 64
    generate_minutes: float = 0.0  # no new batch of replies is started after this (0: all); a rerun makes the rest
    generate_dtype: str = "auto"  # of the replies' decoding (`generation_dtype`)
    replies: Path | None = None  # the replies' file (None: out/train/replies.jsonl.gz)
    generate_only: bool = False  # make the replies and stop
    draft_vocab: int = 8192
    init: Path | None = None  # a trained head to go on from (its draft vocabulary and layers kept)
    ttt: int = 3
    epochs: float = 6.0
    steps: int = 0  # training steps (0: epochs over the replies)
    batch: int = 8
    lr: float = 1e-3
    noise: float = 0.1
    minutes: float = 0.0  # the run's time budget (0: none); training stops there, the state saved
    score_tokens: int = 64  # of each held-out continuation scored
    device: str = "cpu"
    seed: int = 0

    def data_key(self) -> dict:
        """What the stored requests and replies depend on: a rerun must agree."""
        return {k: str(getattr(self, k)) for k in ("llm", "requests", "count", "write", "new_tokens", "temperature",
                                                   "seed")}


def train_head(run: HeadRun) -> dict:
    """Requests, replies, the head trained (or its training continued), written and scored: the report."""
    deadline = time.monotonic() + run.minutes * 60 if run.minutes else None
    work = run.out / "train"
    work.mkdir(parents=True, exist_ok=True)
    check_same_data(work / "data.json", run.data_key())
    device = torch.device(run.device)
    llm, target, tokenizer = load_llm(run.llm, device)
    records = requests(run, llm, tokenizer, work)
    prompts = [prompt_ids(tokenizer, r) for r in records]
    sampling = SamplingParams(temperature=run.temperature, seed=run.seed)
    dtype = generation_dtype(run.generate_dtype, device)
    store = RepliesFile(run.replies or work / "replies.jsonl.gz",
                        {"llm": run.llm, "new_tokens": run.new_tokens, "temperature": run.temperature, "dtype": str(dtype)})
    stop = time.monotonic() + run.generate_minutes * 60 if run.generate_minutes else None
    made = replies(lambda: decoder(run.llm, llm, dtype, device), records, prompts, run.new_tokens, sampling, store,
                   run.generate_batch, stop)
    if run.generate_only:
        return {"replies": str(store.path), "requests": len(records), "replied": len(made),
                "reply_tokens": sum(map(len, made.values())), "dtype": str(dtype)}
    kept = [i for i, r in enumerate(records) if r["id"] in made]
    seqs = [prompts[i] + made[records[i]["id"]] for i in kept]
    prompts = [prompts[i] for i in kept]
    loss_from = [0 if "prompt" in records[i] else len(prompts[j]) - 1 for j, i in enumerate(kept)]
    print(f"distillation set: {len(seqs)} sequences, {sum(map(len, seqs)):,} tokens "
          f"({sum(len(s) - f for s, f in zip(seqs, loss_from)):,} learnt)", flush=True)
    if run.init is not None:
        start = EagleHead.from_pretrained(run.init, llm.cfg, llm.embed.weight)
        vocab, layers = start.vocab_ids.tolist(), list(start.head_cfg.layers)
    else:
        start, layers = None, default_layers(llm.cfg.num_layers)
        vocab = draft_vocab(work / "draft_vocab.json", seqs, loss_from, llm.cfg.vocab_size, run.draft_vocab)
    head = new_head(llm, vocab, layers, start).to(device)
    steps = run.steps or max(1, int(run.epochs * len(seqs) / run.batch))
    done = fit(head, target, seqs, loss_from, vocab, run, steps, work, deadline)
    save_head(run.out, llm.cfg, {k: v.detach().to(torch.bfloat16) for k, v in head.published().items()},
              vocab, layers, llm.cfg.intermediate_size)
    if (file := llm_file(run.llm)) is not None:
        write_base(run.out, file, [])
    report = {"llm": run.llm, "head": str(run.out), "steps": done, "of_steps": steps, "sequences": len(seqs),
              "tokens": sum(map(len, seqs)),
              "reply_tokens": sum(len(s) - len(p) for s, p in zip(seqs, prompts)), "draft_vocab": len(vocab), "layers": layers,
              "loss": losses(work / "loss.jsonl"),
              "agreement": score(run.out, llm, target, tokenizer, run.heldout, device, run.score_tokens)}
    (run.out / "agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def score_head(llm_ref: str, head_dir: Path, heldout: list[Path], device: str = "cpu", new_tokens: int = 64) -> dict:
    """A trained head's agreement alone (`score`)."""
    llm, target, tokenizer = load_llm(llm_ref, torch.device(device))
    return {"llm": llm_ref, "head": str(head_dir),
            "agreement": score(head_dir, llm, target, tokenizer, heldout, device, new_tokens)}


def load_llm(ref: str, device: torch.device):
    """The LLM as this project's model (the engine's), as transformers' (its forward with hidden states, the
    targets), and its tokenizer; in bfloat16 on a GPU, float32 on a CPU."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = checkpoint_dir(ref)
    dtype = resolve_dtype("auto", device)
    target = LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval().requires_grad_(False)
    return LlamaModel.from_pretrained(path, dtype=dtype, device=device), target, AutoTokenizer.from_pretrained(path)


def check_same_data(path: Path, key: dict) -> None:
    """The first run records what its data depends on; a rerun with other data stops, naming the field."""
    if path.exists():
        old = json.loads(path.read_text())
        for k, v in key.items():
            if old.get(k) != v:
                raise ValueError(f"{path.parent.parent}: made with {k}={old.get(k)}, not {v}: continue with the "
                                 f"same flags or train into another --out")
    path.write_text(json.dumps(key, indent=2) + "\n")


def requests(run: HeadRun, llm: LlamaModel, tokenizer, work: Path) -> list[dict]:
    """The file's requests in `weighted_order` (its first `count`, when given), then those the LLM writes,
    written once and kept in work/written.jsonl."""
    records = weighted_order(read_prompt_file(run.requests), run.seed) if run.requests else []
    if run.count:
        records = records[: run.count]
    if run.write:
        written = work / "written.jsonl"
        if not written.exists():
            made = written_requests(Engine(llm, mode=Mode.INCREMENTAL), tokenizer, run.write, run.seed)
            written.write_text("".join(json.dumps(r) + "\n" for r in made))
        records += read_prompt_file(written)
    if not records:
        raise ValueError("no requests: give a prompt file (--requests) or ask the LLM to write some (--write)")
    return records


def weighted_order(records: list[dict], seed: int) -> list[dict]:
    """The records in a random order (by `seed`) in which a request of kind k (its id `k-n`) comes
    KIND_WEIGHTS[k] times as early (a weighted random permutation: key u ** (1 / weight)), so that a run
    stopped early has general requests weighted up."""
    rng = random.Random(seed)
    weight = lambda r: KIND_WEIGHTS.get(str(r.get("id", "")).rsplit("-", 1)[0], 1.0)  # noqa: E731
    keys = [rng.random() ** (1 / weight(r)) for r in records]
    return [records[i] for i in sorted(range(len(records)), key=keys.__getitem__, reverse=True)]


def generation_dtype(name: str, device: torch.device) -> torch.dtype:
    """The replies' dtype: `name`, or for "auto" bfloat16 on a GPU or a CPU with AMX (where it decodes
    about 1.6x as fast as float32 at 32-96 rows), float32 elsewhere (on AVX2 alone bfloat16 is slower)."""
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if bfloat16_is_fast(device) else torch.float32


def bfloat16_is_fast(device: torch.device) -> bool:
    """Whether bfloat16 products beat float32 on `device`: a GPU, or a CPU with AMX. Replies are decoded and
    the head trained (bf16 autocast: the LLM's forward and the head's, 1.8x float32 on an AMX Xeon) in it."""
    return device.type == "cuda" or (device.type == "cpu" and torch.cpu._is_amx_tile_supported())


def decoder(ref: str, llm: LlamaModel, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """The model that decodes the replies: `llm` itself, or the checkpoint again in `dtype`."""
    return llm if dtype == llm.dtype else LlamaModel.from_pretrained(checkpoint_dir(ref), dtype=dtype, device=device)


def engine_for(llm: LlamaModel, prompts: list[list[int]], new_tokens: int, batch: int) -> Engine:
    """Incremental decoding with a KV pool for `batch` of the prompts at once (the default pool of SmolLM2
    in float32 is 3 GB)."""
    return Engine(llm, mode=Mode.INCREMENTAL, kv_tokens=batch * (max(map(len, prompts)) + new_tokens + BLOCK_SIZE))


class RepliesFile:
    """Replies kept in a gzip file of JSON lines, one gzip member per batch appended: a first line
    {"meta": ...} (what the replies depend on: a file made otherwise is refused, naming the field), then
    {"id": request id, "reply": token ids} per reply. A member cut short (a run stopped mid-write) is
    dropped, and the file truncated to the members before it. The decoding's "dtype" is kept per member
    and may differ between them: greedy replies in bfloat16 and in float32 are both the LLM's, parting at
    near-ties, and the head's targets are the LLM's distributions computed during training whatever the
    sequence; a CPU without fast bfloat16 adds float32 replies to a file begun in bfloat16."""

    PER_MEMBER = frozenset({"dtype"})

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = Path(path), meta

    def read(self) -> dict[str, list[int]]:
        data = self.path.read_bytes() if self.path.exists() else b""
        out, good = {}, 0
        while good < len(data):
            d = zlib.decompressobj(wbits=31)
            try:
                lines = d.decompress(data[good:]).decode().splitlines()
            except zlib.error:
                break
            if not d.eof:
                break
            first = json.loads(lines[0])["meta"]
            for k, v in self.meta.items():
                if k not in self.PER_MEMBER and first.get(k) != v:
                    raise ValueError(f"{self.path}: replies made with {k}={first.get(k)}, not {v}: give the same "
                                     f"flags or another --replies")
            out.update((r["id"], r["reply"]) for r in map(json.loads, lines[1:]))
            good = len(data) - len(d.unused_data)
        if good < len(data):
            print(f"{self.path}: {len(data) - good} bytes of an unfinished batch dropped", flush=True)
            with open(self.path, "r+b") as f:
                f.truncate(good)
        return out

    def append(self, replies: list[tuple[str, list[int]]]) -> None:
        lines = [json.dumps({"meta": self.meta}), *(json.dumps({"id": i, "reply": r}) for i, r in replies)]
        z = zlib.compressobj(9, wbits=31)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            f.write(z.compress(("\n".join(lines) + "\n").encode()) + z.flush())


def replies(make_model, records: list[dict], prompts: list[list[int]], new_tokens: int, sampling: SamplingParams,
            store: RepliesFile, batch: int, stop: float | None = None) -> dict[str, list[int]]:
    """Request id -> the LLM's reply (EOS kept) for every record, those `store` holds already read back,
    the rest decoded `batch` at a time (the model made by `make_model()` only when there is something to
    decode) and appended to it; after `stop` (time.monotonic()) no new batch starts."""
    made = store.read()
    todo = [i for i, r in enumerate(records) if r["id"] not in made]
    if not todo:
        return made
    engine = engine_for(make_model(), [prompts[i] for i in todo], new_tokens, batch)
    tokens = sum(map(len, made.values()))
    bar = tqdm(total=len(records), initial=len(records) - len(todo), desc="the LLM's replies", unit="req")
    for start in range(0, len(todo), batch):
        if stop is not None and time.monotonic() > stop:
            break
        part = todo[start: start + batch]
        gens = engine.generate([Request(prompts[i], new_tokens, dataclasses.replace(sampling, seed=sampling.seed + i),
                                        id=str(i)) for i in part])
        store.append([(records[i]["id"], g.token_ids) for i, g in zip(part, gens)])
        made.update((records[i]["id"], g.token_ids) for i, g in zip(part, gens))
        tokens += sum(len(g.token_ids) for g in gens)
        bar.update(len(part))
        bar.set_postfix(reply_tokens=f"{tokens:,}")
    bar.close()
    return made


def draft_vocab(path: Path, seqs: list[list[int]], loss_from: list[int], vocab_size: int, size: int) -> list[int]:
    """The `size` tokens the replies use most (chosen once, kept in `path`)."""
    if not path.exists():
        counts = torch.bincount(torch.cat([torch.tensor(s[f:]) for s, f in zip(seqs, loss_from)]), minlength=vocab_size)
        vocab = sorted(counts.argsort(descending=True, stable=True)[: min(size, vocab_size)].tolist())
        path.write_text(json.dumps({"token_ids": vocab}) + "\n")
    return json.loads(path.read_text())["token_ids"]


def new_head(llm: LlamaModel, vocab: list[int], layers: list[int], start: EagleHead | None = None) -> EagleHead:
    """A head for `llm` to train: `start`'s weights (a trained head, going on), or its embedding (frozen),
    its LM head's rows of `vocab` and its final norm, the layer's hidden half of the attention and its MLP
    from the LLM's last layer, the rest at random."""
    m = dataclasses.replace(llm.cfg, num_layers=1)
    head = EagleHead(HeadConfig(m, len(vocab), llm.cfg.hidden_size, tuple(layers), False))
    H = m.hidden_size
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1 else torch.ones(p.shape))
        last = llm.layers[-1]
        head.embed.weight.copy_(llm.embed.weight)
        head.lm_head.weight.copy_(llm.lm_head.weight[:, vocab])
        head.norm.weight.copy_(llm.norm.weight)
        L = head.layers[0]
        L.qkv.weight[H:].copy_(last.qkv.weight)
        for name in ("o", "post_norm", "gate_up", "down"):
            getattr(L, name).weight.copy_(getattr(last, name).weight)
        L.input_norm.weight.copy_(last.input_norm.weight)
        L.hidden_norm.weight.copy_(last.input_norm.weight)
        if start is not None:
            try:
                head.load_state_dict(start.state_dict())
            except RuntimeError as e:
                raise ValueError(f"--init: the head's shapes are not this LLM's head's: {e}") from None
    head.vocab_ids = torch.tensor(vocab)
    head.embed.weight.requires_grad_(False)
    return head.float()


@torch.no_grad()
def targets(target, tokens: torch.Tensor, lengths: torch.Tensor, layers: list[int]):
    """The LLM's forward over right-padded `tokens` [B, T]: features [B, T, len(layers) * H] (float32) and
    its top-32 next-token distribution at every position, ids [B, T, 32] and probs [B, T, 32]."""
    mask = (torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]).long()
    out = target(input_ids=tokens, attention_mask=mask, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in layers], -1).float()
    probs, ids = out.logits.float().softmax(-1).topk(TOP_K, dim=-1)
    return feats, ids, probs / probs.sum(-1, keepdim=True)


def soft_loss(head: EagleHead, outs, index: torch.Tensor, ids, probs, mask, weight: float) -> torch.Tensor:
    """Training-time test's loss: over steps k, weight^k x the cross-entropy of the head's distribution over
    its draft vocabulary against the LLM's top-32 (its part in the draft vocabulary, renormalized) at the
    step's target positions. ids, probs [B, T, 32], mask [B, T]: the positions learnt."""
    total, norm = 0.0, 0.0
    n = outs[0].shape[1]
    for k, out in enumerate(outs):
        pos = torch.arange(n, device=mask.device) + 1 + k  # the LLM row whose next token step k's node predicts
        ok = pos < ids.shape[1]
        pos = pos.clamp(max=ids.shape[1] - 1)
        b, j = ((mask[:, pos] * ok) > 0).nonzero(as_tuple=True)  # the rows learnt: the LM head runs on these only
        tid = index[ids[b, pos[j]]]  # [rows, 32]
        tp = probs[b, pos[j]] * (tid >= 0)
        tp = tp / tp.sum(-1, keepdim=True).clamp(min=1e-9)
        logp = head.lm_head(head.norm(out[b, j])[0]).float().log_softmax(-1)  # [rows, Vd]
        total = total + weight ** k * -(tp * logp.gather(-1, tid.clamp(min=0))).sum(-1).mean()
        norm += weight ** k
    return total / norm


def fit(head: EagleHead, target, seqs, loss_from, vocab, run: HeadRun, steps: int, work: Path, deadline) -> int:
    """Training-time test on batches of like lengths, targets online; resumes from work/state.pt."""
    device = next(head.parameters()).device
    layers = list(head.head_cfg.layers)
    index = torch.full((head.cfg.vocab_size,), -1, dtype=torch.long, device=device)
    index[torch.tensor(vocab, device=device)] = torch.arange(len(vocab), device=device)
    gen = torch.Generator().manual_seed(run.seed)
    order = sorted(range(len(seqs)), key=lambda r: len(seqs[r]))
    pad = lambda xs, v: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=v).to(device)  # noqa: E731

    def loss():
        start = int(torch.randint(0, max(1, len(order) - run.batch + 1), (1,), generator=gen))
        rows = order[start: start + run.batch]
        tokens = pad([torch.tensor(seqs[r]) for r in rows], 0)
        lengths = torch.tensor([len(seqs[r]) for r in rows], device=device)
        learnt = pad([(torch.arange(len(seqs[r])) >= loss_from[r]).float() for r in rows], 0.0)
        feats, ids, probs = targets(target, tokens, lengths, layers)
        rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
        noise = torch.rand(feats.shape, generator=gen).to(device) * 2 - 1
        outs = head.chains(feats + noise * run.noise * rms, tokens, run.ttt)
        return soft_loss(head, outs, index, ids, probs, learnt, 0.8)

    with reference_kernels():
        return optimize(head, loss, steps, run.lr, 0.0, (0.9, 0.95), gen, work / "state.pt", "head (TTT)",
                        autocast=bfloat16_is_fast(device), device=device.type, deadline=deadline, log=work / "loss.jsonl")


@contextlib.contextmanager
def reference_kernels():
    """The head's chains run the fused elementwise ops' PyTorch references: the Triton kernels (chosen on a
    GPU) have no backward and want one dtype, and autocast mixes bf16 activations with fp32 weights."""
    old = os.environ.get("SPECINFER_FUSED")
    os.environ["SPECINFER_FUSED"] = "reference"
    try:
        yield
    finally:
        if old is None:
            del os.environ["SPECINFER_FUSED"]
        else:
            os.environ["SPECINFER_FUSED"] = old


def losses(log: Path, window: int = 10) -> dict:
    """The mean loss of the first and of the last `window` steps logged (of each half, when fewer)."""
    values = [json.loads(line)["loss"] for line in log.read_text().splitlines()] if log.exists() else []
    window = max(1, min(window, len(values) // 2))
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    return {"first": mean(values[:window]), "last": mean(values[-window:]), "steps_logged": len(values)}


@torch.no_grad()
def agreement(head: EagleHead, target, seqs: list[list[int]], prompt_lens: list[int]) -> dict:
    """Teacher-forced on the LLM's features: at each reply position, whether the head's first drafted
    token is the LLM's next token, and how many drafts of a chain of CHAIN are right from its start."""
    device = head.embed.weight.device
    first, chain, n = 0, 0, 0
    for s, p in zip(seqs, prompt_lens):
        tokens = torch.tensor([s], device=device)
        feats = targets(target, tokens, torch.tensor([len(s)], device=device), list(head.head_cfg.layers))[0]
        outs = head.chains(feats.to(head.dtype), tokens, CHAIN)
        roots = torch.arange(p - 2, len(s) - 2, device=device)  # pair j predicts token j + 2: the reply's tokens
        steps = torch.arange(CHAIN, device=device)[:, None]
        hits = torch.stack([head.lm_logits(o[0, roots]).argmax(-1) == tokens[0, (roots + 2 + k).clamp(max=len(s) - 1)]
                            for k, o in enumerate(outs)])  # [CHAIN, roots]
        hits &= (roots + 2 + steps) < len(s)
        first += int(hits[0].sum())
        chain += int(hits.int().cumprod(0).sum())
        n += len(roots)
    return {"positions": n, "first_token": round(first / max(n, 1), 4), f"chain{CHAIN}_mean": round(chain / max(n, 1), 3)}


def score(head_dir: Path, llm: LlamaModel, target, tokenizer, heldout: list[Path], device, new_tokens: int) -> dict:
    """The head at `head_dir`'s agreement on each held-out file's code prompts and chat requests apart."""
    head = EagleHead.from_pretrained(head_dir, llm.cfg, llm.embed.weight, dtype=llm.dtype, device=device)
    report = {}
    for file in heldout:
        records = read_prompt_file(file)
        for kind, part in (("code", [r for r in records if "prompt" in r]), ("chat", [r for r in records if "messages" in r])):
            if not part:
                continue
            prompts = [prompt_ids(tokenizer, r) for r in part]
            engine = engine_for(llm, prompts, new_tokens, len(prompts))
            gens = engine.generate([Request(p, new_tokens, id=str(i)) for i, p in enumerate(prompts)])
            seqs = [p + g.token_ids for p, g in zip(prompts, gens)]
            name = f"{Path(file).stem}/{kind}"
            with reference_kernels():
                report[name] = {"prompts": len(part), **agreement(head, target, seqs, list(map(len, prompts)))}
            print(f"{name}: {report[name]}", flush=True)
    return report
