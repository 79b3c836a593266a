"""Feature drafters (EAGLE-3 heads): the verifier's features of committed rows are the LLM's residual
stream of the record, whatever the trees; a head drafts from them what its dense training-time
forward computes, whatever the history of its cache; a head loads from the published layout and is
refused where it does not fit the LLM; and with a head drafting, greedy output is the LLM's own and
MSS keeps the LLM's distribution."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specinfer.eagle import EagleHead, save_head
from specinfer import feature_drafter
from specinfer.controller import FEATURE_LEAD
from specinfer.feature_drafter import FeatureSpeculator
from specinfer.generate import Engine, Mode, Request
from specinfer.model import LlamaModel, ModelConfig
from specinfer.sampling import SamplingParams, stream_key
from specinfer.speculator import DraftRequest
from specinfer.tree import TokenTree
from specinfer.verifier import Features, Verifier, VerifyRequest

from .conftest import MODELS, save_random_llama
from .test_dynamic_tree import paths
from .test_sampling_exact import ALPHA, chi_square_pvalue, llama_exact

LAYERS = [1, 4, 6]  # of the fixture LLM's 8


def write_random_head(path, llm: ModelConfig, seed: int, layers=LAYERS, draft_vocab=None, scale: float = 1.0,
                      **config) -> None:
    """A random head of the published layout for `llm`; `scale` sharpens its LM head."""
    g = torch.Generator().manual_seed(seed)
    H, I, D = llm.hidden_size, 2 * llm.hidden_size, llm.head_dim
    rand = lambda *shape: torch.randn(*shape, generator=g) * shape[-1] ** -0.5  # noqa: E731
    vocab = list(range(llm.vocab_size)) if draft_vocab is None else draft_vocab
    p, a = "midlayer.", "midlayer.self_attn."
    tensors = {"fc.weight": rand(H, len(layers) * H), p + "input_layernorm.weight": torch.ones(H),
               p + "hidden_norm.weight": torch.ones(H), a + "q_proj.weight": rand(llm.num_heads * D, 2 * H),
               a + "k_proj.weight": rand(llm.num_kv_heads * D, 2 * H), a + "v_proj.weight": rand(llm.num_kv_heads * D, 2 * H),
               a + "o_proj.weight": rand(H, llm.num_heads * D), p + "post_attention_layernorm.weight": torch.ones(H),
               p + "mlp.gate_proj.weight": rand(I, H), p + "mlp.up_proj.weight": rand(I, H),
               p + "mlp.down_proj.weight": rand(H, I), "norm.weight": torch.ones(H),
               "lm_head.weight": rand(len(vocab), H) * scale}
    save_head(path, llm, tensors, vocab, layers, I, **config)


@pytest.fixture(scope="module")
def fixture_llm():
    return LlamaModel.from_pretrained(MODELS / "llm")


@pytest.fixture(scope="module")
def head(fixture_llm, tmp_path_factory):
    path = tmp_path_factory.mktemp("head")
    write_random_head(path, fixture_llm.cfg, seed=0, scale=4.0)
    return EagleHead.from_pretrained(path, fixture_llm.cfg, fixture_llm.embed.weight)


PROMPTS = [[5, 17, 300, 42, 9, 77, 1024, 3, 3, 8], [100, 200, 300, 400, 500, 600, 700], [11, 12]]


def test_verifier_features_of_committed_rows_are_the_records_residual_stream(fixture_llm):
    """Prefill, then steps with trees holding the LLM's own next tokens among others: the features
    returned cover every record position but the last, in order, and equal a plain prefill's."""
    verifier = Verifier(fixture_llm, feature_layers=tuple(LAYERS))
    prompt = PROMPTS[0]
    got = []
    (v,) = verifier.step([VerifyRequest("r", prompt, features=True)])
    got.append(v.features)
    record = prompt + v.tokens
    for _ in range(4):
        # the LLM's next two tokens (a step without the tree) as one branch, a wrong token as another
        probe = Verifier(fixture_llm)
        (p,) = probe.step([VerifyRequest("p", record)])
        (p2,) = probe.step([VerifyRequest("p", [], TokenTree([p.tokens[0]], [-1]))])
        tree = TokenTree([7, p.tokens[0], p2.tokens[-1]], [-1, -1, 1])
        (v,) = verifier.step([VerifyRequest("r", [], tree, features=True)])
        got.append(v.features)
        record += v.tokens
    assert [f.start for f in got] == [0, *itertools_accumulate([len(f.rows) for f in got])][:-1]
    rows = torch.cat([f.rows for f in got])
    assert len(rows) == len(record) - 1
    fresh = Verifier(fixture_llm, feature_layers=tuple(LAYERS))
    (v,) = fresh.step([VerifyRequest("f", record[:-1], features=True)])
    torch.testing.assert_close(rows, v.features.rows, rtol=1e-4, atol=1e-4)


