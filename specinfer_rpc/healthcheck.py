"""python -m specinfer_rpc.healthcheck HOST:PORT [--service NAME] [--timeout S]

One gRPC health check (grpc.health.v1 Check) for container healthchecks (docker/compose.yaml):
exit status 0 when the service reports SERVING, 1 otherwise, with the status or the error on
stderr. Plaintext only. Kubernetes probes speak gRPC health themselves and do not need this.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 5.0) -> str:
    """The serving status of `service` ("" = the whole server) at `address`, e.g. "SERVING".
    grpc.RpcError when the call fails (nothing listening, unknown service, deadline)."""
    with grpc.insecure_channel(address) as channel:
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
    args = parser.parse_args(argv)
    try:
        status = check(args.address, args.service, args.timeout)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}", file=sys.stderr)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
