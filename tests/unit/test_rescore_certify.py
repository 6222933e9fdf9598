"""The bounds a PRESERVED states (`rescore.certify`): closed forms on hand-made inputs, the
supermartingale boundaries against numerical integration, `needed` against fresh runs of that
size, a cheap coverage replicate (the full study: benchmarks/bench_rescore_coverage.py) and the
power to exclude a realistic deviation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from specaudit.reference import NextToken
from specaudit.rescore import analysis, certify
from specaudit.rescore.records import TokenDraw
from specaudit.stats.tv import conditional_tv_bound, samples_needed

ALPHA = 0.01
TOL = certify.DEFAULT_TOLERANCE


def test_the_default_tolerance_is_dists() -> None:
    from specaudit.distribution.results import DEFAULT_TOLERANCE

    assert certify.certify([0.5], [1.0], [0.5]).tolerance == DEFAULT_TOLERANCE


def test_two_sided_radius_is_where_the_normal_mixture_reaches_one_over_delta() -> None:
    """sqrt(rho / (V + rho)) exp(r^2 / (2 (V + rho))) = 1 / delta at the radius, V = n / 4."""
    for n, delta in ((10, 0.01), (1000, 0.003), (50_000, 1e-4)):
        r = certify.mixture_radius(n, delta)
        rho = certify._rho(delta)
        v = n / 4
        log_m = 0.5 * math.log(rho / (v + rho)) + r * r / (2 * (v + rho))
        assert log_m == pytest.approx(math.log(1 / delta), rel=1e-9)


def _half_normal_mixture(lam: float, s: float, n: int, rho: float) -> float:
    density = float(stats.halfnorm(scale=1 / math.sqrt(rho)).pdf(lam))
    return math.exp(lam * s - lam * lam * n / 8) * density


def test_one_sided_radius_is_where_the_half_normal_mixture_reaches_one_over_delta() -> None:
    """The half-normal mixture of exp(lambda s - lambda^2 n / 8), integrated numerically."""
    for n, delta in ((40, 0.01), (400, 0.003)):
        s = certify.one_sided_radius(n, delta, 100)
        rho = certify._rho(2 * delta, 100)
        value, _ = integrate.quad(_half_normal_mixture, 0, 50, args=(s, n, rho))
        assert value == pytest.approx(1 / delta, rel=1e-5)
        assert s < certify.mixture_radius(n, delta)  # one side is cheaper


def test_pit_estimate_is_the_kolmogorov_distance_of_hand_made_values() -> None:
    # every u in [0, 1/2]: the head of the order holds all the mass where it should hold half
    b = certify.pit_bound(np.linspace(0, 0.5, 1000), ALPHA, TOL)
    assert b.estimate == pytest.approx(0.5)
    assert b.upper >= 0.5 and not b.within and b.needed is None
    # evenly spread values: the estimate is half a step, NaN (impossible tokens) left out
    even = (np.arange(400) + 0.5) / 400
    b = certify.pit_bound(np.append(even, np.nan), ALPHA, TOL)
    assert b.estimate == pytest.approx(0.5 / 400) and b.n == 400


def test_pit_upper_on_exactly_uniform_counts_is_the_margin() -> None:
    """With F(t) = t at every grid point, each level's bound is its cell width plus its widest
    half-width: exactly `pit_margin`."""
    n = 1 << certify.DKW_LEVELS
    b = certify.pit_bound((np.arange(n) + 0.5) / n, ALPHA, TOL)
    assert b.upper == pytest.approx(certify.pit_margin(n, ALPHA), rel=1e-12)


def test_margins_shrink_as_tokens_grow() -> None:
    ns = [10, 30, 100, 300, 1000, 3000, 10_000, 100_000]
    pit = [certify.pit_margin(n, ALPHA) for n in ns]
    fav = [certify.mixture_radius(n, ALPHA) / n for n in ns]
    tv = [certify.one_sided_radius(n, ALPHA, certify.TV_DESIGN_DRAWS) / n for n in ns]
    for seq in (pit, fav, tv):
        assert all(a > b for a, b in zip(seq, seq[1:], strict=False))
    assert pit[-1] < 0.02 and fav[-1] < 0.01


def test_favourite_interval_closed_form() -> None:
    n = 400
    b = certify.favourite_bound(np.ones(n), np.full(n, 0.5), ALPHA, TOL)
    r = certify.mixture_radius(n, ALPHA) / n
    assert b.estimate == pytest.approx(0.5)
    assert b.interval == pytest.approx((0.5 - r, 0.5 + r))
    assert b.upper == pytest.approx(0.5 + r)
    under = certify.favourite_bound(np.zeros(n), np.full(n, 0.5), ALPHA, TOL)
    assert under.interval == pytest.approx((-0.5 - r, -0.5 + r))
    assert under.upper == pytest.approx(0.5 + r) and under.needed is None


def test_tv_bound_wraps_the_conditional_tv_plug_in() -> None:
    strata = [([30, 0, 0], [0.5, 0.5, 0.0]), ([10, 10, 0], [0.5, 0.5, 0.0])]
    b = certify.tv_bound(strata, ALPHA, TOL)
    assert b is not None
    assert b.estimate == pytest.approx(conditional_tv_bound(strata, ALPHA).estimate)
    assert b.estimate == pytest.approx(30 / 50 * 0.5)
    assert b.upper == pytest.approx(0.3 + certify.one_sided_radius(50, ALPHA, 100) / 50)
    assert certify.tv_bound([], ALPHA, TOL) is None


def _fresh_pit(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(n)


def test_needed_uniform_tokens_bring_the_pit_bound_within_tolerance() -> None:
    b = certify.pit_bound(_fresh_pit(300, 1), ALPHA, TOL)
    assert not b.within and b.needed is not None and b.needed > 300
    assert certify.pit_bound(_fresh_pit(b.needed, 2), ALPHA, TOL).within
    # and it is the smallest such projection: one token fewer is not enough
    q = stats.kstwobign.ppf(certify.NOISE_QUANTILE)
    m = b.needed - 1
    assert max(b.estimate, q / math.sqrt(m)) + certify.pit_margin(m, ALPHA) > TOL


def test_needed_null_tokens_bring_the_favourite_and_tv_bounds_within_tolerance() -> None:
    rng = np.random.default_rng(3)
    p = rng.uniform(0.3, 0.9, 100)
    b = certify.favourite_bound(rng.random(100) < p, p, ALPHA, TOL)
    assert not b.within and b.needed is not None
    p2 = rng.uniform(0.3, 0.9, b.needed)
    assert certify.favourite_bound(rng.random(b.needed) < p2, p2, ALPHA, TOL).within
    probs = [0.6, 0.3, 0.1]
    tv = certify.tv_bound([(rng.multinomial(40, probs), probs)], ALPHA, TOL)
    assert tv is not None and not tv.within and tv.needed is not None
    again = certify.tv_bound([(rng.multinomial(tv.needed, probs), probs)], ALPHA, TOL)
    assert again is not None and again.within
    # the same projection as stats.tv.samples_needed, up to the time-uniform margin's shape
    assert tv.needed == pytest.approx(samples_needed(40, tv.upper, TOL), rel=0.1)


def _step_run(n: int, shift: float, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """n steps, each with its own reference distribution over 5 tokens (the favourite first,
    as the PIT orders them) and an engine that moves `shift` of the rest toward the
    favourite: q = p + shift (e_fav - p). Returns u, hits, p_fav and the true PIT distance
    sup_t mean_i shift (min(t / p_i, 1) - t) and favourite excess mean_i shift (1 - p_i)."""
    p = -np.sort(-rng.dirichlet(np.full(5, 0.7), size=n), axis=1)
    q = p * (1 - shift)
    q[:, 0] += shift
    tok = np.minimum((rng.random((n, 1)) > np.cumsum(q, axis=1)).sum(axis=1), 4)
    below = np.cumsum(p, axis=1) - p
    rows = np.arange(n)
    u = below[rows, tok] + rng.random(n) * p[rows, tok]
    pf = p[:, 0]
    return u, (tok == 0).astype(float), pf, np.array([_true_pit(pf, shift), _true_fav(pf, shift)])


def _true_pit(pf: np.ndarray, shift: float) -> float:
    """sup_t of mean_i shift (min(t / p_i, 1) - t): concave and piecewise linear in t, so its
    peak is at one of the p_i."""
    if len(pf) == 0:
        return 0.0
    t = pf[:, None]
    return shift * float(np.max(np.mean(np.minimum(t / pf[None, :], 1) - t, axis=1)))


def _true_fav(pf: np.ndarray, shift: float) -> float:
    return shift * float(np.mean(1 - pf)) if len(pf) else 0.0


def test_coverage_of_the_joint_certificate_cheap_replicate() -> None:
    """200 runs of 150 tokens, null and moved mass, alpha = 0.1: each certificate covers the
    true values of both sequential bounds at both looks (75 and 150 tokens) in all but a
    binomial(200, 0.1) share of runs."""
    alpha, runs, misses = 0.1, 200, 0
    rng = np.random.default_rng(7)
    for r in range(runs):
        shift = 0.0 if r % 2 else 0.15
        u, hits, pf, _ = _step_run(150, shift, rng)
        misses += not all(_covers(u[:n], hits[:n], pf[:n], shift, alpha) for n in (75, 150))
    assert stats.binomtest(misses, runs, alpha, alternative="greater").pvalue > 0.001
    assert misses <= stats.binom.ppf(0.999, runs, alpha)


def _covers(u: np.ndarray, hits: np.ndarray, pf: np.ndarray, shift: float, alpha: float) -> bool:
    cert = certify.certify(u, hits, pf, alpha=alpha)
    pit, fav = cert.bounds[0], cert.bounds[1]
    assert fav.interval is not None
    true_fav = _true_fav(pf, shift)
    return _true_pit(pf, shift) <= pit.upper and fav.interval[0] <= true_fav <= fav.interval[1]


def test_moved_mass_toward_the_favourite_is_excluded_and_exceeds_the_tolerance() -> None:
    """A speculation-like bug (40 % of the other tokens' mass moved to the favourite) over
    2000 tokens: the favourite's interval excludes 0 on the right side, and the certificate
    is not within the tolerance, nor would more tokens bring it there."""
    u, hits, pf, truth = _step_run(2000, 0.4, np.random.default_rng(11))
    cert = certify.certify(u, hits, pf)
    fav = cert.bounds[1]
    assert fav.interval is not None and fav.interval[0] > 0
    assert truth[1] > TOL and fav.interval[0] <= truth[1] <= fav.interval[1]
    assert cert.bounds[0].estimate > TOL
    assert not cert.within and cert.needed is None
    assert "more tokens alone would not" in cert.statement


def _draws(n: int, seed: int) -> list[TokenDraw]:
    """Null draws as `analysis.null_false_alarms` makes them: every 4th shares one prefix."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(4, 0.7), size=n)
    probs[::4] = [0.5, 0.3, 0.15, 0.05]
    toks = np.minimum((rng.random((n, 1)) > np.cumsum(probs, axis=1)).sum(axis=1), 3)
    return [
        TokenDraw(i // 4, 0, i % 4, "start" if i % 4 == 0 else f"p{i}", int(toks[i]),
                  NextToken(probs=dict(enumerate(probs[i].tolist()))))
        for i in range(n)
    ]  # fmt: skip


def test_certify_draws_uses_analysis_pit_values_and_the_repeated_prefix() -> None:
    draws = _draws(400, 5)
    cert = certify.certify_draws(draws, seed=9)
    stats_ = analysis.analyse(draws, seed=9)
    assert cert.bounds[0].estimate == pytest.approx(stats.kstest(stats_.u, "uniform").statistic)
    assert cert.bounds[1].estimate == pytest.approx(
        abs(stats_.favourite_rate - stats_.favourite_expected)
    )
    [(counts, probs)] = certify.strata_of(draws)
    assert sum(counts) == 100 and probs == pytest.approx([0.5, 0.3, 0.15, 0.05, 0.0])
    assert [b.name for b in cert.bounds] == list(certify.SPLIT)
    assert cert.tokens == 400 and cert.confidence == pytest.approx(0.99)


def test_certificate_states_every_bound_and_what_it_cannot_see() -> None:
    rng = np.random.default_rng(2)
    n = 20_000
    p = rng.uniform(0.2, 0.9, n)
    probs = [0.5, 0.5]
    cert = certify.certify(
        rng.random(n), rng.random(n) < p, p, [(rng.multinomial(800, probs), probs)]
    )
    assert cert.within and cert.needed == n
    assert all(b.within and b.needed == b.n for b in cert.bounds)
    for b in cert.bounds:
        assert f"{b.upper:.1%}" in cert.statement or f"{100 * b.upper:.1f}" in cert.statement
    assert "99% confidence" in cert.statement and "within the tolerance of 15%" in cert.statement
    assert any("cancels" in s for s in cert.blind_spots)
    small = certify.certify(rng.random(100), rng.random(100) < 0.5, np.full(100, 0.5))
    assert not small.within and small.needed is not None and small.needed > 100
    assert f"about {small.needed} tokens" in small.statement


@pytest.mark.parametrize(("alpha", "tolerance"), [(0.0, 0.1), (1.0, 0.1), (0.01, 0.0), (0.01, 1.5)])
def test_certify_refuses_levels_out_of_range(alpha: float, tolerance: float) -> None:
    with pytest.raises(ValueError):
        certify.certify([0.5], [1.0], [0.5], alpha=alpha, tolerance=tolerance)


def test_certificate_needed_counts_all_tokens_for_the_repeated_prefix_tv() -> None:
    """The TV's `needed` counts draws at repeated prefixes; the certificate's counts tokens,
    so a TV that binds is scaled by the share of tokens at repeated prefixes."""
    rng = np.random.default_rng(4)
    n = 20_000
    p = rng.uniform(0.2, 0.9, n)
    probs = [0.6, 0.3, 0.1]
    cert = certify.certify(
        rng.random(n), rng.random(n) < p, p, [(rng.multinomial(50, probs), probs)]
    )
    pit, fav, tv = cert.bounds
    assert pit.within and fav.within and not tv.within and tv.needed is not None
    assert cert.needed == math.ceil(tv.needed * n / 50)
