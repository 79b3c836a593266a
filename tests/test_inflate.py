"""Cost-realistic benchmark models: an inflated checkpoint (wider, more heads, wider MLP, deeper)
predicts exactly what its source predicts: logits within float32 rounding (1e-5 absolute plus 1e-5
relative: the three-cycle shipped LLM's logits are larger, and a difference of 1.05e-5 on a logit of
4.5 came from the 10 inflated layers summing in another order), by transformers and by our runner,
and identical greedy outputs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel, ModelConfig, StepInput
from specinfer_bench.inflate import main as inflate_main

from .conftest import MODELS
from .test_greedy import hf_greedy
from .test_tree_decoding import per_item

ATOL = RTOL = 1e-5  # the inflated model against its source, both through transformers
RUNNER_ATOL = 1e-4  # our runner against transformers, as in test_tree_decoding (float32 summation order)


@pytest.mark.parametrize("source,flags", [
    ("tiny", ["--hidden", "96", "--heads-multiple", "2", "--intermediate", "200", "--layers", "4"]),  # untied
    ("shipped", ["--hidden", "512", "--intermediate", "1536", "--layers", "10"]),  # tied, heads x2 by default
])
def test_an_inflated_model_predicts_exactly_what_its_source_predicts(tiny_pair, tmp_path, source, flags):
    src = tiny_pair[1] if source == "tiny" else MODELS / "llm"
    out = tmp_path / "inflated"
    assert inflate_main([str(src), "--out", str(out), "--dtype", "float32", *flags]) == 0
    cfg, big_cfg = ModelConfig.from_dir(src), ModelConfig.from_dir(out)
    assert big_cfg.hidden_size > cfg.hidden_size and big_cfg.num_layers > cfg.num_layers
    assert big_cfg.num_heads == 2 * cfg.num_heads and big_cfg.intermediate_size > cfg.intermediate_size
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    hf_big = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(hf_big(ids).logits, want, atol=ATOL, rtol=RTOL)
    ours = LlamaModel.from_pretrained(out)
    for b in range(2):
        got = per_item(ours, [StepInput(ours.new_pool(256).new_cache(), ids[b].tolist(), [], [])])[0]
        torch.testing.assert_close(got[0], want[b, -1], atol=RUNNER_ATOL, rtol=0)
    prompt = ids[0, :12].tolist()
    gen = Engine(ours, mode=Mode.INCREMENTAL).generate([Request(prompt, 24)])[0]
    assert gen.token_ids == hf_greedy(hf, prompt, 24, eos=cfg.eos_token_ids[0] if cfg.eos_token_ids else None)
