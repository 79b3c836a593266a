"""`specinfer bench`: the tree-shape search's model and a quick end-to-end run."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
import torch

from specinfer.verifier import Verifier
from specinfer_bench.exactness import against, plan
from specinfer_bench.runtime import PHASES, activity, idle, phase_ranges, top_kernels
from specinfer_bench.tree_search import CostModel, expected_tokens_per_step, interpolate, rank_acceptance, search

from .conftest import MODELS, ROOT


def simulated_tokens_per_step(expansion: list[int], p: list[float], trials: int, rng: random.Random) -> float:
    """Draw, level by level, which SSM rank the LLM's token has (none with the leftover mass);
    descend while the tree holds that rank."""
    total = 0
    for _ in range(trials):
        accepted = 0
        for k in expansion:
            rank = rng.choices(range(len(p) + 1), weights=p + [1 - sum(p)])[0]
            if rank >= k:
                break
            accepted += 1
        total += 1 + accepted
    return total / trials


@pytest.mark.parametrize("expansion", [[1], [1, 1, 1, 1], [2, 1, 1], [3, 2, 1, 1], [1, 1, 3, 1, 1, 1, 1, 1]])
def test_expected_tokens_per_step_matches_simulation(expansion):
    p = [0.55, 0.15, 0.08, 0.05]
    rng = random.Random(0)
    assert abs(expected_tokens_per_step(expansion, p) - simulated_tokens_per_step(expansion, p, 20000, rng)) < 0.03


def test_search_ranks_by_tokens_per_cost_and_respects_the_limits():
    p = [0.6, 0.2, 0.1, 0.05]
    free_ssm = CostModel({1: 10.0, 65: 10.0}, {1: 0.0, 16: 0.0})  # trees cost nothing: the biggest allowed wins
    best = search(p, free_ssm, max_depth=3, max_width=2, max_nodes=64)[0]
    assert best["expansion"] == [2, 2, 2]
    costly_ssm = CostModel({1: 10.1, 65: 16.5}, {1: 31.0, 16: 46.0})  # an SSM level costs 3 steps: none wins
    ranked = search(p, costly_ssm)
    assert ranked[0]["expansion"] == []
    assert all(a["tokens_per_ms"] >= b["tokens_per_ms"] for a, b in zip(ranked, ranked[1:]))
    assert all(list(r["expansion"]) == sorted(r["expansion"], reverse=True) for r in ranked)


def test_costs_between_measured_sizes_are_interpolated_and_beyond_them_extrapolated():
    points = {1: 10.0, 3: 12.0, 9: 24.0}
    assert [interpolate(points, x) for x in (1, 2, 3, 6, 9, 12, 0)] == [10.0, 11.0, 12.0, 18.0, 24.0, 30.0, 9.0]
    cost = CostModel({1: 10.0, 3: 12.0, 9: 24.0}, {1: 1.0, 2: 1.5, 4: 2.5})
    assert cost.step_ms([2, 1]) == 16.0 + 1.0 + 1.5  # 1 + 2 + 2 rows verified; levels over 1 and 2 parents


def test_rank_acceptance_of_a_model_against_itself_is_all_rank_one(tiny_pair):
    hf, _, _ = tiny_pair
    seqs = [torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    p = rank_acceptance(hf, hf, seqs, [5, 5, 5], max_rank=4)
    assert p == [1.0, 0.0, 0.0, 0.0]


def test_rank_acceptance_ranks_only_the_draft_vocabulary(tiny_pair):
    """The model against itself drafting from the even tokens: the LLM's token is the SSM's first
    exactly when it is even, and never among its first 4 when odd."""
    hf, _, _ = tiny_pair
    seqs = [torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    with torch.no_grad():
        targets = torch.cat([hf(torch.tensor([s])).logits[0, 4:-1].argmax(-1) for s in seqs])
    p = rank_acceptance(hf, hf, seqs, [5, 5, 5], max_rank=4, vocab=list(range(0, 64, 2)))
    even = int((targets % 2 == 0).sum()) / len(targets)
    assert 0 < even < 1 and p == [even, 0.0, 0.0, 0.0]


def test_quick_bench_checks_outputs_and_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "specinfer_cli", "bench", "--quick", "--no-services", "--prompts", "2",
                           "--max-new-tokens", "12", "--out", str(out), "--llm", str(MODELS / "llm"),
                           "--ssm", str(MODELS / "ssm-0"), "--ssm", str(MODELS / "ssm-1"),
                           "--prompt-file", str(MODELS / "heldout_prompts.jsonl")], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {r["config"]: r for r in result["single"]}
    assert rows["transformers generate"]["speedup"] == 1.0 and rows["transformers generate"]["tokens_per_step"] <= 1.0
    assert rows["transformers assisted (best fixed k)"]["assistant_tokens"] in (2, 4)
    tree = rows["ours tree <1,1,3,1,1,1,1,1>"]
    assert tree["tokens_per_step"] > 1.0 and len(tree["acceptance_by_depth"]) == 8
    assert sum(result["tree_search"]["rank_acceptance"]) <= 1.0 and result["tree_search"]["best"]["tokens_per_step"] >= 1.0
    picked = ",".join(map(str, result["tree_search"]["best"]["expansion"]))
    assert not picked or any(c.startswith(f"ours tree <{picked}>") for c in rows)  # the search's pick is measured
    assert out.with_suffix(".png").stat().st_size > 10_000 and "## Tree-shape search" in out.with_suffix(".md").read_text()


def test_kernel_benchmark_quick_run_writes_its_tables(tmp_path):
    out = tmp_path / "kernel"
    subprocess.run([sys.executable, "-m", "specinfer_bench.kernel", "--grid", "quick", "--out", str(out), "--llm", str(MODELS / "llm")],
                   cwd=ROOT,
                   check=True, capture_output=True, timeout=600)
    data = json.loads(out.with_suffix(".json").read_text())
    assert {(r["prefix"], r["tree"], r["batch"]) for r in data["attention"]} == {(64, t, b) for t in (1, 8) for b in (1, 2)}
    assert all(r["reference_ms"] > 0 and r["sdpa_mask_ms"] > 0 for r in data["attention"])
    assert [r["tree"] for r in data["verifier"]] == [0, 8] and data["verifier"][0]["vs_one_token"] == 1.0
    if not torch.cuda.is_available():
        assert "kernel_ms" not in data["attention"][0] and "No GPU" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0


def test_runtime_benchmark_cpu_run_times_eager_and_static_steps_with_one_sync_per_step(tmp_path):
    out = tmp_path / "runtime"
    proc = subprocess.run([sys.executable, "-m", "specinfer_bench.runtime", "--device", "cpu", "--models", "llm,ssm",
                           "--llm", str(MODELS / "llm"), "--ssm", str(MODELS / "ssm-0"), "--batches", "1", "--trees", "0,16", "--temperatures", "0,1", "--repeats", "2", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    meta = data["meta"]
    assert meta["graphed"] == "static" and meta["dtype"] == "float32" and "proxy" in meta["launches"]
    assert data["skipped"] == [] and set(meta["models"]) == {"llm", "ssm"}
    cases = {(r["model"], r["batch"], r["tree"], r["temperature"]) for r in data["rows"]}
    assert cases == {(m, 1, t, T) for m in ("llm", "ssm") for t in (0, 16) for T in (0, 1)}
    for r in data["rows"]:
        eager, static = r["eager"], r["static"]
        assert all(math.isfinite(m["step_ms"]) and m["step_ms"] > 0 and m["launches"] > 0 and m["gpu_busy"] is None
                   for m in (eager, static))
        assert math.isfinite(r["graphed_vs_eager"]) and r["padded_tokens"][0] >= r["tokens"][0]
        assert eager["syncs"] == static["syncs"] == 1, r
        assert 1.0 <= r["context_growth"] <= 1.2, "random drafts are rarely accepted: about one token per step"
        # the LLM's one-token steps are also timed begun behind each other (a GPU's steady decoding)
        assert ("chained" in r) == (r["model"] == "llm" and r["tree"] == 0), r
        assert "chained" not in r or r["chained"]["step_ms"] > 0 and r["chained"]["gpu_busy"] is None
    text = out.with_suffix(".md").read_text()
    assert "eager vs static" in text and "each begun behind the one before" in text
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_runtime_counts_launch_calls_and_the_gpu_time_of_device_events_but_not_their_annotations():
    """The profile's events as torch 2.11 (the GPU image's) gives them, which have no activity type:
    device events by their device type; a user annotation on the GPU spans kernels already counted."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def event(i, name, start, end, device_type=DeviceType.CPU, annotation=False):
        return FunctionEvent(i, name, 1, start, end, device_type=device_type, is_user_annotation=annotation)

    events = [event(0, "cudaLaunchKernel", 0, 5), event(1, "cudaGraphLaunch", 5, 9), event(2, "aten::mm", 0, 9),
              event(3, "gemm", 10, 250, DeviceType.CUDA), event(4, "Memcpy HtoD", 250, 270, DeviceType.CUDA),
              event(5, "step", 10, 270, DeviceType.CUDA, annotation=True)]
    assert activity(events) == (2, 0.26)


