"""Goodness of fit: is a sample of counts (possibly in several strata) drawn from known
probabilities? The G-test, its exact and Monte-Carlo references for small counts, pooling of
sparse cells, and the exact tail bound used beyond every simulation."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import special
from scipy import stats as st

from specaudit.stats.base import MC_DRAWS, TINY_P, GofResult, mc_pvalue, normalise

__all__ = [
    "EXACT_LIMIT",
    "METHODS",
    "MIN_EXPECTED",
    "g_statistic",
    "multinomial_gof",
    "pool_sparse",
    "stratified_gof",
]

METHODS = ("auto", "g-test", "pooled", "exact", "monte-carlo")
MIN_EXPECTED = 5.0
EXACT_LIMIT = 200_000  # largest number of outcomes the exact test enumerates


def g_statistic(
    observed: Sequence[float] | np.ndarray, expected: Sequence[float] | np.ndarray
) -> float:
    """G = 2 * sum o * ln(o / e) over cells with o > 0 (expected counts, not probabilities)."""
    o = np.asarray(observed, dtype=float)
    e = np.asarray(expected, dtype=float)
    m = o > 0
    if np.any(e[m] <= 0):
        return math.inf
    return float(2.0 * np.sum(o[m] * np.log(o[m] / e[m])))


def _g_rows(obs: np.ndarray, logp: np.ndarray, n: int) -> np.ndarray:
    """G for each row of a count matrix against log-probabilities `logp` (all > -inf)."""
    o = obs.astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(o > 0, o * (np.log(o) - logp - math.log(n)), 0.0)
    return np.asarray(2.0 * terms.sum(axis=-1))


def _williams(n: int, k: int) -> float:
    return 1.0 + (k * k - 1.0) / (6.0 * n * (k - 1.0)) if k > 1 and n > 0 else 1.0


def pool_sparse(
    observed: Sequence[int] | np.ndarray,
    probs: Sequence[float] | np.ndarray,
    min_expected: float = MIN_EXPECTED,
) -> tuple[np.ndarray, np.ndarray]:
    """Merge the sparsest cells until every expected count reaches `min_expected`.

    Cells are merged smallest-expected first into one pool; if the pool is still too small it
    absorbs the next smallest cell. Returns (observed, probs) of the pooled cells (possibly a
    single cell, which then carries no information).
    """
    oa = np.asarray(observed, dtype=float)
    pa = np.asarray(probs, dtype=float)
    n = float(oa.sum())
    order = np.argsort(pa * n, kind="stable")
    o: list[float] = [float(x) for x in oa[order]]
    p: list[float] = [float(x) for x in pa[order]]
    while len(p) > 1 and p[0] * n < min_expected:
        o = [o[0] + o[1], *o[2:]]
        p = [p[0] + p[1], *p[2:]]
        # keep the pool at the front while it is the sparsest cell
        idx = sorted(range(len(p)), key=lambda i: p[i])
        o, p = [o[i] for i in idx], [p[i] for i in idx]
    return np.asarray(o), np.asarray(p)


def _compositions(n: int, k: int) -> np.ndarray:
    """Every vector of k non-negative integers summing to n (stars and bars), as rows."""
    if k == 1:
        return np.array([[n]])
    bars = np.array(list(itertools.combinations(range(n + k - 1), k - 1)), dtype=np.int64)
    padded = np.hstack([np.full((len(bars), 1), -1), bars, np.full((len(bars), 1), n + k - 1)])
    return np.diff(padded, axis=1) - 1


def _exact_pvalue(obs: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """Exact multinomial test: P(G >= G_obs) summed over every possible outcome, as
    (p-value, log10 of it). Summed in log space: the tail of a possible outcome is at least its
    own probability, never 0, however far below the smallest float it lies; the float is then
    floored at TINY_P, an upper bound of the true value (so still a valid p-value)."""
    n, k = int(obs.sum()), len(obs)
    xs = _compositions(n, k)
    logp = np.log(p)
    g_all = _g_rows(xs, logp, n)
    g_obs = float(_g_rows(obs[None, :], logp, n)[0])
    logpmf = special.gammaln(n + 1) - special.gammaln(xs + 1).sum(axis=1) + (xs * logp).sum(axis=1)
    tol = 1e-9 * max(1.0, abs(g_obs))
    log_tail = min(0.0, float(special.logsumexp(logpmf[g_all >= g_obs - tol])))
    return max(math.exp(log_tail), TINY_P), log_tail / math.log(10.0)


def stratified_gof(
    strata: Sequence[tuple[Sequence[int] | np.ndarray, Sequence[float] | np.ndarray]],
    method: str = "auto",
    *,
    min_expected: float = MIN_EXPECTED,
    exact_limit: int = EXACT_LIMIT,
    mc_draws: int = MC_DRAWS,
    mc_stop_hits: int = 0,
    seed: int = 0,
) -> GofResult:
    """G-test of several independent multinomials, each against its own known distribution.

    `strata` is a list of (observed counts, true probabilities) over the same or different
    cells. `method`: "auto" (asymptotic if every expected count >= `min_expected`, else exact
    for one enumerable stratum, else Monte-Carlo), or force "g-test", "pooled", "exact",
    "monte-carlo". Monte-Carlo uses a fixed `seed`, so results are reproducible;
    `mc_stop_hits` > 0 makes it sequential (`mc_pvalue`: up to `mc_draws` draws, stopping at
    that many hits), so a large `mc_draws` costs little unless the statistic is extreme.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} (one of {', '.join(METHODS)})")
    c = _clean(strata)
    if c.impossible:
        return GofResult(
            math.inf, c.df_all, 0.0, "impossible", c.n_total, len(c.strata), 0.0, c.impossible
        )
    if not c.strata:
        return GofResult(0.0, 0, 1.0, "trivial", c.n_total, 0, math.inf)
    if method == "auto":
        method = _auto_method(c, min_expected, exact_limit)
    if method in ("g-test", "pooled"):
        return _asymptotic(c, method, min_expected)
    if method == "exact":
        return _exact(c, exact_limit)
    return _monte_carlo(c, mc_draws, mc_stop_hits, seed)


