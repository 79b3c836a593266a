"""Our decoding modes in-process (the core Engine), one request at a time like the peers.

No command of its own: a part of `specinfer bench` (`python -m specinfer_cli bench`).
"""

from __future__ import annotations

import time

from specinfer.checkpoints import checkpoint_dir
from specinfer.engine import add_tallies
from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel
from specinfer.prompts import prompt_ids
from specinfer.sampling import SamplingParams

CONFIGS = [  # (label, mode, expansion, context lookup: False, True (merged with the SSM's trees) or None (alone, no SSM))
    ("ours incremental", Mode.INCREMENTAL, [], False),
    ("ours sequence <1x4>", Mode.SEQUENCE, [1] * 4, False),
    ("ours sequence <1x8>", Mode.SEQUENCE, [1] * 8, False),
    ("ours tree <2,1,1>", Mode.TREE, [2, 1, 1], False),
    ("ours tree <1,1,3,1,1,1,1,1>", Mode.TREE, [1, 1, 3, 1, 1, 1, 1, 1], False),
    ("ours tree <2,2,2,1,1,1,1,1>", Mode.TREE, [2, 2, 2, 1, 1, 1, 1, 1], False),
    ("ours merged <2,1,1>", Mode.MERGED, [2, 1, 1], False),
    ("ours merged <2,2,2,1,1,1,1,1>", Mode.MERGED, [2, 2, 2, 1, 1, 1, 1, 1], False),
]
QUICK = {"ours incremental", "ours sequence <1x4>", "ours tree <2,1,1>", "ours tree <1,1,3,1,1,1,1,1>",
         "ours merged <2,1,1>"}


def run(llm: LlamaModel, ssms: list[LlamaModel], mode: Mode, expansion: list[int], prompts: list[list[int]],
        max_new_tokens: int, temperature: float, lookup: bool = False, mss: bool = False, heads=(),
        adaptive: bool = False, dynamic: bool = False) -> tuple[list[list[int]], dict]:
    """Outputs and figures: tokens, LLM forwards (prefill included), per-request seconds, and the
    acceptance by depth (share of steps whose accepted path reached depth d), each drafter's
    [accepted, drafted] nodes (numbered as Chunk.drafters: the SSMs, the heads, lookup). heads: feature
    drafters beside the SSMs; adaptive: the controller picks each step's depth of `expansion`;
    dynamic: the drafters' dynamic trees."""
    engine = Engine(llm, ssms, mode, expansion, lookup=lookup, heads=list(heads), adaptive=adaptive, dynamic=dynamic)
    outs, seconds, forwards, drafters = [], [], 0, {}
    reached = [0] * len(expansion)  # deeper where a step accepted more (a lookup chain may outgrow the expansion)
    for i, p in enumerate(prompts):
        start = time.perf_counter()
        g = engine.generate([Request(p, max_new_tokens, SamplingParams(temperature, seed=i, mss=mss), id=str(i))])[0]
        seconds.append(time.perf_counter() - start)
        outs.append(g.token_ids)
        forwards += g.steps
        for a in g.accepted:
            reached += [0] * (a - len(reached))
            for d in range(a):
                reached[d] += 1
        drafters = add_tallies(drafters, g.drafters)
    return outs, {"tokens": sum(map(len, outs)), "forwards": forwards, "request_seconds": seconds,
                  "acceptance_by_depth": [r / max(forwards, 1) for r in reached], "drafters": drafters}


def reference_greedy(llm: LlamaModel, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The LLM's own incremental greedy decoding, batched."""
    engine = Engine(llm, mode=Mode.INCREMENTAL)
    return [g.token_ids for g in engine.generate([Request(p, max_new_tokens) for p in prompts])]


def load_prompt_ids(llm, records: list[dict]) -> list[list[int]]:
    """Prompt file records as token ids, with the LLM's tokenizer (and chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(llm))
    return [prompt_ids(tokenizer, r) for r in records]
