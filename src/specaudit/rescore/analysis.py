"""The re-scored test: randomised PIT values of every sampled token under the reference's
distribution for its exact prefix, and the tests that decide on them.

Why a PIT: each draw x comes from its own distribution p (one per prefix), so no single
goodness-of-fit table exists; but u = F(x-) + V p(x), V ~ U(0,1) independent, is exactly
Uniform(0,1) when x ~ p, whatever p is, and the u of independent draws are i.i.d. Tokens are
ordered for F with the draft's favourite first, then by falling probability: the bugs
speculation makes (accepting the draft's token too often, keeping a rejected draft, a
residual that is not p - q) move mass toward the favourite or between the likely and the
unlikely tokens, which moves u toward one end of [0, 1], where a KS test is strongest.

The decision: an impossible token (x outside the reference's support) is BROKEN on its own,
with certainty; otherwise three tests (`TESTS`), Bonferroni-combined at level alpha, each at
alpha / len(TESTS): the KS test of the u values (`scipy.stats.kstest`), a directed test of how
often x is the draft's favourite (exact Poisson-binomial tail), and per-prefix G-tests where
prefixes repeat (`scipy.stats.power_divergence`). The anytime-valid form is a mixture e-process (a
Dirichlet-multinomial Bayes factor on the u histogram, averaged with a betting martingale on
the favourite), valid at every look.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import special, stats

from specaudit.reference import NextToken
from specaudit.rescore.pit import favourite_of, order, pit, poisson_binomial_sf
from specaudit.rescore.records import RescoreError, TokenDraw
from specaudit.stats import Verdict

DEFAULT_ALPHA = 0.01
POWER = 0.8
# Refuse a run that could not even see this much probability mass moved at every step
# (the KS test's 80 %-power Kolmogorov distance): too few tokens to decide anything.
MAX_DETECTABLE = 0.2
HIST_BINS = 8  # u histogram of the e-process
BET_FRACTIONS = (0.05, 0.1, 0.2, 0.4, 0.8)  # the favourite martingale's mixture
G_MIN_DRAWS = 20  # a prefix enters the per-prefix G-tests with at least this many draws
# the fixed-N tests the verdict combines (Bonferroni: each at `each_test_level`)
TESTS = ("KS of the PIT values", "the draft's favourite", "per-prefix G")


def each_test_level(alpha: float) -> float:
    """The level of each of `TESTS`, so that together they keep alpha (Bonferroni)."""
    return alpha / len(TESTS)


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


def directed_detectable(ps: np.ndarray, level: float, power: float = POWER) -> float:
    """The per-token excess probability of the favourite the directed test detects with
    `power` (normal approximation of the Poisson-binomial)."""
    n = len(ps)
    if n == 0:
        return 1.0
    sd = math.sqrt(float(np.sum(ps * (1 - ps))))
    return (stats.norm.ppf(1 - level) + stats.norm.ppf(power)) * sd / n


def hist_log_e(u: np.ndarray, bins: int = HIST_BINS, a: float = 0.5) -> np.ndarray:
    """log of the Dirichlet(a)-multinomial Bayes factor of the u histogram against uniform,
    after each draw (nan: an impossible token, no bet): a test martingale under the null,
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
    """log of a mixture of betting martingales on 1{x = favourite} - p(favourite): grows when
    the favourite comes up more often than the reference says."""
    steps = np.array([np.log1p(f * (hits - ps)) for f in BET_FRACTIONS])
    cum = np.cumsum(steps, axis=1)
    return np.asarray(special.logsumexp(cum, axis=0) - math.log(len(BET_FRACTIONS)))


@dataclass(frozen=True)
class PrefixTest:
    """The G-test of one repeated prefix: its draws against the reference's distribution."""

    prefix_key: str
    position: int
    draws: int
    p_value: float


@dataclass(frozen=True)
class RescoreStats:
    """What the tests found; `verdict` with `reason` in words, `power` in words too."""

    verdict: Verdict
    reason: str
    power: str
    tokens: int
    impossible: int
    ks_p: float
    directed_p: float
    favourite_rate: float
    favourite_expected: float
    g_prefixes: int
    g_p: float
    e_value: float
    crossed_at: int | None  # draws until the e-process first reached 1/alpha (None: never)
    ks_detectable: float
    directed_detectable: float
    alpha: float
    per_position: dict[int, float] = field(default_factory=dict)  # KS p per position
    prefix_tests: list[PrefixTest] = field(default_factory=list)
    u: list[float] = field(default_factory=list)


