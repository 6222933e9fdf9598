"""The count test of sampled tokens outside the reference's top-k support: one member of the
verdict's Holm family (`analysis.FIXED_TESTS`), edge tokens and impossible ones together.

Why a count and not a rule: a token outside the reference's whole-prefix top-k has no PIT
value, but it is evidence. A quantised model's logits move with the batch shape, so a correct
engine verifying 1-16 tokens at once on a cached prefix sometimes samples the (k+1)-th token
(its k-th in that shape); a top-k 44-instead-of-40 bug samples ranks 41-44 about as often as
the reference samples rank 40. Dropping such tokens hides the bug; calling every one BROKEN
rejects a correct engine. So they are counted, against the reference's own rate.

The null rate. At draw i let S_i be the reference's whole-prefix support and w_i its smallest
probability (`unit`): a token that enters the top-k in another batch shape does so at the edge,
carrying about w_i. A correct engine's chance of sampling outside S_i is m_i, the mass its
batch shape puts outside S_i; write m_i = c_i w_i. The runner measures c_j =
max over shapes of m_j / w_j (`leak_units`) at J prefixes drawn with replacement from the
run's own draws (`sample_draws`), so the c_j are independent draws of the run's c. Their sum is
a count of "k-th tokens' worth" of leaked mass; the exact Poisson upper bound at 1 - delta
(`leak_bound`) bounds the mean c. The expected number of tokens outside support under noise is
then at most sum_i c_U w_i, and the observed count X is tested one-sided against the exact
Poisson-binomial law with those rates (`pit.poisson_binomial_sf`).

Validity with the rate estimated: the p-value is p_count + delta. With probability at least
1 - delta the bound holds and p_count is then super-uniform; so P(p <= t) <= delta + (t - delta)
= t: a valid p-value, and Holm keeps the family's level whatever the dependence.

Impossible tokens: a token outside S_i whose raw logprob is beyond any margin of the k-th and
outside the top-k of every batch shape asked at its own prefix (`runner` classifies; `far`
here) cannot be reached by batch-shape noise: its null probability is 0, so the statistic is
ordered (far count, count) and one far token gives p = delta. With delta = alpha x
`BOUND_SHARE` that rejects in Holm while the family has fewer than 1 / `BOUND_SHARE` members
at its level (fewer than 100 at alpha, 50 at a sequential run's alpha / 2), so a single clear
impossible token still makes the run BROKEN, as the count test at its level. Its rejection
region only grows as the run goes on, so a sequential run may stop at the first one
(`analysis.anytime_decides`) without adding to the level.

What it cannot see: a bug that moves mass within the top-k (the PIT tests' job), or one that
samples outside S_i less often than the reference's noise would (one-sided).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from specaudit.rescore.pit import poisson_binomial_sf
from specaudit.rescore.records import TokenDraw
from specaudit.rescore.scores import ScoreTest

NAME = "outside the top-k support"
BOUND_SHARE = 0.01  # of alpha spent on the leak rate's upper bound
EDGE_PREFIXES = 16  # prefixes at which the reference's own leak is measured

Key = tuple[int, int, int]  # (seed, prompt, position): one draw


def key_of(d: TokenDraw) -> Key:
    return (d.seed, d.prompt, d.position)


def generated_ids(d: TokenDraw) -> list[int]:
    """The tokens generated before draw `d` (its prefix without the prompt)."""
    key = d.prefix_key.split(":", 1)[1]
    return [int(t) for t in key.split(",")] if key else []


def is_outside(d: TokenDraw) -> bool:
    """Whether the sampled token is outside the reference's whole-prefix support."""
    return d.ref.probs.get(d.token, 0.0) <= 0.0


def unit(probs: Mapping[int, float]) -> float:
    """The smallest probability of the support, normalised: what one token leaked across the
    top-k edge carries (0 for an empty support)."""
    pos = [p for p in probs.values() if p > 0.0]
    return min(pos) / sum(pos) if pos else 0.0


