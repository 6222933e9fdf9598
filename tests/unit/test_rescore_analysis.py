"""The re-scored test's statistics on hand-made draws: right size under the null, power
against the biases speculation makes, refusals when it cannot decide."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from specaudit.reference import NextToken
from specaudit.rescore import analysis, pit, runner
from specaudit.rescore.records import RescoreError, TokenDraw
from specaudit.stats import Verdict


def _draws(
    n: int, bias: float = 0.0, *, vocab: int = 6, seed: int = 0, shared: bool = False
) -> list[TokenDraw]:
    """n draws, each from its own random distribution p (or one shared p); `bias` moves that
    much probability to the argmax (the draft's favourite) in what is actually sampled."""
    rng = np.random.default_rng(seed)
    one = rng.dirichlet(np.ones(vocab))
    out = []
    for i in range(n):
        p = one if shared else rng.dirichlet(np.ones(vocab))
        fav = int(np.argmax(p))
        q = (1 - bias) * p
        q[fav] += bias
        tok = int(rng.choice(vocab, p=q))
        key = "same" if shared else str(i)
        out.append(TokenDraw(i, 0, 0, key, tok, NextToken(probs=dict(enumerate(p.tolist())))))
    return out


def test_pit_values_are_uniform_when_tokens_follow_the_reference() -> None:
    res = analysis.analyse(_draws(2000, seed=3))
    assert res.verdict is Verdict.PRESERVED
    assert stats.kstest(res.u, "uniform").pvalue > 0.001
    assert res.impossible == 0


def test_false_alarm_rate_is_within_alpha() -> None:
    """Simulated null runs: more alarms than a Binomial(runs, alpha) makes 1 time in 1000 means
    the test is mis-sized. 40 runs here catch a grossly mis-sized test;
    benchmarks/bench_rescore_null.py measures the rate over 6000 (docs/rescore.md)."""
    runs, alpha = 40, 0.01
    alarms, (lo, _hi) = analysis.null_false_alarms(runs, 240, alpha=alpha, seed=11)
    assert alarms <= stats.binom.ppf(0.999, runs, alpha)
    assert lo <= alpha


def test_a_bias_toward_the_draft_favourite_is_broken() -> None:
    res = analysis.analyse(_draws(1000, bias=0.2, seed=5))
    assert res.verdict is Verdict.BROKEN
    assert res.directed_p < 1e-4
    assert res.favourite_rate > res.favourite_expected


def test_the_named_draft_favourite_is_used_over_the_argmax() -> None:
    """A bias toward a token that is not the reference's argmax is seen when the draft's
    favourite is given."""
    rng = np.random.default_rng(2)
    draws = []
    for i in range(800):
        p = np.array([0.5, 0.3, 0.2])
        q = np.array([0.4, 0.4, 0.2])  # mass moved to token 1, the draft's favourite
        tok = int(rng.choice(3, p=q))
        nt = NextToken(probs=dict(enumerate(p.tolist())))
        draws.append(TokenDraw(i, 0, 0, str(i), tok, nt, draft_favourite=1))
    res = analysis.analyse(draws)
    assert res.verdict is Verdict.BROKEN and res.directed_p < 1e-4


def test_an_impossible_token_is_broken() -> None:
    draws = _draws(400, seed=1)
    d = draws[7]
    draws[7] = TokenDraw(d.seed, 0, 0, d.prefix_key, 99, d.ref)
    res = analysis.analyse(draws)
    assert res.verdict is Verdict.BROKEN and res.impossible == 1
    assert "probability 0" in res.reason


def test_repeated_prefixes_are_g_tested() -> None:
    """One shared prefix whose top two tokens are swapped: PIT order and favourite can miss
    a swap among non-favourites, the per-prefix G-test does not."""
    rng = np.random.default_rng(4)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    q = np.array([0.4, 0.1, 0.2, 0.3])
    nt = NextToken(probs=dict(enumerate(p.tolist())))
    draws = [TokenDraw(i, 0, 0, "k", int(rng.choice(4, p=q)), nt) for i in range(600)]
    res = analysis.analyse(draws)
    assert res.g_prefixes == 1
    assert res.g_p < 1e-6 and res.verdict is Verdict.BROKEN


def test_the_e_process_stays_small_under_the_null_and_grows_under_bias() -> None:
    null = analysis.analyse(_draws(1500, seed=8), sequential=True)
    assert null.e_value < 1 / null.alpha and null.verdict is Verdict.PRESERVED
    bad = analysis.analyse(_draws(1500, bias=0.15, seed=8), sequential=True)
    assert bad.e_value >= 2 / bad.alpha and bad.verdict is Verdict.BROKEN
    assert "anytime-valid" in bad.reason


def test_preserved_states_the_bounds_it_certifies() -> None:
    res = analysis.analyse(_draws(1000, seed=9))
    assert res.verdict is Verdict.PRESERVED and res.certificate is not None
    assert res.certificate.within and res.needed == 1000
    assert "confidence" in res.reason and "cannot see" in res.certifies
    for b in res.certificate.bounds:
        assert 0 <= b.estimate <= b.upper <= res.tolerance


def test_a_run_too_small_to_bound_the_deviation_is_inconclusive_with_the_tokens_needed() -> None:
    """A correct engine over 300 tokens: nothing rejects, yet the bounds cannot exclude a
    deviation of the tolerance, so the run says INCONCLUSIVE and how many tokens would
    decide; the same engine over a fifth more than the tokens it names (a projection from
    this run's estimates, not a promise) is PRESERVED."""
    small = analysis.analyse(_draws(300, seed=13))
    assert small.verdict is Verdict.INCONCLUSIVE
    assert small.needed is not None and small.needed > 300
    assert f"{small.needed}" in small.reason
    big = analysis.analyse(_draws(int(1.2 * small.needed), seed=13))
    assert big.verdict is Verdict.PRESERVED


def test_a_tolerance_a_user_chooses_decides_between_preserved_and_inconclusive() -> None:
    draws = _draws(1000, seed=9)
    assert analysis.analyse(draws, tolerance=0.3).verdict is Verdict.PRESERVED
    assert analysis.analyse(draws, tolerance=0.02).verdict is Verdict.INCONCLUSIVE


def test_under_sampling_the_favourite_is_broken() -> None:
    """The favourite test is two-sided: a draft rejected too often is as wrong as one
    accepted too often."""
    res = analysis.analyse(_draws(1500, bias=-0.15, seed=6))
    assert res.verdict is Verdict.BROKEN
    assert res.favourite_rate < res.favourite_expected
    assert any(t.name == "favourite (two-sided)" and t.rejects for t in res.tests)


def test_preserved_never_sits_beside_an_unexplained_small_p_value() -> None:
    """Every test the verdict prints is in the Holm family: a raw p below alpha that does
    not reject is named with its adjusted value, never left beside PRESERVED unexplained."""
    for seed in range(40):
        res = analysis.analyse(_draws(400, seed=100 + seed, shared=seed % 2 == 0))
        small = [t for t in res.tests if t.p_value < res.alpha]
        if res.verdict is not Verdict.BROKEN:
            assert not any(t.rejects for t in res.tests)
            for t in small:
                assert t.name in res.reason and "does not count" in res.reason
        else:
            assert any(t.rejects for t in res.tests) or res.impossible


def test_sequential_counts_the_fixed_tests_it_prints() -> None:
    """With --sequential the fixed tests still decide (at alpha / 2, at the planned
    maximum): a bias the e-process is slow on but KS sees at once is BROKEN, not PRESERVED
    beside a tiny p-value."""
    rng = np.random.default_rng(21)
    draws = []
    for i in range(1200):
        p = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
        q = np.array([0.3, 0.15, 0.2, 0.15, 0.2])  # rank 2's mass to the tail, not the favourite
        nt = NextToken(probs=dict(enumerate(p.tolist())))
        draws.append(TokenDraw(i, 0, i % 4, f"{i}", int(rng.choice(5, p=q)), nt))
    res = analysis.analyse(draws, sequential=True)
    assert res.verdict is Verdict.BROKEN
    assert any(t.rejects for t in res.tests)


def test_too_few_tokens_are_refused() -> None:
    with pytest.raises(RescoreError, match="too few to decide"):
        analysis.check_enough(30)
    analysis.check_enough(400)


def test_poisson_binomial_tail_is_exact() -> None:
    ps = np.full(50, 0.3)
    for k in (0, 10, 15, 25, 50):
        assert pit.poisson_binomial_sf(k, ps) == pytest.approx(
            stats.binom.sf(k - 1, 50, 0.3), rel=1e-9, abs=1e-15
        )


def test_pit_orders_the_favourite_first() -> None:
    nt = NextToken(probs={5: 0.2, 7: 0.5, 9: 0.3})
    d = TokenDraw(1, 0, 0, "k", 9, nt, draft_favourite=9)
    assert pit.order(nt, 9) == [9, 7, 5]
    assert pit.pit(d, 0.5) == pytest.approx(0.15)
    assert pit.pit(TokenDraw(1, 0, 0, "k", 5, nt, draft_favourite=9), 1.0) == 1.0


def _by_job(draws: list[TokenDraw], per_job: int) -> tuple[list[tuple[int, int]], dict]:
    jobs = [(i, 0) for i in range(len(draws) // per_job)]
    return jobs, {j: draws[k * per_job : (k + 1) * per_job] for k, j in enumerate(jobs)}


def test_a_sequential_run_stops_sampling_once_its_anytime_evidence_decides() -> None:
    """The runner's looks (every LOOK_EVERY samples completed in sampling order): a biased
    engine is decided long before the planned 400 samples, samples completed out of order
    wait for the ones before them, and a correct engine is never stopped."""
    jobs, bad = _by_job(_draws(1600, bias=0.3, seed=31), 4)
    looks = runner._Looks(jobs, 0.01)
    done: dict = {}
    for j in [*jobs[1:200:2], *jobs[0:200:2], *jobs[200:]]:  # the odd ones first
        done[j] = bad[j]
        looks.completed(done)
        if looks.decided_at:
            break
    assert looks.decided_at is not None and looks.decided_at < 200
    assert analysis.anytime_decides([d for j in jobs[: looks.decided_at] for d in bad[j]])
    jobs, good = _by_job(_draws(1600, seed=32), 4)
    looks, done = runner._Looks(jobs, 0.01), {}
    for j in jobs:
        done[j] = good[j]
        looks.completed(done)
    assert looks.decided_at is None and looks.looked == len(jobs)
