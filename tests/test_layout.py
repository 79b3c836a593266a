"""Folders named as they are imported, and no import name of ours that another distribution also installs:
every process started from the repository root (`specinfer serve`, `python -m gateway_svc`, pytest) finds
the repository's folders first, so a folder `kernels/` hid Hugging Face's `kernels`, which transformers
imports. The lock installs what was tested (constraints.txt, scripts/lock.sh)."""

import importlib.metadata
import re
import subprocess
import sys
import tomllib

from .conftest import MODELS, ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def importable_from_root() -> set[str]:
    """The names `import NAME` finds first in the repository root: packages (a folder with __init__.py)
    and modules (NAME.py). Folders without __init__.py are namespace portions, which an installed
    package of the same name takes precedence over."""
    return ({p.parent.name for p in ROOT.glob("*/__init__.py")}
            | {p.stem for p in ROOT.glob("*.py")})


def test_each_package_is_the_folder_of_its_import_name():
    packages = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert "package-dir" not in PYPROJECT["tool"]["setuptools"]  # no folder installed under another name
    top = {p for p in packages if "." not in p}
    assert top <= importable_from_root()
    assert importable_from_root() - top == {"tests"}  # the rest is installed; the tests are not


def test_no_import_name_of_ours_is_installed_by_another_distribution():
    installed = importlib.metadata.packages_distributions()
    for name in sorted(importable_from_root()):
        others = set(installed.get(name, [])) - {"specinfer"}
        assert not others, f"{name}: the repository's folder would hide {sorted(others)}' {name}"


def test_hugging_faces_kernels_beside_the_project_from_the_repository_root():
    """HF `kernels` is in the test extra (transformers 5.25 imports it as a tokenizer or config loads): from
    the root, the project's services and transformers' tokenizer import, and `kernels` is HF's."""
    code = f"""
import kernels, transformers
assert "site-packages" in kernels.__file__, kernels.__file__
import gateway_svc.__main__, manager_svc.__main__, speculator_svc.__main__, verifier_svc.__main__, specinfer_kernels
tok = transformers.AutoTokenizer.from_pretrained({str(MODELS / "llm")!r})
assert tok("hello").input_ids
print(kernels.__file__, transformers.__version__)
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_install_commands_install_from_the_lock_and_the_lock_pins_every_package_exactly():
    lock = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    pins = dict(line.split("==") for line in lock)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.!+_-]+", line) for line in lock), lock
    assert pins["torch"] == "2.13.0"  # the CPU wheel the commands install first, its local label dropped
    assert "specinfer" not in pins
    for dep in PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["test"]:
        name = re.split(r"[\[<>=!~ ;]", dep, maxsplit=1)[0].lower().replace("_", "-")
        assert name in {p.lower().replace("_", "-") for p in pins}, f"{dep}: not in constraints.txt"
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    installs = re.findall(r"pip install [^&\n]*-e [^&\n]*", readme) + re.findall(r"pip install [^\n]*-e [^\n]*", ci)
    assert len(installs) >= 3 and all("-c constraints.txt" in i for i in installs), installs
    for image in (ROOT / "docker").glob("Dockerfile.*"):  # (the GPU image's lock leaves triton to CUDA's torch)
        text = image.read_text()
        assert re.search(r"COPY [^\n]*constraints.txt /src/", text), image.name
        assert re.search(r"pip-install -c /(src|tmp)/constraints.txt /src\b", text), image.name
