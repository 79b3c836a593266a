"""Prometheus metrics: the /metrics endpoint every service serves on its own port, and the
buckets the services' histograms share. Each service defines its own metrics next to its code
(manager_svc/metrics.py, the speculator's and verifier's servicers) in the process's default
registry, which also carries the process collector (resident memory, CPU seconds, open fds)."""

from __future__ import annotations

from prometheus_client import start_http_server

LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)  # +Inf is added
SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


def serve_metrics(host: str, port: int):
    """Start the HTTP /metrics server on a thread; returns it (server_port is the bound port)."""
    server, _ = start_http_server(port, addr=host)
    return server
