"""`specaudit ab`: what placeholder logprobs do to aggregates, speculative vs plain, over seeds.

Why: the field report's most damaging number was an aggregate. With a draft model, the mean
logprob of a 64-token sample at temperature 1 read -0.0011 against -0.48 without one, and it
looked like a finding about the model. It was the instrument: every token after the first
came back as a placeholder (logprob 0.0, no candidates). This module runs the report's habit
as a measurement: sample the same prompt and seeds from a plain and a speculating server, and
compute for each response

- the **naive** mean logprob (what a client that trusts the numbers computes: placeholders
  count as 0.0, `logprobs.Missing.NAIVE`),
- the mean over **real** tokens only (`Missing.SKIP`),
- coverage (real tokens / tokens) and the placeholder count, and
- the server's own ``timings.draft_n`` / ``draft_n_accepted``.

Then it compares the sides over seeds with paired t statistics (scipy.stats) and words a
verdict. The rules (also in docs/ab.md; constants below):

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

import asyncio
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scipy import stats

from specaudit import logprobs as lp
from specaudit.client import ENDPOINTS, AsyncClient, ClientError
from specaudit.errors import SpecauditError

if TYPE_CHECKING:
    from specaudit.audit import AuditContext, Section
    from specaudit.llama.build import LlamaBinaries

JSON = dict[str, Any]

SCHEMA_VERSION = 1
DEFAULT_PROMPT = "Write a short story about a lighthouse keeper."
DEFAULT_SEEDS = 5
DEFAULT_TOKENS = 64
DEFAULT_TOP_LOGPROBS = 3
DEFAULT_SPEC_TYPE = "draft-simple"
AB_ENDPOINTS = ("chat", "completion")
SIDES = ("plain", "spec")

ALPHA = 0.05  # significance level of both verdict tests
CONFIDENCE = 0.95  # confidence level of the reported intervals
FAULT_MAX_COVERAGE = 0.5  # spec coverage below this can be an instrument fault
FAULT_MAX_RATIO = 0.5  # |naive spec mean| <= this * |real plain mean| is "implausibly close to 0"
AGREE_TOLERANCE = 0.01  # nats/token: a mean paired difference this small is agreement

ProgressFn = Callable[[int, int], None]
"""Called with (responses done, responses total) as samples come back."""


class ABError(SpecauditError):
    """Bad settings, or a server whose answers cannot be compared."""


class Verdict(StrEnum):
    INSTRUMENT_FAULT = "instrument fault"
    CONSISTENT = "consistent"
    INCONCLUSIVE = "inconclusive"


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
        if self.seeds < 1:
            raise ABError(f"--seeds must be at least 1 (got {self.seeds})")
        if self.tokens < 1:
            raise ABError(f"--tokens must be at least 1 (got {self.tokens})")
        if not self.prompt:
            raise ABError("--prompt must not be empty")
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
        return list(range(self.first_seed, self.first_seed + self.seeds))

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
    kind: Verdict
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
    def exit_code(self) -> int:
        return {Verdict.CONSISTENT: 0, Verdict.INSTRUMENT_FAULT: 1}.get(self.verdict.kind, 2)


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


def _fmt(x: float | None, spec: str = ".4f") -> str:
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

    # --- instrument fault
    fault_reasons: list[str] = []
    if plain.placeholder:
        fault_reasons.append(
            f"the plain side has {plain.placeholder} placeholders itself, so it is no reference"
        )
    if spec.coverage >= FAULT_MAX_COVERAGE:
        fault_reasons.append(
            f"spec coverage {spec.coverage:.0%} is not below {FAULT_MAX_COVERAGE:.0%}"
        )
    s_mean, p_mean = spec.naive_mean, plain.real_mean
    if s_mean is None or p_mean is None:
        fault_reasons.append("a side has no value to average")
    elif abs(s_mean) > FAULT_MAX_RATIO * abs(p_mean):
        fault_reasons.append(
            f"the spec naive mean {s_mean:.4f} is not within {FAULT_MAX_RATIO:g}x of 0 "
            f"relative to the plain real mean {p_mean:.4f}"
        )
    if fault_test.n < 2:
        fault_reasons.append("fewer than 2 seeds with values on both sides: no test over seeds")
    elif fault_test.p_value is None or fault_test.p_value >= ALPHA:
        fault_reasons.append(
            f"the spec naive mean is not closer to 0 beyond sampling error "
            f"(one-sided paired t-test p = {_fmt(fault_test.p_value, '.3g')})"
        )
    if not fault_reasons:
        assert s_mean is not None and p_mean is not None
        msg = (
            f"instrument fault: the spec side's naive mean logprob ({s_mean:.4f}) is "
            f"implausibly close to 0 next to the plain side's {p_mean:.4f}, and its coverage "
            f"is {spec.coverage:.1%} ({spec.placeholder} of {spec.tokens} tokens are "
            f"placeholders), so the difference comes from the tool, not the model"
        )
        return VerdictInfo(Verdict.INSTRUMENT_FAULT, msg, [], fault_test, agreement_test)

    # --- consistent
    agree_reasons: list[str] = []
    for s in (plain, spec):
        if s.placeholder or s.unchecked or s.real < s.tokens:
            agree_reasons.append(
                f"the {s.side} side is not fully covered ({s.coverage:.1%} real, "
                f"{s.placeholder} placeholders)"
            )
        if s.tokens == 0:
            agree_reasons.append(f"the {s.side} side returned no tokens")
    d = agreement_test
    within_tolerance = d.mean is not None and abs(d.mean) <= AGREE_TOLERANCE
    if d.n == 0:
        agree_reasons.append("no seed has real values on both sides")
    elif within_tolerance:
        pass
    elif d.n < 2:
        agree_reasons.append(
            f"one seed differs by {d.mean:+.4f} and cannot estimate sampling error"
        )
    elif d.p_value is None or d.p_value < ALPHA:
        agree_reasons.append(
            f"the real-only means differ beyond sampling error (Δ {d.mean:+.4f}, "
            f"paired t-test p = {_fmt(d.p_value, '.3g')})"
        )
    if not agree_reasons:
        assert d.mean is not None
        how = (
            f"their per-seed means agree within {AGREE_TOLERANCE:g} nats/token"
            if within_tolerance
            else f"their per-seed means agree within sampling error (paired t-test p = "
            f"{_fmt(d.p_value, '.3g')})"
        )
        msg = (
            f"consistent: both sides return a real logprob for every token, and {how} "
            f"(Δ {d.mean:+.4f} over {d.n} seeds)"
        )
        return VerdictInfo(Verdict.CONSISTENT, msg, [], fault_test, agreement_test)

    reasons = [f"not an instrument fault: {r}" for r in fault_reasons] + [
        f"not consistent: {r}" for r in agree_reasons
    ]
    headline = (
        f"inconclusive: spec coverage {spec.coverage:.1%}, naive means "
        f"{_fmt(spec.naive_mean)} (spec) vs {_fmt(plain.naive_mean)} (plain); "
        + (agree_reasons[0] if agree_reasons else fault_reasons[0])
    )
    return VerdictInfo(Verdict.INCONCLUSIVE, headline, reasons, fault_test, agreement_test)


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


# ---------------------------------------------------------------------------------------------
# sampling


async def _server_info(client: AsyncClient) -> tuple[int, bool | None]:
    """(parallel slots, speculates?) from /slots, else /props' total_slots, else (1, None).

    Also the reachability check: a server that cannot be reached fails here, once, with one
    line, before any sampling starts.
    """
    try:
        body = await client.get("/slots")
        slots = body.get("_list")
        if isinstance(slots, list) and slots:
            spec = any(bool(s.get("speculative")) for s in slots if isinstance(s, dict))
            return len(slots), spec
    except ClientError as e:
        if e.status is None:
            raise
    try:
        props = await client.get("/props")
        n = props.get("total_slots")
        if isinstance(n, int) and n > 0:
            return n, None
    except ClientError as e:
        if e.status is None:
            raise
    return 1, None


def _first_error(eg: BaseExceptionGroup) -> BaseException:
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            return _first_error(e)
        return e
    return eg


async def _collect(
    settings: Settings,
    urls: dict[str, str],
    progress: ProgressFn | None,
    timeout: float,
) -> tuple[list[Response], dict[str, tuple[int, bool | None]]]:
    distinct = sorted(set(urls.values()))
    clients = {u: AsyncClient(u, timeout=timeout) for u in distinct}
    try:
        per_url = {u: await _server_info(clients[u]) for u in distinct}
        # One semaphore per server: when both sides are the same URL they share its slots.
        sems = {u: asyncio.Semaphore(per_url[u][0]) for u in distinct}
        path = ENDPOINTS[settings.endpoint]
        total = len(SIDES) * settings.seeds
        done = 0
        if progress:
            progress(0, total)

        async def one(side: str, seed: int) -> Response:
            nonlocal done
            url = urls[side]
            async with sems[url]:
                body = await clients[url].post(path, settings.request(seed))
            resp = parse_response(side, seed, settings.endpoint, body, settings.top_logprobs)
            done += 1
            if progress:
                progress(done, total)
            return resp

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(one(side, seed))
                    for seed in settings.seed_values
                    for side in SIDES
                ]
        except BaseExceptionGroup as eg:
            raise _first_error(eg) from None
        responses = [t.result() for t in tasks]
    finally:
        for c in clients.values():
            await c.aclose()
    return responses, {side: per_url[urls[side]] for side in SIDES}


def run(
    plain_url: str,
    spec_url: str,
    settings: Settings | None = None,
    *,
    plot: str | Path | None = None,
    progress: ProgressFn | None = None,
    timeout: float = 600.0,
    local: dict[str, Any] | None = None,
) -> ABResult:
    """Sample `settings.seeds` seeds from both servers concurrently and compare them.

    Seeds go out concurrently, up to each server's parallel slots (from /slots). A plot is
    written to `plot` if given.
    """
    settings = settings or Settings()
    urls = {"plain": plain_url.rstrip("/"), "spec": spec_url.rstrip("/")}
    for side, u in urls.items():
        if not u.startswith(("http://", "https://")):
            raise ABError(f"--{side} must be an http(s) URL (got {u!r})")
    t0 = time.monotonic()
    responses, info = asyncio.run(_collect(settings, urls, progress, timeout))
    result = analyse(settings, responses, urls, info, time.monotonic() - t0, local)
    if plot is not None:
        result.plot = draw(result, plot)
    return result


def uses_draft(spec_type: str) -> bool:
    """Whether a --spec-type list needs a draft model (the draft-* types but MTP)."""
    return any(t.startswith("draft-") and t != "draft-mtp" for t in spec_type.split(","))


def run_local(
    settings: Settings | None = None,
    *,
    binaries: LlamaBinaries | None = None,
    model: str | Path | None = None,
    draft: str | Path | None = None,
    spec_type: str = DEFAULT_SPEC_TYPE,
    parallel: int | None = None,
    log_dir: str | Path | None = None,
    plot: str | Path | None = None,
    progress: ProgressFn | None = None,
    status: Callable[[str], None] | None = None,
) -> ABResult:
    """Start a plain and a speculating llama-server from one model, then `run` on them.

    Defaults: Gemma 3 270M as its own draft with draft-simple, the report's setup. Both
    servers bind 127.0.0.1 on free ports and are always stopped.
    """
    from specaudit import llama
    from specaudit.llama import LlamaServer
    from specaudit.models import gemma_270m

    settings = settings or Settings()
    say = status or (lambda msg: None)
    if not spec_type or spec_type == "none":
        raise ABError("--spec-type must name a speculative decoding type (e.g. draft-simple)")
    if binaries is None:
        say("finding llama.cpp binaries")
        binaries = llama.ensure()
    model_path = Path(model) if model is not None else gemma_270m().path
    draft_path = (
        Path(draft) if draft is not None else (model_path if uses_draft(spec_type) else None)
    )
    for what, p in (("model", model_path), ("draft", draft_path)):
        if p is not None and not p.is_file():
            raise ABError(f"{what} file not found: {p}")
    n_par = parallel or min(settings.seeds, 4)
    # Each slot gets ctx/np tokens: room for the prompt (plus a chat template) and the answer.
    per_slot = settings.tokens + max(256, len(settings.prompt.encode()) + 128)
    ctx_size = n_par * (-(-per_slot // 256) * 256)
    logs = Path(log_dir) if log_dir is not None else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    local = {
        "model": str(model_path),
        "draft": str(draft_path) if draft_path else None,
        "spec_type": spec_type,
        "parallel": n_par,
        "ctx_size": ctx_size,
        "binaries": str(binaries.bin_dir),
    }
    with contextlib.ExitStack() as stack:
        servers = {}
        for side in SIDES:
            say(f"starting the {side} llama-server")
            srv = LlamaServer(
                binaries,
                model_path,
                draft=draft_path if side == "spec" else None,
                spec_type=spec_type if side == "spec" else None,
                parallel=n_par,
                ctx_size=ctx_size,
                log_path=logs / f"ab-{side}.log" if logs is not None else None,
                name=f"ab-{side}",
            )
            servers[side] = stack.enter_context(srv)
        say("sampling")
        return run(
            servers["plain"].url,
            servers["spec"].url,
            settings,
            plot=plot,
            progress=progress,
            local=local,
        )


# ---------------------------------------------------------------------------------------------
# rendering shared by the CLI and the audit


def report_shape_rows(result: ABResult) -> list[list[Any]]:
    """The field report's table: one row per side, naive mean per seed, then the mean."""
    rows: list[list[Any]] = []
    for side in SIDES:
        by = result.by_seed(side)
        s = result.side(side)
        label = "no speculation" if side == "plain" else "speculating"
        rows.append(
            [label]
            + [_fmt(by[k].naive_mean) if k in by else "-" for k in result.settings.seed_values]
            + [_fmt(s.naive_mean), f"{s.coverage:.1%}"]
        )
    return rows


