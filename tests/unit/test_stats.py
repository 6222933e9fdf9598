"""The statistics of `specaudit dist` on cases whose answer is known."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import optimize
from scipy import stats as st

from specaudit import stats
from specaudit.stats import Verdict, gof, tv

P3 = [0.345, 0.452, 0.203]  # the report's target after "f"


# --------------------------------------------------------------------------------------------
# goodness of fit


def test_g_statistic_matches_scipy() -> None:
    obs = np.array([290, 380, 170])
    exp = 840 * np.array(P3)
    ref = st.power_divergence(obs, exp, lambda_="log-likelihood").statistic
    assert stats.g_statistic(obs, exp) == pytest.approx(ref, rel=1e-12)


def test_large_counts_use_the_williams_corrected_g_test() -> None:
    obs = [300, 360, 180]
    r = stats.multinomial_gof(obs, P3)
    assert r.method == "g-test"
    assert r.df == 2
    g = st.power_divergence(obs, 840 * np.array(P3), lambda_="log-likelihood").statistic
    q = 1 + (9 - 1) / (6 * 840 * 2)
    assert r.statistic == pytest.approx(g / q)
    assert r.p_value == pytest.approx(st.chi2.sf(g / q, 2))


def test_report_counts_of_the_example_program_are_rejected() -> None:
    # "after f it always chose e": 820 runs, all e
    r = stats.multinomial_gof([820, 0, 0], P3)
    assert r.p_value < 1e-100


def _brute_exact(obs: list[int], p: list[float]) -> float:
    """Exact multinomial p-value by explicit enumeration with scipy's pmf."""
    n, k = sum(obs), len(obs)
    dist = st.multinomial(n, p)
    g_obs = stats.g_statistic(obs, n * np.array(p))
    total = 0.0
    for x in itertools.product(range(n + 1), repeat=k):
        if sum(x) != n:
            continue
        if stats.g_statistic(x, n * np.array(p)) >= g_obs - 1e-9:
            total += dist.pmf(x)
    return total


@pytest.mark.parametrize("obs", [[1, 0, 0], [0, 1, 0], [3, 0, 1], [2, 2, 2], [0, 0, 5], [6, 1, 0]])
def test_small_counts_use_the_exact_test(obs: list[int]) -> None:
    r = stats.multinomial_gof(obs, P3)
    assert r.method == "exact"
    assert r.p_value == pytest.approx(_brute_exact(obs, P3), rel=1e-9)


def test_monte_carlo_agrees_with_exact_and_is_reproducible() -> None:
    obs = [9, 2, 1]
    exact = stats.multinomial_gof(obs, P3, "exact").p_value
    mc = stats.multinomial_gof(obs, P3, "monte-carlo", mc_draws=40_000, seed=3)
    assert mc.p_value == pytest.approx(exact, abs=0.01)
    assert stats.multinomial_gof(obs, P3, "monte-carlo", mc_draws=40_000, seed=3) == mc


def test_auto_falls_back_to_monte_carlo_when_enumeration_is_too_big() -> None:
    p = np.full(12, 1 / 12)
    obs = np.array([30] * 11 + [0])  # expected 27.5 each, but enumerating is impossible
    r = stats.multinomial_gof(obs, p)
    assert r.method == "g-test"
    obs_small = np.array([4] * 11 + [0])
    r = stats.multinomial_gof(obs_small, p)
    assert r.method == "monte-carlo"
    assert 0 < r.p_value <= 1


