"""The wire and the layering: committed stubs match the .proto files; the core never imports grpc
nor anything above it."""

import ast
import subprocess
import sys

from .conftest import ROOT


def test_generated_python_stubs_are_not_stale():
    proc = subprocess.run([sys.executable, "protos/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_core_library_never_imports_grpc():
    modules = sorted(p.stem for p in (ROOT / "specinfer").glob("*.py"))
    code = f"import sys\nfor m in {modules!r}: __import__('specinfer.' + m)\nprint(sorted(k for k in sys.modules if k.split('.')[0] == 'grpc'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


ABOVE_THE_CORE = {"grpc", "grpc_health", "grpc_reflection", "specinfer_rpc", "specinfer_bench", "specinfer_cli",
                  "manager_svc", "speculator_svc", "verifier_svc", "gateway_svc"}


def test_the_core_imports_nothing_above_it_anywhere_in_its_source():
    """Not even lazily inside a function (the old specinfer/cli.py imported the bench and rpc layers
    that way, a circle cli <-> specinfer_bench)."""
    found = []
    for path in sorted((ROOT / "specinfer").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ABOVE_THE_CORE]
    assert found == []
