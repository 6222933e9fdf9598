"""What `dist` works on and reports: the workload, one sample, and the result records.

Also the defaults every part shares (alpha, tolerance, tokens per sample), `DistError`, and
how a sample's text spells outcomes that are not letters (`END`, `SPECIAL_CODES`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specaudit import fixtures
from specaudit.errors import SpecauditError
from specaudit.outcome import Outcome
from specaudit.stats import GofResult, TvBound, TvInterval, Verdict

DEFAULT_TOKENS = 4  # the report's setting: with 4 the server drafts on every request
DEFAULT_ALPHA = 0.01
DEFAULT_TOLERANCE = 0.15  # ~the TV 1000 samples can certify at 4 positions (docs/dist.md)
EVIDENCE_KEPT = 20  # distinct forbidden (position, prefix, token) kept as evidence

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


# A sample's `text` holds one character per generated token (outcome). Fixture letters are
# themselves (ASCII letters or digits); what a correct engine can never produce is spelled with
# private-use characters, so the analysis sees it as an outcome of probability 0:
END = "\ue000"  # the output ended before `tokens` tokens (EOS, a stop): at the first missing one
SPECIAL_CODES: dict[str, str] = {
    tok: chr(0xE001 + i) for i, tok in enumerate(fixtures.SPECIAL_TOKENS)
}  # BOS, EOS, UNK of the fixture's vocabulary
OTHER = "\ue0ff"  # a token id outside the fixture's vocabulary
# Any other character (not a letter, not one of these) is kept as it is: text the fixture cannot
# produce at all, also an outcome of probability 0.
END_LABEL = "<end>"
OTHER_LABEL = "<other>"


def outcome_label(ch: str) -> str:
    """How people read one outcome character: the letter, '</s>', '<end>', or the text seen."""
    if ch == END:
        return END_LABEL
    if ch == OTHER:
        return OTHER_LABEL
    for tok, code in SPECIAL_CODES.items():
        if ch == code:
            return tok
    return ch


@dataclass(frozen=True)
class Sample:
    seed: int
    text: str  # the first `tokens` outcomes: letters, or the codes above (`truth.encode_text`)
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
    """One member of the tested family (a position, the joint, or the draft direction)."""

    __test__ = False  # not a pytest class

    name: str
    kind: str  # "position", "joint" or "directed" (the score test toward the draft)
    position: int  # 0 for the joint and the directed test
    n: int
    contexts: int  # strata (position), cells with non-zero probability (joint), or the
    # (position, context) pairs where the draft differs from the target (directed)
    gof: GofResult
    p_holm: float
    tv: TvInterval  # two-sided, descriptive: the position's marginal (position), the joint's
    # TV (joint); uninformative for the directed test
    rejected: bool
    # What the verdict uses (positions and the joint): a one-sided upper bound, at 1 - alpha/m
    # (m = positions + joint), on the prefix-averaged next-token TV of a position
    # (sum over generated prefixes c of n_c/n TV(engine | c, target | c)) or on the joint's TV.
    tv_bound: TvBound | None = None


@dataclass(frozen=True)
class ImpossibleOutcome:
    """Evidence: a sampled token the target gives probability 0 under the sampler."""

    seed: int  # the first seed that produced it
    position: int  # 1-based
    prefix: str  # the generated letters before it
    token: str  # the letter, '</s>', '<s>', '<unk>', '<end>' (output ended) or the text seen
    count: int = 1  # samples with this same prefix and token


@dataclass(frozen=True)
class DirectedPower:
    """What the directed (draft-leakage) test can see at the N and alpha used.

    Leakage toward the draft: p_lambda = p + lambda (d - p) after every prefix (d the draft's
    distribution under the same sampler, restricted to the target's support). `tv` is the
    largest prefix-averaged next-token TV over positions of the smallest lambda the test
    detects with probability `power` at `level` (alpha over the Holm family size: Holm's first
    step), by the normal approximation of the score statistic.
    """

    n: int
    level: float
    power: float
    lambda_: float | None  # None: not reached even at lambda = 1 (the draft itself)
    tv: float | None
    tv_by_position: list[float]
    information: float  # null variance of one sample's score (Fisher information per sample)


@dataclass(frozen=True)
class GenericPower:
    """What the omnibus tests can see at the N and alpha used, whatever the deviation's
    direction (`stats.detectable_tv`: noncentral chi-square, each test at alpha over the Holm
    family, Holm's first step; approximate, as that approximation is).

    `tv_by_position[t - 1]`: the prefix-averaged next-token TV at position t that the
    position's tests (the pooled test and, where contexts pool, the within-pool one) detect
    with probability at least `power`; `tv_sequence`: the same for the TV of the whole tested
    sequence (positions 1..P), spread over the positions in any way; `tv_joint`: the joint
    test's (first `joint` positions), None without one.
    """

    n: int
    level: float
    power: float
    tv_by_position: list[float | None]
    tv_sequence: float | None
    tv_joint: float | None


@dataclass
class SequentialResult:
    decided_by: (
        str  # "e-value", "fixed-look" (BROKEN), "tv-bound" (WITHIN TOLERANCE), "max-samples"
    )
    samples_used: int  # samples consumed when the decision was made
    samples_drawn: int  # samples the engine produced (in flight when stopped included)
    log_e_value: float
    e_threshold: float  # 2 / alpha: the e-process has half of alpha, the looks the other half
    looks: int  # interim TV analyses
    tv_uppers: list[float]  # per position (prefix-averaged next-token TV), then the joint, at
    # the last look
    evidence: list[ImpossibleOutcome] = field(default_factory=list)  # what made e infinite
    look_level: float | None = None  # decided_by "fixed-look": the level that look rejected at


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
    # the forbidden tokens seen (first seeds, at most EVIDENCE_KEPT distinct (prefix, token))
    evidence: list[ImpossibleOutcome] = field(default_factory=list)
    # the largest of the verdict's one-sided TV bounds (positions' prefix-averaged TV, joint)
    tv_bound: float | None = None
    # INCONCLUSIVE: about how many samples would bring every bound within the tolerance
    # (bounds shrink like 1/sqrt(n)); None otherwise
    samples_needed: int | None = None
    directed: DirectedPower | None = None
    # power against a deviation in any direction, per position and for the tested sequence
    power: GenericPower | None = None
    # one-sided bound (at 1 - alpha) on the TV of the whole tested sequence's distribution
    sequence_tv_bound: float | None = None
    # the llama-server verification path exercised ("plain", "greedy", "rejection", "ngram";
    # dist.runner); None for llama-speculative and a URL
    path: str | None = None

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
    # verification paths not exercised: (path, why), e.g. MTP without an MTP model
    not_covered: list[tuple[str, str]] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        """The weakest engine's: BROKEN, else INCONCLUSIVE, else WITHIN TOLERANCE, else
        PRESERVED (no engine: INCONCLUSIVE)."""
        vs = {e.verdict for e in self.engines}
        if Verdict.BROKEN in vs:
            return Verdict.BROKEN
        if Verdict.INCONCLUSIVE in vs or not vs:
            return Verdict.INCONCLUSIVE
        if Verdict.WITHIN_TOLERANCE in vs:
            return Verdict.WITHIN_TOLERANCE
        return Verdict.PRESERVED

    @property
    def outcome(self) -> Outcome:
        """PRESERVED, WITHIN TOLERANCE -> OK, BROKEN -> FINDING, INCONCLUSIVE -> NO_DECISION."""
        return self.verdict.outcome

    @property
    def exit_code(self) -> int:
        """The `specaudit dist` exit code: 0 PRESERVED / WITHIN TOLERANCE, 1 BROKEN,
        2 INCONCLUSIVE."""
        return self.outcome.exit_code


__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_TOKENS",
    "DEFAULT_TOLERANCE",
    "END",
    "END_LABEL",
    "EVIDENCE_KEPT",
    "OTHER",
    "OTHER_LABEL",
    "SPECIAL_CODES",
    "ContextResult",
    "DirectedPower",
    "DistError",
    "DistResult",
    "EngineResult",
    "GenericPower",
    "ImpossibleOutcome",
    "ProgressFn",
    "Sample",
    "SequentialResult",
    "TestResult",
    "TokenRow",
    "Workload",
    "outcome_label",
]
