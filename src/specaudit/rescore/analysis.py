"""The re-scored verdict: every sampled token against the reference's distribution for its
exact prefix, one family of tests that decides BROKEN, and a certificate that decides between
PRESERVED and INCONCLUSIVE.

Why three outcomes: "no test rejected" is not evidence that nothing is wrong; a small run
rejects nothing. PRESERVED is said only when the certificate's bounds (`certify`: how much
probability mass moved across the PIT order, how far the draft's favourite is from the
reference, the TV at repeated prefixes) are within the tolerance; otherwise INCONCLUSIVE, with
the number of tokens that would decide.

BROKEN, fixed N: one family, Holm at alpha (`FIXED_TESTS` plus one exact test per repeated
prefix, plus the draft-aimed e-process as the p-value 1/max E when the draft's distributions
are known): the KS test of the PIT values (`pit`), the surprisal score, the rank-bin
chi-square, the two-sided favourite test (`scores`), the count of tokens outside the
reference's top-k against its own rate across batch shapes (`outside`: edge and impossible
tokens together; one impossible in every batch shape rejects on its own, at the family's
level), per-prefix exact multinomial tests, and `draft_lr`. Holm keeps the family-wise
error at alpha whatever the tests' dependence, so every p-value the report prints is
accounted for: a raw p below alpha that Holm does not reject is printed with its adjusted
value.

`sequential`: the run is decided by anytime-valid evidence at alpha / 2 (the average of a
Dirichlet-multinomial Bayes factor on the PIT histogram and a two-sided betting martingale on
the favourite, and, with the draft known, `draft_lr`'s e-process; each at an equal share) and
the fixed family at alpha / 2, valid at the run's planned maximum: the verdict never ignores a
test it prints. A token impossible in every batch shape stops a sequential run at once: the
count test rejects on it, and that rejection only grows with the run.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import special, stats

from specaudit.reference import NextToken
from specaudit.rescore import certify, draft_lr, flags, outside, scores
from specaudit.rescore.certify import DEFAULT_TOLERANCE, Certificate
from specaudit.rescore.draft_lr import DraftEvidence
from specaudit.rescore.outside import EdgeLeak, OutsideTest
from specaudit.rescore.pit import Pits
from specaudit.rescore.records import DEFAULT_ALPHA, RescoreError, TokenDraw
from specaudit.rescore.scores import ScoreTest
from specaudit.stats import Verdict, holm

POWER = 0.8
# Refuse a run that could not even see this much probability mass moved at every step
# (the KS test's 80 %-power Kolmogorov distance): too few tokens to decide anything.
MAX_DETECTABLE = 0.2
HIST_BINS = 8  # u histogram of the e-process
# the favourite martingale's mixture, both signs: too many hits and too few
BET_FRACTIONS = (-0.8, -0.4, -0.2, -0.1, -0.05, 0.05, 0.1, 0.2, 0.4, 0.8)
# the whole-run tests of the family (each repeated prefix adds one, the draft one more)
FIXED_TESTS = (
    "KS of the PIT values",
    "surprisal",
    "rank bins",
    "favourite (two-sided)",
    outside.NAME,
)
DRAFT_TEST = "draft-aimed e-process"
# long generations: the PIT values of each band of positions get a KS test of their own in the
# family, so a bug that acts only late (a long KV cache, many verification rounds, a draft
# that drifts) is not diluted by the early tokens. Bands double: 0-7, 8-15, 16-31, ...; a run
# of at most 8 tokens per sample has one band, the whole run, and no extra test
FIRST_BAND = 8
MIN_BAND_VALUES = 50  # a band with fewer PIT values is folded into the one before it


def ks_detectable(n: int, level: float, power: float = POWER) -> float:
    """The smallest Kolmogorov distance of the u CDF from uniform that the KS test at `level`
    detects with `power` (a binomial bound at the median: conservative)."""
    if n <= 0:
        return 1.0
    crit = float(stats.kstwo.ppf(1 - level, n))
    lo, hi = 0.0, 0.5
    for _ in range(40):
        mid = (lo + hi) / 2
        # the empirical CDF at 1/2 - mid ... a shift of mid at one point exceeds crit
        q = 0.5 + mid
        if stats.binom.sf(math.ceil(n * (0.5 + crit)) - 1, n, q) >= power:
            hi = mid
        else:
            lo = mid
    return hi


def check_enough(tokens: int, alpha: float = DEFAULT_ALPHA) -> None:
    """Refuse, before anything is sampled, a run too small to decide anything (one line, exit
    2): the KS test at its Bonferroni share could not see even `MAX_DETECTABLE` of the mass
    moved. A run above this floor but below what the certificate needs is INCONCLUSIVE."""
    level = alpha / len(FIXED_TESTS)
    d = ks_detectable(tokens, level)
    if d > MAX_DETECTABLE:
        lo, hi = tokens, 100_000  # ks_detectable falls with n: the first n within, bisected
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ks_detectable(mid, level) <= MAX_DETECTABLE else (mid + 1, hi)
        need = lo
        raise RescoreError(
            f"{tokens} sampled tokens are too few to decide: the test could not even see "
            f"{d:.0%} of the probability mass moved (need at least {need} tokens: more seeds, "
            "tokens or prompts)"
        )


def hist_log_e(u: np.ndarray, bins: int = HIST_BINS, a: float = 0.5) -> np.ndarray:
    """log of the Dirichlet(a)-multinomial Bayes factor of the u histogram against uniform,
    after each draw (nan: a token outside the support, no bet): a test martingale under the null,
    so valid at every look."""
    counts = np.zeros(bins)
    out = np.empty(len(u))
    log_e, seen = 0.0, 0
    for i, x in enumerate(u):
        if not math.isnan(x):
            b = min(int(x * bins), bins - 1)
            # predictive probability of bin b under the mixture, against 1/bins under the null
            log_e += math.log((counts[b] + a) / (seen + bins * a)) + math.log(bins)
            counts[b] += 1
            seen += 1
        out[i] = log_e
    return out


def bet_log_e(hits: np.ndarray, ps: np.ndarray) -> np.ndarray:
    """log of a mixture of betting martingales on 1{x = favourite} - p(favourite), both
    signs: grows when the favourite comes up more often, or less often, than the reference
    says. Every factor 1 + f (hit - p) is positive for |f| < 1, with mean 1 under the null."""
    steps = np.array([np.log1p(f * (hits - ps)) for f in BET_FRACTIONS])
    cum = np.cumsum(steps, axis=1)
    return np.asarray(special.logsumexp(cum, axis=0) - math.log(len(BET_FRACTIONS)))


@dataclass(frozen=True)
class FamilyTest:
    """One test of the family: its raw p-value, Holm's adjusted one, and whether it rejects
    at the family's level."""

    name: str
    p_value: float
    adjusted: float
    rejects: bool
    detail: str


