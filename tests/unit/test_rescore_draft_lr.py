"""The draft-aimed e-process (`rescore.draft_lr`): every bug's factor has mean exactly 1 under
the reference (exact enumeration), the catalogue's marginals are those of the faulty
samplers (the two-stage sampler enumerated), the e-value is calibrated under the null and
crosses 1/alpha fast on a realistic acceptance bug."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from scipy import stats

from specaudit.reference import NextToken
from specaudit.rescore import draft_lr as dl
from specaudit.rescore.records import TokenDraw


def _pairs() -> list[tuple[np.ndarray, np.ndarray]]:
    """Small aligned (p, q) pairs with the awkward cases: q off p's support, p off q's, p = q,
    disjoint supports, point masses."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(6):
        p, q = rng.dirichlet(np.full(7, 0.7)), rng.dirichlet(np.full(7, 0.7))
        p[rng.choice(7, 2, replace=False)] = 0.0
        q[rng.choice(7, 2, replace=False)] = 0.0
        out.append((p / p.sum(), q / q.sum()))
    p = rng.dirichlet(np.ones(7))
    out.append((p, p.copy()))
    out.append((np.array([0.5, 0.5, 0, 0, 0, 0, 0]), np.array([0, 0, 0.2, 0.8, 0, 0, 0])))
    out.append((np.array([0, 0, 1.0, 0, 0, 0, 0]), np.array([0.1, 0.2, 0.3, 0.4, 0, 0, 0])))
    out.append((np.array([0.3, 0.3, 0.4, 0, 0, 0, 0]), np.array([0, 0, 0, 1.0, 0, 0, 0])))
    return out


