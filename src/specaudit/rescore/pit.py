"""The per-token quantities every re-scored test reads off one record: the draft's favourite,
the PIT order and value, and the exact law of the number of favourite hits.

Kept apart from `analysis` (which decides) and `scores` (the q-free fixed-N tests) so that both
read the same definitions and neither imports the other.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specaudit.reference import NextToken
from specaudit.rescore.records import TokenDraw

__all__ = [
    "Pits",
    "favourite_of",
    "order",
    "pit",
    "poisson_binomial_pmf",
    "poisson_binomial_sf",
]


def order(nt: NextToken, favourite: int | None) -> list[int]:
    """The token order of the PIT: the favourite first, then by falling probability (ties
    by id)."""
    rest = sorted((t for t in nt.probs if t != favourite), key=lambda t: (-nt.probs[t], t))
    return ([favourite] if favourite is not None and favourite in nt.probs else []) + rest


def favourite_of(d: TokenDraw) -> int:
    """The draft's favourite when known, else the reference's argmax (a model that drafts
    with itself, or a smaller model of its family, favours the target's argmax)."""
    if d.draft_favourite is not None:
        return d.draft_favourite
    return min(d.ref.probs, key=lambda t: (-d.ref.probs[t], t))


def pit(d: TokenDraw, v: float) -> float | None:
    """u = F(x-) + v p(x) under the PIT order; None when x is outside the reference's
    support (an impossible token)."""
    p = d.ref.probs.get(d.token, 0.0)
    if p <= 0.0:
        return None
    below = 0.0
    for t in order(d.ref, favourite_of(d)):
        if t == d.token:
            break
        below += d.ref.probs[t]
    total = sum(d.ref.probs.values())
    return min(max((below + v * p) / total, 0.0), 1.0)


def poisson_binomial_pmf(ps: np.ndarray) -> np.ndarray:
    """P(S = k), k = 0..n, for S a sum of independent Bernoulli(ps): exact, by convolution
    (O(n^2), a few milliseconds at n = 5000)."""
    dist = np.zeros(len(ps) + 1)
    dist[0] = 1.0
    for i, p in enumerate(np.asarray(ps, dtype=float)):
        dist[1 : i + 2] = dist[1 : i + 2] * (1 - p) + dist[: i + 1] * p
        dist[0] *= 1 - p
    return dist


def poisson_binomial_sf(k: int, ps: np.ndarray) -> float:
    """P(S >= k) for S a sum of independent Bernoulli(ps): exact, by convolution."""
    dist = poisson_binomial_pmf(ps)
    return float(min(1.0, max(dist[k:].sum(), 0.0)))


@dataclass
class Pits:
    """Per draw, in sampling order: its PIT value (nan in `u_all` for an impossible token),
    whether it was the favourite and the reference's probability of the favourite. One copy
    for the tests (`analysis`) and the bounds (`certify`): both read the same PIT values."""

    u: list[float] = field(default_factory=list)  # possible tokens only
    u_all: list[float] = field(default_factory=list)
    by_position: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    impossible: int = 0
    hits: list[float] = field(default_factory=list)
    favourite_p: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, draws: Sequence[TokenDraw], seed: int) -> Pits:
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
