"""The fixed-sample analysis: per-position stratified tests, the joint, a directed test toward
the draft, Holm, certified TV bounds, a verdict.

Samples are analysed as a `Tally`: counts of the distinct generated texts (cut to the tested
positions), never a list of samples, so memory depends on how many *different* texts came
back (at most letters^positions), not on --seeds. The results are the same as over the list.

What the verdict certifies (docs/dist.md, "Verdict"):

- BROKEN: a token the target gives probability 0 was sampled (a forbidden letter, a special
  token, an early end; the evidence names seed, position and token), or a Holm-corrected test
  rejects at alpha (positions, joint, draft direction);
- PRESERVED: nothing rejects, and with confidence 1 - alpha (one-sided bounds, Bonferroni over
  the positions and the joint) the prefix-averaged next-token TV of every position and the
  joint's TV are within the tolerance;
- INCONCLUSIVE otherwise, with about how many samples would do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy import stats as st

from specaudit import fixtures, stats
from specaudit.distribution.render import fmt_gof_p, p_eq
from specaudit.distribution.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOLERANCE,
    EVIDENCE_KEPT,
    ContextResult,
    DirectedPower,
    DistError,
    EngineResult,
    GenericPower,
    ImpossibleOutcome,
    Sample,
    TestResult,
    TokenRow,
    Workload,
)
from specaudit.distribution.truth import Truth, describe, encode_text, stratum_key
from specaudit.stats import GofResult, TvBound, TvInterval, Verdict

POWER = 0.8  # the directed test's minimum detectable TV is at this power
PATH_LIMIT = 50_000  # sample paths enumerated for the directed test's exact null; else normal
PAIR_TOKENS = 2  # outcomes per sample the seed-independence test compares across seeds
# the history and seed tests' Monte-Carlo stops at this many hits (stats.mc_pvalue; exact):
# a p-value in the bulk costs a few hundred draws, an extreme one all of them
NEW_TESTS_STOP_HITS = 100


@dataclass
class Tally:
    """One engine's samples as the analysis needs them, in memory independent of their number.

    `texts` counts the distinct generated texts (outcomes as `truth.encode_text` spells them)
    cut to the `length` tested characters, in order of first appearance (so the analysis sees
    contexts in the same order as over the list of samples); `seeds` keeps the first seed of
    each (the evidence for a forbidden token); the seed range and draft counts are kept as
    running totals.
    """

    length: int
    texts: dict[str, int] = field(default_factory=dict)
    n: int = 0
    first_seed: int | None = None
    last_seed: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    seeds: dict[str, int] = field(default_factory=dict)
    # consecutive seeds (s, s + 1): counts of their first `pair_length` outcomes, and the runs
    # of consecutive seeds drawn kept as intervals (only their ends' outcomes are remembered),
    # so memory stays bounded by the distinct values, not by --seeds
    pair_length: int = 1
    pairs: dict[tuple[str, str], int] = field(default_factory=dict)
    _run_end: dict[int, int] = field(default_factory=dict, repr=False)  # start -> end
    _run_start: dict[int, int] = field(default_factory=dict, repr=False)  # end -> start
    _ends: dict[int, str] = field(default_factory=dict, repr=False)  # run ends' outcomes

    @classmethod
    def of(cls, samples: Iterable[Sample], workload: Workload) -> Tally:
        t = cls(tally_length(workload), pair_length=pair_length(workload))
        for s in samples:
            t.add(s)
        return t

    @property
    def runs(self) -> list[int]:
        """Lengths of the runs of consecutive seeds drawn (seeds 1..N: [N])."""
        return [end - start + 1 for start, end in self._run_end.items()]

    def _pair(self, s: Sample) -> None:
        seed, key = s.seed, s.text[: self.pair_length]
        if seed in self._run_end or seed in self._run_start:
            return  # a seed seen twice pairs once
        left = seed - 1 in self._run_start
        right = seed + 1 in self._run_end
        if left:
            k = (self._ends[seed - 1], key)
            self.pairs[k] = self.pairs.get(k, 0) + 1
        if right:
            k = (key, self._ends[seed + 1])
            self.pairs[k] = self.pairs.get(k, 0) + 1
        start = self._run_start.pop(seed - 1) if left else seed
        end = self._run_end.pop(seed + 1) if right else seed
        self._run_end[start] = end
        self._run_start[end] = start
        self._ends[seed] = key
        for x in (seed - 1, seed, seed + 1):
            if x in self._ends and x != start and x != end:
                del self._ends[x]

    def add(self, s: Sample) -> None:
        self._pair(s)
        key = s.text[: self.length]
        self.texts[key] = self.texts.get(key, 0) + 1
        if key not in self.seeds or s.seed < self.seeds[key]:
            self.seeds[key] = s.seed
        self.n += 1
        self.first_seed = s.seed if self.first_seed is None else min(self.first_seed, s.seed)
        self.last_seed = s.seed if self.last_seed is None else max(self.last_seed, s.seed)
        if s.drafted is not None:
            self.drafted = (self.drafted or 0) + s.drafted
        if s.accepted is not None:
            self.accepted = (self.accepted or 0) + s.accepted


def tally_length(workload: Workload) -> int:
    """Characters of a sample the analysis reads: the tested positions (and the joint)."""
    return max(workload.positions, workload.joint)


def pair_length(workload: Workload) -> int:
    """Outcomes of each sample the seed-independence test pairs across consecutive seeds: the
    first PAIR_TOKENS (more cells see more of a sample, at the cost of sparser tables)."""
    return max(1, min(PAIR_TOKENS, workload.positions))


def _weighted(texts: Sequence[str] | Mapping[str, int]) -> Iterable[tuple[str, int]]:
    if isinstance(texts, Mapping):
        return texts.items()
    return ((t, 1) for t in texts)


def _context_label(prompt: str, prefixes: list[str]) -> str:
    if len(prefixes) == 1:
        return f"{prompt}+{prefixes[0]}" if prefixes[0] else prompt
    lasts = {p[-1] for p in prefixes if p}
    if len(lasts) == 1:
        return f"…{lasts.pop()} ({len(prefixes)} prefixes)"
    return f"{len(prefixes)} prefixes"


def _rows(labels: Sequence[str], counts: np.ndarray, p: np.ndarray) -> list[TokenRow]:
    n = int(counts.sum())
    lo, hi = stats.clopper_pearson(counts, n, 0.05)
    return [
        TokenRow(
            labels[i],
            float(p[i]),
            int(counts[i]),
            counts[i] / n if n else math.nan,
            float(lo[i]),
            float(hi[i]),
        )
        for i in range(len(labels))
        if p[i] > 0 or counts[i] > 0
    ]


def _prefix_counts(
    truth: Truth, texts: Sequence[str] | Mapping[str, int], t: int
) -> dict[str, np.ndarray]:
    """Counts of the outcome at position t (1-based) per generated prefix, in order of first
    appearance. Samples that ended before t, or whose prefix holds an impossible non-letter
    outcome (already counted at its own position), have no position t."""
    out: dict[str, np.ndarray] = {}
    for text, w in _weighted(texts):
        if len(text) < t:
            continue
        prefix = text[: t - 1]
        if not truth.is_prefix(prefix):
            continue
        c = out.get(prefix)
        if c is None:
            c = np.zeros(len(truth.outcomes), dtype=np.int64)
            out[prefix] = c
        c[truth.cell(text[t - 1])] += w
    return out


def _position_strata(
    truth: Truth, texts: Sequence[str] | Mapping[str, int], t: int
) -> dict[tuple[float, ...], tuple[np.ndarray, np.ndarray, dict[str, None]]]:
    """Counts of the token at position t (1-based), grouped by true conditional distribution.

    Contexts with the same true next-token distribution are interchangeable under the null, so
    they are pooled for the tests; the prefixes pooled are kept (in order of appearance).
    """
    groups: dict[tuple[float, ...], tuple[np.ndarray, np.ndarray, dict[str, None]]] = {}
    for prefix, c in _prefix_counts(truth, texts, t).items():
        p = truth.p(prefix)
        k = stratum_key(p)
        g = groups.get(k)
        if g is None:
            g = (np.zeros(len(p), dtype=np.int64), p, {})
            groups[k] = g
        g[0][:] += c
        g[2][prefix] = None
    return groups


def _marginal_counts(truth: Truth, texts: Sequence[str] | Mapping[str, int], t: int) -> np.ndarray:
    counts = np.zeros(len(truth.outcomes), dtype=np.int64)
    for c in _prefix_counts(truth, texts, t).values():
        counts += c
    return counts


def position_tv(
    truth: Truth, texts: Sequence[str] | Mapping[str, int], t: int, alpha: float
) -> TvInterval:
    """TV between the engine's and the target's *marginal* distribution of the token at
    position t (descriptive: a bug confined to some contexts can keep every marginal exact)."""
    marginal = np.append(truth.marginal(t), [0.0, 0.0])  # over `outcomes`
    return stats.tv_interval(_marginal_counts(truth, texts, t), marginal, alpha)


def conditional_bound(
    truth: Truth, texts: Sequence[str] | Mapping[str, int], t: int, alpha: float
) -> TvBound:
    """One-sided (1 - alpha) bound on position t's prefix-averaged next-token TV: the sum over
    generated prefixes c of (n_c / n) TV(engine's next token | c, target's | c), every prefix
    its own context (an engine may treat prefixes the target cannot tell apart differently)."""
    per = _prefix_counts(truth, texts, t)
    return stats.conditional_tv_bound([(c, truth.p(pf)) for pf, c in per.items()], alpha)


def _joint_cells(
    truth: Truth, texts: Sequence[str] | Mapping[str, int], j: int
) -> tuple[list[str], np.ndarray, np.ndarray, int]:
    joint_p = truth.joint(j)
    seqs = sorted(joint_p)
    counts_d: dict[str, int] = {}
    for text, w in _weighted(texts):
        counts_d[text[:j]] = counts_d.get(text[:j], 0) + w
    extra = sorted(s for s in counts_d if s not in joint_p)  # impossible sequences seen
    cells = seqs + extra
    counts = np.array([counts_d.get(s, 0) for s in cells], dtype=np.int64)
    probs = np.array([joint_p.get(s, 0.0) for s in cells])
    return cells, counts, probs / probs.sum(), len(seqs)


def joint_bound(truth: Truth, texts: Sequence[str] | Mapping[str, int], alpha: float) -> TvBound:
    """One-sided (1 - alpha) bound on the TV of the joint of the first `workload.joint`."""
    _, counts, probs, _ = _joint_cells(truth, texts, truth.workload.joint)
    return stats.conditional_tv_bound([(counts, probs)], alpha)


def tv_family(workload: Workload) -> int:
    """How many certified bounds the verdict needs (positions, plus the joint): each is at
    alpha / this, so all hold together with probability 1 - alpha (Bonferroni)."""
    return workload.positions + (1 if workload.joint else 0)


def certified_bounds(
    truth: Truth, texts: Sequence[str] | Mapping[str, int], alpha: float
) -> list[TvBound]:
    """The verdict's bounds, each at alpha / `tv_family`: positions 1.., then the joint."""
    wl = truth.workload
    a = alpha / tv_family(wl)
    out = [conditional_bound(truth, texts, t, a) for t in range(1, wl.positions + 1)]
    if wl.joint:
        out.append(joint_bound(truth, texts, a))
    return out


