"""Sequential analysis: stop as soon as the evidence is decisive.

An anytime-valid e-process decides BROKEN; alpha-spending TV bounds at looks 25, 50, 100, ...
samples decide PRESERVED. Memory is bounded whatever the number of samples: the e-process and
one count per (position, token) are all that is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specaudit import fixtures, stats
from specaudit.dist.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOLERANCE,
    Sample,
    SequentialResult,
    Workload,
)
from specaudit.dist.truth import Truth, stratum_key
from specaudit.stats import Verdict

SEQUENTIAL_FIRST_LOOK = 25  # interim TV looks at 25, 50, 100, 200, ... samples


def replay_sequential(
    spec: fixtures.FixtureSpec,
    workload: Workload,
    samples: Sequence[Sample],
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[Verdict, SequentialResult]:
    """The sequential procedure run over samples already drawn (in their order)."""
    seq = Sequential(Truth(spec, workload), workload, alpha, tolerance, len(samples))
    for s in samples:
        if seq.add(s):
            break
    return seq.verdict, seq.result(len(samples))


class Sequential:
    """Anytime-valid stopping: e-process for BROKEN, alpha-spending TV bounds for PRESERVED."""

    def __init__(
        self, truth: Truth, workload: Workload, alpha: float, tolerance: float, max_samples: int
    ) -> None:
        self.truth = truth
        self.workload = workload
        self.alpha = alpha
        self.tolerance = tolerance
        self.max_samples = max_samples
        self.eproc = stats.EProcess()
        # counts of each token at each tested position (the TV bounds' data)
        self.counts = np.zeros((workload.positions, len(truth.labels)), dtype=np.int64)
        self.looks = 0
        self.next_look = SEQUENTIAL_FIRST_LOOK
        self.tv_uppers: list[float] = []
        self.verdict = Verdict.INCONCLUSIVE
        self.decided_by = "max-samples"
        self.used = 0

    def add(self, s: Sample) -> bool:
        for t in range(1, self.workload.positions + 1):
            p = self.truth.next(s.text[: t - 1])
            tok = self.truth.index[s.text[t - 1]]
            self.eproc.update((t, stratum_key(p)), p, tok)
            self.counts[t - 1, tok] += 1
        self.used += 1
        n = self.used
        if self.eproc.rejects(self.alpha):
            self.verdict, self.decided_by = Verdict.BROKEN, "e-value"
            return True
        if n >= self.next_look or n >= self.max_samples:
            self.looks += 1
            self.next_look *= 2
            a = stats.alpha_spending(self.looks, self.alpha)
            self.tv_uppers = [
                stats.tv_interval(self.counts[t - 1], self.truth.marginal(t), a).upper
                for t in range(1, self.workload.positions + 1)
            ]
            if all(u <= self.tolerance for u in self.tv_uppers):
                self.verdict, self.decided_by = Verdict.PRESERVED, "tv-bound"
                return True
        return False

    def result(self, drawn: int) -> SequentialResult:
        return SequentialResult(
            decided_by=self.decided_by,
            samples_used=self.used,
            samples_drawn=drawn,
            log_e_value=self.eproc.log_e,
            e_threshold=1.0 / self.alpha,
            looks=self.looks,
            tv_uppers=self.tv_uppers,
        )

    def reason(self) -> str:
        n = self.used
        if self.decided_by == "e-value":
            if self.eproc.impossible:
                return f"a token with true probability 0 after {n} samples: broken with certainty"
            return (
                f"e-value {self.eproc.e_value:.3g} >= 1/alpha = {1 / self.alpha:g} after {n} "
                "samples (anytime-valid)"
            )
        if self.decided_by == "tv-bound":
            return (
                f"after {n} samples every position's next-token TV <= "
                f"{max(self.tv_uppers):.3f} (alpha-spending bound, tolerance {self.tolerance:g}); "
                f"e-value {self.eproc.e_value:.3g} < {1 / self.alpha:g}"
            )
        return (
            f"{n} samples (the maximum) without a decision: e-value {self.eproc.e_value:.3g} < "
            f"{1 / self.alpha:g}, TV up to {max(self.tv_uppers or [1.0]):.3f} not ruled out"
        )


__all__ = ["SEQUENTIAL_FIRST_LOOK", "Sequential", "replay_sequential"]
