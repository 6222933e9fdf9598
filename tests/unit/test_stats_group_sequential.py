"""Sequential mode's group-sequential looks: alpha is spent by information fraction (the
maximum number of samples is known), and every look's Monte-Carlo p-values can reach far
below the look's level, so the looks are not blind for the Monte-Carlo-referenced tests.

Samples are simulated from the fixture's closed form with numpy (no server)."""

from __future__ import annotations

import numpy as np
import pytest
from test_stats_history import SPEC, WL

import calibration
from closed_form import draw
from specaudit import distribution, stats
from specaudit.distribution import sequential


def _looks(maximum: int) -> list[int]:
    out, n = [], sequential.SEQUENTIAL_FIRST_LOOK
    while n < maximum:
        out.append(n)
        n *= 2
    return [*out, maximum]


@pytest.mark.parametrize("kind", stats.SPENDING)
def test_the_looks_spend_exactly_alpha_by_information_fraction(kind: str) -> None:
    alpha = 0.005
    looks = _looks(1000)
    levels = [
        stats.look_level(a, b, 1000, alpha, kind) for a, b in zip([0, *looks], looks, strict=False)
    ]
    assert all(x > 0 for x in levels)
    assert sum(levels) == pytest.approx(alpha, rel=1e-9)
    assert stats.spent_alpha(0.0, alpha, kind) == 0 and stats.spent_alpha(1.0, alpha, kind) == (
        pytest.approx(alpha)
    )
    fractions = np.linspace(0, 1, 50)
    spent = [stats.spent_alpha(t, alpha, kind) for t in fractions]
    assert all(b >= a for a, b in zip(spent, spent[1:], strict=False))
    if kind == "pocock":
        # the look after 100 of 1000 samples gets more than the old 1/look^2 series gave it
        assert levels[2] > stats.alpha_spending(3, alpha)
    with pytest.raises(ValueError):
        stats.spent_alpha(0.5, alpha, "linear")


def test_each_look_draws_enough_monte_carlo_samples_for_its_level() -> None:
    """After 100 of 1000 samples (the third look) the level is what Pocock-type spending gives
    for that information fraction, and a Monte-Carlo p-value can fall below Holm's first step
    at it (the old fixed 10^4 draws floored them at 1e-4, above the 5.6e-5 needed)."""
    truth = distribution.Truth(SPEC, WL)
    seq = sequential.Sequential(truth, WL, 0.01, 1e-9, 1000)
    for s in draw(truth, 100, np.random.default_rng(51)):
        assert not seq.add(s)
    assert seq.looks == 3
    level = stats.look_level(50, 100, 1000, 0.005, sequential.SPENDING)
    need = level / seq.family
    assert 1 / (1 + seq.look_draws) <= need / sequential.MC_RESOLUTION * 1.001
    assert need < 1 / (1 + stats.MC_DRAWS)  # what the looks could not reach before


def test_a_bug_only_the_looks_can_see_is_broken_before_the_maximum() -> None:
    """The pool-preserving history bug (per-context TV up to 0.20 at position 4): the
    e-processes pool contexts by true distribution and cannot see it (the e-value stays below
    its threshold); the looks' history test does, before the 1000th sample. One fixed-seed run
    here; benchmarks/bench_calibration.py looks-power measures how often over 40."""
    rate = calibration.looks_detect_early(1)
    assert (rate.events, rate.runs) == (1, 1), rate.line()
