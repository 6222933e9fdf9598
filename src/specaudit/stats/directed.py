"""The directed test: a one-degree-of-freedom score test toward a given alternative (a leak
toward the draft model), far more powerful against that deviation than the omnibus G-test, and
the smallest such shift it detects with a given power."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import optimize
from scipy import stats as st

from specaudit.stats.base import MC_DRAWS, TINY_P, GofResult, mc_pvalue

__all__ = ["MC_BUDGET", "SKEW_LIMIT", "directed_test", "min_detectable_shift"]

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
    mc_stop_hits: int = 0,
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
    `mc_stop_hits` > 0: sequential Monte-Carlo (`mc_pvalue`), up to `mc_draws` draws.
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
    tol = 1e-9 * max(1.0, abs(t))
    chunk = max(1, int(2e6 // max(1, min(len(v), n))))
    cum = np.cumsum(pi)
    cum[-1] = 1.0

    def simulate(m: int, rng: np.random.Generator) -> np.ndarray:
        if len(v) <= n:
            return np.asarray(rng.multinomial(n, pi, size=m) @ v)
        idx = np.searchsorted(cum, rng.random((m, n)), side="right")
        return np.asarray(v[np.minimum(idx, len(v) - 1)].sum(axis=1))

    p_value, _, hits = mc_pvalue(
        t - tol, simulate, mc_draws, stop_hits=mc_stop_hits, seed=seed, chunk=chunk
    )
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
