"""Tool calls on any model: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (chat completions).

One call format serves every model: the gateway describes the tools and the format in the
conversation's system message, and the manager's structured output enforces it. The reply is
constrained by a Lark grammar: `<tool_call>`, a JSON array of calls, `</tool_call>`. Each call's
`name` is one of the tools' and its `arguments` validate against that tool's `parameters`. So a call
always parses and validates. Greedy output is exactly constrained decoding without speculation, and
the grammar drafts what it forces: the tag, the keys, a lone tool's name.

- `tool_choice` "auto" (the default with tools): a call, or a text reply that does not start with
  one (leading whitespace aside);
- "required": one call or more; a named function (`{"type": "function", "function": {"name": ...}}`):
  exactly one call of it;
- "none": the tools are not shown, and the reply is text.
`parallel_tool_calls: false` allows one call per reply.

Earlier turns: an assistant message's `tool_calls` are written in the same format after its content;
a `tool` message's content (the result) goes in the template's `tool` role. The chat template's own
tool rendering and models' native call formats are not used.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specinfer.grammar import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments; unset: any object
    strict: bool | None = None  # the arguments are always enforced


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it ("" for no arguments, as some clients send)
    parsed_arguments: Any = None  # the openai SDK's parse() adds it: not used


ToolChoice = Literal["none", "auto", "required"] | dict[str, Any] | None  # a request's tool_choice, as sent


class ToolCall(BaseModel):
    """A call in an earlier assistant message, as the client sends it back."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"]
    function: FunctionCall
    index: int | None = None  # a streamed call's, kept by clients that join the deltas: not used


def call_text(calls: list[dict]) -> str:
    """Calls ({"name", "arguments"}) in the format the model is asked to write."""
    return OPEN + json.dumps(calls, ensure_ascii=False) + CLOSE


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what its reply may be: `choice` "auto", "required" or a tool's name."""

    tools: tuple[FunctionDef, ...]
    choice: str
    parallel: bool = True

    def offered(self) -> list[FunctionDef]:
        return [t for t in self.tools if self.choice in ("auto", "required", t.name)]

    def one_call(self) -> bool:
        return not self.parallel or self.choice not in ("auto", "required")

    def instructions(self) -> str:
        """What the system message tells the model."""
        listed = "\n".join(json.dumps({"name": t.name, "description": t.description or "",
                                       "parameters": t.parameters or {"type": "object"}}, ensure_ascii=False)
                           for t in self.offered())
        how = "one call" if self.one_call() else "one call or more"
        text = (f"You can call these functions (each with a JSON Schema of its arguments):\n<tools>\n{listed}\n</tools>\n"
                f"To call functions, reply with nothing but {OPEN}[{{\"name\": \"function_name\", \"arguments\": "
                f"{{\"argument\": \"value\"}}}}]{CLOSE}, listing {how}.")
        if self.choice == "auto":
            return text + " If no function fits the request, answer it directly."
        if self.choice == "required":
            return text + " You must call a function."
        return text + f" Call the function {self.choice}."

    def grammar(self) -> str:
        """The reply's Lark grammar (llguidance's syntax). Each tool's parameters are a definition of
        the calls' schema (`#/$defs/<name>`), their own references moved there with them."""
        tools = self.offered()
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/{t.name}"}}}
                 for t in tools]
        schema = {"x-guidance": JSON_OPTIONS, "type": "array", "minItems": 1,
                  "$defs": {t.name: moved(t.parameters or {"type": "object"}, f"#/$defs/{t.name}") for t in tools},
                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if self.one_call():
            schema["maxItems"] = 1
        rules = [f'call: "{OPEN}" calls "{CLOSE}"', f"calls: %json {json.dumps(schema)}"]
        if self.choice == "auto":
            return "\n".join(["start: REPLY | call", *rules, f"REPLY: /(?s:.*)/ & ~/\\s*{OPEN}(?s:.*)/"])
        return "\n".join(["start: call", *rules])

    def parse(self, text: str) -> list[dict] | None:
        """The reply's calls as OpenAI's `tool_calls`, or None when it is text (or a call cut short by
        max_tokens or a stop string)."""
        if not (text.startswith(OPEN) and text.endswith(CLOSE)):
            return None
        try:
            calls = json.loads(text[len(OPEN):-len(CLOSE)])
        except json.JSONDecodeError:
            return None
        return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for c in calls]


def moved(schema: Any, root: str) -> Any:
    """A schema placed at `root` of another: its local references ("#...") made to point there."""
    if isinstance(schema, dict):
        return {k: root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else moved(v, root)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [moved(v, root) for v in schema]
    return schema


def shown(turns: list[dict], plan: ToolPlan | None) -> list[dict]:
    """The conversation with the plan's instructions in its system message (a new first one when it
    has none)."""
    if plan is None:
        return turns
    if turns and turns[0]["role"] in ("system", "developer"):
        return [{**turns[0], "content": f"{turns[0]['content']}\n\n{plan.instructions()}"}, *turns[1:]]
    return [{"role": "system", "content": plan.instructions()}, *turns]


class StreamedCalls:
    """One streamed choice of a request with tools: its text is held back while it may be a call."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""
        self.text = False  # the reply is text: pass it on

    def add(self, piece: str) -> str:
        """The text to send now."""
        if self.text:
            return piece
        self.held += piece
        start = self.held.lstrip()
        if self.plan.choice == "auto" and not (OPEN.startswith(start) or start.startswith(OPEN)):
            self.text, piece, self.held = True, self.held, ""
            return piece
        return ""

    def end(self) -> tuple[str, list[dict] | None]:
        """At the reply's end: the text still held, or the calls."""
        calls = None if self.text else self.plan.parse(self.held)
        return ("", calls) if calls else (self.held, None)