def _ratios_at_every_token(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every bug's r/p at every token the reference allows, and those tokens."""
    xs = np.flatnonzero(p > 0)
    ratios = dl.likelihood_ratios(np.tile(p, (len(xs), 1)), np.tile(q, (len(xs), 1)), xs)
    return ratios, xs


def test_every_bug_factor_has_mean_one_under_the_reference() -> None:
    """sum_x p(x) r_b(x)/p(x) = 1 for every catalogue member: the martingale property, by
    exact enumeration (the whole of Ville's argument rests on it)."""
    for p, q in _pairs():
        ratios, xs = _ratios_at_every_token(p, q)
        assert np.all(ratios >= 0)
        means = p[xs] @ ratios
        np.testing.assert_allclose(means, 1.0, atol=1e-12)


def test_rounding_never_makes_a_factor_negative() -> None:
    """A floor above every q keeps all of q: the accepted mass sums to 1 up to rounding, and
    the leftover (1 - that sum, a few 1e-16 below 0) must not put negative mass on the tokens
    only the residual reaches (p > 0 = q)."""
    rng = np.random.default_rng(4)
    for _ in range(20):
        p = rng.dirichlet(np.ones(30))
        q = np.full(30, 1 / 25) + rng.uniform(-1e-3, 1e-3, 30)
        q[25:] = 0.0
        ratios, xs = _ratios_at_every_token(p, q / q.sum())
        assert np.all(ratios >= 0) and np.all(np.isfinite(ratios))
        np.testing.assert_allclose(p[xs] @ ratios, 1.0, atol=1e-12)


def test_the_noise_bound_keeps_the_factor_mean_at_most_one() -> None:
    """An engine whose correct distribution p' differs from the reference's p (quantisation
    noise) breaks the exact mean; dividing by 1 - lambda + lambda rho, with rho bounding
    p'/p, restores a supermartingale."""
    rng = np.random.default_rng(3)
    worst_unbounded = 0.0
    for p, q in _pairs():
        w = rng.uniform(1.0, 1.3, size=p.size)
        p_engine = p * w / (p * w).sum()
        rho = float(np.max(np.divide(p_engine, p, out=np.ones_like(p), where=p > 0)))
        ratios, xs = _ratios_at_every_token(p, q)
        for bound in (rho, 1.0):
            # each token's factor alone (a path of one draw), shape (tokens, bugs, lambdas)
            factors = np.exp([dl.log_paths(row[None], ratio_bound=bound)[0] for row in ratios])
            means = np.einsum("x,xbl->bl", p_engine[xs], factors)
            if bound > 1.0:
                assert np.all(means <= 1.0 + 1e-12)
            else:
                worst_unbounded = max(worst_unbounded, float(means.max()))
    assert worst_unbounded > 1.01  # without the bound the noise alone would grow the e-value


def test_acceptance_at_c_one_is_the_reference() -> None:
    for p, q in _pairs():
        r = dl.acceptance(dl.Parts.of(p, q), 1.0)
        np.testing.assert_allclose(r, p, atol=1e-12)


def _two_stage(
    p: np.ndarray,
    q: np.ndarray,
    propose: np.ndarray,
    keep: Callable[[int], float],
    residual: np.ndarray,
) -> np.ndarray:
    """The output distribution of one speculative step, enumerated: the draft proposes d with
    probability propose[d]; it is kept with probability keep(d); otherwise the token is
    drawn from `residual`."""
    out = np.zeros_like(p)
    rejected = 0.0
    for d in range(len(p)):
        if propose[d] == 0:
            continue
        a = keep(d)
        out[d] += propose[d] * a
        rejected += propose[d] * (1 - a)
    return out + rejected * residual


def _correct_residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    res = np.array([max(pi - qi, 0.0) for pi, qi in zip(p, q, strict=True)])
    return res / res.sum() if res.sum() > dl.EMPTY else p


def _scaled(p: np.ndarray, q: np.ndarray, c: float) -> Callable[[int], float]:
    """The acceptance probability min(1, c p(d)/q(d)) of draft token d."""
    return lambda d: min(1.0, c * p[d] / q[d])


def _floored(p: np.ndarray, q: np.ndarray, f: float) -> Callable[[int], float]:
    """The acceptance probability with the target's probability read as max(p(d), f)."""
    return lambda d: min(1.0, max(p[d], f) / q[d])


def _samplers(p: np.ndarray, q: np.ndarray) -> dict[str, np.ndarray]:
    """Each bug's faulty sampler, written as the code that has the bug would run it."""

    def ratio(d: int) -> float:
        return min(1.0, p[d] / q[d])

    def inverted(d: int) -> float:
        return 1.0 if p[d] == 0 else min(1.0, q[d] / p[d])

    res = _correct_residual(p, q)
    argmax = np.zeros_like(q)
    argmax[int(np.argmax(q))] = 1.0
    out = {
        "leak-draft": _two_stage(p, q, q, lambda d: 1.0, res),
        "residual-target": _two_stage(p, q, q, ratio, p),
        "ratio-inverted": _two_stage(p, q, q, inverted, res),
        "argmax-proposal": _two_stage(p, q, argmax, ratio, res),
    }
    for c in dl.ACCEPT_CS:
        out[f"accept-c{c:g}"] = _two_stage(p, q, q, _scaled(p, q, c), res)
    for f in dl.FLOORS:
        out[f"p-floor{f:g}"] = _two_stage(p, q, q, _floored(p, q, f), res)
    for k in dl.TAIL_TOPS:
        top = sorted(range(len(p)), key=lambda t: (-p[t], t))[:k]
        tail = np.array([max(p[t] - q[t], 0.0) if t in top else 0.0 for t in range(len(p))])
        out[f"residual-top{k}"] = _two_stage(
            p, q, q, ratio, tail / tail.sum() if tail.sum() > dl.EMPTY else res
        )
    return out


def test_catalogue_marginals_are_the_faulty_samplers_output() -> None:
    """The marginal each bug is scored with equals the output distribution of the faulty
    two-stage sampler (draft, accept or reject, residual), enumerated on small vocabularies;
    the temperature family's is p^(1 + theta) renormalised."""
    checked = set()
    for p, q in _pairs():
        for name, want in _samplers(p, q).items():
            np.testing.assert_allclose(dl.BUGS[name].marginal(p, q), want, atol=1e-12)
            checked.add(name)
        for theta in dl.THETAS:
            t = p ** (1 + theta)
            np.testing.assert_allclose(
                dl.BUGS[f"temperature{theta:+g}"].marginal(p, q), t / t.sum()
            )
            checked.add(f"temperature{theta:+g}")
    assert checked == set(dl.BUGS)


def test_a_bug_that_moves_mass_moves_it_the_way_speculation_does() -> None:
    """Sanity of the shapes: resampling from p and a scaled-up acceptance put more mass on
    the draft's favourite than p does; the correct residual's marginal does not."""
    rng = np.random.default_rng(5)
    p = rng.dirichlet(np.ones(10))
    q = np.exp(np.log(p) + rng.standard_normal(10))
    q /= q.sum()
    fav = int(np.argmax(q / p))  # where the draft overshoots most
    for name in ("residual-target", "accept-c1.5", "leak-draft"):
        assert dl.BUGS[name].marginal(p, q)[fav] > p[fav]


def _realistic(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k-40-like reference distributions (peaked to flat) and a similar draft,
    q = softmax(log p + noise)."""
    logits = rng.standard_normal((n, 40)) * rng.uniform(0.5, 3.0, size=(n, 1))
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    q = np.exp(np.log(p) + 0.5 * rng.standard_normal((n, 40)))
    return p, q / q.sum(axis=1, keepdims=True)


def _sample(rng: np.random.Generator, r: np.ndarray) -> np.ndarray:
    u = rng.random((r.shape[0], 1))
    return np.minimum((u > np.cumsum(r, axis=1)).sum(axis=1), r.shape[1] - 1)


def test_false_alarm_rate_stays_below_alpha() -> None:
    """Cheap replicate of benchmarks/bench_rescore_draft.py: 200 null runs of 100 tokens, the
    running maximum against 1/alpha at a lenient alpha = 0.1; more alarms than the
    binomial(200, 0.1) 99.9 % quantile means the e-process is not one."""
    runs, alpha, alarms = 200, 0.1, 0
    rng = np.random.default_rng(11)
    for _ in range(runs):
        p, q = _realistic(rng, 100)
        ev = dl.evidence_from_ratios(dl.likelihood_ratios(p, q, _sample(rng, p)), alpha)
        alarms += ev.broken
    assert alarms <= stats.binom.ppf(0.999, runs, alpha)


def test_a_scaled_acceptance_is_caught_and_named() -> None:
    """Tokens from the c = 1.25 acceptance bug (realistic top-40 p, a similar q) cross
    1/alpha = 100 within 1500 tokens, and the verdict names the acceptance family."""
    named = 0
    for seed in range(5):
        rng = np.random.default_rng(seed)
        p, q = _realistic(rng, 1500)
        r = dl.conditioned(dl.BUGS["accept-c1.25"].marginal(p, q), p)
        ev = dl.evidence_from_ratios(dl.likelihood_ratios(p, q, _sample(rng, r)), 0.01)
        assert ev.broken and ev.crossed_at is not None and ev.crossed_at <= 1500
        named += ev.best_bug is not None and dl.BUGS[ev.best_bug].family == "acceptance"
    assert named >= 4


def _draws(p: np.ndarray, q: np.ndarray, tokens: np.ndarray) -> list[TokenDraw]:
    """Draws over token ids 100 + a fixed permutation, with one draft-only token per row, so
    that `align` must build the union support itself."""
    perm = np.random.default_rng(0).permutation(p.shape[1])
    out = []
    for i, (pi, qi, x) in enumerate(zip(p, q, tokens, strict=True)):
        ref = {100 + int(perm[j]): float(pi[j]) for j in range(len(pi))}
        draft = {100 + int(perm[j]): float(0.9 * qi[j]) for j in range(len(qi))}
        draft[999] = 0.1
        tok = 100 + int(perm[x])
        out.append(TokenDraw(i, 0, i, str(i), tok, NextToken(ref), draft=NextToken(draft)))
    return out


def test_draft_e_process_on_draws_matches_the_array_form_and_counts_what_it_skips() -> None:
    rng = np.random.default_rng(2)
    p, q = _realistic(rng, 300)
    xs = _sample(rng, dl.conditioned(dl.BUGS["accept-c2"].marginal(p, q), p))
    draws = _draws(p, q, xs)
    q_seen = np.hstack([0.9 * q, np.full((300, 1), 0.1)])  # the draft-only token
    p_seen = np.hstack([p, np.zeros((300, 1))])
    want = dl.evidence_from_ratios(dl.likelihood_ratios(p_seen, q_seen, xs), 0.01)
    plain = TokenDraw(0, 0, 0, "x", draws[0].token, draws[0].ref)
    assert plain.draft is None
    impossible = TokenDraw(0, 0, 0, "y", 999, draws[0].ref, draft=draws[0].draft)
    got = dl.draft_e_process([plain, impossible, *draws], 0.01)
    assert (got.used, got.excluded, got.without_draft) == (300, 1, 1)
    assert got.log_e_by_bug == pytest.approx(want.log_e_by_bug, rel=1e-9, abs=1e-9)
    assert got.e_value == pytest.approx(want.e_value, rel=1e-9)
    assert want.crossed_at is not None and got.crossed_at == want.crossed_at + 2
    assert got.best_bug == want.best_bug
    assert got.broken and got.best_bug is not None
    assert dl.BUGS[got.best_bug].description in got.summary()


def test_no_draws_with_a_draft_give_no_evidence() -> None:
    nt = NextToken({1: 0.5, 2: 0.5})
    ev = dl.draft_e_process([TokenDraw(0, 0, 0, "k", 1, nt)], 0.05)
    assert (ev.e_value, ev.crossed_at, ev.best_bug, ev.used, ev.without_draft) == (
        1.0,
        None,
        None,
        0,
        1,
    )
    assert not ev.broken


def test_prior_weights_sum_to_one_and_each_family_weighs_the_same() -> None:
    w = np.exp(dl.log_weights())
    assert w.sum() == pytest.approx(1.0)
    families: dict[str, float] = {}
    for b, row in zip(dl.CATALOGUE, w, strict=True):
        families[b.family] = families.get(b.family, 0.0) + float(row.sum())
    assert families.values() == pytest.approx([1 / len(families)] * len(families))


def test_a_refuting_token_zeroes_only_the_lambda_one_component() -> None:
    """A token the bug gives probability 0 ends that bug's lambda = 1 product (log -inf) but
    not the mixture: the other lambdas keep 1 - lambda of their value."""
    paths = dl.log_paths(np.array([[0.0]]))
    assert math.isinf(paths[0, 0, -1]) and paths[0, 0, -1] < 0
    np.testing.assert_allclose(np.exp(paths[0, 0, :-1]), 1 - np.array(dl.LAMBDAS[:-1]))


def test_bad_inputs_are_refused() -> None:
    p, q = np.array([[0.5, 0.5, 0.0]]), np.array([[0.2, 0.3, 0.5]])
    with pytest.raises(ValueError, match="probability 0"):
        dl.likelihood_ratios(p, q, np.array([2]))
    with pytest.raises(ValueError, match="alpha"):
        dl.evidence_from_ratios(np.ones((1, len(dl.CATALOGUE))), 1.5)
    with pytest.raises(ValueError, match="ratio columns"):
        dl.evidence_from_ratios(np.ones((1, 3)), 0.05)
    with pytest.raises(ValueError, match="ratio_bound"):
        dl.log_paths(np.ones((1, 1)), ratio_bound=0.9)
    with pytest.raises(ValueError, match="lambdas"):
        dl.log_paths(np.ones((1, 1)), lambdas=(0.0, 0.5))
