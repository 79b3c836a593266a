"""The distillation set of the default LLM's feature drafter (scripts/train_head.py): requests, the LLM's
greedy replies, and at every position of them the LLM's features (the residual stream entering its
EAGLE-3 layers) and its top-32 next-token distribution.

Three kinds of request, so that the head learns the LLM rather than one kind of text:
  - code: continuations of windows of the corpus (the Python source every machine with the project has);
  - code chat: requests made from the corpus's functions (write it, or explain it), as SSM 0 was trained;
  - general: questions and tasks of every kind, which the LLM writes itself from a list of topics and
    kinds of request (sampled, one seed each). None of the topics is a subject of the held-out general
    requests (models/smollm2/general_prompts.jsonl).
and, as EAGLE's heads learn from a fixed corpus, windows of the corpus itself with the LLM's features
and targets (no reply: volume for the cost of one forward).
Each stage is cached under --work in chunks, so a run that stops resumes where it was.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tqdm import tqdm

from specinfer.generate import Engine, Request
from specinfer.prompts import prompt_ids
from specinfer.sampling import SamplingParams

TOPICS = [
    # nature and science
    "volcanoes", "earthquakes", "the deep ocean", "rainforests", "deserts", "glaciers", "rivers", "coral reefs",
    "bees", "bird migration", "whales", "ants", "mushrooms", "sharks", "dinosaurs", "octopuses", "wolves",
    "atoms", "electricity", "magnets", "DNA", "evolution", "the human heart", "the brain", "bones", "bacteria",
    "sound", "lenses and light", "gravity", "the Moon", "the periodic table", "batteries", "microscopes",
    "chemical reactions in baking", "rainbows", "tides",
    # history and society
    "ancient Egypt", "the Vikings", "the Industrial Revolution", "the Renaissance", "the Silk Road", "the Cold War",
    "the printing press", "the Ottoman Empire", "medieval castles", "the civil rights movement", "the Aztecs",
    "democracy", "voting", "recycling", "volunteering", "city traffic", "public transport", "school uniforms",
    "homework", "museums", "libraries", "the ethics of artificial intelligence", "privacy online",
    # technology
    "smartphones", "how the internet works", "email spam", "cloud storage", "electric cars", "3D printing", "GPS",
    "strong passwords", "video games", "social media", "solar panels on a house", "robots in factories",
    # daily life
    "making a monthly budget", "grocery shopping", "cleaning a kitchen", "doing laundry", "moving to a new city",
    "job interviews", "writing a CV", "time management", "making friends as an adult", "raising toddlers",
    "caring for a dog", "keeping fish", "houseplants", "riding a bicycle", "car maintenance", "cooking pasta",
    "baking bread", "coffee", "tea", "spices", "vegetarian dinners", "birthday parties", "weddings",
    "travelling in Japan", "travelling in Italy", "long train journeys", "saving energy at home", "minimalism",
    "negotiating a salary", "working from home", "starting a small business", "customer service",
    # arts and language
    "watercolour painting", "jazz", "learning the guitar", "learning the piano", "photography", "writing a novel",
    "making a short film", "dance", "theatre", "sculpture", "haiku", "grammar", "idioms", "writing essays",
    "spelling", "children's books", "mythology", "fairy tales", "comic books",
    # health and sport
    "drinking enough water", "stretching", "running a first 5k", "yoga", "good posture", "eye strain", "first aid",
    "the common cold", "allergies", "stress at work", "football", "basketball", "tennis", "swimming",
    "the Olympic Games", "cycling races", "mountain climbing",
    # money and numbers
    "taxes", "banks", "the stock market", "supply and demand", "international trade", "unemployment",
    "fractions", "probability", "geometry", "prime numbers", "statistics", "percentages", "measuring units",
]

KINDS = [
    "a question", "a request for advice", "a request to explain something", "a request for a list of ideas",
    "a request to write a short poem, story or letter", "a request to compare two things",
]


def general_requests(engine: Engine, tokenizer, count: int, seed: int) -> list[str]:
    """`count` requests the LLM writes itself, each from a (topic, kind) pair and its own seed."""
    rng = random.Random(seed)
    pairs = [(rng.choice(TOPICS), rng.choice(KINDS)) for _ in range(count)]
    asks = [prompt_ids(tokenizer, {"messages": [{"role": "user", "content":
            f"Write {kind} that a person might send to an AI assistant about {topic}. "
            f"Write only the request itself, in one or two sentences."}]}) for topic, kind in pairs]
    out = []
    for i in tqdm(range(0, count, 64), desc="general: writing requests"):
        gens = engine.generate([Request(a, 48, SamplingParams(temperature=0.8, seed=seed * 100003 + i + k), id=str(k))
                                for k, a in enumerate(asks[i : i + 64])])
        for (topic, kind), g in zip(pairs[i : i + 64], gens):
            text = tokenizer.decode(g.token_ids, skip_special_tokens=True).strip().split("\n")[0].strip(' "')
            out.append(text if 15 <= len(text) <= 300 else f"Tell me something interesting about {topic}.")
    return out


def replies(engine: Engine, prompts: list[list[int]], new_tokens: int, cache: Path, desc: str) -> list[list[int]]:
    """prompt + the LLM's greedy reply (EOS kept) for each prompt, 64 at a time, cached by chunk."""
    out = []
    chunks = range(0, len(prompts), 64)
    for i in tqdm(chunks, desc=desc):
        f = cache.with_name(f"{cache.name}-{i // 64}.pt")
        if f.exists():
            out += torch.load(f)
            continue
        gens = engine.generate([Request(p, new_tokens, id=str(k)) for k, p in enumerate(prompts[i : i + 64])])
        part = [p + g.token_ids for p, g in zip(prompts[i : i + 64], gens)]
        torch.save(part, f)
        out += part
    return out


@torch.no_grad()
def features_and_targets(hf, seqs: list[list[int]], layers: list[int], top_k: int = 32):
    """Per sequence: the residual stream entering each of `layers` ([T, len(layers) * H], bfloat16)
    and the LLM's top-k next-token distribution at every position (ids int32, probs float16)."""
    feats, ids, probs = [], [], []
    for s in tqdm(seqs, desc="LLM features and targets"):
        out = hf(input_ids=torch.tensor([s]), output_hidden_states=True)
        feats.append(torch.cat([out.hidden_states[i][0] for i in layers], -1).to(torch.bfloat16))
        p = out.logits[0].float().softmax(-1)
        v, k = p.topk(top_k, dim=-1)
        ids.append(k.int())
        probs.append((v / v.sum(-1, keepdim=True)).half())
    return feats, ids, probs
