"""Samples must be independent across seeds: a seed-reuse-like bug (sample s + 1 repeating
sample s) keeps every distribution exact, so only a test across consecutive seeds sees it.
The seed-pair test is part of the verdict's Holm family.

Samples are simulated from the fixture's closed form with numpy (no server)."""

from __future__ import annotations

import numpy as np
from test_stats_history import SPEC, WL

import calibration
from closed_form import draw
from specaudit import distribution, stats
from specaudit.distribution.counting import OutcomeCounts
from specaudit.distribution.sequential import MC_STOP_HITS
from specaudit.stats import Verdict


def reuse_previous_seed(
    samples: list[distribution.Sample], rho: float, rng: np.random.Generator
) -> list[distribution.Sample]:
    """With probability rho, seed s + 1 gives seed s's output again (a stale RNG state)."""
    out = [samples[0]]
    for s in samples[1:]:
        out.append(distribution.Sample(s.seed, out[-1].text) if rng.random() < rho else s)
    return out


def test_seed_reuse_is_broken_by_the_seed_pair_test() -> None:
    """rho = 0.2 at N = 1000: BROKEN in every one of 10 runs, by the seed pairs (each
    distribution stays exact, so the other tests see nothing of it)."""
    truth = distribution.Truth(SPEC, WL)
    rng = np.random.default_rng(41)
    for _ in range(10):
        samples = reuse_previous_seed(draw(truth, 1000, rng), 0.2, rng)
        res = distribution.analyse(SPEC, WL, samples, mc_draws=2000, mc_stop_hits=MC_STOP_HITS)
        pairs = next(x for x in res.tests if x.kind == "seeds")
        assert res.verdict is Verdict.BROKEN and pairs.rejected, res.reason
        assert pairs.n == 999 and pairs.contexts == 1  # one run of consecutive seeds


def test_independent_seeds_keep_the_pair_test_within_alpha() -> None:
    """Correct engines (N = 400): the pair test's p-value falls below 0.05 no more often than
    binomial(runs, 0.05) allows (99.9 % quantile). 30 runs here catch a grossly miscalibrated
    test; benchmarks/bench_calibration.py seed-pairs-null measures the rate over 300."""
    rate = calibration.seed_pair_false_alarms(30)
    assert rate.runs == 30 and rate.passed, rate.line()


def test_pairs_are_counted_by_seed_whatever_the_arrival_order() -> None:
    """Samples arrive out of order (concurrent requests) and with gaps: the pairs are those of
    consecutive seeds, the runs those of the seeds drawn, and only run ends are remembered."""
    truth = distribution.Truth(SPEC, WL)
    samples = [s for s in draw(truth, 300, np.random.default_rng(43)) if s.seed not in (100, 201)]
    order = np.random.default_rng(44).permutation(len(samples))
    tally = OutcomeCounts.of([samples[i] for i in order], WL)
    by_seed = {s.seed: s.text[: tally.pair_length] for s in samples}
    want: dict[tuple[str, str], int] = {}
    for s in by_seed:
        if s + 1 in by_seed:
            k = (by_seed[s], by_seed[s + 1])
            want[k] = want.get(k, 0) + 1
    assert tally.pairs == want
    assert sorted(tally.runs) == sorted([99, 100, 99])
    assert len(tally._ends) <= 6


def test_the_pair_test_matches_its_chi_square_reference_when_counts_are_large() -> None:
    """Dense tables: Monte-Carlo and chi-square references agree (the same null)."""
    rng = np.random.default_rng(45)
    p = np.array([0.5, 0.3, 0.2])
    chain = rng.choice(3, size=3000, p=p)
    pairs = np.zeros((3, 3), dtype=np.int64)
    np.add.at(pairs, (chain[:-1], chain[1:]), 1)
    mc = stats.pair_independence_test(pairs, [3000], p, method="monte-carlo", mc_draws=2000)
    asym = stats.pair_independence_test(pairs, [3000], p, method="g-test")
    assert abs(mc.p_value - asym.p_value) < 0.05
    assert asym.df == 4
