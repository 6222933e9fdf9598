"""What every statistic of `specaudit.stats` shares: its result types, the p-value floor and
the Monte-Carlo budget, and the check that a sample and its distribution fit together.

Kept apart so that the goodness-of-fit, total-variation, directed and verdict modules depend
on this one module, not on each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MC_DRAWS", "TINY_P", "GofResult", "TvBound", "TvInterval", "mc_pvalue", "normalise"]

MC_DRAWS = 10_000  # p-value resolution 1e-4: enough for alpha >= 1e-3
# Smallest positive float: a p-value that underflowed is tiny, not zero. Zero is reserved for
# outcomes that are impossible under the null (certainty, not strong evidence).
TINY_P = 5e-324


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
    # log10 of the p-value when it is known beyond floating point (the exact test: a possible
    # outcome can be less likely than the smallest float); None when `p_value` says it all
    log10_p: float | None = None


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


def normalise(
    observed: Sequence[int] | np.ndarray, probs: Sequence[float] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(counts, probabilities) as 1-D arrays, the probabilities rescaled to sum to exactly 1;
    ValueError if they do not fit together (shapes, signs, a sum far from 1)."""
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


def mc_pvalue(
    threshold: float,
    simulate: Callable[[int, np.random.Generator], np.ndarray],
    max_draws: int,
    *,
    stop_hits: int = 0,
    seed: int = 0,
    chunk: int = 2000,
) -> tuple[float, int, int]:
    """Monte-Carlo p-value P(statistic >= threshold) from `simulate(m, rng)` (m simulated
    statistics under the null), as (p-value, draws made, hits).

    `stop_hits` = 0: all `max_draws` draws, p = (1 + hits) / (1 + draws). `stop_hits` = h > 0:
    Besag and Clifford's (1991) sequential p-value: stop at the draw l where the h-th hit
    occurs, p = h / l, else after `max_draws` draws as above. Exactly valid either way, and
    the sequential form lets `max_draws` be large (a p-value floor far below a small level)
    while a statistic in the bulk of its null stops after about h / p draws.
    """
    rng = np.random.default_rng(seed)
    hits = 0
    done = 0
    step = max(1, chunk)
    while done < max_draws:
        # sequential: chunks grow from 64 draws, so a p-value in the bulk stops early
        m = min(step if stop_hits <= 0 else min(step, max(64, done)), max_draws - done)
        sims = np.asarray(simulate(m, rng))
        hit = sims >= threshold
        if stop_hits > 0 and hits + int(hit.sum()) >= stop_hits:
            where = np.flatnonzero(hit)[stop_hits - hits - 1]
            return stop_hits / (done + int(where) + 1), done + int(where) + 1, stop_hits
        hits += int(hit.sum())
        done += m
    return (1 + hits) / (1 + done), done, hits
