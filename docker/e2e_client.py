"""The client side of docker/e2e.sh: the same greedy requests sent to `specinfer serve` on the host and
to the containers, through gRPC (the manager) and through the official OpenAI client (the gateway).

  record   one fresh system: the first request alone (its latency), then every prompt at once (tokens/s),
           then the OpenAI requests; writes what each returned, and the figures, as JSON
  compare  two records: the outputs must be identical (token ids, texts); exit 1 naming the first difference
  during   every prompt at once while a bash command runs (started once each stream has its first chunk):
           every stream must end, with the reference's tokens; --repeat sends rounds until the command ends
  report   e2e.sh's figures and the two records' as bench/results/NAME.{json,md}, and one summary line

Greedy decoding (temperature 0) makes the LLM's output a function of the prompt alone, whatever the
speculators drafted, which replica drafted it or whether a replica died on the way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

from specinfer.engine import Request
from specinfer_rpc.client import connect_when_ready, generate, request_pb
from specinfer_rpc.v1 import generation_pb2

# eight prompts: the manager's drain is checked on eight streams at once
PROMPTS = [
    "def fibonacci(n):",
    "def quicksort(items):",
    "class Stack:\n    def __init__(self):",
    "import json\n\ndef load_config(path):",
    "The three primary colors are",
    "SELECT name, email FROM users WHERE",
    "def is_prime(n: int) -> bool:",
    "Once upon a time, in a small village,",
]
CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]
MAX_TOKENS = 48
MODEL = "SmolLM2-135M-Instruct"


async def stream_all(address: str, started: asyncio.Event | None = None,
                     detokenize: bool = False) -> tuple[list[dict], float]:
    """Every prompt at once through the manager: per prompt its token ids, first-chunk time and (with
    `detokenize`: calls made after the streams) text; and the seconds from the first call to the last
    stream's end. `started` is set once every stream has its first chunk."""
    stub = await connect_when_ready(address, wait=120.0)
    ids = await asyncio.gather(*(stub.Tokenize(generation_pb2.TokenizeRequest(text=p), wait_for_ready=True)
                                 for p in PROMPTS))
    first = 0

    async def one(prompt_ids):
        nonlocal first
        chunks = stub.Generate(request_pb(Request(list(prompt_ids.token_ids), MAX_TOKENS)))
        out = {"token_ids": [], "finish_reason": 0, "first_chunk_s": None}
        t0 = time.perf_counter()
        async for chunk in chunks:
            if out["first_chunk_s"] is None:
                out["first_chunk_s"] = time.perf_counter() - t0
                first += 1
                if started is not None and first == len(PROMPTS):
                    started.set()
            out["token_ids"].extend(chunk.token_ids)
            out["finish_reason"] = chunk.finish_reason or out["finish_reason"]
        return out

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in ids))
    seconds = time.perf_counter() - t0
    if not detokenize:
        return outs, seconds
    texts = await asyncio.gather(*(stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=o["token_ids"]))
                                   for o in outs))
    for o, t in zip(outs, texts):
        o["text"] = t.text
    return outs, seconds


def openai_outputs(base_url: str) -> dict:
    """The gateway's answers to the prompts (completions) and the chats (chat completions), greedy."""
    client = OpenAI(base_url=base_url, api_key="none", timeout=300.0, max_retries=0)

    def completion(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text

    def chat(messages):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0).choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS) + len(CHATS)) as pool:  # all at once, as the gRPC streams
        completions, chats = pool.map(completion, PROMPTS), pool.map(chat, CHATS)
        return {"completions": list(completions), "chats": list(chats)}


async def first_request(address: str) -> float:
    """Seconds for one request alone, from the call to its stream's end (the system's first)."""
    stub = await connect_when_ready(address, wait=120.0)
    prompt = await stub.Tokenize(generation_pb2.TokenizeRequest(text=PROMPTS[0]), wait_for_ready=True)
    t0 = time.perf_counter()
    async for _ in stub.Generate(request_pb(Request(list(prompt.token_ids), MAX_TOKENS))):
        pass
    return time.perf_counter() - t0


def record(args) -> None:
    latency = asyncio.run(first_request(args.manager))
    streams, seconds = asyncio.run(stream_all(args.manager, detokenize=True))
    tokens = sum(len(s["token_ids"]) for s in streams)
    result = {"first_request_s": round(latency, 3), "tokens": tokens, "seconds": round(seconds, 3),
              "tokens_per_s": round(tokens / seconds, 2), "max_tokens": MAX_TOKENS, "streams": streams,
              "openai": openai_outputs(args.gateway)}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"{args.manager}: first request {latency:.2f} s; {len(PROMPTS)} streams {tokens} tokens in "
          f"{seconds:.2f} s ({tokens / seconds:.1f} tokens/s)")


