"""The verdict rule of benchmarks/bench_hf_generators.py on synthetic counts: a sample drawn from
the exact distribution is PRESERVED at enough seeds (its certified TV bound within the
tolerance), INCONCLUSIVE at too few, and one drawn from a distribution a known TV away is BROKEN,
with a certified bound that covers that TV. No model runs here: the counts are drawn with numpy
from a joint built like the bench's (vocabulary 8, the next token's distribution a function of
the whole prefix)."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from specaudit import stats
from specaudit.stats import Verdict

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hf_generators.py"
TOKENS = 3
ALPHA = 0.01
TOLERANCE = 0.15

Joint = dict[tuple[int, ...], float]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_hf_generators", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def exact(vocab: int, seed: int = 5) -> Joint:
    """A joint of TOKENS tokens: every prefix its own next-token distribution (Dirichlet 0.3,
    about as peaked as the bench's targets), chained."""
    rng = np.random.default_rng(seed)
    out: Joint = {}
    cond = {
        pf: rng.dirichlet(np.full(vocab, 0.3))
        for t in range(TOKENS)
        for pf in itertools.product(range(vocab), repeat=t)
    }
    for seq in itertools.product(range(vocab), repeat=TOKENS):
        out[seq] = float(np.prod([cond[seq[:t]][seq[t]] for t in range(TOKENS)]))
    return out


def draw(dist: Joint, n: int, seed: int) -> list[tuple[int, ...]]:
    keys = list(dist)
    pr = np.array([dist[k] for k in keys])
    idx = np.random.default_rng(seed).choice(len(keys), size=n, p=pr / pr.sum())
    return [keys[i] for i in idx]


def shifted(dist: Joint, eps: float) -> tuple[Joint, float]:
    """(1 - eps) dist + eps on its least likely sequence, and its exact TV from dist."""
    rare = min(dist, key=lambda k: dist[k])
    q = {k: (1 - eps) * v + (eps if k == rare else 0.0) for k, v in dist.items()}
    keys = list(dist)
    tv = stats.tv_distance([q[k] for k in keys], [dist[k] for k in keys])
    return q, tv


def verdict(
    bench: ModuleType, draws: list[tuple[int, ...]], dist: Joint
) -> tuple[Verdict, list[stats.TvBound], int, int | None]:
    _, _, p, _, _ = bench.compare(draws, dist, TOKENS)
    out: tuple[Verdict, list[stats.TvBound], int, int | None] = bench.judge(
        draws, dist, TOKENS, p, ALPHA, TOLERANCE
    )
    return out


def test_the_defaults_are_dists(bench: ModuleType) -> None:
    from specaudit import distribution

    assert (bench.DEFAULT_ALPHA, bench.DEFAULT_TOLERANCE) == (
        distribution.DEFAULT_ALPHA,
        distribution.DEFAULT_TOLERANCE,
    )


def test_a_sample_of_the_exact_distribution_is_preserved_with_its_bound(bench: ModuleType) -> None:
    p = exact(bench.VOCAB)
    v, bounds, joint, needed = verdict(bench, draw(p, 5000, seed=1), p)
    assert joint == TOKENS
    assert len(bounds) == TOKENS + 1  # every position, then the joint
    assert all(b.confidence == pytest.approx(1 - ALPHA / (TOKENS + 1)) for b in bounds)
    assert max(b.upper for b in bounds) <= TOLERANCE
    assert v is Verdict.PRESERVED and needed is None


def test_too_few_seeds_of_the_exact_distribution_are_inconclusive(bench: ModuleType) -> None:
    p = exact(bench.VOCAB)
    v, bounds, _, needed = verdict(bench, draw(p, 200, seed=2), p)
    assert v is Verdict.INCONCLUSIVE
    assert max(b.upper for b in bounds) > TOLERANCE
    assert needed is not None and needed > 200


def test_a_distribution_a_known_tv_away_is_broken_and_bounded(bench: ModuleType) -> None:
    p = exact(bench.VOCAB)
    q, tv = shifted(p, 0.1)
    assert 0.09 < tv <= 0.1
    v, bounds, _, _ = verdict(bench, draw(q, 5000, seed=3), p)
    assert v is Verdict.BROKEN
    assert bounds[-1].upper >= tv  # the certified joint bound covers the true TV


def test_a_sequence_the_target_forbids_is_broken(bench: ModuleType) -> None:
    p = exact(bench.VOCAB)
    rare = min(p, key=lambda k: p[k])
    forbidding = {k: v for k, v in p.items() if k != rare}
    total = sum(forbidding.values())
    forbidding = {k: v / total for k, v in forbidding.items()}
    draws = draw(forbidding, 5000, seed=4)
    assert verdict(bench, draws, forbidding)[0] is Verdict.PRESERVED
    v, bounds, _, _ = verdict(bench, [*draws[:-1], rare], forbidding)
    assert v is Verdict.BROKEN


def test_exit_codes_follow_dist(bench: ModuleType) -> None:
    pres, inc, brk = Verdict.PRESERVED, Verdict.INCONCLUSIVE, Verdict.BROKEN
    assert bench.exit_code([pres, pres]) == 0
    assert bench.exit_code([pres, inc]) == 2
    assert bench.exit_code([inc, brk]) == 1
    assert bench.exit_code([brk, pres]) == 1


def test_an_underflowed_p_is_tiny_not_impossible(bench: ModuleType) -> None:
    """p = 0 is kept for draws the target forbids; a G-test's underflow is floored at TINY_P and
    its size kept in log10 (mpmath), as far as chi-square's tail goes."""
    p = exact(bench.VOCAB)
    top = max(p, key=lambda k: p[k])
    g, dof, pv, _, _ = bench.compare([top] * 20000, p, TOKENS)
    assert pv == stats.TINY_P
    log10 = bench.log10_chi2_sf(g, dof)
    assert log10 is not None and log10 < -320
    from scipy import stats as st

    assert bench.log10_chi2_sf(41.6, 4) == pytest.approx(np.log10(st.chi2.sf(41.6, 4)), abs=1e-9)
