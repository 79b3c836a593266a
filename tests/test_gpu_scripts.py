"""The scripts a lent GPU runs (bench/gpu_*.sh on bench/gpu_lib.sh): a lease is 15 minutes and cannot
be spent on plumbing, so what they share is checked here: each part keeps its own time limit and says
how it ended, what comes back fits the device's limits (at most 8 files of 16 MiB, plain names), and
what is moved out of the checkout to make a run small enough comes back as it was."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "bench" / "gpu_lib.sh"


def bash(script: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f". {LIB}\n{script}"], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


@pytest.mark.parametrize("script", sorted((ROOT / "bench").glob("gpu_*.sh")), ids=lambda p: p.name)
def test_every_gpu_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_parts_keep_their_limits_and_what_comes_back_fits_the_device(tmp_path):
    out = tmp_path / "out"
    proc = bash("gpu_setup probe cpu || exit 9\n"
                "part fine 20 python3 -c 'print(1)'\n"
                "part broken 20 python3 -c 'import sys; print(\"the cause\"); sys.exit(3)'; echo \"status $?\"\n"
                "part hangs 1 sleep 30; echo \"status $?\"\n"
                "say 'a figure: 42'\n"
                "gpu_finish", ROOT, OUT=str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert re.search(r"^fine: ok in \d+ s$", proc.stdout, re.M)
    assert "broken: FAILED (exit 3)" in proc.stdout and "last: the cause" in proc.stdout and "status 3" in lines
    assert "hangs: TIMED OUT after 1 s" in proc.stdout and "status 124" in lines
    summary = (out / "probe_cpu_summary.txt").read_text()
    assert summary.splitlines()[0].startswith("probe on cpu, torch ") and "a figure: 42" in summary
    back = [p for p in out.rglob("*") if p.is_file()]
    assert len(back) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in back)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in back)
    listing = subprocess.run(["tar", "-tzf", str(out / "probe_cpu.tar.gz")], capture_output=True, text=True).stdout
    assert {"./fine.log", "./broken.log", "./hangs.log", "./summary.txt"} <= set(listing.split())


def test_what_pack_moves_aside_unpack_puts_back(tmp_path):
    files = {"models/smollm2/ssm-0/w.bin": "a", "models/smollm2/head-1/base.json": "b",
             "models/fixtures/llm/w.bin": "c", "README.md": "d"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / ".gitignore").write_text("/.gpu/\n/.whl/\n")
    subprocess.run("git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm t", shell=True,
                   cwd=tmp_path, check=True)
    (tmp_path / ".whl").mkdir()  # the wheels as if downloaded: gpu_pack fetches nothing then
    names = bash('printf "%s\\n" "${GPU_WHEELS[@]}"', tmp_path).stdout.split()
    for w in names:
        name, version = w.split("==")
        (tmp_path / ".whl" / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")

    proc = bash("gpu_pack fixtures", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "models/smollm2").exists() and (tmp_path / "models/fixtures/llm/w.bin").exists()
    assert re.search(r"to carry: \d+ bytes of the tree", proc.stdout)
    proc = bash("gpu_unpack", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert {n: (tmp_path / n).read_text() for n in files} == files

    # what `gpu_pack smollm2` moves: a folder, and a folder inside one that stays
    assert bash("gpu_aside models/fixtures && gpu_aside models/smollm2/ssm-0", tmp_path).returncode == 0
    assert not (tmp_path / "models/fixtures").exists() and not (tmp_path / "models/smollm2/ssm-0").exists()
    assert (tmp_path / "models/smollm2/head-1/base.json").exists()
    proc = bash("gpu_unpack", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert {n: (tmp_path / n).read_text() for n in files} == files
    assert not (tmp_path / ".gpu/aside").exists()
    assert subprocess.run(["git", "status", "--short"], cwd=tmp_path, capture_output=True, text=True).stdout == ""


def test_a_script_refuses_a_part_it_does_not_have_before_it_sets_anything_up(tmp_path):
    proc = bash("gpu_start probe 'tests|table' --only tabel", ROOT, OUT=str(tmp_path / "out"))
    assert proc.returncode == 2 and "--only tests|table" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_tests_record_is_a_gpu_runs_summary_whose_tests_passed(tmp_path):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "first_run_cpu_summary.txt").write_text("first_run on cpu\ntests: ok in 11 s\n")  # the plumbing's
    (results / "kernel_h100_summary.txt").write_text("kernel on h100\ntests: FAILED (exit 1) in 80 s\n")
    assert bash("gpu_tests_record", tmp_path).returncode == 1
    (results / "first_run_h200_summary.txt").write_text("first_run on h200\ntests: ok in 95 s\n")
    proc = bash("gpu_tests_record", tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "bench/results/first_run_h200_summary.txt"


def test_the_tests_part_names_the_first_failure_and_returns_pytests_status(tmp_path):
    (tmp_path / "test_probe.py").write_text("def test_fine():\n    pass\n\n\ndef test_broken():\n    assert 1 == 2\n")
    proc = bash(f"gpu_setup probe cpu || exit 9\ntests_part 60 {tmp_path / 'test_probe.py'}; echo \"status $?\"",
                ROOT, OUT=str(tmp_path / "out"))
    # pytest's status: 1 for a failed test, 2 where pytest-xdist's workers run them (-x interrupts the rest)
    status = 2 if subprocess.run(["python3", "-c", "import xdist"], capture_output=True).returncode == 0 else 1
    assert f"status {status}" in proc.stdout.splitlines(), proc.stdout + proc.stderr
    assert f"tests: FAILED (exit {status})" in proc.stdout
    assert re.search(r"tests: 1 failed, 1 passed.*; first failure: \S+test_probe.py::test_broken", proc.stdout)


def test_the_default_llms_checksum_is_the_file_head_0_was_trained_on():
    """A run rebuilds SmolLM2's GGUF from carried parts and checks it (gpu_smollm2) where head-1 may be aside."""
    want = json.loads((ROOT / "models/smollm2/head-1/base.json").read_text())["sha256"]
    assert bash("echo $GPU_SMOLLM2_SHA256", ROOT).stdout.strip() == want
