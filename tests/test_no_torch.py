"""The manager and the gateway run without torch (their images leave it out): in processes where
importing torch fails, they serve the LLM's own greedy output, grammar-constrained output and
penalized sampling included, beside a verifier and a speculator that have it."""

from __future__ import annotations

import json
import urllib.request

from tokenizers import Tokenizer

from specinfer_rpc.launch import System

from .conftest import MODELS
from .services import reference_greedy

# Python runs sitecustomize at start: from then on torch, and the packages only torch needs, are as
# absent as in the images (importing them fails, and importlib.util.find_spec, which transformers
# asks, says they are not there), and the process says it ran
BLOCKER = """
import importlib.abc, importlib.util, os, sys

def absent(name):
    return name.split(".")[0] in ("torch", "sympy", "mpmath", "networkx")

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if absent(name):
            raise ModuleNotFoundError(f"No module named {name!r} (not installed in this image)", name=name)

find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if absent(name) else find_spec(name, package)
sys.meta_path.insert(0, NoTorch())
open(os.path.join(os.path.dirname(__file__), f"ran-{os.getpid()}"), "w").close()
"""


def completion(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.load(r)


def test_the_manager_and_the_gateway_serve_without_torch(tmp_path, monkeypatch, heldout_ids):
    blocked = tmp_path / "no-torch"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text(BLOCKER)
    system = System(log_dir=tmp_path / "logs")
    try:
        common = ["--port", "0", "--metrics-port", "0"]
        verifier = system.start("verifier", "verifier_svc", ["--model", str(MODELS / "llm"), *common], 120)
        speculator = system.start("speculator", "speculator_svc",
                                  ["--ssm", str(MODELS / "ssm-0"), "--threads", "1", *common], 120)
        monkeypatch.setenv("PYTHONPATH", str(blocked))
        manager = system.start("manager", "manager_svc", [*common, "--verifier", verifier.address, "--speculators",
                                                          speculator.address, "--tokenizer", str(MODELS / "llm")], 120)
        gateway = system.start("gateway", "gateway_svc", ["--port", "0", "--manager", manager.address,
                                                          "--tokenizer", str(MODELS / "llm")], 120, http="http")
        monkeypatch.delenv("PYTHONPATH")
        assert len(list(blocked.glob("ran-*"))) == 2, "the blocker ran in the manager and the gateway"

        ids = heldout_ids[0]
        body = {"model": "llm", "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        greedy = completion(gateway.url, body)
        want = Tokenizer.from_file(str(MODELS / "llm" / "tokenizer.json")).decode(
            reference_greedy([ids], 24, ignore_eos=True)[0], skip_special_tokens=True)
        assert greedy["choices"][0]["text"] == want and greedy["usage"]["completion_tokens"] == 24
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                  "additionalProperties": False}
        constrained = completion(gateway.url, {**body, "ignore_eos": False, "max_tokens": 32, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
        assert set(json.loads(constrained["choices"][0]["text"])) == {"n"}
        penalized = completion(gateway.url, {**body, "temperature": 0.8, "seed": 3, "presence_penalty": 0.5,
                                             "logit_bias": {"5": 2.0}, "min_tokens": 4})
        assert penalized["usage"]["completion_tokens"] == 24
        assert all(s.process.poll() is None for s in system.services)
    finally:
        system.stop()
