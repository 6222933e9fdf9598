"""The fixed-sample analysis: per-position stratified tests, the joint, Holm, TV, a verdict.

Samples are analysed as a `Tally`: counts of the distinct generated texts (cut to the tested
positions), never a list of samples, so memory depends on how many *different* texts came
back (at most letters^positions), not on --seeds. The results are the same as over the list.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from specaudit import fixtures, stats
from specaudit.dist.render import p_eq
from specaudit.dist.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOLERANCE,
    ContextResult,
    DistError,
    EngineResult,
    Sample,
    TestResult,
    TokenRow,
    Workload,
)
from specaudit.dist.truth import Truth, check_text, stratum_key
from specaudit.stats import TvInterval, Verdict


@dataclass
class Tally:
    """One engine's samples as the analysis needs them, in memory independent of their number.

    `texts` counts the distinct generated texts cut to the `length` tested characters, in
    order of first appearance (so the analysis sees contexts in the same order as over the
    list of samples); the seed range and draft counts are kept as running totals.
    """

    length: int
    texts: dict[str, int] = field(default_factory=dict)
    n: int = 0
    first_seed: int | None = None
    last_seed: int | None = None
    drafted: int | None = None
    accepted: int | None = None

    @classmethod
    def of(cls, samples: Iterable[Sample], workload: Workload) -> Tally:
        t = cls(tally_length(workload))
        for s in samples:
            t.add(s)
        return t

    def add(self, s: Sample) -> None:
        key = s.text[: self.length]
        self.texts[key] = self.texts.get(key, 0) + 1
        self.n += 1
        self.first_seed = s.seed if self.first_seed is None else min(self.first_seed, s.seed)
        self.last_seed = s.seed if self.last_seed is None else max(self.last_seed, s.seed)
        if s.drafted is not None:
            self.drafted = (self.drafted or 0) + s.drafted
        if s.accepted is not None:
            self.accepted = (self.accepted or 0) + s.accepted


def tally_length(workload: Workload) -> int:
    """Characters of a sample the analysis reads: the tested positions (and the joint)."""
    return max(workload.positions, workload.joint)


def _weighted(texts: Sequence[str] | Mapping[str, int]) -> Iterable[tuple[str, int]]:
    if isinstance(texts, Mapping):
        return texts.items()
    return ((t, 1) for t in texts)


def _context_label(prompt: str, prefixes: list[str]) -> str:
    if len(prefixes) == 1:
        return f"{prompt}+{prefixes[0]}" if prefixes[0] else prompt
    lasts = {p[-1] for p in prefixes if p}
    if len(lasts) == 1:
        return f"…{lasts.pop()} ({len(prefixes)} prefixes)"
    return f"{len(prefixes)} prefixes"


def _rows(labels: Sequence[str], counts: np.ndarray, p: np.ndarray) -> list[TokenRow]:
    n = int(counts.sum())
    lo, hi = stats.clopper_pearson(counts, n, 0.05)
    return [
        TokenRow(
            labels[i],
            float(p[i]),
            int(counts[i]),
            counts[i] / n if n else math.nan,
            float(lo[i]),
            float(hi[i]),
        )
        for i in range(len(labels))
        if p[i] > 0 or counts[i] > 0
    ]


def _position_strata(
    truth: Truth, texts: Sequence[str] | Mapping[str, int], t: int
) -> dict[tuple[float, ...], tuple[np.ndarray, np.ndarray, dict[str, None]]]:
    """Counts of the token at position t (1-based), grouped by true conditional distribution.

    Contexts with the same true next-token distribution are interchangeable under the null, so
    they are pooled; the prefixes pooled are kept (in order of appearance) for labels.
    """
    groups: dict[tuple[float, ...], tuple[np.ndarray, np.ndarray, dict[str, None]]] = {}
    for text, w in _weighted(texts):
        prefix = text[: t - 1]
        p = truth.next(prefix)
        k = stratum_key(p)
        g = groups.get(k)
        if g is None:
            g = (np.zeros(len(p), dtype=np.int64), p, {})
            groups[k] = g
        g[0][truth.index[text[t - 1]]] += w
        g[2][prefix] = None
    return groups


def _marginal_counts(truth: Truth, texts: Sequence[str] | Mapping[str, int], t: int) -> np.ndarray:
    counts = np.zeros(len(truth.labels), dtype=np.int64)
    for text, w in _weighted(texts):
        counts[truth.index[text[t - 1]]] += w
    return counts


def position_tv(
    truth: Truth, texts: Sequence[str] | Mapping[str, int], t: int, alpha: float
) -> TvInterval:
    """TV between the engine's and the target's distribution of the token at position t."""
    return stats.tv_interval(_marginal_counts(truth, texts, t), truth.marginal(t), alpha)


def analyze(
    spec: fixtures.FixtureSpec,
    workload: Workload,
    samples: Sequence[Sample] | Tally,
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    engine: str = "engine",
    kind: str = "url",
    seconds: float = 0.0,
    mc_seed: int = 0,
) -> EngineResult:
    """Test samples against the fixture's closed-form distributions (fixed-sample analysis).

    `samples`: the samples, or their `Tally` (whose texts the caller has checked with
    `check_text`); the result is the same.
    """
    if isinstance(samples, Tally):
        tally = samples
    else:
        for s in samples:
            check_text(s.text, workload.tokens, spec, engine)
        tally = Tally.of(samples, workload)
    if not tally.n:
        raise DistError(f"{engine}: no samples to analyse")
    if tally.length < tally_length(workload):
        raise DistError(f"{engine}: the tally keeps {tally.length} characters, too few")
    truth = Truth(spec, workload)
    texts = tally.texts
    tests: list[TestResult] = []
    contexts: list[ContextResult] = []
    headline: list[ContextResult] = []
    tv_uppers: list[float] = []
    for t in range(1, workload.positions + 1):
        groups = _position_strata(truth, texts, t)
        strata = [(c, p) for c, p, _ in groups.values()]
        gof = stats.stratified_gof(strata, seed=mc_seed + t)
        tv = position_tv(truth, texts, t, alpha)
        tv_uppers.append(tv.upper)
        n = int(sum(c.sum() for c, _ in strata))
        tests.append(
            TestResult(f"position {t}", "position", t, n, len(strata), gof, 1.0, tv, False)
        )
        want = truth.most_likely_prefix(t - 1) if t <= 3 else None
        for counts, p, pref in sorted(groups.values(), key=lambda g: -int(g[0].sum())):
            prefixes = list(pref)
            ctx = ContextResult(
                position=t,
                label=_context_label(workload.prompt, prefixes),
                prefixes=sorted(prefixes)[:8],
                n=int(counts.sum()),
                tokens=_rows(truth.labels, counts, p),
                gof=stats.multinomial_gof(counts, p, seed=mc_seed + 100 * t),
                tv=stats.tv_interval(counts, p, alpha),
            )
            contexts.append(ctx)
            if want is not None and want in prefixes:
                ctx.label = f"{workload.prompt}+{want}" if want else workload.prompt
                if len(prefixes) > 1:
                    ctx.label += f" (+{len(prefixes) - 1} alike)"
                headline.append(ctx)
    if workload.joint:
        j = workload.joint
        joint_p = truth.joint(j)
        seqs = sorted(joint_p)
        counts_d: dict[str, int] = {}
        for text, w in texts.items():
            counts_d[text[:j]] = counts_d.get(text[:j], 0) + w
        extra = sorted(s for s in counts_d if s not in joint_p)  # impossible sequences seen
        cells = seqs + extra
        counts = np.array([counts_d.get(s, 0) for s in cells], dtype=np.int64)
        probs = np.array([joint_p.get(s, 0.0) for s in cells])
        probs = probs / probs.sum()
        gof = stats.multinomial_gof(counts, probs, seed=mc_seed + 1000)
        tv = stats.tv_interval(counts, probs, alpha)
        tests.append(
            TestResult(
                f"joint 1-{j}", "joint", 0, int(counts.sum()), len(seqs), gof, 1.0, tv, False
            )
        )
    adj = stats.holm([x.gof.p_value for x in tests])
    for x, pa in zip(tests, adj, strict=True):
        x.p_holm = pa
        x.rejected = pa < alpha
    # each generated token is in exactly one position test
    impossible = sum(x.gof.impossible for x in tests if x.kind == "position")
    verdict = stats.decide(adj, alpha, tv_uppers, tolerance, impossible > 0)
    reason = _reason(verdict, tests, tv_uppers, alpha, tolerance, impossible)
    assert tally.first_seed is not None and tally.last_seed is not None
    return EngineResult(
        engine=engine,
        kind=kind,
        verdict=verdict,
        alpha=alpha,
        tolerance=tolerance,
        n_samples=tally.n,
        first_seed=tally.first_seed,
        last_seed=tally.last_seed,
        drafted=tally.drafted,
        accepted=tally.accepted,
        tests=tests,
        contexts=contexts,
        headline=headline,
        impossible=impossible,
        reason=reason,
        seconds=seconds,
    )


def _reason(
    verdict: Verdict,
    tests: list[TestResult],
    tv_uppers: list[float],
    alpha: float,
    tolerance: float,
    impossible: int,
) -> str:
    m = len(tests)
    if impossible:
        return f"{impossible} sampled token(s) have true probability 0: broken with certainty"
    if verdict is Verdict.BROKEN:
        worst = min(tests, key=lambda x: x.p_holm)
        return (
            f"{worst.name} rejects: p {p_eq(worst.gof.p_value)} "
            f"(Holm over {m}: p {p_eq(worst.p_holm)}), alpha {alpha:g}"
        )
    worst_tv = max(tv_uppers) if tv_uppers else math.nan
    if verdict is Verdict.PRESERVED:
        return (
            f"no test rejects at {alpha:g} (Holm over {m}); next-token TV <= {worst_tv:.3f} "
            f"at every position ({1 - alpha:.0%} bound, tolerance {tolerance:g})"
        )
    return (
        f"no test rejects at {alpha:g} (Holm over {m}), but TV up to {worst_tv:.3f} is not "
        f"ruled out (tolerance {tolerance:g}): more samples needed"
    )


__all__ = ["Tally", "analyze", "position_tv", "tally_length"]
