"""How much the reference disagrees with itself, as the re-scored run uses it: the floor under
its same-model probe (`noise_spread`, `probe_difference`) and its top-k boundary rule
(`at_the_edge`).

Why in `rescore` and not with the reference client (`specaudit.reference`): these are the
re-scored run's rules about what a disagreement means; the client only asks and parses. The
fidelity check measures its own floor (`specaudit.check.fidelity`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specaudit.client import Client
from specaudit.fixtures import SamplerSettings
from specaudit.reference import NextToken, ask_next_token, completion_body, incremental_answers

# Probe prompt distributions of engine and reference may differ by this much (float noise of
# batch sizes and threads; the fidelity check measures the floor properly).
PROBE_TOLERANCE = 0.02


def noise_spread(
    url: str,
    ids: Sequence[int],
    sampler: SamplerSettings,
    n_probs: int,
    timeout: float = 120.0,
    extend: int = 24,
) -> tuple[float, float]:
    """How much the reference disagrees with itself across batch shapes and slots: (largest TV
    between two answers, largest spread of a raw logprob), over `ids` and `ids` extended by
    `extend` tokens of the reference's own. Answers: the prefix in one piece, its last 1-16
    tokens as one batch on a cached prefix (`incremental_answers`), and four identical
    requests at once (batched across the reference's slots). The floor under the same-model
    probe and the top-k boundary rule."""
    from concurrent.futures import ThreadPoolExecutor

    def whole(p: Sequence[int]) -> NextToken:
        return ask_next_token(
            url, p, sampler, n_probs, raw_probs=n_probs + 20, cache_prompt=False, timeout=timeout
        )

    with Client(url, timeout=timeout) as c:
        gen = c.post(
            "/completion",
            {**completion_body(ids, sampler, 1), "n_predict": extend, "return_tokens": True},
        ).get("tokens", [])
    tv, lp = 0.0, 0.0
    for p in (list(ids), [*ids, *(int(t) for t in gen)]):
        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(whole, [p] * 4))
        answers += incremental_answers(url, p, sampler, n_probs, raw_probs=n_probs + 20)
        tv = max(tv, *(probe_difference(a.probs, b.probs) for a in answers for b in answers))
        lp = max(lp, logprob_spread(answers))
    return tv, lp


def logprob_spread(answers: Sequence[NextToken]) -> float:
    """The largest spread of one token's raw logprob across `answers` (tokens every answer
    reports); 0 for fewer than two answers."""
    if len(answers) < 2:
        return 0.0
    common = set.intersection(*(set(a.logprobs) for a in answers))
    return max(
        (max(a.logprobs[t] for a in answers) - min(a.logprobs[t] for a in answers) for t in common),
        default=0.0,
    )


def at_the_edge(token: int, answers: Sequence[NextToken], margin: float) -> bool:
    """Whether `token`, outside one answer's top-k, is inside it in another batch shape, or
    within the margin of the k-th token's raw logprob in one of them: the larger of `margin`
    and twice the spread measured among these answers (answers for one prefix)."""
    m = max(margin, 2 * logprob_spread(answers))
    for a in answers:
        if token in a.probs:
            return True
        support = [a.logprobs[t] for t in a.probs if t in a.logprobs]
        if token in a.logprobs and support and a.logprobs[token] >= min(support) - m:
            return True
    return False


def probe_difference(a: Mapping[int, float], b: Mapping[int, float]) -> float:
    """Total-variation distance between two next-token distributions (token id -> prob)."""
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


__all__ = [
    "PROBE_TOLERANCE",
    "at_the_edge",
    "logprob_spread",
    "noise_spread",
    "probe_difference",
]