@pytest.mark.parametrize("n", [1, 10, 1000, 10**6])
def test_an_observed_zero_probability_token_is_broken_with_certainty(n: int) -> None:
    # n - 1 perfectly typical observations and one impossible one
    p = [0.5, 0.5, 0.0]
    obs = [(n - 1) // 2, (n - 1) - (n - 1) // 2, 1]
    r = stats.multinomial_gof(obs, p)
    assert r.method == "impossible"
    assert r.p_value == 0.0
    assert r.impossible == 1
    assert math.isinf(r.statistic)
    adj = stats.holm([r.p_value, 1.0, 1.0])
    assert stats.decide(adj, 1e-12, [0.0], 1.0, impossible=True) is Verdict.BROKEN
    assert stats.decide(adj, 1e-12, [0.0], 1.0) is Verdict.BROKEN  # p = 0 rejects at any alpha


def test_one_possible_outcome_is_trivially_consistent() -> None:
    r = stats.multinomial_gof([7, 0], [1.0, 0.0])
    assert r.method == "trivial" and r.p_value == 1.0 and r.df == 0


def test_strata_add_statistics_and_degrees_of_freedom() -> None:
    a = ([300, 360, 180], P3)
    b = ([50, 150], [0.25, 0.75])
    both = stats.stratified_gof([a, b])
    one, two = stats.stratified_gof([a]), stats.stratified_gof([b])
    assert both.df == one.df + two.df == 3
    assert both.statistic == pytest.approx(one.statistic + two.statistic)
    assert both.p_value == pytest.approx(st.chi2.sf(both.statistic, 3))
    assert both.n_strata == 2


def test_sparse_strata_use_monte_carlo() -> None:
    r = stats.stratified_gof([([3, 1, 0], P3), ([2, 2], [0.5, 0.5])])
    assert r.method == "monte-carlo"
    assert r.df == 3


def test_pool_sparse_merges_until_every_cell_is_big_enough() -> None:
    o, p = stats.pool_sparse([50, 30, 3, 2, 1], [0.5, 0.3, 0.1, 0.06, 0.04], 5.0)
    assert (p * 86 >= 5).all()
    assert o.sum() == 86 and p.sum() == pytest.approx(1.0)
    r = stats.multinomial_gof([50, 30, 3, 2, 1], [0.5, 0.3, 0.1, 0.06, 0.04], "pooled")
    assert r.method == "pooled" and r.df == len(p) - 1


def test_p_values_are_calibrated_under_the_null() -> None:
    """Small samples (exact / Monte-Carlo) and large (G-test) reject about alpha of the time."""
    rng = np.random.default_rng(7)
    for n, method in ((12, "exact"), (400, "g-test")):
        ps = []
        for i in range(400):
            obs = rng.multinomial(n, P3)
            r = stats.multinomial_gof(obs, P3, seed=i)
            assert r.method == method
            ps.append(r.p_value)
        rate = float(np.mean(np.array(ps) < 0.05))
        assert rate <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 400), (n, rate)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="sum to"):
        stats.multinomial_gof([1, 2], [0.5, 0.6])
    with pytest.raises(ValueError, match="method"):
        stats.multinomial_gof([1, 2], [0.5, 0.5], "magic")
    with pytest.raises(ValueError, match="single stratum"):
        stats.stratified_gof([([1, 1], [0.5, 0.5])] * 2, "exact")


# --------------------------------------------------------------------------------------------
# total variation


def test_tv_distance() -> None:
    assert stats.tv_distance([1, 0, 0], P3) == pytest.approx(0.655)
    assert stats.tv_distance(P3, P3) == 0.0


def test_clopper_pearson_matches_scipy() -> None:
    for k, n in ((0, 10), (3, 10), (10, 10), (420, 1000)):
        lo, hi = stats.clopper_pearson(k, n, 0.05)
        ci = st.binomtest(k, n).proportion_ci(0.95, method="exact")
        assert float(lo) == pytest.approx(ci.low, abs=1e-12)
        assert float(hi) == pytest.approx(ci.high, abs=1e-12)


def _tv_max_by_lp(lo: np.ndarray, hi: np.ndarray, p: np.ndarray) -> float:
    best = 0.0
    k = len(p)
    for m in range(1, 2**k - 1):
        s = np.array([(m >> j) & 1 for j in range(k)], dtype=bool)
        r = optimize.linprog(
            -s.astype(float), A_eq=np.ones((1, k)), b_eq=[1], bounds=list(zip(lo, hi, strict=True)),
            method="highs",
        )  # fmt: skip
        best = max(best, -r.fun - p[s].sum())
    return best


