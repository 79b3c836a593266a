"""The HTTP gateway: OpenAI's completions and chat completions API over the manager's gRPC
Generation API, vLLM's tokenizer routes (tokenization.py), the live tree viewer (static/), /health and
the gateway's own /metrics.

Text is tokenized and detokenized here, with the LLM's tokenizer (its chat template for chat);
only token ids go to the manager. Each verifier step the manager streams becomes one server-sent
event. Errors before the first token are HTTP statuses (gRPC INVALID_ARGUMENT 400, UNAUTHENTICATED
401, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504), after it an error event; both
in OpenAI's error shape. A client that goes away cancels its gRPC call, so every service frees the
request. The caller's `Authorization` header is passed to the manager as is.

`seed`: the same prompt, seed and settings give the same text whatever the speculation and the load
(the manager's coupled sampling); a request without one gets a fresh seed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.exceptions import HTTPException
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from specinfer_rpc.client import FINISH_NAMES, speculation_pb
from specinfer_rpc.metrics import LATENCY_BUCKETS
from specinfer_rpc.security import open_channel
from specinfer_rpc.server import channel_options
from specinfer_rpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from .protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    choice_seeds,
    validation_error,
)
from .text import TextStream
from .tools import StreamedCalls, ToolPlan, shown
from .tokenization import DetokenizeRequest, TokenizeRequest, detokenized, tokenized, tokenizer_info

STATIC = Path(__file__).resolve().parent / "static"
ROUTES = {"/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
          "/detokenize", "/tokenizer_info"}
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class Metrics:
    """The gateway's own request metrics, in a registry of its own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specinfer_gateway_requests", "HTTP requests answered, by path and status",
                                ["path", "status"], registry=r)
        self.in_flight = Gauge("specinfer_gateway_requests_in_flight", "generation requests being answered", registry=r)
        self.latency = Histogram("specinfer_gateway_request_seconds", "generation requests, arrival to last byte",
                                 ["path"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specinfer_gateway_time_to_first_token_seconds", "arrival to the first step's tokens",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("specinfer_gateway_completion_tokens", "tokens generated for clients", registry=r)
        self.disconnects = Counter("specinfer_gateway_client_disconnects",
                                   "generation requests whose client left before the end (their gRPC call cancelled)",
                                   registry=r)


@dataclass
class Tally:
    """One choice's output and usage as it streams."""

    prompt_tokens: int
    text: TextStream
    stop_ids: set[int]
    silent: bool = False  # echo with max_tokens 0: the one token generated is not output
    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    finish: str | None = None  # OpenAI's finish_reason
    usage: generation_pb2.Usage | None = None  # the manager's, on its last message
    prediction: list[int] = field(default_factory=lambda: [0, 0])  # its steps' accepted and rejected prediction tokens

    def step(self, msg: generation_pb2.GenerateResponse) -> tuple[str, int]:
        """Take one step's message; the text to send for it and how many of its tokens are output."""
        ids = [] if self.silent else list(msg.token_ids)
        self.tokens += ids
        self.steps += 1
        self.prediction[0] += msg.accepted_prediction_tokens
        self.prediction[1] += msg.rejected_prediction_tokens
        if msg.finish_reason:
            reason = FINISH_NAMES[msg.finish_reason]
            self.finish, self.usage = OPENAI_FINISH[reason], msg.usage
            if reason == "stop" and ids and ids[-1] in self.stop_ids:  # like a stop string, not sent
                ids = ids[:-1]
        piece = self.text.add(ids)
        if self.text.stopped:
            self.finish = "stop"
        elif self.finish:
            piece += self.text.finish()
        return piece, len(ids)

    def completion_tokens(self) -> int:
        return len(self.tokens) if self.usage is None or self.silent else self.usage.completion_tokens


def usage_json(choices: list[Choice], prompt_tokens: int, predicted: bool = False) -> dict:
    """OpenAI's usage over all choices (each prompt counted once), plus the speculation figures. A stream cut by a stop string has no usage from the manager;
    its figures then come from the steps seen (each step's tokens are its accepted drafts plus one of
    the LLM's own), and its prompt counts no cached tokens. A prompt's cached tokens are those none of
    its choices computed (the verifier's prefix cache held them). With a prediction (`predicted`),
    OpenAI's completion_tokens_details: its tokens drafted and accepted, drafted and rejected, over
    the steps seen."""
    tallies = [c.tally for c in choices]
    completion = sum(t.completion_tokens() for t in tallies)
    steps = sum(t.usage.verifier_steps if t.usage is not None else t.steps for t in tallies)
    accepted = sum(t.usage.accepted_draft_tokens if t.usage is not None else len(t.tokens) - t.steps for t in tallies)
    spec = {"verifier_steps": steps, "mean_tokens_per_step": sum(
                t.usage.completion_tokens if t.usage is not None else len(t.tokens) for t in tallies) / max(steps, 1),
            "accepted_draft_tokens": accepted}
    if all(t.usage is not None for t in tallies):
        spec["tree_steps"] = sum(t.usage.tree_steps for t in tallies)
        spec["no_tree_reason"] = next((t.usage.no_tree_reason for t in tallies if t.usage.no_tree_reason), "")
    cached = sum(min(c.tally.usage.cached_tokens if c.tally.usage is not None else 0 for c in same)
                 for _, same in itertools.groupby(choices, key=lambda c: id(c.prompt)))  # a prompt's choices
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
             "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached},
             "speculation": spec}
    if predicted:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": sum(t.prediction[0] for t in tallies),
                                              "rejected_prediction_tokens": sum(t.prediction[1] for t in tallies)}
    return usage


