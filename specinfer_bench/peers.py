"""The baselines a user has without us, run through transformers on the same checkpoints:
incremental `generate`, and assisted generation (sequence speculative decoding) with an SSM as
the assistant. One request at a time, as transformers serves them.

No command of its own: a part of `specinfer bench` (`python -m specinfer_cli bench`).
"""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM

from specinfer.checkpoints import checkpoint_dir


def load(path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(path), dtype=torch.float32).eval()
    model.forwards = 0  # LLM forward passes, counted by a hook
    model.register_forward_hook(lambda m, *_: setattr(m, "forwards", m.forwards + 1))
    return model


@torch.no_grad()
def run(llm, prompts: list[list[int]], max_new_tokens: int, temperature: float, assistant=None,
        num_assistant_tokens: int | None = None, seed: int = 0) -> tuple[list[list[int]], dict]:
    """Outputs and figures: tokens, LLM forwards, per-request seconds. num_assistant_tokens None
    keeps the assistant's default schedule; a number fixes it ("constant" schedule)."""
    if assistant is not None and num_assistant_tokens is not None:
        assistant.generation_config.num_assistant_tokens = num_assistant_tokens
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    outs, seconds, forwards = [], [], 0
    for i, p in enumerate(prompts):
        torch.manual_seed(seed + i)
        ids = torch.tensor([p])
        llm.forwards = 0
        start = time.perf_counter()
        out = llm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           assistant_model=assistant, **sampling)
        seconds.append(time.perf_counter() - start)
        forwards += llm.forwards
        outs.append(out[0, len(p):].tolist())
    return outs, {"tokens": sum(map(len, outs)), "forwards": forwards, "request_seconds": seconds}