def itertools_accumulate(xs):
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def test_a_step_returns_at_most_its_feature_bytes_newest_prompt_rows_first(fixture_llm):
    """Two prompts and a budget of 5 rows: each prompt's newest 2 rows, as a plain prefill computes them."""
    row_bytes = len(LAYERS) * fixture_llm.cfg.hidden_size * 4
    verifier = Verifier(fixture_llm, feature_layers=tuple(LAYERS), feature_bytes=5 * row_bytes)
    verdicts = verifier.step([VerifyRequest("a", PROMPTS[0], features=True), VerifyRequest("b", PROMPTS[1], features=True)])
    for prompt, v in zip(PROMPTS, verdicts):
        assert v.features.start == len(prompt) - 2 and len(v.features.rows) == 2
        full = record_features(fixture_llm, prompt + [0])
        torch.testing.assert_close(v.features.rows, full[-2:], rtol=1e-4, atol=1e-4)


def test_features_are_refused_by_a_verifier_without_feature_layers(fixture_llm):
    verifier = Verifier(fixture_llm)
    with pytest.raises(ValueError, match="features"):
        verifier.step([VerifyRequest("r", PROMPTS[0], features=True)])
    assert "r" not in verifier.caches or not verifier.caches["r"].tokens


def record_features(llm: LlamaModel, record: list[int]) -> torch.Tensor:
    """The LLM's features of record positions 0..len-2 (a plain prefill)."""
    (v,) = Verifier(llm, feature_layers=tuple(LAYERS)).step([VerifyRequest("x", record[:-1], features=True)])
    return v.features.rows


def test_drafted_chain_is_the_dense_training_time_forward(fixture_llm, head):
    """A greedy chain drafted on the paged cache equals the argmax of `EagleHead.chains` run over the
    record followed by the chain itself (the training-time test's forward), at the last root."""
    record = PROMPTS[0] + [64, 65, 66]
    feats = record_features(fixture_llm, record)
    (tree,) = FeatureSpeculator(head).draft([DraftRequest("r", record, [1, 1, 1, 1], features=[Features(0, feats)])])
    drafts = tree.tokens
    assert tree.parents == [-1, 0, 1, 2]
    tokens = torch.tensor([record + drafts])
    padded = torch.cat([feats, feats.new_zeros(len(drafts) + 1, feats.shape[1])])[None]
    with torch.no_grad():
        outs = head.chains(padded, tokens, steps=4)
    root = len(record) - 2
    expected = [int(head.lm_logits(o[0, root][None]).argmax()) for o in outs]
    assert drafts == expected


