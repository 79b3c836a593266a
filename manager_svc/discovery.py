"""Where an SSM's replicas are: a static list, or a DNS name looked up again and again.

Targets (one `--speculators` entry each):
  host:port                      one replica
  host:port|host:port|...        replicas of one SSM
  dns:///name:port               the system resolver: every A/AAAA address of `name` (Docker's
                                 service names, Kubernetes headless Services); SRV records
                                 `_grpc._tcp.name` first, when there are any, give hosts and ports
  dns://server:port/name:port    the same, asking that DNS server (gRPC's target syntax)

Kubernetes publishes `_grpc._tcp.<service>` SRV records for a headless Service's port named
"grpc", and A records for its ready pods only, so a pod that goes away leaves the answer.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver


LOOKUP_ERRORS = (OSError, dns.exception.DNSException)


@dataclass(frozen=True)
class Target:
    static: tuple[str, ...] = ()  # replica addresses, or a DNS name:
    name: str = ""
    port: int = 0
    server: str = ""  # DNS server host[:port]; empty: the system's resolver

    @property
    def dynamic(self) -> bool:
        return bool(self.name)


def _split_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"speculators: {what} {text!r} needs host:port")
    return host.strip("[]"), int(port)


def parse_target(entry: str) -> Target:
    """ValueError names the field."""
    entry = entry.strip()
    if entry.startswith("dns:"):
        rest = entry[len("dns:"):]
        if not rest.startswith("//"):
            rest = "///" + rest  # dns:name:port
        server, sep, hostport = rest[2:].partition("/")
        if not sep:
            raise ValueError(f"speculators: {entry!r} is not dns:///name:port or dns://server/name:port")
        name, port = _split_port(hostport, "DNS target")
        return Target(name=name, port=port, server=server)
    replicas = tuple(a.strip() for a in entry.split("|"))
    for a in replicas:
        _split_port(a, "address")
    return Target(static=replicas)


def _resolver(server: str) -> dns.asyncresolver.Resolver:
    if not server:
        resolver = dns.asyncresolver.Resolver()
        resolver.lifetime = 2.0  # a host with no reachable DNS server still gets its addresses soon
        return resolver
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.lifetime = 2.0
    host, port = _split_port(server, "DNS server") if server.startswith("[") or server.count(":") == 1 else (server, 53)
    resolver.nameservers = [host]
    resolver.port = port
    return resolver


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _addresses(resolver: dns.asyncresolver.Resolver, system: bool, name: str, port: int) -> list[str]:
    if system:  # getaddrinfo: /etc/hosts and the platform's DNS, as every other program on the host sees them
        infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
        return [_hostport(info[4][0], port) for info in infos]
    out = []
    for kind in ("A", "AAAA"):
        try:
            out += [_hostport(r.address, port) for r in await resolver.resolve(name, kind, search=True)]
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            pass
    return out


async def resolve(target: Target) -> list[str]:
    """The target's replica addresses now, sorted and without repeats. Raises one of
    LOOKUP_ERRORS when the name cannot be looked up."""
    if not target.dynamic:
        return sorted(set(target.static))
    resolver = _resolver(target.server)
    system = not target.server
    try:
        srv = await resolver.resolve(f"_grpc._tcp.{target.name}", "SRV", search=True)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer, dns.resolver.NoNameservers, dns.exception.Timeout):
        srv = []  # no SRV records (Docker's DNS has none), or no DNS server at all: addresses alone
    found: list[str] = []
    for record in srv:
        found += await _addresses(resolver, system, record.target.to_text(omit_final_dot=True), record.port)
    if not srv:
        found = await _addresses(resolver, system, target.name, target.port)
    return sorted(set(found))

