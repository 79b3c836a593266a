"""The scaffold every service runs in: a grpc.aio server on uvloop with health checking and
reflection, errors mapped to status codes in one place, requests that do not parse refused in
one place, and a graceful stop on SIGTERM/SIGINT (health NOT_SERVING first, then in-flight calls
get `grace` seconds to finish)."""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import logging
import signal
import sys
from collections.abc import Callable

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specinfer.errors import (
    AlreadyRunning,
    CacheFull,
    Failed,
    Overloaded,
    VerifierLost,
    VerifierUnavailable,
)

from .config import ServerConfig
from .metrics import serve_metrics
from .security import server_credentials

log = logging.getLogger("specinfer")


class Abort(Exception):
    """End the call with this status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


CORE_ERRORS = {  # the core's typed errors (specinfer/errors.py) as status codes
    CacheFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AlreadyRunning: grpc.StatusCode.ALREADY_EXISTS,
    VerifierUnavailable: grpc.StatusCode.UNAVAILABLE,
    VerifierLost: grpc.StatusCode.UNAVAILABLE,
    Failed: grpc.StatusCode.INTERNAL,
}


def _status(e: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, Abort):
        return e.code, str(e)
    for kind, code in CORE_ERRORS.items():
        if isinstance(e, kind):
            return code, str(e)
    if isinstance(e, ValueError):  # the core names the field: "max_new_tokens: must be > 0, got 0"
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    log.exception("internal error")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


def rpc_errors(method: Callable) -> Callable:
    """Decorate a servicer method (unary or streaming) so exceptions become status codes."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:  # the peer went away, or the server is stopping: no one to answer
                return
            except Exception as e:
                await context.abort(*_status(e))
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await context.abort(*_status(e))
    return unary


_CORRUPT = object()  # what a guarded deserializer returns for bytes that do not parse


class CorruptRequests(grpc.aio.ServerInterceptor):
    """A request, or an item of a request stream, whose bytes do not parse ends its call with
    INVALID_ARGUMENT "request is not a valid <Message>" and one WARNING line. (grpc.aio itself
    answers UNKNOWN and logs a traceback: the deserializer raises before or outside the servicer.)"""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _guard(handler, details.method)


def _guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that returns _CORRUPT instead of raising, and its behaviour
    wrapped, in the calling style grpc.aio dispatches on, to refuse a _CORRUPT request."""
    parse = handler.request_deserializer
    message = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)  # parse is Message.FromString
    reason = f"request is not a valid {message.name if message else 'message'}"
    kind = ("stream_" if handler.request_streaming else "unary_") + ("stream" if handler.response_streaming else "unary")
    behaviour = getattr(handler, kind)

    def tolerant(raw: bytes):
        try:
            return parse(raw)
        except Exception:  # noqa: BLE001 (protobuf's DecodeError, or whatever another deserializer raises)
            return _CORRUPT

    def refuse(context):  # one line; then abort: a coroutine on grpc.aio's context, done at once on its sync one
        log.warning("%s: %s (from %s)", method, reason, context.peer())
        return context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)

    async def valid(request, context):
        if request is _CORRUPT:
            await refuse(context)  # raises AbortError
        return request

    async def upto_corrupt(requests, corrupt: list):  # a request stream, ended at its first corrupt item
        async for r in requests:
            if r is _CORRUPT:
                corrupt.append(r)
                return
            yield r

    async def admit(request, context, corrupt: list):
        """The request, or the request stream up to a corrupt item: the servicer answers the items
        before it, and the call is refused after (abort from the call's own task, not from wherever
        the servicer reads its stream: a servicer may read ahead in a task of its own)."""
        if handler.request_streaming:  # (servicers iterate their request streams, none calls context.read())
            return upto_corrupt(request, corrupt)
        return await valid(request, context)

    if inspect.isasyncgenfunction(behaviour):
        async def guarded(request, context):
            corrupt = []
            async for response in behaviour(await admit(request, context, corrupt), context):
                yield response
            if corrupt:
                await refuse(context)
    elif inspect.iscoroutinefunction(behaviour):
        async def guarded(request, context):
            corrupt = []
            response = await behaviour(await admit(request, context, corrupt), context)
            if corrupt:
                await refuse(context)
            return response
    else:  # every handler served is a coroutine or an async generator
        return handler
    return handler._replace(request_deserializer=tolerant, **{kind: guarded})


class Health(health.aio.HealthServicer):
    """grpc_health's servicer with `List` as well: every service's status (the installed one answers
    List UNIMPLEMENTED and logs a traceback, so any client could fill the logs)."""

    async def List(self, request, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            service: health_pb2.HealthCheckResponse(status=status) for service, status in self._server_status.items()})


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options for servers and clients: message size limits, and reconnection that notices a
    restarted peer within about a second instead of gRPC's default backoff of up to 2 minutes."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            # a server accepts its peers' keepalive pings on long quiet streams (an idle speculator
            # stream) instead of answering GOAWAY too_many_pings
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 0)]


async def serve(name: str, cfg: ServerConfig, services: list[tuple[Callable, object, str]],
                interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> None:
    """Run `services` ((add_to_server, servicer, full service name) triples) on cfg.host:cfg.port,
    TLS when cfg has a certificate, and /metrics on cfg.metrics_port, until SIGTERM or SIGINT,
    then stop gracefully."""
    credentials = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.tls_client_auth)
    server = grpc.aio.server(options=channel_options(cfg.max_message_bytes),
                             interceptors=(*interceptors, CorruptRequests()))
    for add, servicer, _ in services:
        add(servicer, server)
    health_servicer = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [full for _, _, full in services]
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{cfg.host}:{cfg.port}"
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    metrics = serve_metrics(cfg.host, cfg.metrics_port) if cfg.metrics_port >= 0 else None
    if metrics is not None:  # printed before "listening": whoever waits for that line has both
        print(f"{name} metrics on http://{cfg.host}:{metrics.server_port}/metrics", flush=True)
    # what start-up made (modules, models, tokenizers) lives as long as the service: kept out of the
    # collector's scans (its garbage collected first), so that a full collection under load pauses for
    # what serving allocates only
    gc.collect()
    gc.freeze()
    await server.start()
    for service in names + [""]:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"{name} listening on {cfg.host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(f"{name} stopping (grace {cfg.grace}s)", file=sys.stderr, flush=True)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(cfg.grace)
    if metrics is not None:
        metrics.shutdown()


def run(main) -> None:
    """Run a service's async main on uvloop; a bad setting (ValueError naming it) or a checkpoint that
    is not there (FileNotFoundError, e.g. the default LLM's package not installed) ends it with that
    message and exit code 2."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        uvloop.run(main)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
