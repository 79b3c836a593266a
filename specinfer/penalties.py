"""The sampling parameters that depend on what a request has said so far: presence, frequency and
repetition penalties, a logit bias, and a least number of tokens before the request may end; and
the set of tokens a request may generate at all. They
define the distribution a client asks for; the verifier adjusts each row's logits with them before
it decides (greedy argmax, the coupled sample or MSS then see the adjusted distribution), so the
output is exactly plain decoding with the same parameters, whatever was drafted.

A tree row's adjustment uses the counts of *its own path*: the row after node u sees the record
plus the tokens from the root's child down to u, exactly what plain decoding would have said
before predicting that position. Row 0 (after the root) sees the record alone.

For each row, in vLLM's order (its V1 sampler):
    0. allowed_token_ids:  when given, every other token gets -inf
    1. min_tokens:  while fewer than min_tokens tokens are generated, the tokens that would end the
                    request (its stop tokens, the model's EOS unless ignored) get -inf, unless
                    nothing else is left (a grammar that allows only the end wins)
    2. logit_bias:  logit[v] += bias[v]
    3. repetition:  for v in the prompt or the output, logit[v] /= r if logit[v] > 0 else *= r
                    (HF's and vLLM's repetition_penalty)
    4. frequency, presence:  logit[v] -= frequency * count[v] + presence * (count[v] > 0), count
                    over the generated tokens only (OpenAI's definition)
"""

from __future__ import annotations

import torch

from .devices import to_device
from .sampling import SamplingParams
from .tree import TokenTree, depths


def adjust_logits(logits: torch.Tensor, roots: list[int], trees: list[TokenTree], records: list[list[int]],
                  output_starts: list[int], sampling: list[SamplingParams], stop_ids: list[list[int]]) -> None:
    """Adjust in place the rows of logits [R, V] of the requests whose sampling asks for any of the
    above: request i's rows are roots[i] (after its record) and roots[i] + 1 + u (after tree node u);
    records[i] is its token record (prompt and output), output_starts[i] where its output begins,
    stop_ids[i] the tokens min_tokens holds back. A few tensor ops over the adjusted rows, whatever
    the batch."""
    asked = [i for i, s in enumerate(sampling) if s.adjusts_logits]
    if not asked:
        return
    dev, vocab = logits.device, logits.shape[1]
    rows, owner, path_rows, path_tokens, generated = [], [], [], [], []
    for k, i in enumerate(asked):
        tree, record = trees[i], records[i]
        n = 1 + len(tree)
        at = len(rows)
        rows += range(roots[i], roots[i] + n)
        owner += [k] * n
        for u, path in enumerate(tree.paths()):  # the row after node u counts u's path
            path_rows += [at + 1 + u] * len(path)
            path_tokens += path
        done = len(record) - output_starts[i]
        generated += [done, *(done + d for d in depths(tree.parents))]
    owner_t = to_device(torch.tensor(owner), dev)
    # per request over the vocabulary: generated-token counts and prompt-or-output presence
    base_ids = [(k, t) for k, i in enumerate(asked) for t in records[i][output_starts[i]:]]
    seen_ids = [(k, t) for k, i in enumerate(asked) for t in records[i]]
    counts = _counts(len(asked), vocab, base_ids, dev)[owner_t]  # [n_rows, V]
    seen = _counts(len(asked), vocab, seen_ids, dev)[owner_t]
    along = _counts(len(rows), vocab, list(zip(path_rows, path_tokens)), dev)  # each row's path
    counts += along
    seen += along
    at = to_device(torch.tensor(rows), dev)
    x = logits[at].float()  # [n_rows, V]

    allowed = [(k, t) for k, i in enumerate(asked) for t in sampling[i].allowed_token_ids]
    if allowed:
        limited = to_device(torch.tensor([bool(sampling[i].allowed_token_ids) for i in asked]), dev)[owner_t]
        barred = limited[:, None] & (_counts(len(asked), vocab, allowed, dev)[owner_t] == 0)
        x = x.masked_fill(barred, float("-inf"))

    held = [(r, t) for r, k in enumerate(owner) if generated[r] < sampling[asked[k]].min_tokens
            for t in stop_ids[asked[k]]]
    if held:
        hold = _counts(len(rows), vocab, held, dev) > 0
        free = (x.isfinite() & ~hold).any(dim=1, keepdim=True)  # something else is left to take
        x = x.masked_fill(hold & free, float("-inf"))
    bias = [(k, t, b) for k, i in enumerate(asked) for t, b in sampling[i].logit_bias]
    if bias:
        table = torch.zeros(len(asked), vocab, device=dev)
        k, t, b = zip(*bias)
        table[to_device(torch.tensor(k), dev), to_device(torch.tensor(t), dev)] = to_device(torch.tensor(b), dev)
        x += table[owner_t]
    per_row = to_device(torch.tensor([[sampling[asked[k]].repetition_penalty, sampling[asked[k]].frequency_penalty,
                                       sampling[asked[k]].presence_penalty] for k in owner]), dev)
    r, f, p = per_row[:, 0:1], per_row[:, 1:2], per_row[:, 2:3]
    x = torch.where(seen > 0, torch.where(x > 0, x / r, x * r), x)
    x -= f * counts + p * (counts > 0)
    logits[at] = x.to(logits.dtype)


def _counts(n: int, vocab: int, pairs: list[tuple[int, int]], dev: torch.device) -> torch.Tensor:
    """[n, V] float32: how often each (row, token) pair occurs."""
    out = torch.zeros(n, vocab, device=dev)
    if pairs:
        at = to_device(torch.tensor(pairs), dev)
        out.index_put_((at[:, 0], at[:, 1]), torch.ones(len(pairs), device=dev), accumulate=True)
    return out