def differences(reference: dict, streams: list[dict]) -> list[str]:
    return [f"prompt {i} ({PROMPTS[i]!r}): {s['token_ids']} != reference {r['token_ids']}"
            for i, (r, s) in enumerate(zip(reference["streams"], streams))
            if s["token_ids"] != r["token_ids"] or s["finish_reason"] != r["finish_reason"]]


def compare(args) -> None:
    ref, got = (json.load(open(p)) for p in (args.reference, args.record))
    diffs = differences(ref, got["streams"])
    diffs += [f"OpenAI {kind} {i}: {g!r} != reference {r!r}" for kind in ("completions", "chats")
              for i, (r, g) in enumerate(zip(ref["openai"][kind], got["openai"][kind])) if r != g]
    if diffs:
        sys.exit("different outputs:\n" + "\n".join(diffs))
    print(f"identical: {len(ref['streams'])} gRPC streams, {len(ref['openai']['completions'])} completions and "
          f"{len(ref['openai']['chats'])} chats through the OpenAI client")


async def during(args) -> None:
    reference = json.load(open(args.reference))
    started = asyncio.Event()
    rounds = [asyncio.create_task(stream_all(args.manager, started))]
    await started.wait()
    command = asyncio.create_task(asyncio.to_thread(subprocess.run, ["bash", "-c", args.command], check=True))
    while args.repeat and not command.done():
        await rounds[-1]
        if not command.done():
            rounds.append(asyncio.create_task(stream_all(args.manager)))
    await command  # raises CalledProcessError if the command failed
    results = await asyncio.gather(*rounds, return_exceptions=True)
    lost = [r for r in results if isinstance(r, BaseException)]
    if lost:
        sys.exit(f"{len(lost)} of {len(results)} rounds lost a request: {lost[0]!r}")
    diffs = [d for streams, _ in results for d in differences(reference, streams)]
    if diffs:
        sys.exit("different outputs:\n" + "\n".join(diffs))
    print(f"{len(results) * len(PROMPTS)} streams in {len(results)} rounds while `{args.command}` ran: "
          "every one ended, identical to the reference")


def report(args) -> None:
    figures = json.load(open(args.figures))
    runs = {}
    for name, path in (("specinfer serve", args.host), ("compose", args.containers)):
        r = json.load(open(path))
        runs[name] = {k: r[k] for k in ("first_request_s", "tokens", "seconds", "tokens_per_s")}
    result = {"what": "docker/e2e.sh on this machine's CPU: the images built, the system run under compose with "
                      f"3 speculator replicas; {len(PROMPTS)} greedy prompts of {MAX_TOKENS} tokens at once"
                      + (f"; {args.note}" if args.note else ""),
              **figures, "runs": runs}
    with open(f"{args.out}.json", "w") as fh:
        json.dump(result, fh, indent=1)
    mb = {k: round(v / 1e6) for k, v in figures["image_bytes"].items()}
    lines = ["# docker/e2e.sh (CPU)", "", result["what"] + ". Written by `bash docker/e2e.sh`.", "",
             "| image | build (s) | size (MB) |", "| --- | --- | --- |"]
    lines += [f"| specinfer/{k}:0.1.0 | {figures['build_s'][k]} | {mb[k]} |" for k in mb]
    lines += ["", "| system | first request (s) | tokens/s |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v['first_request_s']} | {v['tokens_per_s']} |" for k, v in runs.items()]
    lines += ["", f"Base image {figures['base_image_s']} s (0: present), builds {figures['build_s']['all']} s, every "
                  f"service healthy {figures['healthy_s']} s after compose up, the whole script {figures['e2e_s']} s."]
    with open(f"{args.out}.md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    host, box = runs["specinfer serve"], runs["compose"]
    print(f"e2e: PASSED in {figures['e2e_s']} s: 4 images built in {figures['build_s']['all']} s "
          f"({', '.join(f'{k} {v} MB' for k, v in mb.items())}); outputs identical to specinfer serve through gRPC "
          f"and OpenAI; a speculator killed, speculators 3->1->3, the manager stopped: nothing lost; first request "
          f"{box['first_request_s']} s (host {host['first_request_s']} s); {box['tokens_per_s']} tokens/s "
          f"(host {host['tokens_per_s']}); compose down: no container left")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("record")
    p.add_argument("--manager", required=True)
    p.add_argument("--gateway", required=True, help="the OpenAI base URL, http://HOST:PORT/v1")
    p.add_argument("--out", required=True)
    p = sub.add_parser("compare")
    p.add_argument("reference")
    p.add_argument("record")
    p = sub.add_parser("during")
    p.add_argument("--manager", required=True)
    p.add_argument("--reference", required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--repeat", action="store_true", help="send rounds of the prompts until the command ends")
    p = sub.add_parser("report")
    for flag in ("--figures", "--host", "--containers", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--note", default="", help="how this run was made (cold or warm Docker storage, the load beside it)")
    args = parser.parse_args()
    {"record": record, "compare": compare, "report": report,
     "during": lambda a: asyncio.run(during(a))}[args.cmd](args)


if __name__ == "__main__":
    main()