def check_enough(tokens: int, alpha: float = DEFAULT_ALPHA) -> None:
    """Refuse, before anything is sampled, a run too small to decide (one line, exit 2)."""
    level = each_test_level(alpha)
    d = ks_detectable(tokens, level)
    if d > MAX_DETECTABLE:
        need = next(n for n in range(tokens, 100_000) if ks_detectable(n, level) <= MAX_DETECTABLE)
        raise RescoreError(
            f"{tokens} sampled tokens are too few to decide: the test could not even see "
            f"{d:.0%} of the probability mass moved (need at least {need} tokens: more seeds, "
            "tokens or prompts)"
        )


def analyse(
    draws: Sequence[TokenDraw],
    *,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    sequential: bool = False,
) -> RescoreStats:
    """Decide on re-scored draws (in sampling order). The PIT's randomisation comes from
    `seed` (fixed: the same draws give the same verdict). `sequential`: the anytime-valid
    form decides (the e-process against 1/alpha, valid however often it was looked at); the
    fixed-N tests are then reported, not used."""
    pits = _Pits.of(draws, seed)
    n = len(draws)
    level = each_test_level(alpha)
    us = pits.u
    ks_p = float(stats.kstest(np.array(us), "uniform").pvalue) if len(us) else 1.0
    per_pos = {
        p: float(stats.kstest(np.array(x), "uniform").pvalue)
        for p, x in sorted(pits.by_position.items())
    }
    h, ps = np.array(pits.hits), np.array(pits.favourite_p)
    k = int(h.sum())
    directed_p = poisson_binomial_sf(k, ps) if n else 1.0
    prefix_tests = _prefix_tests(draws)
    m = len(prefix_tests)
    g_p = min(1.0, min((t.p_value for t in prefix_tests), default=1.0) * m) if m else 1.0
    e_value, crossed_at = _e_process(pits, alpha)
    ks_d, dir_d = ks_detectable(len(us), level), directed_detectable(ps, level)
    power = (
        f"over {n} tokens, a change that moves at least {ks_d:.1%} of each step's probability "
        f"mass toward one end of the token order (toward or away from the draft's favourite "
        f"token) would have been caught with {POWER:.0%} probability; so would raising the "
        f"favourite's probability by {dir_d:.1%} per token"
    )
    if sequential:
        reasons = _sequential_reasons(pits.impossible, e_value, alpha)
    else:
        reasons = _fixed_reasons(pits.impossible, ks_p, (k, ps, directed_p), g_p, level)
    if reasons:
        verdict, reason = Verdict.BROKEN, "; ".join(reasons)
    else:
        verdict = Verdict.PRESERVED
        reason = (
            f"the {n} sampled tokens are draws from the reference's distribution for their "
            f"exact prefixes as far as {n} tokens can tell (KS p = {ks_p:.2g}, favourite "
            f"p = {directed_p:.2g}, {m} repeated prefixes G-tested, alpha = {alpha})"
        )
    return RescoreStats(
        verdict=verdict, reason=reason, power=power, tokens=n, impossible=pits.impossible,
        ks_p=ks_p, directed_p=directed_p, favourite_rate=k / n if n else 0.0,
        favourite_expected=float(ps.mean()) if n else 0.0, g_prefixes=m, g_p=g_p,
        e_value=e_value, crossed_at=crossed_at, ks_detectable=ks_d,
        directed_detectable=dir_d, alpha=alpha,
        per_position=per_pos, prefix_tests=prefix_tests, u=us,
    )  # fmt: skip


@dataclass
class _Pits:
    """Per draw, in sampling order: its PIT value (nan in `u_all` for an impossible token),
    whether it was the favourite and the reference's probability of the favourite."""

    u: list[float] = field(default_factory=list)  # possible tokens only
    u_all: list[float] = field(default_factory=list)
    by_position: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    impossible: int = 0
    hits: list[float] = field(default_factory=list)
    favourite_p: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, draws: Sequence[TokenDraw], seed: int) -> _Pits:
        """The PIT's randomisation V comes from `seed`, one uniform per draw."""
        out = cls()
        v = np.random.default_rng(seed).random(len(draws))
        for d, vi in zip(draws, v, strict=True):
            u = pit(d, float(vi))
            fav = favourite_of(d)
            out.hits.append(1.0 if d.token == fav else 0.0)
            out.favourite_p.append(d.ref.probs.get(fav, 0.0) / sum(d.ref.probs.values()))
            if u is None:
                out.impossible += 1
                out.u_all.append(math.nan)
                continue
            out.u.append(u)
            out.u_all.append(u)
            out.by_position[d.position].append(u)
        return out


