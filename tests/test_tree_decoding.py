"""Tree-based parallel decoding: one forward over a ragged batch of trees gives, for every node u,
the logits Hugging Face's own model gives for plain causal decoding of prefix + S_u."""

import json
import random
import shutil

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specinfer.model import DRAFT_VOCAB, Dense, LlamaModel, StepInput
from specinfer.tree import TokenTree, dfs_order, reorder

from .conftest import path_to, save_random_llama

ATOL = 1e-4  # float32; observed differences are ~1e-6


def random_tree(rng: random.Random, n: int, vocab: int) -> TokenTree:
    parents = [rng.randrange(-1, u) for u in range(n)]
    tree = TokenTree([rng.randrange(vocab) for _ in range(n)], parents)
    return reorder(tree, dfs_order(tree.parents))


SHAPES = {
    "chain": lambda rng, v: TokenTree([rng.randrange(v) for _ in range(6)], [-1, 0, 1, 2, 3, 4]),
    "wide": lambda rng, v: TokenTree([rng.randrange(v) for _ in range(8)], [-1] * 8),
    "one_node": lambda rng, v: TokenTree([rng.randrange(v)], [-1]),
    "random": lambda rng, v: random_tree(rng, 20, v),
}


def per_item(model, items: list[StepInput]) -> list[torch.Tensor]:
    """The forward's logits [R, V], split into each item's rows."""
    return list(model(items).split([it.n_rows for it in items]))


def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def check_batch(hf, model, rng, prefix_lens, shapes):
    vocab = model.cfg.vocab_size
    pool = model.new_pool(4096)
    caches = [pool.new_cache() for _ in prefix_lens]
    prefixes = [[rng.randrange(vocab) for _ in range(n)] for n in prefix_lens]
    trees = [SHAPES[s](rng, vocab) for s in shapes]
    out = per_item(model, [StepInput(c, p, t.tokens, t.parents) for c, p, t in zip(caches, prefixes, trees)])
    for prefix, tree, logits in zip(prefixes, trees, out):
        assert logits.shape == (len(tree) + 1, vocab)
        torch.testing.assert_close(logits[0], reference_logits(hf, prefix), atol=ATOL, rtol=0)
        for u, path in enumerate(tree.paths()):
            torch.testing.assert_close(logits[1 + u], reference_logits(hf, prefix + list(path)), atol=ATOL, rtol=0)
    return caches, prefixes, trees


@pytest.mark.parametrize("seed", range(3))
def test_every_tree_node_matches_causal_decoding_of_its_path(tiny_pair, seed):
    hf, llm_dir, _ = tiny_pair
    model = LlamaModel.from_pretrained(llm_dir)
    rng = random.Random(seed)
    check_batch(hf, model, rng, [1, 5, 17, 40], ["chain", "wide", "one_node", "random"])


def test_committed_path_kv_serves_the_next_step(tiny_pair):
    """After committing an accepted path (KV moved, rest dropped), the next step's new token and
    tree still match causal decoding of prefix + path + bonus."""
    hf, llm_dir, _ = tiny_pair
    model = LlamaModel.from_pretrained(llm_dir)
    rng = random.Random(7)
    caches, prefixes, trees = check_batch(hf, model, rng, [3, 9], ["random", "random"])
    items, records = [], []
    for cache, prefix, tree in zip(caches, prefixes, trees):
        leaf = max(range(len(tree)), key=lambda u: len(path_to(tree, u)))
        path = path_to(tree, leaf)
        cache.commit(path)
        assert cache.length == len(prefix) + len(path)
        bonus = rng.randrange(model.cfg.vocab_size)
        nxt = random_tree(rng, 10, model.cfg.vocab_size)
        records.append((prefix + [tree.tokens[u] for u in path] + [bonus], nxt))
        items.append(StepInput(cache, [bonus], nxt.tokens, nxt.parents))
    for (record, nxt), logits in zip(records, per_item(model, items)):
        torch.testing.assert_close(logits[0], reference_logits(hf, record), atol=ATOL, rtol=0)
        for u, path in enumerate(nxt.paths()):
            torch.testing.assert_close(logits[1 + u], reference_logits(hf, record + list(path)), atol=ATOL, rtol=0)


def test_ssm_style_level_by_level_growth_matches_causal_decoding(tiny_pair):
    """Nodes added over several forwards (as an SSM grows its tree) attend to earlier levels."""
    hf, llm_dir, _ = tiny_pair
    model = LlamaModel.from_pretrained(llm_dir)
    cache = model.new_pool(4096).new_cache()
    prefix = [3, 1, 4, 1, 5]
    model([StepInput(cache, prefix, [], [])])
    level1 = model([StepInput(cache, [], [9, 2], [-1, -1])])
    level2 = model([StepInput(cache, [], [6, 5, 3], [0, 0, 1])])
    for row, path in zip(list(level1) + list(level2), [[9], [2], [9, 6], [9, 5], [2, 3]]):
        torch.testing.assert_close(row, reference_logits(hf, prefix + path), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["qwen2_bias", "llama3_rope", "linear_rope", "tied_mha"])
def test_llama_family_variants_match_transformers(tmp_path, variant):
    if variant == "qwen2_bias":
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        hf = Qwen2ForCausalLM(cfg).eval()
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        hf.save_pretrained(tmp_path)
    elif variant == "llama3_rope":
        hf = save_random_llama(tmp_path, 0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16})
    elif variant == "linear_rope":
        hf = save_random_llama(tmp_path, 0, rope_scaling={"rope_type": "linear", "factor": 4.0})
    else:
        hf = save_random_llama(tmp_path, 0, kv_heads=4, tie_word_embeddings=True)
    model = LlamaModel.from_pretrained(tmp_path)
    check_batch(hf, model, random.Random(1), [2, 30], ["random", "chain"])


