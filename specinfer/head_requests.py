"""Requests to distil a feature head from (`head_training.py`): what the LLM is asked, so that its replies
teach the head the LLM rather than one kind of text.

Two sources:
  - the request set: general questions and tasks of every kind, code and code chat, made from templates
    x topics x kinds, bare code prompts (windows of the standard library's source for the LLM to
    continue) and requests to write or explain a function of the standard library, as the held-out chat
    requests are made (`request_set`; shipped as models/requests/train.jsonl, `python -m
    specinfer.head_requests models/requests/train.jsonl`). Template-made, not written by people.
  - the LLM writing requests itself from a topic and a kind of request, sampled, one seed each
    (`written_requests`).
None of the topics is a subject of the held-out general requests (models/smollm2/general_prompts.jsonl).
"""

from __future__ import annotations

import ast
import json
import random
import sys
import sysconfig
import zlib
from pathlib import Path

from .generate import Engine, Request
from .prompts import prompt_ids
from .sampling import SamplingParams

TOPICS = [
    # nature and science
    "volcanoes", "earthquakes", "the deep ocean", "rainforests", "deserts", "glaciers", "rivers", "coral reefs",
    "bees", "bird migration", "whales", "ants", "mushrooms", "sharks", "dinosaurs", "octopuses", "wolves",
    "atoms", "electricity", "magnets", "DNA", "evolution", "the human heart", "the brain", "bones", "bacteria",
    "sound", "lenses and light", "gravity", "the Moon", "the periodic table", "batteries", "microscopes",
    "chemical reactions in baking", "rainbows", "tides", "comets", "Mars", "the Sun", "hurricanes", "caves",
    "frogs", "elephants", "owls", "butterflies", "penguins", "trees in autumn", "soil", "fossils", "crystals",
    # history and society
    "ancient Egypt", "the Vikings", "the Industrial Revolution", "the Renaissance", "the Silk Road", "the Cold War",
    "the printing press", "the Ottoman Empire", "medieval castles", "the civil rights movement", "the Aztecs",
    "democracy", "voting", "recycling", "volunteering", "city traffic", "public transport", "school uniforms",
    "homework", "museums", "libraries", "the ethics of artificial intelligence", "privacy online", "the Great Wall",
    "the Roman roads", "the invention of the telephone", "the first moon landing", "ancient Greece", "samurai",
    "pirates", "the history of money", "the Olympic truce", "city planning", "local newspapers",
    # technology
    "smartphones", "how the internet works", "email spam", "cloud storage", "electric cars", "3D printing", "GPS",
    "strong passwords", "video games", "social media", "solar panels on a house", "robots in factories",
    "databases", "open source software", "computer viruses", "wifi routers", "spreadsheets", "search engines",
    "drones", "smart watches", "online shopping", "QR codes", "backups",
    # daily life
    "making a monthly budget", "grocery shopping", "cleaning a kitchen", "doing laundry", "moving to a new city",
    "job interviews", "writing a CV", "time management", "making friends as an adult", "raising toddlers",
    "caring for a dog", "keeping fish", "houseplants", "riding a bicycle", "car maintenance", "cooking pasta",
    "baking bread", "coffee", "tea", "spices", "vegetarian dinners", "birthday parties", "weddings",
    "travelling in Japan", "travelling in Italy", "long train journeys", "saving energy at home", "minimalism",
    "negotiating a salary", "working from home", "starting a small business", "customer service", "camping",
    "packing a suitcase", "fixing a bicycle tyre", "painting a room", "composting", "sewing", "knitting",
    "buying a used car", "planning a road trip", "hosting a dinner", "cooking rice", "making pizza at home",
    # arts and language
    "watercolour painting", "jazz", "learning the guitar", "learning the piano", "photography", "writing a novel",
    "making a short film", "dance", "theatre", "sculpture", "haiku", "grammar", "idioms", "writing essays",
    "spelling", "children's books", "mythology", "fairy tales", "comic books", "opera", "folk music",
    "calligraphy", "pottery", "crossword puzzles", "podcasts",
    # health and sport
    "drinking enough water", "stretching", "running a first 5k", "yoga", "good posture", "eye strain", "first aid",
    "the common cold", "allergies", "stress at work", "football", "basketball", "tennis", "swimming",
    "the Olympic Games", "cycling races", "mountain climbing", "table tennis", "skiing", "rowing", "meditation",
    # money and numbers
    "taxes", "banks", "the stock market", "supply and demand", "international trade", "unemployment",
    "fractions", "probability", "geometry", "prime numbers", "statistics", "percentages", "measuring units",
    "insurance", "pensions", "credit cards", "exchange rates", "algebra", "logarithms", "graphs and charts",
]

