"""The fixed-sample analysis: the family of tests run in order, Holm, the verdict.

The parts live by concern: `counting` (samples as `OutcomeCounts`, the tables the tests read),
`bounds` (certified TV bounds), `direction` (the score test toward the draft), `dependence`
(the full history, independence across seeds), `wording` (the verdict in words). Here they
are put together into one `EngineResult`.

What the verdict certifies (docs/dist.md, "Verdict"):

- BROKEN: a token the target gives probability 0 was sampled (a forbidden letter, a special
  token, an early end; the evidence names seed, position and token), or a Holm-corrected test
  rejects at alpha (positions, joint, draft direction, history, seed pairs);
- PRESERVED: nothing rejects, and with confidence 1 - alpha (one-sided bounds, Bonferroni over
  the positions and the joint) the prefix-averaged next-token TV of every position and the
  joint's TV are within the tolerance;
- INCONCLUSIVE otherwise, with about how many samples would do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from specaudit import fixtures, stats
from specaudit.distribution.bounds import certified_bounds, position_tv, sequence_bound
from specaudit.distribution.counting import (
    OutcomeCounts,
    Texts,
    joint_cells,
    position_strata,
    tally_length,
)
from specaudit.distribution.dependence import (
    history_positions,
    history_result,
    seed_pair_result,
)
from specaudit.distribution.direction import (
    POWER,
    directed_result,
    directed_tv,
    draft_direction,
)
from specaudit.distribution.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOLERANCE,
    EVIDENCE_KEPT,
    ContextResult,
    DistError,
    EngineResult,
    GenericPower,
    ImpossibleOutcome,
    Sample,
    TestResult,
    TokenRow,
    Workload,
)
from specaudit.distribution.truth import Truth, describe, encode_text
from specaudit.distribution.wording import reason
from specaudit.stats import TvBound, TvInterval, Verdict

HEADLINE_POSITIONS = 3  # the report's headline rows: the most likely context at 1..this


@dataclass(frozen=True)
class _MonteCarlo:
    """How every Monte-Carlo p-value of one analysis is drawn; each test adds its own offset
    to `seed`, so the tests' draws are independent and reproducible."""

    seed: int
    draws: int
    stop_hits: int


def analyse(
    spec: fixtures.FixtureSpec,
    workload: Workload,
    samples: Sequence[Sample] | OutcomeCounts,
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    engine: str = "engine",
    kind: str = "url",
    seconds: float = 0.0,
    mc_seed: int = 0,
    mc_draws: int = stats.MC_DRAWS,
    mc_stop_hits: int = 0,
) -> EngineResult:
    """Test samples against the fixture's closed-form distributions (fixed-sample analysis).

    `samples`: the samples (their texts are encoded with `encode_text`: a short output, a
    special token or a character outside the fixture are outcomes of probability 0), or their
    `OutcomeCounts` of encoded texts; the result is the same. `mc_draws`: simulations per
    Monte-Carlo p-value (any number keeps them valid; fewer only coarsens them);
    `mc_stop_hits` > 0 makes the family's Monte-Carlo p-values sequential (`stats.mc_pvalue`),
    so a large `mc_draws` (a floor below a small level) costs little where the evidence is
    weak.
    """
    counts = _counted(spec, workload, samples, engine)
    truth = Truth(spec, workload)
    texts = counts.texts
    mc = _MonteCarlo(mc_seed, mc_draws, mc_stop_hits)
    bounds = certified_bounds(truth, texts, alpha)
    tests, contexts, headline = _position_tests(truth, texts, bounds, alpha, mc)
    if workload.joint:
        tests.append(_joint_test(truth, texts, bounds[-1], alpha, mc))
    # each generated token is in exactly one position test
    impossible = sum(x.gof.impossible for x in tests if x.kind == "position")
    directed = _directed_test(truth, counts, impossible > 0, alpha, mc)
    if directed is not None:  # a draft equal to the target has no direction to test
        tests.append(directed)
    tests += _history_tests(truth, texts, bounds, alpha, mc)
    tests.append(_seed_test(truth, counts, alpha, mc))
    adjusted = _holm(tests, alpha)
    uppers = [b.upper for b in bounds]
    verdict = stats.decide(adjusted, alpha, uppers, tolerance, impossible > 0)
    needed = stats.samples_needed(counts.n, max(uppers), tolerance)
    level = alpha / len(tests)  # Holm's first step: the power figures' level
    assert counts.first_seed is not None and counts.last_seed is not None
    result = EngineResult(
        engine=engine,
        kind=kind,
        verdict=verdict,
        alpha=alpha,
        tolerance=tolerance,
        n_samples=counts.n,
        first_seed=counts.first_seed,
        last_seed=counts.last_seed,
        drafted=counts.drafted,
        accepted=counts.accepted,
        tests=tests,
        contexts=contexts,
        headline=headline,
        impossible=impossible,
        reason="",
        seconds=seconds,
        evidence=_evidence(truth, counts),
        tv_bound=max(uppers),
        samples_needed=needed if verdict is Verdict.INCONCLUSIVE else None,
        directed=draft_direction(truth).power(counts.n, level) if directed is not None else None,
        power=generic_power(tests, workload, counts.n, level),
        sequence_tv_bound=sequence_bound(truth, texts, counts.n, alpha),
    )
    result.reason = reason(result, workload, spec)
    return result


