"""The reference sampled as if it were the engine: the same seeds, the same sampler, the same
number of tokens. Two uses.

**A control arm.** The reference's own samples go through the same re-scoring and the same
test as the engine's. On an exact reference they are a null run and their verdict is a check
of the test itself; on a quantised model whose probabilities move with the batch shape (a
generation is evaluated in other shapes than a one-token re-scoring request) they measure the
noisy null on the very model and prompts the user runs: an engine's BROKEN is only as strong as
its control's PRESERVED beside it.

**Same-seed coupling.** An engine that samples the target's token and then matches the draft
against it (llama.cpp's greedy draft path, MTP and EAGLE3 with greedy drafts, the n-gram
types) draws every token from the same seeded generator as a plain server does, so when it is
correct its sample at seed s is the reference's own generation at seed s, token for token.
Divergence from it is evidence of a bug whatever its direction, including one whose direction
changes from prefix to prefix and cancels in every marginal test (a stale context after the
first rejection). A correct engine still diverges where the two evaluate the same prefix in
different batch shapes and float rounding moves a draw across a boundary; the reference's
divergence from itself, asked again at the same seeds, is that rate, and the test compares the
two (Fisher's exact test, one-sided). Only engines that sample and match are coupled: one that
uses the generator for acceptance draws (rejection sampling) diverges by design, so the test
is asked for (`--coupling`), never assumed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from scipy import stats

from specaudit.rescore.sampling import SeededGeneration

CONTROL_REPEATS = 64  # samples the reference is asked twice for its self-divergence


@dataclass(frozen=True)
class Coupling:
    """Engine against reference at the same seeds, and the reference against itself.

    `diverged`: samples whose token ids differ from the reference's at the same (seed,
    prompt); `first`: the position of the first difference -> how many; `p_value`: Fisher's
    exact test that the engine diverges more often than the reference from itself."""

    samples: int
    diverged: int
    control_samples: int
    control_diverged: int
    p_value: float
    first: dict[int, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.diverged / self.samples if self.samples else 0.0

    @property
    def control_rate(self) -> float:
        return self.control_diverged / self.control_samples if self.control_samples else 0.0

    def summary(self) -> str:
        where = ", ".join(f"position {k}: {v}" for k, v in sorted(self.first.items())[:4])
        return (
            f"{self.diverged} of {self.samples} samples differ from the reference's own at the "
            f"same seed ({where or 'none'}); the reference differs from itself in "
            f"{self.control_diverged} of {self.control_samples} (Fisher p = {self.p_value:.2g})"
        )


def _key(g: SeededGeneration) -> tuple[int, int]:
    return (g.seed, g.prompt)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two generations differ (a shorter one differs where it
    ends), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def couple(
    engine: Sequence[SeededGeneration],
    reference: Sequence[SeededGeneration],
    again: Sequence[SeededGeneration],
) -> Coupling:
    """Compare the engine's samples with the reference's at the same (seed, prompt), and the
    reference's with `again` (the reference asked a second time, some of the same seeds)."""
    ref = {_key(g): g.ids for g in reference}
    firsts: Counter[int] = Counter()
    samples = 0
    for g in engine:
        if _key(g) not in ref:
            continue
        samples += 1
        pos = first_difference(g.ids, ref[_key(g)])
        if pos is not None:
            firsts[pos] += 1
    pairs = [(g.ids, ref[_key(g)]) for g in again if _key(g) in ref]
    control = sum(first_difference(a, b) is not None for a, b in pairs)
    diverged = sum(firsts.values())
    p = 1.0
    if samples and pairs:
        table = [[diverged, samples - diverged], [control, len(pairs) - control]]
        p = float(stats.fisher_exact(table, alternative="greater").pvalue)
    return Coupling(samples, diverged, len(pairs), control, p, dict(firsts))


__all__ = ["CONTROL_REPEATS", "Coupling", "couple", "first_difference"]
