"""The count test of sampled tokens outside the reference's top-k (`rescore.outside`): exact on
tiny cases against scipy and enumeration, at its level with the null rate estimated (a cheap
replicate of benchmarks/bench_rescore_edge.py), powerful on a top-k 44-instead-of-40 bug, and a
single token impossible in every batch shape still BROKEN, at once under --sequential."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

import rescore_synthetic as rs
from specaudit.reference import NextToken
from specaudit.rescore import analysis, outside, runner
from specaudit.rescore.outside import EdgeLeak
from specaudit.rescore.records import TokenDraw
from specaudit.stats import Verdict


def _draw(i: int, probs: dict[int, float], token: int) -> TokenDraw:
    return TokenDraw(i, 0, 0, f"0:{i}", token, NextToken(probs=probs))


def test_the_leak_is_the_mass_outside_the_whole_support_in_units_of_its_smallest() -> None:
    whole = {1: 0.5, 2: 0.3, 3: 0.2}
    assert outside.unit(whole) == pytest.approx(0.2)
    same = {1: 0.5, 2: 0.31, 3: 0.19}
    swapped = {1: 0.5, 2: 0.3, 4: 0.2}  # the 3rd token swapped for the 4th: one unit leaked
    assert outside.leak_units(whole, [same]) == 0.0
    assert outside.leak_units(whole, [same, swapped]) == pytest.approx(1.0)
    assert outside.leak_units(whole, []) == 0.0


def test_the_leak_bound_is_the_exact_poisson_upper_bound() -> None:
    """P(Poisson(J x bound) <= count) = delta: the bound's definition, against scipy."""
    for total, j, delta in ((0.0, 16, 1e-4), (2.3, 16, 1e-3), (7.0, 32, 0.01)):
        b = outside.leak_bound(total, j, delta)
        assert stats.poisson.cdf(math.ceil(total), j * b) == pytest.approx(delta, rel=1e-6)
    assert outside.leak_bound(1.0, 0, 0.01) == math.inf


def test_the_count_p_value_is_exact_on_tiny_cases() -> None:
    """Equal units: the binomial tail (scipy) plus delta; unequal: full enumeration."""
    edge = EdgeLeak((0.5, 0.0, 1.0, 0.0), 1e-3)
    support = {0: 0.9, 1: 0.1}  # unit 0.1
    draws = [_draw(i, support, 5 if i < 2 else 0) for i in range(6)]
    got = outside.outside_test(draws, edge)
    r = edge.bound * 0.1
    assert got.outside == 2 and got.far == 0
    assert got.p_value == pytest.approx(stats.binom.sf(1, 6, r) + 1e-3, rel=1e-9)
    assert got.expected == pytest.approx(6 * r)
    assert got.estimate == pytest.approx(6 * 0.1 * 0.375)

    supports = [{0: 0.7, 1: 0.3}, {0: 0.95, 1: 0.05}, {0: 0.5, 1: 0.5}, {0: 0.8, 1: 0.2}]
    draws = [_draw(i, s, 9 if i in (1, 3) else 0) for i, s in enumerate(supports)]
    edge = EdgeLeak((0.1,), 0.0)
    rates = [min(1.0, edge.bound * outside.unit(s)) for s in supports]
    tail = sum(
        math.prod(r if o else 1 - r for r, o in zip(rates, outcome, strict=True))
        for outcome in itertools.product((0, 1), repeat=4)
        if sum(outcome) >= 2
    )
    assert outside.outside_test(draws, edge).p_value == pytest.approx(tail, rel=1e-9)


def test_a_far_token_gives_delta_and_no_measurement_means_a_null_rate_of_zero() -> None:
    support = {0: 0.6, 1: 0.4}
    draws = [_draw(i, support, 7 if i == 3 else 0) for i in range(50)]
    edge = EdgeLeak((0.0,) * 16, 1e-4)
    near = outside.outside_test(draws, edge)
    assert near.far == 0 and near.p_value > 0.5  # one token where ~20 units are allowed
    far = outside.outside_test(draws, edge, far={outside.key_of(draws[3])})
    assert far.far == 1 and far.p_value == 1e-4
    unmeasured = outside.outside_test(draws)
    assert (unmeasured.far, unmeasured.p_value) == (1, 0.0)
    assert outside.outside_test(draws[:3]).p_value == 1.0


def _null_run(rng: np.random.Generator, n: int, swap: float) -> outside.OutsideTest:
    draws, rows = rs.topk_run(n, rng, swap=swap)
    picked = outside.sample_draws(n, seed=int(rng.integers(1 << 30)))
    edge = EdgeLeak(rs.topk_leaks(rows, picked, rng, swap), 0.1 * outside.BOUND_SHARE)
    return outside.outside_test(draws, edge)


