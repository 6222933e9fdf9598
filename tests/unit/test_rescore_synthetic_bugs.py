"""The simulated bug classes of the power table (benchmarks/bench_rescore_mutants.py) are the
bugs they claim to be: their closed forms, and a bug-free chain's draws unchanged by them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rescore_synthetic as rs  # noqa: E402


def test_a_residual_drawn_from_p_is_min_p_q_plus_the_rejection_mass_times_p() -> None:
    p = np.array([[0.5, 0.3, 0.2]])
    q = np.array([[0.2, 0.6, 0.2]])
    got = rs.residual_target(p, q)
    # accepted: min(p, q) = (0.2, 0.3, 0.2), rejected 0.3 of the time, then a draw from p
    np.testing.assert_allclose(got, [[0.2 + 0.3 * 0.5, 0.3 + 0.3 * 0.3, 0.2 + 0.3 * 0.2]])
    assert not np.allclose(got, p)
    # a draft equal to the target is never rejected: the bug has nothing to act on
    np.testing.assert_allclose(rs.residual_target(p, p), p)


def test_a_chain_without_the_history_bug_draws_the_same_tokens_as_before() -> None:
    plain = rs.chain(400, np.random.default_rng(3), with_draft=True)
    zero = rs.chain(400, np.random.default_rng(3), with_draft=True, stale=0.0)
    assert [d.token for d in plain] == [d.token for d in zero]


def test_the_history_bug_moves_tokens_only_after_a_rejection_and_keeps_the_support() -> None:
    plain = rs.chain(4000, np.random.default_rng(5), with_draft=True)
    stale = rs.chain(4000, np.random.default_rng(5), with_draft=True, stale=0.5)
    pairs = list(zip(plain, stale, strict=True))
    # a generation's first token comes before any rejection: never moved, same reference
    assert all(a.token == b.token and a.ref == b.ref for a, b in pairs if a.position == 0)
    moved = [b for a, b in pairs if a.token != b.token]
    assert 200 < len(moved) < 3000
    assert all(d.position > 0 for d in moved)
    # the support stays: every token the engine drew has real mass under the reference
    assert min(d.ref.probs[d.token] for d in stale) > 1e-9
