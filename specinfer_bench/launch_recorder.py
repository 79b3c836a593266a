"""A pytest plugin that writes every Triton launch the tests make in Triton's CPU interpreter as a JSON line
to $SPECINFER_LAUNCHES: the kernel, its arguments (a tensor as its dtype, numbers as they are) and its
keyword arguments (constexprs, warps, stages). `specinfer_bench.kernel_compile --launches FILE` compiles
them for a GPU, so the variants a GPU's test run compiles, and what that costs, are known without one:

    TRITON_INTERPRET=1 SPECINFER_LAUNCHES=/tmp/launches.jsonl python -m pytest -q -p specinfer_bench.launch_recorder tests/test_kernels.py
"""

import json
import os

import torch
from triton.runtime.interpreter import InterpretedFunction

_run = InterpretedFunction.run


def _encode(value):
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch.")}
    return value if isinstance(value, (bool, int, float, str)) or value is None else repr(value)


def _recorded_run(self, *args, grid, warmup, **kwargs):
    with open(os.environ["SPECINFER_LAUNCHES"], "a") as f:
        f.write(json.dumps({"module": self.fn.__module__, "name": self.fn.__name__,
                            "args": [_encode(a) for a in args],
                            "kwargs": {k: _encode(v) for k, v in kwargs.items()}}) + "\n")
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") != "1" or "SPECINFER_LAUNCHES" not in os.environ:
        raise RuntimeError("specinfer_bench.launch_recorder records the interpreter's launches: "
                           "set TRITON_INTERPRET=1 and SPECINFER_LAUNCHES=FILE")
    InterpretedFunction.run = _recorded_run
