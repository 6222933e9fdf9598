"""Every verdict says what it could have seen: per position, the prefix-averaged TV that the
tests detect with 80 % power whatever the deviation's direction, and the same for the whole
tested sequence; PRESERVED also bounds the whole sequence's TV. The numbers are typed fields
of the result, in its reason, its Markdown and its JSON.

Samples are simulated from the fixture's closed form with numpy (no server)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import stats as st
from test_stats_history import SPEC, WL

from closed_form import draw
from specaudit import distribution, stats
from specaudit.distribution.results import GenericPower
from specaudit.report import to_jsonable
from specaudit.stats import Verdict


def test_the_noncentrality_gives_the_requested_power() -> None:
    for df, level in ((1, 0.01), (6, 1e-3), (40, 1e-4)):
        lam = stats.detectable_noncentrality(df, level, 0.8)
        assert st.ncx2.sf(st.chi2.isf(level, df), df, lam) == pytest.approx(0.8, abs=1e-4)
    assert stats.detectable_tv(0, [2], 0.01) is None
    assert stats.detectable_tv(1000, [0], 0.01) is None
    one = stats.detectable_tv(1000, [2], 0.01)
    assert one is not None and one == pytest.approx(
        (stats.detectable_noncentrality(2, 0.01) / 4000) ** 0.5
    )


def _res(n: int, seed: int) -> distribution.EngineResult:
    truth = distribution.Truth(SPEC, WL)
    return distribution.analyse(
        SPEC, WL, draw(truth, n, np.random.default_rng(seed)), mc_draws=2000
    )


def test_preserved_reports_power_per_position_and_a_bound_on_the_whole_sequence() -> None:
    res = _res(1500, 61)
    assert res.verdict is Verdict.PRESERVED, res.reason
    g = res.power
    assert isinstance(g, GenericPower) and g.n == 1500 and g.power == 0.8
    assert g.level == pytest.approx(0.01 / len(res.tests))
    assert len(g.tv_by_position) == WL.positions
    assert all(x is not None and 0 < x < 0.2 for x in g.tv_by_position)
    assert g.tv_sequence is not None and g.tv_sequence > max(x or 0 for x in g.tv_by_position)
    assert g.tv_joint is not None
    assert res.sequence_tv_bound is not None and 0 < res.sequence_tv_bound <= 1
    assert "power against any deviation" in res.reason
    assert f"whole tested sequence (positions 1-4) has TV <= {res.sequence_tv_bound:.3f}" in (
        res.reason
    )
    md = distribution.to_markdown(
        distribution.DistResult("x", Path("."), {}, WL, 0.01, 0.15, False, [res])
    )
    assert "Any deviation: 80% power" in md and "Whole tested sequence: TV <=" in md
    js = to_jsonable(res)
    assert js["power"]["tv_by_position"] == pytest.approx(g.tv_by_position)
    assert js["sequence_tv_bound"] == pytest.approx(res.sequence_tv_bound)
    assert "directed" in js and "tv_bound" in js  # the old fields stay


def test_other_verdicts_report_their_power_too() -> None:
    res = _res(200, 62)
    assert res.verdict is Verdict.INCONCLUSIVE
    assert res.power is not None and "power against any deviation" in res.reason


def test_a_deviation_of_the_reported_size_at_position_1_is_seen_with_that_power() -> None:
    """Position 1 (one context): two directions of deviation with exactly the reported TV,
    the easiest to miss (mass moved proportionally, from the likeliest token to the others)
    and a plain swap; the position-1 test at the reported level rejects in at least about
    80 % of 200 replicates each."""
    res = _res(1000, 63)
    g = res.power
    assert g is not None and g.tv_by_position[0] is not None
    tv = g.tv_by_position[0]
    truth = distribution.Truth(SPEC, WL)
    p = truth.p("")
    support = np.flatnonzero(p > 0)
    top = support[np.argmax(p[support])]
    others = [i for i in support if i != top]
    spread = p.copy()
    spread[top] -= tv
    spread[others] += tv * p[others] / p[others].sum()
    swap = p.copy()
    swap[top] -= tv
    swap[others[0]] += tv
    rng = np.random.default_rng(64)
    for q in (spread, swap):
        assert stats.tv_distance(q, p) == pytest.approx(tv)
        hits = sum(
            stats.multinomial_gof(rng.multinomial(1000, q), p).p_value < g.level for _ in range(200)
        )
        assert hits >= st.binom.ppf(0.001, 200, 0.78), hits


def test_the_whole_sequence_bound_covers_the_true_sequence_tv() -> None:
    """Every context tilted by 0.04: the true TV of the 4-token sequence, by enumeration, is
    within the reported bound in every one of 20 runs."""
    truth = distribution.Truth(SPEC, WL)

    def bend(prefix: str, p: np.ndarray) -> np.ndarray:
        order = np.argsort(-p, kind="stable")
        q = p.copy()
        q[order[0]] -= 0.04
        q[order[1]] += 0.04
        return q

    def paths(prefix: str, pb: float, qb: float) -> list[tuple[float, float]]:
        """(target, bent) probability of every 4-token path continuing `prefix`."""
        if len(prefix) == 4:
            return [(pb, qb)]
        p = truth.next(prefix)
        q = bend(prefix, p)
        out: list[tuple[float, float]] = []
        for j in np.flatnonzero((p > 0) | (q > 0)):
            out += paths(prefix + truth.labels[j], pb * p[j], qb * q[j])
        return out

    true_tv = 0.5 * sum(abs(a - b) for a, b in paths("", 1.0, 1.0))
    assert 0.05 < true_tv < 0.2
    rng = np.random.default_rng(65)
    for _ in range(20):
        res = distribution.analyse(SPEC, WL, draw(truth, 1000, rng, bend), mc_draws=300)
        assert res.sequence_tv_bound is not None and res.sequence_tv_bound >= true_tv