KINDS = [
    "a question", "a request for advice", "a request to explain something", "a request for a list of ideas",
    "a request to write a short poem, story or letter", "a request to compare two things",
]

GENERAL = [
    "What is {t}?", "How does {t} work?", "Why is {t} important?", "Tell me something surprising about {t}.",
    "Give me three facts about {t}.", "Explain {t} in simple words.", "Explain {t} to a child.",
    "What are common mistakes people make with {t}?", "What are the pros and cons of {t}?",
    "Summarize what people should know about {t} in one paragraph.", "Write a short poem about {t}.",
    "Write a haiku about {t}.", "Write a short story that involves {t}.", "Write a limerick about {t}.",
    "Write a friendly letter to a friend about {t}.", "Give me five ideas related to {t}.",
    "List some questions a beginner might ask about {t}.", "How would you teach {t} to a beginner?",
    "What is the history of {t}?", "What might the future of {t} look like?", "Give me advice about {t}.",
    "I want to learn about {t}. Where should I start?", "Write a short quiz with answers about {t}.",
    "Describe {t} in three sentences.", "What are the main ideas behind {t}?", "Write a tweet about {t}.",
    "Write a short speech about {t}.", "What are some myths about {t}?", "Write a product description for a book about {t}.",
    "Make a study plan for learning about {t} in a week.", "What jobs are connected to {t}?",
    "Write a dialogue between two friends discussing {t}.", "Create a short lesson plan about {t}.",
    "What would a scientist say about {t}?", "Explain {t} using an analogy.",
    "Write an outline for an essay about {t}.", "Write the opening paragraph of a blog post about {t}.",
    "Write an email inviting colleagues to a talk about {t}.", "Write a riddle whose answer is {t}.",
    "Give me a fun fact about {t} that I can share at dinner.", "What books or resources would you suggest about {t}?",
    "Write a short news headline and summary about {t}.", "Write a motivational quote inspired by {t}.",
    "What are three open questions about {t}?", "Write a children's song about {t}.",
    "Explain {t} as if you were a pirate.", "Write a short review of a documentary about {t}.",
    "How has {t} changed in the last hundred years?", "What should a tourist know about {t}?",
    "Give me a step-by-step guide related to {t}.", "Write a mnemonic to remember something about {t}.",
    "Describe {t} from the point of view of a cat.", "Write a formal definition of {t}.",
    "What is the most common question about {t}, and its answer?", "Write a short debate opening for and against {t}.",
    "Write five multiple-choice questions about {t}.", "Tell me a joke about {t}.",
    "What vocabulary words should I know to talk about {t}?", "Write a diary entry of someone who loves {t}.",
    "How is {t} different around the world?",
]

LANGS = ["French", "Spanish", "German", "Italian", "Portuguese"]

TRANSLATE = [
    "Translate into {lang}: 'I would like to learn more about {t}.'",
    "Translate into {lang}: 'My friend told me a story about {t}.'",
    "How do you say '{t}' in {lang}? Use it in a sentence.",
    "Rewrite this sentence to sound more formal, then translate it into {lang}: 'I think {t} is really cool.'",
]

COMPARE = ["Compare {t} and {u}.", "What do {t} and {u} have in common?", "Which is more interesting, {t} or {u}? Why?",
           "Write a short poem that mentions both {t} and {u}."]

