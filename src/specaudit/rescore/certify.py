"""What a PRESERVED from `specaudit rescore` certifies: upper confidence bounds, in the units a
user quotes (probability mass moved, total variation), that stay valid when a sequential run
stops at a time chosen by looking at the data.

Three bounds, each at alpha / 3 (Bonferroni, `SPLIT`; fixed in advance, so the third share is
spent even when no prefix repeats), hold together with probability at least 1 - alpha:

- **the PIT order** (`pit_bound`): the Kolmogorov distance sup_t |G(t) - t| of the average
  over steps G = (1/n) sum_i G_i of the PIT values' CDFs G_i (each given everything sampled
  before it). G_i(t) - t is the probability mass the engine moved into (> 0) or out of (< 0)
  "the first t of the reference's mass in the PIT order" (the draft's favourite first, then by
  falling probability, the token at the cut counted in part). So the bound says: on average
  over the sampled steps, no head of the token order gained or lost more than `upper` of
  probability mass; mass moved toward the favourite and toward the tail alike. Time-uniform,
  valid for dependent tokens (`pit_bound` says why).
- **the favourite** (`favourite_bound`): the average excess (1/n) sum_i (P(hit_i | past) -
  p_fav_i) of the draft's favourite, both signs (over- and under-sampling); time-uniform.
- **repeated prefixes** (`tv_bound`): where a prefix repeats (at least
  `scores.MIN_PREFIX_DRAWS` draws), the draws-weighted average TV between the engine's and the
  reference's next-token distributions, from `stats.tv.conditional_tv_bound`'s plug-in with a
  margin that is uniform over the (random) number of draws. Assumes the engine's distribution
  at a prefix is the same at every visit, and a run whose seeds were fixed in advance (fixed
  n; `tv_bound` says why).

All three quantities are at most the average per-step TV (a head of the order and the
favourite are events), so "within tolerance" is a statement about these projections, never
that each step's TV is small: `BLIND_SPOTS` lists what one draw per prefix cannot see. The
default tolerance is `dist`'s (`distribution.DEFAULT_TOLERANCE`).

The engine of every bound is one supermartingale (Robbins' normal mixture): an increment
xi_i with E[xi_i | past] = 0 in an interval of length 1 whose ends are known given the past
has E[exp(lambda xi_i) | past] <= exp(lambda^2 / 8) (Hoeffding's lemma, conditionally), so
exp(lambda S_n - lambda^2 n / 8) is a non-negative supermartingale for every lambda, and so is
its mixture over lambda ~ N(0, 1 / rho), sqrt(rho / (V + rho)) exp(S_n^2 / (2 (V + rho))) with
V = n / 4 (Fubini). Ville's inequality: with probability 1 - delta it stays below 1 / delta at
every n, i.e. |S_n| < sqrt((V + rho) (log((V + rho) / rho) + 2 log(1 / delta))) for all n at
once (Howard, Ramdas, McAuliffe and Sekhon 2021, "Time-uniform, nonparametric, nonasymptotic
confidence sequences", the normal mixture; `mixture_radius`). Nothing assumes independence or
identical distributions: martingale differences are enough, which is what a sampled token's
PIT is given the tokens before it. rho is tuned once (`DESIGN_TOKENS`), never from the data.

Assumptions, all bounds: the reference's probabilities are the truth the engine is compared
with (from the record, never from the engine); the PIT's randomisation V is drawn
independently of the engine (`analysis` draws it from a fixed seed); the tokens are given in
sampling order, and "given the past" means given everything sampled before, in every seed:
seeds that share random numbers across prompts (docs/rescore.md, "PIT") make a token depend
on another prompt's tokens, which these bounds count as part of the deviation (they stay
valid, only larger). The PIT bound and the favourite's hold at every n at once, so at any
stopping time; the repeated-prefix TV at a number of seeds fixed in advance.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special, stats

from specaudit.distribution.results import DEFAULT_TOLERANCE
from specaudit.rescore.pit import Pits
from specaudit.rescore.records import DEFAULT_ALPHA, TokenDraw
from specaudit.rescore.scores import MIN_PREFIX_DRAWS
from specaudit.stats.tv import conditional_tv_bound

__all__ = [
    "BLIND_SPOTS",
    "DEFAULT_TOLERANCE",
    "DESIGN_TOKENS",
    "SPLIT",
    "Bound",
    "Certificate",
    "certify",
    "certify_draws",
    "confidence_percent",
    "favourite_bound",
    "mixture_radius",
    "one_sided_radius",
    "pit_bound",
    "pit_margin",
    "strata_of",
    "tv_bound",
]

SPLIT = ("PIT order", "favourite", "repeated prefixes")  # each bound at alpha / len(SPLIT)
DESIGN_TOKENS = 1000  # each mixture's rho makes its radius smallest at this many tokens
TV_DESIGN_DRAWS = 100  # the same for the repeated-prefix TV (about a prompt's seeds)
DKW_LEVELS = 12  # dyadic grids of 2, 4, ..., 4096 cells for the PIT band
MAX_NEEDED = 10**9  # beyond this, `needed` is None: no realistic run decides
NOISE_QUANTILE = 0.9  # `needed`'s floor: the estimate pure noise stays under with this chance
_KS_NOISE = float(stats.kstwobign.ppf(NOISE_QUANTILE))  # sqrt(n) KS, asymptotic quantile

BLIND_SPOTS = (
    "one draw per prefix only sees averages over steps: a change whose direction varies from "
    "prefix to prefix (more mass on the favourite at some, less at others) cancels in the PIT "
    "and favourite bounds; only repeated prefixes (mostly each prompt's first token) are "
    "seen one by one",
    "the PIT bound sees mass moved across a cut of the token order (favourite first, then by "
    "falling probability); mass exchanged between tokens on the same side of every cut it "
    "could cross (neighbours in the order, tokens of equal probability ordered by id only), "
    "or alternating up and down the order, moves the PIT CDF little: its Kolmogorov distance "
    "is at most the TV, and can be far below it",
    "every bound is an average over the steps the run sampled, weighted by how often the "
    "engine visited them: not a bound for the worst prefix, nor for prefixes, prompts or "
    "lengths the run never reached",
    "these are next-token bounds; the TV of whole generations can grow with their length "
    "(at most the sum over positions)",
    "the reference is the truth: a change it shares (the same bug, the same quantisation "
    "noise) is invisible, and tokens outside the reference's top-k support are not in these "
    "bounds (their count has its own test against the reference's measured leak)",
    "the repeated-prefix TV assumes the engine's distribution at a prefix is the same at "
    "every visit, and holds for a run whose seeds were fixed in advance",
)


def confidence_percent(c: float) -> str:
    """A confidence level as a person writes it: 99%, 99.5% (a run with an arm at another
    temperature decides each arm at alpha / 2; rounding 99.5% to whole percent said 100%)."""
    return f"{c * 100:.6g}%"


@dataclass(frozen=True)
class Bound:
    """One certified upper bound: `upper` bounds the true `name` with probability `confidence`
    (jointly with the certificate's other bounds at the certificate's confidence).

    `estimate` is the plug-in value, `interval` the confidence interval of a signed quantity
    (the favourite's excess: negative is under-sampling). `needed`: the total number of
    tokens (draws at repeated prefixes for the TV) at which `upper` would come within
    `tolerance` (see each bound for the projection it assumes); `n` when it already is; None
    when no run of up to `MAX_NEEDED` would (the estimate itself is beyond the tolerance).
    """

    name: str
    what: str  # the quantity in words, for a report
    estimate: float
    upper: float
    tolerance: float
    n: int
    needed: int | None
    confidence: float
    interval: tuple[float, float] | None = None

    @property
    def within(self) -> bool:
        return self.upper <= self.tolerance


@dataclass(frozen=True)
class Certificate:
    """All bounds at a joint confidence 1 - alpha, and what they do not see.

    `needed`: total tokens that would bring every bound within the tolerance (the largest of
    the bounds' `needed`, the TV's scaled by the share of tokens at repeated prefixes);
    `tokens` when already within; None when some bound's estimate is beyond the tolerance.
    """

    bounds: tuple[Bound, ...]
    alpha: float
    tolerance: float
    tokens: int
    needed: int | None
    statement: str
    blind_spots: tuple[str, ...] = BLIND_SPOTS

    @property
    def confidence(self) -> float:
        return 1.0 - self.alpha

    @property
    def within(self) -> bool:
        return all(b.within for b in self.bounds)


# ---------------------------------------------------------------------------------------------
# the supermartingale boundaries


def _radius(n: float, delta: float, rho: float) -> float:
    v = n / 4.0
    return math.sqrt((v + rho) * (math.log((v + rho) / rho) + 2.0 * math.log(1.0 / delta)))


@functools.lru_cache(maxsize=4096)
def _rho(delta: float, design: int = DESIGN_TOKENS) -> float:
    """The mixture precision that makes the radius per token smallest at `design` tokens: a
    constant of the design (it depends on delta alone), so the boundary stays valid."""
    res = optimize.minimize_scalar(
        lambda lr: _radius(design, delta, math.exp(lr)), bounds=(-8.0, 16.0), method="bounded"
    )
    return math.exp(float(res.x))


def mixture_radius(n: int, delta: float) -> float:
    """r_n with P(|S_k| >= r_k for some k >= 1) <= delta, for S a sum of martingale differences
    each in a predictable interval of length 1 (the normal mixture, module docstring)."""
    if n <= 0:
        return 0.0
    return _radius(n, delta, _rho(delta))


@functools.lru_cache(maxsize=65536)
def one_sided_radius(n: int, delta: float, design: int = DESIGN_TOKENS) -> float:
    """r_n with P(S_k >= r_k for some k) <= delta: the mixture over lambda > 0 only (a
    half-normal density), 2 sqrt(rho / (V + rho)) exp(s^2 / (2 (V + rho))) Phi(s / sqrt(V +
    rho)) = 1 / delta solved for s. About the two-sided radius at 2 delta."""
    if n <= 0:
        return 0.0
    rho = _rho(2 * delta, design)
    w = n / 4.0 + rho

    def log_m(s: float) -> float:
        return (
            math.log(2.0) + 0.5 * math.log(rho / w) + s * s / (2 * w)
            + float(special.log_ndtr(s / math.sqrt(w))) - math.log(1.0 / delta)
        )  # fmt: skip

    hi = _radius(n, delta, rho) + 1.0
    return float(optimize.brentq(log_m, 0.0, hi, xtol=1e-9))


def _smallest_n(ok: Callable[[int], bool], start: int) -> int | None:
    """The smallest n >= start with ok(n), for ok false then true as n grows; None beyond
    `MAX_NEEDED`."""
    if ok(start):
        return start
    lo, hi = start, max(2 * start, 2)
    while not ok(hi):
        lo, hi = hi, 2 * hi
        if hi > MAX_NEEDED:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


# ---------------------------------------------------------------------------------------------
# 1. the PIT order: a time-uniform DKW band for martingale differences


@functools.lru_cache(maxsize=1)
def _levels() -> np.ndarray:
    """Level of each grid point j / 2^L (0 < j < 2^L): L minus the trailing zero bits of j,
    i.e. the coarsest dyadic grid it lies on."""
    j = np.arange(1, 1 << DKW_LEVELS)
    return np.asarray(DKW_LEVELS - np.log2(j & -j).astype(int))


def _point_eps(n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Grid points t and their half-widths eps_t(n) = mixture_radius(n, delta_t) / n."""
    level = _levels()
    t = np.arange(1, 1 << DKW_LEVELS) / (1 << DKW_LEVELS)
    eps_by_level = np.array(
        [0.0]
        + [
            mixture_radius(n, alpha / DKW_LEVELS / (1 << (lv - 1))) / n
            for lv in range(1, DKW_LEVELS + 1)
        ]
    )
    return t, eps_by_level[level]


def pit_margin(n: int, alpha: float) -> float:
    """The most `pit_bound`'s upper can exceed its estimate at n tokens: the best level's
    cell width plus its widest half-width."""
    if n <= 0:
        return 1.0
    return min(
        2.0**-lv + mixture_radius(n, alpha / DKW_LEVELS / (1 << (lv - 1))) / n
        for lv in range(1, DKW_LEVELS + 1)
    )


def _pit_upper(sorted_u: np.ndarray, alpha: float) -> float:
    n = len(sorted_u)
    t, eps = _point_eps(n, alpha)
    f = np.searchsorted(sorted_u, t, side="right") / n
    best = 1.0
    for lv in range(1, DKW_LEVELS + 1):
        step = 1 << (DKW_LEVELS - lv)
        idx = np.arange(step - 1, len(t), step)  # the points of level <= lv
        # with the ends 0 and 1, where G and F are exact (G is continuous: V is)
        tt = np.concatenate([[0.0], t[idx], [1.0]])
        ff = np.concatenate([[0.0], f[idx], [1.0]])
        ee = np.concatenate([[0.0], eps[idx], [0.0]])
        up = np.maximum(ff[1:] + ee[1:] - tt[:-1], tt[1:] - ff[:-1] + ee[:-1])
        best = min(best, float(up.max()))
    return best


def pit_bound(u: Sequence[float] | np.ndarray, alpha: float, tolerance: float) -> Bound:
    """Upper bound on sup_t |G(t) - t|, G the average over steps of the PIT values' CDFs given
    the past, valid at every n at once with probability 1 - alpha.

    Why valid, dependent tokens included: for a fixed t, 1{u_i <= t} - G_i(t) has mean 0 given
    the past and lies in [-G_i(t), 1 - G_i(t)], so n (F_n(t) - G(t)) (F_n the empirical CDF)
    is a sum of such martingale differences and `mixture_radius` holds for it at every n. A
    union over the dyadic grid points t = j / 2^L (level l's 2^(l-1) new points share
    alpha / L) makes all of them hold together. Between two neighbouring points a < b of a
    grid, G and F are non-decreasing, so for t in [a, b]
    |G(t) - t| <= max(F(b) + eps_b - a, b - F(a) + eps_a), every level's grid gives a bound,
    and the smallest is taken. G(0) = 0 and G(1) = 1 exactly (u has no atoms: the PIT's
    randomisation V is continuous and independent of the engine). The union over grids costs
    about what Howard and Ramdas's (2022) time-uniform DKW pays for i.i.d. data, without
    their i.i.d. assumption: their Theorem (the "time-uniform DKW", eps_n about 0.85 sqrt((log
    log(e n) + 0.8 log(1612 / alpha)) / n)) is proven for i.i.d. draws, and its constants are
    not re-derived here, so it is not used; at n = 1000 and alpha = 0.0033 that formula gives
    0.095 and `pit_margin` 0.091. NaN (impossible tokens) are left out: with the increment
    1{possible_i} (1{u_i <= t} - G_i(t)), G_i given the past and a possible token, and the
    variance process counting possible tokens only, the supermartingale is unchanged, so G is
    then the average over the possible tokens.

    `needed`: if the estimate stays where it is, but never below what pure noise gives at N
    (the `NOISE_QUANTILE` of the Kolmogorov distribution over sqrt(N)).
    """
    x = np.asarray(u, dtype=float)
    x = np.sort(x[~np.isnan(x)])
    n = len(x)
    conf = 1.0 - alpha
    what = "probability mass moved toward or away from the draft's favourite (PIT order)"
    if n == 0:
        return Bound(SPLIT[0], what, math.nan, 1.0, tolerance, 0, None, conf)
    i = np.arange(1, n + 1)
    est = float(max(np.max(i / n - x), np.max(x - (i - 1) / n)))  # the KS statistic
    upper = min(1.0, _pit_upper(x, alpha))
    q = _KS_NOISE

    def ok(m: int) -> bool:
        return max(est, q / math.sqrt(m)) + pit_margin(m, alpha) <= tolerance

    needed = n if upper <= tolerance else _smallest_n(ok, n)
    return Bound(SPLIT[0], what, est, upper, tolerance, n, needed, conf)


# ---------------------------------------------------------------------------------------------
# 2. the favourite's average excess


def favourite_bound(
    hits: Sequence[float] | np.ndarray,
    p_fav: Sequence[float] | np.ndarray,
    alpha: float,
    tolerance: float,
) -> Bound:
    """Confidence sequence for the favourite's average excess (1/n) sum_i (P(hit_i | past) -
    p_fav_i), both signs; `upper` bounds its absolute value, `interval` the signed value.

    Why valid: hit_i - P(hit_i | past) has mean 0 given the past and lies in an interval of
    length 1, so `mixture_radius` (two-sided, at alpha) holds at every n:
    |mean(hit - p_fav) - excess| < r_n / n. `needed`: if the estimate stays where it is, but
    never below the `NOISE_QUANTILE` two-sided normal quantile of its own sampling noise.
    """
    h = np.asarray(hits, dtype=float)
    p = np.asarray(p_fav, dtype=float)
    n = len(h)
    conf = 1.0 - alpha
    what = "the draft's favourite's probability, sampled minus the reference's"
    if n == 0:
        return Bound(SPLIT[1], what, math.nan, 1.0, tolerance, 0, None, conf, (-1.0, 1.0))
    mean = float(np.mean(h - p))
    r = mixture_radius(n, alpha) / n
    lo, hi = max(-1.0, mean - r), min(1.0, mean + r)
    upper = max(abs(lo), abs(hi))
    z = float(stats.norm.ppf(0.5 + NOISE_QUANTILE / 2))
    sd = math.sqrt(float(np.mean(p * (1 - p))))

    def ok(m: int) -> bool:
        return max(abs(mean), z * sd / math.sqrt(m)) + mixture_radius(m, alpha) / m <= tolerance

    needed = n if upper <= tolerance else _smallest_n(ok, n)
    return Bound(SPLIT[1], what, abs(mean), upper, tolerance, n, needed, conf, (lo, hi))


# ---------------------------------------------------------------------------------------------
# 3. repeated prefixes: the conditional TV


Strata = Sequence[tuple[Sequence[int] | np.ndarray, Sequence[float] | np.ndarray]]


def tv_bound(strata: Strata, alpha: float, tolerance: float) -> Bound | None:
    """Upper bound on sum_c (n_c / n) TV(q_c, p_c) over the repeated prefixes c (q_c the
    engine's distribution there, p_c the reference's), or None without any.

    The estimate is `stats.tv.conditional_tv_bound`'s plug-in; its argument bounds the TV by
    the plug-in plus (1/n) sum_i (q_c(S_c) - 1[x_i in S_c]) with S_c = {q_c > p_c} fixed, a
    sum of martingale differences when the draws are taken position by position (every
    seed's position-0 draw, then every position-1 draw, ...: seeds are independent, so that
    order is as good as any). In that order whether a prefix repeats is known before its
    draws, so the number n of draws counted is random but predictable; the one-sided
    `one_sided_radius` holds at every n, so the random n costs nothing. The position order is
    not the sampling order: this bound is for a run whose seeds were fixed in advance, not
    for one stopped by looking (the PIT and favourite bounds are). Assumes q_c is the same at
    every visit of c. `needed` (draws at repeated prefixes): the plug-in projected as
    `stats.tv.samples_needed` projects a bound (shrinking like 1 / sqrt(n): its bias, as if
    the TV were 0), plus the exact time-uniform margin at that size (not quite 1 / sqrt(n));
    within a few per cent of `samples_needed(n, upper, tolerance)` on runs of 40 to 1000
    draws.
    """
    fixed = conditional_tv_bound(strata, alpha)
    if fixed.n == 0:
        return None
    n, est = fixed.n, fixed.estimate
    upper = min(1.0, est + one_sided_radius(n, alpha, TV_DESIGN_DRAWS) / n)

    def ok(m: int) -> bool:
        return est * math.sqrt(n / m) + one_sided_radius(m, alpha, TV_DESIGN_DRAWS) / m <= tolerance

    needed = n if upper <= tolerance else _smallest_n(ok, n)
    what = f"TV at the {fixed.contexts} repeated prefixes ({n} draws)"
    return Bound(SPLIT[2], what, est, upper, tolerance, n, needed, 1.0 - alpha)


# ---------------------------------------------------------------------------------------------
# the certificate


def certify(
    u: Sequence[float] | np.ndarray,
    hits: Sequence[float] | np.ndarray,
    p_fav: Sequence[float] | np.ndarray,
    strata: Strata = (),
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Certificate:
    """Every bound at a joint confidence 1 - alpha (each at alpha / 3), in sampling order:
    `u` the PIT values (NaN: an impossible token, left out), `hits` 1 where the token was the
    draft's favourite, `p_fav` the reference's probability of the favourite, `strata` the
    repeated prefixes' (counts, reference probabilities) (`strata_of`)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if not 0 < tolerance <= 1:
        raise ValueError(f"tolerance must be in (0, 1], got {tolerance}")
    each = alpha / len(SPLIT)
    bounds = [pit_bound(u, each, tolerance), favourite_bound(hits, p_fav, each, tolerance)]
    tv = tv_bound(strata, each, tolerance)
    if tv is not None:
        bounds.append(tv)
    tokens = len(hits)
    needed = _needed(bounds, tokens)
    return Certificate(
        bounds=tuple(bounds),
        alpha=alpha,
        tolerance=tolerance,
        tokens=tokens,
        needed=needed,
        statement=_statement(bounds, alpha, tolerance, tokens, needed),
    )


def _needed(bounds: Sequence[Bound], tokens: int) -> int | None:
    out = tokens
    for b in bounds:
        if b.needed is None:
            return None
        need = b.needed
        if b.name == SPLIT[2] and b.n:
            need = math.ceil(need * tokens / b.n)  # repeated-prefix draws -> all tokens
        out = max(out, need)
    return out


def _statement(
    bounds: Sequence[Bound], alpha: float, tolerance: float, tokens: int, needed: int | None
) -> str:
    """One sentence a user can quote."""
    by = {b.name: b for b in bounds}
    pit, fav = by[SPLIT[0]], by[SPLIT[1]]
    parts = [
        f"with {confidence_percent(1 - alpha)} confidence, over {tokens} sampled tokens, "
        "on average at most "
        f"{pit.upper:.1%} of a step's probability mass moved across any cut of the token order "
        "(toward or away from the draft's favourite)",
        f"the favourite's probability is within ±{100 * fav.upper:.1f} percentage points of "
        "the reference's",
    ]
    tv = by.get(SPLIT[2])
    if tv is not None:
        parts.append(
            f"at the repeated prefixes the engine's next-token distribution is within TV "
            f"{tv.upper:.1%} of the reference's"
        )
    sentence = ", ".join(parts[:-1]) + " and " + parts[-1]
    if all(b.within for b in bounds):
        return f"{sentence}: all within the tolerance of {tolerance:.0%}"
    if needed is None:
        return (
            f"{sentence}: not within the tolerance of {tolerance:.0%}, and more tokens alone "
            "would not bring it there"
        )
    return (
        f"{sentence}: not all within the tolerance of {tolerance:.0%} (about {needed} tokens "
        "would decide)"
    )


def strata_of(
    draws: Sequence[TokenDraw], min_draws: int = MIN_PREFIX_DRAWS
) -> list[tuple[list[int], list[float]]]:
    """(counts, reference probabilities) of every prefix with at least `min_draws` draws, over
    the reference's support plus one cell for tokens outside it (probability 0)."""
    groups: dict[str, list[TokenDraw]] = defaultdict(list)
    for d in draws:
        groups[d.prefix_key].append(d)
    out = []
    for ds in groups.values():
        if len(ds) < min_draws:
            continue
        ids = sorted(ds[0].ref.probs)
        total = sum(ds[0].ref.probs.values())
        where = {t: i for i, t in enumerate(ids)}
        counts = [0] * (len(ids) + 1)
        for d in ds:
            counts[where.get(d.token, len(ids))] += 1
        out.append((counts, [ds[0].ref.probs[t] / total for t in ids] + [0.0]))
    return out


def certify_draws(
    draws: Sequence[TokenDraw],
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    seed: int = 0,
) -> Certificate:
    """`certify` on re-scored draws in sampling order, with the PIT values `analysis.analyse`
    uses for the same `seed`."""
    pits = Pits.of(draws, seed)  # the same PIT values as the tests: one copy
    return certify(
        pits.u_all, pits.hits, pits.favourite_p, strata_of(draws), alpha=alpha, tolerance=tolerance
    )
