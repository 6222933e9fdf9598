"""The default `dist` analysis sees every position's full history, not only the pool of
contexts that share a true next-token distribution: a bug that bends single histories while
keeping each pool's mixture exact is BROKEN, and a correct engine stays within alpha.

Samples are simulated from the fixture's closed form with numpy (no server)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import calibration
from calibration import pool_preserving_bend
from closed_form import Bend, draw
from specaudit import distribution, fixtures, stats
from specaudit.distribution.dependence import history_positions
from specaudit.distribution.sequential import MC_STOP_HITS
from specaudit.distribution.truth import stratum_key
from specaudit.stats import Verdict

SPEC = fixtures.default_spec()
WL = distribution.make_workload(SPEC)  # 4 positions, joint 1-3, top-k 3


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


def _verdicts(bend: Bend, runs: int, seed: int) -> list[distribution.EngineResult]:
    """`runs` analyses of 1000 bent samples at alpha 0.01; Monte-Carlo p-values stop at
    sequential mode's hit count (a p-value near its level still gets all 2000 draws)."""
    truth = distribution.Truth(SPEC, WL)
    rng = np.random.default_rng(seed)
    return [
        distribution.analyse(
            SPEC, WL, draw(truth, 1000, rng, bend), mc_draws=2000, mc_stop_hits=MC_STOP_HITS
        )
        for _ in range(runs)
    ]


def test_a_history_dependent_bug_that_keeps_each_pool_exact_is_broken_at_1000() -> None:
    """Per-context TV up to 0.20 at position 4, every pool's mixture exact: the pooled tests
    are blind to it (it used to be PRESERVED in about 90 % of runs at N = 1000). The within-pool
    test sees it: BROKEN in at least 90 % of 20 runs, by the history test (19 of 20; a
    history test blind within the pools, each prefix a pool of its own, leaves 0)."""
    truth = distribution.Truth(SPEC, WL)
    bend, _ = pool_preserving_bend(truth, 4, 0.20)
    results = _verdicts(bend, 20, 31)
    seen = Counter(r.verdict for r in results)
    assert seen[Verdict.BROKEN] >= 18, seen
    hist = [next(x for x in r.tests if x.name == "history 4") for r in results]
    assert sum(x.rejected for x in hist) >= 18


def test_correct_engines_keep_the_history_tests_within_alpha() -> None:
    """Correct engines at alpha 0.05, 1000 samples: BROKEN, and each history test's rejection
    at alpha unadjusted, no more often than binomial(runs, 0.05) allows (99.9 %). 24 runs here
    catch a grossly miscalibrated test; benchmarks/bench_calibration.py history-null measures
    the rate over 200 (docs/dist.md, "Calibration")."""
    rates = calibration.history_false_alarms(24)
    assert len(rates) == 1 + len(history_positions(distribution.Truth(SPEC, WL)))
    for rate in rates:
        assert rate.runs == 24 and rate.passed, rate.line()


def test_the_history_test_runs_only_where_contexts_pool() -> None:
    truth = distribution.Truth(SPEC, WL)
    assert history_positions(truth) == (3, 4)  # position 2: one letter, its own pool
    one = distribution.make_workload(SPEC, positions=2, joint=2)
    assert history_positions(distribution.Truth(SPEC, one)) == ()