def report_shape_headers(result: ABResult) -> list[str]:
    return (
        ["side"] + [f"seed {k}" for k in result.settings.seed_values] + ["mean (naive)", "coverage"]
    )


DETAIL_HEADERS = [
    "seed",
    "side",
    "naive mean",
    "real-only mean",
    "coverage",
    "real",
    "placeholders",
    "draft_n",
    "accepted",
]


def _ci(ci: tuple[float, float] | None, sep: str = " ") -> str:
    return "" if ci is None else f"{sep}[{ci[0]:.4f}, {ci[1]:.4f}]"


def detail_rows(result: ABResult, ci_sep: str = " ") -> list[list[Any]]:
    """Per seed and side, then a summary row per side (means with their t-intervals)."""
    rows: list[list[Any]] = []
    for r in result.responses:
        rows.append(
            [
                r.seed,
                r.side,
                _fmt(r.naive_mean),
                _fmt(r.real_mean),
                f"{r.coverage:.1%}",
                f"{r.real}/{r.tokens}",
                r.placeholder,
                "-" if r.draft_n is None else r.draft_n,
                "-" if r.draft_n_accepted is None else r.draft_n_accepted,
            ]
        )
    for side in SIDES:
        s = result.side(side)
        rows.append(
            [
                "all",
                side,
                _fmt(s.naive_mean) + _ci(s.naive_ci, ci_sep),
                _fmt(s.real_mean) + _ci(s.real_ci, ci_sep),
                f"{s.coverage:.1%}",
                f"{s.real}/{s.tokens}",
                s.placeholder,
                "-" if s.draft_n is None else s.draft_n,
                "-" if s.draft_n_accepted is None else s.draft_n_accepted,
            ]
        )
    return rows


