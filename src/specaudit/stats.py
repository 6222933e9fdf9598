"""The statistics behind `specaudit dist`: does an engine sample from a known distribution?

Why these choices:

- **Goodness of fit** is a likelihood-ratio (G) test. The asymptotic chi-square reference is
  only trusted when every expected cell count is at least 5 (with Williams' correction, which
  keeps the G-test honest at moderate counts). Below that the p-value comes from the exact
  multinomial distribution when it can be enumerated, otherwise from a Monte-Carlo simulation
  of the same statistic under the null, so small counts never get an asymptotic p-value they
  have not earned. Pooling sparse cells is offered as an explicit method.
- **Strata**: later positions are tested conditionally on what came before. Each conditioning
  context is a stratum with its own expected distribution; under the null the strata are
  independent multinomials given their sizes, so their G statistics add up (and so do their
  degrees of freedom, or their simulated nulls).
- **Impossible outcomes**: a token whose true probability is exactly zero cannot be sampled by a
  correct engine, whatever the sample size. Observing one gives p = 0 and a BROKEN verdict with
  certainty; no asymptotics involved.
- **Effect size**: the total-variation distance with a simultaneous confidence interval built
  from per-cell Clopper-Pearson bounds (Bonferroni over cells): the interval covers every
  distribution consistent with those bounds, so it is conservative and valid for any n.
- **Certified TV**: a one-sided upper bound on a *prefix-averaged* TV, sum over contexts c of
  (n_c / n) TV(q_c, p_c): the plug-in estimate plus the largest deviation of a mean of n
  independent Bernoullis at level alpha, whatever their probabilities (`deviation_bound`,
  from Hoeffding's 1956 comparison with the binomial). Valid for any n and any number of
  contexts: the union over cell subsets is not needed, because the subset that attains the
  true TV is fixed (unknown, but not chosen from the data).
- **Directed test**: a one-degree-of-freedom score test toward a given alternative direction
  (`directed_test`): the total score of n independent samples, whose null distribution is known
  exactly (a finite distribution of one sample's score), Monte-Carlo or normal.
- **Verdicts**: BROKEN when a Holm-corrected test rejects at alpha; PRESERVED only when nothing
  rejects *and* the data rule out a TV above a stated tolerance (an equivalence statement: absence
  of evidence is not evidence of absence); WITHIN TOLERANCE when only the latter was certified
  (sequential mode stops there); otherwise INCONCLUSIVE.
- **Sequential**: an e-process (a product of predictive likelihood ratios, with a Dirichlet
  mixture as the alternative) is a test martingale under the null, so by Ville's inequality
  stopping the first time it exceeds 1/alpha keeps the false-alarm rate at most alpha however
  often one looks.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from scipy import optimize, special
from scipy import stats as st

from specaudit.outcome import Outcome

__all__ = [
    "DirectedEProcess",
    "EProcess",
    "GofResult",
    "mixed_log_e",
    "TvBound",
    "TvInterval",
    "Verdict",
    "alpha_spending",
    "clopper_pearson",
    "conditional_tv_bound",
    "decide",
    "deviation_bound",
    "directed_test",
    "g_statistic",
    "holm",
    "min_detectable_shift",
    "multinomial_gof",
    "pool_sparse",
    "samples_needed",
    "stratified_gof",
    "tv_distance",
    "tv_interval",
]

METHODS = ("auto", "g-test", "pooled", "exact", "monte-carlo")
MIN_EXPECTED = 5.0
EXACT_LIMIT = 200_000  # largest number of outcomes the exact test enumerates
MC_DRAWS = 10_000  # p-value resolution 1e-4: enough for alpha >= 1e-3
_PROB_TOL = 1e-9
# Smallest positive float: a p-value that underflowed is tiny, not zero. Zero is reserved for
# outcomes that are impossible under the null (certainty, not strong evidence).
TINY_P = 5e-324


class Verdict(StrEnum):
    PRESERVED = "PRESERVED"
    BROKEN = "BROKEN"
    INCONCLUSIVE = "INCONCLUSIVE"
    # TV within the tolerance is certified, but not that the tests could have seen smaller
    # deviations (sequential mode's early stop): a pass, weaker than PRESERVED
    WITHIN_TOLERANCE = "WITHIN TOLERANCE"

    @property
    def outcome(self) -> Outcome:
        """PRESERVED, WITHIN TOLERANCE -> OK; BROKEN -> FINDING; INCONCLUSIVE -> NO_DECISION."""
        return {
            Verdict.PRESERVED: Outcome.OK,
            Verdict.WITHIN_TOLERANCE: Outcome.OK,
            Verdict.BROKEN: Outcome.FINDING,
            Verdict.INCONCLUSIVE: Outcome.NO_DECISION,
        }[self]


@dataclass(frozen=True)
class GofResult:
    """One goodness-of-fit test (possibly over several strata)."""

    statistic: float  # G summed over strata (Williams-corrected for "g-test"); inf if impossible
    df: int
    p_value: float
    method: str  # "g-test", "pooled", "exact", "monte-carlo", "impossible", "trivial"
    n: int  # observations
    n_strata: int  # strata that carried information (n > 0 and more than one possible outcome)
    min_expected: float  # smallest expected cell count among the tested cells
    impossible: int = 0  # observations of zero-probability outcomes


@dataclass(frozen=True)
class TvInterval:
    """Total-variation distance between the engine's and the true distribution."""

    estimate: float
    lower: float
    upper: float
    confidence: float  # e.g. 0.99: simultaneous over all cells involved


