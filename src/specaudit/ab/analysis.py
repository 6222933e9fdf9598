"""`specaudit.ab`'s measurement: settings, the per-response reduction, the statistics over seeds
and the verdict. Pure: responses in, an `ABResult` out (sampling is `specaudit.ab.sampling`).

The verdict rules (also in docs/ab.md; constants below):

**instrument fault**, when all hold:
  1. the plain side is a clean reference: no placeholder on it;
  2. the spec side's pooled coverage is below `FAULT_MAX_COVERAGE` (50%);
  3. the spec side's naive mean is implausibly close to 0: its magnitude is at most
     `FAULT_MAX_RATIO` (half) of the plain side's real-only mean, and
  4. it is closer to 0 beyond sampling error: a one-sided paired t-test over seeds of
     d_s = naive_spec(s) - real_plain(s) > 0 has p < `ALPHA` (needs >= 2 seeds).

**consistent**, when both sides return a real logprob for every token of every (non-empty)
response, and the per-seed real-only means agree: the paired differences are all within
`AGREE_TOLERANCE` on average (|mean d| <= 0.01 nats/token; on llama-server the same seed often
gives the same tokens on both sides, so d is exactly 0), or a two-sided paired t-test does not
reject equality at `ALPHA` (needs >= 2 seeds).

**inconclusive** otherwise, with the reasons.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from specaudit import logprobs as lp
from specaudit import validate
from specaudit.errors import SpecauditError
from specaudit.outcome import Outcome

JSON = dict[str, Any]

SCHEMA_VERSION = 1
DEFAULT_PROMPT = "Write a short story about a lighthouse keeper."
DEFAULT_SEEDS = 5
DEFAULT_TOKENS = 64
DEFAULT_TOP_LOGPROBS = 3
# Every response (with its per-token trace, for the plot) is kept and all seeds are in flight
# at once: memory grows with seeds, so they are capped. 10,000 seeds give a t-interval far
# narrower than any effect ab looks for.
MAX_SEEDS = 10_000
AB_ENDPOINTS = ("chat", "completion")
SIDES = ("plain", "spec")

ALPHA = 0.05  # significance level of both verdict tests
CONFIDENCE = 0.95  # confidence level of the reported intervals
FAULT_MAX_COVERAGE = 0.5  # spec coverage below this can be an instrument fault
FAULT_MAX_RATIO = 0.5  # |naive spec mean| <= this * |real plain mean| is "implausibly close to 0"
AGREE_TOLERANCE = 0.01  # nats/token: a mean paired difference this small is agreement


class ABError(SpecauditError):
    """Bad settings, or a server whose answers cannot be compared."""


class ABVerdict(StrEnum):
    INSTRUMENT_FAULT = "instrument fault"
    CONSISTENT = "consistent"
    INCONCLUSIVE = "inconclusive"

    @property
    def outcome(self) -> Outcome:
        """An instrument fault is the finding `ab` looks for; inconclusive decides nothing."""
        return _OUTCOMES[self]


_OUTCOMES = {
    ABVerdict.INSTRUMENT_FAULT: Outcome.FINDING,
    ABVerdict.CONSISTENT: Outcome.OK,
    ABVerdict.INCONCLUSIVE: Outcome.NO_DECISION,
}


@dataclass(frozen=True)
class Settings:
    """What is sampled: the same for both sides, so the sides differ only in the server."""

    seeds: int = DEFAULT_SEEDS
    tokens: int = DEFAULT_TOKENS
    prompt: str = DEFAULT_PROMPT
    temperature: float = 1.0
    sampler_top_k: int | None = None  # the sampler's top-k; None = the server's default
    top_logprobs: int = DEFAULT_TOP_LOGPROBS  # candidates requested per token (CLI --top-k)
    endpoint: str = "chat"
    first_seed: int = 1
    confidence: float = CONFIDENCE

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_ranges()

    def _check_sizes(self) -> None:
        """Seeds, tokens and the prompt: what each side samples."""
        if self.seeds < 1:
            raise ABError(f"--seeds must be at least 1 (got {self.seeds})")
        validate.integer(self.seeds, "--seeds", max=MAX_SEEDS, error=ABError)
        if self.tokens < 1:
            raise ABError(f"--tokens must be at least 1 (got {self.tokens})")
        validate.integer(self.tokens, "--tokens", max=validate.MAX_INT32, error=ABError)
        if not self.prompt:
            raise ABError("--prompt must not be empty")
        validate.text(self.prompt, "--prompt", error=ABError)

    def _check_ranges(self) -> None:
        """The sampler's settings, the seed range and the confidence, each in its range."""
        validate.integer(self.top_logprobs, "--top-k", max=validate.MAX_INT32, error=ABError)
        if self.sampler_top_k is not None:
            validate.integer(
                self.sampler_top_k, "--sampler-top-k", max=validate.MAX_INT32, error=ABError
            )
        if self.first_seed + self.seeds - 1 > validate.MAX_SEED:
            raise ABError(f"seeds must stay <= {validate.MAX_SEED} (llama.cpp's seed is a uint32)")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ABError(f"--temperature must be a finite number >= 0 (got {self.temperature})")
        if self.sampler_top_k is not None and self.sampler_top_k < 0:
            raise ABError(f"--sampler-top-k must be >= 0 (got {self.sampler_top_k})")
        if self.top_logprobs < 1:
            # Without candidates a placeholder cannot be told from a value: nothing to measure.
            raise ABError(f"--top-k must be at least 1 (got {self.top_logprobs})")
        if self.endpoint not in AB_ENDPOINTS:
            raise ABError(f"--endpoint must be one of {', '.join(AB_ENDPOINTS)}")
        if self.first_seed < 0:
            raise ABError(f"first seed must be >= 0 (got {self.first_seed})")
        if not 0 < self.confidence < 1:
            raise ABError(f"confidence must be in (0, 1) (got {self.confidence})")

    @property
    def seed_values(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))  # <= MAX_SEEDS

    def request(self, seed: int) -> JSON:
        """The request body for one seed on the chosen endpoint."""
        if self.endpoint == "chat":
            body: JSON = {
                "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": self.tokens,
                "logprobs": True,
                "top_logprobs": self.top_logprobs,
            }
        else:
            body = {"prompt": self.prompt, "n_predict": self.tokens, "n_probs": self.top_logprobs}
        body.update({"temperature": self.temperature, "seed": seed})
        if self.sampler_top_k is not None:
            body["top_k"] = self.sampler_top_k
        return body