def _counted(
    spec: fixtures.FixtureSpec,
    workload: Workload,
    samples: Sequence[Sample] | OutcomeCounts,
    engine: str,
) -> OutcomeCounts:
    """The samples' texts encoded and counted (or the counts given), checked to be usable."""
    if isinstance(samples, OutcomeCounts):
        counts = samples
    else:
        counts = OutcomeCounts.of(
            (replace(s, text=encode_text(s.text, workload.tokens, spec)) for s in samples),
            workload,
        )
    if not counts.n:
        raise DistError(f"{engine}: no samples to analyse")
    if counts.length < tally_length(workload):
        raise DistError(f"{engine}: the tally keeps {counts.length} characters, too few")
    return counts


def _position_tests(
    truth: Truth, texts: Texts, bounds: list[TvBound], alpha: float, mc: _MonteCarlo
) -> tuple[list[TestResult], list[ContextResult], list[ContextResult]]:
    """Each tested position: its stratified test (the family's member), then every context's
    own test (descriptive rows), the most likely context of the first positions as headline."""
    tests: list[TestResult] = []
    contexts: list[ContextResult] = []
    headline: list[ContextResult] = []
    for t in range(1, truth.workload.positions + 1):
        groups = position_strata(truth, texts, t)
        strata = [(c, p) for c, p, _ in groups.values()]
        gof = stats.stratified_gof(
            strata, seed=mc.seed + t, mc_draws=mc.draws, mc_stop_hits=mc.stop_hits
        )
        tv = position_tv(truth, texts, t, alpha)
        n = int(sum(c.sum() for c, _ in strata))
        tests.append(
            TestResult(
                f"position {t}", "position", t, n, len(strata), gof, 1.0, tv, False, bounds[t - 1]
            )
        )
        want = truth.most_likely_prefix(t - 1) if t <= HEADLINE_POSITIONS else None
        for counts, p, pref in sorted(groups.values(), key=lambda g: -int(g[0].sum())):
            ctx = _context(truth, t, counts, p, list(pref), alpha, mc)
            contexts.append(ctx)
            if want is not None and want in pref:
                _name_headline(ctx, truth.workload.prompt, want, len(pref))
                headline.append(ctx)
    return tests, contexts, headline


def _context(
    truth: Truth,
    t: int,
    counts: np.ndarray,
    p: np.ndarray,
    prefixes: list[str],
    alpha: float,
    mc: _MonteCarlo,
) -> ContextResult:
    """One pool of position t (prefixes with one true next-token distribution), tested alone."""
    return ContextResult(
        position=t,
        label=_context_label(truth.workload.prompt, prefixes),
        prefixes=sorted(prefixes)[:8],
        n=int(counts.sum()),
        tokens=_rows(truth.outcomes, counts, p),
        gof=stats.multinomial_gof(
            counts, p, seed=mc.seed + 100 * t, mc_draws=mc.draws, mc_stop_hits=mc.stop_hits
        ),
        tv=stats.tv_interval(counts, p, alpha),
    )


def _name_headline(ctx: ContextResult, prompt: str, want: str, pooled: int) -> None:
    """A headline row is named after the most likely prefix, and how many it pools with."""
    ctx.label = f"{prompt}+{want}" if want else prompt
    if pooled > 1:
        ctx.label += f" (+{pooled - 1} alike)"


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


def _joint_test(
    truth: Truth, texts: Texts, bound: TvBound, alpha: float, mc: _MonteCarlo
) -> TestResult:
    """The joint distribution of the first `workload.joint` positions, one multinomial."""
    j = truth.workload.joint
    _, counts, probs, n_seqs = joint_cells(truth, texts, j)
    gof = stats.multinomial_gof(
        counts, probs, seed=mc.seed + 1000, mc_draws=mc.draws, mc_stop_hits=mc.stop_hits
    )
    tv = stats.tv_interval(counts, probs, alpha)
    return TestResult(
        f"joint 1-{j}", "joint", 0, int(counts.sum()), n_seqs, gof, 1.0, tv, False, bound
    )


