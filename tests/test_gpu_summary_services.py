"""The services part's summary (specinfer_bench.gpu_summary.services): every stream count's figures against
issue 95's goals, services against in process, the greedy check, and a run the services did not finish."""

from __future__ import annotations

import json

from specinfer_bench.gpu_summary import services


def row(config: str, concurrency: int, tokens_per_s: float, split: str, share: float = 1.0) -> dict:
    return {"config": config, "concurrency": concurrency, "tokens_per_s": tokens_per_s, "identical_share": share,
            f"{split}_ms_per_iteration": 9.0, f"{split}_verify_ms": 6.0, f"{split}_verify_wait_ms": 6.75,
            f"{split}_draft_ms": 1.5, f"{split}_draft_wait_ms": 1.75, f"{split}_own_ms": 0.5}


def result(rows: list[dict] | None, in_process: list[dict]) -> dict:
    out = {"dtype": "bfloat16", "default_config": "2,1,1@16", "max_new_tokens": 128, "requests_per_stream": 4,
           "greedy_check": {"prompts": 8, "tokens": 32},
           "in_process": in_process}
    return out if rows is None else {**out, "rows": rows}


def summary(tmp_path, data: dict) -> str:
    path = tmp_path / "services_h100.json"
    path.write_text(json.dumps(data))
    return "\n".join(services(path))


def test_the_summary_weighs_each_stream_count_against_the_goals(tmp_path):
    rows = [row("off", 1, 160.0, "manager"), {**row("2,1,1@16", 1, 320.0, "manager", 0.97), "tokens_per_step": 2.5},
            row("off", 16, 2000.0, "manager"), row("2,1,1@16", 16, 2100.0, "manager", 0.97),
            row("off", 64, 6000.0, "manager"), row("2,1,1@16", 64, 7500.0, "manager", 0.97)]
    inproc = [row("off", 1, 170.0, "engine"), row("2,1,1@16", 1, 400.0, "engine", 0.96)]
    text = summary(tmp_path, result(rows, inproc))
    assert "off 160.0 tok/s" in text
    assert "2,1,1@16 320.0 = 2.00x off at 2.50 tok/step (goal >= 2.5x: MISSED)" in text
    assert "2,1,1@16 2100.0 = 1.05x off;" in text  # no goal at 16 streams
    assert "2,1,1@16 7500.0 = 1.25x off (goal >= 1.2x: met)" in text
    assert "off 0.94x (goal >= 1.1x: MISSED), 2,1,1@16 0.80x (goal >= 1.1x: MISSED)" in text
    assert "all/verifier/its hop/speculator/its hop/manager own: off 9.0/6.0/0.8/1.5/0.2/0.5" in text
    old = {k: v for k, v in rows[0].items() if "wait" not in k and "own" not in k}  # a record from before the waits
    assert "off 9.0/6.0/-/1.5/-/-" in summary(tmp_path, result([old], []))
    assert "its hop/engine own" in text
    assert "services 2,1,1@16 97.0%" in text and "in process 2,1,1@16 96.0%" in text
    assert len(text.splitlines()) <= 9


def test_a_run_the_services_did_not_finish_still_shows_in_process(tmp_path):
    text = summary(tmp_path, result(None, [row("off", 1, 170.0, "engine"), row("2,1,1@16", 1, 400.0, "engine")]))
    assert "no services rows" in text and "in process 1 stream: off 170.0 tok/s, 2,1,1@16 400.0 = 2.35x off" in text
    assert "services / in process" not in text


def test_the_summary_says_what_each_managers_controller_chose_and_predicted_at_its_load(tmp_path):
    at_1 = {"1": {"chosen": {"none": 90, "trees 1": 4}, "predicted_tok_s": {"none": 210.0, "trees 1": 150.5},
                  "realized_tok_s": {"none": 190.2}},
            "8": {"chosen": {"trees 3": 6}, "predicted_tok_s": {"none": 900.0, "trees 3": 400.0}}}
    at_16 = {"15": {"chosen": {"trees 3": 20}, "predicted_tok_s": {"none": 2000.0, "trees 3": 3600.0}},
             "12": {"chosen": {"none": 2}, "predicted_tok_s": {"none": 1800.0, "trees 3": 3000.0}}}
    rows = [row("off", 1, 160.0, "manager"), {**row("2,1,1@256", 1, 150.0, "manager"), "manager_controller": at_1},
            {**row("2,1,1@256", 16, 3000.0, "manager"), "manager_controller": at_16}]
    text = summary(tmp_path, result(rows, []))
    assert ("controller, 2,1,1@256 at 1 streams, batch 1: chose none x90, trees 1 x4; "
            "predicted tok/s none 210 (gave 190), trees 1 150") in text
    assert "controller, 2,1,1@256 at 16 streams, batch 15: chose trees 3 x20" in text  # the batch size it ran most


def test_the_summary_counts_the_steps_the_verifier_began_behind_the_running_one(tmp_path):
    rows = [{**row("off", 1, 200.0, "manager"), "verifier_begun_behind": 510.0},
            {**row("off@sequential", 1, 180.0, "manager"), "verifier_begun_behind": 0.0}]
    text = summary(tmp_path, result(rows, [row("off", 1, 210.0, "engine")]))
    assert "verifier steps begun behind the running one, per run: off 510, off@sequential 0" in text
    assert "begun behind" not in text.split("in process 1 stream")[1]  # the engine in process has no such count


def test_the_summary_gives_the_hit_rate_and_the_verifiers_idle_time_where_a_setting_drafted_ahead(tmp_path):
    ahead = {**row("2,1,1@16@predraft", 1, 330.0, "manager"), "manager_predraft_hits": 30, "manager_predraft_misses": 10,
             "verifier_idle_ms": {"plain": 1.5, "miss": 4.0, "hit": 0.4}}
    inproc = [row("off", 1, 170.0, "engine"),
              {**row("2,1,1@16@predraft", 1, 380.0, "engine"), "engine_predraft_hits": 5, "engine_predraft_misses": 15}]
    data = {**result([row("off", 1, 160.0, "manager"), row("2,1,1@16", 1, 320.0, "manager"), ahead], inproc),
            "ignore_eos": False}
    text = summary(tmp_path, data)
    assert "(at most: natural stops)" in text
    assert ("services 1 stream, drafted ahead: 2,1,1@16@predraft 75% of 40 hit (verifier idle ms plain 1.50, "
            "miss 4.00, hit 0.40)") in text
    assert "in process 1 stream, drafted ahead: 2,1,1@16@predraft 25% of 20 hit" in text
    assert "drafted ahead: 2,1,1@16 " not in text
