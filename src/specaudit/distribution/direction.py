"""The directed test: does the engine leak toward the draft's distribution?

A speculative bug most often mixes some of the draft's next-token distribution into the
target's. `DraftDirection` is that alternative, p_lambda = p + lambda (d~ - p), over every
tested position; `directed_result` is its score test (one statistic, exact null by
enumerating the sample paths when there are few enough), and `DraftDirection.power` the
smallest leak it sees with POWER.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from scipy import stats as st

from specaudit import fixtures, stats
from specaudit.distribution.results import DirectedPower, DistError, Workload
from specaudit.distribution.truth import Truth
from specaudit.stats import GofResult, TvInterval

POWER = 0.8  # the minimum detectable TV (directed and generic) is at this power
PATH_LIMIT = 50_000  # sample paths enumerated for the directed test's exact null; else normal


def draft_score(truth: Truth, prefix: str, cell: int) -> float:
    """One token's draft-direction score d~(x)/p(x) - 1 after `prefix` (d~: the draft's
    distribution restricted to the target's support, renormalised; mean 0 under the target,
    >= -1). The token must be possible after `prefix`."""
    p = truth.p(prefix)
    d = truth.draft_p(prefix)
    support = p > 0
    mass = float(d[support].sum())
    if mass <= 0:
        return 0.0
    return float(d[cell] / mass / p[cell] - 1.0)


class DraftDirection:
    """The draft-leakage alternative p_lambda = p + lambda (d~ - p) after every prefix, with d~
    the draft's next-token distribution (same sampler) restricted to the target's support and
    renormalised (mass the draft puts outside it would be an impossible token: certain BROKEN).

    One sample's score at lambda = 0 is U = sum over tested positions of d~(x_t)/p(x_t) - 1,
    mean 0 under the target; the total over n independent samples is the test statistic. Its
    exact null is that of a sum of n independent copies of one sample's U, whose distribution
    is the enumeration of the sample paths (`paths`). States merge prefixes the fixture cannot
    tell apart (`FixtureSpec.state_key`), as `Truth.marginal` does.
    """

    def __init__(self, truth: Truth) -> None:
        self.truth = truth
        wl = truth.workload
        self.positions = wl.positions
        prompt = wl.prompt
        # per position: states (representative prefix), their per-token arrays, children
        self.levels: list[list[_State]] = []
        index: dict[str, int] = {truth.spec.state_key(prompt): 0}
        reps = [""]
        counts = [1]  # sample paths reaching each state
        self.n_paths = 0
        for t in range(1, self.positions + 1):
            level = [self._state(rep) for rep in reps]
            self.levels.append(level)
            if t == self.positions:
                self.n_paths = sum(c * len(s.support) for c, s in zip(counts, level, strict=True))
                break
            index = {}
            nxt_reps: list[str] = []
            nxt_counts: list[int] = []
            for st_, c in zip(level, counts, strict=True):
                kids = []
                for j in st_.support:
                    tok = truth.outcomes[j]
                    if tok not in truth.spec.letters:
                        raise DistError(f"special token {tok!r} is possible: generation may stop")
                    longer = st_.prefix + tok
                    key = truth.spec.state_key(prompt + longer)
                    k = index.get(key)
                    if k is None:
                        k = len(nxt_reps)
                        index[key] = k
                        nxt_reps.append(longer)
                        nxt_counts.append(0)
                    nxt_counts[k] += c
                    kids.append(k)
                st_.children = kids
            reps, counts = nxt_reps, nxt_counts
        self.information = float(self.moments(0.0)[1] ** 2)
        self.contexts = sum(1 for level in self.levels for s in level if s.chi2 > 1e-12)

    def _state(self, prefix: str) -> _State:
        p = self.truth.p(prefix)
        d = self.truth.draft_p(prefix)
        support = np.flatnonzero(p > 0)
        ps = p[support]
        mass = float(d[support].sum())
        dt = d[support] / mass if mass > 0 else ps.copy()
        u = dt / ps - 1.0
        return _State(
            prefix=prefix,
            support=support,
            p=ps,
            dt=dt,
            u=u,
            chi2=float(np.sum(dt * dt / ps) - 1.0),
            tv=0.5 * float(np.abs(dt - ps).sum()),
        )

    def score(self, prefix: str, cell: int) -> float:
        """One token's score d~(x)/p(x) - 1 (the token must be possible after `prefix`)."""
        return draft_score(self.truth, prefix, cell)

    def _forward(self, lam: float) -> tuple[float, float, list[float]]:
        """(mean, variance of one sample's score, prefix-averaged TV per position) under
        p_lambda; the variance sums the conditional variances (exact at lambda = 0, where the
        scores are martingale differences; first order in lambda otherwise)."""
        w = np.ones(1)
        mean = var = 0.0
        tvs: list[float] = []
        for t, level in enumerate(self.levels, start=1):
            tv_t = 0.0
            nxt = np.zeros(len(self.levels[t]) if t < len(self.levels) else 0)
            for wi, s in zip(w, level, strict=True):
                q = s.p + lam * (s.dt - s.p)
                m = lam * s.chi2
                mean += wi * m
                var += wi * (float(q @ (s.u * s.u)) - m * m)
                tv_t += wi * lam * s.tv
                if t < len(self.levels):
                    for qj, k in zip(q, s.children, strict=True):
                        nxt[k] += wi * qj
            tvs.append(tv_t)
            w = nxt
        return mean, var, tvs

    def moments(self, lam: float) -> tuple[float, float]:
        mean, var, _ = self._forward(lam)
        return mean, math.sqrt(max(var, 0.0))

    def tv(self, lam: float) -> list[float]:
        """Prefix-averaged next-token TV from the target at each position under p_lambda."""
        return [float(x) for x in self._forward(lam)[2]]

    @functools.cached_property
    def paths(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(score, null probability) of every sample path over the tested positions; None if
        there are more than PATH_LIMIT."""
        if self.n_paths > PATH_LIMIT:
            return None
        vals = np.zeros(1)
        probs = np.ones(1)
        where = np.zeros(1, dtype=np.int64)  # state index of each partial path
        for t, level in enumerate(self.levels, start=1):
            nv, np_, nw = [], [], []
            for v, pr, k in zip(vals, probs, where, strict=True):
                s = level[k]
                nv.append(v + s.u)
                np_.append(pr * s.p)
                nw.append(np.asarray(s.children if t < len(self.levels) else [0] * len(s.p)))
            vals = np.concatenate(nv)
            probs = np.concatenate(np_)
            where = np.concatenate(nw).astype(np.int64)
        return vals, probs

    def power(self, n: int, level: float) -> DirectedPower:
        sd0 = math.sqrt(self.information)
        lam = stats.min_detectable_shift(n, sd0, self.moments, level, POWER)
        tvs = self.tv(lam) if lam is not None else []
        return DirectedPower(
            n=n,
            level=level,
            power=POWER,
            lambda_=lam,
            tv=max(tvs) if tvs else None,
            tv_by_position=tvs,
            information=self.information,
        )


@dataclass
class _State:
    prefix: str  # a generated prefix in this state
    support: np.ndarray  # cells the target allows
    p: np.ndarray  # target probabilities on the support
    dt: np.ndarray  # the draft's, restricted to the support and renormalised
    u: np.ndarray  # score of each supported token: dt / p - 1
    chi2: float  # chi-square divergence of dt from p: the score's variance
    tv: float  # TV(dt, p)
    children: list[int] = field(default_factory=list)  # next position's state per token


@functools.lru_cache(maxsize=16)
def _direction(spec: fixtures.FixtureSpec, workload: Workload) -> DraftDirection:
    return DraftDirection(Truth(spec, workload))


def draft_direction(truth: Truth) -> DraftDirection:
    """The draft-leakage alternative of a fixture and workload (cached)."""
    return _direction(truth.spec, truth.workload)


def directed_result(
    truth: Truth,
    texts: Mapping[str, int],
    n: int,
    impossible: bool,
    *,
    mc_draws: int = stats.MC_DRAWS,
    mc_stop_hits: int = 0,
    mc_seed: int = 0,
) -> tuple[GofResult, DraftDirection]:
    """The score test toward the draft over every tested position and context, one statistic."""
    dd = draft_direction(truth)
    if impossible:
        return GofResult(math.inf, 1, 0.0, "impossible", n, dd.contexts, 0.0, 0), dd
    total = 0.0
    for text, w in texts.items():
        u = 0.0
        for t in range(1, dd.positions + 1):
            u += dd.score(text[: t - 1], truth.cell(text[t - 1]))
        total += w * u
    paths = dd.paths
    if paths is None:
        z = total / math.sqrt(n * dd.information) if dd.information > 0 else 0.0
        if dd.information <= 1e-15:
            return GofResult(0.0, 1, 1.0, "trivial", n, dd.contexts, math.inf), dd
        p = max(float(st.norm.sf(z)), stats.TINY_P)
        return GofResult(z, 1, p, "normal", n, dd.contexts, math.inf), dd
    vals, probs = paths
    gof = stats.directed_test(
        total, n, vals, probs, contexts=dd.contexts, mc_draws=mc_draws,
        mc_stop_hits=mc_stop_hits, seed=mc_seed,
    )  # fmt: skip
    return gof, dd


def directed_tv(dd: DraftDirection, gof: GofResult, n: int, alpha: float) -> TvInterval:
    """Descriptive: the TV toward the draft that the score estimates (one-step estimate of
    lambda, clipped to [0, 1]), in an uninformative [0, 1] interval (the test, not this
    number, is the evidence)."""
    if gof.method == "impossible" or dd.information <= 0 or not math.isfinite(gof.statistic):
        return TvInterval(1.0 if gof.method == "impossible" else 0.0, 0.0, 1.0, 1 - alpha)
    lam = min(1.0, max(0.0, gof.statistic / math.sqrt(n * dd.information)))
    return TvInterval(max(dd.tv(lam)) if lam > 0 else 0.0, 0.0, 1.0, 1 - alpha)


__all__ = [
    "PATH_LIMIT",
    "POWER",
    "DraftDirection",
    "directed_result",
    "directed_tv",
    "draft_direction",
    "draft_score",
]
