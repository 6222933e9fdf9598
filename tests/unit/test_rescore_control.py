"""Same-seed coupling: an engine that samples and matches must reproduce the reference's own
generation at every seed; divergence is compared with the reference's from itself."""

from __future__ import annotations

import numpy as np

import rescore_synthetic as synth
from specaudit.rescore import analysis, control
from specaudit.rescore.sampling import SeededGeneration
from specaudit.rescore.scores import ScoreTest
from specaudit.stats import Verdict


def _gen(seed: int, ids: tuple[int, ...], prompt: int = 0) -> SeededGeneration:
    return SeededGeneration(seed, prompt, ids)


def test_the_first_difference_is_where_two_generations_part() -> None:
    assert control.first_difference((1, 2, 3), (1, 2, 3)) is None
    assert control.first_difference((1, 2, 3), (1, 5, 3)) == 1
    assert control.first_difference((1, 2), (1, 2, 3)) == 2  # a shorter one parts where it ends


def test_an_engine_that_reproduces_the_reference_is_not_flagged() -> None:
    ref = [_gen(s, (s % 5, s % 3, 1)) for s in range(100)]
    c = control.couple(ref, ref, ref[:64])
    assert (c.samples, c.diverged, c.control_samples, c.control_diverged) == (100, 0, 64, 0)
    assert c.p_value == 1.0 and c.first == {}


def test_divergence_beyond_the_references_own_is_significant_and_located() -> None:
    """A history bug: after its first rejection the engine keeps a stale context, so a third of
    its samples part from the reference's at position 2; the reference parts from itself in 1
    of 64 (batch-shape rounding)."""
    ref = [_gen(s, (s % 5, s % 3, s % 7, 0)) for s in range(120)]
    eng = [_gen(g.seed, g.ids[:2] + (99, 0)) if g.seed % 3 == 0 else g for g in ref]
    again = [_gen(1, (9, 9, 9, 9)), *ref[1:64]]
    c = control.couple(eng, ref, again)
    assert c.diverged == 40 and c.first == {2: 40}
    assert c.control_diverged == 1 and c.p_value < 1e-6
    assert "40 of 120" in c.summary()
    # the same divergence where the reference is as unstable is not evidence
    noisy = [_gen(g.seed, (99,)) if g.seed % 2 == 0 else g for g in ref[:64]]
    assert control.couple(eng, ref, noisy).p_value > 0.05


def test_the_coupling_test_joins_the_family_holm_decides() -> None:
    draws = synth.run(1000, np.random.default_rng(9))
    fine = analysis.analyse(draws, extra=[ScoreTest("same-seed coupling", 0.0, 0.5, "")])
    assert fine.verdict is Verdict.PRESERVED
    assert [t.name for t in fine.tests][-1] == "same-seed coupling"
    bad = analysis.analyse(draws, extra=[ScoreTest("same-seed coupling", 0.3, 1e-9, "x")])
    assert bad.verdict is Verdict.BROKEN and "same-seed coupling" in bad.reason
    assert any(t.name == "same-seed coupling" and t.rejects for t in bad.tests)