@dataclass(frozen=True)
class RescoreStats:
    """What the run found: `verdict` with `reason` in words; `certifies` what a PRESERVED
    states (or an INCONCLUSIVE lacks), the certificate's sentence and its blind spots."""

    verdict: Verdict
    reason: str
    certifies: str
    tokens: int
    impossible: int  # outside the support and beyond the reference's noise in every shape
    ks_p: float
    surprisal_p: float
    rank_p: float
    directed_p: float  # the two-sided favourite test
    favourite_rate: float
    favourite_expected: float
    g_prefixes: int
    g_p: float  # the smallest Holm-adjusted p-value of the per-prefix tests (1: none)
    e_value: float  # the PIT e-process's running maximum
    crossed_at: int | None  # draws until the anytime evidence first decided (None: never)
    alpha: float
    tolerance: float
    needed: int | None  # tokens that would decide an INCONCLUSIVE (None: more would not)
    outside: OutsideTest | None = None  # the count of tokens outside the top-k support
    certificate: Certificate | None = None
    draft: DraftEvidence | None = None
    tests: list[FamilyTest] = field(default_factory=list)
    per_position: dict[int, float] = field(default_factory=dict)  # KS p per position
    prefix_tests: list[ScoreTest] = field(default_factory=list)
    u: list[float] = field(default_factory=list)


