"""vLLM's tokenizer routes on the gateway, with the gateway's own tokenizer (the one its completions
and chat use), so a client counts and splits text exactly as the server will:

- `POST /tokenize` `{"prompt"}` (tokenized as a completions prompt; `add_special_tokens`, default
  true) or `{"messages"}` (through the chat template; `add_generation_prompt`, default true) ->
  `{"count", "max_model_len", "tokens"}`; with `tools` (and `tool_choice`) the conversation is the one
  a chat request with them sends (tools.py);
- `POST /detokenize` `{"tokens"}` -> `{"prompt"}`;
- `GET /tokenizer_info` -> the special tokens, the chat template and the context length, which
  lm-evaluation-harness's `tokenizer_backend=remote` reads before it tokenizes through /tokenize.

`model` is optional; when given it must be the served one (404 otherwise).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from specinfer_rpc.v1 import generation_pb2

from .protocol import ApiError, ChatMessage, tool_plan
from .tools import Tool, ToolChoice


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def tokenized(gateway, body: TokenizeRequest, info: generation_pb2.ModelInfo) -> dict:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError.bad("prompt", "give a prompt or messages, one of them")
    if body.prompt is not None and (body.tools or body.tool_choice is not None):
        raise ApiError.bad("tools", "only with messages")
    ids = (gateway.text_ids(body.prompt, body.add_special_tokens) if body.prompt is not None
           else gateway.chat_ids(body.messages, body.add_generation_prompt, tool_plan(body.tools, body.tool_choice)))
    return {"count": len(ids), "max_model_len": info.context_length, "tokens": ids}


def detokenized(gateway, body: DetokenizeRequest, info: generation_pb2.ModelInfo) -> dict:
    bad = [t for t in body.tokens if not 0 <= t < info.vocab_size]
    if bad:
        raise ApiError.bad("tokens", f"ids must be in [0, {info.vocab_size}), got {bad[:5]}")
    return {"prompt": gateway.tokenizer.decode(body.tokens)}  # special tokens kept: /tokenize's inverse


def tokenizer_info(tokenizer, info: generation_pb2.ModelInfo) -> dict:
    return {"tokenizer_class": type(tokenizer).__name__, "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
            "chat_template": tokenizer.chat_template, "model_max_length": info.context_length}
