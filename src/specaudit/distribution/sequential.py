"""Sequential analysis: stop as soon as the evidence is decisive.

BROKEN is decided two ways, each with half of alpha, so the false-alarm rate stays <= alpha:
an anytime-valid e-process (the average of the omnibus per-context mixture and a directed
one toward the draft's distribution, crossing 2/alpha), and a group-sequential look: the
fixed-sample tests (position G-tests, joint, directed score, Holm) at looks 25, 50, 100, 200,
... samples, each at its alpha-spending share of alpha/2. Why both: the e-process reacts at
once to gross bugs (a forbidden token is infinite evidence), the looks bring the
fixed-sample tests' power to small deviations that the e-process learns slowly.

Alpha-spending TV bounds at the same looks decide WITHIN TOLERANCE: the prefix-averaged
next-token TV of every position and the joint's TV are certified within the tolerance, but an
early stop does not claim that smaller deviations would have shown (the fixed-sample test at
--seeds would see TV 0.05 where the sequential one stops at 200 samples), so it never says
PRESERVED. Memory is bounded whatever the number of samples: the e-processes and the tally of
distinct texts are all that is kept.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import replace

from specaudit import fixtures, stats
from specaudit.distribution.analysis import analyse, family_size
from specaudit.distribution.bounds import certified_bounds
from specaudit.distribution.counting import OutcomeCounts
from specaudit.distribution.direction import draft_score
from specaudit.distribution.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOLERANCE,
    EVIDENCE_KEPT,
    ImpossibleOutcome,
    Sample,
    SequentialResult,
    Workload,
)
from specaudit.distribution.truth import Truth, describe, encode_text, stratum_key
from specaudit.distribution.wording import evidence_sentence
from specaudit.stats import Verdict

SEQUENTIAL_FIRST_LOOK = 25  # interim looks at 25, 50, 100, 200, ... samples, and at the last
E_SHARE = 0.5  # of alpha, to the e-process; the rest is spent over the looks' fixed tests
SPENDING = "pocock"  # Lan-DeMets spending by information fraction (stats.spent_alpha)
MC_RESOLUTION = 10  # a look's Monte-Carlo floor: its level / (family size x this)
MC_STOP_HITS = 20  # sequential Monte-Carlo (stats.mc_pvalue): stop at this many hits
MC_CAP = 2_000_000  # most draws per Monte-Carlo p-value at a look


def replay_sequential(
    spec: fixtures.FixtureSpec,
    workload: Workload,
    samples: Sequence[Sample],
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    mc_draws: int = stats.MC_DRAWS,
) -> tuple[Verdict, SequentialResult]:
    """The sequential procedure run over samples already drawn (in their order)."""
    seq = Sequential(
        Truth(spec, workload), workload, alpha, tolerance, len(samples), mc_draws=mc_draws
    )
    for s in samples:
        if seq.add(replace(s, text=encode_text(s.text, workload.tokens, spec))):
            break
    return seq.verdict, seq.result(len(samples))


class Sequential:
    """Valid early stopping: e-process or a look's fixed tests for BROKEN (alpha split
    between them), alpha-spending TV bounds for WITHIN TOLERANCE. Samples must be encoded
    (`truth.encode_text`)."""

    def __init__(
        self,
        truth: Truth,
        workload: Workload,
        alpha: float,
        tolerance: float,
        max_samples: int,
        *,
        mc_draws: int = stats.MC_DRAWS,
    ) -> None:
        """`mc_draws`: simulations per Monte-Carlo p-value at a look (any number keeps the
        looks valid; fewer only coarsens them)."""
        self.truth = truth
        self.workload = workload
        self.alpha = alpha
        self.tolerance = tolerance
        self.max_samples = max_samples
        self.mc_draws = mc_draws
        self.eproc = stats.EProcess()
        self.directed = stats.DirectedEProcess()
        self.e_threshold = 1.0 / (E_SHARE * alpha)
        self.look_level: float | None = None  # the level of the look that rejected
        self.tally = OutcomeCounts.of((), workload)  # the TV bounds' data (distinct texts only)
        self.evidence: list[ImpossibleOutcome] = []
        self.looks = 0
        self.next_look = SEQUENTIAL_FIRST_LOOK
        self.last_look_n = 0
        self.look_draws = 0  # Monte-Carlo draws allowed per p-value at the last look
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
            if p[cell] > 0:
                self.directed.update(draft_score(truth, prefix, cell))
            else:
                self.directed.update(math.inf)
                if len(self.evidence) < EVIDENCE_KEPT:
                    self.evidence.append(
                        ImpossibleOutcome(s.seed, t, prefix, describe(s.text[t - 1], truth.spec))
                    )
        self.tally.add(s)
        self.used += 1
        n = self.used
        if self.log_e >= math.log(self.e_threshold):
            self.verdict, self.decided_by = Verdict.BROKEN, "e-value"
            return True
        if n >= self.next_look or n >= self.max_samples:
            self.looks += 1
            self.next_look *= 2
            prev, self.last_look_n = self.last_look_n, n
            top = max(self.max_samples, n)
            level = stats.look_level(prev, n, top, (1.0 - E_SHARE) * self.alpha, SPENDING)
            # the floor of a Monte-Carlo p-value must lie well below what Holm's first step
            # needs at this level; sequential draws make that cheap where evidence is weak
            self.look_draws = int(
                min(MC_CAP, max(self.mc_draws, math.ceil(MC_RESOLUTION * self.family / level)))
            )
            fixed = analyse(
                truth.spec, self.workload, self.tally, alpha=level, mc_draws=self.look_draws,
                mc_stop_hits=MC_STOP_HITS,
            )  # fmt: skip
            if fixed.verdict is Verdict.BROKEN:
                self.verdict, self.decided_by = Verdict.BROKEN, "fixed-look"
                self.look_level = level
                return True
            a = stats.look_level(prev, n, top, self.alpha, SPENDING)
            self.tv_uppers = [b.upper for b in certified_bounds(truth, self.tally.texts, a)]
            if all(u <= self.tolerance for u in self.tv_uppers):
                self.verdict, self.decided_by = Verdict.WITHIN_TOLERANCE, "tv-bound"
                return True
        return False

    @functools.cached_property
    def family(self) -> int:
        """Tests in a look's Holm family (positions, joint, draft direction, history, seeds)."""
        return family_size(self.truth)

    @property
    def log_e(self) -> float:
        """log of the e-process: the average of the omnibus and the directed one."""
        return stats.mixed_log_e(self.eproc.log_e, self.directed.log_e)

    @property
    def e_value(self) -> float:
        return math.exp(self.log_e) if self.log_e < 700 else math.inf

    def result(self, drawn: int) -> SequentialResult:
        return SequentialResult(
            decided_by=self.decided_by,
            samples_used=self.used,
            samples_drawn=drawn,
            log_e_value=self.log_e,
            e_threshold=self.e_threshold,
            looks=self.looks,
            tv_uppers=self.tv_uppers,
            evidence=list(self.evidence),
            look_level=self.look_level,
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
                f"e-value {self.e_value:.3g} >= 2/alpha = {self.e_threshold:g} after {n} "
                "samples (anytime-valid; omnibus and draft-direction e-processes averaged)"
            )
        if self.decided_by == "fixed-look":
            return (
                f"after {n} samples (look {self.looks}) the fixed-sample tests reject at the "
                f"look's spent level {self.look_level:.2g} (group-sequential: alpha/2 spent by "
                f"information fraction, {SPENDING}-type, over looks at "
                f"{SEQUENTIAL_FIRST_LOOK}, {2 * SEQUENTIAL_FIRST_LOOK}, ... and "
                f"{self.max_samples} samples)"
            )
        if self.decided_by == "tv-bound":
            return (
                f"after {n} samples the prefix-averaged next-token TV of every position and the "
                f"joint's TV are <= {max(self.tv_uppers):.3f} (alpha-spending bounds, tolerance "
                f"{self.tolerance:g}); e-value {self.e_value:.3g} < 2/alpha = "
                f"{self.e_threshold:g} (omnibus and draft-direction e-processes averaged, the "
                "quantity that decides BROKEN). "
                "Within tolerance only: an early stop does not show that smaller deviations "
                "would have been seen (the fixed-sample test certifies PRESERVED)"
            )
        return (
            f"{n} samples (the maximum) without a decision: e-value {self.e_value:.3g} < "
            f"{self.e_threshold:g}, TV up to {max(self.tv_uppers or [1.0]):.3f} not ruled out"
        )


__all__ = [
    "E_SHARE",
    "MC_CAP",
    "MC_RESOLUTION",
    "MC_STOP_HITS",
    "SEQUENTIAL_FIRST_LOOK",
    "SPENDING",
    "Sequential",
    "replay_sequential",
]