LANGUAGES = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "SQL", "Bash"]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a text", "removes duplicates from a list while keeping the order", "merges two sorted lists",
    "finds the largest element of an array", "computes the factorial of n", "checks whether a string is a palindrome",
    "flattens a nested list", "parses a CSV line into fields", "converts Celsius to Fahrenheit",
    "finds the most common element in a list", "sorts a list of records by a key", "implements binary search",
    "reads a file and counts its lines", "validates an email address", "computes the greatest common divisor",
    "transposes a matrix", "groups words by their first letter", "implements a stack", "implements a queue",
    "implements a linked list", "computes the average of a list of numbers", "rotates an array by k positions",
    "checks whether two strings are anagrams", "converts a number to Roman numerals", "finds all permutations of a string",
    "computes the running sum of a list", "splits a list into chunks of size n", "finds the intersection of two lists",
    "capitalizes every word of a sentence", "counts the vowels in a string", "generates all subsets of a set",
    "implements bubble sort", "implements quicksort", "implements merge sort", "parses a date string",
    "formats a number with thousands separators", "computes the distance between two points",
    "retries a function call up to three times", "memoizes a function", "reads JSON from a file",
    "writes a dictionary to a JSON file", "implements an LRU cache", "checks balanced parentheses",
    "computes the median of a list", "finds the longest common prefix of strings", "converts a binary string to an integer",
    "counts the frequency of each character", "implements a simple calculator", "builds a histogram of values",
    "finds the second largest number in a list", "removes whitespace from both ends of every line",
    "computes a moving average", "validates a password's strength", "implements a binary tree insert",
    "performs a breadth-first search on a graph", "performs a depth-first search on a graph",
    "finds the shortest path with Dijkstra's algorithm", "converts a list of pairs into a dictionary",
    "paginates a list of items", "computes the dot product of two vectors", "checks whether a year is a leap year",
]

CODE = [
    "Write a {lang} function that {task}.", "How do I write code in {lang} that {task}?",
    "Show me a {lang} snippet that {task}, with comments.", "Write a unit test for a {lang} function that {task}.",
    "What is the time complexity of a function that {task}? Show it in {lang}.",
    "Write a {lang} function that {task}, and explain how it works.",
]

CODE_CHAT = [
    "I'm learning {lang}. What is the idiomatic way to {verb}?", "In {lang}, how do I {verb}?",
    "My {lang} program is slow when I {verb}. How can I speed it up?", "What is the best practice in {lang} to {verb}?",
    "Explain, with an example, how to {verb} in {lang}.", "What errors can happen when I {verb} in {lang}, and how do I handle them?",
]

CODE_VERBS = [
    "read a file line by line", "handle exceptions", "define a class", "use a dictionary", "loop over a list with indexes",
    "format strings", "write a unit test", "parse command-line arguments", "make an HTTP request", "sort a list of objects",
    "work with dates and times", "use regular expressions", "run code in parallel", "log messages", "read environment variables",
    "structure a project", "write documentation", "manage dependencies", "connect to a database", "serialize data to JSON",
    "write a recursive function", "avoid global variables", "use higher-order functions", "write an iterator",
    "copy a data structure deeply", "compare floating-point numbers", "measure how long code takes", "handle Unicode text",
    "debug a crash", "write a command-line tool",
]


HELDOUT_EVERY = 20  # the corpus's held-out files: crc32 of the name % 20 == 0 (scripts/train_fixtures.py)


def stdlib_train_files() -> list[tuple[str, Path]]:
    """(name, path) of the standard library's Python files, tests and site-packages left out, and never a
    file of the corpus's held-out split, where the held-out code prompts and chat requests come from."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    named = ((f"stdlib/{p.relative_to(stdlib)}", p) for p in sorted(stdlib.rglob("*.py")))
    return [(name, p) for name, p in named if not {"test", "tests", "site-packages", "dist-packages"}
            & set(p.relative_to(stdlib).parts[:-1]) and zlib.crc32(name.encode()) % HELDOUT_EVERY != 0]


def code_windows(count: int, seed: int) -> list[str]:
    """`count` windows of 6-16 lines of the standard library's Python source (at most 800 characters),
    each from a random line of a random file of `stdlib_train_files`."""
    files = stdlib_train_files()
    rng, out = random.Random(seed), []
    while len(out) < count:
        try:
            lines = rng.choice(files)[1].read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        if len(lines) < 40:
            continue
        start = rng.randrange(0, len(lines) - 24)
        text = "".join(lines[start: start + rng.randint(6, 16)])[:800]
        if len(text.strip()) >= 160:
            out.append(text)
    return out


def functions(files: list[tuple[str, Path]], rng: random.Random, count: int, per_file: int = 1) -> list[dict]:
    """Up to `count` functions with a docstring from `files` (name, path), at most `per_file` of a file
    (variety), the files in an order drawn from `rng`: name, arguments, the docstring's first sentence and
    the source."""
    found = []
    names = list(files)
    rng.shuffle(names)
    for _, path in names:
        if len(found) >= count:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        taken = 0
        for node in ast.walk(tree):
            if taken < per_file and isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                first = (doc or "").strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")
                if 20 <= len(first) <= 200:
                    args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
                    found.append({"name": node.name, "args": args, "summary": first,
                                  "source": ast.get_source_segment(text, node) or ""})
                    taken += 1
    return found[:count]


def chat_request(fn: dict, k: int) -> list[dict]:
    """A user request made from a function (`functions`): write it (even k) or explain it (odd k); the
    held-out chat requests (models/smollm2/prompts.jsonl) are these, of the held-out files' functions."""
    if k % 2 == 0:
        summary = fn["summary"][0].lower() + fn["summary"][1:]
        text = f"Write a Python function `{fn['name']}({fn['args']})` that does the following: {summary}."
    else:
        text = f"Explain what this Python function does:\n```python\n{fn['source'][:700]}\n```"
    return [{"role": "user", "content": text}]


