"""The fixed-N tests of a re-scored run that need no draft distribution q, each with its size
held at small n: the surprisal test, the rank-bin test, the two-sided favourite test and the
per-prefix multinomial tests.

Why these: a speculative-decoding bug moves probability between the tokens the target model
ranks high and those it ranks low (an acceptance rule such as min(1, 1.25 p/q), a residual that
is not max(0, p - q), a temperature applied twice) or between the draft's favourite and the
rest. The surprisal of the sampled token, log p(x), and its rank under p, see the first kind
with the reference's numbers alone; the favourite's hit count sees the second, in both
directions (a draft token accepted too often or too rarely); a prefix that repeats (every
seed's first token) is tested on its whole distribution.

Why they are valid: each draw x_i comes from its own p_i (the reference's answer for its
exact prefix), and given everything sampled before it the score of step i has a known law
under the null. The sums below are martingales with known conditional variances, so the
self-normalised statistics tend to their Gaussian / chi-square laws whatever the dependence
between steps (martingale CLT); where that limit is not yet reached (few tokens, a few steps
carrying most of the variance, small expected counts) the p-value is Monte-Carlo: each x_i
drawn again from its p_i with a fixed seed (`stats.mc_pvalue`, Besag-Clifford sequential
stopping). That simulation is the exact null when the steps' distributions do not depend on
earlier draws of the test (independent seeds, repeated prefixes) and the same approximation
as the CLT otherwise, with the per-term skewness the CLT misses; the benchmark
(benchmarks/bench_rescore_scores.py) measures both on simulated runs, including a Markov
chain whose distributions depend on the token before.

Tokens outside the reference's support (p = 0) are left out here: they are BROKEN on their
own and counted by the caller. Every test returns a `ScoreTest`; `analysis` combines them,
Holm at alpha, with the run's other tests.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special
from scipy import stats as st

from specaudit.rescore.pit import favourite_of, poisson_binomial_pmf
from specaudit.rescore.records import TokenDraw
from specaudit.stats import MC_DRAWS, SKEW_LIMIT, TINY_P, mc_pvalue, multinomial_gof
from specaudit.stats.gof import MIN_EXPECTED, pool_sparse

__all__ = [
    "KURTOSIS_LIMIT",
    "MIN_BIN_EXPECTED",
    "MIN_PREFIX_DRAWS",
    "PREFIX_EXACT_LIMIT",
    "PREFIX_POOL_EXPECTED",
    "RANK_EDGES",
    "SHARE_LIMIT",
    "STOP_HITS",
    "RankBins",
    "ScoreTest",
    "favourite_test",
    "prefix_tests",
    "rank_bin_moments",
    "rank_bin_test",
    "surprisal_test",
]

# A prefix enters the per-prefix tests with at least this many draws (analysis.G_MIN_DRAWS):
# below it a prefix's multinomial test has almost no power, and each test costs Holm level.
MIN_PREFIX_DRAWS = 20
# A prefix's tokens expecting fewer draws than this are pooled into one cell before its test
# (`stats.gof.pool_sparse`, decided by p and n alone, so the p-value stays exact): 30 tail
# cells of top-k 40 expecting 0.05 draws each add noise to G and take its power.
PREFIX_POOL_EXPECTED = 1.0
# Exact p-value up to this many possible outcomes (enumerating 10^5 costs about 0.1 s, a
# sequential Monte-Carlo p-value in the bulk a few milliseconds), Monte-Carlo beyond.
PREFIX_EXACT_LIMIT = 10_000
# First rank (1-based) of each rank bin: ranks 1, 2, 3-4, 5-8, 9-16, 17+ (dyadic: the top
# ranks, where the mass is, on their own; the tail, where a top-k / top-p bug lands, pooled).
RANK_EDGES = (1, 2, 3, 5, 9, 17)
# Adjacent tail bins are merged (from the last up) until each expects this many tokens: a bin
# expecting 0.05 would make one token a huge statistic and leave no power for the others.
MIN_BIN_EXPECTED = 1.0
# The surprisal sum is referred to the normal only when these say the CLT has arrived: the
# sum's skewness (the normal's two-sided tails are off by about skew * z^2 / 6), its excess
# kurtosis, and the share of the variance carried by the largest single step.
KURTOSIS_LIMIT = 0.1
SHARE_LIMIT = 0.02
STOP_HITS = 20  # Besag-Clifford: a Monte-Carlo p-value stops at this many exceedances
_CHUNK = 2_000_000  # simulated tokens per Monte-Carlo chunk (memory)
_RERR = 1 + 1e-7  # the probability ordering's tolerance (scipy.stats.binomtest's)


@dataclass(frozen=True)
class ScoreTest:
    """One test of a re-scored run: its statistic, its p-value and what it saw, in words."""

    name: str
    statistic: float
    p_value: float
    detail: str


@dataclass(frozen=True)
class _Steps:
    """The tested draws (p(x) > 0), each step's distribution sorted by falling probability
    (ties by id), normalised, zero-padded to one width; `rank[i]` is x_i's 0-based rank."""

    probs: np.ndarray  # n x K
    rank: np.ndarray  # n, int
    excluded: int  # draws with p(x) = 0, left out

    @property
    def n(self) -> int:
        return len(self.rank)


