"""Beyond the pooled position tests: the full history, and independence across seeds.

The position tests pool prefixes that share one true next-token distribution; a bug could bend
single histories while keeping every pool's mixture exact, so each pool also gets a
homogeneity test (`history_result`). Seeds must give independent samples: consecutive seeds'
outcomes are tested for independence (`seed_pair_result`).
"""

from __future__ import annotations

import functools

import numpy as np

from specaudit import fixtures, stats
from specaudit.distribution.counting import OutcomeCounts, Texts, prefix_counts
from specaudit.distribution.results import Workload
from specaudit.distribution.truth import Truth, stratum_key
from specaudit.stats import GofResult

# the history and seed tests' Monte-Carlo stops at this many hits (stats.mc_pvalue; exact):
# a p-value in the bulk costs a few hundred draws, an extreme one all of them
NEW_TESTS_STOP_HITS = 100


@functools.lru_cache(maxsize=64)
def _history_positions(spec: fixtures.FixtureSpec, workload: Workload) -> tuple[int, ...]:
    """Positions t >= 2 where two different generated prefixes can share one true next-token
    distribution (and so one pool of the position test): only there can a bug bend single
    histories while keeping every pool's mixture exact. Found by walking the fixture's states
    (`FixtureSpec.state_key`), counting the distinct prefixes that reach each."""
    truth = Truth(spec, workload)
    prompt = workload.prompt
    level: dict[str, tuple[str, int]] = {spec.state_key(prompt): ("", 1)}
    out: list[int] = []
    for t in range(1, workload.positions + 1):
        pools: dict[tuple[float, ...], int] = {}
        for rep, count in level.values():
            k = stratum_key(truth.p(rep))
            pools[k] = pools.get(k, 0) + count
        if t >= 2 and any(c >= 2 for c in pools.values()):
            out.append(t)
        nxt: dict[str, tuple[str, int]] = {}
        for rep, count in level.values():
            p = truth.p(rep)
            for j in np.flatnonzero(p > 0):
                tok = truth.outcomes[j]
                if tok not in spec.letters:
                    continue  # generation may stop here; nothing follows
                key = spec.state_key(prompt + rep + tok)
                old = nxt.get(key)
                nxt[key] = (rep + tok, count) if old is None else (old[0], old[1] + count)
        level = nxt
    return tuple(out)


def history_positions(truth: Truth) -> tuple[int, ...]:
    """The positions that get a within-pool (history) test (cached per fixture and workload)."""
    return _history_positions(truth.spec, truth.workload)


def history_result(
    truth: Truth,
    texts: Texts,
    t: int,
    *,
    mc_draws: int = stats.MC_DRAWS,
    mc_stop_hits: int = 0,
    mc_seed: int = 0,
) -> GofResult:
    """Within each pool of position t (prefixes with one true next-token distribution), is the
    token independent of the full prefix? `stats.homogeneity_test` over the pools."""
    tables: dict[tuple[float, ...], tuple[list[np.ndarray], np.ndarray]] = {}
    for prefix, c in prefix_counts(truth, texts, t).items():
        p = truth.p(prefix)
        rows, _ = tables.setdefault(stratum_key(p), ([], p))
        rows.append(c)
    return stats.homogeneity_test(
        [(np.vstack(rows), p) for rows, p in tables.values()],
        mc_draws=mc_draws,
        mc_stop_hits=mc_stop_hits or NEW_TESTS_STOP_HITS,
        seed=mc_seed,
    )


def seed_pair_result(
    truth: Truth,
    counts: OutcomeCounts,
    *,
    mc_draws: int = stats.MC_DRAWS,
    mc_stop_hits: int = 0,
    mc_seed: int = 0,
) -> GofResult:
    """Are consecutive seeds' samples independent? The G test of independence of the pairs
    (first `counts.pair_length` outcomes at seed s, at seed s + 1), against chains of the same
    lengths drawn from the closed form (`stats.pair_independence_test`). Pairs holding an
    outcome of probability 0 are left out (the position tests report those)."""
    j = counts.pair_length
    if j == 1:
        p = truth.p("")
        support = np.flatnonzero(p > 0)
        probs = p[support]
        cell_of = {int(c): k for k, c in enumerate(support)}
        index = {a: cell_of.get(truth.cell(a)) for pair in counts.pairs for a in pair if a}
    else:
        joint = truth.joint(j)
        seqs = sorted(joint)
        probs = np.array([joint[x] for x in seqs])
        index = {x: k for k, x in enumerate(seqs)}
    table = np.zeros((len(probs), len(probs)), dtype=np.int64)
    for (a, b), w in counts.pairs.items():
        ia, ib = index.get(a), index.get(b)
        if ia is not None and ib is not None:
            table[ia, ib] += w
    return stats.pair_independence_test(
        table,
        counts.runs,
        probs / probs.sum(),
        mc_draws=mc_draws,
        mc_stop_hits=mc_stop_hits or NEW_TESTS_STOP_HITS,
        seed=mc_seed,
    )


__all__ = [
    "NEW_TESTS_STOP_HITS",
    "history_positions",
    "history_result",
    "seed_pair_result",
]
