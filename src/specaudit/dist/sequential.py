"""Sequential analysis: stop as soon as the evidence is decisive.

An anytime-valid e-process decides BROKEN; alpha-spending TV bounds at looks 25, 50, 100, ...
samples decide WITHIN TOLERANCE: the prefix-averaged next-token TV of every position and the
joint's TV are certified within the tolerance, but an early stop does not claim that smaller
deviations would have shown (the fixed-sample test at --seeds would see TV 0.05 where the
sequential one stops at 200 samples), so it never says PRESERVED. Memory is bounded whatever
the number of samples: the e-process and the tally of distinct texts are all that is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from specaudit import fixtures, stats
from specaudit.dist.analysis import Tally, certified_bounds, evidence_sentence
from specaudit.dist.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOLERANCE,
    EVIDENCE_KEPT,
    ImpossibleOutcome,
    Sample,
    SequentialResult,
    Workload,
)
from specaudit.dist.truth import Truth, describe, encode_text, stratum_key
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
        if seq.add(replace(s, text=encode_text(s.text, workload.tokens, spec))):
            break
    return seq.verdict, seq.result(len(samples))


class Sequential:
    """Anytime-valid stopping: e-process for BROKEN, alpha-spending TV bounds for WITHIN
    TOLERANCE. Samples must be encoded (`truth.encode_text`)."""

    def __init__(
        self, truth: Truth, workload: Workload, alpha: float, tolerance: float, max_samples: int
    ) -> None:
        self.truth = truth
        self.workload = workload
        self.alpha = alpha
        self.tolerance = tolerance
        self.max_samples = max_samples
        self.eproc = stats.EProcess()
        self.tally = Tally.of((), workload)  # the TV bounds' data (distinct texts only)
        self.evidence: list[ImpossibleOutcome] = []
        self.looks = 0
        self.next_look = SEQUENTIAL_FIRST_LOOK
        self.tv_uppers: list[float] = []
        self.verdict = Verdict.INCONCLUSIVE
        self.decided_by = "max-samples"
        self.used = 0

    def add(self, s: Sample) -> bool:
        truth = self.truth
        for t in range(1, min(len(s.text), self.workload.positions) + 1):
            prefix = s.text[: t - 1]
            if not truth.is_prefix(prefix):
                break  # after an impossible outcome (already infinite evidence)
            p = truth.p(prefix)
            cell = truth.cell(s.text[t - 1])
            self.eproc.update((t, stratum_key(p)), p, cell)
            if p[cell] <= 0 and len(self.evidence) < EVIDENCE_KEPT:
                self.evidence.append(
                    ImpossibleOutcome(s.seed, t, prefix, describe(s.text[t - 1], truth.spec))
                )
        self.tally.add(s)
        self.used += 1
        n = self.used
        if self.eproc.rejects(self.alpha):
            self.verdict, self.decided_by = Verdict.BROKEN, "e-value"
            return True
        if n >= self.next_look or n >= self.max_samples:
            self.looks += 1
            self.next_look *= 2
            a = stats.alpha_spending(self.looks, self.alpha)
            self.tv_uppers = [b.upper for b in certified_bounds(truth, self.tally.texts, a)]
            if all(u <= self.tolerance for u in self.tv_uppers):
                self.verdict, self.decided_by = Verdict.WITHIN_TOLERANCE, "tv-bound"
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
            evidence=list(self.evidence),
        )

    def reason(self) -> str:
        n = self.used
        if self.decided_by == "e-value":
            if self.eproc.impossible:
                first = ""
                if self.evidence:
                    e = self.evidence[0]
                    first = f" ({evidence_sentence(e, self.workload.prompt, self.truth.spec)})"
                return (
                    f"a token with true probability 0 after {n} samples{first}: broken with "
                    "certainty, p = 0"
                )
            return (
                f"e-value {self.eproc.e_value:.3g} >= 1/alpha = {1 / self.alpha:g} after {n} "
                "samples (anytime-valid)"
            )
        if self.decided_by == "tv-bound":
            return (
                f"after {n} samples the prefix-averaged next-token TV of every position and the "
                f"joint's TV are <= {max(self.tv_uppers):.3f} (alpha-spending bounds, tolerance "
                f"{self.tolerance:g}); e-value {self.eproc.e_value:.3g} < {1 / self.alpha:g}. "
                "Within tolerance only: an early stop does not show that smaller deviations "
                "would have been seen (the fixed-sample test certifies PRESERVED)"
            )
        return (
            f"{n} samples (the maximum) without a decision: e-value {self.eproc.e_value:.3g} < "
            f"{1 / self.alpha:g}, TV up to {max(self.tv_uppers or [1.0]):.3f} not ruled out"
        )


__all__ = ["SEQUENTIAL_FIRST_LOOK", "Sequential", "replay_sequential"]