def _steps(draws: Sequence[TokenDraw]) -> _Steps:
    tested = [d for d in draws if d.ref.probs.get(d.token, 0.0) > 0.0]
    width = max((len(d.ref.probs) for d in tested), default=1)
    n = len(tested)
    pad = [width - len(d.ref.probs) for d in tested]
    big = int(np.iinfo(np.int64).max)
    ids = np.array([[*d.ref.probs.keys(), *[big] * k] for d, k in zip(tested, pad, strict=True)])
    # padding: probability -1 sorts last
    vals = np.array(
        [[*d.ref.probs.values(), *[-1.0] * k] for d, k in zip(tested, pad, strict=True)]
    )
    ids, vals = ids.reshape(n, width), vals.reshape(n, width)
    order = np.lexsort((ids, -vals), axis=1)  # falling probability, ties by id
    probs = np.maximum(np.take_along_axis(vals, order, axis=1), 0.0)
    probs /= np.maximum(probs.sum(axis=1, keepdims=True), 1e-300)
    tokens = np.array([d.token for d in tested], dtype=np.int64)
    rank = np.argmax(np.take_along_axis(ids, order, axis=1) == tokens[:, None], axis=1)
    return _Steps(probs, rank.astype(np.int64), len(draws) - n)


def _alias(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker's alias tables of every row, all rows at once: column j is kept with probability
    keep[i, j], else it is alias[i, j], and each column carries mass 1 / K. Vose's pairing,
    many small columns per round: the row's largest column g tops up its small columns in
    column order while it still holds at least 1 before each (the invariant a single pairing
    needs), so a heavy head settles its tail in a few rounds."""
    n, k = probs.shape
    scaled = probs * k
    keep = np.ones((n, k))
    alias = np.tile(np.arange(k), (n, 1))
    active = np.ones((n, k), dtype=bool)
    rows = np.arange(n)
    for _ in range(k):
        small = active & (scaled < 1.0)
        big = np.where(active & ~small, scaled, -np.inf)
        g = big.argmax(axis=1)
        work = small.any(axis=1) & np.isfinite(big[rows, g])
        if not work.any():
            break
        deficit = np.where(small & work[:, None], 1.0 - scaled, 0.0)
        before = np.cumsum(deficit, axis=1) - deficit
        chosen = small & work[:, None] & (before <= scaled[rows, g][:, None] - 1.0)
        keep[chosen] = scaled[chosen]
        alias[chosen] = np.broadcast_to(g[:, None], (n, k))[chosen]
        scaled[rows, g] -= np.where(chosen, deficit, 0.0).sum(axis=1)
        active &= ~chosen
    return keep, alias


def _sampler(
    probs: np.ndarray, values: np.ndarray
) -> Callable[[np.random.Generator, int], np.ndarray]:
    """Draws m x n values, each row `values[i, x_i]` for one draw x_i from every step's
    distribution, by the alias method (one uniform per draw: its integer part over K picks
    the column, the fraction is the coin that keeps it or takes its alias)."""
    n, k = probs.shape
    keep2, alias = _alias(probs)
    keep = keep2.ravel()
    own = values.ravel()
    other = np.take_along_axis(values, alias, axis=1).ravel()
    offsets = np.arange(n) * k

    def draw(rng: np.random.Generator, m: int) -> np.ndarray:
        u = rng.random((m, n))
        u *= k
        col = np.minimum(u.astype(np.int64), k - 1)
        u -= col
        col += offsets
        return np.where(u < keep.take(col), own.take(col), other.take(col))

    return draw


def _mc(
    observed: float,
    simulate: Callable[[int, np.random.Generator], np.ndarray],
    n: int,
    mc_draws: int,
    stop_hits: int,
    seed: int,
) -> tuple[float, int]:
    """P(simulated >= observed) by `stats.mc_pvalue`, as (p-value, hits)."""
    tol = 1e-9 * max(1.0, abs(observed))
    chunk = max(1, _CHUNK // max(1, n))
    p, _, hits = mc_pvalue(
        observed - tol, simulate, mc_draws, stop_hits=stop_hits, seed=seed, chunk=chunk
    )
    return p, hits


def _excluded(s: _Steps) -> str:
    return f"; {s.excluded} token(s) outside the support left out" if s.excluded else ""


# --- surprisal ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Surprisal:
    """Per step: the score of each rank, s = log p - E_p[log p] (0 where p = 0), and the
    score's variance, third moment and fourth cumulant under p."""

    score: np.ndarray  # n x K
    var: np.ndarray
    k3: np.ndarray
    k4: np.ndarray

    @classmethod
    def of(cls, probs: np.ndarray) -> _Surprisal:
        pos = probs > 0
        logp = np.where(pos, np.log(np.where(pos, probs, 1.0)), 0.0)
        score = np.where(pos, logp - (probs * logp).sum(axis=1, keepdims=True), 0.0)
        sq = score * score  # products, not **: numpy's float pow is 100 times slower
        var = (probs * sq).sum(axis=1)
        k3 = (probs * sq * score).sum(axis=1)
        k4 = (probs * sq * sq).sum(axis=1) - 3 * var * var
        return cls(score, var, k3, k4)


def surprisal_test(
    draws: Sequence[TokenDraw],
    *,
    method: str = "auto",
    mc_draws: int = MC_DRAWS,
    stop_hits: int = STOP_HITS,
    seed: int = 0,
) -> ScoreTest:
    """Is the sampled tokens' surprisal what p says? S = sum_i (log p_i(x_i) - E_{p_i}[log p_i])
    over sqrt(sum_i Var_{p_i}[log p_i]), two-sided: z > 0 means the tokens are more probable
    under p than p's own draws are (too sharp: a temperature below 1, a draft accepted too
    often), z < 0 too flat.

    Each term has conditional mean 0 given its prefix, so S is a martingale whose predictable
    variance is the denominator: z -> N(0, 1) under any dependence (martingale CLT). `method`
    "normal" uses that (p = 2 P(|N| >= |z|)); "monte-carlo" refers |z| to draws of every x_i
    from its p_i (`mc_draws` at most, sequential at `stop_hits`; beyond every simulation the
    Chernoff bound if smaller); "auto" takes the normal only when the sum's skewness is at
    most SKEW_LIMIT, its excess kurtosis at most KURTOSIS_LIMIT and no step carries more than
    SHARE_LIMIT of the variance, else Monte-Carlo.
    """
    if method not in ("auto", "normal", "monte-carlo"):
        raise ValueError(f"unknown method {method!r}")
    s = _steps(draws)
    sur = _Surprisal.of(s.probs)
    total_var = float(sur.var.sum())
    if s.n == 0 or total_var <= 1e-12:
        return ScoreTest("surprisal", 0.0, 1.0, f"no token with any variation{_excluded(s)}")
    observed = float(sur.score[np.arange(s.n), s.rank].sum())
    sd = math.sqrt(total_var)
    z = observed / sd
    skew = float(sur.k3.sum()) / total_var**1.5
    kurt = float(sur.k4.sum()) / total_var**2
    share = float(sur.var.max()) / total_var
    if method == "auto":
        clt = abs(skew) <= SKEW_LIMIT and abs(kurt) <= KURTOSIS_LIMIT and share <= SHARE_LIMIT
        method = "normal" if clt else "monte-carlo"
    if method == "normal":
        p = max(float(2 * st.norm.sf(abs(z))), TINY_P)
    else:
        p = _surprisal_mc(s, sur, abs(z), (mc_draws, stop_hits, seed))
    direction = "sharper" if z > 0 else "flatter"
    detail = (
        f"{s.n} tokens: surprisal sum {observed:+.4g} (sd {sd:.4g}, z = {z:+.3g}: {direction} "
        f"than p), skewness {skew:+.2g}, {method}{_excluded(s)}"
    )
    return ScoreTest("surprisal", z, p, detail)


def _chernoff(s: _Steps, sur: _Surprisal, t: float) -> float:
    """Chernoff's bound on P(|S| >= t): for each tail, min over lambda of
    exp(sum_i log E_{p_i} exp(lambda s_i) - lambda |t|), each step's moment generating function
    exact (p_i is known). Valid for independent steps; for dependent ones the same exponential
    supermartingale argument at the realised steps (as the CLT, an approximation)."""
    pos = s.probs > 0
    logp = np.where(pos, np.log(np.where(pos, s.probs, 1.0)), -np.inf)

    def log_tail(sign: float) -> float:
        def f(lam: float) -> float:
            return float(special.logsumexp(logp + sign * lam * sur.score, axis=1).sum()) - lam * t

        res = optimize.minimize_scalar(f, bounds=(0.0, 50.0), method="bounded")
        return min(0.0, float(res.fun))

    return float(min(1.0, math.exp(log_tail(1.0)) + math.exp(log_tail(-1.0))))


def _surprisal_mc(s: _Steps, sur: _Surprisal, abs_z: float, mc: tuple[int, int, int]) -> float:
    """P(|Z| >= |z|) with every x_i drawn again from its p_i. Chernoff's bound (`_chernoff`)
    is used instead when it is below the simulation's floor (no draws needed), or when no
    simulation reached |z| and it is smaller: a far-out statistic keeps a p-value below
    1 / (draws + 1). Still valid: the bound is above the true tail, so it is below the floor
    only where the simulation would have rejected at every level above the floor anyway."""
    mc_draws, stop_hits, seed = mc
    sd = math.sqrt(float(sur.var.sum()))
    floor = 1 / (mc_draws + 1)
    # the bound is worth its optimisation only far out (the normal's tail says where)
    far = 2 * st.norm.sf(abs_z) < floor
    bound = max(_chernoff(s, sur, abs_z * sd), TINY_P) if far else 1.0
    if bound <= floor:
        return bound
    draw = _sampler(s.probs, sur.score)

    def simulate(m: int, rng: np.random.Generator) -> np.ndarray:
        return np.asarray(np.abs(draw(rng, m).sum(axis=1)) / sd)

    p, hits = _mc(abs_z, simulate, s.n, mc_draws, stop_hits, seed)
    if hits:
        return p
    return min(p, bound if far else max(_chernoff(s, sur, abs_z * sd), TINY_P))


# --- rank bins ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RankBins:
    """The rank bins as tested: each step's bin probabilities pi_i, the observed and expected
    counts, and the exact null covariance sum_i (diag(pi_i) - pi_i pi_i^T)."""

    labels: tuple[str, ...]  # the ranks (1-based) of each bin: "1", "3-4", "17+"
    step_probs: np.ndarray  # n x B
    observed: np.ndarray  # B
    expected: np.ndarray  # B
    covariance: np.ndarray  # B x B
    bin_of_rank: np.ndarray  # K: the bin of each 0-based rank


def _group_bins(expected: np.ndarray) -> list[list[int]]:
    """Adjacent base bins merged from the tail up until each group expects MIN_BIN_EXPECTED
    tokens (top rank first). Depends on p alone, never on the draws: the test stays exact."""
    groups: list[list[int]] = []
    cur: list[int] = []
    acc = 0.0
    for b in reversed(range(len(expected))):
        cur.insert(0, b)
        acc += float(expected[b])
        if acc >= MIN_BIN_EXPECTED:
            groups.insert(0, cur)
            cur, acc = [], 0.0
    if cur:
        if groups:
            groups[0] = cur + groups[0]
        else:
            groups = [cur]
    return groups


def _label(group: list[int], edges: Sequence[int], last: int) -> str:
    lo = edges[group[0]]
    if group[-1] == last:
        return f"{lo}+"
    hi = edges[group[-1] + 1] - 1
    return str(lo) if hi == lo else f"{lo}-{hi}"


def rank_bin_moments(draws: Sequence[TokenDraw], edges: Sequence[int] = RANK_EDGES) -> RankBins:
    """Counts of the tested tokens by their rank under p (1 = the most probable, ties by id)
    in the bins starting at `edges` (1-based, increasing, the first 1), sparse tail bins
    merged (`MIN_BIN_EXPECTED`), with the expected counts and their exact covariance."""
    return _rank_bins(_steps(draws), edges)


def _rank_bins(s: _Steps, edges: Sequence[int]) -> RankBins:
    if not edges or edges[0] != 1 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"rank edges must start at 1 and increase: {edges!r}")
    width = s.probs.shape[1]
    base_of_rank = np.searchsorted(np.asarray(edges), np.arange(width) + 1, side="right") - 1
    nb = len(edges)
    base = np.zeros((s.n, nb))
    for b in range(nb):
        base[:, b] = s.probs[:, base_of_rank == b].sum(axis=1)
    groups = _group_bins(base.sum(axis=0))
    group_of_base = np.zeros(nb, dtype=np.int64)
    for g, members in enumerate(groups):
        group_of_base[members] = g
    pi = np.stack([base[:, g].sum(axis=1) for g in groups], axis=1)
    bin_of_rank = group_of_base[base_of_rank]
    observed = np.bincount(bin_of_rank[s.rank], minlength=len(groups)).astype(float)
    expected = pi.sum(axis=0)
    covariance = np.diag(expected) - pi.T @ pi
    labels = tuple(_label(g, edges, nb - 1) for g in groups)
    return RankBins(labels, pi, observed, expected, covariance, bin_of_rank)