@dataclass(frozen=True)
class TvBound:
    """One-sided upper confidence bound on a prefix-averaged TV (see `conditional_tv_bound`)."""

    estimate: float  # plug-in: sum over contexts of (n_c / n) TV(empirical_c, p_c)
    upper: float
    confidence: float  # 1 - alpha of this bound
    n: int
    contexts: int  # contexts with at least one observation
    margin: float  # upper - estimate before clipping at 1: deviation_bound(n, alpha)


# ---------------------------------------------------------------------------------------------
# goodness of fit


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


def _exact_pvalue(obs: np.ndarray, p: np.ndarray) -> float:
    """Exact multinomial test: P(G >= G_obs) summed over every possible outcome."""
    n, k = int(obs.sum()), len(obs)
    xs = _compositions(n, k)
    logp = np.log(p)
    g_all = _g_rows(xs, logp, n)
    g_obs = float(_g_rows(obs[None, :], logp, n)[0])
    logpmf = special.gammaln(n + 1) - special.gammaln(xs + 1).sum(axis=1) + (xs * logp).sum(axis=1)
    tol = 1e-9 * max(1.0, abs(g_obs))
    return float(min(1.0, np.exp(logpmf[g_all >= g_obs - tol]).sum()))


def _normalise(
    observed: Sequence[int] | np.ndarray, probs: Sequence[float] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    o = np.asarray(observed, dtype=np.int64)
    p = np.asarray(probs, dtype=float)
    if o.shape != p.shape or o.ndim != 1:
        raise ValueError("observed and probs must be 1-D arrays of the same length")
    if np.any(o < 0) or np.any(p < 0):
        raise ValueError("counts and probabilities must be non-negative")
    s = p.sum()
    if not abs(s - 1.0) <= 1e-6:
        raise ValueError(f"probabilities sum to {s}, not 1")
    return o, p / s


def stratified_gof(
    strata: Sequence[tuple[Sequence[int] | np.ndarray, Sequence[float] | np.ndarray]],
    method: str = "auto",
    *,
    min_expected: float = MIN_EXPECTED,
    exact_limit: int = EXACT_LIMIT,
    mc_draws: int = MC_DRAWS,
    seed: int = 0,
) -> GofResult:
    """G-test of several independent multinomials, each against its own known distribution.

    `strata` is a list of (observed counts, true probabilities) over the same or different
    cells. `method`: "auto" (asymptotic if every expected count >= `min_expected`, else exact
    for one enumerable stratum, else Monte-Carlo), or force "g-test", "pooled", "exact",
    "monte-carlo". Monte-Carlo uses a fixed `seed`, so results are reproducible.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} (one of {', '.join(METHODS)})")
    cleaned: list[tuple[np.ndarray, np.ndarray]] = []
    n_total = 0
    impossible = 0
    df_all = 0
    for observed, probs in strata:
        o, p = _normalise(observed, probs)
        n_total += int(o.sum())
        zero = p <= 0
        impossible += int(o[zero].sum())
        o, p = o[~zero], p[~zero]
        df_all += max(len(p) - 1, 0)
        if o.sum() > 0 and len(p) > 1:
            cleaned.append((o, p))
    if impossible:
        return GofResult(
            math.inf, df_all, 0.0, "impossible", n_total, len(cleaned), 0.0, impossible
        )
    if not cleaned:
        return GofResult(0.0, 0, 1.0, "trivial", n_total, 0, math.inf)
    df = sum(len(p) - 1 for _, p in cleaned)
    min_e = min(float((o.sum() * p).min()) for o, p in cleaned)
    n_used = int(sum(o.sum() for o, _ in cleaned))

    if method == "auto":
        if min_e >= min_expected:
            method = "g-test"
        elif len(cleaned) == 1 and _n_outcomes(cleaned[0]) <= exact_limit:
            method = "exact"
        else:
            method = "monte-carlo"

    if method in ("g-test", "pooled"):
        g = 0.0
        df = 0
        me = math.inf
        for o, p in cleaned:
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
            return GofResult(0.0, 0, 1.0, "trivial", n_total, 0, me)
        p_value = max(float(st.chi2.sf(g, df)), TINY_P)
        return GofResult(g, df, p_value, method, n_used, len(cleaned), me)

    if method == "exact":
        if len(cleaned) != 1:
            raise ValueError("the exact test takes a single stratum")
        o, p = cleaned[0]
        if _n_outcomes((o, p)) > exact_limit:
            raise ValueError("too many outcomes to enumerate; use monte-carlo")
        g = g_statistic(o, o.sum() * p)
        return GofResult(g, df, _exact_pvalue(o, p), "exact", n_used, 1, min_e)

    # Monte-Carlo: simulate the summed G statistic under the null.
    rng = np.random.default_rng(seed)
    g_obs = 0.0
    sims = np.zeros(mc_draws)
    for o, p in cleaned:
        n = int(o.sum())
        logp = np.log(p)
        g_obs += float(_g_rows(o[None, :], logp, n)[0])
        sims += _g_rows(rng.multinomial(n, p, size=mc_draws), logp, n)
    tol = 1e-9 * max(1.0, abs(g_obs))
    hits = int(np.count_nonzero(sims >= g_obs - tol))
    p_value = (1 + hits) / (mc_draws + 1)
    if hits == 0:
        # Beyond every simulation: the simulated p-value is only a floor. The method of types
        # bounds the tail exactly: P(G/2 >= t) <= (number of possible count vectors) * e^-t.
        # Using it only when no simulation reached G keeps the p-value valid at every level.
        p_value = max(min(p_value, _types_bound(g_obs, cleaned)), TINY_P)
    return GofResult(g_obs, df, p_value, "monte-carlo", n_used, len(cleaned), min_e)


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


# ---------------------------------------------------------------------------------------------
# total variation


def tv_distance(q: Sequence[float] | np.ndarray, p: Sequence[float] | np.ndarray) -> float:
    return float(0.5 * np.abs(np.asarray(q, dtype=float) - np.asarray(p, dtype=float)).sum())


def clopper_pearson(k: int | np.ndarray, n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Exact two-sided (1 - alpha) binomial interval(s) for k successes out of n."""
    kk = np.asarray(k, dtype=float)
    if n <= 0:
        return np.zeros_like(kk), np.ones_like(kk)
    with np.errstate(invalid="ignore"):
        lo = np.where(kk > 0, st.beta.ppf(alpha / 2, kk, n - kk + 1), 0.0)
        hi = np.where(kk < n, st.beta.ppf(1 - alpha / 2, kk + 1, n - kk), 1.0)
    return np.asarray(lo, dtype=float), np.asarray(hi, dtype=float)


def _tv_bounds(lo: np.ndarray, hi: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """Smallest and largest TV(q, p) over q in the box [lo, hi] intersected with the simplex."""
    k = len(p)
    lo = np.minimum(lo, hi)
    # min: TV = sum (q - p)^+ = sum (p - q)^+ >= max(sum (lo - p)^+, sum (p - hi)^+), and that
    # bound is attained (the cells whose interval contains p absorb the difference).
    low = max(float(np.clip(lo - p, 0, None).sum()), float(np.clip(p - hi, 0, None).sum()))
    # max: TV = max_S q(S) - p(S), and max q(S) = min(hi(S), 1 - lo(S^c)), so
    # TV_max = max_S min(sum_S (hi - p), sum_{S^c} (p - lo)). Exact by enumeration for small k,
    # else its LP relaxation (x in [0, 1]), which can only overstate it (conservative).
    a = hi - p
    b = p - lo
    if k <= 16:
        masks = ((np.arange(1 << k)[:, None] >> np.arange(k)) & 1).astype(bool)
        up = float(np.max(np.minimum(masks @ a, (~masks) @ b)))
    else:
        # maximise t s.t. t <= a.x, t <= b.(1 - x), 0 <= x <= 1
        c2 = np.concatenate([np.zeros(k), [-1.0]])
        a_ub2 = np.vstack([np.concatenate([-a, [1.0]]), np.concatenate([b, [1.0]])])
        res2 = optimize.linprog(
            c2,
            A_ub=a_ub2,
            b_ub=[0.0, float(b.sum())],
            bounds=[(0, 1)] * k + [(None, None)],
            method="highs",
        )
        up = float(-res2.fun) if res2.status == 0 else 1.0
    return max(0.0, low), float(min(1.0, max(up, low)))


def _pool_forbidden(o: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge all zero-probability cells into one: TV is unchanged (|q_j - 0| adds up), and the
    confidence box needs one cell less per forbidden token."""
    zero = p <= 0
    if zero.sum() <= 1:
        return o, p
    return np.append(o[~zero], o[zero].sum()), np.append(p[~zero], 0.0)


def tv_interval(
    counts: Sequence[int] | np.ndarray, probs: Sequence[float] | np.ndarray, alpha: float
) -> TvInterval:
    """TV between the empirical and true distribution, with a (1 - alpha) confidence interval.

    Two valid intervals, each at alpha / 2, intersected (so the result keeps 1 - alpha):
    - a box: every cell gets a Clopper-Pearson interval at alpha / (2k), and the TV interval
      spans every distribution inside it (tight when there are few cells);
    - a uniform one: TV(q, q_hat) = max over cell subsets S of q_hat(S) - q(S), each a binomial
      mean, so Hoeffding plus a union bound over the 2^k - 2 subsets gives
      |TV_hat - TV| <= sqrt(ln((2^k - 2) / (alpha / 2)) / (2n)) (better with many cells).
    Zero-probability cells are pooled into one (TV is unchanged, an engine may put mass there).
    Valid for any n: conservative rather than asymptotic.
    """
    o, p = _pool_forbidden(*_normalise(counts, probs))
    n = int(o.sum())
    if n == 0:
        return TvInterval(math.nan, 0.0, 1.0, 1 - alpha)
    k = len(p)
    est = tv_distance(o / n, p)
    lo, hi = clopper_pearson(o, n, alpha / (2 * k))
    low, up = _tv_bounds(lo, hi, p)
    if k >= 2:
        eps = math.sqrt(math.log(max(2**k - 2, 1) / (alpha / 2)) / (2 * n))
        low, up = max(low, est - eps), min(up, est + eps)
    return TvInterval(est, max(0.0, low), min(1.0, max(up, low)), 1 - alpha)


# ---------------------------------------------------------------------------------------------
# certified (one-sided) bounds on a prefix-averaged TV


@functools.lru_cache(maxsize=1024)
def deviation_bound(n: int, alpha: float) -> float:
    """Smallest eps with P(S <= sum(p_i) - n eps) <= alpha for every S = X_1 + ... + X_n of
    independent Bernoulli(p_i), whatever the p_i.

    Hoeffding (1956, "On the distribution of the number of successes in independent trials",
    Theorem 4): P(S <= b) <= P(Binomial(n, mean p) <= b) whenever b <= n mean(p) - 1, which holds
    here once eps >= 1/n. So eps is set by the worst binomial, sup over theta of
    P(Bin(n, theta) <= n theta - n eps), taken over a grid rigorously (on [theta_j, theta_j+1]
    the tail is at most P(Bin(n, theta_j) <= n theta_j+1 - n eps): the cdf falls in theta, the
    cut-off rises). Never above Hoeffding's inequality's sqrt(ln(1/alpha) / 2n), which is also
    the fallback. About 18 % below it for alpha around 1e-3.
    """
    if n <= 0:
        return 1.0
    if not 0 < alpha < 1:
        raise ValueError("alpha must be in (0, 1)")
    hoeffding = min(1.0, math.sqrt(math.log(1.0 / alpha) / (2.0 * n)))
    grid = min(max(2 * n, 1000), 20_000)
    theta = np.linspace(0.0, 1.0, grid + 1)

    def worst(eps: float) -> float:
        cut = np.floor(n * theta[1:] - n * eps + 1e-9)
        return float(np.max(np.where(cut >= 0, st.binom.cdf(cut, n, theta[:-1]), 0.0)))

    lo, hi = 1.0 / n, hoeffding
    if lo >= hi or worst(hi) > alpha:
        return max(hoeffding, lo)
    if worst(lo) <= alpha:
        return lo
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if worst(mid) <= alpha:
            hi = mid
        else:
            lo = mid
        if hi - lo < 1e-6:
            break
    return hi


def conditional_tv_bound(
    strata: Sequence[tuple[Sequence[int] | np.ndarray, Sequence[float] | np.ndarray]],
    alpha: float,
) -> TvBound:
    """One-sided (1 - alpha) upper bound on D = sum_c (n_c / n) TV(q_c, p_c).

    `strata`: per context c, the observed counts (from the unknown q_c) and the true p_c; the
    weights are the contexts' observed frequencies, and the bound holds conditionally on them
    (given the contexts, the observations are independent). Why it is valid: with S_c the
    set where q_c > p_c, TV(q_c, p_c) = q_c(S_c) - p_c(S_c) and the plug-in TV(q^_c, p_c) is at
    least q^_c(S_c) - p_c(S_c), so D - D^ <= (1/n) sum_i (q(S) - 1[x_i in S]) over the n
    observations, a mean of independent centred Bernoullis: at most `deviation_bound(n, alpha)`
    with probability 1 - alpha. No union over subsets or contexts: the S_c are fixed. The
    plug-in's upward bias (about sqrt(k / n_c) per context) only makes it conservative.
    """
    n = 0
    acc = 0.0
    contexts = 0
    for observed, probs in strata:
        o, p = _normalise(observed, probs)
        m = int(o.sum())
        if m == 0:
            continue
        contexts += 1
        n += m
        acc += m * tv_distance(o / m, p)
    if n == 0:
        return TvBound(math.nan, 1.0, 1 - alpha, 0, 0, 1.0)
    est = acc / n
    eps = deviation_bound(n, alpha)
    return TvBound(est, min(1.0, est + eps), 1 - alpha, n, contexts, eps)


def samples_needed(n: int, upper: float, tolerance: float) -> int:
    """About how many samples bring a bound `upper` (from n samples) within `tolerance`, if it
    shrinks like 1/sqrt(n) (sampling noise and the plug-in's bias both do)."""
    if upper <= tolerance:
        return n
    return int(math.ceil(n * (upper / tolerance) ** 2))


# ---------------------------------------------------------------------------------------------
# directed (one degree of freedom) test

SKEW_LIMIT = 0.05  # normal reference when |skewness of the total score| <= this, else simulate
MC_BUDGET = 4e7  # largest draws x min(outcomes, n) simulated; beyond it the normal reference


def directed_test(
    observed: float,
    n: int,
    values: Sequence[float] | np.ndarray,
    probs: Sequence[float] | np.ndarray,
    *,
    contexts: int = 0,
    method: str = "auto",
    mc_draws: int = MC_DRAWS,
    seed: int = 0,
) -> GofResult:
    """One-sided test that a total score is too large: `observed` = sum of n independent
    scores, each distributed under the null as `values` with probabilities `probs` (mean 0).

    The score of a one-parameter alternative p + lambda (d - p) at lambda = 0 (a score test,
    one degree of freedom, locally most powerful toward d). Reference: "normal" when the total's
    skewness (that of one score over sqrt(n)) is at most SKEW_LIMIT, where the normal tail is
    accurate to a few percent at the levels used; otherwise "monte-carlo", the exact null
    simulated (`mc_draws` totals, fixed seed), p = (1 + hits) / (1 + draws), and beyond every
    simulation the Bernstein bound exp(-t^2 / (2 (n var + b t / 3))) (b the largest score) if
    smaller: valid at every level. `statistic` is z = observed / sqrt(n var).
    """
    if method not in ("auto", "normal", "monte-carlo"):
        raise ValueError(f"unknown method {method!r}")
    v = np.asarray(values, dtype=float)
    pi = np.asarray(probs, dtype=float)
    if v.shape != pi.shape or v.ndim != 1 or len(v) == 0:
        raise ValueError("values and probs must be 1-D arrays of the same length")
    pi = pi / pi.sum()
    mu = float(pi @ v)
    v = v - mu  # exactly 0 in theory; removes rounding
    var = float(pi @ (v * v))
    if n <= 0 or var <= 1e-15:
        return GofResult(0.0, 1, 1.0, "trivial", max(n, 0), contexts, math.inf)
    sd = math.sqrt(n * var)
    t = observed - n * mu
    z = t / sd
    min_e = float(n * pi.min())
    skew = abs(float(pi @ v**3)) / var**1.5 / math.sqrt(n)
    cost = mc_draws * min(len(v), n)
    if method == "auto":
        method = "normal" if skew <= SKEW_LIMIT or cost > MC_BUDGET else "monte-carlo"
    if method == "normal":
        return GofResult(z, 1, max(float(st.norm.sf(z)), TINY_P), "normal", n, contexts, min_e)
    rng = np.random.default_rng(seed)
    tol = 1e-9 * max(1.0, abs(t))
    hits = 0
    done = 0
    chunk = max(1, int(2e6 // max(1, min(len(v), n))))
    cum = np.cumsum(pi)
    cum[-1] = 1.0
    while done < mc_draws:
        m = min(chunk, mc_draws - done)
        if len(v) <= n:
            sims = rng.multinomial(n, pi, size=m) @ v
        else:
            idx = np.searchsorted(cum, rng.random((m, n)), side="right")
            sims = v[np.minimum(idx, len(v) - 1)].sum(axis=1)
        hits += int(np.count_nonzero(sims >= t - tol))
        done += m
    p_value = (1 + hits) / (1 + mc_draws)
    if hits == 0 and t > 0:
        b = float(v.max())
        bern = math.exp(-(t * t) / (2.0 * (n * var + b * t / 3.0)))
        p_value = max(min(p_value, bern), TINY_P)
    return GofResult(z, 1, p_value, "monte-carlo", n, contexts, min_e)


def min_detectable_shift(
    n: int,
    sd0: float,
    moments: Callable[[float], tuple[float, float]],
    level: float,
    power: float = 0.8,
) -> float | None:
    """Smallest lambda in (0, 1] that a one-sided score test at `level` detects with
    probability `power`, by the normal approximation: the total of n scores has null sd
    sqrt(n) sd0 and, under lambda, mean n mu(lambda) and sd sqrt(n) sd(lambda), with
    (mu, sd) = moments(lambda). None if not even lambda = 1 reaches that power."""
    if n <= 0 or sd0 <= 0:
        return None
    crit = float(st.norm.isf(level)) * sd0 * math.sqrt(n)

    def gap(lam: float) -> float:
        mu, sd = moments(lam)
        return float(st.norm.sf((crit - n * mu) / (math.sqrt(n) * max(sd, 1e-12)))) - power

    if gap(1.0) < 0:
        return None
    return float(optimize.brentq(gap, 0.0, 1.0, xtol=1e-7))


# ---------------------------------------------------------------------------------------------
# multiple testing and verdicts


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (controls the family-wise error rate)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adj = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adj[i] = running
    return adj


def decide(
    adjusted_pvalues: Sequence[float],
    alpha: float,
    tv_uppers: Sequence[float],
    tolerance: float,
    impossible: bool = False,
) -> Verdict:
    """BROKEN if anything rejects (or an impossible outcome was seen); PRESERVED only if
    nothing rejects and every TV upper bound is within `tolerance`; else INCONCLUSIVE.

    What PRESERVED certifies is what the bounds bound: give it the bounds of every quantity the
    verdict speaks of (in `specaudit dist`: each position's prefix-averaged next-token TV and
    the joint's TV, each at 1 - alpha / m)."""
    if impossible or any(p < alpha for p in adjusted_pvalues):
        return Verdict.BROKEN
    if tv_uppers and all(u <= tolerance for u in tv_uppers):
        return Verdict.PRESERVED
    return Verdict.INCONCLUSIVE


def alpha_spending(look: int, alpha: float) -> float:
    """Error budget of the `look`-th (1-based) interim analysis: sums to alpha over all looks."""
    return alpha * 6.0 / (math.pi**2 * look * look)


# ---------------------------------------------------------------------------------------------
# sequential, anytime-valid


class EProcess:
    """Test martingale for "every token is drawn from its known conditional distribution".

    For each observed token x in context c, the e-value is multiplied by q_c(x) / p_c(x), where
    p_c is the null (true) distribution and q_c the predictive of a Dirichlet mixture fitted to
    the tokens seen so far in that context (Krichevsky-Trofimov on the null's support; a small
    prior mass on tokens the null forbids, so one such token makes the e-value infinite).
    Under the null E[q/p] = 1 at every step, hence P(sup E >= 1/alpha) <= alpha (Ville).
    """

    def __init__(self, prior: float = 0.5, off_support_prior: float = 0.1) -> None:
        self.prior = prior
        self.off_support_prior = off_support_prior
        self.log_e = 0.0
        self.steps = 0
        self.impossible = 0
        self._counts: dict[Hashable, np.ndarray] = {}

    def update(
        self, context: Hashable, probs: Sequence[float] | np.ndarray, observed: int
    ) -> float:
        """Account for one token; returns the log e-value so far."""
        p = np.asarray(probs, dtype=float)
        counts = self._counts.get(context)
        if counts is None:
            counts = np.zeros(len(p))
            self._counts[context] = counts
        support = p > 0
        n_off = int((~support).sum())
        prior = np.where(support, self.prior, self.off_support_prior / max(n_off, 1))
        q = (counts + prior) / (counts.sum() + prior.sum())
        self.steps += 1
        if p[observed] <= 0:
            self.impossible += 1
            self.log_e = math.inf
        elif math.isfinite(self.log_e):
            self.log_e += math.log(q[observed]) - math.log(p[observed])
        counts[observed] += 1
        return self.log_e

    @property
    def e_value(self) -> float:
        return math.exp(self.log_e) if self.log_e < 700 else math.inf

    def rejects(self, alpha: float) -> bool:
        return self.log_e >= math.log(1.0 / alpha)


DIRECTED_LAMBDAS = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0)


class DirectedEProcess:
    """Test martingale for one direction of deviation: p_lambda = p + lambda (d - p).

    Each token's factor is p_lambda(x) / p(x) = 1 + lambda u, with u = d(x)/p(x) - 1 (mean 0
    under p, and >= -1, so every factor is >= 0 for lambda in [0, 1]); the e-value is the
    average of the products over a grid of lambdas (an average of test martingales is one).
    Why: one parameter shared by every context pays far less for learning than the omnibus
    `EProcess`, whose per-context mixture pays in every context; a bug that leaks toward the
    draft is caught in a fraction of the samples.
    """

    def __init__(self, lambdas: Sequence[float] = DIRECTED_LAMBDAS) -> None:
        lam = np.asarray(lambdas, dtype=float)
        if lam.size == 0 or np.any(lam <= 0) or np.any(lam > 1):
            raise ValueError("lambdas must lie in (0, 1]")
        self.lambdas = lam
        self._log = np.zeros(lam.size)
        self.steps = 0

    def update(self, u: float) -> float:
        """Account for one token's score u = d(x)/p(x) - 1 (inf: the token is impossible)."""
        if not u >= -1.0:
            raise ValueError(f"score {u} < -1: not d(x)/p(x) - 1")
        self.steps += 1
        if math.isinf(u):
            self._log[:] = math.inf
        else:
            with np.errstate(divide="ignore"):
                self._log += np.log1p(self.lambdas * u)  # lambda = 1, u = -1: that member is 0
        return self.log_e

    @property
    def log_e(self) -> float:
        if np.all(np.isneginf(self._log)):
            return -math.inf
        return float(np.logaddexp.reduce(self._log) - math.log(self.lambdas.size))


def mixed_log_e(*log_es: float) -> float:
    """log of the average of e-processes: still an e-process (Ville holds for the average)."""
    return float(np.logaddexp.reduce(np.asarray(log_es, dtype=float)) - math.log(len(log_es)))