def test_the_count_test_holds_its_level_with_the_rate_estimated() -> None:
    """A correct engine on a noisy edge (its 40th and 41st tokens swap at 30 % of prefixes,
    far more than Gemma's): false alarms at alpha = 0.1 not above alpha (binomial test)."""
    rng = np.random.default_rng(11)
    runs = 120
    alarms = sum(_null_run(rng, 200, 0.3).p_value < 0.1 for _ in range(runs))
    assert stats.binomtest(alarms, runs, 0.1, alternative="greater").pvalue > 1e-3


def test_a_top_k_off_by_four_is_seen_by_the_count() -> None:
    """Top-k 44 instead of 40: ranks 41-44 sampled about 10 times per 1000 tokens, which the
    old edge rule dropped; the count rejects a 4000-token run at alpha / 5 (its Bonferroni
    share), with the reference's own edge noisy at 2 % of prefixes."""
    rng = np.random.default_rng(3)
    draws, rows = rs.topk_run(4000, rng, k_engine=44, swap=0.02)
    edge = EdgeLeak(rs.topk_leaks(rows, outside.sample_draws(4000), rng, 0.02), 1e-4)
    got = outside.outside_test(draws, edge)
    assert got.outside > 2 * got.expected
    assert got.p_value < 0.01 / len(analysis.FIXED_TESTS)


def test_a_single_impossible_token_is_broken_in_the_family_and_stops_a_sequential_run() -> None:
    rng = np.random.default_rng(5)
    draws, _ = rs.topk_run(400, rng)
    d = draws[17]
    draws[17] = TokenDraw(d.seed, d.prompt, d.position, d.prefix_key, 63, d.ref)
    edge = EdgeLeak((0.0,) * outside.EDGE_PREFIXES, 0.01 * outside.BOUND_SHARE)
    far = {outside.key_of(draws[17])}
    for sequential in (False, True):
        res = analysis.analyse(draws, edge=edge, far=far, sequential=sequential)
        assert res.verdict is Verdict.BROKEN and res.impossible == 1
        assert res.reason.startswith(outside.NAME) and "probability 0" in res.reason
    near = analysis.analyse(draws, edge=edge)  # the same token, at the edge: counted, kept
    assert near.verdict is not Verdict.BROKEN and near.outside is not None
    assert near.outside.outside == 1 and near.impossible == 0
    assert analysis.anytime_decides(draws, far=far)
    assert not analysis.anytime_decides(draws)
    jobs = [(s, 0) for s in range(40)]
    looks = runner._Looks(jobs, 0.01)
    looks.completed({jobs[0]: draws[:1]}, far)
    assert looks.decided_at == 1  # at once, before the first regular look


def test_the_report_shows_the_count_against_the_reference_s_own_rate() -> None:
    from specaudit.fixtures import SamplerSettings
    from specaudit.rescore import render

    support = {0: 0.6, 1: 0.4}
    draws = [_draw(i, support, 7 if i == 3 else 0) for i in range(50)]
    edge = EdgeLeak((0.0,) * 16, 1e-4)
    res = runner.RescoreResult(
        "e", "r", None, [[1]], 50, 1, SamplerSettings(), draws=draws, boundary=1, edge=edge
    )
    res.stats = analysis.analyse(draws, edge=edge)
    row = dict(render.rows(res))["tokens outside the reference's top-k (count test)"]
    assert row.startswith("1 outside (1 at the edge, 0 impossible); expected under")
    assert "at 16 prefixes), p = 1" in row
    assert render.to_json(res)["outside"]["count"] == 1


def test_tokens_outside_the_top_k_are_sorted_into_edge_and_impossible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the edge: within the margin of the k-th raw logprob, or within `FAR_FACTOR` margins
    (at least `FAR_MIN` nats); impossible: beyond that, or not in the raw top k + 20 at all,
    unless its own prefix's batch shapes put it in the top-k (asked for at most
    `EDGE_CONFIRM` tokens)."""
    import asyncio

    from specaudit.fixtures import SamplerSettings
    from specaudit.rescore import spread

    raw = {0: -0.7, 1: -1.2, 2: -1.6, 3: -1.62, 4: -2.5, 5: -1.9, 8: -2.6}
    moved = NextToken(probs={0: 0.5, 1: 0.3, 8: 0.2})  # token 8 in the top-3 of one shape
    monkeypatch.setattr(spread, "incremental_answers", lambda *a, **k: [moved])

    class Ref:
        url = "http://reference"
        sampler = SamplerSettings()

        async def raw(self, ids: object, n: int) -> dict[int, float]:
            return raw

    support = {0: 0.5, 1: 0.3, 2: 0.2}
    draws = [_draw(i, support, t) for i, t in enumerate((0, 3, 5, 4, 6, 8))]
    sorter = spread.OutsideSorter(Ref(), [[1, 2]], 3, 0.05, 1.0)  # type: ignore[arg-type]
    asyncio.run(sorter.classify(draws))
    assert sorter.near == 3  # 3: within the margin; 5: 0.3 nats past; 8: in another shape
    assert sorter.far == {outside.key_of(draws[3]), outside.key_of(draws[4])}  # 0.9 past, absent
    assert sorter.confirmed == 3
