"""Where checkpoints live and how they are loaded: the shipped models' directory, the dtypes a
command line may name, and the device 'auto' means."""

from __future__ import annotations

import os
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' is cuda when there is a GPU, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def models_dir() -> Path:
    """The shipped models (models/ beside the packages), or $SPECINFER_MODELS."""
    return Path(os.environ.get("SPECINFER_MODELS", Path(__file__).resolve().parent.parent / "models"))


def default_ssms() -> list[Path]:
    """Every shipped SSM (SSM 0, then SSM 1 boost-tuned on SSM 0's misses)."""
    return sorted(p for p in models_dir().glob("ssm-*") if (p / "config.json").exists())


def served_ssms() -> list[Path]:
    """The SSMs the services draft with unless told otherwise: SSM 0 alone. With the manager's context
    lookup merged in, SSM 1 adds little (held-out agreement 89.8% -> 92.1%), and on a 2-core CPU its own
    speculator process costs more than that: at one stream 1.21-1.24x no speculation with both
    against 1.50-1.57x with SSM 0 alone, at two streams 0.85-0.90x against 1.03-1.08x (two alternated
    runs each, on the SSMs shipped before: bench/results/services_ssms_ab_cpu.md)."""
    return default_ssms()[:1]