@dataclass
class Choice:
    """One choice of a request: its gRPC call and what it has output."""

    index: int
    call: object
    tally: Tally
    prompt: list[int]
    echo: str | None = None  # the prompt's text, sent before the output (completions with echo)
    first: object = None  # the call's first message
    calls: StreamedCalls | None = None  # a streamed chat reply that may be tool calls: its text held back
    offset: int = 0  # characters output so far (completions' text_offset)


class Gateway:
    def __init__(self, manager: str, tokenizer, request_timeout: float, credentials: grpc.ChannelCredentials | None,
                 max_message_bytes: int, model_name: str = "", max_choices: int = 1024):
        self.manager = manager
        self.tokenizer = tokenizer
        self.timeout = request_timeout
        # round_robin: a name with several addresses (managers behind a headless Service) shares the load
        self.channel = open_channel(manager, credentials,
                                    channel_options(max_message_bytes) + [("grpc.lb_policy_name", "round_robin")])
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.model_name = model_name  # served name; empty: the manager's model_name
        self.fixed: generation_pb2.ModelInfo | None = None  # the manager's answer, asked once (`served`)
        self.max_choices = max_choices  # prompts x n per request
        self.metrics = Metrics()

    async def call(self, method, request, metadata):
        try:
            return await method(request, timeout=30, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise ApiError.from_grpc(e.code().name, e.details() or "") from None

    async def model_info(self, metadata) -> generation_pb2.ModelInfo:
        info = await self.call(self.stub.GetModelInfo, generation_pb2.GetModelInfoRequest(), metadata)
        if self.model_name:
            info.model_name = self.model_name
        return info

    async def served(self, model: str | None, metadata) -> generation_pb2.ModelInfo:
        """What does not change while the manager serves (the model id requests must name, its context),
        asked of a manager once, not per request: with round_robin over two managers, a question per
        request sent every Generate to the same one. 404 when the request names another model."""
        if self.fixed is None:
            self.fixed = await self.model_info(metadata)
        if model is not None and model != self.fixed.model_name:
            raise ApiError(404, f"model: {model!r} is not served here; this gateway serves {self.fixed.model_name!r} "
                                f"(GET /v1/models)", "not_found_error", "model", "model_not_found")
        return self.fixed

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                 plan: ToolPlan | None = None) -> list[int]:
        """The messages through the model's chat template (with the tools' instructions, tools.py)."""
        if not self.tokenizer.chat_template:
            raise ApiError.bad("messages", "the model's tokenizer has no chat template "
                                           "(tokenizer_config.json chat_template); use /v1/completions")
        turns = shown([m.turn(i) for i, m in enumerate(messages)], plan)
        try:
            ids = self.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, tokenize=True)
        except jinja2.TemplateError as e:  # e.g. a template that allows only alternating user and assistant turns
            raise ApiError.bad("messages", f"the model's chat template refuses this conversation: {e}") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in newer transformers

    def prompt_ids(self, body, plan: ToolPlan | None) -> list[list[int]]:
        """Each prompt's token ids."""
        if isinstance(body, ChatCompletionRequest):
            return [self.chat_ids(body.messages, plan=plan)]
        return [self.text_ids(p) if isinstance(p, str) else list(p) for p in body.prompts()]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_texts(self, ids) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    async def generate(self, http: Request, body, path: str):
        body.refuse_unsupported()
        metadata = auth(http)
        served = (await self.served(body.model, metadata)).model_name
        plan = body.tool_plan() if isinstance(body, ChatCompletionRequest) else None
        prompts = self.prompt_ids(body, plan)
        if len(prompts) * body.n > self.max_choices:
            raise ApiError.bad("prompt" if len(prompts) > 1 else "n",
                               f"at most {self.max_choices} choices (prompts x n) per request (the gateway's "
                               f"--max-choices), got {len(prompts)} x {body.n}")
        stops, stop_ids, grammar, bias = body.stop_strings(), body.stop_ids(), body.grammar(), body.bias()
        seeds = choice_seeds(secrets.randbits(64) if body.seed is None else body.seed, body.n)
        predicted = body.predicted_text()
        prediction = self.text_ids(predicted, add_special_tokens=False) if predicted else []
        silent = body.echo and body.max_tokens == 0  # the prompt's logprobs only: one token is generated, not output
        texts = body.prompts() if body.echo else [None] * len(prompts)
        choices = []
        for p, (prompt, text) in enumerate(zip(prompts, texts)):
            for j, seed in enumerate(seeds):
                request = generation_pb2.GenerateRequest(
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(temperature=body.temperature, top_k=body.top_k,
                                                       top_p=body.top_p, min_p=body.min_p, seed=seed,
                                                       presence_penalty=body.presence_penalty,
                                                       frequency_penalty=body.frequency_penalty,
                                                       repetition_penalty=body.repetition_penalty,
                                                       logit_bias=bias, min_tokens=body.min_tokens,
                                                       allowed_token_ids=body.allowed_token_ids or []),
                    stopping=generation_pb2.StoppingCriteria(max_new_tokens=1 if silent else body.max_tokens or 0,
                                                             stop_token_ids=stop_ids, ignore_eos=body.ignore_eos),
                    priority=body.priority, prediction_token_ids=prediction,
                    speculation=speculation_pb(body.expansion()), return_draft_trees=body.return_draft_trees,
                    return_logprobs=body.wants_logprobs and not silent, top_logprobs=body.top,
                    return_prompt_logprobs=body.echo and body.wants_logprobs,
                    response_format=generation_pb2.ResponseFormat(**{grammar[0]: grammar[1]}) if grammar else None)
                echo = (text if isinstance(text, str) else self.decode(prompt)) if body.echo else None
                choices.append(Choice(p * body.n + j, self.stub.Generate(request, timeout=self.timeout, metadata=metadata),
                                      Tally(len(prompt), TextStream(self.decode, stops, body.include_stop_str_in_output),
                                            set(stop_ids), silent),
                                      prompt, echo, calls=StreamedCalls(plan) if plan and body.stream else None))
        start = time.perf_counter()
        try:
            firsts = await asyncio.gather(*(c.call.read() for c in choices))  # errors before the first token: statuses
        except grpc.aio.AioRpcError as e:  # all or nothing: a choice refused (the queue full) cancels the others
            for c in choices:
                c.call.cancel()
            which = "" if len(choices) == 1 else f" (one of this request's {len(choices)} choices; all were cancelled)"
            error = ApiError.from_grpc(e.code().name, (e.details() or "") + which)
            raise error.renamed("response_format", "tools") if plan else error from None
        for c, first in zip(choices, firsts):
            c.first = first
        self.metrics.ttft.observe(time.perf_counter() - start)
        kind = "chat" if isinstance(body, ChatCompletionRequest) else "text"
        reply = Reply(f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()),
                      served, kind, body.return_draft_trees, body.wants_logprobs, self, plan,
                      predicted=predicted is not None)
        prompt_tokens = sum(map(len, prompts))
        self.metrics.in_flight.inc()
        outcome = {"completed": False}

        def close():  # however the response ends: the calls are cancelled, so every service frees the requests
            for c in choices:
                c.call.cancel()
            self.metrics.in_flight.dec()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)
            if not outcome["completed"]:
                self.metrics.disconnects.inc()

        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return CallStream(self._events(choices, reply, include_usage, prompt_tokens, outcome), close)
        try:
            return await self._whole(http, choices, reply, prompt_tokens, outcome)
        finally:
            close()

    async def _messages(self, choice: Choice):
        """(message, text piece, tokens output) per step until the end or a stop string."""
        msg = choice.first
        while msg is not grpc.aio.EOF:
            piece, kept = choice.tally.step(msg)
            self.metrics.tokens.inc(kept)
            yield msg, piece, kept
            if choice.tally.text.stopped:
                return
            msg = await choice.call.read()

    async def _events(self, choices: list[Choice], reply: Reply, include_usage: bool, prompt_tokens: int,
                      outcome: dict):
        """Each choice's steps as chunks, as they come (choices interleaved)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice):
            try:
                async for msg, piece, kept in self._messages(c):
                    await queue.put(reply.chunk(c, piece, msg, kept))
            except grpc.aio.AioRpcError as e:
                await queue.put(ApiError.from_grpc(e.code().name, e.details() or "").body())
            finally:
                await queue.put(None)

        pumps = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            ended = 0
            while ended < len(pumps):
                item = await queue.get()
                if item is None:
                    ended += 1
                else:
                    yield sse(item)
            if include_usage:
                yield sse(reply.usage_chunk(usage_json(choices, prompt_tokens, reply.predicted)))
        finally:
            for p in pumps:
                p.cancel()
        outcome["completed"] = True
        yield "data: [DONE]\n\n"

    async def _whole(self, http: Request, choices: list[Choice], reply: Reply, prompt_tokens: int, outcome: dict):
        async def collect(c: Choice):
            text, entries = c.echo or "", reply.echo_logprobs(c)
            async for msg, piece, kept in self._messages(c):
                text += piece
                entries += [entry(e) for e in msg.logprobs[:kept]]
            return text, entries

        work = asyncio.ensure_future(asyncio.gather(*(collect(c) for c in choices)))
        gone = asyncio.ensure_future(wait_disconnect(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # the client left
            work.cancel()
            return Response(status_code=499)
        outcome["completed"] = True
        try:
            outputs = work.result()
        except grpc.aio.AioRpcError as e:
            raise ApiError.from_grpc(e.code().name, e.details() or "") from None
        return JSONResponse(reply.whole(choices, outputs, usage_json(choices, prompt_tokens, reply.predicted)))


class CallStream(StreamingResponse):
    """Server-sent events whose `close` runs however the response ends: finished, or the client
    gone before or while it streamed (then the generator may never have started)."""

    def __init__(self, events, close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.close = close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.close()
            await self.body_iterator.aclose()


def auth(http: Request) -> tuple:
    """The caller's Authorization header, as the manager's call metadata."""
    return (("authorization", http.headers["authorization"]),) if "authorization" in http.headers else ()


async def wait_disconnect(http: Request) -> None:
    """Returns when the client closes its connection (the body has been read already)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def entry(e) -> tuple[int, float, list[tuple[int, float]]]:
    """A protobuf TokenLogprob as (token, logprob, top); -inf as OpenAI writes it (JSON has no infinity)."""
    finite = lambda x: max(x, -9999.0)  # noqa: E731
    return e.token_id, finite(e.logprob), [(t, finite(v)) for t, v in zip(e.top_token_ids, e.top_logprobs)]