@dataclass(frozen=True)
class _Mahalanobis:
    """(d^T C^+ d) through C's eigenvectors of non-zero eigenvalue (the pseudo-inverse): the
    sum-to-n direction, and any a step structure pins, carry no variance and are left out."""

    basis: np.ndarray  # B x r, eigenvectors over sqrt(eigenvalue)

    @classmethod
    def of(cls, covariance: np.ndarray) -> _Mahalanobis:
        w, v = np.linalg.eigh(covariance)
        keep = w > 1e-9 * max(float(w.max()), 1e-300)
        return cls(v[:, keep] / np.sqrt(w[keep]))

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])

    def __call__(self, d: np.ndarray) -> np.ndarray:
        return np.asarray(((d @ self.basis) ** 2).sum(axis=-1))


def rank_bin_test(
    draws: Sequence[TokenDraw],
    *,
    edges: Sequence[int] = RANK_EDGES,
    method: str = "auto",
    mc_draws: int = MC_DRAWS,
    stop_hits: int = STOP_HITS,
    seed: int = 0,
) -> ScoreTest:
    """Do the sampled tokens' ranks under p fall in the rank bins as p says? The Mahalanobis
    distance of the observed from the expected bin counts under their exact covariance
    (`rank_bin_moments`), df = the covariance's rank (bins - 1 as a rule).

    Bins by rank under p, not by the PIT order with the draft's favourite first: the rank is
    defined by p alone (no draft needed), means the same at every step, and a bug that moves
    mass between likely and unlikely tokens (temperature, top-k / top-p, a residual that is
    not p - q, rank 2 given to rank 3) moves counts between bins; the favourite, whichever it
    is, has `favourite_test`. The counts minus their expectation are a vector martingale with
    that predictable covariance, so the statistic tends to chi-square(df) under any dependence;
    `method` "chi-square" uses that, "monte-carlo" refers it to every x_i drawn again from its
    p_i, "auto" takes chi-square only when every bin expects MIN_EXPECTED tokens or more.
    """
    if method not in ("auto", "chi-square", "monte-carlo"):
        raise ValueError(f"unknown method {method!r}")
    s = _steps(draws)
    rb = _rank_bins(s, edges)
    maha = _Mahalanobis.of(rb.covariance)
    if s.n == 0 or maha.rank == 0:
        why = f"{s.n} token(s): too few to fill two rank bins expecting {MIN_BIN_EXPECTED:g} each"
        return ScoreTest("rank bins", 0.0, 1.0, f"{why}{_excluded(s)}")
    x2 = float(maha(rb.observed - rb.expected))
    if method == "auto":
        method = "chi-square" if rb.expected.min() >= MIN_EXPECTED else "monte-carlo"
    if method == "chi-square":
        p = max(float(st.chi2.sf(x2, maha.rank)), TINY_P)
    else:
        p = _rank_bin_mc(s, rb, maha, x2, (mc_draws, stop_hits, seed))
    bins = ", ".join(
        f"{lab}: {o:.0f}/{e:.1f}"
        for lab, o, e in zip(rb.labels, rb.observed, rb.expected, strict=True)
    )
    detail = (
        f"{s.n} tokens by rank under p, observed/expected {bins}; chi-square {x2:.3g} on "
        f"{maha.rank} df, {method}{_excluded(s)}"
    )
    return ScoreTest("rank bins", x2, p, detail)