@dataclass(frozen=True)
class _Strata:
    """The strata as tested: cells of probability 0 taken out (their counts are `impossible`),
    strata without counts or with one cell left out (they carry no information)."""

    strata: list[tuple[np.ndarray, np.ndarray]]
    n_total: int  # every count given
    impossible: int  # counts in cells of probability 0
    df_all: int  # degrees of freedom of every stratum given

    @property
    def df(self) -> int:
        return sum(len(p) - 1 for _, p in self.strata)

    @property
    def n_used(self) -> int:
        return int(sum(o.sum() for o, _ in self.strata))

    @property
    def min_expected(self) -> float:
        return min(float((o.sum() * p).min()) for o, p in self.strata)


def _clean(
    strata: Sequence[tuple[Sequence[int] | np.ndarray, Sequence[float] | np.ndarray]],
) -> _Strata:
    cleaned: list[tuple[np.ndarray, np.ndarray]] = []
    n_total = impossible = df_all = 0
    for observed, probs in strata:
        o, p = normalise(observed, probs)
        n_total += int(o.sum())
        zero = p <= 0
        impossible += int(o[zero].sum())
        o, p = o[~zero], p[~zero]
        df_all += max(len(p) - 1, 0)
        if o.sum() > 0 and len(p) > 1:
            cleaned.append((o, p))
    return _Strata(cleaned, n_total, impossible, df_all)


def _auto_method(c: _Strata, min_expected: float, exact_limit: int) -> str:
    """Asymptotic when every expected count is large enough, else exact when one stratum's
    outcomes can be enumerated, else Monte-Carlo."""
    if c.min_expected >= min_expected:
        return "g-test"
    if len(c.strata) == 1 and _n_outcomes(c.strata[0]) <= exact_limit:
        return "exact"
    return "monte-carlo"


