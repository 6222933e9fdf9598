"""Per-token draft flags: what the engine says happened at each speculated position (the
draft's proposal d there, and the rule that verified it), tested against what that rule must
do.

Why: the marginal tests see a verification bug only through its effect on p's marginals,
diluted by every token the bug does not touch (a rejection-only bug acts on the fifth of
Gemma's drafts that are rejected). Where the engine flags its tokens (specaudit's
spec-logprobs build of llama-server: ``draft_id`` and ``verified_by`` on each token of the
speculative loop), every flagged position is a direct trial of the verification rule:

- **acceptance**: x = d with probability min(1, p(d)/q(d)) under rejection sampling, p(d)
  under sample-and-match: the count of acceptances against its Poisson-binomial law;
- **residual**: after a rejection, x is drawn from norm(max(0, p - q)) (rejection) or from p
  without d (match): randomised PIT values under that residual, KS against U(0,1).

Only what the flags identify: the law of acceptance *given the proposal d*, never p(d) (a
sampled draft proposes d with probability q(d)); and only where the rule's inputs are known:
q for rejection sampling (the draft's distribution at the prefix: `--draft-url`, a fixture's
closed form), p alone for matching. A token after a fully accepted draft (``draft_id`` -1) is
a plain draw from p, left to the marginal tests. The reference's measured noise
(`ratio_bound`, the largest engine/reference probability ratio a correct engine shows)
widens the acceptance law into an interval and the test takes its conservative end; a
residual with less than `MIN_RESIDUAL_MASS` is left out (there it is noise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from specaudit.rescore.pit import poisson_binomial_pmf
from specaudit.rescore.records import TokenDraw
from specaudit.rescore.scores import ScoreTest
from specaudit.stats import TINY_P

ACCEPTANCE = "draft acceptance (flags)"
RESIDUAL = "residual after a rejection (flags)"
RULES = ("rejection", "match")  # what the flags can name that these tests know the law of
MIN_RESIDUAL_MASS = 0.05
OUTSIDE_MARGIN = 1e-3  # relative: p(x) this far below q(x) is not float rounding


@dataclass(frozen=True)
class DraftFlag:
    """One token's flag: the draft's proposal at its position (None: none, the token after a
    fully accepted draft) and the rule that verified it."""

    draft: int | None
    rule: str


def _prob(probs: Mapping[int, float], t: int) -> float:
    total = sum(probs.values())
    return probs.get(t, 0.0) / total if total > 0 else 0.0


def _acceptance_law(d: TokenDraw, ratio_bound: float) -> tuple[float, float] | None:
    """(lowest, highest) acceptance probability of `d`'s proposal that a correct engine can
    have, given the reference's noise; None where the rule's inputs are unknown."""
    assert d.draft_token is not None
    p = _prob(d.ref.probs, d.draft_token)
    if d.verified_by == "match":
        return max(0.0, min(1.0, p / ratio_bound)), min(1.0, p * ratio_bound)
    if d.verified_by != "rejection" or d.draft is None:
        return None
    q = _prob(d.draft.probs, d.draft_token)
    if q <= 0:
        return None  # a proposal the draft gives no mass: the flags contradict q; not ours
    r = p / q
    lo, hi = r / (ratio_bound * ratio_bound), r * ratio_bound * ratio_bound
    return min(1.0, lo), min(1.0, hi)


def acceptance_test(draws: Sequence[TokenDraw], *, ratio_bound: float = 1.0) -> ScoreTest | None:
    """The count of flagged proposals accepted against its Poisson-binomial law, two-sided:
    P(S <= k) under the lowest acceptance probabilities and P(S >= k) under the highest (the
    conservative ends of the noise interval), the smaller doubled. None: no flagged proposal
    is testable."""
    hits: list[bool] = []
    lo: list[float] = []
    hi: list[float] = []
    for d in draws:
        if d.draft_token is None or d.verified_by not in RULES:
            continue
        law = _acceptance_law(d, ratio_bound)
        if law is None:
            continue
        hits.append(d.token == d.draft_token)
        lo.append(law[0])
        hi.append(law[1])
    if not hits:
        return None
    k, n = sum(hits), len(hits)
    # the conservative end of the noise interval for each tail: a count this low is likeliest
    # under the lowest acceptance probabilities, one this high under the highest
    below = float(poisson_binomial_pmf(np.array(lo))[: k + 1].sum())
    above = float(poisson_binomial_pmf(np.array(hi))[k:].sum())
    p = min(1.0, max(2 * min(below, above), TINY_P))
    mid = (np.array(lo) + np.array(hi)) / 2
    mean, var = float(mid.sum()), float((mid * (1 - mid)).sum())
    z = (k - mean) / math.sqrt(var) if var > 0 else 0.0
    detail = (
        f"{k} of {n} flagged proposals accepted where the verification rule expects "
        f"{mean:.1f} (z = {z:+.3g})"
    )
    return ScoreTest(ACCEPTANCE, z, p, detail)


def _residual(d: TokenDraw) -> dict[int, float] | None:
    """The residual law `d`'s token was drawn from after its proposal was rejected (None:
    unknown, or too small to tell from the reference's noise)."""
    assert d.draft_token is not None
    total = sum(d.ref.probs.values())
    p = {t: v / total for t, v in d.ref.probs.items()} if total > 0 else {}
    if d.verified_by == "match":
        res = {t: v for t, v in p.items() if t != d.draft_token}
    elif d.verified_by == "rejection" and d.draft is not None:
        qt = sum(d.draft.probs.values())
        res = {t: v - d.draft.probs.get(t, 0.0) / qt for t, v in p.items()}
        res = {t: v for t, v in res.items() if v > 0}
    else:
        return None
    mass = sum(res.values())
    if mass < MIN_RESIDUAL_MASS:
        return None
    return {t: v / mass for t, v in res.items()}


