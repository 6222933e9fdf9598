"""The exact multinomial test never reports p = 0 for an outcome the null allows: p = 0 is
reserved for impossible outcomes (certainty), and a possible outcome's tail is at least its own
probability, however far below the smallest float that lies."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special

from specaudit import stats
from specaudit.distribution.render import fmt_gof_p


def test_a_possible_but_astronomically_unlikely_outcome_is_not_p_zero() -> None:
    res = stats.multinomial_gof([0, 0, 600], [0.4975, 0.4975, 0.005])
    assert res.method == "exact"
    assert res.p_value > 0  # a valid p-value (>= the true one), never 0
    # the only outcome at least this extreme is the observed one: its log10 probability
    assert res.log10_p == pytest.approx(600 * math.log10(0.005), rel=1e-9)
    assert fmt_gof_p(res) != "0" and "1e-1381" in fmt_gof_p(res)


def test_the_log_space_tail_agrees_with_the_plain_sum_where_both_are_representable() -> None:
    rng = np.random.default_rng(4)
    p = np.array([0.5, 0.3, 0.2])
    for _ in range(20):
        obs = rng.multinomial(30, p)
        res = stats.multinomial_gof(obs, p, method="exact")
        assert res.log10_p is not None
        assert res.p_value == pytest.approx(10**res.log10_p, rel=1e-9)
    far = stats.multinomial_gof([0, 0, 300], [0.45, 0.45, 0.1], method="exact")
    assert far.log10_p == pytest.approx(
        float(special.logsumexp([300 * math.log(0.1)])) / math.log(10), rel=1e-9
    )


def test_impossible_outcomes_keep_p_zero() -> None:
    res = stats.multinomial_gof([1, 5, 0], [0.0, 0.5, 0.5])
    assert res.p_value == 0.0 and res.method == "impossible"
