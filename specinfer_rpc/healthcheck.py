"""python -m specinfer_rpc.healthcheck HOST:PORT [--service NAME] [--timeout S] [--tls-ca F ...]

One gRPC health check (grpc.health.v1 Check) for container healthchecks (docker/compose.yaml):
exit status 0 when the service reports SERVING, 1 otherwise, with the status or the error on
stderr. Kubernetes probes speak gRPC health themselves and do not need this (but they speak
plaintext only). With TLS it takes the service's own settings from the environment
(SPECINFER_TLS_CA, SPECINFER_TLS_CERT, SPECINFER_TLS_KEY), so inside the service's container it
needs no flags; --tls-server-name names the certificate's host when it does not cover HOST.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .security import channel_credentials


def check(address: str, service: str = "", timeout: float = 5.0, credentials: grpc.ChannelCredentials | None = None,
          server_name: str = "") -> str:
    """The serving status of `service` ("" = the whole server) at `address`, e.g. "SERVING".
    grpc.RpcError when the call fails (nothing listening, unknown service, deadline)."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    with (grpc.insecure_channel(address) if credentials is None
          else grpc.secure_channel(address, credentials, options=options)) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specinfer_rpc.healthcheck",
                                     description="Exit 0 when the gRPC health service at HOST:PORT reports "
                                                 "SERVING, else 1.")
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    for flag, what in (("ca", "CA bundle: connect with TLS"), ("cert", "client certificate (mutual TLS)"),
                       ("key", "key of --tls-cert"), ("server_name", "host name the server's certificate has")):
        env = f"SPECINFER_TLS_{flag.upper()}"
        parser.add_argument(f"--tls-{flag.replace('_', '-')}", default=os.environ.get(env, ""), help=f"{what} [env {env}]")
    args = parser.parse_args(argv)
    try:
        credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        status = check(args.address, args.service, args.timeout, credentials, args.tls_server_name)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}", file=sys.stderr)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