def test_a_draft_depends_on_the_record_and_its_features_not_on_the_caches_history(fixture_llm, head):
    """Told step by step (features arriving a step late, trees drafted and dropped between), the head
    drafts what a fresh head told everything at once drafts; a repeated draft is the same tree."""
    record = PROMPTS[1] + [1, 2, 3, 4, 5, 6, 7, 8]
    feats = record_features(fixture_llm, record)
    spec = FeatureSpeculator(head)
    told, trees = 0, []
    for end in (len(PROMPTS[1]), len(PROMPTS[1]) + 3, len(PROMPTS[1]) + 4, len(record)):
        f = Features(told - 1 if told else 0, feats[max(told - 1, 0): end - 1])
        trees.append(spec.draft([DraftRequest("r", record[told:end], [2, 2, 1], features=[f])])[0])
        told = end
    again = spec.draft([DraftRequest("r", [], [2, 2, 1])])[0]
    fresh = FeatureSpeculator(head).draft([DraftRequest("r", record, [2, 2, 1], features=[Features(0, feats)])])[0]
    assert (trees[-1].tokens, trees[-1].parents) == (fresh.tokens, fresh.parents) == (again.tokens, again.parents)


def test_drafters_take_a_finished_requests_blocks_and_draft_what_a_fresh_one_drafts(fixture_llm, head):
    """The drafters' prefix cache: a request whose leading tokens a released one had takes its SSM
    and head K/V blocks (not computed again) and gets the tree a fresh drafter gives."""
    from specinfer.speculator import Speculator

    record = PROMPTS[0] + list(range(20, 44))
    feats = record_features(fixture_llm, record)
    for drafter in (Speculator(fixture_llm), FeatureSpeculator(head)):
        ask = lambda rid: DraftRequest(rid, record, [2, 2, 1], features=[Features(0, feats)])
        drafter.draft([ask("a")])
        drafter.release("a")
        (tree,) = drafter.draft([ask("b")])
        (fresh,) = type(drafter)(*((head,) if isinstance(drafter, FeatureSpeculator) else (fixture_llm,))).draft(
            [ask("b")])
        assert (tree.tokens, tree.parents) == (fresh.tokens, fresh.parents)
        assert drafter.pool.hit_tokens >= 16, type(drafter).__name__


def test_both_drafters_key_their_coupled_guess_by_the_records_length(fixture_llm, head, monkeypatch):
    """A coupled request's guess races the noise of the position the root's children take: the
    record's length, whether the drafter caches tokens (an SSM) or pairs a token behind (the head),
    told at once or step by step (the verifier keys its sample the same way: `acceptance.decide_batch`)."""
    from specinfer.speculator import Speculator

    seen = []
    real = Speculator._guess_first
    monkeypatch.setattr(Speculator, "_guess_first", lambda self, *args: seen.append(args[4]) or real(self, *args))
    record = PROMPTS[1] + [1, 2, 3, 4]
    feats = record_features(fixture_llm, record)
    params = SamplingParams(0.9, seed=5)
    for drafter in (Speculator(fixture_llm), FeatureSpeculator(head)):
        told = 0
        for end in (len(PROMPTS[1]), len(record)):
            seen.clear()
            f = Features(told - 1 if told else 0, feats[max(told - 1, 0): end - 1])
            drafter.draft([DraftRequest("r", record[told:end], [2, 1], params, features=[f])])
            assert seen and all(c == [(stream_key(5, "sample"), end)] for c in seen), (type(drafter).__name__, seen)
            told = end


@pytest.mark.parametrize("chunk", [5])
@pytest.mark.parametrize("sampling,dynamic", [(SamplingParams(), False), (SamplingParams(), True),
                                              (SamplingParams(temperature=0.8, seed=3, mss=True), False)],
                         ids=["greedy", "dynamic", "sampled"])