# ---------------------------------------------------------------------------------------------
# the full history: within-pool homogeneity, and independence across seeds


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


def family_size(truth: Truth) -> int:
    """How many tests `analyze` puts in its Holm family for this fixture and workload: the
    positions, the joint, the draft direction (unless the draft equals the target), the
    history tests, the seed pairs."""
    wl = truth.workload
    directed = 1 if draft_direction(truth).information > 1e-15 else 0
    return wl.positions + (1 if wl.joint else 0) + directed + len(history_positions(truth)) + 1


def history_result(
    truth: Truth,
    texts: Sequence[str] | Mapping[str, int],
    t: int,
    *,
    mc_draws: int = stats.MC_DRAWS,
    mc_stop_hits: int = 0,
    mc_seed: int = 0,
) -> GofResult:
    """Within each pool of position t (prefixes with one true next-token distribution), is the
    token independent of the full prefix? `stats.homogeneity_test` over the pools."""
    tables: dict[tuple[float, ...], tuple[list[np.ndarray], np.ndarray]] = {}
    for prefix, c in _prefix_counts(truth, texts, t).items():
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
    tally: Tally,
    *,
    mc_draws: int = stats.MC_DRAWS,
    mc_stop_hits: int = 0,
    mc_seed: int = 0,
) -> GofResult:
    """Are consecutive seeds' samples independent? The G test of independence of the pairs
    (first `tally.pair_length` outcomes at seed s, at seed s + 1), against chains of the same
    lengths drawn from the closed form (`stats.pair_independence_test`). Pairs holding an
    outcome of probability 0 are left out (the position tests report those)."""
    j = tally.pair_length
    if j == 1:
        p = truth.p("")
        support = np.flatnonzero(p > 0)
        probs = p[support]
        cell_of = {int(c): k for k, c in enumerate(support)}
        index = {a: cell_of.get(truth.cell(a)) for pair in tally.pairs for a in pair if a}
    else:
        joint = truth.joint(j)
        seqs = sorted(joint)
        probs = np.array([joint[x] for x in seqs])
        index = {x: k for k, x in enumerate(seqs)}
    table = np.zeros((len(probs), len(probs)), dtype=np.int64)
    for (a, b), w in tally.pairs.items():
        ia, ib = index.get(a), index.get(b)
        if ia is not None and ib is not None:
            table[ia, ib] += w
    return stats.pair_independence_test(
        table,
        tally.runs,
        probs / probs.sum(),
        mc_draws=mc_draws,
        mc_stop_hits=mc_stop_hits or NEW_TESTS_STOP_HITS,
        seed=mc_seed,
    )