@dataclass
class Response:
    """One sampled response, reduced to what the aggregates need (plus its token trace)."""

    side: str
    seed: int
    text: str
    n_predicted: int | None  # the server's own token count (usage / tokens_predicted)
    tokens: int  # token records received
    real: int
    placeholder: int
    unchecked: int
    coverage: float
    naive_mean: float | None
    real_mean: float | None
    draft_n: int | None
    draft_n_accepted: int | None
    token_texts: list[str] = field(default_factory=list)
    reported_logprobs: list[float | None] = field(default_factory=list)  # as sent (0.0 for a ph)
    real_logprobs: list[float | None] = field(default_factory=list)  # None where missing

    @property
    def mixed(self) -> bool:
        """Real values and placeholders in one response, beyond the always-real first token."""
        return self.placeholder > 0 and self.real > 1


@dataclass
class SideSummary:
    """One side over all seeds."""

    side: str
    url: str
    speculative: bool | None  # what /slots says (None: the server has no /slots)
    slots: int  # concurrent requests sent to it
    responses: int
    tokens: int
    real: int
    placeholder: int
    unchecked: int
    coverage: float  # pooled: real / tokens
    naive_mean: float | None  # mean over seeds of the per-seed naive means
    naive_ci: tuple[float, float] | None
    real_mean: float | None  # mean over seeds of the per-seed real-only means
    real_ci: tuple[float, float] | None
    draft_n: int | None  # summed over responses; None when no response reported it
    draft_n_accepted: int | None


@dataclass
class Delta:
    """A paired comparison over seeds: mean of d_s, its t-interval, and a t-test p-value."""

    name: str
    n: int  # seeds with a value on both sides
    mean: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    alternative: str = "two-sided"


@dataclass
class VerdictInfo:
    kind: ABVerdict
    message: str  # worded for a person, one line
    reasons: list[str] = field(default_factory=list)
    fault_test: Delta | None = None  # naive spec - real plain, one-sided
    agreement_test: Delta | None = None  # real spec - real plain, two-sided