def test_a_long_record_is_fed_a_chunk_a_draft_with_empty_trees_then_the_whole_records_tree(
        fixture_llm, head, chunk, sampling, dynamic):
    """A drafter (SSM or head) with a prefill chunk c, told a record of which its cache must hold n
    tokens, feeds c of them per draft and drafts an empty tree for ceil(n / c) - 1 drafts, then the
    tree a drafter fed the record whole drafts; a short request in the same batch gets its own tree
    at every draft meanwhile."""
    from specinfer.speculator import Speculator

    record, short = PROMPTS[0] + list(range(20, 44)), PROMPTS[1][:4]  # short: within a chunk
    feats, short_feats = record_features(fixture_llm, record), record_features(fixture_llm, short)
    for make in (lambda **kw: Speculator(fixture_llm, dynamic=dynamic, **kw),
                 lambda **kw: FeatureSpeculator(head, dynamic=dynamic, **kw)):
        ask = lambda rid, tokens, f: DraftRequest(rid, tokens, [2, 2, 1], sampling, features=[Features(0, f)] if f is not None else [])
        whole, alone = make().draft([ask("long", record, feats), ask("short", short, short_feats)])
        drafter = make(prefill_chunk=chunk)
        first = drafter.draft([ask("long", record, feats), ask("short", short, short_feats)])
        n = len(drafter.caches["long"].tokens)
        drafts, lengths = [first], [drafter.caches["long"].length]
        for _ in range(-(-n // chunk) - 1):
            drafts.append(drafter.draft([ask("long", [], None), ask("short", [], None)]))
            lengths.append(drafter.caches["long"].length)
        name = type(drafter).__name__
        assert n > 2 * chunk, name
        assert [len(t) for t, _ in drafts[:-1]] == [0] * (len(drafts) - 1), name
        assert lengths[:-1] == [chunk * (i + 1) for i in range(len(drafts) - 1)], name
        assert (drafts[-1][0].tokens, drafts[-1][0].parents) == (whole.tokens, whole.parents), name
        assert all((s.tokens, s.parents) == (alone.tokens, alone.parents) for _, s in drafts), name


def test_features_of_the_wrong_width_are_refused_naming_the_field(fixture_llm, head):
    spec = FeatureSpeculator(head)
    with pytest.raises(ValueError, match="features"):
        spec.draft([DraftRequest("r", PROMPTS[0], [2], features=[Features(0, torch.zeros(9, 5))])])
    assert "r" not in spec.caches


def test_a_head_that_does_not_fit_the_llm_is_refused(fixture_llm, tmp_path):
    cfg = fixture_llm.cfg
    cases = {
        "vocab_size": dict(vocab_size=cfg.vocab_size + 1),
        "hidden size": dict(target_hidden_size=cfg.hidden_size * 2),
        "layers": dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, cfg.num_layers]}),
    }
    for i, (what, override) in enumerate(cases.items()):
        write_random_head(tmp_path / str(i), cfg, seed=1, **override)
        with pytest.raises(ValueError, match=what):
            EagleHead.from_pretrained(tmp_path / str(i), cfg, fixture_llm.embed.weight)
    write_random_head(tmp_path / "d2t", cfg, seed=1, draft_vocab=[0, 1, 2])
    from safetensors.torch import load_file, save_file
    t = load_file(tmp_path / "d2t" / "model.safetensors")
    t["d2t"] = torch.tensor([0, 0, cfg.vocab_size])
    save_file(t, tmp_path / "d2t" / "model.safetensors")
    with pytest.raises(ValueError, match="d2t"):
        EagleHead.from_pretrained(tmp_path / "d2t", cfg, fixture_llm.embed.weight)


def test_a_head_round_trips_through_the_published_layout(fixture_llm, head, tmp_path):
    save_head(tmp_path, fixture_llm.cfg, head.published(), head.vocab_ids.tolist(), LAYERS,
              head.cfg.intermediate_size)
    again = EagleHead.from_pretrained(tmp_path, fixture_llm.cfg, fixture_llm.embed.weight)
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("ssms,mode,dynamic,chunk", [
    (0, Mode.TREE, False, 0), (1, Mode.TREE, False, 0), (1, Mode.MERGED, False, 0), (0, Mode.TREE, True, 0),
    (1, Mode.MERGED, True, 0), (1, Mode.TREE, False, 4)],
    ids=["head", "ssm+head", "merged", "head-dynamic", "merged-dynamic", "ssm+head-prefilled-in-chunks"])