# ---------------------------------------------------------------------------------------------
# the directed test: leakage toward the draft


def draft_score(truth: Truth, prefix: str, cell: int) -> float:
    """One token's draft-direction score d~(x)/p(x) - 1 after `prefix` (d~: the draft's
    distribution restricted to the target's support, renormalised; mean 0 under the target,
    >= -1). The token must be possible after `prefix`."""
    p = truth.p(prefix)
    d = truth.draft_p(prefix)
    support = p > 0
    mass = float(d[support].sum())
    if mass <= 0:
        return 0.0
    return float(d[cell] / mass / p[cell] - 1.0)


class DraftDirection:
    """The draft-leakage alternative p_lambda = p + lambda (d~ - p) after every prefix, with d~
    the draft's next-token distribution (same sampler) restricted to the target's support and
    renormalised (mass the draft puts outside it would be an impossible token: certain BROKEN).

    One sample's score at lambda = 0 is U = sum over tested positions of d~(x_t)/p(x_t) - 1,
    mean 0 under the target; the total over n independent samples is the test statistic. Its
    exact null is that of a sum of n independent copies of one sample's U, whose distribution
    is the enumeration of the sample paths (`paths`). States merge prefixes the fixture cannot
    tell apart (`FixtureSpec.state_key`), as `Truth.marginal` does.
    """

    def __init__(self, truth: Truth) -> None:
        self.truth = truth
        wl = truth.workload
        self.positions = wl.positions
        prompt = wl.prompt
        # per position: states (representative prefix), their per-token arrays, children
        self.levels: list[list[_State]] = []
        index: dict[str, int] = {truth.spec.state_key(prompt): 0}
        reps = [""]
        counts = [1]  # sample paths reaching each state
        self.n_paths = 0
        for t in range(1, self.positions + 1):
            level = [self._state(rep) for rep in reps]
            self.levels.append(level)
            if t == self.positions:
                self.n_paths = sum(c * len(s.support) for c, s in zip(counts, level, strict=True))
                break
            index = {}
            nxt_reps: list[str] = []
            nxt_counts: list[int] = []
            for st_, c in zip(level, counts, strict=True):
                kids = []
                for j in st_.support:
                    tok = truth.outcomes[j]
                    if tok not in truth.spec.letters:
                        raise DistError(f"special token {tok!r} is possible: generation may stop")
                    longer = st_.prefix + tok
                    key = truth.spec.state_key(prompt + longer)
                    k = index.get(key)
                    if k is None:
                        k = len(nxt_reps)
                        index[key] = k
                        nxt_reps.append(longer)
                        nxt_counts.append(0)
                    nxt_counts[k] += c
                    kids.append(k)
                st_.children = kids
            reps, counts = nxt_reps, nxt_counts
        self.information = float(self.moments(0.0)[1] ** 2)
        self.contexts = sum(1 for level in self.levels for s in level if s.chi2 > 1e-12)

    def _state(self, prefix: str) -> _State:
        p = self.truth.p(prefix)
        d = self.truth.draft_p(prefix)
        support = np.flatnonzero(p > 0)
        ps = p[support]
        mass = float(d[support].sum())
        dt = d[support] / mass if mass > 0 else ps.copy()
        u = dt / ps - 1.0
        return _State(
            prefix=prefix,
            support=support,
            p=ps,
            dt=dt,
            u=u,
            chi2=float(np.sum(dt * dt / ps) - 1.0),
            tv=0.5 * float(np.abs(dt - ps).sum()),
        )

    def score(self, prefix: str, cell: int) -> float:
        """One token's score d~(x)/p(x) - 1 (the token must be possible after `prefix`)."""
        return draft_score(self.truth, prefix, cell)

    def _forward(self, lam: float) -> tuple[float, float, list[float]]:
        """(mean, variance of one sample's score, prefix-averaged TV per position) under
        p_lambda; the variance sums the conditional variances (exact at lambda = 0, where the
        scores are martingale differences; first order in lambda otherwise)."""
        w = np.ones(1)
        mean = var = 0.0
        tvs: list[float] = []
        for t, level in enumerate(self.levels, start=1):
            tv_t = 0.0
            nxt = np.zeros(len(self.levels[t]) if t < len(self.levels) else 0)
            for wi, s in zip(w, level, strict=True):
                q = s.p + lam * (s.dt - s.p)
                m = lam * s.chi2
                mean += wi * m
                var += wi * (float(q @ (s.u * s.u)) - m * m)
                tv_t += wi * lam * s.tv
                if t < len(self.levels):
                    for qj, k in zip(q, s.children, strict=True):
                        nxt[k] += wi * qj
            tvs.append(tv_t)
            w = nxt
        return mean, var, tvs

    def moments(self, lam: float) -> tuple[float, float]:
        mean, var, _ = self._forward(lam)
        return mean, math.sqrt(max(var, 0.0))

    def tv(self, lam: float) -> list[float]:
        """Prefix-averaged next-token TV from the target at each position under p_lambda."""
        return [float(x) for x in self._forward(lam)[2]]

    @functools.cached_property
    def paths(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(score, null probability) of every sample path over the tested positions; None if
        there are more than PATH_LIMIT."""
        if self.n_paths > PATH_LIMIT:
            return None
        vals = np.zeros(1)
        probs = np.ones(1)
        where = np.zeros(1, dtype=np.int64)  # state index of each partial path
        for t, level in enumerate(self.levels, start=1):
            nv, np_, nw = [], [], []
            for v, pr, k in zip(vals, probs, where, strict=True):
                s = level[k]
                nv.append(v + s.u)
                np_.append(pr * s.p)
                nw.append(np.asarray(s.children if t < len(self.levels) else [0] * len(s.p)))
            vals = np.concatenate(nv)
            probs = np.concatenate(np_)
            where = np.concatenate(nw).astype(np.int64)
        return vals, probs

    def power(self, n: int, level: float) -> DirectedPower:
        sd0 = math.sqrt(self.information)
        lam = stats.min_detectable_shift(n, sd0, self.moments, level, POWER)
        tvs = self.tv(lam) if lam is not None else []
        return DirectedPower(
            n=n,
            level=level,
            power=POWER,
            lambda_=lam,
            tv=max(tvs) if tvs else None,
            tv_by_position=tvs,
            information=self.information,
        )


@dataclass
class _State:
    prefix: str  # a generated prefix in this state
    support: np.ndarray  # cells the target allows
    p: np.ndarray  # target probabilities on the support
    dt: np.ndarray  # the draft's, restricted to the support and renormalised
    u: np.ndarray  # score of each supported token: dt / p - 1
    chi2: float  # chi-square divergence of dt from p: the score's variance
    tv: float  # TV(dt, p)
    children: list[int] = field(default_factory=list)  # next position's state per token


@functools.lru_cache(maxsize=16)
def _direction(spec: fixtures.FixtureSpec, workload: Workload) -> DraftDirection:
    return DraftDirection(Truth(spec, workload))


def draft_direction(truth: Truth) -> DraftDirection:
    """The draft-leakage alternative of a fixture and workload (cached)."""
    return _direction(truth.spec, truth.workload)


def directed_result(
    truth: Truth,
    texts: Mapping[str, int],
    n: int,
    impossible: bool,
    *,
    mc_draws: int = stats.MC_DRAWS,
    mc_stop_hits: int = 0,
    mc_seed: int = 0,
) -> tuple[GofResult, DraftDirection]:
    """The score test toward the draft over every tested position and context, one statistic."""
    dd = draft_direction(truth)
    if impossible:
        return GofResult(math.inf, 1, 0.0, "impossible", n, dd.contexts, 0.0, 0), dd
    total = 0.0
    for text, w in texts.items():
        u = 0.0
        for t in range(1, dd.positions + 1):
            u += dd.score(text[: t - 1], truth.cell(text[t - 1]))
        total += w * u
    paths = dd.paths
    if paths is None:
        z = total / math.sqrt(n * dd.information) if dd.information > 0 else 0.0
        if dd.information <= 1e-15:
            return GofResult(0.0, 1, 1.0, "trivial", n, dd.contexts, math.inf), dd
        p = max(float(st.norm.sf(z)), stats.TINY_P)
        return GofResult(z, 1, p, "normal", n, dd.contexts, math.inf), dd
    vals, probs = paths
    gof = stats.directed_test(
        total, n, vals, probs, contexts=dd.contexts, mc_draws=mc_draws,
        mc_stop_hits=mc_stop_hits, seed=mc_seed,
    )  # fmt: skip
    return gof, dd


# ---------------------------------------------------------------------------------------------
# the analysis


def analyze(
    spec: fixtures.FixtureSpec,
    workload: Workload,
    samples: Sequence[Sample] | Tally,
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    engine: str = "engine",
    kind: str = "url",
    seconds: float = 0.0,
    mc_seed: int = 0,
    mc_draws: int = stats.MC_DRAWS,
    mc_stop_hits: int = 0,
) -> EngineResult:
    """Test samples against the fixture's closed-form distributions (fixed-sample analysis).

    `samples`: the samples (their texts are encoded with `encode_text`: a short output, a
    special token or a character outside the fixture are outcomes of probability 0), or their
    `Tally` of encoded texts; the result is the same. `mc_draws`: simulations per Monte-Carlo
    p-value (any number keeps them valid; fewer only coarsens them); `mc_stop_hits` > 0 makes
    the family's Monte-Carlo p-values sequential (`stats.mc_pvalue`), so a large `mc_draws`
    (a floor below a small level) costs little where the evidence is weak.
    """
    if isinstance(samples, Tally):
        tally = samples
    else:
        tally = Tally.of(
            (replace(s, text=encode_text(s.text, workload.tokens, spec)) for s in samples),
            workload,
        )
    if not tally.n:
        raise DistError(f"{engine}: no samples to analyse")
    if tally.length < tally_length(workload):
        raise DistError(f"{engine}: the tally keeps {tally.length} characters, too few")
    truth = Truth(spec, workload)
    texts = tally.texts
    tests: list[TestResult] = []
    contexts: list[ContextResult] = []
    headline: list[ContextResult] = []
    bounds = certified_bounds(truth, texts, alpha)
    evidence = _evidence(truth, tally)
    for t in range(1, workload.positions + 1):
        groups = _position_strata(truth, texts, t)
        strata = [(c, p) for c, p, _ in groups.values()]
        gof = stats.stratified_gof(
            strata, seed=mc_seed + t, mc_draws=mc_draws, mc_stop_hits=mc_stop_hits
        )
        tv = position_tv(truth, texts, t, alpha)
        n = int(sum(c.sum() for c, _ in strata))
        tests.append(
            TestResult(
                f"position {t}", "position", t, n, len(strata), gof, 1.0, tv, False, bounds[t - 1]
            )
        )
        want = truth.most_likely_prefix(t - 1) if t <= 3 else None
        for counts, p, pref in sorted(groups.values(), key=lambda g: -int(g[0].sum())):
            prefixes = list(pref)
            ctx = ContextResult(
                position=t,
                label=_context_label(workload.prompt, prefixes),
                prefixes=sorted(prefixes)[:8],
                n=int(counts.sum()),
                tokens=_rows(truth.outcomes, counts, p),
                gof=stats.multinomial_gof(
                    counts, p, seed=mc_seed + 100 * t, mc_draws=mc_draws, mc_stop_hits=mc_stop_hits
                ),
                tv=stats.tv_interval(counts, p, alpha),
            )
            contexts.append(ctx)
            if want is not None and want in prefixes:
                ctx.label = f"{workload.prompt}+{want}" if want else workload.prompt
                if len(prefixes) > 1:
                    ctx.label += f" (+{len(prefixes) - 1} alike)"
                headline.append(ctx)
    if workload.joint:
        j = workload.joint
        _, counts, probs, n_seqs = _joint_cells(truth, texts, j)
        gof = stats.multinomial_gof(
            counts, probs, seed=mc_seed + 1000, mc_draws=mc_draws, mc_stop_hits=mc_stop_hits
        )
        tv = stats.tv_interval(counts, probs, alpha)
        tests.append(
            TestResult(
                f"joint 1-{j}", "joint", 0, int(counts.sum()), n_seqs, gof, 1.0, tv, False,
                bounds[-1],
            )
        )  # fmt: skip
    # each generated token is in exactly one position test
    impossible = sum(x.gof.impossible for x in tests if x.kind == "position")
    dgof, dd = directed_result(
        truth, texts, tally.n, impossible > 0, mc_draws=mc_draws, mc_stop_hits=mc_stop_hits,
        mc_seed=mc_seed + 2000,
    )  # fmt: skip
    if dgof.method != "trivial":  # a draft equal to the target has no direction to test
        tests.append(
            TestResult(
                "draft direction", "directed", 0, tally.n, dd.contexts, dgof, 1.0,
                _directed_tv(dd, dgof, tally.n, alpha), False,
            )
        )  # fmt: skip
    # the full history: within each pool, is the token independent of the prefix?
    for t in history_positions(truth):
        hgof = history_result(
            truth, texts, t, mc_draws=mc_draws, mc_stop_hits=mc_stop_hits,
            mc_seed=mc_seed + 3000 + t,
        )  # fmt: skip
        tests.append(
            TestResult(
                f"history {t}", "history", t, hgof.n, hgof.n_strata, hgof, 1.0,
                TvInterval(bounds[t - 1].estimate, 0.0, 1.0, 1 - alpha), False,
            )
        )  # fmt: skip
    # independence across consecutive seeds
    sgof = seed_pair_result(
        truth, tally, mc_draws=mc_draws, mc_stop_hits=mc_stop_hits, mc_seed=mc_seed + 4000
    )
    tests.append(
        TestResult(
            "seed pairs", "seeds", 0, sgof.n, len(tally.runs), sgof, 1.0,
            TvInterval(math.nan, 0.0, 1.0, 1 - alpha), False,
        )
    )  # fmt: skip
    adj = stats.holm([x.gof.p_value for x in tests])
    for x, pa in zip(tests, adj, strict=True):
        x.p_holm = pa
        x.rejected = pa < alpha
    uppers = [b.upper for b in bounds]
    verdict = stats.decide(adj, alpha, uppers, tolerance, impossible > 0)
    worst = max(uppers)
    needed = stats.samples_needed(tally.n, worst, tolerance)
    power = dd.power(tally.n, alpha / len(tests)) if dgof.method != "trivial" else None
    generic = generic_power(tests, workload, tally.n, alpha / len(tests))
    seq_bound = sequence_bound(truth, texts, tally.n, alpha)
    reason = _reason(
        verdict, tests, bounds, alpha, tolerance, impossible, evidence, workload, needed, spec
    )
    if not impossible:
        reason += "; " + power_sentence(generic, workload)
        if verdict is Verdict.PRESERVED:
            reason += (
                f"; the whole tested sequence (positions 1-{workload.positions}) has TV <= "
                f"{seq_bound:.3f} (one-sided, at {1 - alpha:.4g})"
            )
    assert tally.first_seed is not None and tally.last_seed is not None
    return EngineResult(
        engine=engine,
        kind=kind,
        verdict=verdict,
        alpha=alpha,
        tolerance=tolerance,
        n_samples=tally.n,
        first_seed=tally.first_seed,
        last_seed=tally.last_seed,
        drafted=tally.drafted,
        accepted=tally.accepted,
        tests=tests,
        contexts=contexts,
        headline=headline,
        impossible=impossible,
        reason=reason,
        seconds=seconds,
        evidence=evidence,
        tv_bound=worst,
        samples_needed=needed if verdict is Verdict.INCONCLUSIVE else None,
        directed=power,
        power=generic,
        sequence_tv_bound=seq_bound,
    )


def generic_power(
    tests: Sequence[TestResult], workload: Workload, n: int, level: float
) -> GenericPower:
    """The TV each position's tests (pooled and within-pool), the whole sequence's and the
    joint's see with POWER whatever the direction (`stats.detectable_tv`), at `level` (alpha
    over the Holm family: Holm's first step), from the degrees of freedom the tests had."""
    by_pos: list[float | None] = []
    every: list[int] = []
    for t in range(1, workload.positions + 1):
        dfs = [x.gof.df for x in tests if x.position == t and x.kind in ("position", "history")]
        every += dfs
        by_pos.append(stats.detectable_tv(n, dfs, level, POWER))
    joint = [x.gof.df for x in tests if x.kind == "joint"]
    return GenericPower(
        n=n,
        level=level,
        power=POWER,
        tv_by_position=by_pos,
        tv_sequence=stats.detectable_tv(n, every, level, POWER, parts=workload.positions),
        tv_joint=stats.detectable_tv(n, joint, level, POWER) if joint else None,
    )


def power_sentence(g: GenericPower, workload: Workload) -> str:
    """'80% power against any deviation of prefix-averaged next-token TV >= .08/.09/.. at
    positions 1-4, of the whole sequence's TV >= .35'."""

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    out = (
        f"{g.power:.0%} power against any deviation of prefix-averaged next-token TV >= "
        f"{'/'.join(f(x) for x in g.tv_by_position)} at positions 1-{workload.positions}"
    )
    if g.tv_joint is not None:
        out += f", of joint (1-{workload.joint}) TV >= {f(g.tv_joint)}"
    return out + f", of the whole tested sequence's TV >= {f(g.tv_sequence)}"


def sequence_bound(
    truth: Truth, texts: Sequence[str] | Mapping[str, int], n: int, alpha: float
) -> float:
    """One-sided (1 - alpha) bound on the TV of the whole tested sequence's distribution
    (`stats.sequence_tv_bound` over the positions' bounds at alpha / (2 positions))."""
    pos = truth.workload.positions
    uppers = [
        conditional_bound(truth, texts, t, alpha / (2 * pos)).upper for t in range(1, pos + 1)
    ]
    return stats.sequence_tv_bound(uppers, n, alpha)


def _directed_tv(dd: DraftDirection, gof: GofResult, n: int, alpha: float) -> TvInterval:
    """Descriptive: the TV toward the draft that the score estimates (one-step estimate of
    lambda, clipped to [0, 1]), in an uninformative [0, 1] interval (the test, not this
    number, is the evidence)."""
    if gof.method == "impossible" or dd.information <= 0 or not math.isfinite(gof.statistic):
        return TvInterval(1.0 if gof.method == "impossible" else 0.0, 0.0, 1.0, 1 - alpha)
    lam = min(1.0, max(0.0, gof.statistic / math.sqrt(n * dd.information)))
    return TvInterval(max(dd.tv(lam)) if lam > 0 else 0.0, 0.0, 1.0, 1 - alpha)


def _evidence(truth: Truth, tally: Tally) -> list[ImpossibleOutcome]:
    """Every forbidden (position, prefix, token) seen at a tested position, first seeds first."""
    found: dict[tuple[int, str, str], tuple[int, int]] = {}
    for text, w in tally.texts.items():
        for t in range(1, min(len(text), truth.workload.positions) + 1):
            prefix = text[: t - 1]
            if not truth.is_prefix(prefix):
                break
            ch = text[t - 1]
            if truth.p(prefix)[truth.cell(ch)] > 0:
                continue
            key = (t, prefix, ch)
            seed = tally.seeds.get(text, 0)
            prev = found.get(key)
            found[key] = (min(prev[0], seed), prev[1] + w) if prev else (seed, w)
    rows = [
        ImpossibleOutcome(seed, t, prefix, describe(ch, truth.spec), count)
        for (t, prefix, ch), (seed, count) in found.items()
    ]
    rows.sort(key=lambda r: (r.seed, r.position))
    return rows[:EVIDENCE_KEPT]


def evidence_sentence(e: ImpossibleOutcome, prompt: str, spec: fixtures.FixtureSpec) -> str:
    """'seed 17: '</s>' at position 2 after bcdbc+f'."""
    after = f"{prompt}+{e.prefix}" if e.prefix else prompt
    what = "the output ended" if e.token == "<end>" else f"{e.token!s}"
    out = f"seed {e.seed}: {what} at position {e.position} after {after}"
    if e.token.startswith("'") or e.token == "<other>":
        out += f" (not a token of fixture {spec.name}: is the engine running it?)"
    return out


def _p_words(g: GofResult) -> str:
    """'= 0.0042', '< 1e-300' or '~ 1e-1381' (the exact test's log-space tail)."""
    f = fmt_gof_p(g)
    return f"~ {f[1:]}" if f.startswith("~") else p_eq(g.p_value)


def _reason(
    verdict: Verdict,
    tests: list[TestResult],
    bounds: list[TvBound],
    alpha: float,
    tolerance: float,
    impossible: int,
    evidence: list[ImpossibleOutcome],
    workload: Workload,
    needed: int,
    spec: fixtures.FixtureSpec,
) -> str:
    m = len(tests)
    if impossible:
        seen = evidence_sentence(evidence[0], workload.prompt, spec) if evidence else "?"
        return (
            f"{impossible} sampled token(s) have true probability 0 under the sampler "
            f"({seen}): broken with certainty, p = 0"
        )
    if verdict is Verdict.BROKEN:
        top = min(tests, key=lambda x: x.p_holm)
        return (
            f"{top.name} rejects: p {_p_words(top.gof)} "
            f"(Holm over {m}: p {p_eq(top.p_holm)}), alpha {alpha:g}"
        )
    pos = bounds[: workload.positions]
    joint = bounds[workload.positions :]
    worst_pos = max(b.upper for b in pos)
    conf = f"{1 - alpha:.4g}"
    what = f"prefix-averaged next-token TV <= {worst_pos:.3f} at every position"
    if joint:
        what += f", joint TV (1-{workload.joint}) <= {joint[0].upper:.3f}"
    if verdict is Verdict.PRESERVED:
        return (
            f"no test rejects at {alpha:g} (Holm over {m}); {what} "
            f"(one-sided, together at {conf}; tolerance {tolerance:g})"
        )
    worst = max(bounds, key=lambda b: b.upper)
    i = bounds.index(worst)
    name = f"joint 1-{workload.joint}" if i >= workload.positions else f"position {i + 1}"
    tail = (
        f"more samples needed, about {needed} samples in all if what remains is sampling noise "
        "(the bounds and the plug-in's bias shrink like 1/sqrt(n))"
    )
    return (
        f"no test rejects at {alpha:g} (Holm over {m}), but {name}'s TV up to "
        f"{worst.upper:.3f} is not ruled out (tolerance {tolerance:g}): {tail}"
    )


__all__ = [
    "PAIR_TOKENS",
    "POWER",
    "family_size",
    "generic_power",
    "history_positions",
    "history_result",
    "pair_length",
    "power_sentence",
    "seed_pair_result",
    "sequence_bound",
    "DraftDirection",
    "Tally",
    "analyze",
    "certified_bounds",
    "conditional_bound",
    "directed_result",
    "draft_score",
    "draft_direction",
    "evidence_sentence",
    "joint_bound",
    "position_tv",
    "tally_length",
    "tv_family",
]
