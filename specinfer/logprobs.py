"""Log-probabilities of tokens under the LLM's own distribution: the log-softmax of its logits at the
token's position, before temperature, top-k, top-p and min-p (what a caller asks when scoring text, and what
OpenAI's API and vLLM return by default).

They are read from the verifier's logits of the rows a step keeps: the root's row (the distribution
of the step's first token) and the accepted nodes' rows, so speculation changes them only by the
rounding of a tree step against an incremental one (float32: within 1e-4). Only those rows are
computed, on the device, and what crosses to the host is O(tokens x top), never the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP = 20  # most alternatives a token's entry lists (OpenAI's limit)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the most likely tokens there, best first


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """Entry i: the logprob of tokens[i] in logits row rows[i] [R, V], with its tops[i] most likely
    tokens. One copy to the host."""
    import torch  # on the verifier; the manager and the gateway take MAX_TOP and TokenLogprob without torch

    if not rows:
        return []
    dev = logits.device
    at = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
    ids = torch.tensor(tokens, dtype=torch.long).to(dev, non_blocking=True)
    lp = logits[at].float().log_softmax(-1)  # [n, V]
    k = max(tops)
    chosen = lp.gather(1, ids[:, None])[:, 0]
    best = lp.topk(k, dim=-1) if k else None
    parts = [chosen] + ([best.values.flatten(), best.indices.flatten().float()] if k else [])
    host = torch.cat(parts).cpu().tolist()  # token ids < 2^24 are exact in float32
    n = len(rows)
    out = []
    for i in range(n):
        top = [(int(host[n + n * k + i * k + j]), host[n + i * k + j]) for j in range(tops[i])] if k else []
        out.append(TokenLogprob(tokens[i], host[i], top))
    return out
