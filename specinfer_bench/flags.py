"""The flags of `specinfer bench` (kept apart so that building the CLI imports nothing heavy)."""

from pathlib import Path


def add_flags(p) -> None:
    p.add_argument("--quick", action="store_true", help="fewer prompts, tokens, configs and concurrencies (under a minute on 2 cores)")
    p.add_argument("--llm", type=Path, default=None, help="LLM checkpoint directory (default: shipped)")
    p.add_argument("--ssm", type=Path, action="append", default=None, help="SSM directories (default: shipped)")
    p.add_argument("--prompts", type=int, default=None, help="held-out prompts to use (default 16, quick 4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64, quick 32")
    p.add_argument("--concurrency", default=None, help="services: default 1,4,16,32, quick 1,4")
    p.add_argument("--no-services", action="store_true", help="skip the services part")
    p.add_argument("--search-tree", action="store_true", help="only run the tree-shape search and print its choice")
    p.add_argument("--out", type=Path, default=Path("bench/results/bench"))
