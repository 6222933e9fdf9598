"""Tests that see what a goodness-of-fit test against pooled contexts cannot:

- `homogeneity_test`: within a pool of contexts that share one true next-token distribution,
  does the next token depend on which context it followed? A bug that keeps each pool's
  mixture exact while bending individual histories (one context up, another down) leaves the
  pooled G-test blind; the G-test of independence between context and token sees it.
- `pair_independence_test`: are consecutive seeds' samples independent? A seed-reuse-like bug
  (sample s + 1 repeating, or depending on, sample s) keeps every distribution exact.

Both know the null exactly (the fixture's closed form), so small counts get a Monte-Carlo
reference simulated from it, not an asymptotic one they have not earned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as st

from specaudit.stats.base import MC_DRAWS, TINY_P, GofResult, mc_pvalue
from specaudit.stats.gof import MIN_EXPECTED, _types_bound

__all__ = ["PAIR_MC_BUDGET", "g_independence", "homogeneity_test", "pair_independence_test"]

PAIR_MC_BUDGET = 4e7  # largest draws x tokens simulated for the pair test; fewer draws beyond


def g_independence(table: np.ndarray) -> np.ndarray:
    """G statistic of independence of the last two axes of `table` (any leading axes: one G
    per table): 2 sum o ln(o n / (row total x column total)). Empty rows and columns add 0."""
    o = np.asarray(table, dtype=float)
    r = o.sum(axis=-1, keepdims=True)
    c = o.sum(axis=-2, keepdims=True)
    n = o.sum(axis=(-1, -2), keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(o > 0, o * np.log(o * n / (r * c)), 0.0)
    return np.asarray(2.0 * terms.sum(axis=(-1, -2)))


def _df_and_min_expected(table: np.ndarray) -> tuple[int, float]:
    r = table.sum(axis=1)
    c = table.sum(axis=0)
    r, c = r[r > 0], c[c > 0]
    n = float(table.sum())
    if len(r) < 2 or len(c) < 2:
        return 0, math.inf
    return (len(r) - 1) * (len(c) - 1), float(r.min() * c.min() / n)


def homogeneity_test(
    tables: Sequence[tuple[np.ndarray, Sequence[float] | np.ndarray]],
    method: str = "auto",
    *,
    min_expected: float = MIN_EXPECTED,
    mc_draws: int = MC_DRAWS,
    mc_stop_hits: int = 0,
    seed: int = 0,
) -> GofResult:
    """Is the next token independent of the context within each pool of contexts?

    `tables`: per pool, (counts: contexts x cells, the pool's true distribution p over the
    cells). Each context's row is compared with the rest of its pool (G of the 2 x cells
    table), read as a chi-square tail, and the statistic is the smallest over every row of
    every pool (min-p): a bug that bends two contexts of one pool is not diluted by the
    degrees of freedom of all the others (a summed G lost most of its power that way).
    Under the null every row is multinomial(row total, p). Reference: "g-test" (Bonferroni
    over the rows) when every expected count is at least `min_expected`, else "monte-carlo"
    (rows simulated from the known p, `mc_pvalue`: exact), and beyond every simulation the
    union over rows of the method-of-types bound (a row's G against the rest is at most the
    pool's G of homogeneity, at most its rows' G against p). `statistic` and `df` are the
    pools' summed G of independence and degrees of freedom (descriptive). Cells p forbids are
    left out (the goodness-of-fit test reports them).
    """
    if method not in ("auto", "g-test", "monte-carlo"):
        raise ValueError(f"unknown method {method!r}")
    pools = _clean_pools(tables)
    n = int(sum(int(o.sum()) for o, _ in pools))
    if not pools:
        return GofResult(0.0, 0, 1.0, "trivial", n, 0, math.inf)
    dfs, mins = zip(*(_df_and_min_expected(o) for o, _ in pools), strict=True)
    df = int(sum(dfs))
    min_e = float(min(mins))
    if df == 0:
        return GofResult(0.0, 0, 1.0, "trivial", n, len(pools), min_e)
    g = float(sum(float(g_independence(o)) for o, _ in pools))
    s_obs = max(float(_row_score(_rows_vs_rest(o), o.shape[1]).max()) for o, _ in pools)
    if method == "auto":
        method = "g-test" if min_e >= min_expected else "monte-carlo"
    if method == "g-test":
        # Bonferroni over the rows: each row-vs-rest G is chi-square with cells - 1 df
        rows_total = sum(len(o) for o, _ in pools)
        p_value = max(min(1.0, rows_total * math.exp(-s_obs)), TINY_P)
        return GofResult(g, df, p_value, "g-test", n, len(pools), min_e)
    p_value = _homogeneity_mc(pools, s_obs, mc_draws, mc_stop_hits, seed)
    return GofResult(g, df, p_value, "monte-carlo", n, len(pools), min_e)


def _clean_pools(
    tables: Sequence[tuple[np.ndarray, Sequence[float] | np.ndarray]],
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The pools as tested: cells p forbids and empty rows left out, and pools with fewer
    than two rows or cells (nothing to compare) dropped; p renormalised."""
    pools: list[tuple[np.ndarray, np.ndarray]] = []
    for counts, probs in tables:
        o = np.asarray(counts, dtype=np.int64)
        p = np.asarray(probs, dtype=float)
        if o.ndim != 2 or o.shape[1] != len(p):
            raise ValueError("each table is contexts x cells, one cell per probability")
        keep = p > 0
        o = o[:, keep]
        o = o[o.sum(axis=1) > 0]
        if len(o) >= 2 and int(keep.sum()) >= 2:
            pools.append((o, p[keep] / p[keep].sum()))
    return pools


