"""Total-variation distance between an engine's and the true distribution: a two-sided
confidence interval for one distribution, and a certified one-sided bound on a TV averaged over
conditioning contexts (what PRESERVED and WITHIN TOLERANCE certify)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from scipy import optimize
from scipy import stats as st

from specaudit.stats.base import TvBound, TvInterval, normalise

__all__ = [
    "clopper_pearson",
    "conditional_tv_bound",
    "deviation_bound",
    "samples_needed",
    "sequence_tv_bound",
    "tv_distance",
    "tv_interval",
]


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
    o, p = _pool_forbidden(*normalise(counts, probs))
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
        o, p = normalise(observed, probs)
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


def sequence_tv_bound(uppers: Sequence[float], n: int, alpha: float) -> float:
    """Upper bound, at confidence 1 - alpha, on the TV between the engine's and the target's
    distribution of the whole sequence of tested positions, from per-position bounds
    `uppers` on the prefix-averaged next-token TV (observed prefixes' weights) that hold
    together at 1 - alpha / 2.

    Why: TV of a sequence is at most the sum over positions of the expected next-token TV
    given the engine's prefix (the hybrid argument: swap one position's conditional at a
    time). The observed prefixes' average g of sum_t TV_t, a mean of n i.i.d. values in
    [0, P] (P positions), is within P sqrt(ln(2 / alpha) / 2n) of its expectation with
    probability 1 - alpha / 2 (Hoeffding). At most 1."""
    if n <= 0 or not uppers:
        return 1.0
    margin = len(uppers) * math.sqrt(math.log(2.0 / alpha) / (2.0 * n))
    return float(min(1.0, sum(uppers) + margin))