@dataclass
class ABResult:
    schema_version: int
    settings: Settings
    plain: SideSummary
    spec: SideSummary
    delta_naive: Delta  # spec - plain, naive means
    delta_real: Delta  # spec - plain, real-only means
    verdict: VerdictInfo
    responses: list[Response]
    local: dict[str, Any] | None  # how the servers were started, when ab started them
    plot: Path | None
    seconds: float

    def side(self, name: str) -> SideSummary:
        return self.plain if name == "plain" else self.spec

    def by_seed(self, side: str) -> dict[int, Response]:
        return {r.seed: r for r in self.responses if r.side == side}

    @property
    def outcome(self) -> Outcome:
        return self.verdict.kind.outcome

    @property
    def exit_code(self) -> int:
        return self.verdict.kind.outcome.exit_code


# ---------------------------------------------------------------------------------------------
# statistics


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def t_interval(xs: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Student-t interval for the mean of `xs`; None below 2 values, a point if they agree."""
    n = len(xs)
    if n < 2:
        return None
    m = sum(xs) / n
    sd = statistics.stdev(xs)
    if sd == 0:
        return (m, m)
    from scipy import stats  # here, not at import: `specaudit ab`'s start-up and errors

    lo, hi = stats.t.interval(confidence, n - 1, loc=m, scale=sd / math.sqrt(n))
    return (float(lo), float(hi))


def paired(
    name: str,
    a: dict[int, float | None],
    b: dict[int, float | None],
    confidence: float = CONFIDENCE,
    alternative: str = "two-sided",
) -> Delta:
    """Mean of d_s = a(s) - b(s) over seeds where both have a value, with interval and p."""
    d = [
        float(av) - float(bv)
        for s in sorted(a)
        if (av := a[s]) is not None and (bv := b.get(s)) is not None
    ]
    n = len(d)
    if n == 0:
        return Delta(name, 0, None, None, None, None, alternative)
    m = sum(d) / n
    ci = t_interval(d, confidence)
    p: float | None = None
    if n >= 2:
        if statistics.stdev(d) == 0:
            # no spread: the differences are all the same number; t is 0 or infinite
            if m == 0:
                p = 1.0
            elif alternative == "greater":
                p = 0.0 if m > 0 else 1.0
            elif alternative == "less":
                p = 0.0 if m < 0 else 1.0
            else:
                p = 0.0
        else:
            from scipy import stats

            p = float(stats.ttest_1samp(d, 0.0, alternative=alternative).pvalue)
    return Delta(name, n, m, ci[0] if ci else None, ci[1] if ci else None, p, alternative)


# ---------------------------------------------------------------------------------------------
# parsing one response


def parse_response(side: str, seed: int, endpoint: str, body: JSON, requested: int) -> Response:
    """Reduce one server answer to a `Response`; refuse answers that carry no logprobs."""
    records = lp.from_response(endpoint, body, requested)
    if endpoint == "chat":
        choices = body.get("choices") or [{}]
        msg = choices[0].get("message") if isinstance(choices[0], dict) else None
        text = str((msg or {}).get("content") or "")
        usage = body.get("usage") or {}
        n_pred = usage.get("completion_tokens") if isinstance(usage, dict) else None
    else:
        text = str(body.get("content") or "")
        n_pred = body.get("tokens_predicted")
    n_predicted = n_pred if isinstance(n_pred, int) and not isinstance(n_pred, bool) else None
    if not records and (n_predicted or text):
        raise ABError(
            f"the {side} server returned text for seed {seed} but no logprobs "
            f"(does it support {'top_logprobs' if endpoint == 'chat' else 'n_probs'}?)"
        )
    timings = body.get("timings") if isinstance(body.get("timings"), dict) else {}
    assert isinstance(timings, dict)
    dn, dna = timings.get("draft_n"), timings.get("draft_n_accepted")
    c = lp.counts(records)
    return Response(
        side=side,
        seed=seed,
        text=text,
        n_predicted=n_predicted,
        tokens=c.total,
        real=c.real,
        placeholder=c.placeholder,
        unchecked=c.unchecked,
        coverage=c.coverage,
        naive_mean=lp.mean_logprob(records, lp.Missing.NAIVE),
        real_mean=lp.mean_logprob(records, lp.Missing.SKIP),
        draft_n=dn if isinstance(dn, int) else None,
        draft_n_accepted=dna if isinstance(dna, int) else None,
        token_texts=[r.token for r in records],
        reported_logprobs=[r.reported_logprob for r in records],
        real_logprobs=[r.logprob for r in records],
    )


# ---------------------------------------------------------------------------------------------
# aggregation and verdict


def summarize(
    side: str,
    url: str,
    responses: Sequence[Response],
    speculative: bool | None = None,
    slots: int = 1,
    confidence: float = CONFIDENCE,
) -> SideSummary:
    rs = [r for r in responses if r.side == side]
    naive = [r.naive_mean for r in rs if r.naive_mean is not None]
    real = [r.real_mean for r in rs if r.real_mean is not None]
    tokens = sum(r.tokens for r in rs)
    n_real = sum(r.real for r in rs)
    dn = [r.draft_n for r in rs if r.draft_n is not None]
    dna = [r.draft_n_accepted for r in rs if r.draft_n_accepted is not None]
    return SideSummary(
        side=side,
        url=url,
        speculative=speculative,
        slots=slots,
        responses=len(rs),
        tokens=tokens,
        real=n_real,
        placeholder=sum(r.placeholder for r in rs),
        unchecked=sum(r.unchecked for r in rs),
        coverage=n_real / tokens if tokens else 0.0,
        naive_mean=_mean(naive),
        naive_ci=t_interval(naive, confidence),
        real_mean=_mean(real),
        real_ci=t_interval(real, confidence),
        draft_n=sum(dn) if dn else None,
        draft_n_accepted=sum(dna) if dna else None,
    )


def _by_seed(responses: Sequence[Response], side: str, attr: str) -> dict[int, float | None]:
    return {r.seed: getattr(r, attr) for r in responses if r.side == side}


def fmt(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def decide(
    responses: Sequence[Response],
    plain: SideSummary,
    spec: SideSummary,
    confidence: float = CONFIDENCE,
) -> VerdictInfo:
    """The verdict rules of the module docstring, applied to per-seed responses."""
    fault_test = paired(
        "naive spec - real plain",
        _by_seed(responses, "spec", "naive_mean"),
        _by_seed(responses, "plain", "real_mean"),
        confidence,
        alternative="greater",
    )
    agreement_test = paired(
        "real spec - real plain",
        _by_seed(responses, "spec", "real_mean"),
        _by_seed(responses, "plain", "real_mean"),
        confidence,
    )

    fault_reasons = _fault_reasons(plain, spec, fault_test)
    if not fault_reasons:
        return VerdictInfo(
            ABVerdict.INSTRUMENT_FAULT, _fault_message(plain, spec), [], fault_test, agreement_test
        )
    agree_reasons = _agreement_reasons(plain, spec, agreement_test)
    if not agree_reasons:
        msg = _consistent_message(agreement_test)
        return VerdictInfo(ABVerdict.CONSISTENT, msg, [], fault_test, agreement_test)

    reasons = [f"not an instrument fault: {r}" for r in fault_reasons] + [
        f"not consistent: {r}" for r in agree_reasons
    ]
    headline = (
        f"inconclusive: spec coverage {spec.coverage:.1%}, naive means "
        f"{fmt(spec.naive_mean)} (spec) vs {fmt(plain.naive_mean)} (plain); "
        + (agree_reasons[0] if agree_reasons else fault_reasons[0])
    )
    return VerdictInfo(ABVerdict.INCONCLUSIVE, headline, reasons, fault_test, agreement_test)


def _fault_reasons(plain: SideSummary, spec: SideSummary, fault_test: Delta) -> list[str]:
    """Why the difference is not (shown to be) the tool's placeholders; empty if it is."""
    reasons: list[str] = []
    if plain.placeholder:
        reasons.append(
            f"the plain side has {plain.placeholder} placeholders itself, so it is no reference"
        )
    if spec.coverage >= FAULT_MAX_COVERAGE:
        reasons.append(f"spec coverage {spec.coverage:.0%} is not below {FAULT_MAX_COVERAGE:.0%}")
    s_mean, p_mean = spec.naive_mean, plain.real_mean
    if s_mean is None or p_mean is None:
        reasons.append("a side has no value to average")
    elif abs(s_mean) > FAULT_MAX_RATIO * abs(p_mean):
        reasons.append(
            f"the spec naive mean {s_mean:.4f} is not within {FAULT_MAX_RATIO:g}x of 0 "
            f"relative to the plain real mean {p_mean:.4f}"
        )
    if fault_test.n < 2:
        reasons.append("fewer than 2 seeds with values on both sides: no test over seeds")
    elif fault_test.p_value is None or fault_test.p_value >= ALPHA:
        reasons.append(
            f"the spec naive mean is not closer to 0 beyond sampling error "
            f"(one-sided paired t-test p = {fmt(fault_test.p_value, '.3g')})"
        )
    return reasons


def _fault_message(plain: SideSummary, spec: SideSummary) -> str:
    s_mean, p_mean = spec.naive_mean, plain.real_mean
    assert s_mean is not None and p_mean is not None
    return (
        f"instrument fault: the spec side's naive mean logprob ({s_mean:.4f}) is "
        f"implausibly close to 0 next to the plain side's {p_mean:.4f}, and its coverage "
        f"is {spec.coverage:.1%} ({spec.placeholder} of {spec.tokens} tokens are "
        f"placeholders), so the difference comes from the tool, not the model"
    )


def _within_tolerance(d: Delta) -> bool:
    return d.mean is not None and abs(d.mean) <= AGREE_TOLERANCE


def _agreement_reasons(plain: SideSummary, spec: SideSummary, d: Delta) -> list[str]:
    """Why the sides' real values are not (shown to be) consistent; empty if they are."""
    reasons: list[str] = []
    for s in (plain, spec):
        if s.placeholder or s.unchecked or s.real < s.tokens:
            reasons.append(
                f"the {s.side} side is not fully covered ({s.coverage:.1%} real, "
                f"{s.placeholder} placeholders)"
            )
        if s.tokens == 0:
            reasons.append(f"the {s.side} side returned no tokens")
    if d.n == 0:
        reasons.append("no seed has real values on both sides")
    elif _within_tolerance(d):
        pass
    elif d.n < 2:
        reasons.append(f"one seed differs by {d.mean:+.4f} and cannot estimate sampling error")
    elif d.p_value is None or d.p_value < ALPHA:
        reasons.append(
            f"the real-only means differ beyond sampling error (Δ {d.mean:+.4f}, "
            f"paired t-test p = {fmt(d.p_value, '.3g')})"
        )
    return reasons


def _consistent_message(d: Delta) -> str:
    assert d.mean is not None
    how = (
        f"their per-seed means agree within {AGREE_TOLERANCE:g} nats/token"
        if _within_tolerance(d)
        else f"their per-seed means agree within sampling error (paired t-test p = "
        f"{fmt(d.p_value, '.3g')})"
    )
    return (
        f"consistent: both sides return a real logprob for every token, and {how} "
        f"(Δ {d.mean:+.4f} over {d.n} seeds)"
    )


def analyse(
    settings: Settings,
    responses: Sequence[Response],
    urls: dict[str, str],
    info: dict[str, tuple[int, bool | None]] | None = None,
    seconds: float = 0.0,
    local: dict[str, Any] | None = None,
) -> ABResult:
    """Summaries, Δs and the verdict from per-seed responses of both sides."""
    info = info or {}
    summ = {
        side: summarize(
            side,
            urls[side],
            responses,
            speculative=info.get(side, (1, None))[1],
            slots=info.get(side, (1, None))[0],
            confidence=settings.confidence,
        )
        for side in SIDES
    }
    conf = settings.confidence
    dn = paired(
        "naive: spec - plain",
        _by_seed(responses, "spec", "naive_mean"),
        _by_seed(responses, "plain", "naive_mean"),
        conf,
    )
    dr = paired(
        "real only: spec - plain",
        _by_seed(responses, "spec", "real_mean"),
        _by_seed(responses, "plain", "real_mean"),
        conf,
    )
    verdict = decide(responses, summ["plain"], summ["spec"], conf)
    order = {s: i for i, s in enumerate(SIDES)}
    ordered = sorted(responses, key=lambda r: (r.seed, order.get(r.side, 9)))
    return ABResult(
        schema_version=SCHEMA_VERSION,
        settings=settings,
        plain=summ["plain"],
        spec=summ["spec"],
        delta_naive=dn,
        delta_real=dr,
        verdict=verdict,
        responses=ordered,
        local=local,
        plot=None,
        seconds=seconds,
    )


__all__ = [
    "AB_ENDPOINTS",
    "AGREE_TOLERANCE",
    "ALPHA",
    "CONFIDENCE",
    "DEFAULT_PROMPT",
    "DEFAULT_SEEDS",
    "DEFAULT_TOKENS",
    "DEFAULT_TOP_LOGPROBS",
    "FAULT_MAX_COVERAGE",
    "FAULT_MAX_RATIO",
    "SCHEMA_VERSION",
    "SIDES",
    "ABError",
    "ABResult",
    "ABVerdict",
    "Delta",
    "Response",
    "Settings",
    "SideSummary",
    "VerdictInfo",
    "analyse",
    "decide",
    "fmt",
    "paired",
    "parse_response",
    "summarize",
    "t_interval",
]