def analyse(
    draws: Sequence[TokenDraw],
    *,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    sequential: bool = False,
    tolerance: float = DEFAULT_TOLERANCE,
    ratio_bound: float = 1.0,
    extra: Sequence[ScoreTest] = (),
    edge: EdgeLeak | None = None,
    far: Collection[outside.Key] = (),
) -> RescoreStats:
    """Decide on re-scored draws (in sampling order). The PIT's randomisation comes from
    `seed` (fixed: the same draws give the same verdict). `ratio_bound`: the reference's
    measured noise as a bound on engine/reference probability ratios (`draft_lr`). `extra`:
    more tests of the family, computed elsewhere (the same-seed coupling, `control`).
    `edge`: the reference's own leak across its top-k edge and `far` the draws impossible in
    every batch shape (`runner`), for the outside count (`outside.outside_test`; without
    `edge` its null rate is 0)."""
    pits = Pits.of(draws, seed)
    counted = outside.outside_test(draws, edge, far)
    evidence = draft_lr.draft_e_process(draws, alpha, ratio_bound=ratio_bound)
    draft = evidence if evidence.used else None
    family_level = alpha / 2 if sequential else alpha
    whole, prefixes = _fixed_tests(draws, pits, seed, counted)
    # where the engine flags its speculated tokens: each flagged position a direct trial of
    # its verification rule (`rescore.flags`)
    flagged = flags.flag_tests(draws, ratio_bound=ratio_bound, seed=seed)
    members = [*whole, *flagged, *prefixes, *extra]
    if draft is not None and not sequential:
        members.append(ScoreTest(DRAFT_TEST, draft.e_value, min(1.0, 1 / draft.e_value), ""))
    family = _family(members, family_level)
    e_value, crossed_at, anytime = _anytime(pits, draft, alpha / 2, sequential)
    cert = certify.certify(
        pits.u_all, pits.hits, pits.favourite_p, certify.strata_of(draws),
        alpha=alpha, tolerance=tolerance,
    )  # fmt: skip
    reasons = list(anytime)
    reasons += [_rejection(t, family_level) for t in family if t.rejects]
    n = len(draws)
    if reasons:
        verdict, reason = Verdict.BROKEN, "; ".join(reasons)
    else:
        verdict = Verdict.PRESERVED if cert.within else Verdict.INCONCLUSIVE
        reason = _kept_reason(verdict, family, family_level, cert)
    by_name = {t.name: t for t in family}
    prefix_adj = [by_name[t.name].adjusted for t in prefixes]
    fav_p = np.array(pits.favourite_p)
    return RescoreStats(
        verdict=verdict, reason=reason, certifies=_certifies(cert), tokens=n,
        impossible=counted.far, ks_p=by_name[FIXED_TESTS[0]].p_value,
        surprisal_p=by_name[FIXED_TESTS[1]].p_value, rank_p=by_name[FIXED_TESTS[2]].p_value,
        directed_p=by_name[FIXED_TESTS[3]].p_value,
        favourite_rate=float(np.mean(pits.hits)) if n else 0.0,
        favourite_expected=float(fav_p.mean()) if n else 0.0, g_prefixes=len(prefixes),
        g_p=min(prefix_adj, default=1.0), e_value=e_value, crossed_at=crossed_at, alpha=alpha,
        tolerance=tolerance, needed=cert.needed, outside=counted, certificate=cert, draft=draft,
        tests=family, per_position=_per_position(pits), prefix_tests=prefixes, u=pits.u,
    )  # fmt: skip


def anytime_decides(
    draws: Sequence[TokenDraw],
    *,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    far: Collection[outside.Key] = (),
) -> bool:
    """Whether `analyse(..., sequential=True)` has already decided BROKEN on these draws, the
    first of a run in sampling order: a sequential run stops sampling there (`runner`). The
    anytime-valid evidence at alpha / 2, or a draw in `far` (impossible in every batch shape):
    the outside count test gives it p = delta, which Holm rejects at the family's level, and
    that rejection stays with every later draw, so stopping on it adds nothing to the level."""
    if any(outside.key_of(d) in far and outside.is_outside(d) for d in draws):
        return True
    pits = Pits.of(draws, seed)
    evidence = draft_lr.draft_e_process(draws, alpha)
    return bool(_anytime(pits, evidence if evidence.used else None, alpha / 2, True)[2])