def test_greedy_output_with_a_head_is_the_llms_own(fixture_llm, head, ssms, mode, dynamic, chunk):
    """chunk: long prompts prefilled in chunks of it, by the verifier and the drafters."""
    ssm = [LlamaModel.from_pretrained(MODELS / "ssm-0")][:ssms]
    reqs = [Request(p, 24, id=str(i)) for i, p in enumerate(PROMPTS)]
    plain = Engine(fixture_llm, mode=Mode.INCREMENTAL).generate(reqs)
    spec = Engine(fixture_llm, ssm, mode, [2, 2, 1], heads=[head], lookup=True, dynamic=dynamic,
                  prefill_chunk=chunk).generate(reqs)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    assert sum(g.tree_steps for g in spec) > 0


def test_head_drafts_keep_the_llms_distribution_under_mss(tmp_path):
    """MSS over the head's sampled drafts (from a draft vocabulary of 4 of the 6 tokens) emits the
    LLM's own law (chi-square against the exact law by enumeration)."""
    hf = save_random_llama(tmp_path / "llm", 10, vocab=6, hidden=32, logit_scale=40.0)
    llm = LlamaModel.from_pretrained(tmp_path / "llm")
    write_random_head(tmp_path / "head", llm.cfg, seed=3, layers=[0, 1, 1], draft_vocab=[0, 2, 3, 5], scale=6.0)
    head = EagleHead.from_pretrained(tmp_path / "head", llm.cfg, llm.embed.weight)
    params = SamplingParams(temperature=0.9, mss=True)
    prompt = [1, 4, 2]
    engine = Engine(llm, [], Mode.TREE, [2, 2], heads=[head])
    gens = engine.generate([Request(list(prompt), 4, dataclasses.replace(params, seed=s)) for s in range(3000)])
    assert sum(g.tree_steps for g in gens) > 0
    samples = [tuple(g.token_ids[1:4]) for g in gens]
    assert chi_square_pvalue(samples, llama_exact(hf, prompt, params, keep=3)) > ALPHA


@pytest.fixture(scope="module")
def head_system(fixture_llm, tmp_path_factory):
    """The services on the fixture LLM: SSM 0's speculator and a feature speculator (a random head)."""
    from specinfer_rpc.launch import launch

    root = tmp_path_factory.mktemp("head-system")
    write_random_head(root / "head", fixture_llm.cfg, seed=0, scale=4.0)
    system = launch(MODELS / "llm", [MODELS / "ssm-0"], speculators=1, port=0, log_dir=root, heads=[root / "head"])
    yield system
    system.stop()


def test_greedy_through_the_services_with_a_feature_speculator_is_the_llms_own(head_system, heldout_ids):
    """The verifier returns features for the feature speculator's requests (its info names the
    layers), the manager hands them on, and the output is the LLM's own greedy tokens."""
    import grpc

    from specinfer_rpc.client import generate_all
    from specinfer_rpc.v1 import generation_pb2, generation_pb2_grpc, verifier_pb2, verifier_pb2_grpc

    from .services import reference_greedy

    with grpc.insecure_channel(head_system.services[0].address) as channel:
        info = verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10)
    assert list(info.feature_layers) == LAYERS
    prompts = heldout_ids[:6]
    streams = generate_all(head_system.manager.address, [Request(p, 32) for p in prompts], "2,2,1")
    assert [s.token_ids for s in streams] == reference_greedy(prompts, 32)
    assert sum(s.usage.verifier_steps for s in streams) < sum(len(s.token_ids) for s in streams)
    with grpc.insecure_channel(head_system.manager.address) as channel:  # the viewer names each drafter
        model = generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert list(model.drafter_names) == ["ssm-0", "head"]