def with_chosen(e: tuple) -> list[tuple[int, float]] | None:
    """An entry's top alternatives with the chosen token's own added when it is not among them:
    completions' "up to logprobs + 1", as OpenAI's and vLLM's (chat lists exactly the top, as OpenAI's)."""
    token, logprob, top = e
    return top if top is None or any(t == token for t, _ in top) else top + [(token, logprob)]


@dataclass
class Reply:
    """The shapes of one request's response objects: completions ("text") or chat."""

    id: str
    created: int
    model: str
    kind: str
    trees: bool
    logprobs: bool  # the choices carry logprobs
    gateway: Gateway
    tools: ToolPlan | None = None  # chat with tools: a reply may be calls
    predicted: bool = False  # the request had a prediction: usage carries completion_tokens_details
    role_sent: set[int] = field(default_factory=set)  # chat: the choices whose role was sent

    def _object(self, suffix: str = "") -> dict:
        obj = "text_completion" if self.kind == "text" else "chat.completion" + suffix
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def echo_logprobs(self, c: Choice) -> list:
        """The echoed prompt's entries: its first token has no logprob (nothing precedes it)."""
        if c.echo is None or not self.logprobs:
            return []
        return [(c.prompt[0], None, None)] + [entry(e) for e in c.first.prompt_logprobs]

    def logprobs_json(self, c: Choice, entries: list) -> dict | None:
        """OpenAI's logprobs object of these entries (token, logprob or None, top or None)."""
        if not self.logprobs:
            return None
        text = self.gateway.token_texts
        if self.kind == "chat":
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": [
                {"token": a, "logprob": v, "bytes": list(a.encode())} for a, (_, v) in zip(text([i for i, _ in top]), top)]}
                for t, (_, lp, top) in zip(text([e[0] for e in entries]), entries)]}
        tokens, offsets = text([e[0] for e in entries]), []
        for t in tokens:
            offsets.append(c.offset)
            c.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else dict(zip(text([i for i, _ in top]), (v for _, v in top)))
                                 for top in map(with_chosen, entries)],
                "text_offset": offsets}

    def chunk(self, c: Choice, piece: str, msg: generation_pb2.GenerateResponse, kept: int) -> dict:
        """The step's chunk; its token_ids are the tokens its text and logprobs hold (the prompt's first
        with echo; not a stop token id, nor the token generated for echo with max_tokens 0)."""
        ids, entries = list(msg.token_ids[:kept]), [entry(e) for e in msg.logprobs[:kept]]
        if c.echo is not None:  # the first chunk: the prompt first
            piece, entries, c.echo = c.echo + piece, self.echo_logprobs(c) + entries, None
            ids = c.prompt + ids
        if self.kind == "text":
            choice = {"index": c.index, "text": piece, "finish_reason": c.tally.finish}
        else:
            finish, calls = c.tally.finish, None
            if c.calls is not None:
                piece = c.calls.add(piece)
                if finish:
                    held, calls = c.calls.end()
                    piece += held
            delta = {"content": piece} if c.index in self.role_sent else {"role": "assistant", "content": piece}
            self.role_sent.add(c.index)
            if calls:
                delta["content"] = None
                delta["tool_calls"], finish = [{"index": i, **call} for i, call in enumerate(calls)], "tool_calls"
            choice = {"index": c.index, "delta": delta, "finish_reason": finish}
        choice["logprobs"] = self.logprobs_json(c, entries)
        choice["token_ids"] = ids
        if self.trees:
            t = msg.draft_tree
            choice["token_texts"] = self.gateway.token_texts(ids)
            choice["draft_tree"] = {"token_ids": list(t.token_ids), "token_texts": self.gateway.token_texts(t.token_ids),
                                    "parents": list(t.parents), "speculators": list(t.speculators),
                                    "accepted": list(t.accepted)}
        return {**self._object(".chunk"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._object(".chunk"), "choices": [], "usage": usage}

    def whole(self, choices: list[Choice], outputs: list[tuple[str, list]], usage: dict) -> dict:
        out = []
        for c, (text, entries) in zip(choices, outputs):
            logprobs = self.logprobs_json(c, entries)
            if self.kind == "text":
                out.append({"index": c.index, "text": text, "finish_reason": c.tally.finish, "logprobs": logprobs})
            else:
                calls = self.tools.parse(text) if self.tools else None
                message = {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
                    {"role": "assistant", "content": text}
                out.append({"index": c.index, "message": message, "finish_reason": "tool_calls" if calls else c.tally.finish,
                            "logprobs": logprobs})
        return {**self._object(), "choices": out, "usage": usage}


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="specinfer gateway", description="OpenAI-compatible HTTP API over the SpecInfer manager",
                  docs_url="/docs", redoc_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    metrics = gateway.metrics

    app.add_middleware(CountRequests, counter=metrics.requests)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # no such route (404), wrong method (405)
        allowed = f" (allowed: {e.headers['Allow']})" if e.headers and "Allow" in e.headers else ""
        error = ApiError.from_http(e.status_code, f"{e.detail}: {request.method} {request.url.path}{allowed}")
        return JSONResponse(error.body(), status_code=error.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception):  # a bug here: still OpenAI's shape (and logged by uvicorn)
        error = ApiError(500, f"internal error in the gateway: {type(e).__name__}", "server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        error = validation_error(e.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/", include_in_schema=False)
    async def viewer():
        return FileResponse(STATIC / "index.html")

    @app.get("/health")
    async def health():
        try:
            status = (await gateway.health.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
        except grpc.aio.AioRpcError as e:
            return JSONResponse({"status": "unavailable", "manager": gateway.manager, "error": e.code().name},
                                status_code=503)
        ok = status == health_pb2.HealthCheckResponse.SERVING
        return JSONResponse({"status": "ok" if ok else "unavailable", "manager": gateway.manager},
                            status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        info = await gateway.model_info(auth(request))
        return {"object": "list", "data": [{
            "id": info.model_name, "object": "model", "created": 0, "owned_by": "specinfer",
            "specinfer": {"expansion": list(info.expansion), "tree_budget": info.tree_budget,
                          "speculators": info.speculators, "context_lookup_mask": info.context_lookup_mask,
                          "grammar_mask": info.grammar_mask, "prediction_mask": info.prediction_mask,
                          "drafters": list(info.drafter_names),
                          "context_length": info.context_length,
                          "default_max_new_tokens": info.default_max_new_tokens,
                          "max_new_tokens_cap": info.max_new_tokens_cap,
                          "chat_template": bool(gateway.tokenizer.chat_template)}}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        return tokenized(gateway, body, await gateway.served(body.model, auth(request)))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        return detokenized(gateway, body, await gateway.served(body.model, auth(request)))

    @app.get("/tokenizer_info")
    async def tokenizer(request: Request):
        return tokenizer_info(gateway.tokenizer, await gateway.served(None, auth(request)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await gateway.generate(request, body, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await gateway.generate(request, body, "/v1/chat/completions")

    return app


class CountRequests:
    """Pure ASGI middleware (it neither buffers streams nor hides disconnects): count each HTTP
    response by path and status."""

    def __init__(self, app, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/static"):
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in ROUTES else "other"  # callers choose paths: bound the labels
        status = []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.counter.labels(path, str(status[0] if status else 499)).inc()
