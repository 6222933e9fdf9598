"""From p-values and TV bounds to a verdict: Holm's correction, the decision rule, and the
error budget of interim looks. `Verdict` is the vocabulary every `dist` consumer speaks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

from scipy import stats as st

from specaudit.outcome import Outcome

__all__ = ["SPENDING", "Verdict", "alpha_spending", "decide", "holm", "look_level", "spent_alpha"]


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
    """Error budget of the `look`-th (1-based) interim analysis: sums to alpha over all looks.
    For an unknown number of looks; with a known maximum `look_level` spends by information
    fraction, which leaves far more to the looks that have the data (sequential mode's)."""
    return alpha * 6.0 / (math.pi**2 * look * look)


SPENDING = ("pocock", "obrien-fleming")


def spent_alpha(fraction: float, alpha: float, kind: str = "pocock") -> float:
    """Lan-DeMets alpha-spending: the error budget spent by information fraction `fraction`
    (samples so far / the maximum): 0 at 0, alpha at 1. "pocock": alpha ln(1 + (e - 1) t),
    which spends early (power at interim looks); "obrien-fleming": 2 - 2 Phi(z_{1-alpha/2} /
    sqrt(t)), which keeps almost all of alpha for the end."""
    t = min(1.0, max(0.0, fraction))
    if t <= 0:
        return 0.0
    if kind == "pocock":
        return alpha * math.log(1.0 + (math.e - 1.0) * t)
    if kind == "obrien-fleming":
        return float(2.0 * st.norm.sf(st.norm.isf(alpha / 2.0) / math.sqrt(t)))
    raise ValueError(f"unknown spending function {kind!r} (one of {', '.join(SPENDING)})")


def look_level(previous: int, now: int, maximum: int, alpha: float, kind: str = "pocock") -> float:
    """The level of a look after `now` samples when the previous look was after `previous`, of
    at most `maximum`: what the spending function spends between the two. Summed over any
    looks these levels never exceed alpha (a union bound over the looks: valid whatever the
    looks' correlation, and the maximum known in advance makes the fractions exact)."""
    if maximum <= 0:
        raise ValueError("the maximum number of samples must be positive")
    return max(
        0.0,
        spent_alpha(now / maximum, alpha, kind) - spent_alpha(previous / maximum, alpha, kind),
    )