def _fixed_tests(
    draws: Sequence[TokenDraw], pits: Pits, seed: int, counted: OutsideTest
) -> tuple[list[ScoreTest], list[ScoreTest]]:
    """The whole-run tests (`FIXED_TESTS`, in that order) and the per-prefix ones."""
    ks_p = float(stats.kstest(np.array(pits.u), "uniform").pvalue) if pits.u else 1.0
    ks = ScoreTest(FIXED_TESTS[0], math.nan, ks_p, f"{len(pits.u)} PIT values against U(0,1)")
    whole = [
        ks,
        scores.surprisal_test(draws, seed=seed),
        scores.rank_bin_test(draws, seed=seed),
        scores.favourite_test(draws),
        counted.score_test(),
    ]
    named = [
        ScoreTest(name, t.statistic, t.p_value, t.detail)
        for name, t in zip(FIXED_TESTS, whole, strict=True)
    ]
    return [*named, *position_band_tests(pits)], scores.prefix_tests(draws, seed=seed)


def position_bands(positions: Collection[int]) -> list[tuple[int, int]]:
    """[lo, hi) bands of token positions: 0-7, then doubling (8-15, 16-31, ...), up to the
    last position present."""
    last = max(positions, default=-1)
    bands, lo, hi = [], 0, FIRST_BAND
    while lo <= last:
        bands.append((lo, hi))
        lo, hi = hi, 2 * hi
    return bands


def position_band_tests(pits: Pits) -> list[ScoreTest]:
    """A KS test of the PIT values per band of positions (`position_bands`), when there is
    more than one: under the null every PIT value is U(0,1) given everything before it, so
    any fixed subset of them is a sample of U(0,1), whatever the generation's length."""
    groups: list[tuple[int, int, list[float]]] = []
    for lo, hi in position_bands(pits.by_position):
        u = [x for p in range(lo, hi) for x in pits.by_position.get(p, [])]
        if groups and len(u) < MIN_BAND_VALUES:
            groups[-1] = (groups[-1][0], hi, groups[-1][2] + u)
        else:
            groups.append((lo, hi, u))
    if len(groups) < 2:
        return []
    last = max(pits.by_position)
    out = []
    for lo, hi, u in groups:
        p = float(stats.kstest(np.array(u), "uniform").pvalue) if u else 1.0
        out.append(
            ScoreTest(
                f"KS at positions {lo}-{min(hi, last + 1) - 1}",
                math.nan,
                p,
                f"{len(u)} PIT values of the tokens at positions {lo} to {min(hi, last + 1) - 1}",
            )
        )
    return out


def _family(members: Sequence[ScoreTest], level: float) -> list[FamilyTest]:
    adjusted = holm([t.p_value for t in members])
    return [
        FamilyTest(t.name, t.p_value, a, a < level, t.detail)
        for t, a in zip(members, adjusted, strict=True)
    ]