def delta_line(d: Delta, confidence: float = CONFIDENCE) -> str:
    if d.mean is None:
        return f"Δ {d.name}: n/a (no seed with values on both sides)"
    ci = (
        f", {confidence:.0%} CI [{d.ci_low:+.4f}, {d.ci_high:+.4f}]"
        if d.ci_low is not None and d.ci_high is not None
        else ", no CI (1 seed)"
    )
    p = f", paired t-test p = {d.p_value:.3g}" if d.p_value is not None else ""
    return f"Δ {d.name}: {d.mean:+.4f}{ci} over {d.n} seeds{p}"


def side_line(s: SideSummary) -> str:
    said = {True: "speculates", False: "does not speculate", None: "unknown (no /slots)"}
    return f"{s.side} ({s.url}): /slots says it {said[s.speculative]}; {s.slots} slots used"


def markdown(result: ABResult, title: str | None = None) -> str:
    """The result as Markdown: report-shaped table, detail table, Δs and the verdict."""
    from specaudit.report import md_table

    st = result.settings
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines += [
        f"{st.seeds} seeds × {st.tokens} tokens, temperature {st.temperature:g}, "
        f"endpoint `{ENDPOINTS[st.endpoint]}`, {st.top_logprobs} candidates requested, "
        f"prompt {st.prompt!r}.",
        "",
        md_table(report_shape_headers(result), report_shape_rows(result)),
        "",
        md_table(DETAIL_HEADERS, detail_rows(result)),
        "",
        *[f"- {side_line(result.side(side))}" for side in SIDES],
        "- " + delta_line(result.delta_naive, st.confidence),
        "- " + delta_line(result.delta_real, st.confidence),
        "",
        f"**Verdict: {result.verdict.message}.**",
    ]
    if result.verdict.reasons:
        lines += [""] + [f"- {r}" for r in result.verdict.reasons]
    if result.plot is not None:
        lines += ["", f"Plot: `{result.plot}`"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# plot


def draw(result: ABResult, path: str | Path) -> Path:
    """A PNG a person reads at a glance: traces with placeholders marked, per-seed means."""
    import textwrap

    from specaudit import plots

    plt = plots.pyplot()
    colors = {"plain": plots.PLAIN_COLOR, "spec": plots.SPEC_COLOR}
    fig = plt.figure(figsize=(12, 8.2))
    gs = fig.add_gridspec(2, 3, height_ratios=[1.25, 1], hspace=0.42, wspace=0.32)
    ax_tr = fig.add_subplot(gs[0, :])
    ax_means = fig.add_subplot(gs[1, :2])
    ax_cov = fig.add_subplot(gs[1, 2])

    # 1. per-token traces, as reported: placeholders are the red x's sitting at 0.0
    marked = False
    for r in result.responses:
        xs = list(range(len(r.reported_logprobs)))
        ys = [v if v is not None else 0.0 for v in r.reported_logprobs]
        ax_tr.plot(xs, ys, color=colors[r.side], lw=1.1, alpha=0.55)
        ph = [(x, y) for x, y, real in zip(xs, ys, r.real_logprobs, strict=True) if real is None]
        if ph:
            px, py = zip(*ph, strict=True)
            ax_tr.scatter(
                px,
                py,
                marker="x",
                s=22,
                color=plots.MISSING_COLOR,
                linewidths=1.0,
                zorder=3,
                label=None if marked else "placeholder (0.0 sent, no candidates)",
            )
            marked = True
    for side in SIDES:
        s = result.side(side)
        ax_tr.plot([], [], color=colors[side], lw=2, label=f"{side}: {s.responses} responses")
    ax_tr.axhline(0.0, color="black", lw=0.6)
    ax_tr.set_title("Per-token logprob as the server reported it (all seeds overlaid)")
    ax_tr.set_xlabel("token index in response")
    ax_tr.set_ylabel("logprob (nats)")
    ax_tr.legend(loc="lower right", fontsize=9, framealpha=0.9)
    ax_tr.grid(alpha=0.3)

    # 2. per-seed means: filled = naive (what a client computes), hollow = real tokens only
    seeds = result.settings.seed_values
    offs = {"plain": -0.12, "spec": 0.12}
    for side in SIDES:
        by = result.by_seed(side)
        ks = [k for k in seeds if k in by]
        xs_n = [k + offs[side] for k in ks if by[k].naive_mean is not None]
        ys_n = [by[k].naive_mean for k in ks if by[k].naive_mean is not None]
        xs_r = [k + offs[side] for k in ks if by[k].real_mean is not None]
        ys_r = [by[k].real_mean for k in ks if by[k].real_mean is not None]
        ax_means.scatter(
            xs_n, ys_n, s=60, color=colors[side], label=f"{side}: naive mean", zorder=3
        )
        ax_means.scatter(
            xs_r,
            ys_r,
            s=150,
            facecolors="none",
            edgecolors=colors[side],
            linewidths=1.5,
            label=f"{side}: real tokens only",
            zorder=3,
        )
        for k in ks:  # a real-only mean over a handful of tokens says so
            rr = by[k]
            if rr.real_mean is not None and rr.real < rr.tokens:
                ax_means.annotate(
                    f"{rr.real} tok",
                    (k + offs[side], rr.real_mean),
                    xytext=(9, -3),
                    textcoords="offset points",
                    fontsize=8,
                    color=colors[side],
                )
        m = result.side(side).naive_mean
        if m is not None:
            ax_means.axhline(m, color=colors[side], ls="--", lw=1, alpha=0.8)
    ax_means.axhline(0.0, color="black", lw=0.6)
    ax_means.set_xticks(seeds)
    ax_means.set_xlim(seeds[0] - 0.6, seeds[-1] + 0.75)  # room for the "n tok" labels
    ax_means.set_xlabel("seed")
    ax_means.set_ylabel("mean logprob per token")
    ax_means.set_title("Per-seed means (dashed: mean over seeds of the naive means)")
    ax_means.legend(fontsize=8, loc="best", framealpha=0.9)
    ax_means.grid(alpha=0.3)

    # 3. coverage: real vs placeholder tokens per side
    reals = [result.side(n).real for n in SIDES]
    phs = [result.side(n).placeholder for n in SIDES]
    ax_cov.bar(list(SIDES), reals, color=[colors[n] for n in SIDES], label="real")
    ax_cov.bar(
        list(SIDES), phs, bottom=reals, color=plots.MISSING_COLOR, alpha=0.75, label="placeholder"
    )
    for i, name in enumerate(SIDES):
        sm = result.side(name)
        ax_cov.text(i, sm.tokens, f"{sm.coverage:.1%} real", ha="center", va="bottom", fontsize=10)
    ax_cov.set_ylim(0, max(1, max(result.side(n).tokens for n in SIDES)) * 1.4)
    ax_cov.set_ylabel("tokens")
    ax_cov.set_title("Coverage: real vs placeholder tokens")
    ax_cov.legend(fontsize=8, loc="upper center", ncol=2)

    st = result.settings
    head = (
        f"specaudit ab: {st.seeds} seeds × {st.tokens} tokens, T={st.temperature:g}, "
        f"{ENDPOINTS[st.endpoint]}"
    )
    verdict = textwrap.fill(result.verdict.message, 125)
    vcolor = {
        Verdict.INSTRUMENT_FAULT: plots.MISSING_COLOR,
        Verdict.CONSISTENT: "#2ca02c",
    }.get(result.verdict.kind, "#555555")
    fig.text(0.5, 0.995, head, ha="center", va="top", fontsize=12, weight="bold")
    fig.text(0.5, 0.962, verdict, ha="center", va="top", fontsize=10, color=vcolor)
    fig.subplots_adjust(top=0.86)
    return plots.save(fig, path)


# ---------------------------------------------------------------------------------------------
# audit section

AUDIT_FIXTURE_PROMPT_FALLBACK = "bcdbc"


def _audit_runs(ctx: AuditContext, seeds: int, tokens: int) -> list[tuple[str, ABResult]]:
    out: list[tuple[str, ABResult]] = []
    configs = [
        ("Gemma 3 270M", "gemma", DEFAULT_PROMPT),
        ("fixture", "fixture", getattr(getattr(ctx.fixture, "spec", None), "prompt", None)),
    ]
    for label, key, prompt in configs:
        ctx.progress(f"ab: {label}")
        plain = ctx.server(f"{key}-plain")
        spec = ctx.server(f"{key}-spec")
        settings = Settings(
            seeds=seeds, tokens=tokens, prompt=prompt or AUDIT_FIXTURE_PROMPT_FALLBACK
        )
        res = run(plain.url, spec.url, settings, plot=ctx.out_dir / f"ab-{key}.png")
        out.append((label, res))
    return out


def audit_section(
    ctx: AuditContext, seeds: int = DEFAULT_SEEDS, tokens: int = DEFAULT_TOKENS
) -> Section:
    """The report's aggregate table on Gemma 3 270M and on the fixture, with plots."""
    from specaudit.audit import Section
    from specaudit.report import md_table

    runs = _audit_runs(ctx, seeds, tokens)
    summary_rows = []
    for label, r in runs:
        summary_rows.append(
            [
                label,
                _fmt(r.plain.naive_mean),
                _fmt(r.spec.naive_mean),
                f"{r.plain.coverage:.1%}",
                f"{r.spec.coverage:.1%}",
                f"{r.delta_naive.mean:+.4f}{_ci_pair(r.delta_naive)}"
                if r.delta_naive.mean is not None
                else "n/a",
                r.verdict.kind.value,
            ]
        )
    md = [
        "Same prompt and seeds on a plain and a speculating server; naive = what a client "
        "that averages the logprobs it got computes (placeholders count as 0.0).",
        "",
        md_table(
            [
                "model",
                "plain naive mean",
                "spec naive mean",
                "plain coverage",
                "spec coverage",
                "Δ naive (spec − plain), 95% CI",
                "verdict",
            ],
            summary_rows,
        ),
    ]
    for label, r in runs:
        md += ["", markdown(r, title=label)]
    faults = [label for label, r in runs if r.verdict.kind is Verdict.INSTRUMENT_FAULT]
    summary = "; ".join(
        f"{label}: {r.verdict.kind.value} (naive {_fmt(r.plain.naive_mean)} plain vs "
        f"{_fmt(r.spec.naive_mean)} spec, spec coverage {r.spec.coverage:.0%})"
        for label, r in runs
    )
    from specaudit.report import to_jsonable

    return Section(
        key="ab",
        title="Aggregates: what placeholders do to a mean logprob (speculative vs plain)",
        markdown="\n".join(md),
        data={label: to_jsonable(r) for label, r in runs},
        plots=[r.plot for _, r in runs if r.plot is not None],
        status="finding" if faults else "ok",
        summary=summary,
    )


def _ci_pair(d: Delta) -> str:
    if d.ci_low is None or d.ci_high is None:
        return ""
    return f" [{d.ci_low:+.4f}, {d.ci_high:+.4f}]"


__all__ = [
    "ABError",
    "ABResult",
    "Delta",
    "Response",
    "Settings",
    "SideSummary",
    "Verdict",
    "VerdictInfo",
    "analyse",
    "audit_section",
    "decide",
    "draw",
    "markdown",
    "paired",
    "parse_response",
    "run",
    "run_local",
    "t_interval",
]