def _impossible(d: TokenDraw, ratio_bound: float) -> bool:
    """Whether a rejected position's token is one the residual cannot give even within the
    reference's noise: rejection sampling's residual has no mass where p <= q, so a token
    with p(x) clearly below q(x) (`OUTSIDE_MARGIN`, after the noise) is a draw from something
    else (the target itself, after a rejection: the `residual-target` bug)."""
    if d.verified_by != "rejection" or d.draft is None:
        return False
    p = _prob(d.ref.probs, d.token) * ratio_bound * ratio_bound
    return p < _prob(d.draft.probs, d.token) * (1 - OUTSIDE_MARGIN)


def residual_test(
    draws: Sequence[TokenDraw], *, ratio_bound: float = 1.0, seed: int = 0
) -> ScoreTest | None:
    """KS of the randomised PIT values of rejected positions' tokens under their residual
    laws (tokens in id order). A token the residual cannot give even within the reference's
    noise (`_impossible`) has probability 0 under a correct engine: one is enough (p =
    TINY_P); a token just outside the residual's support (within the noise) is left out and
    counted. None: no rejected flagged position is testable."""
    rng = np.random.default_rng(seed)
    u: list[float] = []
    impossible = near = skipped = 0
    for d in draws:
        if d.draft_token is None or d.verified_by not in RULES or d.token == d.draft_token:
            continue
        res = _residual(d)
        if res is None:
            skipped += 1
            continue
        px = res.get(d.token, 0.0)
        if px <= 0:
            if _impossible(d, ratio_bound):
                impossible += 1
            else:
                near += 1
            continue
        below = sum(v for t, v in res.items() if t < d.token)
        u.append(min(1.0, below + float(rng.random()) * px))
    if not u and not impossible:
        return None
    ks = stats.kstest(np.array(u), "uniform") if u else None
    p = TINY_P if impossible else float(ks.pvalue) if ks is not None else 1.0
    left = (
        f"; {impossible} where the residual has no mass (p(x) < q(x) beyond the noise)"
        if impossible
        else ""
    )
    left += f"; {near} just outside its support (within the noise) left out" if near else ""
    left += f"; {skipped} with a residual too small to test" if skipped else ""
    detail = f"{len(u)} rejected positions' tokens against their residual laws{left}"
    return ScoreTest(RESIDUAL, float(ks.statistic) if ks is not None else math.nan, p, detail)


def flag_tests(
    draws: Sequence[TokenDraw], *, ratio_bound: float = 1.0, seed: int = 0
) -> list[ScoreTest]:
    """The flag tests that have something to test, for the run's Holm family."""
    out = [
        acceptance_test(draws, ratio_bound=ratio_bound),
        residual_test(draws, ratio_bound=ratio_bound, seed=seed),
    ]
    return [t for t in out if t is not None]


def align(entries: Sequence[object], ids: Sequence[int]) -> list[dict[str, object] | None]:
    """Each generated token's entry of a response's ``completion_probabilities``, or None:
    the entries are matched to the ids in order by their ``id``, because llama-server gives
    no entry to a token whose text ends inside a UTF-8 character, so the i-th entry is not
    always the i-th token's. Entries that match no later id are ignored."""
    out: list[dict[str, object] | None] = [None] * len(ids)
    j = 0
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("id"), int):
            continue
        k = j
        while k < len(ids) and ids[k] != e["id"]:
            k += 1
        if k == len(ids):
            continue
        out[k] = e
        j = k + 1
    return out


def parse_flags(entries: Sequence[object], ids: Sequence[int]) -> tuple[DraftFlag | None, ...]:
    """Each token's flag from its aligned entry (`align`); () when no entry has one (an engine
    that does not flag)."""
    out: list[DraftFlag | None] = []
    for e in align(entries, ids):
        rule = e.get("verified_by") if e is not None else None
        draft = e.get("draft_id") if e is not None else None
        if not isinstance(rule, str) or not isinstance(draft, int) or isinstance(draft, bool):
            out.append(None)
            continue
        out.append(DraftFlag(draft if draft >= 0 else None, rule))
    return tuple(out) if any(f is not None for f in out) else ()


__all__ = [
    "ACCEPTANCE",
    "MIN_RESIDUAL_MASS",
    "RESIDUAL",
    "DraftFlag",
    "acceptance_test",
    "align",
    "flag_tests",
    "parse_flags",
    "residual_test",
]