def _anytime(
    pits: Pits, draft: DraftEvidence | None, level: float, sequential: bool
) -> tuple[float, int | None, list[str]]:
    """The PIT e-process's running maximum, the draws until the anytime evidence first
    decided, and (`sequential`) BROKEN's reasons from it at `level`, split equally between the
    PIT e-process and the draft's when the draft is known."""
    if not pits.u_all:
        return 1.0, None, []
    both = np.logaddexp(
        hist_log_e(np.array(pits.u_all)),
        bet_log_e(np.array(pits.hits), np.array(pits.favourite_p)),
    ) - math.log(2)
    e_value = math.exp(min(float(np.max(both)), 700.0))
    share = level / 2 if draft is not None else level
    over = np.nonzero(both >= math.log(1 / share))[0]
    crossed = [int(over[0]) + 1] if len(over) else []
    if not sequential:
        return e_value, crossed[0] if crossed else None, []
    reasons = []
    if crossed:
        reasons.append(
            f"the PIT e-process reached {e_value:.3g} >= {1 / share:.3g} (anytime-valid, "
            f"after {crossed[0]} draws)"
        )
    if draft is not None and draft.e_value >= 1 / share:
        likely = f" (most evidence: {draft.best_bug})" if draft.best_bug else ""
        reasons.append(
            f"the draft-aimed e-process reached {draft.e_value:.3g} >= {1 / share:.3g} "
            f"(anytime-valid){likely}"
        )
        if draft.crossed_at is not None:
            crossed.append(draft.crossed_at)
    return e_value, min(crossed) if crossed else None, reasons


def _rejection(t: FamilyTest, level: float) -> str:
    what = f"; {t.detail}" if t.detail else ""
    return f"{t.name}: p = {t.p_value:.2g} (Holm-adjusted {t.adjusted:.2g} < {level:.2g}){what}"


def _kept_reason(
    verdict: Verdict, family: Sequence[FamilyTest], level: float, cert: Certificate
) -> str:
    """Why no test rejected, naming every raw p-value below the level that Holm did not keep
    (so the report never shows one without saying why it does not count), then what the
    bounds certify or lack."""
    small = [t for t in family if t.p_value < level]
    head = f"no test of the {len(family)} rejects at alpha = {level:.2g} (Holm)"
    if small:
        head += "; " + ", ".join(
            f"{t.name} p = {t.p_value:.2g} does not count: Holm-adjusted over {len(family)} "
            f"tests it is {t.adjusted:.2g}"
            for t in small
        )
    if verdict is Verdict.PRESERVED:
        return f"{head}; {cert.statement}"
    return f"{head}, but the bounds are not tight enough to certify: {cert.statement}"


def _certifies(cert: Certificate) -> str:
    return cert.statement + ". What one draw per prefix cannot see: " + "; ".join(cert.blind_spots)


def _per_position(pits: Pits) -> dict[int, float]:
    return {
        p: float(stats.kstest(np.array(x), "uniform").pvalue)
        for p, x in sorted(pits.by_position.items())
    }


def null_false_alarms(
    runs: int, tokens: int, *, vocab: int = 8, alpha: float = DEFAULT_ALPHA, seed: int = 0
) -> tuple[int, tuple[float, float]]:
    """Simulate `runs` re-scored runs whose tokens really are drawn from the reference
    (random distributions, a few repeated prefixes), and count BROKEN verdicts: the test's
    false-alarm rate, with its 95 % Clopper-Pearson interval (`scipy.stats.binomtest`)."""
    rng = np.random.default_rng(seed)
    alarms = 0
    for r in range(runs):
        # position 0 shares one distribution (a repeated prefix, tested exactly); later
        # positions each have their own, as long generations do
        probs = rng.dirichlet(np.full(vocab, 0.5), size=tokens)
        probs[::4] = rng.dirichlet(np.ones(vocab))
        toks = (rng.random((tokens, 1)) > np.cumsum(probs, axis=1)).sum(axis=1)
        toks = np.minimum(toks, vocab - 1)
        draws = [
            TokenDraw(
                i // 4,
                0,
                i % 4,
                "start" if i % 4 == 0 else f"{r}:{i}",
                int(toks[i]),
                NextToken(probs=dict(enumerate(probs[i].tolist()))),
            )  # fmt: skip
            for i in range(tokens)
        ]
        if analyse(draws, alpha=alpha, seed=r).verdict is Verdict.BROKEN:
            alarms += 1
    ci = stats.binomtest(alarms, runs).proportion_ci(0.95)
    return alarms, (float(ci.low), float(ci.high))


__all__ = [
    "DEFAULT_ALPHA",
    "DRAFT_TEST",
    "FIXED_TESTS",
    "FamilyTest",
    "RescoreStats",
    "analyse",
    "anytime_decides",
    "check_enough",
    "null_false_alarms",
]