def _rank_bin_mc(
    s: _Steps, rb: RankBins, maha: _Mahalanobis, x2: float, mc: tuple[int, int, int]
) -> float:
    mc_draws, stop_hits, seed = mc
    nbins = len(rb.labels)
    draw = _sampler(rb.step_probs, np.broadcast_to(np.arange(nbins), rb.step_probs.shape))

    def simulate(m: int, rng: np.random.Generator) -> np.ndarray:
        bins = draw(rng, m) + nbins * np.arange(m)[:, None]
        counts = np.bincount(bins.ravel(), minlength=m * nbins).reshape(m, nbins)
        return maha(counts - rb.expected)

    return _mc(x2, simulate, s.n, mc_draws, stop_hits, seed)[0]


# --- the favourite -----------------------------------------------------------------------


def favourite_test(
    draws: Sequence[TokenDraw], favourites: Sequence[int] | None = None
) -> ScoreTest:
    """Was the draft's favourite sampled as often as p says, neither more nor less? The
    number of hits against its exact Poisson-binomial law (the sum of each step's p(fav)),
    two-sided by probability ordering, as `scipy.stats.binomtest`: the p-value is the
    probability of every count no more likely than the one seen (the law is log-concave, so
    that is the two tails beyond it). Too many hits: a draft accepted too often; too few: a
    draft rejected too often, which the one-sided test cannot see.

    `favourites`: the favourite per draw (default `pit.favourite_of`: the draft's favourite
    when known, else p's argmax). Exact when the steps' p(fav) do not depend on earlier hits,
    and the CLT's approximation otherwise.
    """
    fav = [favourite_of(d) for d in draws] if favourites is None else list(favourites)
    if len(fav) != len(draws):
        raise ValueError("one favourite per draw")
    hits: list[bool] = []
    ps: list[float] = []
    excluded = 0
    for d, f in zip(draws, fav, strict=True):
        if d.ref.probs.get(d.token, 0.0) <= 0.0:
            excluded += 1
            continue
        hits.append(d.token == f)
        ps.append(d.ref.probs.get(f, 0.0) / sum(d.ref.probs.values()))
    n, k = len(ps), sum(hits)
    pa = np.clip(np.asarray(ps, dtype=float), 0.0, 1.0)
    mean, var = float(pa.sum()), float((pa * (1 - pa)).sum())
    pmf = poisson_binomial_pmf(pa)
    p = float(pmf[pmf <= pmf[k] * _RERR].sum()) if n else 1.0
    p = min(1.0, max(p, TINY_P))
    z = (k - mean) / math.sqrt(var) if var > 0 else 0.0
    out = f"; {excluded} token(s) outside the support left out" if excluded else ""
    detail = (
        f"the favourite sampled {k} times of {n} where p expects {mean:.1f} (z = {z:+.3g}){out}"
    )
    return ScoreTest("favourite (two-sided)", z, p, detail)


