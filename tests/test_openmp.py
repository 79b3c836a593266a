"""The model services bound OpenMP's idle spinning before torch loads libgomp (which reads the
setting once, at load): the verifier's idle threads must not spin on the cores the speculators
draft on (specinfer_rpc/openmp.py). The services bench does too, so that its in-process runs compare
with the services on equal terms."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specinfer_rpc.openmp import SPIN_COUNT

ROOT = Path(__file__).resolve().parent.parent

# records GOMP_SPINCOUNT at the moment torch is first imported, then imports the service's entry point
PROBE = """
import importlib.abc, os, sys
seen = []
class Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("GOMP_SPINCOUNT", "<unset>"))
        return None
sys.meta_path.insert(0, Probe())
import {module}
assert "torch" in sys.modules, "the entry point did not import torch"
print(seen[0])
"""


def spin_count_when_torch_loads(module: str, env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")} | env
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("module", ["verifier_svc.__main__", "speculator_svc.__main__", "specinfer_bench.services"])
def test_model_services_bound_the_spin_before_torch_loads(module):
    assert spin_count_when_torch_loads(module, {}) == SPIN_COUNT


def test_an_operators_own_openmp_setting_wins():
    assert spin_count_when_torch_loads("verifier_svc.__main__", {"GOMP_SPINCOUNT": "123"}) == "123"
    assert spin_count_when_torch_loads("verifier_svc.__main__", {"OMP_WAIT_POLICY": "ACTIVE"}) == "<unset>"
