"""The flags of `specinfer bench` (kept apart so that building the CLI imports nothing heavy)."""

from pathlib import Path

from specinfer.checkpoints import DEFAULT_LLM, default_prompts


def add_flags(p) -> None:
    p.add_argument("--quick", action="store_true", help="fewer prompts, tokens, configs and concurrencies (under a minute on 2 cores)")
    p.add_argument("--llm", default=DEFAULT_LLM, help="LLM checkpoint: a directory, a .gguf file or %(default)s")
    p.add_argument("--ssm", type=Path, action="append", default=None,
                   help="SSM checkpoints (default: the default LLM's drafters; another LLM's must be named)")
    p.add_argument("--prompt-file", type=Path, default=default_prompts(),
                   help="JSONL prompts: 'prompt' or 'messages' per line (default: the default LLM's held-out prompts)")
    p.add_argument("--prompts", type=int, default=None, help="held-out prompts to use (default 16, quick 4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64, quick 32")
    p.add_argument("--concurrency", default=None, help="services: default 1,4,16,32, quick 1,4")
    p.add_argument("--no-services", action="store_true", help="skip the services part")
    p.add_argument("--search-tree", action="store_true", help="only run the tree-shape search and print its choice")
    p.add_argument("--out", type=Path, default=Path("bench/results/bench"))