# --- repeated prefixes -------------------------------------------------------------------


def prefix_tests(
    draws: Sequence[TokenDraw],
    *,
    min_draws: int = MIN_PREFIX_DRAWS,
    mc_draws: int = MC_DRAWS,
    stop_hits: int = STOP_HITS,
    seed: int = 0,
) -> list[ScoreTest]:
    """One multinomial test per prefix repeated at least `min_draws` times (tested draws):
    its token counts against p by the G statistic (tokens expecting fewer than
    PREFIX_POOL_EXPECTED draws pooled), with an exact p-value when its outcomes
    can be enumerated (PREFIX_EXACT_LIMIT) and a Monte-Carlo one otherwise
    (`stats.multinomial_gof`), never the chi-square approximation, which at 200 draws over
    flat top-k 40 distributions rejected 2.25 % of null prefixes at alpha = 1 %
    (benchmarks/bench_rescore_scores.py). The simulation's seed is `seed` mixed
    with a CRC of the prefix key: the same draws give the same p-values in any order. The
    draws of one prefix are independent given it (one per seed), so each p-value is exact;
    the caller combines them (Holm)."""
    groups: dict[str, list[TokenDraw]] = defaultdict(list)
    for d in draws:
        if d.ref.probs.get(d.token, 0.0) > 0.0:
            groups[d.prefix_key].append(d)
    out = []
    for key, ds in groups.items():
        if len(ds) < min_draws:
            continue
        ids = sorted(t for t, p in ds[0].ref.probs.items() if p > 0)
        probs = np.array([ds[0].ref.probs[t] for t in ids])
        probs /= probs.sum()
        where = {t: j for j, t in enumerate(ids)}
        # one reference answer per prefix: the first draw's (a cached answer, the same for all)
        counts = np.bincount([where[d.token] for d in ds if d.token in where], minlength=len(ids))
        n = int(counts.sum())
        obs, cells = pool_sparse(counts, probs, PREFIX_POOL_EXPECTED)
        outcomes = math.comb(n + len(cells) - 1, len(cells) - 1)
        method = "exact" if outcomes <= PREFIX_EXACT_LIMIT else "monte-carlo"
        res = multinomial_gof(
            obs.astype(np.int64), cells, method, mc_draws=mc_draws, mc_stop_hits=stop_hits,
            seed=(seed * 1_000_003 + zlib.crc32(key.encode())) % 2**32,
        )  # fmt: skip
        detail = (
            f"position {ds[0].position}, {n} draws over {len(ids)} tokens ({len(cells)} cells "
            f"after pooling): G = {res.statistic:.3g}, {res.method}"
        )
        out.append(ScoreTest(f"prefix {key}", res.statistic, res.p_value, detail))
    return out