def _directed_test(
    truth: Truth, counts: OutcomeCounts, impossible: bool, alpha: float, mc: _MonteCarlo
) -> TestResult | None:
    """The score test toward the draft; None when the draft equals the target."""
    gof, dd = directed_result(
        truth, counts.texts, counts.n, impossible, mc_draws=mc.draws,
        mc_stop_hits=mc.stop_hits, mc_seed=mc.seed + 2000,
    )  # fmt: skip
    if gof.method == "trivial":
        return None
    return TestResult(
        "draft direction", "directed", 0, counts.n, dd.contexts, gof, 1.0,
        directed_tv(dd, gof, counts.n, alpha), False,
    )  # fmt: skip


def _history_tests(
    truth: Truth, texts: Texts, bounds: list[TvBound], alpha: float, mc: _MonteCarlo
) -> list[TestResult]:
    """The full history: within each pool, is the token independent of the prefix?"""
    out = []
    for t in history_positions(truth):
        gof = history_result(
            truth, texts, t, mc_draws=mc.draws, mc_stop_hits=mc.stop_hits,
            mc_seed=mc.seed + 3000 + t,
        )  # fmt: skip
        out.append(
            TestResult(
                f"history {t}", "history", t, gof.n, gof.n_strata, gof, 1.0,
                TvInterval(bounds[t - 1].estimate, 0.0, 1.0, 1 - alpha), False,
            )
        )  # fmt: skip
    return out


def _seed_test(truth: Truth, counts: OutcomeCounts, alpha: float, mc: _MonteCarlo) -> TestResult:
    """Independence across consecutive seeds."""
    gof = seed_pair_result(
        truth, counts, mc_draws=mc.draws, mc_stop_hits=mc.stop_hits, mc_seed=mc.seed + 4000
    )
    return TestResult(
        "seed pairs", "seeds", 0, gof.n, len(counts.runs), gof, 1.0,
        TvInterval(math.nan, 0.0, 1.0, 1 - alpha), False,
    )  # fmt: skip


def _holm(tests: list[TestResult], alpha: float) -> list[float]:
    """Holm over the whole family: each test's adjusted p-value and rejection set in place."""
    adjusted = stats.holm([x.gof.p_value for x in tests])
    for x, pa in zip(tests, adjusted, strict=True):
        x.p_holm = pa
        x.rejected = pa < alpha
    return adjusted


def family_size(truth: Truth) -> int:
    """How many tests `analyse` puts in its Holm family for this fixture and workload: the
    positions, the joint, the draft direction (unless the draft equals the target), the
    history tests, the seed pairs."""
    wl = truth.workload
    directed = 1 if draft_direction(truth).information > 1e-15 else 0
    return wl.positions + (1 if wl.joint else 0) + directed + len(history_positions(truth)) + 1


def generic_power(
    tests: Sequence[TestResult], workload: Workload, n: int, level: float
) -> GenericPower:
    """The TV each position's tests (pooled and within-pool), the whole sequence's and the
    joint's see with POWER whatever the direction (`stats.detectable_tv`), at `level` (alpha
    over the Holm family: Holm's first step), from the degrees of freedom the tests had."""
    by_pos: list[float | None] = []
    every: list[int] = []
    for t in range(1, workload.positions + 1):
        dfs = [x.gof.df for x in tests if x.position == t and x.kind in ("position", "history")]
        every += dfs
        by_pos.append(stats.detectable_tv(n, dfs, level, POWER))
    joint = [x.gof.df for x in tests if x.kind == "joint"]
    return GenericPower(
        n=n,
        level=level,
        power=POWER,
        tv_by_position=by_pos,
        tv_sequence=stats.detectable_tv(n, every, level, POWER, parts=workload.positions),
        tv_joint=stats.detectable_tv(n, joint, level, POWER) if joint else None,
    )


def _evidence(truth: Truth, counts: OutcomeCounts) -> list[ImpossibleOutcome]:
    """Every forbidden (position, prefix, token) seen at a tested position, first seeds first."""
    found: dict[tuple[int, str, str], tuple[int, int]] = {}
    for text, w in counts.texts.items():
        for t in range(1, min(len(text), truth.workload.positions) + 1):
            prefix = text[: t - 1]
            if not truth.is_prefix(prefix):
                break
            ch = text[t - 1]
            if truth.p(prefix)[truth.cell(ch)] > 0:
                continue
            key = (t, prefix, ch)
            seed = counts.seeds.get(text, 0)
            prev = found.get(key)
            found[key] = (min(prev[0], seed), prev[1] + w) if prev else (seed, w)
    rows = [
        ImpossibleOutcome(seed, t, prefix, describe(ch, truth.spec), count)
        for (t, prefix, ch), (seed, count) in found.items()
    ]
    rows.sort(key=lambda r: (r.seed, r.position))
    return rows[:EVIDENCE_KEPT]


__all__ = [
    "analyse",
    "family_size",
    "generic_power",
]