def _asymptotic(c: _Strata, method: str, min_expected: float) -> GofResult:
    """The G-test with Williams' correction against chi-square ("pooled": sparse cells of
    each stratum merged first, `pool_sparse`)."""
    g = 0.0
    df = 0
    me = math.inf
    for o, p in c.strata:
        if method == "pooled":
            o2, p2 = pool_sparse(o, p, min_expected)
        else:
            o2, p2 = o.astype(float), p
        k = len(p2)
        if k < 2:
            continue
        n = float(o2.sum())
        g += g_statistic(o2, n * p2) / _williams(int(n), k)
        df += k - 1
        me = min(me, float((n * p2).min()))
    if df == 0:
        return GofResult(0.0, 0, 1.0, "trivial", c.n_total, 0, me)
    p_value = max(float(st.chi2.sf(g, df)), TINY_P)
    return GofResult(g, df, p_value, method, c.n_used, len(c.strata), me)


def _exact(c: _Strata, exact_limit: int) -> GofResult:
    """The exact multinomial test of one stratum (every outcome enumerated)."""
    if len(c.strata) != 1:
        raise ValueError("the exact test takes a single stratum")
    o, p = c.strata[0]
    if _n_outcomes((o, p)) > exact_limit:
        raise ValueError("too many outcomes to enumerate; use monte-carlo")
    g = g_statistic(o, o.sum() * p)
    pv, log10_p = _exact_pvalue(o, p)
    return GofResult(g, c.df, pv, "exact", c.n_used, 1, c.min_expected, log10_p=log10_p)


def _monte_carlo(c: _Strata, mc_draws: int, mc_stop_hits: int, seed: int) -> GofResult:
    """The summed G statistic against its null simulated (sequentially if `mc_stop_hits`)."""
    g_obs = 0.0
    for o, p in c.strata:
        g_obs += float(_g_rows(o[None, :], np.log(p), int(o.sum()))[0])
    tol = 1e-9 * max(1.0, abs(g_obs))

    def simulate(m: int, rng: np.random.Generator) -> np.ndarray:
        sims = np.zeros(m)
        for o, p in c.strata:
            n = int(o.sum())
            sims += _g_rows(rng.multinomial(n, p, size=m), np.log(p), n)
        return sims

    if mc_stop_hits > 0:
        p_value, _, hits = mc_pvalue(
            g_obs - tol, simulate, mc_draws, stop_hits=mc_stop_hits, seed=seed, chunk=2000
        )
    else:
        sims = simulate(mc_draws, np.random.default_rng(seed))
        hits = int(np.count_nonzero(sims >= g_obs - tol))
        p_value = (1 + hits) / (mc_draws + 1)
    if hits == 0:
        # Beyond every simulation: the simulated p-value is only a floor. The method of types
        # bounds the tail exactly: P(G/2 >= t) <= (number of possible count vectors) * e^-t.
        # Using it only when no simulation reached G keeps the p-value valid at every level.
        p_value = max(min(p_value, _types_bound(g_obs, c.strata)), TINY_P)
    return GofResult(g_obs, c.df, p_value, "monte-carlo", c.n_used, len(c.strata), c.min_expected)


def _types_bound(g: float, strata: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
    """Exact (non-asymptotic) upper bound on P(sum of G >= g) under the null.

    G/2 = n KL(empirical || p), and P(empirical = type) <= exp(-n KL), so
    E[exp(G/2)] <= number of types; independent strata multiply; Markov does the rest.
    """
    log_types = sum(
        math.lgamma(int(o.sum()) + len(p)) - math.lgamma(int(o.sum()) + 1) - math.lgamma(len(p))
        for o, p in strata
    )
    return float(min(1.0, math.exp(min(0.0, log_types - g / 2.0))))


def _n_outcomes(stratum: tuple[np.ndarray, np.ndarray]) -> int:
    o, p = stratum
    return math.comb(int(o.sum()) + len(p) - 1, len(p) - 1)


def multinomial_gof(
    observed: Sequence[int] | np.ndarray,
    probs: Sequence[float] | np.ndarray,
    method: str = "auto",
    **kw: int | float,
) -> GofResult:
    """Goodness of fit of one sample of counts against known probabilities (see stratified_gof)."""
    return stratified_gof([(observed, probs)], method, **kw)  # type: ignore[arg-type]
