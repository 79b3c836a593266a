"""Grammar engines for structured output (JSON mode, JSON Schema): xgrammar against llguidance.

For each engine, on one CPU thread, per schema of `bench/json_schemas.jsonl` and for plain JSON-object
mode (`{"type": "object"}`, walked over one object holding every example):

- compile: the first compile of the schema (xgrammar with its cache off; llguidance: building the
  grammar and its matcher), after one warm-up compile; the tokenizer info is built once, timed apart;
  and the first mask of a new matcher (llguidance builds its lexer lazily, so it pays there);
- per token, walking the tokens of `json.dumps(example)`: computing the allowed-token bitmask
  (torch.int32, ceil(vocab / 32) words) for the current state, finding the forced (jump-forward)
  continuation, advancing by the token and rolling that token back; the mean per token of each walk,
  median over the repeated walks;
- a tree check: from each state of the walk, k candidate tokens one token deep (advance + rollback);
  the candidates are the example's token and k - 1 others allowed by both engines (seeded);
- correctness: both engines walk the example in lockstep: does each allow every token, do their
  masks agree, does the final state accept (EOS allowed, then terminated); rolling back the whole
  walk gives the initial mask again;
- JSON Schema keyword coverage (a valid instance accepted, invalid ones rejected, or a compile
  error), the errors for uncompilable schemas, what a disallowed token does to a matcher, applying
  the bitmask to a logits row, and the install footprint.

    python -m specinfer_bench.grammar_engines --tokenizer /tmp/smol_tok --out bench/results/grammar_engines_cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib.metadata import distribution
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from .report import command_line, machine

JSON_OBJECT = {"type": "object"}
DATE = "^\\d{4}-\\d{2}-\\d{2}$"
METRICS = ("mask", "forced", "advance", "rollback", "tree")
# (keyword, schema, a valid instance, invalid instances)
FEATURES = [
    ("pattern", {"type": "string", "pattern": DATE}, "2024-01-02", ["2024-1-02", "x"]),
    ("pattern unanchored (a search, per the spec)", {"type": "string", "pattern": "ab"}, "xaby", ["xy"]),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", ["a", "abcde"]),
    ("escapes in a string with minLength/maxLength", {"type": "string", "minLength": 1, "maxLength": 20},
     'say "hi"\n', [""]),
    ("escapes in a string with pattern", {"type": "string", "pattern": "^[^x]+$"}, 'say "hi"', ["x"]),
    ("\\u escape of a printable character, llguidance's default options",
     {"type": "string", "x-guidance": {"json_allow_general_unicode_escapes": False}}, "café", [1]),
    ("format: date", {"type": "string", "format": "date"}, "2024-01-02", ["hello"]),
    ("format: email", {"type": "string", "format": "email"}, "a@b.org", ["hello"]),
    ("enum", {"enum": ["red", "green"]}, "green", ["blue"]),
    ("const", {"const": "x"}, "x", ["y"]),
    ("integer minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 10}, 7, [0, 11, 1.5]),
    ("number minimum/maximum", {"type": "number", "minimum": 0, "maximum": 1}, 0.5, [1.5, -2]),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 0}, 1, [0]),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, 6, [7]),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 2],
     [[1], [1, 2, 3, 4]]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [[1, 1]]),
    ("required + additionalProperties: false",
     {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"],
      "additionalProperties": False}, {"a": 1}, [{}, {"a": 1, "c": 2}]),
    ("anyOf / nullable", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None, ["x"]),
    ("$ref / $defs", {"$defs": {"p": {"type": "integer", "maximum": 5}}, "type": "array", "items": {"$ref": "#/$defs/p"}},
     [1, 5], [[6]]),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}, "additionalProperties": False},
     {"x_a": 1}, [{"y": 1}]),
    ("not", {"not": {"type": "string"}}, 1, ["x"]),
]
BAD_SCHEMAS = {
    "pattern '(unclosed'": {"type": "string", "pattern": "(unclosed"},
    "unsupported keyword uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "unsupported keyword dependentRequired": {"type": "object", "properties": {"a": {"type": "integer"}},
                                              "dependentRequired": {"a": ["b"]}},
    "lookahead pattern": {"type": "string", "pattern": "^(?=a)a+$"},
    "unknown type": {"type": "strin"},
}


class XGrammar:
    """xgrammar: TokenizerInfo -> GrammarCompiler.compile_json_schema -> GrammarMatcher."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import xgrammar as xgr
        self.xgr = xgr
        self.info_s, self.info = seconds(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, schema):
        return self.compiler.compile_json_schema(schema, any_whitespace=True, strict_mode=True)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    @staticmethod
    def fill(m, bitmask):
        m.fill_next_token_bitmask(bitmask)

    @staticmethod
    def forced(m):
        return m.find_jump_forward_string()

    @staticmethod
    def advance(m, token):
        return m.accept_token(token)

    @staticmethod
    def rollback(m, n):
        m.rollback(n)

    @staticmethod
    def accepting(m):
        return m.is_completed()

    @staticmethod
    def terminated(m):
        return m.is_terminated()

    def accepts(self, grammar, ids):
        m = self.matcher(grammar)
        return all(m.accept_token(t) for t in ids) and m.is_completed()

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    """llguidance: llguidance.hf.from_tokenizer -> LLMatcher(grammar_from_json_schema); its matchers never
    raise on grammar errors, so compile checks is_error() and raises with get_error()."""

    name = "llguidance"
    # without json_allow_general_unicode_escapes it rejects json.dumps' "\\u00e9" (ensure_ascii) for "é"
    options = {"whitespace_flexible": True, "json_allow_general_unicode_escapes": True}

    def __init__(self, tokenizer, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.llg_torch = llguidance, llguidance.torch
        self.info_s, self.info = seconds(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)
        m = self.llg.LLMatcher(self.info, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    @staticmethod
    def matcher(grammar):
        return grammar.deep_copy()

    def fill(self, m, bitmask):
        self.llg_torch.fill_next_token_bitmask(m, bitmask)

    @staticmethod
    def forced(m):
        return m.compute_ff_tokens()

    @staticmethod
    def advance(m, token):
        return m.consume_token(token)

    @staticmethod
    def rollback(m, n):
        m.rollback(n)

    @staticmethod
    def accepting(m):
        return m.is_accepting()

    @staticmethod
    def terminated(m):
        return m.is_stopped()

    def accepts(self, grammar, ids):
        m = self.matcher(grammar)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    def apply(self, logits, bitmask):
        self.llg_torch.apply_token_bitmask_inplace(logits, bitmask)


def allowed_set(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)


def seconds(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def lockstep(engines, grammars, ids, eos, vocab, k, rng) -> tuple[dict, list[list[int]]]:
    """Walk both engines over ids together: per engine, the first disallowed token and whether the end
    accepts; where their masks differ; and the tree-check candidates of each state both reach."""
    matchers = [e.matcher(g) for e, g in zip(engines, grammars)]
    masks = [torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32) for _ in engines]
    out = {e.name: {"rejected_at": None} for e in engines}
    differ, only, candidates = 0, [set(), set()], []
    for i, tok in enumerate(ids):
        alive = [out[e.name]["rejected_at"] is None for e in engines]
        sets = []
        for e, m, bm, live in zip(engines, matchers, masks, alive):
            sets.append(None)
            if live:
                e.fill(m, bm)
                sets[-1] = allowed_set(bm, vocab)
                if sets[-1][tok]:
                    e.advance(m, tok)
                else:
                    out[e.name]["rejected_at"] = i
        if not all(alive):
            continue
        if not (sets[0] == sets[1]).all():
            differ += 1
            only[0].update(np.flatnonzero(sets[0] & ~sets[1]).tolist())
            only[1].update(np.flatnonzero(sets[1] & ~sets[0]).tolist())
        if sets[0][tok] and sets[1][tok]:
            others = np.flatnonzero(sets[0] & sets[1] & (np.arange(vocab) != tok)).tolist()
            candidates.append([tok] + rng.sample(others, min(k - 1, len(others))))
    for e, m, bm in zip(engines, matchers, masks):
        if out[e.name]["rejected_at"] is None:
            e.fill(m, bm)
            eos_ok, acc = bool(allowed_set(bm, vocab)[eos]), e.accepting(m)
            out[e.name]["end_accepts"] = eos_ok and acc and e.advance(m, eos) and e.terminated(m)
    return {"engines": out, "steps_masks_differ": differ,
            "only_allowed_by": {e.name: sorted(o) for e, o in zip(engines, only)}}, candidates


def walk(engine, grammar, ids, candidates, vocab) -> dict:
    """One timed walk: µs per step of each metric, rolling back the whole walk, forced-output steps."""
    bm = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    m = engine.matcher(grammar)
    engine.fill(m, bm)
    first = bm.clone()
    times = {k: [] for k in METRICS}
    forced_steps = 0
    clock = time.perf_counter_ns
    for tok, cands in zip(ids, candidates):
        t0 = clock()
        engine.fill(m, bm)
        t1 = clock()
        for c in cands:
            engine.advance(m, c)
            engine.rollback(m, 1)
        t2 = clock()
        forced_steps += bool(engine.forced(m))
        t3 = clock()
        engine.advance(m, tok)
        t4 = clock()
        engine.rollback(m, 1)
        t5 = clock()
        engine.advance(m, tok)
        for key, dt in zip(("mask", "tree", "forced", "advance", "rollback"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            times[key].append(dt / 1e3)
    t0 = clock()
    engine.rollback(m, len(candidates))
    times["rollback_all"] = (clock() - t0) / 1e3
    engine.fill(m, bm)
    return {"times": times, "rollback_all_ok": torch.equal(bm, first), "forced_steps": forced_steps}


def prepare(engine, schema, vocab) -> tuple[object, dict]:
    """The compiled grammar, with the times of compiling it, of a new matcher and of that matcher's first mask."""
    compile_s, grammar = seconds(lambda: engine.compile(schema))
    new_s, m = seconds(lambda: engine.matcher(grammar))
    first_mask_s, _ = seconds(lambda: engine.fill(m, torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)))
    return grammar, {"compile_ms": 1e3 * compile_s, "new_matcher_us": 1e6 * new_s, "first_mask_ms": 1e3 * first_mask_s}


def bench_walks(engine, grammar, ids, candidates, vocab, repeats) -> dict:
    walks = [walk(engine, grammar, ids, candidates, vocab) for _ in range(repeats)]
    row = {"steps": len(candidates), "candidates_per_step": statistics.mean(map(len, candidates)) if candidates else 0,
           "forced_steps": walks[0]["forced_steps"], "rollback_all_ok": all(w["rollback_all_ok"] for w in walks),
           "rollback_all_us": statistics.median(w["times"]["rollback_all"] for w in walks),
           "mask_steps_us": [t for w in walks for t in w["times"]["mask"]]}
    for key in METRICS:
        row[f"{key}_us"] = statistics.median(statistics.mean(w["times"][key]) for w in walks) if candidates else None
    return row


def features(engine, tokenizer) -> dict:
    encode = lambda v: tokenizer.encode(json.dumps(v), add_special_tokens=False)
    out = {}
    for name, schema, good, bads in FEATURES:
        try:
            grammar = engine.compile(schema)
        except Exception as e:  # each engine has its own error type; the message is the finding
            out[name] = f"compile error: {first_line(e)}"
            continue
        if not engine.accepts(grammar, encode(good)):
            out[name] = "rejects a valid instance"
        else:
            out[name] = "enforced" if not any(engine.accepts(grammar, encode(b)) for b in bads) else "ignored"
    return out


def bad_schemas(engine) -> dict:
    out = {}
    for name, schema in BAD_SCHEMAS.items():
        try:
            engine.compile(schema)
            out[name] = "compiles, no error"
        except Exception as e:  # see features()
            out[name] = f"{type(e).__name__}: {first_line(e)}"
    return out


def split_special(tokenizer, ids: list[int]) -> list[tuple[str, list[str]]]:
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return [("special tokens", [tokenizer.decode([t]) for t in ids if t in special]),
            ("others", [tokenizer.decode([t]) for t in ids if t not in special])]


def first_line(e: Exception) -> str:
    return " ".join(str(e).split("\n")[:3]).strip()


def disallowed_token(engine, tokenizer) -> dict:
    """Advance by a token the grammar does not allow, then by one it does."""
    m = engine.matcher(engine.compile(JSON_OBJECT))
    bad, good = (tokenizer.encode(s, add_special_tokens=False)[0] for s in ("x", "{"))
    return {"returns": engine.advance(m, bad), "usable_after": engine.advance(m, good)}


def apply_timing(engine, vocab, repeats=200) -> dict:
    bm = torch.randint(-2**31, 2**31 - 1, (1, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(1, vocab)
    first_s, _ = seconds(lambda: engine.apply(logits.clone(), bm))
    row = logits.clone()
    times = []
    for _ in range(repeats):
        t, _ = seconds(lambda: engine.apply(row, bm))
        times.append(1e6 * t)
    return {"first_call_ms": 1e3 * first_s, "median_us": statistics.median(times)}


def footprint(wheels: Path | None) -> dict:
    out = {}
    for dist_name in ("xgrammar", "llguidance", "apache-tvm-ffi"):
        d = distribution(dist_name)
        reqs = [r for r in d.requires or [] if "extra ==" not in r]
        size = sum((f.locate().stat().st_size for f in d.files or [] if f.locate().exists()))
        whl = sorted(wheels.glob(f"{dist_name.replace('-', '_')}-*.whl")) if wheels else []
        out[dist_name] = {"version": d.version, "requires": reqs, "installed_mb": size / 2**20,
                          "wheel_mb": whl[0].stat().st_size / 2**20 if whl else None}
    return out


def summarize(rows: list[dict]) -> dict:
    compiles = [r["compile_ms"] for r in rows]
    med = lambda key: statistics.median(r[key] for r in rows)
    steps = sorted(t for r in rows for t in r["mask_steps_us"])
    return {"compile_ms_min": min(compiles), "compile_ms_median": statistics.median(compiles), "compile_ms_max": max(compiles),
            "first_mask_ms": med("first_mask_ms"), "new_matcher_us": med("new_matcher_us"),
            **{f"{k}_us": med(f"{k}_us") for k in METRICS}, "rollback_all_us": med("rollback_all_us"),
            "mask_p99_us": steps[int(0.99 * (len(steps) - 1))], "mask_max_us": steps[-1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer directory (AutoTokenizer)")
    ap.add_argument("--schemas", type=Path, default=Path("bench/json_schemas.jsonl"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/grammar_engines_cpu"), help="writes OUT.json and OUT.md")
    ap.add_argument("--repeats", type=int, default=5, help="timed walks per schema and engine (median)")
    ap.add_argument("--k", type=int, default=8, help="candidate tokens per tree check")
    ap.add_argument("--wheels", type=Path, help="a `pip download --no-deps` folder, for the wheel sizes")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    entries = [json.loads(line) for line in args.schemas.read_text().splitlines() if line.strip()]
    entries.append({"name": "json_object (all examples in one object)", "schema": JSON_OBJECT,
                    "example": {e["name"]: e["example"] for e in entries}})
    engines = [XGrammar(tokenizer, vocab), LLGuidance(tokenizer, vocab)]
    for engine in engines:
        engine.compile({"type": "object", "properties": {"warm": {"type": "integer"}}})
    rng = random.Random(0)
    rows, checks = {e.name: [] for e in engines}, []
    for entry in tqdm(entries, desc="schemas"):
        ids = tokenizer.encode(json.dumps(entry["example"]), add_special_tokens=False)
        prepared = [prepare(e, entry["schema"], vocab) for e in engines]
        check, candidates = lockstep(engines, [g for g, _ in prepared], ids, eos, vocab, args.k, rng)
        checks.append({"name": entry["name"], "tokens": len(ids), **check})
        for e, (grammar, times) in zip(engines, prepared):
            rows[e.name].append({"name": entry["name"], **times,
                                 **bench_walks(e, grammar, ids, candidates, vocab, args.repeats)})
    summary = {name: summarize(r[:-1]) for name, r in rows.items()}  # the schemas, without JSON-object mode
    for r in rows.values():
        for row in r:
            del row["mask_steps_us"]
    result = {
        "meta": {"command": command_line("python -m specinfer_bench.grammar_engines", argv), "machine": machine(),
                 "tokenizer": str(args.tokenizer), "vocab": vocab, "repeats": args.repeats, "k": args.k,
                 "tokenizer_info_ms": {e.name: 1e3 * e.info_s for e in engines}},
        "footprint": footprint(args.wheels), "summary": summary, "rows": rows, "checks": checks,
        "features": {e.name: features(e, tokenizer) for e in engines},
        "bad_schemas": {e.name: bad_schemas(e) for e in engines},
        "disallowed_token": {e.name: disallowed_token(e, tokenizer) for e in engines},
        "apply_mask": {e.name: apply_timing(e, vocab) for e in engines}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    args.out.with_suffix(".md").write_text(markdown(result, tokenizer))
    print(args.out.with_suffix(".md").read_text())
    return 0


def markdown(res: dict, tokenizer) -> str:
    meta, fp, names = res["meta"], res["footprint"], list(res["summary"])
    n = len(res["checks"]) - 1
    lines = [f"`{meta['command']}` on {meta['machine']}", "",
             "Versions: " + ", ".join(f"{k} {v['version']}" for k, v in fp.items()) +
             f". Vocabulary {meta['vocab']} (int32 bitmask of {(meta['vocab'] + 31) // 32} words); one thread "
             "(torch.set_num_threads(1), xgrammar GrammarCompiler(max_threads=1); llguidance has no thread option "
             "outside its batch LLExecutor). xgrammar `compile_json_schema(schema, any_whitespace=True, strict_mode=True)`, "
             f"llguidance `grammar_from_json_schema(schema, defaults={LLGuidance.options})`. "
             f"{meta['repeats']} timed walks per schema, median. Tokenizer info built "
             "once: " + ", ".join(f"{k} {v:.0f} ms" for k, v in meta["tokenizer_info_ms"].items()) + ".", "",
             f"## Medians over the {n} schemas", "",
             "| engine | compile ms min / median / max | first mask ms | new matcher µs | mask µs/token | mask p99 / max µs "
             f"| forced µs | advance µs/token | rollback(1) µs | rollback(all) µs | tree check µs (k={meta['k']}) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in res["summary"].items():
        lines.append(f"| {name} | {s['compile_ms_min']:.2f} / {s['compile_ms_median']:.2f} / {s['compile_ms_max']:.2f} | "
                     f"{s['first_mask_ms']:.3f} | {s['new_matcher_us']:.1f} | {s['mask_us']:.1f} | "
                     f"{s['mask_p99_us']:.0f} / {s['mask_max_us']:.0f} | {s['forced_us']:.1f} | {s['advance_us']:.1f} | "
                     f"{s['rollback_us']:.1f} | {s['rollback_all_us']:.1f} | {s['tree_us']:.1f} |")
    lines += ["", "compile: the first compile of each schema (xgrammar: `compile_json_schema`, cache off; llguidance: "
              "`grammar_from_json_schema` + `LLMatcher`, whose lexer is built lazily, hence the first mask column). new "
              "matcher: `GrammarMatcher(compiled)` / `template.deep_copy()`. mask: filling the bitmask (xgrammar "
              "`fill_next_token_bitmask`, llguidance `llguidance.torch.fill_next_token_bitmask`); p99 / max over every "
              "step of every walk. forced: `find_jump_forward_string` / `compute_ff_tokens`. rollback(all): the whole "
              "walk at once. tree check: k candidates, each advance + rollback(1), without their masks. Where an engine rejects "
              "a token of the example, both engines' timed walks stop before it.", "",
              "## Per schema (xgrammar / llguidance)", "",
              "| schema | tokens | compile ms | first mask ms | mask µs | advance µs | rollback µs | tree µs | "
              "forced steps | masks differ at | end accepts |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    pair = lambda rows, key, f: " / ".join(format(r[key], f) if r[key] is not None else "-" for r in rows)
    for i, check in enumerate(res["checks"]):
        rows = [res["rows"][name][i] for name in names]
        ends = " / ".join("yes" if c.get("end_accepts") else f"no (rejected token {c['rejected_at']})"
                          if c["rejected_at"] is not None else "no" for c in check["engines"].values())
        lines.append(f"| {check['name']} | {check['tokens']} | {pair(rows, 'compile_ms', '.2f')} | "
                     f"{pair(rows, 'first_mask_ms', '.3f')} | {pair(rows, 'mask_us', '.1f')} | {pair(rows, 'advance_us', '.1f')} | "
                     f"{pair(rows, 'rollback_us', '.1f')} | {pair(rows, 'tree_us', '.1f')} | {pair(rows, 'forced_steps', 'd')} | "
                     f"{check['steps_masks_differ']} steps | {ends} |")
    only = {e: sorted({t for c in res["checks"] for t in c["only_allowed_by"][e]}) for e in names}
    all_ok = all(c["engines"][e].get("end_accepts") for c in res["checks"] for e in names)
    rb_ok = {name: all(r["rollback_all_ok"] for r in res["rows"][name]) for name in names}
    lines += ["", "## Correctness", "",
              f"- Every example's tokens allowed and the end accepted (EOS allowed, then terminated) by both engines: "
              f"{'yes' if all_ok else 'NO, see the table'}.",
              f"- Masks differ at {sum(c['steps_masks_differ'] for c in res['checks'])} of "
              f"{sum(c['tokens'] for c in res['checks'])} states. " + " ".join(
                  f"Allowed by {e} alone somewhere: {len(ts)} distinct tokens" + "".join(
                      f"; {len(part)} {kind}" + (f" (e.g. {', '.join(repr(t) for t in part[:12])})" if part else "")
                      for kind, part in split_special(tokenizer, ts) if ts) + "." for e, ts in only.items()),
              "- Rolling the whole walk back gives the initial mask again: " +
              ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in rb_ok.items()) + ".",
              "- Advancing by a disallowed token: " + "; ".join(
                  f"{k} returns {v['returns']}, the matcher {'stays usable' if v['usable_after'] else 'is dead (error state)'}"
                  for k, v in res["disallowed_token"].items()) + ".", "",
              "## What speculative decoding needs", "",
              "- Rollback of several tokens: xgrammar `GrammarMatcher.rollback(n)` (history unlimited), llguidance "
              "`LLMatcher.rollback(n)`; the rollback(all) column above rolls back a whole walk.",
              "- Forced tokens: xgrammar `GrammarMatcher.find_jump_forward_string()` (a string, to be tokenized), llguidance "
              "`LLMatcher.compute_ff_tokens()` (token ids; `compute_ff_bytes()` for the bytes). States with forced output "
              "over all walks: " + ", ".join(f"{e} {sum(r['forced_steps'] for r in res['rows'][e])}" for e in names) + ".",
              "- Masks for a whole draft tree in one call: xgrammar `GrammarMatcher.traverse_draft_tree(retrieve_next_token, "
              "retrieve_next_sibling, draft_tokens, bitmask)`; llguidance only a chain per matcher "
              "(`llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(LLExecutor, [(matcher, row, drafts)], bitmask)`).",
              "", "## JSON Schema keywords", "", "| keyword | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    lines += [f"| {kw} | " + " | ".join(res["features"][e][kw] for e in names) + " |" for kw in res["features"][names[0]]]
    lines += ["", "## Uncompilable schemas", "", "| schema | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    lines += [f"| {s} | " + " | ".join(res["bad_schemas"][e][s].replace("|", "\\|") for e in names) + " |"
              for s in res["bad_schemas"][names[0]]]
    lines += ["", "## Applying the mask to a [1, V] float32 logits row on the CPU", "",
              "| helper | first call ms | µs per call |", "| --- | --- | --- |",
              "| xgrammar `xgr.apply_token_bitmask_inplace(logits, bitmask)` (C++ CPU kernel) | "
              f"{res['apply_mask']['xgrammar']['first_call_ms']:.1f} | {res['apply_mask']['xgrammar']['median_us']:.0f} |",
              "| llguidance `llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)` (torch.compile) | "
              f"{res['apply_mask']['llguidance']['first_call_ms']:.0f} | {res['apply_mask']['llguidance']['median_us']:.0f} |",
              "", "## Install footprint", "", "| package | wheel MB | installed MB | requires (no extras) |", "| --- | --- | --- | --- |"]
    lines += [f"| {k} {v['version']} | {'-' if v['wheel_mb'] is None else format(v['wheel_mb'], '.1f')} | "
              f"{v['installed_mb']:.1f} | {', '.join(v['requires']) or 'nothing'} |" for k, v in fp.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
