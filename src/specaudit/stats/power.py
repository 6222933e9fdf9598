"""What a verdict could have seen: the smallest deviation, in any direction, that the omnibus
chi-square-type tests detect with a given power.

Why TV follows from the noncentrality: a test of df degrees of freedom at `level` has power
`power` from a noncentrality lambda* on (noncentral chi-square, the usual approximation of
G and Pearson statistics under nearby alternatives). n samples from q instead of p carry
noncentrality n chi2(q, p) = n sum (q - p)^2 / p, and Cauchy-Schwarz gives
TV(q, p) <= sqrt(chi2(q, p)) / 2, so every deviation of TV at least sqrt(lambda* / (4 n)) has
noncentrality at least lambda*, whatever its direction. Averaged over contexts (weights
n_c / n), Jensen keeps the same bound for the averaged TV. When several tests share the
noncentrality (a position's pooled test and its within-pool test; every position of a
sequence), a total at least the sum of their lambda*s leaves one of them at least its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from scipy import optimize
from scipy import stats as st

__all__ = ["detectable_noncentrality", "detectable_tv"]


@functools.lru_cache(maxsize=4096)
def detectable_noncentrality(df: int, level: float, power: float = 0.8) -> float:
    """Noncentrality at which a chi-square test with `df` degrees of freedom at `level` has
    probability `power` of rejecting (0 for df 0: nothing to detect)."""
    if df <= 0:
        return 0.0
    if not 0 < level < 1 or not 0 < power < 1:
        raise ValueError("level and power must lie in (0, 1)")
    crit = float(st.chi2.isf(level, df))

    def gap(lam: float) -> float:
        return float(st.ncx2.sf(crit, df, lam)) - power

    hi = 10.0 + crit
    while gap(hi) < 0:
        hi *= 2
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-6))


def detectable_tv(
    n: int, dfs: Sequence[int], level: float, power: float = 0.8, *, parts: int = 1
) -> float | None:
    """Smallest TV (averaged over contexts; summed over `parts` positions of a sequence, each
    of which may carry part of it) that a family of chi-square tests with degrees of freedom
    `dfs`, each at `level`, detects with probability at least `power` whatever the direction:
    sqrt(parts x sum lambda*(df) / (4 n)), at most 1. None if n is 0 or nothing is tested."""
    lam = sum(detectable_noncentrality(int(d), level, power) for d in dfs if d > 0)
    if n <= 0 or lam <= 0:
        return None
    return min(1.0, math.sqrt(parts * lam / (4.0 * n)))
