"""Writes arithmetic.jsonl: 160 four-way multiple-choice sums (a + b with a, b in 1..40; the wrong
choices one off, ten off and the digits swapped), seeded, for the lm-evaluation-harness task
arithmetic.yaml that scores them through the gateway (bench/results/lm_eval_cpu.md)."""

import json
import random
from pathlib import Path

rng = random.Random(0)
with open(Path(__file__).with_name("arithmetic.jsonl"), "w") as fh:
    for _ in range(160):
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        s = a + b
        wrong = [w for w in dict.fromkeys([s + 1, s - 1, s + 10, int(str(s)[::-1]), s + 2]) if w != s and w > 0][:3]
        choices = [str(x) for x in rng.sample([s] + wrong, 4)]
        fh.write(json.dumps({"question": f"Question: What is {a} plus {b}?\nAnswer:", "choices": choices,
                             "answer": choices.index(str(s))}) + "\n")