def request_set(seed: int = 0, windows: int = 4000) -> list[dict]:
    """Every template with every topic (code: language x task; code chat: language x verb), sampled
    pairs of topics to compare, and `windows` bare code prompts (`code_windows`), shuffled; then for each
    function `functions` finds (two per file) a request to write it and one to explain it: prompt records
    (`prompts.py`) with ids `kind-n`."""
    rng = random.Random(seed)
    general = [t.format(t=topic) for t in GENERAL for topic in TOPICS]
    general += [t.format(lang=lang, t=topic) for t in TRANSLATE for lang in LANGS for topic in TOPICS]
    general += [rng.choice(COMPARE).format(t=a, u=b) for a, b in (rng.sample(TOPICS, 2) for _ in range(2000))]
    code = [t.format(lang=lang, task=task) for t in CODE for lang in LANGUAGES for task in CODE_TASKS]
    chat = [t.format(lang=lang, verb=verb) for t in CODE_CHAT for lang in LANGUAGES for verb in CODE_VERBS]
    records = []
    for kind, texts in (("general", general), ("code", code), ("code-chat", chat)):
        texts = list(dict.fromkeys(texts))
        records += [{"id": f"{kind}-{n}", "messages": [{"role": "user", "content": text}]} for n, text in enumerate(texts)]
    records += [{"id": f"code-window-{n}", "prompt": text} for n, text in enumerate(dict.fromkeys(code_windows(windows, seed)))]
    rng.shuffle(records)
    files = stdlib_train_files()
    asks = {chat_request(fn, k)[0]["content"]: None for fn in functions(files, random.Random(seed), 2 * len(files), 2)
            for k in (0, 1)}
    return records + [{"id": f"code-fn-{n}", "messages": [{"role": "user", "content": text}]}  # after: the rest keep
                      for n, text in enumerate(asks)]  # their places


def written_requests(engine: Engine, tokenizer, count: int, seed: int, batch: int = 64) -> list[dict]:
    """`count` requests the LLM writes itself, each from a (topic, kind) pair and its own seed: prompt records."""
    rng = random.Random(seed)
    pairs = [(rng.choice(TOPICS), rng.choice(KINDS)) for _ in range(count)]
    asks = [prompt_ids(tokenizer, {"messages": [{"role": "user", "content":
            f"Write {kind} that a person might send to an AI assistant about {topic}. "
            f"Write only the request itself, in one or two sentences."}]}) for topic, kind in pairs]
    out = []
    for i in range(0, count, batch):
        gens = engine.generate([Request(a, 48, SamplingParams(temperature=0.8, seed=seed * 100003 + i + k), id=str(k))
                                for k, a in enumerate(asks[i: i + batch])], progress=True)
        for (topic, kind), g in zip(pairs[i: i + batch], gens):
            text = tokenizer.decode(g.token_ids, skip_special_tokens=True).strip().split("\n")[0].strip(' "')
            text = text if 15 <= len(text) <= 300 else f"Tell me something interesting about {topic}."
            out.append({"id": f"written-{len(out)}", "messages": [{"role": "user", "content": text}]})
    return out


if __name__ == "__main__":
    path = Path(sys.argv[1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in request_set()))
