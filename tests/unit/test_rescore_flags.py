"""Per-token draft flags (`rescore.flags`): the response entries aligned to the generated ids,
and the two tests of the verification rule against their laws, on simulated engines whose
acceptance and residual are exactly right or wrong. The real flags come from the spec-logprobs
build (tests/integration/test_rescore_servers.py)."""

from __future__ import annotations

import numpy as np
from scipy import stats

from specaudit.reference import NextToken
from specaudit.rescore import flags
from specaudit.rescore.flags import DraftFlag
from specaudit.rescore.records import TokenDraw


def test_entries_are_aligned_by_id_when_a_token_has_none() -> None:
    """llama-server gives no entry to a token whose text ends inside a UTF-8 character: the
    second token here has none, and the third's entry must not be read as the second's."""
    ids = [5, 7, 9]
    entries = [{"id": 5}, {"id": 9, "draft_id": 9, "verified_by": "rejection"}]
    assert flags.align(entries, ids) == [entries[0], None, entries[1]]
    assert flags.parse_flags(entries, ids) == (None, None, DraftFlag(9, "rejection"))


def test_an_engine_that_does_not_flag_gives_no_flags() -> None:
    assert flags.parse_flags([{"id": 1}, {"id": 2}], [1, 2]) == ()
    assert flags.parse_flags([], [1, 2]) == ()
    bonus = flags.parse_flags([{"id": 1, "draft_id": -1, "verified_by": "match"}], [1])
    assert bonus == (DraftFlag(None, "match"),)  # the token after a fully accepted draft


P = {0: 0.5, 1: 0.25, 2: 0.15, 3: 0.1}
Q = {0: 0.2, 1: 0.2, 2: 0.3, 3: 0.3}  # the residual norm(max(0, p - q)) lives on tokens 0, 1


def _rejection_draws(
    n: int, rng: np.random.Generator, *, residual_from_p: bool = False
) -> list[TokenDraw]:
    """`n` positions of an exact rejection sampler with draft q and target p (the same prefix
    law each time): d ~ q, accepted with min(1, p/q), else x from norm(max(0, p - q)), or from p
    itself with `residual_from_p` (the residual-target bug)."""
    keys = sorted(P)
    resid = np.array([max(0.0, P[t] - Q[t]) for t in keys])
    resid /= resid.sum()
    out = []
    for i in range(n):
        d = int(rng.choice(keys, p=[Q[t] for t in keys]))
        if rng.random() < min(1.0, P[d] / Q[d]):
            x = d
        else:
            law = np.array([P[t] for t in keys]) if residual_from_p else resid
            x = int(rng.choice(keys, p=law))
        out.append(
            TokenDraw(
                i,
                0,
                1,
                f"0:{i}",
                x,
                NextToken(probs=P),
                draft=NextToken(probs=Q),
                draft_token=d,
                verified_by="rejection",
            )  # fmt: skip
        )
    return out


def test_an_exact_rejection_sampler_keeps_both_laws() -> None:
    draws = _rejection_draws(2000, np.random.default_rng(0))
    acc = flags.acceptance_test(draws)
    res = flags.residual_test(draws)
    assert acc is not None and res is not None
    assert acc.p_value > 0.01 and res.p_value > 0.01
    assert acc.detail.startswith(f"{sum(d.token == d.draft_token for d in draws)} of 2000")


def test_a_residual_drawn_from_p_is_seen_at_once() -> None:
    """After a rejection the bug draws from p, so tokens 2 and 3 appear where the residual has
    no mass (p < q): certain evidence, where the exact sampler never gives one."""
    draws = _rejection_draws(300, np.random.default_rng(1), residual_from_p=True)
    res = flags.residual_test(draws)
    assert res is not None and res.p_value < 1e-300
    assert "where the residual has no mass" in res.detail
    exact = flags.residual_test(_rejection_draws(300, np.random.default_rng(1)))
    assert exact is not None and "no mass" not in exact.detail


def test_an_acceptance_rule_that_accepts_too_often_is_seen() -> None:
    """min(1, 1.5 p/q) instead of min(1, p/q): the count of acceptances is too high."""
    rng = np.random.default_rng(2)
    draws = _rejection_draws(1500, rng)
    biased = []
    for d in draws:
        assert d.draft_token is not None
        if d.token != d.draft_token and rng.random() < 0.5 * P[d.draft_token] / Q[d.draft_token]:
            d = TokenDraw(
                d.seed, d.prompt, d.position, d.prefix_key, d.draft_token, d.ref,
                draft=d.draft, draft_token=d.draft_token, verified_by=d.verified_by,
            )  # fmt: skip
        biased.append(d)
    acc = flags.acceptance_test(biased)
    assert acc is not None and acc.p_value < 1e-4 and acc.statistic > 0


def test_match_needs_no_q_and_its_acceptance_is_p_of_the_proposal() -> None:
    """Sample-and-match: the target samples x from p and the proposal d is accepted when
    x = d, so P(accept) = p(d); a rejected position's x is p without d."""
    rng = np.random.default_rng(3)
    keys = sorted(P)
    draws = []
    for i in range(2000):
        d = 0  # a greedy draft proposes its argmax
        x = int(rng.choice(keys, p=[P[t] for t in keys]))
        draws.append(
            TokenDraw(i, 0, 1, f"0:{i}", x, NextToken(probs=P), draft_token=d, verified_by="match")
        )
    acc, res = flags.acceptance_test(draws), flags.residual_test(draws)
    assert acc is not None and res is not None
    assert acc.p_value > 0.01 and res.p_value > 0.01


def test_noise_widens_the_acceptance_law_instead_of_raising_false_alarms() -> None:
    """Reference probabilities 10 % off the engine's: with the measured ratio bound the test
    takes the conservative end and holds; without it the same draws are an alarm."""
    rng = np.random.default_rng(4)
    draws = _rejection_draws(4000, rng)
    off = {0: 0.5 * 0.9, 1: 0.25, 2: 0.15 * 1.1, 3: 0.1}  # what a noisy reference answers
    noisy = [
        TokenDraw(
            d.seed,
            d.prompt,
            d.position,
            d.prefix_key,
            d.token,
            NextToken(probs=off),
            draft=d.draft,
            draft_token=d.draft_token,
            verified_by=d.verified_by,
        )  # fmt: skip
        for d in draws
    ]
    kept = flags.acceptance_test(noisy, ratio_bound=1.1)
    assert kept is not None and kept.p_value > 0.01
    alarm = flags.acceptance_test(noisy)
    assert alarm is not None and alarm.p_value < 0.01


def test_the_acceptance_test_holds_its_level() -> None:
    """A cheap replicate (200 exact runs of 300 positions): the share of p < 0.05 is not
    above 5 % (one-sided binomial test)."""
    rng = np.random.default_rng(5)
    ps = []
    for _ in range(200):
        t = flags.acceptance_test(_rejection_draws(300, rng))
        assert t is not None
        ps.append(t.p_value)
    low = sum(p < 0.05 for p in ps)
    assert stats.binomtest(low, len(ps), 0.05, alternative="greater").pvalue > 0.001, low
