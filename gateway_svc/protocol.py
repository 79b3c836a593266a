"""The OpenAI request bodies the gateway accepts, and its errors in OpenAI's JSON shape.

Supported beyond text: `logprobs` (completions: the top up to 20, and the chosen token when it is
not among them, as OpenAI's "up to logprobs + 1"; chat: `logprobs` and `top_logprobs` up to 20,
exactly that many alternatives, as OpenAI's), `echo` (with the prompt's logprobs, also with `max_tokens: 0`), prompts as
token-id lists and several prompts in one request (completions), and `n` choices per prompt (choice
j samples with a seed derived from the request's, `choice_seeds`); how many choices one request may
ask is the gateway's `--max-choices`.
`response_format` (both endpoints): `text`, `json_object`, `json_schema` (its `schema` is enforced
whether `strict` or not), and as extensions `{"type": "regex", "regex": ...}` and
`{"type": "grammar", "grammar": ...}` (llguidance's Lark syntax); one that does not compile is a 400
naming `response_format`.
`presence_penalty`, `frequency_penalty` and `logit_bias` (token ids as strings) as OpenAI defines
them, with vLLM's extensions `repetition_penalty` and `min_tokens`: exact under speculation
(specinfer/penalties.py). `stop` takes token ids (ints) beside strings; vLLM's `stop_token_ids` and
`include_stop_str_in_output` are taken too, and vLLM's `allowed_token_ids`.
`tools`, `tool_choice` and `parallel_tool_calls` (chat): one call format for every model, enforced by
a grammar (tools.py); an assistant message's `tool_calls` and `tool` messages in the conversation.
`prediction` (OpenAI's Predicted Outputs, `{"type": "content", "content": ...}`; on completions too):
drafted where the output follows it (specinfer/prediction.py), the output unchanged, with any other
parameter; usage then carries `completion_tokens_details` (accepted and rejected prediction tokens).
Parameters the system cannot honour are refused with 400 naming them, never silently ignored:
`best_of`, `suffix`. They are accepted at their neutral values (`best_of: 1`), which some clients
always send.
Extensions: `top_k`, `min_p` (vLLM's, after `top_p`), `ignore_eos`, `priority` (vLLM's: lower values are scheduled first, default 0),
`speculation` ("off", an expansion such as "2,1,1" or [2, 1, 1]; unset: the server's default) and
`return_draft_trees` (each streamed step carries its draft tree).
Chat without `max_tokens` generates to the end of the reply (EOS, a stop) or of the context, as
OpenAI and vLLM do; completions keep OpenAI's default of 16.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from specinfer.grammar import KINDS
from specinfer.logprobs import MAX_TOP
from specinfer.tree import parse_expansion, validate_expansion

from .tools import Tool, ToolCall, ToolChoice, ToolPlan, call_text

MAX_N = 16  # choices per prompt at most
GOLDEN = 0x9E3779B97F4A7C15  # choice j's seed: the request's plus j times this, modulo 2**64


def choice_seeds(seed: int, n: int) -> list[int]:
    """The seed of each of n choices: choice 0 is the request's own seed, so n = 1 changes nothing,
    and choice j is exactly a request of its own with seed j (the seed contract holds per choice)."""
    return [(seed + j * GOLDEN) % (1 << 64) for j in range(n)]

# gRPC status name -> (HTTP status, OpenAI error type)
STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


# the manager's field names -> the request's
OPENAI_FIELDS = {"max_new_tokens": "max_tokens", "prompt": "prompt", "stop_token_ids": "stop",
                 "sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.top_k": "top_k",
                 "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "speculation.expansion": "speculation", "speculation.mode": "speculation",
                 **{f"response_format.{kind}": "response_format" for kind in KINDS}}


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    @classmethod
    def bad(cls, param: str, message: str) -> ApiError:
        return cls(400, f"{param}: {message}", param=param)

    @classmethod
    def from_grpc(cls, code_name: str, details: str) -> ApiError:
        """The manager's error, its field (the message's "field: ..." prefix) named as OpenAI does."""
        status, kind = STATUS.get(code_name, (500, "server_error"))
        param = None
        head, sep, rest = details.partition(": ")
        if status == 400 and sep and " " not in head:
            param = OPENAI_FIELDS.get(head, head)
            details = f"{param}: {rest}"
        return cls(status, details, kind, param, code_name.lower())

    @classmethod
    def from_http(cls, status: int, message: str) -> ApiError:
        """An error the web framework raised (no route, wrong method), typed as the same status from the manager."""
        default = "invalid_request_error" if status < 500 else "server_error"
        kind = next((k for s, k in STATUS.values() if s == status), default)
        return cls(status, message, kind)

    def renamed(self, param: str, name: str) -> ApiError:
        """The same error naming `name` where it named `param` (a field the gateway wrote for the caller's)."""
        if self.param != param:
            return self
        return ApiError(self.status, name + str(self)[len(param):], self.type, name, self.code)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def text_of(content: str | list[dict[str, Any]] | None, name: str) -> str:
    """A message's (or a prediction's) content as text: a string, or text parts joined; 400 naming
    `name` for parts of another kind."""
    if not isinstance(content, list):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError.bad(name, "only text parts are supported")
        parts.append(part["text"])
    return "".join(parts)


class PredictionContent(BaseModel):
    """OpenAI's Predicted Outputs: text the output is expected to repeat."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: str | list[dict[str, Any]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Generation(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=1 << 64)  # unset: a fresh one per request
    stop: str | list[str | int] | None = None  # strings, and token ids (ints)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # caller metadata, not used
    # extensions
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's
    ignore_eos: bool = False
    priority: int = 0
    speculation: str | list[int] | None = None
    return_draft_trees: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    response_format: dict[str, Any] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM's
    min_tokens: int = Field(0, ge=0)  # vLLM's
    stop_token_ids: list[int] | None = None  # vLLM's: as token ids in stop
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be generated
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string, not before
    prediction: PredictionContent | None = None  # OpenAI's Predicted Outputs

    def predicted_text(self) -> str | None:
        """The prediction's text (None: no prediction)."""
        return None if self.prediction is None else text_of(self.prediction.content, "prediction.content")

    def bias(self) -> dict[int, float]:
        """logit_bias with its keys as token ids (the manager checks them against the vocabulary)."""
        try:
            return {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise ApiError.bad("logit_bias", "keys must be token ids, e.g. {\"50256\": -100}") from None

    def refuse_unsupported(self) -> None:
        if self.allowed_token_ids == []:
            raise ApiError.bad("allowed_token_ids", "must not be empty (leave it out to allow every token)")
        if self.stream_options is not None and not self.stream:
            raise ApiError.bad("stream_options", "only allowed with stream: true")

    def grammar(self) -> tuple[str, str] | None:
        """The response format as the manager's `ResponseFormat` takes it: (its field, the value), or
        None for plain text. Whether a schema, regex or grammar compiles is the manager's to say."""
        fmt = self.response_format
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind == "text" and fmt.keys() == {"type"}:
            return None
        if kind == "json_object" and fmt.keys() == {"type"}:
            return "json_object", True
        if kind == "json_schema" and fmt.keys() == {"type", "json_schema"}:
            spec = fmt["json_schema"]
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise ApiError.bad("response_format", "json_schema: {\"name\": ..., \"schema\": {...}} with the schema")
            unknown = set(spec) - {"name", "description", "schema", "strict"}
            if unknown:
                raise ApiError.bad("response_format", f"json_schema: unknown keys {sorted(unknown)}")
            return "json_schema", json.dumps(spec["schema"])
        for ours, field in (("regex", "regex"), ("grammar", "lark")):
            if kind == ours and fmt.keys() == {"type", ours} and isinstance(fmt[ours], str):
                return field, fmt[ours]
        raise ApiError.bad("response_format", "one of {\"type\": \"text\"}, {\"type\": \"json_object\"}, "
                           "{\"type\": \"json_schema\", \"json_schema\": {...}}, {\"type\": \"regex\", \"regex\": ...}, "
                           "{\"type\": \"grammar\", \"grammar\": ...}")

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else [s for s in self.stop or () if isinstance(s, str)]
        if any(not s for s in stops):
            raise ApiError.bad("stop", "stop strings must not be empty")
        return stops

    def stop_ids(self) -> list[int]:
        """The stop token ids, from stop and vLLM's stop_token_ids."""
        ids = [] if isinstance(self.stop, str) else [s for s in self.stop or () if isinstance(s, int)]
        return list(dict.fromkeys(ids + (self.stop_token_ids or [])))

    def expansion(self) -> str | None:
        """The speculation setting as `specinfer_rpc.client.speculation_pb` takes it: None (the
        server's), "off", or "k_1,...,k_m"."""
        spec = self.speculation
        if spec is None or spec == "default":
            return None
        if spec == "off":
            return spec
        try:
            ks = parse_expansion(spec) if isinstance(spec, str) else list(spec)
            if not ks:
                raise ValueError("an empty expansion means no speculation: say \"off\"")
            validate_expansion(ks)
        except ValueError as e:
            raise ApiError.bad("speculation", f"\"off\", \"default\" or an expansion k_1,...,k_m: {e}") from None
        return ",".join(map(str, ks))


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of not in (None, 1):
            raise ApiError.bad("best_of", f"not supported (use n), got {self.best_of}")
        if self.suffix is not None:
            raise ApiError.bad("suffix", "not supported (no fill-in-the-middle)")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError.bad("max_tokens", "0 only with echo (the prompt's logprobs, nothing generated)")
        prompts = self.prompts()
        if not prompts or any(not p for p in prompts):
            raise ApiError.bad("prompt", "must not be empty")
        if self.stream and self.echo and len(prompts) * self.n > 1:
            raise ApiError.bad("echo", "with stream: true, only for one prompt and n = 1")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: texts, or token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def top(self) -> int:
        return self.logprobs or 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    # what a returned message carries, which clients send back as they got it: not used
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    parsed: Any = None
    function_call: None = None  # the deprecated single call: use tool_calls

    def text(self, index: int) -> str:
        return text_of(self.content, f"messages[{index}].content")

    def turn(self, index: int) -> dict:
        """The message as the chat template takes it; an assistant's calls follow its text."""
        text = self.text(index)
        if self.tool_calls:
            if self.role != "assistant":
                raise ApiError.bad(f"messages[{index}].tool_calls", "only in an assistant's message")
            calls = []
            for j, call in enumerate(self.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
                    calls.append({"name": call.function.name, "arguments": arguments})
                except json.JSONDecodeError:
                    raise ApiError.bad(f"messages[{index}].tool_calls[{j}].function.arguments", "not JSON") from None
            text += call_text(calls)
        turn = {"role": self.role, "content": text}
        for key in ("name", "tool_call_id"):  # for templates that read them
            if getattr(self, key) is not None:
                turn[key] = getattr(self, key)
        return turn


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None  # unset: True

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise ApiError.bad("top_logprobs", "only with logprobs: true")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ApiError.bad("max_completion_tokens", "differs from max_tokens; give one")
            self.max_tokens = self.max_completion_tokens
        if self.tool_plan() is not None and self.response_format not in (None, {"type": "text"}):
            raise ApiError.bad("response_format", "not with tools (a reply is a call or text); "
                                                  "give tool_choice: \"none\" for a formatted reply")

    def tool_plan(self) -> ToolPlan | None:
        """What the reply may be with the request's tools; None: text, the tools not shown."""
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls is not False)

    def grammar(self) -> tuple[str, str] | None:
        plan = self.tool_plan()
        return ("lark", plan.grammar()) if plan is not None else super().grammar()

    @property
    def top(self) -> int:
        return self.top_logprobs or 0

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    echo: ClassVar[bool] = False  # completions only


def tool_plan(tools: list[Tool] | None, choice: str | dict | None, parallel: bool = True) -> ToolPlan | None:
    """A request's tools and tool_choice as a plan (tools.py); None: text, the tools not shown."""
    if not tools:
        if choice not in (None, "none"):
            raise ApiError.bad("tool_choice", "only with tools")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise ApiError.bad("tools", "function names must differ")
    if isinstance(choice, dict):
        name = choice["function"].get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or name is None or set(choice) != {"type", "function"}:
            raise ApiError.bad("tool_choice", "\"none\", \"auto\", \"required\" or "
                                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in names:
            raise ApiError.bad("tool_choice", f"no tool is named {name!r}")
        choice = name
    if choice == "none":
        return None
    return ToolPlan(tuple(t.function for t in tools), choice or "auto", parallel)


def validation_error(errors: list[dict]) -> ApiError:
    """FastAPI's request validation errors as one 400 naming the first bad field."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # a union's member name (e.g. "str", "list[int]") is not the caller's field
    field = ".".join(x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool"))
    if e.get("type") == "extra_forbidden":
        return ApiError.bad(field, "unsupported parameter")
    if e.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {e.get('msg', '')}")
    return ApiError.bad(field or "body", e.get("msg", "invalid"))
