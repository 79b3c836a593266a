"""Prompt files: JSONL, one request per line, with an optional `id` and either
  - `prompt`: text the LLM continues (a code prompt), or
  - `messages`: a chat request ([{"role": ..., "content": ...}]), rendered with the LLM's chat template.
The core's engine takes token ids; this is where text becomes them, with a Hugging Face tokenizer."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompt_file(path: str | Path) -> list[dict]:
    """The file's records; ValueError naming the line when one has neither field."""
    records = []
    with open(path) as fh:
        for n, line in enumerate(fh):
            if not line.strip():
                continue
            record = json.loads(line)
            if "prompt" not in record and "messages" not in record:
                raise ValueError(f"{path}:{n + 1}: no 'prompt' or 'messages' field")
            records.append({**record, "id": str(record.get("id", n))})
    return records


def prompt_text(tokenizer, record: dict) -> str:
    """A record as the text the LLM sees (a chat request through the chat template)."""
    if "messages" in record:
        if not tokenizer.chat_template:
            where = f"{record['id']}: " if "id" in record else ""  # a file's records have one, a caller's may not
            raise ValueError(f"{where}a chat request, and the LLM's tokenizer has no chat template")
        return tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False)
    return record["prompt"]


def prompt_ids(tokenizer, record: dict) -> list[int]:
    """A record's token ids (the chat template's special tokens as the tokenizer maps them)."""
    return tokenizer(prompt_text(tokenizer, record), add_special_tokens="messages" not in record)["input_ids"]
