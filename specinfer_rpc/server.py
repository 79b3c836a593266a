"""The scaffold every service runs in: a grpc.aio server on uvloop with health checking and
reflection, errors mapped to status codes in one place, and a graceful stop on SIGTERM/SIGINT
(health NOT_SERVING first, then in-flight calls get `grace` seconds to finish)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
import sys
from collections.abc import Callable

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specinfer.kv_cache import CacheFull

from .config import ServerConfig

log = logging.getLogger("specinfer")


class Abort(Exception):
    """End the call with this status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _status(e: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, Abort):
        return e.code, str(e)
    if isinstance(e, CacheFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
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


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options for servers and clients: message size limits, and reconnection that notices a
    restarted peer within about a second instead of gRPC's default backoff of up to 2 minutes."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000)]


async def serve(name: str, cfg: ServerConfig, services: list[tuple[Callable, object, str]]) -> None:
    """Run `services` ((add_to_server, servicer, full service name) triples) on cfg.host:cfg.port
    until SIGTERM or SIGINT, then stop gracefully."""
    server = grpc.aio.server(options=channel_options(cfg.max_message_bytes))
    for add, servicer, _ in services:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [full for _, _, full in services]
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
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


def run(main) -> None:
    """Run a service's async main on uvloop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(main)
