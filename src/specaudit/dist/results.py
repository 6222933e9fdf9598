"""What `dist` works on and reports: the workload, one sample, and the result records.

Also the defaults every part shares (alpha, tolerance, tokens per sample) and `DistError`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specaudit import fixtures
from specaudit.errors import SpecauditError
from specaudit.outcome import Outcome
from specaudit.stats import GofResult, TvInterval, Verdict

DEFAULT_TOKENS = 4  # the report's setting: with 4 the server drafts on every request
DEFAULT_ALPHA = 0.01
DEFAULT_TOLERANCE = 0.15  # ~the TV 1000 samples can certify at 4 positions (docs/dist.md)

ProgressFn = Callable[[str, int, int], None]
"""Called with (engine label, samples done, samples planned)."""


class DistError(SpecauditError):
    """Bad input for `dist`, or an engine that did not answer like the fixture it should run."""


@dataclass(frozen=True)
class Workload:
    """What every sample is: the fixture prompt, tokens generated, sampler settings."""

    prompt: str
    tokens: int  # generated per sample
    positions: int  # positions tested (1..positions)
    joint: int  # joint distribution of the first `joint` positions (0: not tested)
    sampler: fixtures.SamplerSettings


@dataclass(frozen=True)
class Sample:
    seed: int
    text: str  # the first `tokens` generated letters
    drafted: int | None = None  # draft tokens proposed (None: engine does not say / no draft)
    accepted: int | None = None


@dataclass
class TokenRow:
    token: str
    expected: float
    observed: int
    frequency: float
    ci_low: float  # 95% Clopper-Pearson, for plots and tables
    ci_high: float


@dataclass
class ContextResult:
    """One conditioning context (or pooled contexts with the same true distribution)."""

    position: int
    label: str
    prefixes: list[str]  # generated prefixes pooled here (at most a few are kept)
    n: int
    tokens: list[TokenRow]
    gof: GofResult
    tv: TvInterval


@dataclass
class TestResult:
    """One member of the tested family (a position, or the joint)."""

    __test__ = False  # not a pytest class

    name: str
    kind: str  # "position" or "joint"
    position: int  # 0 for the joint
    n: int
    contexts: int  # strata (position) or cells with non-zero probability (joint)
    gof: GofResult
    p_holm: float
    tv: TvInterval
    rejected: bool


@dataclass
class SequentialResult:
    decided_by: str  # "e-value", "tv-bound" or "max-samples"
    samples_used: int  # samples consumed when the decision was made
    samples_drawn: int  # samples the engine produced (in flight when stopped included)
    log_e_value: float
    e_threshold: float  # 1 / alpha
    looks: int  # interim TV analyses
    tv_uppers: list[float]  # per position, at the last look


@dataclass
class EngineResult:
    engine: str  # label for people
    kind: str  # "server-plain", "server-spec", "speculative-example", "url"
    verdict: Verdict
    alpha: float
    tolerance: float
    n_samples: int
    first_seed: int
    last_seed: int
    drafted: int | None
    accepted: int | None
    tests: list[TestResult]
    contexts: list[ContextResult]
    headline: list[ContextResult]  # the most likely context at each position (the report's rows)
    impossible: int  # observed tokens the target forbids
    reason: str
    seconds: float
    sequential: SequentialResult | None = None

    @property
    def samples_per_s(self) -> float:
        return self.n_samples / self.seconds if self.seconds > 0 else math.inf


@dataclass
class DistResult:
    fixture: str
    fixture_dir: Path
    sha256: dict[str, str]
    workload: Workload
    alpha: float
    tolerance: float
    sequential: bool
    engines: list[EngineResult]
    plot: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        vs = {e.verdict for e in self.engines}
        if Verdict.BROKEN in vs:
            return Verdict.BROKEN
        if Verdict.INCONCLUSIVE in vs or not vs:
            return Verdict.INCONCLUSIVE
        return Verdict.PRESERVED

    @property
    def outcome(self) -> Outcome:
        """PRESERVED -> OK, BROKEN -> FINDING, INCONCLUSIVE -> NO_DECISION."""
        return self.verdict.outcome

    @property
    def exit_code(self) -> int:
        """The `specaudit dist` exit code: 0 PRESERVED, 1 BROKEN, 2 INCONCLUSIVE."""
        return self.outcome.exit_code


__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_TOKENS",
    "DEFAULT_TOLERANCE",
    "ContextResult",
    "DistError",
    "DistResult",
    "EngineResult",
    "ProgressFn",
    "Sample",
    "SequentialResult",
    "TestResult",
    "TokenRow",
    "Workload",
]
