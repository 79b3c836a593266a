"""The optimizer loop every model trained here shares (the fixtures, SmolLM2's drafters, feature heads):
AdamW with warmup and cosine decay, a resumable checkpoint of the training state, a progress bar and
an optional deadline. What a step's loss is, and where its batch comes from, is the caller's."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def optimize(model, loss_of_step, steps, lr, weight_decay, betas, gen, ckpt: Path, desc, every_s=300.0,
             autocast: bool = True, device: str = "cpu", deadline: float | None = None,
             log: Path | None = None) -> int:
    """AdamW with warmup + cosine decay; loss_of_step() draws its own batch from `gen` and returns the
    loss, computed under bf16 autocast on `device` (on a CPU twice as fast as fp32 with AVX512-BF16;
    `autocast` False: in float32, faster on a CPU without it). The model, the optimizer and `gen` are
    saved to `ckpt` every `every_s` seconds, at the last step and at `deadline` (time.monotonic()),
    where it stops; a rerun resumes from there. `log` gets a line {"step", "loss"} per step. Returns
    the steps done so far, the resumed ones included."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"].cpu())
        start = state["step"]
    model.train()
    bar = tqdm(range(start, steps), desc=desc, initial=start, total=steps)
    saved, step = time.monotonic(), start
    with open(log, "a") if log else contextlib.nullcontext() as lines:
        for step in bar:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):  # fp32 weights and optimizer, bf16 matmuls
                loss = loss_of_step()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if lines:
                lines.write(json.dumps({"step": step, "loss": round(loss.item(), 5)}) + "\n")
            step += 1
            late = deadline is not None and time.monotonic() > deadline
            if time.monotonic() - saved > every_s or step == steps or late:
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step}
                torch.save(state, ckpt.with_suffix(".tmp"))
                ckpt.with_suffix(".tmp").replace(ckpt)
                saved = time.monotonic()
            if late:
                break
    bar.close()
    model.eval()
    return step
