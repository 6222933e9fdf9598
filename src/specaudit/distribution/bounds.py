"""The certified TV bounds the verdict rests on, and the descriptive TV intervals.

PRESERVED needs, with confidence 1 - alpha, every position's prefix-averaged next-token TV
and the joint's TV within the tolerance: one one-sided bound each, at alpha / `tv_family`
(Bonferroni), so all hold together.
"""

from __future__ import annotations

import numpy as np

from specaudit import stats
from specaudit.distribution.counting import Texts, joint_cells, marginal_counts, prefix_counts
from specaudit.distribution.results import Workload
from specaudit.distribution.truth import Truth
from specaudit.stats import TvBound, TvInterval


def position_tv(truth: Truth, texts: Texts, t: int, alpha: float) -> TvInterval:
    """TV between the engine's and the target's *marginal* distribution of the token at
    position t (descriptive: a bug confined to some contexts can keep every marginal exact)."""
    marginal = np.append(truth.marginal(t), [0.0, 0.0])  # over `outcomes`
    return stats.tv_interval(marginal_counts(truth, texts, t), marginal, alpha)


def conditional_bound(truth: Truth, texts: Texts, t: int, alpha: float) -> TvBound:
    """One-sided (1 - alpha) bound on position t's prefix-averaged next-token TV: the sum over
    generated prefixes c of (n_c / n) TV(engine's next token | c, target's | c), every prefix
    its own context (an engine may treat prefixes the target cannot tell apart differently)."""
    per = prefix_counts(truth, texts, t)
    return stats.conditional_tv_bound([(c, truth.p(pf)) for pf, c in per.items()], alpha)


def joint_bound(truth: Truth, texts: Texts, alpha: float) -> TvBound:
    """One-sided (1 - alpha) bound on the TV of the joint of the first `workload.joint`."""
    _, counts, probs, _ = joint_cells(truth, texts, truth.workload.joint)
    return stats.conditional_tv_bound([(counts, probs)], alpha)


def tv_family(workload: Workload) -> int:
    """How many certified bounds the verdict needs (positions, plus the joint): each is at
    alpha / this, so all hold together with probability 1 - alpha (Bonferroni)."""
    return workload.positions + (1 if workload.joint else 0)


def certified_bounds(truth: Truth, texts: Texts, alpha: float) -> list[TvBound]:
    """The verdict's bounds, each at alpha / `tv_family`: positions 1.., then the joint."""
    wl = truth.workload
    a = alpha / tv_family(wl)
    out = [conditional_bound(truth, texts, t, a) for t in range(1, wl.positions + 1)]
    if wl.joint:
        out.append(joint_bound(truth, texts, a))
    return out


def sequence_bound(truth: Truth, texts: Texts, n: int, alpha: float) -> float:
    """One-sided (1 - alpha) bound on the TV of the whole tested sequence's distribution
    (`stats.sequence_tv_bound` over the positions' bounds at alpha / (2 positions))."""
    pos = truth.workload.positions
    uppers = [
        conditional_bound(truth, texts, t, alpha / (2 * pos)).upper for t in range(1, pos + 1)
    ]
    return stats.sequence_tv_bound(uppers, n, alpha)


__all__ = [
    "certified_bounds",
    "conditional_bound",
    "joint_bound",
    "position_tv",
    "sequence_bound",
    "tv_family",
]
