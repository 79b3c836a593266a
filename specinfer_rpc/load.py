"""A bounded streaming load on the Generation API: `concurrency` workers each send requests back
to back for `duration` seconds; reports tokens/s, time to first token and inter-token latency.

Inter-token latency is per token: a chunk of n tokens arriving dt after the previous chunk counts
as n tokens at dt / n each, so speculation's multi-token chunks are not mistaken for stalls.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

import grpc

from specinfer.generate import Request
from specinfer.sampling import SamplingParams

from .client import connect, generate, request_pb


@dataclass
class LoadReport:
    concurrency: int
    seconds: float
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    steps: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)  # whole request

    def summary(self) -> dict:
        def pct(xs, q):
            return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1e3 if len(xs) > 1 else float("nan")
        return {"concurrency": self.concurrency, "seconds": round(self.seconds, 2), "requests": self.requests,
                "errors": sum(self.errors.values()), "tokens": self.tokens,
                "tokens_per_s": round(self.tokens / self.seconds, 1),
                "tokens_per_step": round(self.tokens / self.steps, 3) if self.steps else 0.0,
                "ttft_p50_ms": round(pct(self.ttft, 50), 1), "ttft_p99_ms": round(pct(self.ttft, 99), 1),
                "itl_p50_ms": round(pct(self.itl, 50), 2), "itl_p99_ms": round(pct(self.itl, 99), 2),
                "latency_p50_ms": round(pct(self.latency, 50), 1), "latency_p99_ms": round(pct(self.latency, 99), 1)}


async def run_load(address: str, prompts: list[list[int]], concurrency: int, duration: float,
                   max_new_tokens: int = 64, speculation: str | None = None, max_requests: int | None = None,
                   sampling: SamplingParams = SamplingParams(),
                   credentials: grpc.ChannelCredentials | None = None, top_logprobs: int | None = None,
                   ignore_eos: bool = True) -> LoadReport:
    """Workers take prompts round-robin; stop starting requests after `duration` s (or
    `max_requests` in all) and wait for the running ones to finish. top_logprobs: every request
    asks for its tokens' logprobs with that many alternatives (None: none); ignore_eos: every request
    runs to max_new_tokens (False: it stops where the LLM ends its reply)."""
    stub = connect(address, credentials)
    report = LoadReport(concurrency, 0.0)
    start = time.perf_counter()
    counter = iter(range(10**9))

    async def worker():
        while time.perf_counter() - start < duration:
            n = next(counter)
            if max_requests is not None and n >= max_requests:
                return
            req = Request(prompts[n % len(prompts)], max_new_tokens, sampling, ignore_eos=ignore_eos,
                          logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0)
            try:
                s = await generate(stub, request_pb(req, speculation))
            except grpc.aio.AioRpcError as e:
                report.errors[e.code().name] = report.errors.get(e.code().name, 0) + 1
                continue
            report.requests += 1
            report.tokens += len(s.token_ids)
            report.steps += s.usage.verifier_steps
            report.ttft.append(s.chunk_times[0])
            report.latency.append(s.chunk_times[-1])
            for prev, now, size in zip(s.chunk_times, s.chunk_times[1:], s.chunk_sizes[1:]):
                report.itl.extend([(now - prev) / size] * size)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    report.seconds = time.perf_counter() - start
    return report
