"""python -m gateway_svc --manager HOST:PORT [--port 8000]: the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import sys
from dataclasses import dataclass

import uvicorn

from specinfer.checkpoints import DEFAULT_LLM, checkpoint_dir
from specinfer_rpc.config import EndpointConfig, load_config, option
from specinfer_rpc.security import channel_credentials
from specinfer_rpc.server import run

from .app import Gateway, create_app


@dataclass
class GatewayConfig(EndpointConfig):
    """The HTTP gateway: OpenAI's completions and chat completions API, and the live tree viewer."""

    port: int = option(8000, "HTTP port to listen on (0: any free port)")
    manager: str = option("127.0.0.1:50051", "the manager's address (its gRPC Generation API); a name with several "
                                             "addresses (dns:///managers:50051, a headless Service) is used round robin")
    tokenizer: str = option(DEFAULT_LLM, "the LLM's checkpoint (directory, .gguf file or the default), for its tokenizer and chat template")
    model_name: str = option("", "model id clients name (empty: the manager's model_name)")
    request_timeout: float = option(600.0, "seconds a generation may take before it fails 504")
    max_message_bytes: int = option(4 << 20, "largest gRPC message accepted or sent")
    max_choices: int = option(1024, "choices (prompts x n) one request may ask; each is a request to the manager, "
                                    "which queues what its --max-batch and --max-queue allow (past them: 429)")


def listening_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def main(cfg: GatewayConfig) -> None:
    from transformers import AutoTokenizer

    if cfg.tls_key and not cfg.tls_cert:
        raise ValueError("tls_cert: needed with tls_key")
    if cfg.tls_client_auth and not (cfg.tls_cert and cfg.tls_ca):
        raise ValueError("tls_ca: needed with tls_client_auth (and tls_cert)")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(cfg.tokenizer))
    # to the manager: TLS verified by tls_ca, presenting tls_cert (as the other services do)
    gateway = Gateway(cfg.manager, tokenizer, cfg.request_timeout,
                      channel_credentials(cfg.tls_ca, cfg.tls_cert, cfg.tls_key), cfg.max_message_bytes, cfg.model_name,
                      cfg.max_choices)
    sock = listening_socket(cfg.host, cfg.port)
    config = uvicorn.Config(create_app(gateway), log_level="warning", timeout_graceful_shutdown=cfg.grace,
                            ssl_certfile=cfg.tls_cert or None, ssl_keyfile=cfg.tls_key or None,
                            ssl_ca_certs=cfg.tls_ca if cfg.tls_client_auth else None,
                            ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_client_auth else ssl.CERT_NONE)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = sock.getsockname()[:2]
        scheme = "https" if cfg.tls_cert else "http"
        where = f"[{host}]" if ":" in host else host
        print(f"gateway: OpenAI API on {scheme}://{where}:{port}/v1, live tree viewer on {scheme}://{where}:{port}/",
              file=sys.stderr, flush=True)
        print(f"gateway listening on {where}:{port}", flush=True)
    await serving  # until SIGTERM/SIGINT (uvicorn's handlers), then a graceful stop
    await gateway.channel.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(main(load_config(GatewayConfig, prog="python -m gateway_svc")))
