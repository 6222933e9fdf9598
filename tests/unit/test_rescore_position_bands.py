"""Long generations: the PIT values of each band of positions (0-7, 8-15, 16-31, ...) get a KS
test of their own in the family, so a bug that acts only late in a generation is not diluted by
the early tokens; a run of at most 8 tokens per sample keeps its family as it was."""

from __future__ import annotations

import numpy as np
from scipy import stats

from specaudit.reference import NextToken
from specaudit.rescore import analysis
from specaudit.rescore.pit import Pits
from specaudit.rescore.records import TokenDraw
from specaudit.stats import Verdict

FAIR = {0: 0.5, 1: 0.5}


def _draws(
    rng: np.random.Generator, *, gens: int, tokens: int, late: float = 0.0
) -> list[TokenDraw]:
    """`gens` generations of `tokens` tokens from a fair coin, the tokens from position 32 on
    biased by `late` toward token 0 (a bug that acts only late)."""
    out = []
    for g in range(gens):
        for i in range(tokens):
            p0 = 0.5 + (late if i >= 32 else 0.0)
            tok = 0 if rng.random() < p0 else 1
            out.append(TokenDraw(g, 0, i, f"0:{g}:{i}", tok, NextToken(probs=FAIR)))
    return out


def test_bands_double_from_eight_up_to_the_last_position() -> None:
    assert analysis.position_bands(range(8)) == [(0, 8)]
    assert analysis.position_bands(range(64)) == [(0, 8), (8, 16), (16, 32), (32, 64)]
    assert analysis.position_bands([0, 70]) == [(0, 8), (8, 16), (16, 32), (32, 64), (64, 128)]


def test_eight_tokens_per_sample_add_no_test() -> None:
    draws = _draws(np.random.default_rng(0), gens=100, tokens=8)
    st = analysis.analyse(draws)
    assert [t.name for t in st.tests] == list(analysis.FIXED_TESTS)


def test_a_band_with_too_few_values_is_folded_into_the_one_before() -> None:
    """20 generations of 10 tokens: positions 8-9 have 40 values, fewer than a band needs, so
    the run has one band and no extra test; 30 generations (60 values) make two."""
    rng = np.random.default_rng(1)
    assert analysis.position_band_tests(Pits.of(_draws(rng, gens=20, tokens=10), 0)) == []
    two = analysis.position_band_tests(Pits.of(_draws(rng, gens=30, tokens=10), 0))
    assert [t.name for t in two] == ["KS at positions 0-7", "KS at positions 8-9"]
    assert two[1].detail.startswith("60 PIT values")


def test_a_bug_that_acts_only_late_is_broken_by_its_band() -> None:
    st = analysis.analyse(_draws(np.random.default_rng(2), gens=60, tokens=64, late=0.08))
    by = {t.name: t for t in st.tests}
    assert st.verdict is Verdict.BROKEN
    late = by["KS at positions 32-63"]
    assert late.rejects and late.p_value < by["KS of the PIT values"].p_value / 100
    assert "KS at positions 32-63" in st.reason


def test_band_p_values_are_uniform_under_the_null() -> None:
    """A cheap replicate of the bands' level (80 runs x 4 bands): the share below 0.05 is not
    above 5 % (one-sided binomial test), and their KS against U(0,1) holds."""
    rng = np.random.default_rng(3)
    ps = [
        t.p_value
        for r in range(80)
        for t in analysis.position_band_tests(Pits.of(_draws(rng, gens=20, tokens=64), r))
    ]
    assert len(ps) == 320
    low = sum(p < 0.05 for p in ps)
    assert stats.binomtest(low, len(ps), 0.05, alternative="greater").pvalue > 0.001, low
