"""specinfer_rpc.model_thread: the model thread makes the models' device current, with the rules of
torch.cuda.set_device (faked here, so that the property holds on a machine without a GPU too)."""

from __future__ import annotations

import pytest
import torch

from specinfer_rpc.model_thread import ModelThread


@pytest.mark.parametrize("device, current", [("cuda", None), ("cuda:1", 1), ("cpu", None)])
def test_the_model_thread_starts_on_any_device_a_service_resolves(monkeypatch, device, current):
    """A service's `--device cuda` (and `auto` on a GPU) is a device without an index, which
    set_device refuses; the model thread then keeps the current device (seen on an H200: the verifier
    service did not start)."""
    made_current = []

    def set_device(d):
        if isinstance(d, torch.device) and d.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{d}")
        made_current.append(torch.device(d).index)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    thread = ModelThread("test", 0, torch.device(device))
    try:
        assert thread.call(lambda: "started") == "started"
    finally:
        thread.executor.shutdown()
    assert made_current == ([] if current is None else [current])
