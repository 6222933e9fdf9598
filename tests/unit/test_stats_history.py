"""The default `dist` analysis sees every position's full history, not only the pool of
contexts that share a true next-token distribution: a bug that bends single histories while
keeping each pool's mixture exact is BROKEN, and a correct engine stays within alpha.

Samples are simulated from the fixture's closed form with numpy (no server)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from scipy import stats as st

from specaudit import distribution, fixtures, stats
from specaudit.distribution.dependence import history_positions
from specaudit.distribution.truth import stratum_key
from specaudit.stats import Verdict

SPEC = fixtures.default_spec()
WL = distribution.make_workload(SPEC)  # 4 positions, joint 1-3, top-k 3
Bend = Callable[[str, np.ndarray], np.ndarray]


def simulate(
    truth: distribution.Truth, n: int, rng: np.random.Generator, bend: Bend | None = None
) -> list[distribution.Sample]:
    """n samples (seeds 1..n) from the closed form, optionally bent by `bend(prefix, p)`;
    vectorised per distinct prefix (one uniform per sample and position, inverse cdf)."""
    texts = np.array([""] * n, dtype=object)
    for _ in range(truth.workload.tokens):
        u = rng.random(n)
        out = np.empty(n, dtype=object)
        for prefix in sorted(set(texts)):
            idx = np.flatnonzero(texts == prefix)
            p = truth.next(prefix)
            if bend is not None:
                p = bend(prefix, p)
            cum = np.cumsum(p)
            cum[-1] = 1.0
            picks = np.searchsorted(cum, u[idx], side="right")
            out[idx] = [prefix + truth.labels[j] for j in picks]
        texts = out
    return [distribution.Sample(i + 1, str(t)) for i, t in enumerate(texts)]


def pool_preserving_bend(truth: distribution.Truth, t: int, tv: float) -> tuple[Bend, float]:
    """The review's kind of mutant: at position t, in the pool of prefixes sharing a last
    letter (one true next-token distribution) whose two most likely prefixes are the most
    common, the first moves mass from the pool's most to its second most likely token and
    the second the reverse, in inverse proportion to their probabilities, so the pool's
    mixture stays exact; the larger shift is `tv`. Returns the bend and the prefix-averaged
    TV it causes at position t."""
    joint = truth.joint(t - 1)
    pools: dict[tuple[float, ...], list[str]] = {}
    for prefix in sorted(joint, key=lambda x: -joint[x]):
        pools.setdefault(stratum_key(truth.p(prefix)), []).append(prefix)
    pool = max((v for v in pools.values() if len(v) >= 2), key=lambda v: joint[v[1]])
    a, b = pool[:2]
    wa, wb = joint[a], joint[b]
    p = truth.next(a)
    hi, lo = (int(i) for i in np.argsort(-p, kind="stable")[:2])
    d_b = min(tv, p[hi] * wa / wb, p[lo])  # b moves d_b from lo to hi, a d_a back
    d_a = d_b * wb / wa
    shift = {a: (hi, lo, d_a), b: (lo, hi, d_b)}
    avg = wa * d_a + wb * d_b

    def bend(prefix: str, p: np.ndarray) -> np.ndarray:
        if len(prefix) != t - 1 or prefix not in shift:
            return p
        src, dst, d = shift[prefix]
        q = p.copy()
        q[src] -= d
        q[dst] += d
        return q

    return bend, avg


def test_the_mutant_keeps_every_pool_mixture_exact_and_bends_histories_by_up_to_020() -> None:
    truth = distribution.Truth(SPEC, WL)
    bend, avg = pool_preserving_bend(truth, 4, 0.20)
    joint = truth.joint(3)
    mix_true: dict[tuple[float, ...], np.ndarray] = {}
    mix_bent: dict[tuple[float, ...], np.ndarray] = {}
    biggest = 0.0
    for prefix, w in joint.items():
        p = truth.next(prefix)
        q = bend(prefix, p)
        biggest = max(biggest, stats.tv_distance(q, p))
        k = stratum_key(truth.p(prefix))
        mix_true[k] = mix_true.get(k, 0) + w * p
        mix_bent[k] = mix_bent.get(k, 0) + w * q
    assert biggest == pytest.approx(0.20)
    for k, m in mix_true.items():
        assert np.allclose(m, mix_bent[k], atol=1e-12)
    assert 0.02 < avg < 0.05  # prefix-averaged TV at position 4: far below the tolerance


def _verdicts(bend: Bend | None, runs: int, seed: int, n: int = 1000, alpha: float = 0.01,
              mc_draws: int = 1000) -> list[distribution.EngineResult]:  # fmt: skip
    truth = distribution.Truth(SPEC, WL)
    rng = np.random.default_rng(seed)
    return [
        distribution.analyze(
            SPEC, WL, simulate(truth, n, rng, bend), alpha=alpha, mc_draws=mc_draws
        )  # fmt: skip
        for _ in range(runs)
    ]


def test_a_history_dependent_bug_that_keeps_each_pool_exact_is_broken_at_1000() -> None:
    """Per-context TV up to 0.20 at position 4, every pool's mixture exact: the pooled tests
    are blind to it (it used to be PRESERVED in about 90 % of runs at N = 1000). The within-pool
    test sees it: BROKEN in at least 90 % of 40 runs, by the history test."""
    truth = distribution.Truth(SPEC, WL)
    bend, _ = pool_preserving_bend(truth, 4, 0.20)
    results = _verdicts(bend, 40, 31, mc_draws=2000)
    seen = Counter(r.verdict for r in results)
    assert seen[Verdict.BROKEN] >= 36, seen
    hist = [next(x for x in r.tests if x.name == "history 4") for r in results]
    assert sum(x.rejected for x in hist) >= 36


def test_correct_engines_keep_the_history_tests_within_alpha() -> None:
    """200 correct engines at alpha 0.05, 1000 samples: BROKEN, and each history test's
    rejection at alpha unadjusted, no more often than binomial(200, 0.05) allows (99.9 %)."""
    alpha = 0.05
    results = _verdicts(None, 200, 32, alpha=alpha, mc_draws=500)
    limit = st.binom.ppf(0.999, 200, alpha)
    assert sum(r.verdict is Verdict.BROKEN for r in results) <= limit
    for t in history_positions(distribution.Truth(SPEC, WL)):
        ps = [next(x for x in r.tests if x.name == f"history {t}").gof.p_value for r in results]
        assert sum(p < alpha for p in ps) <= limit, t


def test_the_history_test_runs_only_where_contexts_pool() -> None:
    truth = distribution.Truth(SPEC, WL)
    assert history_positions(truth) == (3, 4)  # position 2: one letter, its own pool
    one = distribution.make_workload(SPEC, positions=2, joint=2)
    assert history_positions(distribution.Truth(SPEC, one)) == ()
