"""Which device and dtype a service or a command runs its models on, from the names its flags take."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' is cuda when there is a GPU, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA (tensor cores) and float32 elsewhere (this project's CPUs have no
    fast bf16 products); otherwise one of DTYPES by name."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x (on the host) on `device`, queued without waiting: a copy from pageable memory to a GPU may
    wait for the work already queued on the stream (CUDA's API synchronization rules), so it goes
    through pinned memory, which a verifier step begun behind another one needs to stay ahead."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
