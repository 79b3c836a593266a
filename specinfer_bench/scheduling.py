"""Memory and scheduling through the real services on the default LLM, as `specinfer serve` runs it
(the verifier with the head's feature layers, SSM 0's speculator and the head's, the manager with
its defaults; `--llm` another: context lookup alone), one scenario at a time, each setting side by
side in the same run:

- multiturn: one chat of 8 turns, the conversation sent again each turn, the prefix cache on and
  off: per turn the prompt, the tokens the cache held, the rows prefilled, the time to first token;
- capacity: 48 chat requests at once with max_tokens 2048 and replies of 100-300 tokens
  (`models/smollm2/capacity_prompts.jsonl`) on a 16384-token pool: the most running
  at once and the tokens/s, against the `--baseline` source tree (today's main, which reserves
  prompt + max_tokens up front and takes at most 1024);
- overflow: 64 requests (ignore_eos) whose whole need is twice the pool: all complete, identical to
  the same requests on a pool that holds them all, the preemptions, every block free afterwards;
- fairness: 8 short requests sent while 32 long streams (1000 tokens) fill a batch of 32, fair
  turns on and off: each short request's time against its time alone;
- long: a ~6000-token prompt sent while 8 streams run, chunked prefill (verifier and speculators)
  with each of `--long-chunks` (0: off): the streams' longest wait between two chunks (and before
  the prompt was sent), and the long request's time to first token.

    python -m specinfer_bench.scheduling --scenarios multiturn,overflow,fairness,long,capacity \\
        --baseline /path/to/main --out bench/results/scheduling_cpu
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import grpc
from tqdm import tqdm

from specinfer.checkpoints import (DEFAULT_LLM, checkpoint_dir, default_prompts, drafter_dirs, served_heads,
                                   served_ssms)
from specinfer.generate import Request
from specinfer.prompts import prompt_ids, read_prompt_file
from specinfer_rpc.client import connect, generate, request_pb
from specinfer_rpc.launch import System, start_backends
from specinfer_rpc.v1 import verifier_pb2, verifier_pb2_grpc

from .report import command_line, machine, write_record

GENERAL = Path(__file__).resolve().parent.parent / "models" / "smollm2" / "general_prompts.jsonl"
# chat requests whose greedy replies on the default LLM measured 100-300 tokens, ending by themselves
CAPACITY = GENERAL.with_name("capacity_prompts.jsonl")


class Bench:
    """Starts an LLM's services as `specinfer serve` does (the default LLM with its SSM 0 and head,
    another with context lookup alone), from this tree or `source`, with extra flags, one system at a time."""

    def __init__(self, llm: str, logs: Path):
        self.llm, self.logs = llm, logs
        self.ssms, self.heads = drafter_dirs(None, False, llm, served_ssms), drafter_dirs(None, False, llm, served_heads)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(llm))

    def start(self, tag: str, verifier_args: list[str] = (), manager_args: list[str] = (),
              source: Path | None = None, speculator_args: list[str] = ()) -> System:
        system = System(log_dir=self.logs / tag)
        verifier, specs = start_backends(system, self.llm, self.ssms, len(self.ssms), self.heads,
                                         verifier_args=verifier_args, speculator_args=speculator_args, timeout=300,
                                         source=source)
        system.start("manager", "manager_svc", ["--port", "0", "--verifier", verifier.address, "--tokenizer", self.llm,
                                                "--speculators", ",".join(s.address for s in specs), *manager_args],
                     300, source=source)
        return system

    def chat(self, messages: list[dict]) -> list[int]:
        return prompt_ids(self.tokenizer, {"messages": messages})


def pool_info(system: System) -> verifier_pb2.VerifierInfo:
    with grpc.insecure_channel(system.by_name("verifier").address) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=30)


async def run_all(address: str, requests: list[Request], watch=None) -> tuple[list, float, int]:
    """Every request at once: the streams, the seconds, and the most requests the verifier held at once
    (polled), when `watch` is the system."""
    stub = connect(address)
    most, done = 0, False

    async def poll():
        nonlocal most
        while not done:
            most = max(most, (await asyncio.to_thread(pool_info, watch)).active_requests)
            await asyncio.sleep(0.2)

    poller = asyncio.create_task(poll()) if watch is not None else None
    start = time.perf_counter()
    streams = await asyncio.gather(*(generate(stub, request_pb(r), timeout=3600) for r in requests))
    seconds = time.perf_counter() - start
    done = True
    if poller is not None:
        await poller
    return streams, seconds, most


def cached(stream) -> int:
    return getattr(stream.usage, "cached_tokens", 0)  # a baseline's stubs may not have it


def multiturn(bench: Bench, turns: int, max_new_tokens: int) -> dict:
    users = [r["messages"][0]["content"] for r in read_prompt_file(GENERAL)[:turns]]
    out = {}
    for setting, flags in (("cache on", []), ("cache off", ["--no-prefix-cache"])):
        system = bench.start(f"multiturn-{setting.split()[1]}", flags)
        try:
            messages, rows = [], []
            for user in tqdm(users, desc=f"multiturn, {setting}"):
                messages.append({"role": "user", "content": user})
                prompt = bench.chat(messages)
                [stream], _, _ = asyncio.run(run_all(system.manager.address, [Request(prompt, max_new_tokens)]))
                messages.append({"role": "assistant",
                                 "content": bench.tokenizer.decode(stream.token_ids, skip_special_tokens=True)})
                rows.append({"prompt": len(prompt), "cached": cached(stream), "prefilled": len(prompt) - cached(stream),
                             "ttft_s": stream.chunk_times[0], "reply": len(stream.token_ids)})
        finally:
            system.stop()
        out[setting] = rows
    return out


def overflow(bench: Bench, prompts: list[list[int]], max_new_tokens: int) -> dict:
    requests = [Request(p, max_new_tokens, ignore_eos=True, id=f"r{i}") for i, p in enumerate(prompts)]
    need = sum(-(-(len(p) + max_new_tokens + 40) // 16) * 16 for p in prompts)  # + a merged tree's slots
    pool = need // 2
    out = {"requests": len(requests), "need_tokens": need, "pool_tokens": pool}
    for setting, kv in (("pool half the need", pool), ("pool for all", 4 * need)):
        system = bench.start(f"overflow-{kv}", ["--kv-cache-tokens", str(kv)], ["--max-batch", "64"])
        try:
            streams, seconds, most = asyncio.run(run_all(system.manager.address, requests, system))
            time.sleep(1.0)  # the last releases ride the manager's idle flush
            info = pool_info(system)
        finally:
            system.stop()
        out[setting] = {"seconds": seconds, "tokens": sum(len(s.token_ids) for s in streams), "most_running": most,
                        "completed": sum(s.finish_reason == "length" for s in streams),
                        "preemptions": sum(getattr(s.usage, "preemptions", 0) for s in streams),
                        "free_after": info.kv_cache_free_tokens, "pool": info.kv_cache_tokens,
                        "outputs": [s.token_ids for s in streams]}
    out["identical"] = out["pool half the need"].pop("outputs") == out["pool for all"].pop("outputs")
    return out


def capacity(bench: Bench, prompts: list[list[int]], baseline: Path | None) -> dict:
    out = {}
    runs = [("blocks on demand", None, 2048)] + ([("baseline (reserves, cap 1024)", baseline, 1024)] if baseline else [])
    for setting, source, max_tokens in runs:
        system = bench.start(f"capacity-{max_tokens}", ["--kv-cache-tokens", "16384"], source=source)
        try:
            streams, seconds, most = asyncio.run(run_all(system.manager.address,
                                                         [Request(p, max_tokens) for p in prompts], system))
        finally:
            system.stop()
        tokens = sum(len(s.token_ids) for s in streams)
        lengths = sorted(len(s.token_ids) for s in streams)
        out[setting] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "most_running": most,
                        "reply_tokens_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
                        "finish": {r: sum(s.finish_reason == r for s in streams) for r in ("eos", "length", "stop")},
                        "outputs": [s.token_ids for s in streams]}
    outputs = [v.pop("outputs") for v in out.values()]
    out["identical"] = all(o == outputs[0] for o in outputs)
    return out


def fairness(bench: Bench, longs: list[list[int]], shorts: list[list[int]], short_tokens: int) -> dict:
    out = {}
    for setting, turn in (("fair turns (32 tokens)", "32"), ("first come, first served", "0")):
        system = bench.start(f"fairness-{turn}", ["--kv-cache-tokens", "65536"],
                             ["--max-batch", "32", "--turn-tokens", turn])
        try:
            address = system.manager.address
            alone = [asyncio.run(run_all(address, [Request(p, short_tokens)]))[1] for p in shorts]

            async def beside():
                stub = connect(address)
                calls = [asyncio.create_task(generate(stub, request_pb(Request(p, 1000, ignore_eos=True)), 3600))
                         for p in longs]
                await asyncio.sleep(15)  # the long streams are running
                start = time.perf_counter()

                async def one(p):
                    await generate(stub, request_pb(Request(p, short_tokens)), 3600)
                    return time.perf_counter() - start

                times = await asyncio.gather(*(one(p) for p in shorts))
                for c in calls:
                    c.cancel()
                return times

            times = asyncio.run(beside())
        finally:
            system.stop()
        out[setting] = {"alone_s": alone, "beside_s": times, "ratio": [t / a for t, a in zip(times, alone)]}
    return out


def long_prompt(bench: Bench, streams: list[list[int]], long: list[int], chunks: list[int]) -> dict:
    out = {"long_prompt_tokens": len(long)}
    for setting, chunk in ((f"chunked ({c})" if c else "whole", str(c)) for c in chunks):
        # a verify timeout of 3 minutes (default 60 s): a chunk slowed by a shared machine is measured, not failed
        system = bench.start(f"long-{chunk}", ["--kv-cache-tokens", "32768"],
                             ["--prefill-chunk", chunk, "--verify-timeout", "180"], speculator_args=["--prefill-chunk", chunk])
        try:
            address = system.manager.address

            async def run():
                stub = connect(address)
                calls = [asyncio.create_task(generate(stub, request_pb(Request(p, 160, ignore_eos=True)), 3600))
                         for p in streams]
                await asyncio.sleep(8)
                sent = time.perf_counter()
                first = await asyncio.gather(generate(stub, request_pb(Request(long, 4)), 3600),
                                             return_exceptions=True)
                runs = await asyncio.gather(*calls, return_exceptions=True)
                return first[0], runs, sent

            start = time.perf_counter()
            first, runs, sent = asyncio.run(run())
        finally:
            system.stop()
        failed = [r for r in [first, *runs] if isinstance(r, Exception)]
        if failed:  # e.g. a step past the manager's --verify-timeout fails every request in it
            out[setting] = {"failed": f"{len(failed)} of {1 + len(runs)} requests: {failed[0].code().name}: "
                                      f"{failed[0].details()}"}
            continue
        # the streams' chunks' times since their start, against the long request's: their longest
        # wait between two chunks after it was sent
        sent_at = sent - start
        gaps = [max((b - a for a, b in zip(r.chunk_times, r.chunk_times[1:]) if b > sent_at), default=0.0)
                for r in runs]
        before = [max((b - a for a, b in zip(r.chunk_times, r.chunk_times[1:]) if b <= sent_at), default=0.0)
                  for r in runs]
        every = sorted(b - a for r in runs for a, b in zip(r.chunk_times, r.chunk_times[1:]))
        out[setting] = {"long_ttft_s": first.chunk_times[0], "streams_longest_gap_s": max(gaps),
                        "streams_longest_gap_before_s": max(before), "streams_median_gap_s": every[len(every) // 2]}
    return out


def markdown(results: dict, meta: dict) -> str:
    lines = [f"`{meta['command']}` on {meta['machine']}", ""]
    if "multiturn" in results:
        r = results["multiturn"]
        lines += ["## Multi-turn: one chat, the conversation sent again each turn (greedy, replies of at most "
                  f"{meta['max_new_tokens']} tokens)", "",
                  "| turn | prompt | cached on | prefilled on | TTFT on (s) | prefilled off | TTFT off (s) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for i, (on, off) in enumerate(zip(r["cache on"], r["cache off"]), 1):
            lines.append(f"| {i} | {on['prompt']} | {on['cached']} | {on['prefilled']} | {on['ttft_s']:.3f} | "
                         f"{off['prefilled']} | {off['ttft_s']:.3f} |")
        lines.append("")
    if "capacity" in results:
        r = results["capacity"]
        lines += ["## Capacity: 48 chat requests at once, a 16384-token pool", "",
                  "| setting | most running | tokens | seconds | tok/s | reply tokens min/median/max | finish |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for k, v in r.items():
            if isinstance(v, dict):
                lines.append(f"| {k} | {v['most_running']} | {v['tokens']} | {v['seconds']:.1f} | "
                             f"{v['tokens_per_s']:.1f} | {'/'.join(map(str, v['reply_tokens_min_median_max']))} | "
                             f"{v['finish']} |")
        lines += [f"\nOutputs identical across settings: {r['identical']}", ""]
    if "overflow" in results:
        r = results["overflow"]
        lines += [f"## Overflow: {r['requests']} requests needing {r['need_tokens']} KV slots in all", "",
                  "| pool | most running | completed | preemptions | seconds | free slots after / pool |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for k in ("pool half the need", "pool for all"):
            v = r[k]
            lines.append(f"| {k} | {v['most_running']} | {v['completed']} | {v['preemptions']} | {v['seconds']:.1f} | "
                         f"{v['free_after']} / {v['pool']} |")
        lines += [f"\nOutputs identical: {r['identical']}", ""]
    if "fairness" in results:
        r = results["fairness"]
        lines += ["## Fairness: 8 short requests sent while 32 long streams fill a batch of 32", "",
                  "| setting | short alone (s), median | beside the long ones (s), each | ratio, worst |",
                  "| --- | --- | --- | --- |"]
        for k, v in r.items():
            alone = sorted(v["alone_s"])[len(v["alone_s"]) // 2]
            lines.append(f"| {k} | {alone:.2f} | {', '.join(f'{t:.1f}' for t in v['beside_s'])} | "
                         f"{max(v['ratio']):.1f}x |")
        lines.append("")
    if "long" in results:
        r = results["long"]
        lines += [f"## Long prompt: {r['long_prompt_tokens']} tokens sent while 8 streams run", "",
                  "| prefill | long request's first token (s) | streams' longest wait (s) | the same before it was "
                  "sent (s) | streams' median gap (s) |",
                  "| --- | --- | --- | --- | --- |"]
        for k, v in r.items():
            if isinstance(v, dict) and "failed" in v:
                lines.append(f"| {k} | failed: {v['failed']} | | | |")
            elif isinstance(v, dict):
                lines.append(f"| {k} | {v['long_ttft_s']:.2f} | {v['streams_longest_gap_s']:.2f} | "
                             f"{v.get('streams_longest_gap_before_s', float('nan')):.2f} | "
                             f"{v['streams_median_gap_s']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llm", default=DEFAULT_LLM)
    p.add_argument("--scenarios", default="multiturn,overflow,fairness,long,capacity")
    p.add_argument("--baseline", type=Path, help="a source tree to compare with in the capacity scenario (today's main)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="multiturn: each reply's most tokens")
    p.add_argument("--long-chunks", default="512,0", help="long: the prefill chunks to compare (0: the whole prompt)")
    p.add_argument("--out", type=Path, default=Path("bench/results/scheduling_cpu"))
    args = p.parse_args()
    bench = Bench(args.llm, Path(tempfile.mkdtemp(prefix="specinfer-scheduling-")))
    general = [bench.chat(r["messages"]) for r in read_prompt_file(GENERAL)]
    held = read_prompt_file(default_prompts())
    code = [bench.tokenizer(r["prompt"])["input_ids"] for r in held if "prompt" in r]
    chats = [bench.chat(r["messages"]) for r in held if "messages" in r]
    meta = {"machine": machine(), "command": command_line("python -m specinfer_bench.scheduling", None),
            "max_new_tokens": args.max_new_tokens}
    results = {}
    for scenario in args.scenarios.split(","):
        if scenario == "multiturn":
            results[scenario] = multiturn(bench, 8, args.max_new_tokens)
        elif scenario == "capacity":
            results[scenario] = capacity(bench, [bench.chat(r["messages"]) for r in read_prompt_file(CAPACITY)],
                                         args.baseline)
        elif scenario == "overflow":
            results[scenario] = overflow(bench, (general + code + chats)[:64], 128)
        elif scenario == "fairness":
            results[scenario] = fairness(bench, (code + chats)[:32], general[:8], 32)
        elif scenario == "long":
            text = "\n\n".join(r.get("prompt", "") for r in held) * 4
            long = bench.tokenizer(text)["input_ids"][:6000]
            results[scenario] = long_prompt(bench, code[:8], long, [int(c) for c in args.long_chunks.split(",")])
        else:
            raise SystemExit(f"--scenarios: unknown {scenario!r}")
        table = markdown(results, meta)
        write_record(args.out, {**meta, **results}, table)  # after each scenario: a run can take hours
        print(table, flush=True)


if __name__ == "__main__":
    main()
