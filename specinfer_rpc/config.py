"""Service configuration: one dataclass per service, filled from flags and environment variables.

Every field `max_batch` is the flag `--max-batch` and the environment variable
`SPECINFER_MAX_BATCH`; a flag beats the environment, which beats the default. Lists are
comma-separated. The resolved configuration is printed at start.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass


def env_name(field: str) -> str:
    return "SPECINFER_" + field.upper()


def _parser_for(kind):
    if kind is bool:
        return lambda text: text.strip().lower() in ("1", "true", "yes", "on")
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        return lambda text: [item(x) for x in text.split(",") if x.strip()]
    return kind


def load_config(cls, argv: list[str] | None = None, prog: str | None = None):
    """Build `cls` (a dataclass whose fields carry metadata={"help": ...}) from flags and env."""
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().splitlines()[0])
    for f in dataclasses.fields(cls):
        parse = _parser_for(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        env = env_name(f.name)
        if env in os.environ:
            default = parse(os.environ[env])
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {default!r}]"
        if hints[f.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=parse, default=default, help=help_text)
    cfg = cls(**vars(parser.parse_args(argv)))
    print(f"{parser.prog}: {cfg}", file=sys.stderr, flush=True)
    return cfg


def option(default, help: str, **kw):
    """A config field with its help text."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help}, **kw)
    return dataclasses.field(default=default, metadata={"help": help}, **kw)


@dataclass
class EndpointConfig:
    """Where a service listens and how it secures its connections (every service, the HTTP
    gateway included)."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(0, "port to listen on (0: any free port)")
    max_message_bytes: int = option(16 << 20, "largest gRPC message accepted or sent")
    grace: float = option(10.0, "seconds in-flight calls get to finish on SIGTERM")
    tls_cert: str = option("", "PEM certificate chain: serve TLS with it (empty: plaintext), and call the other "
                               "services with TLS, presenting it as client certificate")
    tls_key: str = option("", "PEM private key of tls_cert")
    tls_ca: str = option("", "PEM CA bundle: verify the services this one calls with it (empty: the system's roots "
                             "when tls_cert is set, else plaintext to them)")
    tls_client_auth: bool = option(False, "mutual TLS: require client certificates signed by tls_ca")


@dataclass
class ServerConfig(EndpointConfig):
    """Settings every gRPC service has."""

    metrics_port: int = option(-1, "port of the Prometheus /metrics endpoint, on the same host (-1: none; 0: any free port)")