def leak_units(whole: Mapping[int, float], shapes: Sequence[Mapping[int, float]]) -> float:
    """The largest mass any of `shapes` (the reference's answers for one prefix in other batch
    shapes) puts outside `whole`'s support, in units of `whole`'s smallest probability."""
    w = unit(whole)
    if w <= 0.0:
        return 0.0
    mass = 0.0
    for s in shapes:
        total = sum(p for p in s.values() if p > 0.0)
        if total > 0.0:
            out = sum(p for t, p in s.items() if p > 0.0 and whole.get(t, 0.0) <= 0.0)
            mass = max(mass, out / total)
    return mass / w


def leak_bound(total: float, prefixes: int, delta: float) -> float:
    """Exact Poisson upper confidence bound at 1 - `delta` on the mean leak per prefix, from
    `total` leak units over `prefixes` prefixes (inf with none measured)."""
    if prefixes <= 0:
        return math.inf
    count = math.ceil(total - 1e-9)
    return float(stats.chi2.ppf(1.0 - delta, 2 * (count + 1))) / (2 * prefixes)


def sample_draws(n: int, count: int = EDGE_PREFIXES, seed: int = 0) -> list[int]:
    """`count` indices of n draws, uniform with replacement (seeded): the prefixes where the
    reference's own leak is measured, independent draws of the run's."""
    if n <= 0:
        return []
    return [int(i) for i in np.random.default_rng(seed).integers(0, n, size=count)]


@dataclass(frozen=True)
class EdgeLeak:
    """The reference's own leak across its top-k edge, measured at `len(leaks)` of the run's
    prefixes in verification-shaped batches: per prefix, leak units (`leak_units`); `delta`
    the share of alpha its upper bound spends."""

    leaks: tuple[float, ...]
    delta: float

    @property
    def mean(self) -> float:
        return float(np.mean(self.leaks)) if self.leaks else 0.0

    @property
    def bound(self) -> float:
        return leak_bound(sum(self.leaks), len(self.leaks), self.delta)


@dataclass(frozen=True)
class OutsideTest:
    """The count test's result: `outside` tokens outside the support (`far` of them
    impossible in every batch shape), `expected` the count the bound allows under the
    reference's noise (`estimate` at the measured mean), `p_value` including delta."""

    outside: int
    far: int
    expected: float
    estimate: float
    p_value: float
    delta: float

    def detail(self) -> str:
        far = (
            f", {self.far} with probability 0 under the reference in every batch shape"
            if self.far
            else ""
        )
        return (
            f"{self.outside} sampled tokens outside the reference's top-k{far}; under its own "
            f"noise at most {self.expected:.3g} expected (measured {self.estimate:.3g})"
        )

    def score_test(self) -> ScoreTest:
        return ScoreTest(NAME, float(self.outside), self.p_value, self.detail())


def outside_test(
    draws: Sequence[TokenDraw], edge: EdgeLeak | None = None, far: Collection[Key] = ()
) -> OutsideTest:
    """The count test (module doc). Without `edge` (no measurement: simulated draws, an
    engine's own reported distributions) the null rate is 0 and delta 0: any token outside
    the support rejects, every one counted impossible."""
    outside = [d for d in draws if is_outside(d)]
    if edge is None:
        n = len(outside)
        return OutsideTest(n, n, 0.0, 0.0, 0.0 if n else 1.0, 0.0)
    units = np.array([unit(d.ref.probs) for d in draws])
    bound = edge.bound
    rates = np.minimum(1.0, bound * units) if math.isfinite(bound) else (units > 0) * 1.0
    n_far = sum(1 for d in outside if key_of(d) in far)
    # the null probability of a far token is 0: one rejects at delta
    p_count = 1.0 if not outside else 0.0 if n_far else poisson_binomial_sf(len(outside), rates)
    return OutsideTest(
        outside=len(outside), far=n_far, expected=float(rates.sum()),
        estimate=float(edge.mean * units.sum()),
        p_value=min(1.0, p_count + edge.delta), delta=edge.delta,
    )  # fmt: skip


__all__ = [
    "BOUND_SHARE",
    "EDGE_PREFIXES",
    "NAME",
    "EdgeLeak",
    "Key",
    "OutsideTest",
    "generated_ids",
    "is_outside",
    "key_of",
    "leak_bound",
    "leak_units",
    "outside_test",
    "sample_draws",
    "unit",
]