def test_tv_box_bounds_are_exact() -> None:
    rng = np.random.default_rng(2)
    for _ in range(40):
        k = int(rng.integers(2, 6))
        p, q = rng.dirichlet(np.ones(k)), rng.dirichlet(np.ones(k))
        n = int(rng.integers(5, 200))
        obs = rng.multinomial(n, q)
        lo, hi = stats.clopper_pearson(obs, n, 0.05 / k)
        low, up = tv._tv_bounds(lo, hi, p)
        assert up == pytest.approx(_tv_max_by_lp(lo, hi, p), abs=1e-9)
        # the minimum is attained somewhere in the box
        r = optimize.linprog(
            np.r_[np.zeros(k), np.ones(k)],
            A_ub=np.hstack([np.eye(k), -np.eye(k)]), b_ub=p,
            A_eq=np.r_[np.ones(k), np.zeros(k)][None, :], b_eq=[1],
            bounds=list(zip(lo, hi, strict=True)) + [(0, None)] * k, method="highs",
        )  # fmt: skip
        assert low == pytest.approx(r.fun, abs=1e-9)


def test_tv_interval_covers_the_truth() -> None:
    rng = np.random.default_rng(11)
    p = np.array(P3 + [0.0] * 5)
    q = np.array([0.40, 0.40, 0.18, 0.02, 0, 0, 0, 0])
    true_tv = stats.tv_distance(q, p)
    misses = 0
    for _ in range(300):
        for n in (30, 500):
            iv = stats.tv_interval(rng.multinomial(n, q), p, 0.1)
            misses += not (iv.lower <= true_tv <= iv.upper)
    assert misses <= 0.1 * 600
    iv = stats.tv_interval([820, 0, 0] + [0] * 5, p, 0.01)
    assert iv.lower > 0.6 and iv.estimate == pytest.approx(0.655)


def test_tv_interval_narrows_with_more_samples() -> None:
    p = np.array(P3)
    wide = stats.tv_interval(np.round(100 * p).astype(int), p, 0.01)
    narrow = stats.tv_interval(np.round(10000 * p).astype(int), p, 0.01)
    assert narrow.upper < wide.upper < 0.5
    assert narrow.upper < 0.03


# --------------------------------------------------------------------------------------------
# multiple testing, verdicts


def test_holm() -> None:
    assert stats.holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert stats.holm([0.5]) == [0.5]
    assert stats.holm([0.3, 0.3, 0.3]) == pytest.approx([0.9, 0.9, 0.9])


def test_decide() -> None:
    assert stats.decide([0.02, 0.5], 0.01, [0.05, 0.08], 0.1) is Verdict.PRESERVED
    assert stats.decide([0.002, 0.5], 0.01, [0.05, 0.08], 0.1) is Verdict.BROKEN
    assert stats.decide([0.02, 0.5], 0.01, [0.05, 0.2], 0.1) is Verdict.INCONCLUSIVE


def test_alpha_spending_never_exceeds_alpha() -> None:
    assert sum(stats.alpha_spending(i, 0.01) for i in range(1, 10_000)) < 0.01


# --------------------------------------------------------------------------------------------
# sequential


def test_e_process_false_alarms_stay_below_alpha() -> None:
    """Ville: sampling from the null, crossing 1/alpha at ANY time is rarer than alpha."""
    rng = np.random.default_rng(5)
    alpha = 0.05
    crossed = 0
    runs = 300
    for _ in range(runs):
        e = stats.EProcess()
        for x in rng.choice(3, size=300, p=P3):
            e.update("ctx", P3, int(x))
            if e.rejects(alpha):
                crossed += 1
                break
    assert crossed / runs <= alpha


D3 = [0.6, 0.3, 0.1]  # a draft's distribution in the same context


def _score(x: int) -> float:
    return D3[x] / P3[x] - 1.0


def test_directed_e_process_false_alarms_stay_below_alpha() -> None:
    """Ville again, for the lambda-mixture toward the draft: under the null (tokens from P3)
    the e-value crosses 1/alpha in fewer than alpha of the runs, at any time."""
    rng = np.random.default_rng(15)
    alpha, runs, crossed = 0.05, 400, 0
    for _ in range(runs):
        e = stats.DirectedEProcess()
        for x in rng.choice(3, size=400, p=P3):
            if e.update(_score(int(x))) >= math.log(1 / alpha):
                crossed += 1
                break
    assert crossed <= st.binom.ppf(0.999, runs, alpha), crossed


