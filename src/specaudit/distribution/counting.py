"""One engine's samples counted, and the tables the tests read from the counts.

Samples are kept as `OutcomeCounts`: counts of the distinct generated texts (cut to the tested
positions), never a list of samples, so memory depends on how many *different* texts came
back (at most letters^positions), not on --seeds. Every table below reads texts either as a
list or as such counts (text -> weight); the results are the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from specaudit.distribution.results import Sample, Workload
from specaudit.distribution.truth import Truth, stratum_key

PAIR_TOKENS = 2  # outcomes per sample the seed-independence test compares across seeds

# a list of encoded texts, or the distinct ones with their counts
Texts: TypeAlias = Sequence[str] | Mapping[str, int]


@dataclass
class OutcomeCounts:
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
    def of(cls, samples: Iterable[Sample], workload: Workload) -> OutcomeCounts:
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


def weighted(texts: Texts) -> Iterable[tuple[str, int]]:
    if isinstance(texts, Mapping):
        return texts.items()
    return ((t, 1) for t in texts)


def prefix_counts(truth: Truth, texts: Texts, t: int) -> dict[str, np.ndarray]:
    """Counts of the outcome at position t (1-based) per generated prefix, in order of first
    appearance. Samples that ended before t, or whose prefix holds an impossible non-letter
    outcome (already counted at its own position), have no position t."""
    out: dict[str, np.ndarray] = {}
    for text, w in weighted(texts):
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


def position_strata(
    truth: Truth, texts: Texts, t: int
) -> dict[tuple[float, ...], tuple[np.ndarray, np.ndarray, dict[str, None]]]:
    """Counts of the token at position t (1-based), grouped by true conditional distribution.

    Contexts with the same true next-token distribution are interchangeable under the null, so
    they are pooled for the tests; the prefixes pooled are kept (in order of appearance).
    """
    groups: dict[tuple[float, ...], tuple[np.ndarray, np.ndarray, dict[str, None]]] = {}
    for prefix, c in prefix_counts(truth, texts, t).items():
        p = truth.p(prefix)
        k = stratum_key(p)
        g = groups.get(k)
        if g is None:
            g = (np.zeros(len(p), dtype=np.int64), p, {})
            groups[k] = g
        g[0][:] += c
        g[2][prefix] = None
    return groups


def marginal_counts(truth: Truth, texts: Texts, t: int) -> np.ndarray:
    counts = np.zeros(len(truth.outcomes), dtype=np.int64)
    for c in prefix_counts(truth, texts, t).values():
        counts += c
    return counts


def joint_cells(
    truth: Truth, texts: Texts, j: int
) -> tuple[list[str], np.ndarray, np.ndarray, int]:
    joint_p = truth.joint(j)
    seqs = sorted(joint_p)
    counts_d: dict[str, int] = {}
    for text, w in weighted(texts):
        counts_d[text[:j]] = counts_d.get(text[:j], 0) + w
    extra = sorted(s for s in counts_d if s not in joint_p)  # impossible sequences seen
    cells = seqs + extra
    counts = np.array([counts_d.get(s, 0) for s in cells], dtype=np.int64)
    probs = np.array([joint_p.get(s, 0.0) for s in cells])
    return cells, counts, probs / probs.sum(), len(seqs)


__all__ = [
    "PAIR_TOKENS",
    "OutcomeCounts",
    "Texts",
    "joint_cells",
    "marginal_counts",
    "pair_length",
    "position_strata",
    "prefix_counts",
    "tally_length",
    "weighted",
]
