"""One SSM served by several speculator replicas: they share the load, they are not merged.

A request is sticky to one replica (that replica holds the request's SSM KV cache): it is given
to the usable replica with the fewest requests when it first drafts, and stays there. When its
replica breaks (error, end of stream, slow answer) or leaves the DNS answer, the request moves to
another one on its next draft, which is sent the whole record and prefills it (a chunk a draft
when it is long, speculator.py); those steps go without its tree. A replica that appears gets new
requests first, as it has none.

The engine sees the same interface as a single `SpeculatorClient` (a drafter).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from specinfer.engine import Draft, gather

from .clients import SpeculatorClient
from .discovery import LOOKUP_ERRORS, Target, resolve

log = logging.getLogger("specinfer.manager")


class SpeculatorReplicas:
    CONNECT_WAIT = 2.0  # seconds a joining replica gets to answer before its first draft tries again

    def __init__(self, target: Target, drafter: int, timeout: float, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None, verifier_layers: tuple[int, ...] = ()):
        self.target = target
        self.drafter = drafter
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        self.credentials = credentials
        self.verifier_layers = verifier_layers  # the features the verifier returns
        self.replicas: dict[str, SpeculatorClient] = {}
        self.assigned: dict[str, SpeculatorClient] = {}  # request id -> its replica
        self.draft_ns = 0  # the slowest replica's own time in the last exchange

    @property
    def name(self) -> str:
        """What the replicas host, as the first that answered says ("" before any did)."""
        return next(("+".join(r.model_names) for r in self.replicas.values() if r.model_names), "")

    @property
    def wants_features(self) -> bool:
        return any(r.wants_features for r in self.replicas.values())

    @property
    def connected(self) -> bool:
        return any(r.connected for r in self.replicas.values())

    def load(self) -> dict[str, int]:
        """Requests per replica address."""
        counts = dict.fromkeys(self.replicas, 0)
        for r in self.assigned.values():
            counts[r.address] += 1
        return counts

    async def refresh(self) -> None:
        """Look the target up again: use new replicas, drop the ones gone (their requests move)."""
        try:
            addresses = await resolve(self.target)
        except LOOKUP_ERRORS as e:
            log.warning("speculators %s: lookup failed (%s); keeping %d replicas", self.target, e, len(self.replicas))
            return
        joined = []
        for address in addresses:
            if address not in self.replicas:
                log.info("speculator replica %s joins (drafter %d)", address, self.drafter)
                joined.append(SpeculatorClient(address, self.drafter, self.timeout, self.max_message_bytes,
                                               self.credentials, self.target.name, self.verifier_layers))
                self.replicas[address] = joined[-1]
        await asyncio.gather(*(r.connect(self.CONNECT_WAIT) for r in joined))
        for address in set(self.replicas) - set(addresses):
            log.info("speculator replica %s leaves", address)
            gone = self.replicas.pop(address)
            self.assigned = {rid: r for rid, r in self.assigned.items() if r is not gone}
            await gone.close()

    async def discover(self, interval: float) -> None:
        """Refresh every `interval` seconds, forever (a static list needs no refresh)."""
        while self.target.dynamic:
            await asyncio.sleep(interval)
            try:
                await self.refresh()
            except Exception:  # a bad answer must not end discovery
                log.exception("speculators %s: refresh failed", self.target)

    def _replica_for(self, request_id: str) -> SpeculatorClient | None:
        current = self.assigned.get(request_id)
        if current is not None and current.usable:
            return current
        if current is not None:
            current.release(request_id)
        usable = [r for r in self.replicas.values() if r.usable]
        if not usable:
            self.assigned.pop(request_id, None)
            return None
        load = self.load()
        chosen = min(usable, key=lambda r: load[r.address])
        self.assigned[request_id] = chosen
        return chosen

    async def draft(self, drafts: list[Draft]) -> dict:
        """Trees by request id, each from the request's replica."""
        by_replica: dict[SpeculatorClient, list[Draft]] = {}
        for d in drafts:
            replica = self._replica_for(d.request_id)
            if replica is not None:
                by_replica.setdefault(replica, []).append(d)
        answers = await gather(*(r.draft(ds) for r, ds in by_replica.items()))
        self.draft_ns = max((r.draft_ns for r in by_replica if r.connected), default=0)
        return {rid: tree for answer in answers for rid, tree in answer.items()}

    async def drafted_ahead(self) -> dict:
        """The trees drafted ahead, by request, each from the request's replica."""
        answers = await gather(*(r.drafted_ahead() for r in self.replicas.values()))
        return {rid: trees for r, answer in zip(self.replicas.values(), answers) for rid, trees in answer.items()
                if self.assigned.get(rid) is r}

    def release(self, request_id: str) -> None:
        replica = self.assigned.pop(request_id, None)
        if replica is not None:
            replica.release(request_id)

    async def flush(self) -> None:
        await asyncio.gather(*(r.flush() for r in self.replicas.values()))

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas.values()))