def test_unsupported_checkpoint_is_refused_with_the_field_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="model_type"):
        LlamaModel.from_pretrained(tmp_path)


def test_lm_head_rows_do_not_depend_on_the_other_rows(tiny_pair):
    """On this CPU the LM head multiplies by its oneDNN-packed weight (Dense.pack): a row's logits
    are bit-identical whether the row goes alone or with others, and equal x @ W up to rounding."""
    _, llm_dir, _ = tiny_pair
    head = LlamaModel.from_pretrained(llm_dir).lm_head
    assert (head.packed is not None) == torch.backends.mkldnn.is_available()
    x = torch.randn(17, head.weight.shape[0], generator=torch.Generator().manual_seed(0))
    rows = head(x)
    for i in range(len(x)):
        assert torch.equal(head(x[i : i + 1])[0], rows[i])
    torch.testing.assert_close(rows, x @ head.weight, atol=ATOL, rtol=0)
    assert head.to(torch.float64).packed is None  # cast: back to the plain weight


def draft_vocab_dir(tmp_path, llm_dir, content: str):
    """A copy of the checkpoint at llm_dir with a draft vocabulary file holding `content`."""
    shutil.copytree(llm_dir, tmp_path / "drafter")
    (tmp_path / "drafter" / DRAFT_VOCAB).write_text(content)
    return tmp_path / "drafter"


def test_draft_vocabulary_keeps_its_tokens_logits_and_hides_the_rest(tiny_pair, tmp_path):
    """A checkpoint with a draft vocabulary: the full model's logits on its tokens, -inf elsewhere."""
    _, llm_dir, _ = tiny_pair
    keep = list(range(0, 64, 3))
    full = LlamaModel.from_pretrained(llm_dir)
    drafter = LlamaModel.from_pretrained(draft_vocab_dir(tmp_path, llm_dir, json.dumps({"token_ids": keep})))
    assert drafter.lm_head.weight.shape == (full.cfg.hidden_size, len(keep))
    rng = random.Random(0)
    tree = SHAPES["random"](rng, 64)
    prefix = [rng.randrange(64) for _ in range(9)]
    want, got = (m([StepInput(m.new_pool(512).new_cache(), prefix, tree.tokens, tree.parents)]) for m in (full, drafter))
    hidden = torch.ones(64, dtype=torch.bool)
    hidden[keep] = False
    torch.testing.assert_close(got[:, keep], want[:, keep], atol=ATOL, rtol=0)
    assert torch.isneginf(got[:, hidden]).all()


@pytest.mark.parametrize("content,match", [
    ('{"token_ids": [1, 64]}', "token id 64 is outside the vocabulary"),
    ('{"token_ids": []}', "must not be empty"),
    ('{"ids": [1, 2]}', "must be a list of token ids"),
])
def test_bad_draft_vocabulary_is_refused_naming_the_file(tiny_pair, tmp_path, content, match):
    _, llm_dir, _ = tiny_pair
    with pytest.raises(ValueError, match=f"{DRAFT_VOCAB}: token_ids: {match}"):
        LlamaModel.from_pretrained(draft_vocab_dir(tmp_path, llm_dir, content))


@pytest.mark.parametrize("d_in,invariant", [(None, False), (None, True), (1536, True)])  # None: the fixture's
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17, 32, 33, 48, 100, 256, 300, 600])  # gate/up; 1536: SmolLM2's down
def test_projections_are_x_times_w_and_each_row_its_own(tiny_pair, rows, d_in, invariant, monkeypatch):
    """A layer's projections multiply by W in oneDNN's layout (Dense.pack), zero-padded to a row bucket
    past Dense.PACKED_ROWS, by W itself beyond the last bucket: every row count gives x @ W up to rounding,
    and up to the last bucket each row of a product is bit for bit that row multiplied alone, so a tree
    node's projections do not depend on the rows beside it. In the row-invariant mode every row count
    keeps a row's bits (slices of the last bucket beyond it: a prompt chunk's rows too), with 1,536
    inputs as well (a one-row product is padded where oneDNN's sums in another order alone: Dense._pad_one_row)."""
    if invariant:
        monkeypatch.setenv("SPECINFER_TREE_ATTENTION", "invariant")
    _, llm_dir, _ = tiny_pair
    dense = LlamaModel.from_pretrained(llm_dir).layers[0].gate_up
    if d_in is not None:
        weight = torch.randn(d_in, 96, generator=torch.Generator().manual_seed(d_in)) / d_in ** 0.5
        dense = Dense(d_in, 96, bias=False)
        dense.weight = torch.nn.Parameter(weight, requires_grad=False)
        dense.pack()
    assert (dense.packed is not None) == torch.backends.mkldnn.is_available()
    x = torch.randn(rows, dense.weight.shape[0], generator=torch.Generator().manual_seed(rows))
    y = dense(x)
    assert y.is_contiguous()
    torch.testing.assert_close(y, x @ dense.weight, atol=ATOL, rtol=0)
    if rows <= dense.ROW_BUCKETS[-1] or invariant:
        for i in {0, rows // 2, rows - 1}:
            assert torch.equal(dense(x[i: i + 1]), y[i: i + 1])
    assert dense.to(torch.float64).packed is None  # cast: back to the plain weight