def _rows_vs_rest(o: np.ndarray) -> np.ndarray:
    """Each context's row against the rest of its pool: G of the 2 x cells table, for every
    row (leading axes kept): (..., rows)."""
    o = np.asarray(o, dtype=float)
    rest = o.sum(axis=-2, keepdims=True) - o
    return g_independence(np.stack([o, rest], axis=-2))


def _row_score(g: np.ndarray, k: int) -> np.ndarray:
    """-ln of a chi-square tail with k - 1 df: a fixed monotone map, so rows of pools of
    different sizes are comparable; the Monte-Carlo reference is exact whatever it is."""
    return np.asarray(-st.chi2.logsf(g, max(k - 1, 1)))


def _homogeneity_mc(
    pools: list[tuple[np.ndarray, np.ndarray]],
    s_obs: float,
    mc_draws: int,
    mc_stop_hits: int,
    seed: int,
) -> float:
    """P(the largest row score >= s_obs), rows simulated from each pool's known p; beyond
    every simulation, the method-of-types bound if smaller."""

    def simulate(m: int, rng: np.random.Generator) -> np.ndarray:
        best = np.full(m, -np.inf)
        for o, p in pools:
            rows = o.sum(axis=1)
            sims = np.stack([rng.multinomial(int(r), p, size=m) for r in rows], axis=1)
            best = np.maximum(best, _row_score(_rows_vs_rest(sims), o.shape[1]).max(axis=1))
        return best

    tol = 1e-9 * max(1.0, abs(s_obs))
    p_value, _, hits = mc_pvalue(
        s_obs - tol, simulate, mc_draws, stop_hits=mc_stop_hits, seed=seed, chunk=1000
    )
    if hits == 0:
        # union over rows of each row's method-of-types bound at its own threshold (a row's
        # G against the rest is at most the G of the pool's rows against p)
        bound = 0.0
        for o, p in pools:
            g_i = float(st.chi2.isf(math.exp(-s_obs), max(o.shape[1] - 1, 1)))
            bound += len(o) * _types_bound(g_i, [(row, p) for row in o])
        p_value = max(min(p_value, bound), TINY_P)
    return p_value


def pair_independence_test(
    pairs: np.ndarray,
    chains: Sequence[int],
    probs: Sequence[float] | np.ndarray,
    method: str = "auto",
    *,
    min_expected: float = MIN_EXPECTED,
    mc_draws: int = MC_DRAWS,
    mc_stop_hits: int = 0,
    seed: int = 0,
) -> GofResult:
    """Are consecutive samples independent? `pairs[a, b]` counts consecutive seeds (s, s + 1)
    whose outcomes are a and b; `chains` are the lengths of the runs of consecutive seeds
    drawn (seeds 1..N: one chain of N); `probs` the outcomes' true distribution.

    The statistic is the G of independence of the pair table (Anderson and Goodman's test of
    a Markov chain of order 0 against order 1). Reference: chi-square with (rows - 1)(columns
    - 1) degrees of freedom when every expected count is at least `min_expected`, else
    "monte-carlo": chains of the same lengths drawn i.i.d. from the known `probs`, the exact
    null whatever the counts (draws capped at PAIR_MC_BUDGET / tokens, any number valid).
    """
    if method not in ("auto", "g-test", "monte-carlo"):
        raise ValueError(f"unknown method {method!r}")
    o = np.asarray(pairs, dtype=np.int64)
    p = np.asarray(probs, dtype=float)
    k = len(p)
    if o.shape != (k, k):
        raise ValueError("pairs must be a square table, one row and column per probability")
    n = int(o.sum())
    df, min_e = _df_and_min_expected(o)
    if df == 0 or n == 0:
        return GofResult(0.0, 0, 1.0, "trivial", n, 0, min_e)
    g_obs = float(g_independence(o))
    if method == "auto":
        method = "g-test" if min_e >= min_expected else "monte-carlo"
    if method == "g-test":
        return GofResult(
            g_obs, df, max(float(st.chi2.sf(g_obs, df)), TINY_P), "g-test", n, 1, min_e
        )
    lengths = [int(c) for c in chains if int(c) >= 2]
    tokens = max(1, sum(lengths))
    draws = int(min(mc_draws, max(200, PAIR_MC_BUDGET // tokens)))
    support = np.flatnonzero(p > 0)
    ps = p[support] / p[support].sum()
    ks = len(support)
    cum = np.cumsum(ps)
    cum[-1] = 1.0

    def simulate(m: int, rng: np.random.Generator) -> np.ndarray:
        table = np.zeros(m * ks * ks, dtype=np.int64)
        base = (np.arange(m) * ks * ks)[:, None]
        for length in lengths:
            idx = np.minimum(np.searchsorted(cum, rng.random((m, length)), side="right"), ks - 1)
            codes = base + idx[:, :-1] * ks + idx[:, 1:]
            table += np.bincount(codes.ravel(), minlength=m * ks * ks)
        return g_independence(table.reshape(m, ks, ks))

    tol = 1e-9 * max(1.0, abs(g_obs))
    chunk = max(1, int(2e6 // tokens))
    p_value, _, _ = mc_pvalue(
        g_obs - tol, simulate, draws, stop_hits=mc_stop_hits, seed=seed, chunk=chunk
    )
    return GofResult(g_obs, df, p_value, "monte-carlo", n, 1, min_e)
