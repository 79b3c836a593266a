"""The wire and the layering: committed stubs match the .proto files; the core never imports grpc."""

import subprocess
import sys

from .conftest import ROOT


def test_generated_python_stubs_are_not_stale():
    proc = subprocess.run([sys.executable, "protos/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_core_library_never_imports_grpc():
    modules = sorted(p.stem for p in (ROOT / "specinfer").glob("*.py") if p.stem != "__main__")
    code = f"import sys\nfor m in {modules!r}: __import__('specinfer.' + m)\nprint(sorted(k for k in sys.modules if k.split('.')[0] == 'grpc'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