@pytest.mark.parametrize("rows,width,dtype,data,start", [
    (2, 96 * 3, 1, b"\0" * 10, 0),  # fewer bytes than the rows need
    (1, 5, 1, b"\0" * 20, 0),  # the wrong width for the head
    (1, 768, 1, b"\0" * 3072, 500),  # past the record
    (1, 768, 7, b"\0" * 3072, 0),  # an unknown dtype
    (1, 768, 1, b"\xff" * 3072, 0),  # NaN
], ids=["short", "width", "position", "dtype", "nan"])
def test_corrupt_features_get_invalid_argument_naming_the_field(head_system, rows, width, dtype, data, start):
    import grpc

    from specinfer_rpc.v1 import common_pb2, speculator_pb2, speculator_pb2_grpc

    head = next(s for s in head_system.services if s.name == "speculator-head-0")
    update = speculator_pb2.DraftUpdate(request_id="bad", new_token_ids=[5, 6, 7], expansion=[2],
                                        features=[common_pb2.FeatureRows(start=start, rows=rows, width=width,
                                                                         dtype=dtype, data=data)])
    with grpc.insecure_channel(head.address) as channel:
        call = speculator_pb2_grpc.SpeculatorStub(channel).Speculate(
            iter([speculator_pb2.SpeculateRequest(iteration=1, updates=[update])]), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "features (request" in e.value.details() and "bad)" in e.value.details()


@pytest.mark.parametrize("dtype,bytes_per_value", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_features_cross_the_wire_bit_for_bit(dtype, bytes_per_value):
    from specinfer_rpc.model_convert import features_from_pb, features_to_pb

    f = Features(7, torch.randn(5, 12).to(dtype))
    pb = features_to_pb(f)
    assert (pb.start, pb.rows, pb.width, len(pb.data)) == (7, 5, 12, 5 * 12 * bytes_per_value)
    back = features_from_pb(pb, "features")
    assert back.start == 7 and back.rows.dtype == dtype and torch.equal(back.rows, f.rows)


def dense_logits(head: EagleHead, feats: torch.Tensor, record: list[int], after: list[int]) -> list[torch.Tensor]:
    """The head's logits along the chain `after` from the record's root, each row reading the output of the
    one before (its own prediction of the LLM's features), by the training-time test's dense forward: the
    root's, then each of `after`'s tokens'."""
    tokens = torch.tensor([record + after + [0]])
    padded = torch.cat([feats, feats.new_zeros(len(after) + 2, feats.shape[1])])[None]
    with torch.no_grad():
        outs = head.chains(padded, tokens, steps=len(after) + 1)
    return [head.lm_logits(o[0, len(record) - 2][None])[0] for o in outs]


@pytest.mark.parametrize("expansion", [[1, 1, 1], [2, 1]])
def test_a_head_drafts_ahead_from_its_own_predicted_features(fixture_llm, head, expansion):
    """The outcomes a head drafts ahead for are the likeliest by its own probabilities, and each one's tree is
    what it grows below the outcome's bonus token with its own outputs standing in for the LLM's features of
    the accepted path (which come only with the verdict): the dense training-time forward along the outcome's
    tokens, greedy. Its tree sent is `draft`'s."""
    record = PROMPTS[0] + [64, 65, 66]
    feats = record_features(fixture_llm, record)
    request = DraftRequest("r", record, expansion, features=[Features(0, feats)], ahead=4)
    (tree,), later = FeatureSpeculator(head).draft_ahead([request])
    (ahead,) = later()
    assert paths(tree) == paths(FeatureSpeculator(head).draft([dataclasses.replace(request, ahead=0)])[0])
    scored = []
    for path in [()] + sorted(paths(tree)):
        logits = dense_logits(head, feats, record, list(path))
        logp = sum(logits[i].log_softmax(-1)[t].item() for i, t in enumerate(path))
        children = {p[-1] for p in paths(tree) if len(p) == len(path) + 1 and p[:-1] == path}
        best = logits[-1].log_softmax(-1).topk(4 + len(children))
        scored += [(logp + q, path + (b,)) for b, q in zip(best.indices.tolist(), best.values.tolist()) if b not in children]
    assert list(ahead) == [key for _, key in sorted(scored, key=lambda s: -s[0])[:4]]
    for key, grown in ahead.items():
        first = dense_logits(head, feats, record, list(key))[-1].topk(expansion[0]).indices.tolist()
        assert sorted(p for p in paths(grown) if len(p) == 1) == sorted((t,) for t in first), key
        chain = first[:1]  # down the likeliest children, by the dense forward
        for _ in expansion[1:]:
            chain.append(int(dense_logits(head, feats, record, list(key) + chain)[-1].argmax()))
        assert tuple(chain) in paths(grown), key


@pytest.mark.parametrize("ahead", [False, True], ids=["one-step-at-a-time", "plain-steps-sent-ahead"])
def test_plain_steps_bring_the_llms_features_only_before_a_look_at_a_tree(fixture_llm, head, monkeypatch, ahead):
    """Held on plain decoding (the controller's rates patched so that it wins), the engine asks the LLM's
    features of the FEATURE_LEAD plain steps before each look at a tree, and of no other plain step: at a
    look the head drafts from the LLM's features of the tokens before it, not from zeros, and plain decoding
    held pays for none. So too where plain steps are sent ahead of their answers (a verifier on a GPU)."""
    engine = Engine(fixture_llm, [], Mode.TREE, [2, 1, 1], heads=[head], adaptive=True)
    engine.engine.steps_ahead = ahead
    controller = engine.engine.controller
    monkeypatch.setattr(controller, "rate", lambda b, choice, *a: 0.5 if choice.depth else 1.0)
    chosen, asked, choose, verify = [], [], controller.choose, engine.engine.verifier.verify

    def logged_choice(*a, **k):
        chosen.append(choose(*a, **k))
        return chosen[-1]

    async def logged_step(checks, release, follows=False):
        asked.append(all(c.features for c in checks))
        return await verify(checks, release, follows)

    monkeypatch.setattr(controller, "choose", logged_choice)
    engine.engine.verifier.verify = logged_step
    engine.generate([Request(PROMPTS[0], 160, id="0", ignore_eos=True)])
    # a choice a step (sent ahead, the last step's request ends with it: the choice made for a next one sends none)
    assert len(chosen) - len(asked) == ahead
    chosen = chosen[: len(asked)]
    trees = [i for i, c in enumerate(chosen) if c.depth]
    # the looks: tree choices after a stretch of plain steps longer than the lead (the choices measured before)
    looks = [(a, t) for a, t in zip(trees, trees[1:]) if t - a > FEATURE_LEAD + 1]
    assert len(looks) >= 2, trees
    for a, t in looks:
        assert asked[a + 1 : t] == [i >= t - FEATURE_LEAD for i in range(a + 1, t)], (a, t)


@pytest.fixture(scope="module")
def plain_and_narrow_head(fixture_llm, tmp_path_factory):
    """The LLM's greedy tokens for PROMPTS, and a random head whose draft vocabulary is the tokens they hold: its
    outcomes drafted ahead then hit now and then (a head over the whole vocabulary never does)."""
    plain = Engine(fixture_llm, mode=Mode.INCREMENTAL).generate([Request(p, 24, id=str(i)) for i, p in enumerate(PROMPTS)])
    path = tmp_path_factory.mktemp("narrow")
    write_random_head(path, fixture_llm.cfg, seed=0, scale=4.0, draft_vocab=sorted({t for g in plain for t in g.token_ids}))
    return [g.token_ids for g in plain], EagleHead.from_pretrained(path, fixture_llm.cfg, fixture_llm.embed.weight), path


def test_greedy_output_drafting_ahead_with_a_head_is_the_llms_and_steps_hit(fixture_llm, plain_and_narrow_head):
    """A head drafts ahead for 16 outcomes of each tree: the LLM's tokens, and steps whose outcome it had drafted a
    tree for (before heads drafted ahead, none)."""
    plain, head, _ = plain_and_narrow_head
    engine = Engine(fixture_llm, [], Mode.TREE, [2, 1, 1], heads=[head], draft_ahead=16)
    assert [g.token_ids for g in engine.generate([Request(p, 24, id=str(i)) for i, p in enumerate(PROMPTS)])] == plain
    assert engine.engine.stats.predraft_hits > 0


def test_outcome_steps_with_a_head_give_the_llms_tokens_and_the_head_every_positions_features(
        fixture_llm, plain_and_narrow_head, monkeypatch):
    """Steps sent before the outcome of the one before, drafted ahead by a head: the LLM's tokens, and the head is
    told the LLM's features of every committed position (a gap would be fed zeros), the steps that followed an
    outcome bringing theirs."""
    plain, head, _ = plain_and_narrow_head
    gaps = []
    add = feature_drafter._Known.add

    def told(known, start, rows):
        if known.rows is not None and start > known.start + len(known.rows):
            gaps.append(start)
        add(known, start, rows)

    monkeypatch.setattr(feature_drafter._Known, "add", told)
    engine = Engine(fixture_llm, [], Mode.TREE, [2, 1, 1], heads=[head], draft_ahead=16, outcome_steps=True)
    followed, verify = [], engine.engine.verifier.verify

    async def counted(checks, release, follows=False):
        followed.append(follows)
        return await verify(checks, release, follows)

    engine.engine.verifier.verify = counted
    assert [g.token_ids for g in engine.generate([Request(p, 24, id=str(i)) for i, p in enumerate(PROMPTS)])] == plain
    assert any(followed) and engine.engine.stats.predraft_hits > 0 and not gaps


def test_an_outcome_the_head_missed_waits_for_it_after_the_answer_and_takes_the_ssms_tree_before(
        fixture_llm, head, plain_and_narrow_head):
    """SSM 0 and a head that never drafts the outcome (random, over the whole vocabulary), one stream at a time. After
    the answer, a step waits for the head's tree: no hits, but the SSM's drafted outcomes are counted (the bench's
    "either" rate). A step sent before the outcome of the one before takes an outcome the SSM drafted ahead for with
    its tree alone, so steps hit though the head missed every one (with candidates only where every drafter drafted
    ahead, none would). The tokens are the LLM's."""
    plain, _, _ = plain_and_narrow_head
    ssm = LlamaModel.from_pretrained(MODELS / "ssm-0")
    for outcome_steps in (False, True):
        engine = Engine(fixture_llm, [ssm], Mode.TREE, [2, 1, 1], heads=[head], draft_ahead=16, outcome_steps=outcome_steps)
        taken, commit = [], engine.engine._commit

        def kept(s, v, tree, sources, *rest):
            taken.append(sorted(sources))
            return commit(s, v, tree, sources, *rest)

        engine.engine._commit = kept
        assert [engine.generate([Request(p, 24, id=str(i))])[0].token_ids for i, p in enumerate(PROMPTS)] == plain
        stats = engine.engine.stats
        if outcome_steps:
            assert stats.predraft_hits > 0 and [0] in taken
        else:
            assert stats.predraft_hits == 0 and stats.predraft_partial > 0


def test_outcome_steps_through_the_services_with_a_head_give_the_llms_tokens(plain_and_narrow_head):
    """Real services, a head's speculator alone, `--draft-ahead 16 --outcome-steps`: the LLM's greedy tokens, and
    steps that took the tree the head drafted for their outcome, their features asked of the verifier."""
    from specinfer_rpc.client import generate_all
    from specinfer_rpc.launch import launch

    from .test_metrics import scrape, total

    plain, _, path = plain_and_narrow_head
    system = launch(MODELS / "llm", [], 0, port=0, heads=[path], manager_args=["--draft-ahead", "16", "--outcome-steps"])
    try:
        streams = generate_all(system.manager.address, [Request(p, 24) for p in PROMPTS], "2,1,1")
        m, v = scrape(system.manager.metrics), scrape(system.by_name("verifier").metrics)
    finally:
        system.stop()
    assert [list(s.token_ids) for s in streams] == plain
    assert total(m, "specinfer_predraft_hits_total") > 0 and total(v, "specinfer_verifier_idle_seconds_count", next="hit") > 0
