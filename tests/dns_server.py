"""A small authoritative DNS server on 127.0.0.1 (UDP) for the tests: SRV and A records that the
test changes while the system runs, as Kubernetes does for a headless Service's ready pods."""

from __future__ import annotations

import socketserver
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class DNSServer:
    def __init__(self):
        self.records: dict[tuple[str, str], list[str]] = {}  # (name., type) -> rdata texts
        self.lock = threading.Lock()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                data, sock = self.request
                query = dns.message.from_wire(data)
                response = dns.message.make_response(query)
                response.flags |= dns.flags.AA
                q = query.question[0]
                kind = dns.rdatatype.to_text(q.rdtype)
                with outer.lock:
                    rdatas = list(outer.records.get((q.name.to_text().lower(), kind), ()))
                    known = any(name == q.name.to_text().lower() for name, _ in outer.records)
                if rdatas:
                    response.answer.append(dns.rrset.from_text_list(q.name, 1, dns.rdataclass.IN, q.rdtype, rdatas))
                elif not known:
                    response.set_rcode(dns.rcode.NXDOMAIN)
                sock.sendto(response.to_wire(), self.client_address)

        self.server = socketserver.ThreadingUDPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set(self, name: str, kind: str, rdatas: list[str]) -> None:
        with self.lock:
            self.records[(name.lower().rstrip(".") + ".", kind)] = list(rdatas)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
