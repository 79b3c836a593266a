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
    return sorted(p for p in models_dir().glob("ssm-*") if (p / "config.json").exists())