def test_directed_e_process_beats_the_omnibus_on_leakage_toward_the_draft() -> None:
    """Output leaking 30 % of the way toward the draft, over 12 contexts that share the
    direction: the directed e-process crosses 1/1e-3 in far fewer samples than the per-context
    omnibus mixture (which must learn every context on its own)."""
    rng = np.random.default_rng(16)
    leak = 0.7 * np.array(P3) + 0.3 * np.array(D3)
    first: dict[str, list[int]] = {"directed": [], "omnibus": []}
    for _ in range(20):
        d, o = stats.DirectedEProcess(), stats.EProcess()
        nd = no = None
        for n, x in enumerate(rng.choice(3, size=5000, p=leak).tolist(), 1):
            if d.update(_score(x)) >= math.log(1e3) and nd is None:
                nd = n
            o.update(n % 12, P3, x)
            if o.rejects(1e-3) and no is None:
                no = n
            if nd and no:
                break
        first["directed"].append(nd or 5001)
        first["omnibus"].append(no or 5001)
    assert np.median(first["directed"]) * 2 < np.median(first["omnibus"]), first


def test_directed_e_process_impossible_token_and_bad_scores() -> None:
    e = stats.DirectedEProcess()
    assert e.log_e == 0.0
    e.update(math.inf)
    assert math.isinf(e.log_e) and e.log_e > 0
    with pytest.raises(ValueError, match="score"):
        stats.DirectedEProcess().update(-1.5)
    with pytest.raises(ValueError, match="lambdas"):
        stats.DirectedEProcess([0.0, 0.5])
    # u = -1 (the draft gives the token 0) zeroes the lambda = 1 member only
    e = stats.DirectedEProcess([0.5, 1.0])
    e.update(-1.0)
    assert e.log_e == pytest.approx(math.log(0.25))
    assert stats.mixed_log_e(0.0, math.log(3.0)) == pytest.approx(math.log(2.0))


def test_e_process_flags_the_example_program_quickly() -> None:
    e = stats.EProcess()
    n = 0
    while not e.rejects(1e-3):
        e.update(("pos 2", "after f"), P3, 0)  # always 'e', as in the report
        n += 1
    assert n <= 15


def test_e_process_zero_probability_token_is_certain() -> None:
    e = stats.EProcess()
    e.update("a", [0.5, 0.5, 0.0], 2)
    assert math.isinf(e.log_e) and e.impossible == 1
    assert e.rejects(1e-300)
    e.update("a", [0.5, 0.5, 0.0], 0)
    assert math.isinf(e.log_e)


def test_types_bound_is_a_valid_tail_bound() -> None:
    """Where Monte-Carlo saw nothing as extreme, the method-of-types bound takes over; it must
    never be below the exact tail probability."""
    rng = np.random.default_rng(9)
    for _ in range(30):
        obs = rng.multinomial(int(rng.integers(3, 25)), [0.6, 0.3, 0.1])
        p = np.array(P3)
        g = stats.g_statistic(obs, obs.sum() * p)
        exact = stats.multinomial_gof(obs, p, "exact").p_value
        assert gof._types_bound(g, [(obs, p)]) >= exact - 1e-12


def test_monte_carlo_reports_extreme_evidence_beyond_its_floor() -> None:
    r = stats.stratified_gof([([300, 0, 0], P3), ([3, 1], [0.5, 0.5])], "monte-carlo")
    assert r.method == "monte-carlo"
    assert r.p_value < 1e-50


def test_overwhelming_evidence_is_tiny_but_only_impossibility_is_zero() -> None:
    huge = stats.multinomial_gof([100_000, 0, 0], P3)
    assert 0 < huge.p_value < 1e-300 and huge.method == "g-test"
    assert stats.multinomial_gof([1, 0, 0, 1], P3 + [0.0]).p_value == 0.0


def test_verdicts_map_onto_the_shared_outcomes() -> None:
    from specaudit.outcome import Outcome

    assert Verdict.PRESERVED.outcome is Outcome.OK
    assert Verdict.BROKEN.outcome is Outcome.FINDING
    assert Verdict.INCONCLUSIVE.outcome is Outcome.NO_DECISION
    assert Verdict.WITHIN_TOLERANCE.outcome is Outcome.OK
    assert [v.outcome.exit_code for v in Verdict] == [0, 1, 2, 0]