def test_runtime_splits_the_gpus_idle_time_by_the_host_phase_it_fell_in():
    """Idle: the step's host span less the device's events; each gap goes to the phase whose range it
    falls in, the rest to "other". The phases' ranges come from the owner's methods, wrapped only
    while the profiled step runs."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent
    from torch.profiler import ProfilerActivity, profile

    def event(i, name, start, end, device_type=DeviceType.CPU):
        return FunctionEvent(i, name, 1, start, end, device_type=device_type)

    events = [event(0, "step", 0, 1000), event(1, "phase.forward", 100, 400), event(2, "phase.decide", 600, 900),
              event(3, "gemm", 300, 500, DeviceType.CUDA), event(4, "argmax", 550, 650, DeviceType.CUDA)]
    # gaps 0-300 (forward from 100), 500-550, 650-1000 (decide until 900): 700 us idle
    assert idle(events) == pytest.approx({"forward": 200 / 700, "decide": 250 / 700, "other": 250 / 700})
    events.append(event(5, "argmax", 700, 760, DeviceType.CUDA))
    assert top_kernels(events, 1) == [("gemm", 1, 0.2)] and top_kernels(events)[1] == ("argmax", 2, 0.16)

    class Owner:  # a verifier's step: its forward, then its decision queued and its verdicts read
        def forward(self, x):
            return x + 1

        def _decision(self, x):
            return x * 2

        def _verdicts(self, x):
            return x - 1

    owner = Owner()
    with phase_ranges(owner), profile(activities=[ProfilerActivity.CPU]) as prof:
        assert owner._verdicts(owner._decision(owner.forward(1))) == 3
    names = [e.name for e in prof.events()]
    assert names.count("phase.forward") == 1 and names.count("phase.decide") == 2
    assert not {"forward", "_decision", "_verdicts"} & set(vars(owner)), "the class's methods again after the step"
    assert set(PHASES["decide"]) <= set(vars(Verifier)), "the phases name the verifier's own methods"


def test_the_gpu_summary_of_a_runtime_run_says_where_the_gpu_waits_and_what_a_tree_adds(tmp_path):
    from specinfer_bench.gpu_summary import runtime

    def mode(ms, kernels):
        return {"step_ms": ms, "gpu_busy": 0.6, "launches": 10, "top_kernels": kernels,
                "gpu_idle_ms": {"forward": 0.25, "decide": 0.3, "other": 0.125}}

    rows = [{"model": "llm-1b", "batch": 1, "tree": t, "eager": {"step_ms": 9.0, "gpu_busy": 0.1, "launches": 236},
             "graphs": mode(ms, k)} for t, ms, k in ((0, 1.7, [["gemm_small", 64, 0.8], ["attn", 16, 0.1]]),
                                                      (64, 2.4, [["gemm_large", 64, 1.0], ["attn", 16, 0.3]]))]
    rows += [dict(r, temperature=1.0) for r in rows]  # sampled rows: their own lines, labelled
    rows[0]["chained"] = {"step_ms": 1.25, "gpu_busy": 0.93}  # and the steps begun behind each other (newer runs)
    path = tmp_path / "runtime.json"
    path.write_text(json.dumps({"meta": {"graphed": "graphs"}, "rows": rows}))
    lines = runtime(path)
    assert lines[0].startswith("runtime llm-1b batch 1:") and "trees vs one token (graphs): 64: 1.41x" in lines[0]
    assert lines[4].startswith("runtime llm-1b T=1 batch 1:") and len(lines) == 7
    assert lines[1] == "  one-token steps begun behind each other (graphs): 1.25 ms a step (busy 93%)"
    assert lines[2].endswith("forward 0.25 ms, decide 0.30 ms, other 0.12 ms")
    assert lines[3].endswith("gemm_large +1.000 ms, attn +0.200 ms")


def test_the_gpu_summary_of_a_kernel_table_names_the_cells_where_the_kernel_is_wrong(tmp_path):
    from specinfer_bench.gpu_summary import kernel

    def cell(prefix, error):
        return {"prefix": prefix, "tree": 16, "batch": 8, "kernel_vs_sdpa": 1.5, "kernel_peak_fraction": 0.5,
                "kernel_max_error": error, "kernel_right": error <= 1.6e-2}

    path = tmp_path / "kernel.json"
    path.write_text(json.dumps({"meta": {"note": "", "config": "m64-n64-w4-s3-p2"}, "verifier": [],
                                "attention": [cell(512, 3e-3), cell(2048, 0.5), cell(8192, float("nan"))]}))
    lines = kernel(path)
    assert lines[0] == ("kernel = reference in 1 of 3 cells; WRONG at prefix 2048, tree 16, batch 8 (max error 0.5); "
                        "WRONG at prefix 8192, tree 16, batch 8 (max error nan)")
    for r in (old := json.loads(path.read_text()))["attention"]:  # a record from before the check: no claim either way
        del r["kernel_right"]
    path.write_text(json.dumps(old))
    assert kernel(path)[0].startswith("kernel m64-n64-w4-s3-p2 vs SDPA+mask: >= 1.0x in 3 of 3 cells")


def test_manager_time_writes_its_table(tmp_path):
    out = tmp_path / "manager_time"
    proc = subprocess.run([sys.executable, "-m", "specinfer_bench.manager_time", "--batches", "1,4", "--repeats", "20",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|")[1:-1] for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert [int(r[0]) for r in rows] == [1, 4] and all(float(x) > 0 for r in rows for x in r[1:])


def test_services_configs_name_their_options_and_refuse_unknown_ones():
    from specinfer_bench.services import manager_flags

    off = manager_flags("off@baseline", "v:1", ["s:2"])
    assert "--speculators" not in off and "--no-context-lookup" in off  # no drafter at all: incremental decoding
    alone = manager_flags("2,1,1@16@alone", "v:1", ["s:2"], ["h:3"])
    assert alone[alone.index("--speculators") + 1] == "" and "--context-lookup" in alone
    with pytest.raises(ValueError, match="@alone is context lookup without speculators"):
        manager_flags("2,1,1@16@alone@head", "v:1", ["s:2"], ["h:3"])
    flags = manager_flags("2,1,1@16@static@nolookup@mss@baseline", "v:1", ["s:2"])
    assert flags[flags.index("--tree-budget") + 1] == "16" and "--no-adaptive" in flags and "--no-context-lookup" in flags
    with pytest.raises(ValueError, match="unknown option"):
        manager_flags("2,1,1@16@fast", "v:1", ["s:2"])


def test_services_configs_that_draft_with_speculators_need_some_and_the_others_start_none():
    from specinfer_bench.services import check_configs, manager_flags, uses_ssms

    with pytest.raises(ValueError, match="no speculator to draft with"):  # another LLM, no --ssm named
        manager_flags("2,1,1@16", "v:1", [])
    head = manager_flags("2,1,1@16@head", "v:1", [], ["h:3"])  # an LLM with a head of its own and no SSM
    assert head[head.index("--speculators") + 1] == "h:3"
    check_configs(["off", "2,1,1@16@alone"], 0, 0)  # before any service starts
    with pytest.raises(ValueError, match="'2,1,1@16@static'"):
        check_configs(["off", "2,1,1@16@static"], 0, 0)
    assert [uses_ssms(c) for c in ("off", "off@sequential", "2,1,1@16@alone", "2,1,1@16", "2,1,1@16@head")] == \
        [False, False, False, True, True]


def test_services_bench_of_another_llm_drafts_with_lookup_alone_and_starts_no_speculator(tmp_path):
    """No SSM named on an LLM other than the default: 'off' and @alone run, in process and through the
    services, with no speculator process (the default LLM's SSM does not share its tokenizer), outputs
    checked against the LLM's greedy decoding; a setting that needs an SSM is refused before anything starts."""
    common = [sys.executable, "-m", "specinfer_bench.services", "--llm", str(MODELS / "llm"),
              "--prompt-file", str(MODELS / "heldout_prompts.jsonl"), "--concurrency", "1",
              "--requests-per-stream", "1", "--rounds", "1", "--max-new-tokens", "8"]
    refused = subprocess.run([*common, "--configs", "off;2,1,1@16"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and "'2,1,1@16': no speculator to draft with" in refused.stderr
    out, logs = tmp_path / "services", tmp_path / "logs"
    proc = subprocess.run([*common, "--configs", "off;2,1,1@16@alone", "--in-process", "--log-dir", str(logs),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.stem for p in logs.glob("*.log")) == ["manager-0", "manager-1", "verifier"]
    result = json.loads(out.with_suffix(".json").read_text())
    assert {(r["config"], r["identical_share"]) for r in result["rows"]} == {("off", 1.0), ("2,1,1@16@alone", 1.0)}
    idle = {r["config"]: r["verifier_idle_ms"] for r in result["rows"]}  # from the verifier's /metrics: only plain steps off
    assert set(idle["off"]) == {"plain"} and idle["off"]["plain"] >= 0 and set(idle["2,1,1@16@alone"]) <= {"plain", "miss"}
    alone = next(r for r in result["in_process"] if r["config"] == "2,1,1@16@alone")
    assert alone["identical_share"] == 1.0 and alone["tokens"] == 8


def test_in_process_settings_are_the_managers_and_refuse_what_only_the_services_do():
    from specinfer.generate import Mode
    from specinfer_bench.services import PREDRAFT_OUTCOMES, engine_settings, identical_share, manager_flags

    from specinfer.engine import default_tree_budget

    ssms = ["ssm-0", "ssm-1"]  # the engine takes them as they are
    assert engine_settings("off", ssms, "cpu") == {"ssms": [], "mode": Mode.INCREMENTAL}
    assert engine_settings("2,1,1@16", ssms, "cpu") == {
        "ssms": ssms, "mode": Mode.MERGED, "expansion": [2, 1, 1], "tree_budget": 16, "adaptive": True, "lookup": True,
        "draft_ahead": 0, "outcome_steps": False}
    assert engine_settings("2,1,1@16@predraft", ssms, "cpu")["draft_ahead"] == PREDRAFT_OUTCOMES  # the manager's flag
    assert engine_settings("2,1,1@16@predraft@outcome", ssms, "cpu")["outcome_steps"]
    flags = manager_flags("2,1,1@16@predraft@outcome", "v", ["s"])
    assert flags[flags.index("--draft-ahead") + 1] == str(PREDRAFT_OUTCOMES) and "--outcome-steps" in flags
    one = engine_settings("1,1@8@static@nolookup", ssms[:1], "cpu")
    assert one["mode"] == Mode.TREE and not one["adaptive"] and not one["lookup"]
    alone = engine_settings("2,1,1@16@alone", ssms, "cpu")  # context lookup without the SSMs, as the manager's
    assert alone["ssms"] == [] and alone["mode"] == Mode.TREE and alone["lookup"] and alone["adaptive"]
    for device in ("cpu", "cuda"):  # budget 0: the manager's default for the verifier's device, as --tree-budget 0
        assert engine_settings("2,1,1@0", ssms, device)["tree_budget"] == default_tree_budget(device)
    for config in ("off@logprobs", "2,1,1@16@mss"):
        with pytest.raises(ValueError, match="only through the services"):
            engine_settings(config, ssms, "cpu")
    reference = [[1, 2, 3, 4], [5, 6]]
    assert identical_share("x", reference, reference, exact=True) == 1.0
    assert identical_share("x", [[1, 2, 9, 9], [5, 6]], reference, exact=False) == 0.75
    with pytest.raises(SystemExit, match="differ"):
        identical_share("x", [[1, 2, 9, 9], [5, 6]], reference, exact=True)


def test_host_benchmark_times_every_role_batch_and_tree_through_the_buckets(tmp_path):
    out = tmp_path / "host"
    proc = subprocess.run([sys.executable, "-m", "specinfer_bench.host", "--batches", "1,3", "--trees", "0,5",
                           "--repeats", "3", "--prompt-len", "20", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["role"], r["batch"], r["tree_nodes"]) for r in rows] == [
        (role, b, t) for b in (1, 3) for role, t in (("verify", 0), ("verify", 5), ("draft", 16))]
    assert all(0 < r["host_us"] < 1e6 and 0 < r["host_us_after_forward"] < 1e6 for r in rows)
    # each request's bonus token plus its tree, padded to the next bucket up; a draft's two levels
    assert [r["buckets"] for r in rows] == [[1], [6], [1, 4], [3], [20], [3, 12]]


def test_divergence_benchmark_finds_float32_identical(tmp_path):
    """float32 greedy with speculation is identical to the same engine without it, with the reference
    attention and the row-invariant one (the share is computed, not assumed: the same comparison reports
    bf16's flips), each run timed."""
    out = tmp_path / "divergence"
    proc = subprocess.run([sys.executable, "-m", "specinfer_bench.divergence", "--llm", str(MODELS / "llm"),
                           "--ssm", str(MODELS / "ssm-0"), "--prompt-file", str(MODELS / "heldout_prompts.jsonl"),
                           "--prompts", "3", "--max-new-tokens", "24", "--dtypes", "float32", "--device", "cpu",
                           "--attentions", "reference,invariant", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    for attention in ("reference", "invariant"):
        summary = data["summary"][f"{attention} float32"]
        assert {k: summary[k] for k in ("identical_prompts", "prompts", "identical_share")} == {
            "identical_prompts": 3, "prompts": 3, "identical_share": 1.0}
        assert summary["plain_tok_s"] > 0 and summary["speculative_tok_s"] > 0
    assert [r["tokens"] for r in data["rows"]] == [24] * 6


def test_divergence_compares_position_by_position():
    from specinfer_bench.divergence import compare

    assert compare([1, 2, 3], [1, 2, 3]) == (1.0, None)
    assert compare([1, 2, 3, 4], [1, 9, 3, 4]) == (0.75, 1)
    assert compare([1, 2], [1, 2, 5]) == (1.0, 2)  # one stopped earlier: they differ where it stopped


def test_no_benchmark_module_imports_one_that_imports_it_back():
    """What modules share lives in one they all import (attention_cases), never in a circle, counting
    imports inside functions too."""
    import ast

    mods = {p.stem: p for p in (ROOT / "specinfer_bench").glob("*.py")}
    imports = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = node.module if node.level == 0 else f"specinfer_bench.{node.module}"
                found.add(module.removeprefix("specinfer_bench.").split(".")[0])
        imports[name] = found & set(mods) - {name}
    assert imports["kernel_compile"] and imports["kernel_sweep"]  # the scan sees their imports

    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in imports[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert [m for m in mods if m in reached(m)] == []


def test_the_invariance_probe_names_where_a_row_gets_other_bits(tmp_path):
    from specinfer_bench import invariance

    invariance.main(["--llm", str(MODELS / "llm"), "--out", str(tmp_path / "inv")])
    report = json.loads((tmp_path / "inv.json").read_text())
    cases = {"tree node", "beside another request", "row of a 300-row prompt"}
    assert set(report["model"][str(MODELS / "llm")]) == cases
    invariant = report["model, invariant attention"][str(MODELS / "llm")]
    for case in cases:  # none differs with the invariant attention, or it refused to run, saying why
        assert invariant[case]["first_differing_op"] is None or invariant[case]["first_differing_op"].startswith("refused: ")
    assert report["dense"]["row counts (1..600) where row 0 differs from row 0 alone"] == []
    assert "## Elementwise" in (tmp_path / "inv.md").read_text()


def test_head_volume_puts_trained_and_scored_heads_side_by_side(tmp_path):
    """A trained head's report gives its own reply tokens and steps; a scored head's come after its path;
    an earlier table's rows can lead."""
    from specinfer_bench.head_volume import main

    agreement = lambda x: {"prompts/code": {"first_token": x, "chain4_mean": 2 * x},  # noqa: E731
                           "general_prompts/chat": {"first_token": x / 2, "chain4_mean": x}}
    (tmp_path / "h0.json").write_text(json.dumps({"agreement": agreement(0.5)}))
    (tmp_path / "h1.json").write_text(json.dumps({"agreement": agreement(0.6), "reply_tokens": 1_000_000, "steps": 1520}))
    out = tmp_path / "volume"
    main(["--report", f"head-0={tmp_path / 'h0.json'}:173910:1344", "--report", f"head-1={tmp_path / 'h1.json'}",
          "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["head"], r["reply_tokens"], r["steps"]) for r in rows] == [("head-0", 173910, 1344), ("head-1", 1_000_000, 1520)]
    text = out.with_suffix(".md").read_text()
    assert "| head-1 | 1,000,000 | 1,520 | 60.0% (1.20) | 30.0% (0.60) |" in text
    assert out.with_suffix(".png").stat().st_size > 0
    # an earlier table's rows come first, as they were, with the machine each was made on (a table of rows
    # without their own: the table's)
    made = json.loads(out.with_suffix(".json").read_text())
    rows = [{k: v for k, v in r.items() if k != "machine"} for r in made["rows"]]
    out.with_suffix(".json").write_text(json.dumps({**made, "rows": rows, "machine": "Elsewhere CPU, 2 torch threads"}))
    main(["--earlier", str(out.with_suffix(".json")), "--report", f"head-2={tmp_path / 'h1.json'}", "--out", str(tmp_path / "v2")])
    rows = json.loads((tmp_path / "v2.json").read_text())["rows"]
    assert [r["head"] for r in rows] == ["head-0", "head-1", "head-2"]
    assert [r["machine"] for r in rows[:2]] == ["Elsewhere CPU, 2 torch threads"] * 2 and rows[2]["machine"] != rows[0]["machine"]
    assert "| head-0 | 173,910 | 1,344 | 50.0% (1.00) | 25.0% (0.50) | Elsewhere CPU |" in (tmp_path / "v2.md").read_text()


def test_exactness_names_the_first_request_and_token_that_differ_from_off():
    reference = [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert against(reference, [list(r) for r in reference], ["a", "b", "c"]) == {"identical": 3, "of": 3}
    out = against(reference, [[1, 2, 3], [4, 9, 6], [7]], ["a", "b", "c"])
    assert out == {"identical": 1, "of": 3,
                   "first_difference": {"request": "b", "position": 1, "off": [5], "this": [9]}}
    assert plan(2)[0] == ("off", 1) and plan(2).count(("default", 16)) == 2 and plan(1).count(("default", 1)) == 1