def _e_process(pits: _Pits, alpha: float) -> tuple[float, int | None]:
    """The e-value's running maximum and the draws until it first reached 1/alpha (None:
    never). The average of two e-processes is one: its running maximum against 1/alpha is
    valid."""
    if not pits.u_all:
        return 1.0, None
    both = np.logaddexp(
        hist_log_e(np.array(pits.u_all)),
        bet_log_e(np.array(pits.hits), np.array(pits.favourite_p)),
    ) - math.log(2)
    e_value = math.exp(min(float(np.max(both)), 700.0))
    over = np.nonzero(both >= math.log(1 / alpha))[0]
    return e_value, int(over[0]) + 1 if len(over) else None


def _sequential_reasons(impossible: int, e_value: float, alpha: float) -> list[str]:
    """BROKEN's reasons when the e-process decides (the fixed-N tests are only reported)."""
    reasons = _impossible_reasons(impossible)
    if e_value >= 1 / alpha:
        reasons.append(f"the e-process reached {e_value:.3g} >= 1/alpha = {1 / alpha:.3g}")
    return reasons


def _fixed_reasons(
    impossible: int,
    ks_p: float,
    favourite: tuple[int, np.ndarray, float],
    g_p: float,
    level: float,
) -> list[str]:
    """BROKEN's reasons from `TESTS`, each at `level`; `favourite`: (times the favourite was
    sampled, its reference probability per draw, the directed p-value)."""
    reasons = _impossible_reasons(impossible)
    k, ps, directed_p = favourite
    if ks_p < level:
        reasons.append(f"the PIT values are not uniform (KS p = {ks_p:.2g} < {level:.2g})")
    if directed_p < level:
        reasons.append(
            f"the draft's favourite was sampled {k} times where the reference expects "
            f"{ps.sum():.1f} (p = {directed_p:.2g} < {level:.2g})"
        )
    if g_p < level:
        reasons.append(f"a repeated prefix's tokens do not fit (G-test, Bonferroni p = {g_p:.2g})")
    return reasons


def _impossible_reasons(impossible: int) -> list[str]:
    if not impossible:
        return []
    return [f"{impossible} sampled token(s) have probability 0 under the reference"]


def _prefix_tests(draws: Sequence[TokenDraw]) -> list[PrefixTest]:
    groups: dict[str, list[TokenDraw]] = defaultdict(list)
    for d in draws:
        groups[d.prefix_key].append(d)
    out = []
    for key, ds in groups.items():
        if len(ds) < G_MIN_DRAWS:
            continue
        probs = ds[0].ref.probs
        total = sum(probs.values())
        n = len(ds)
        # categories with an expected count >= 1 stand alone, the rest are pooled
        big = [t for t in probs if n * probs[t] / total >= 1.0]
        counts: dict[int, int] = defaultdict(int)
        for d in ds:
            counts[d.token if d.token in big else -1] += 1
        exp = [n * probs[t] / total for t in big]
        obs = [counts[t] for t in big]
        rest = n - sum(exp)
        if rest > 1e-9:
            exp.append(rest)
            obs.append(counts[-1])
        elif counts[-1]:
            out.append(PrefixTest(key, ds[0].position, n, 0.0))
            continue
        if len(exp) < 2:
            continue
        g = stats.power_divergence(obs, exp, lambda_="log-likelihood")
        out.append(PrefixTest(key, ds[0].position, n, float(g.pvalue)))
    return out


def null_false_alarms(
    runs: int, tokens: int, *, vocab: int = 8, alpha: float = DEFAULT_ALPHA, seed: int = 0
) -> tuple[int, tuple[float, float]]:
    """Simulate `runs` re-scored runs whose tokens really are drawn from the reference
    (random distributions, a few repeated prefixes), and count BROKEN verdicts: the test's
    false-alarm rate, with its 95 % Clopper-Pearson interval (`scipy.stats.binomtest`)."""
    rng = np.random.default_rng(seed)
    alarms = 0
    for r in range(runs):
        # position 0 shares one distribution (a repeated prefix, G-tested); later positions
        # each have their own, as long generations do
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
    "TESTS",
    "PrefixTest",
    "RescoreStats",
    "analyse",
    "check_enough",
    "each_test_level",
    "favourite_of",
    "null_false_alarms",
    "order",
    "pit",
    "poisson_binomial_sf",
]
