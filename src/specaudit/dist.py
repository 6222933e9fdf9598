"""`specaudit dist`: does an engine that speculates still sample from the target distribution?

Speculative decoding is meant to be invisible: the tokens must follow the target model's
distribution exactly. This module samples many seeds from an engine running a fixture model
(see `specaudit.fixtures`) and compares what came out with the distribution the fixture's
*definition* implies -- computed in closed form, never taken from the engine under test.

What is tested, for each engine:
- every tested position t, conditionally on the tokens generated before it (contexts with the
  same true next-token distribution are pooled; they are interchangeable under the null);
- the joint distribution of the first few positions;
- one verdict at a stated alpha: BROKEN if a Holm-corrected test rejects (or a token with true
  probability zero shows up), PRESERVED if nothing rejects and the data rule out a next-token
  TV distance above the tolerance at every position, INCONCLUSIVE otherwise.
- `sequential=True` instead stops as soon as the evidence is decisive, using an anytime-valid
  e-process (BROKEN) and alpha-spending TV bounds (PRESERVED), and reports the samples used.

Engines: a llama-server we spawn with and without a draft model (`server`), any
llama-server-compatible URL (`url`), and llama.cpp's `llama-speculative` example program run
once per seed (`speculative-example`). See docs/dist.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from specaudit import audit, fixtures, stats
from specaudit.client import AsyncClient, Client, ClientError
from specaudit.errors import SpecauditError
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer
from specaudit.paths import cache_root
from specaudit.stats import GofResult, TvInterval, Verdict

ENGINES = ("server", "speculative-example", "url")
DEFAULT_TOKENS = 4  # the report's setting: with 4 the server drafts on every request
MIN_TOKENS = 3  # llama-server drafts nothing when n_predict < 3
MAX_JOINT = 6
DEFAULT_ALPHA = 0.01
DEFAULT_TOLERANCE = 0.15  # ~the TV 1000 samples can certify at 4 positions (docs/dist.md)
SEQUENTIAL_FIRST_LOOK = 25  # interim TV looks at 25, 50, 100, 200, ... samples
# The closed form models this chain (fixtures.SamplerSettings); sent explicitly so a server's
# own defaults (penalties, DRY, XTC, another order) cannot change what is sampled.
SAMPLER_CHAIN = ("top_k", "top_p", "min_p", "temperature")
EXAMPLE_RETRIES = 50  # see ExampleEngine: llama.cpp may lose the output tail at exit

ProgressFn = Callable[[str, int, int], None]
"""Called with (engine label, samples done, samples planned)."""


class DistError(SpecauditError):
    """Bad input for `dist`, or an engine that did not answer like the fixture it should run."""


# ---------------------------------------------------------------------------------------------
# results


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


# ---------------------------------------------------------------------------------------------
# ground truth (from the fixture definition only)


class Truth:
    """Closed-form next-token distributions of a fixture, cached by generated prefix."""

    def __init__(self, spec: fixtures.FixtureSpec, workload: Workload) -> None:
        self.spec = spec
        self.workload = workload
        self.labels: tuple[str, ...] = spec.tokens
        self.index = {t: i for i, t in enumerate(self.labels)}
        self._cache: dict[str, np.ndarray] = {}
        self._marginals: dict[int, np.ndarray] = {}

    def next(self, prefix: str) -> np.ndarray:
        """True distribution over all tokens of the token after prompt + `prefix`."""
        p = self._cache.get(prefix)
        if p is None:
            try:
                d = fixtures.conditional_distribution(
                    self.spec, self.workload.prompt, prefix, self.workload.sampler
                )
            except fixtures.AmbiguousSamplingError as e:
                raise DistError(f"ambiguous sampler settings for this fixture: {e}") from None
            p = np.array([d[t] for t in self.labels], dtype=float)
            self._cache[prefix] = p
        return p

    def joint(self, n: int) -> dict[str, float]:
        try:
            return fixtures.sequence_distribution(
                self.spec, self.workload.prompt, n, self.workload.sampler
            )
        except fixtures.AmbiguousSamplingError as e:
            raise DistError(f"ambiguous sampler settings for this fixture: {e}") from None
        except ValueError as e:
            raise DistError(f"joint distribution undefined: {e}") from None

    def marginal(self, t: int) -> np.ndarray:
        """True distribution of the token at position t (1-based), averaged over prefixes.

        A forward pass whose state is the last generated letter: a fixture's logits depend on
        the last token only (see `specaudit.fixtures`), so that letter is all the past it sees.
        """
        cached = self._marginals.get(t)
        if cached is not None:
            return cached
        state: dict[str, float] = {"": 1.0}
        letters = set(self.spec.letters)
        for _ in range(t - 1):
            nxt: dict[str, float] = {}
            for last, w in state.items():
                for j, q in enumerate(self.next(last)):
                    if q <= 0:
                        continue
                    tok = self.labels[j]
                    if tok not in letters:
                        raise DistError(f"special token {tok!r} is possible: generation may stop")
                    nxt[tok] = nxt.get(tok, 0.0) + w * float(q)
            state = nxt
        out = np.zeros(len(self.labels))
        for last, w in state.items():
            out += w * self.next(last)
        self._marginals[t] = out
        return out

    def most_likely_prefix(self, length: int) -> str:
        """The generated prefix of this length the target is most likely to produce."""
        if length == 0:
            return ""
        d = self.joint(length)
        return max(d, key=lambda s: (d[s], s))


def _key(p: np.ndarray) -> tuple[float, ...]:
    return tuple(float(x) for x in p)


# ---------------------------------------------------------------------------------------------
# analysis (fixed sample)


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


def _position_strata(
    truth: Truth, texts: Sequence[str], t: int
) -> dict[tuple[float, ...], tuple[np.ndarray, np.ndarray, dict[str, None]]]:
    """Counts of the token at position t (1-based), grouped by true conditional distribution.

    Contexts with the same true next-token distribution are interchangeable under the null, so
    they are pooled; the prefixes pooled are kept (in order of appearance) for labels.
    """
    groups: dict[tuple[float, ...], tuple[np.ndarray, np.ndarray, dict[str, None]]] = {}
    for text in texts:
        prefix = text[: t - 1]
        p = truth.next(prefix)
        k = _key(p)
        g = groups.get(k)
        if g is None:
            g = (np.zeros(len(p), dtype=np.int64), p, {})
            groups[k] = g
        g[0][truth.index[text[t - 1]]] += 1
        g[2][prefix] = None
    return groups


def _marginal_counts(truth: Truth, texts: Sequence[str], t: int) -> np.ndarray:
    counts = np.zeros(len(truth.labels), dtype=np.int64)
    for text in texts:
        counts[truth.index[text[t - 1]]] += 1
    return counts


def _position_tv(truth: Truth, texts: Sequence[str], t: int, alpha: float) -> TvInterval:
    """TV between the engine's and the target's distribution of the token at position t."""
    return stats.tv_interval(_marginal_counts(truth, texts, t), truth.marginal(t), alpha)


def analyze(
    spec: fixtures.FixtureSpec,
    workload: Workload,
    samples: Sequence[Sample],
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    engine: str = "engine",
    kind: str = "url",
    seconds: float = 0.0,
    mc_seed: int = 0,
) -> EngineResult:
    """Test samples against the fixture's closed-form distributions (fixed-sample analysis)."""
    if not samples:
        raise DistError(f"{engine}: no samples to analyse")
    truth = Truth(spec, workload)
    texts = [s.text for s in samples]
    for s in samples:
        _check_text(s.text, workload.tokens, spec, engine)
    tests: list[TestResult] = []
    contexts: list[ContextResult] = []
    headline: list[ContextResult] = []
    tv_uppers: list[float] = []
    for t in range(1, workload.positions + 1):
        groups = _position_strata(truth, texts, t)
        strata = [(c, p) for c, p, _ in groups.values()]
        gof = stats.stratified_gof(strata, seed=mc_seed + t)
        tv = _position_tv(truth, texts, t, alpha)
        tv_uppers.append(tv.upper)
        n = int(sum(c.sum() for c, _ in strata))
        tests.append(
            TestResult(f"position {t}", "position", t, n, len(strata), gof, 1.0, tv, False)
        )
        want = truth.most_likely_prefix(t - 1) if t <= 3 else None
        for counts, p, pref in sorted(groups.values(), key=lambda g: -int(g[0].sum())):
            prefixes = list(pref)
            ctx = ContextResult(
                position=t,
                label=_context_label(workload.prompt, prefixes),
                prefixes=sorted(prefixes)[:8],
                n=int(counts.sum()),
                tokens=_rows(truth.labels, counts, p),
                gof=stats.multinomial_gof(counts, p, seed=mc_seed + 100 * t),
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
        joint_p = truth.joint(j)
        seqs = sorted(joint_p)
        counts_d: dict[str, int] = {}
        for text in texts:
            counts_d[text[:j]] = counts_d.get(text[:j], 0) + 1
        extra = sorted(s for s in counts_d if s not in joint_p)  # impossible sequences seen
        cells = seqs + extra
        counts = np.array([counts_d.get(s, 0) for s in cells], dtype=np.int64)
        probs = np.array([joint_p.get(s, 0.0) for s in cells])
        probs = probs / probs.sum()
        gof = stats.multinomial_gof(counts, probs, seed=mc_seed + 1000)
        tv = stats.tv_interval(counts, probs, alpha)
        tests.append(
            TestResult(
                f"joint 1-{j}", "joint", 0, int(counts.sum()), len(seqs), gof, 1.0, tv, False
            )
        )
    adj = stats.holm([x.gof.p_value for x in tests])
    for x, pa in zip(tests, adj, strict=True):
        x.p_holm = pa
        x.rejected = pa < alpha
    # each generated token is in exactly one position test
    impossible = sum(x.gof.impossible for x in tests if x.kind == "position")
    verdict = stats.decide(adj, alpha, tv_uppers, tolerance, impossible > 0)
    reason = _reason(verdict, tests, tv_uppers, alpha, tolerance, impossible)
    drafted = [s.drafted for s in samples if s.drafted is not None]
    accepted = [s.accepted for s in samples if s.accepted is not None]
    return EngineResult(
        engine=engine,
        kind=kind,
        verdict=verdict,
        alpha=alpha,
        tolerance=tolerance,
        n_samples=len(samples),
        first_seed=min(s.seed for s in samples),
        last_seed=max(s.seed for s in samples),
        drafted=sum(drafted) if drafted else None,
        accepted=sum(accepted) if accepted else None,
        tests=tests,
        contexts=contexts,
        headline=headline,
        impossible=impossible,
        reason=reason,
        seconds=seconds,
    )


def _reason(
    verdict: Verdict,
    tests: list[TestResult],
    tv_uppers: list[float],
    alpha: float,
    tolerance: float,
    impossible: int,
) -> str:
    m = len(tests)
    if impossible:
        return f"{impossible} sampled token(s) have true probability 0: broken with certainty"
    if verdict is Verdict.BROKEN:
        worst = min(tests, key=lambda x: x.p_holm)
        return (
            f"{worst.name} rejects: p {_p_eq(worst.gof.p_value)} "
            f"(Holm over {m}: p {_p_eq(worst.p_holm)}), alpha {alpha:g}"
        )
    worst_tv = max(tv_uppers) if tv_uppers else math.nan
    if verdict is Verdict.PRESERVED:
        return (
            f"no test rejects at {alpha:g} (Holm over {m}); next-token TV <= {worst_tv:.3f} "
            f"at every position ({1 - alpha:.0%} bound, tolerance {tolerance:g})"
        )
    return (
        f"no test rejects at {alpha:g} (Holm over {m}), but TV up to {worst_tv:.3f} is not "
        f"ruled out (tolerance {tolerance:g}): more samples needed"
    )


def _check_text(text: str, tokens: int, spec: fixtures.FixtureSpec, engine: str) -> None:
    if len(text) != tokens or any(ch not in spec.letters for ch in text):
        raise DistError(
            f"{engine} generated {text!r}, not {tokens} letters of fixture {spec.name!r} "
            "(is it running that fixture?)"
        )


# ---------------------------------------------------------------------------------------------
# engines


class Engine(Protocol):
    label: str
    kind: str
    concurrency: int

    async def sample(self, seed: int) -> Sample: ...

    async def aclose(self) -> None: ...


class ServerEngine:
    """A llama-server (or compatible) URL, sampled on native /completion, requests concurrent
    over its slots."""

    def __init__(
        self,
        url: str,
        spec: fixtures.FixtureSpec,
        workload: Workload,
        *,
        label: str | None = None,
        kind: str = "url",
        concurrency: int | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.spec = spec
        self.workload = workload
        self.label = label or f"url {self.url}"
        self.kind = kind
        self.concurrency = concurrency or 2 * _slot_count(self.url)
        self._client = AsyncClient(self.url, timeout=timeout, max_connections=self.concurrency)
        s = workload.sampler
        self._body: dict[str, Any] = {
            "prompt": workload.prompt,
            "n_predict": workload.tokens,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "min_p": s.min_p,
            "samplers": list(SAMPLER_CHAIN),
            "dynatemp_range": 0.0,
            "mirostat": 0,
            "n_probs": 0,
        }

    def body(self, seed: int) -> dict[str, Any]:
        """The native /completion request for one seed: every sampler knob explicit."""
        return {**self._body, "seed": seed}

    async def sample(self, seed: int) -> Sample:
        r = await self._client.post("/completion", self.body(seed))
        text = r.get("content")
        if not isinstance(text, str):
            raise DistError(f"{self.label}: /completion answered without a 'content' string")
        _check_text(text, self.workload.tokens, self.spec, self.label)
        tm_raw = r.get("timings")
        tm: dict[str, Any] = tm_raw if isinstance(tm_raw, dict) else {}
        dn, da = tm.get("draft_n"), tm.get("draft_n_accepted")
        return Sample(
            seed,
            text,
            dn if isinstance(dn, int) else None,
            da if isinstance(da, int) else None,
        )

    async def aclose(self) -> None:
        await self._client.aclose()


def _slot_count(url: str) -> int:
    """Parallel slots of a server (from /slots, else /props), 1 if it does not say."""
    try:
        with Client(url, timeout=10) as c:
            slots = c.slots()
            if slots:
                return len(slots)
            props = c.props() or {}
    except ClientError as e:
        raise DistError(str(e)) from None
    n = props.get("total_slots")
    return n if isinstance(n, int) and n > 0 else 1


class ExampleEngine:
    """llama.cpp's `llama-speculative` example, one process per seed, processes in parallel.

    Its generated text goes through llama.cpp's asynchronous logger, which can lose the tail
    of the output when the process exits; a run whose output is incomplete (no closing blank
    lines, no final statistics) is therefore repeated (same seed, same result).
    """

    def __init__(
        self,
        binary: Path,
        target: Path,
        draft: Path,
        spec: fixtures.FixtureSpec,
        workload: Workload,
        *,
        jobs: int | None = None,
        label: str = "llama-speculative",
    ) -> None:
        if not Path(binary).is_file():
            raise DistError(f"llama-speculative binary not found: {binary}")
        self.binary = Path(binary)
        self.target = Path(target)
        self.draft = Path(draft)
        self.spec = spec
        self.workload = workload
        self.label = label
        self.kind = "speculative-example"
        self.concurrency = jobs or os.cpu_count() or 1
        self.retries = 0  # incomplete outputs repeated so far

    def argv(self, seed: int) -> list[str]:
        s = self.workload.sampler
        return [
            str(self.binary),
            "-m", str(self.target),
            "-md", str(self.draft),
            "-p", self.workload.prompt,
            "-n", str(self.workload.tokens),
            "--samplers", ";".join(SAMPLER_CHAIN),
            "--top-k", str(s.top_k),
            "--top-p", repr(float(s.top_p)),
            "--min-p", repr(float(s.min_p)),
            "--temp", repr(float(s.temperature)),
            "--seed", str(seed),
            "-t", "1",  # one thread per process: the model is tiny and processes run in parallel
        ]  # fmt: skip

    async def sample(self, seed: int) -> Sample:
        last = ""
        for _ in range(EXAMPLE_RETRIES):
            proc = await asyncio.create_subprocess_exec(
                *self.argv(seed),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                out_b, err_b = await proc.communicate()
            except asyncio.CancelledError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                raise
            out = out_b.decode("utf-8", "replace")
            err = err_b.decode("utf-8", "replace")
            if proc.returncode != 0:
                tail = [ln for ln in err.splitlines() if ln.strip()]
                raise DistError(
                    f"llama-speculative exited with code {proc.returncode} (seed {seed}): "
                    f"{tail[-1] if tail else 'no output'}"
                )
            parsed = parse_example_output(out, err, self.workload.prompt)
            if parsed is not None and len(parsed[0]) >= self.workload.tokens:
                text, drafted, accepted = parsed
                text = text[: self.workload.tokens]
                _check_text(text, self.workload.tokens, self.spec, self.label)
                return Sample(seed, text, drafted, accepted)
            self.retries += 1
            last = out.strip()[:60]
        raise DistError(
            f"llama-speculative (seed {seed}) printed incomplete output {EXAMPLE_RETRIES} times "
            f"(last: {last!r})"
        )

    async def aclose(self) -> None:
        return None


_STAT_RE = re.compile(r"\bn_(drafted|accept)\s*=\s*(\d+)")


def parse_example_output(stdout: str, stderr: str, prompt: str) -> tuple[str, int, int] | None:
    """(generated text, drafted, accepted) from one llama-speculative run; None if incomplete.

    stdout is ``\\n\\n`` + prompt + generated + ``\\n\\n`` + ``\\n\\n``; the last two blank lines
    are logged after the statistics, so seeing them means nothing before was lost.
    """
    found = dict((k, int(v)) for k, v in _STAT_RE.findall(stderr))
    if "drafted" not in found or "accept" not in found:
        return None
    if len(stdout) - len(stdout.rstrip("\n")) < 4:
        return None
    body = stdout.strip("\n")
    if not body.startswith(prompt):
        return None
    return body[len(prompt) :], found["drafted"], found["accept"]


# ---------------------------------------------------------------------------------------------
# driving an engine


async def _drive(
    engine: Engine,
    seeds: Sequence[int],
    consume: Callable[[Sample], bool],
) -> int:
    """Sample `seeds` concurrently; hand results to `consume` in seed order until it says stop.

    Returns how many samples were drawn. On stop the few samples in flight are let finish and
    dropped (milliseconds; a process killed mid-start could be left unreaped); on an error or
    an interrupt they are cancelled.
    """
    order = list(seeds)
    running: dict[asyncio.Task[Sample], int] = {}
    ready: dict[int, Sample] = {}
    launched = consumed = drawn = 0
    window = max(1, engine.concurrency)
    finished = False
    try:
        while consumed < len(order):
            while (
                launched < len(order) and len(running) < window and launched - consumed < 4 * window
            ):
                seed = order[launched]
                running[asyncio.ensure_future(engine.sample(seed))] = seed
                launched += 1
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                seed = running.pop(task)
                ready[seed] = task.result()  # re-raises the engine's error
                drawn += 1
            while consumed < len(order) and order[consumed] in ready:
                stop = consume(ready.pop(order[consumed]))
                consumed += 1
                if stop:
                    finished = True
                    return drawn + len(running)
        finished = True
        return drawn
    finally:
        if running:
            if not finished:
                for task in running:
                    task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


def collect(
    engine: Engine, seeds: Sequence[int], progress: ProgressFn | None = None
) -> list[Sample]:
    """Just the samples, in seed order, no analysis (benchmarks, studies over seed blocks)."""
    out: list[Sample] = []
    report = progress or (lambda label, done, planned: None)

    def consume(s: Sample) -> bool:
        out.append(s)
        report(engine.label, len(out), len(seeds))
        return False

    async def go() -> None:
        try:
            await _drive(engine, seeds, consume)
        finally:
            await engine.aclose()

    asyncio.run(go())
    return out


def measure(
    engine: Engine,
    spec: fixtures.FixtureSpec,
    workload: Workload,
    seeds: Sequence[int],
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    sequential: bool = False,
    progress: ProgressFn | None = None,
) -> EngineResult:
    """Sample `seeds` from `engine` and test them (fixed sample, or sequential with early stop)."""
    return asyncio.run(
        measure_async(
            engine, spec, workload, seeds,
            alpha=alpha, tolerance=tolerance, sequential=sequential, progress=progress,
        )
    )  # fmt: skip


async def measure_async(
    engine: Engine,
    spec: fixtures.FixtureSpec,
    workload: Workload,
    seeds: Sequence[int],
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    sequential: bool = False,
    progress: ProgressFn | None = None,
) -> EngineResult:
    truth = Truth(spec, workload)
    samples: list[Sample] = []
    total = len(seeds)
    report = progress or (lambda label, done, planned: None)
    seq = _Sequential(truth, workload, alpha, tolerance, total) if sequential else None

    def consume(s: Sample) -> bool:
        samples.append(s)
        report(engine.label, len(samples), total)
        return seq.add(s) if seq is not None else False

    t0 = time.perf_counter()
    try:
        drawn = await _drive(engine, seeds, consume)
    finally:
        await engine.aclose()
    seconds = time.perf_counter() - t0
    res = analyze(
        spec, workload, samples,
        alpha=alpha, tolerance=tolerance, engine=engine.label, kind=engine.kind, seconds=seconds,
    )  # fmt: skip
    if seq is not None:
        res.sequential = seq.result(drawn)
        res.verdict = seq.verdict
        res.reason = seq.reason()
    return res


def replay_sequential(
    spec: fixtures.FixtureSpec,
    workload: Workload,
    samples: Sequence[Sample],
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[Verdict, SequentialResult]:
    """The sequential procedure run over samples already drawn (in their order)."""
    seq = _Sequential(Truth(spec, workload), workload, alpha, tolerance, len(samples))
    for s in samples:
        if seq.add(s):
            break
    return seq.verdict, seq.result(len(samples))


class _Sequential:
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
        self.texts: list[str] = []
        self.looks = 0
        self.next_look = SEQUENTIAL_FIRST_LOOK
        self.tv_uppers: list[float] = []
        self.verdict = Verdict.INCONCLUSIVE
        self.decided_by = "max-samples"
        self.used = 0

    def add(self, s: Sample) -> bool:
        self.texts.append(s.text)
        for t in range(1, self.workload.positions + 1):
            p = self.truth.next(s.text[: t - 1])
            self.eproc.update((t, _key(p)), p, self.truth.index[s.text[t - 1]])
        n = len(self.texts)
        self.used = n
        if self.eproc.rejects(self.alpha):
            self.verdict, self.decided_by = Verdict.BROKEN, "e-value"
            return True
        if n >= self.next_look or n >= self.max_samples:
            self.looks += 1
            self.next_look *= 2
            a = stats.alpha_spending(self.looks, self.alpha)
            self.tv_uppers = [
                _position_tv(self.truth, self.texts, t, a).upper
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


# ---------------------------------------------------------------------------------------------
# orchestration


def make_workload(
    spec: fixtures.FixtureSpec,
    *,
    prompt: str | None = None,
    tokens: int = DEFAULT_TOKENS,
    positions: int | None = None,
    joint: int | None = None,
    sampler: fixtures.SamplerSettings = fixtures.REPORT_SAMPLER,
) -> Workload:
    """Validate the workload against the fixture (one-line DistError on bad input)."""
    prompt = spec.prompt if prompt is None else prompt
    if not prompt or any(ch not in spec.letters for ch in prompt):
        raise DistError(
            f"--prompt {prompt!r} must be a non-empty string of the fixture's letters "
            f"({''.join(spec.letters)})"
        )
    if tokens < MIN_TOKENS:
        raise DistError(
            f"--tokens must be at least {MIN_TOKENS} (got {tokens}): llama-server drafts "
            "nothing on shorter requests"
        )
    if tokens + len(prompt) >= spec.config.context_length:
        raise DistError(f"--tokens {tokens} does not fit the fixture's context")
    positions = tokens if positions is None else positions
    if not 1 <= positions <= tokens:
        raise DistError(f"--positions must be between 1 and --tokens ({tokens}), got {positions}")
    joint = min(3, positions) if joint is None else joint
    if not 0 <= joint <= min(positions, MAX_JOINT):
        raise DistError(
            f"--joint must be between 0 and min(--positions, {MAX_JOINT}) = "
            f"{min(positions, MAX_JOINT)}, got {joint}"
        )
    s = sampler
    if s.top_p <= 0 or s.top_p > 1 or s.min_p < 0 or s.min_p >= 1 or s.top_k < 0:
        raise DistError(
            "sampler settings out of range (0 < top-p <= 1, 0 <= min-p < 1, top-k >= 0)"
        )
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise DistError("--temperature must be >= 0")
    wl = Workload(prompt, tokens, positions, joint, sampler)
    truth = Truth(spec, wl)
    truth.next("")  # surfaces ambiguous settings now
    if joint:
        truth.joint(joint)
    return wl


def load_fixture(
    path: str | os.PathLike[str] | None, work_dir: Path | None = None
) -> fixtures.FixtureSet:
    """The fixture at `path` (SHA-256 verified), or the default fixture built into `work_dir`."""
    if path is None:
        # Building is deterministic and atomic, so a shared cache directory is safe.
        d = work_dir or (cache_root() / "fixtures")
        return fixtures.build(d / "default")
    try:
        return fixtures.load(path)
    except fixtures.FixtureError as e:
        raise DistError(f"fixture {path}: {e}") from None


def _check_common(
    engines: Sequence[str], url: str | None, seeds: int, alpha: float, tolerance: float
) -> None:
    if not engines:
        raise DistError("no engine given")
    for e in engines:
        if e not in ENGINES:
            raise DistError(f"unknown engine {e!r} (one of {', '.join(ENGINES)})")
    if "url" in engines and not url:
        raise DistError("--engine url needs --url")
    if seeds < 1:
        raise DistError(f"--seeds must be at least 1, got {seeds}")
    if not 0 < alpha < 1:
        raise DistError(f"--alpha must be in (0, 1), got {alpha}")
    if not 0 < tolerance <= 1:
        raise DistError(f"--tolerance must be in (0, 1], got {tolerance}")


def validate(
    engines: Sequence[str],
    *,
    fixture: str | os.PathLike[str] | fixtures.FixtureSet | None = None,
    url: str | None = None,
    prompt: str | None = None,
    tokens: int = DEFAULT_TOKENS,
    positions: int | None = None,
    joint: int | None = None,
    sampler: fixtures.SamplerSettings = fixtures.REPORT_SAMPLER,
    seeds: int = 1000,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    work_dir: Path | None = None,
) -> tuple[fixtures.FixtureSet, Workload]:
    """Check every input before anything slow starts; returns the fixture and the workload."""
    _check_common(engines, url, seeds, alpha, tolerance)
    fs = fixture if isinstance(fixture, fixtures.FixtureSet) else load_fixture(fixture, work_dir)
    wl = make_workload(
        fs.spec, prompt=prompt, tokens=tokens, positions=positions, joint=joint, sampler=sampler
    )
    return fs, wl


def needs_binaries(engines: Sequence[str]) -> bool:
    return any(e in ("server", "speculative-example") for e in engines)


@contextlib.contextmanager
def spawn_server(
    binaries: LlamaBinaries,
    fixture: fixtures.FixtureSet,
    *,
    draft: bool,
    parallel: int = 4,
    log_dir: Path | None = None,
) -> Iterator[LlamaServer]:
    """A llama-server on the fixture, with (`--spec-type draft-simple`) or without a draft."""
    name = "dist-spec" if draft else "dist-plain"
    srv = LlamaServer(
        binaries,
        fixture.target,
        draft=fixture.draft if draft else None,
        spec_type="draft-simple" if draft else None,
        parallel=parallel,
        ctx_size=fixture.spec.config.context_length * parallel,
        # The fixture needs no second thread; on a busy machine extra threads only spin.
        extra_args=["-t", "1"],
        log_path=(log_dir / f"{name}.log") if log_dir else None,
        name=name,
    )
    with srv:
        yield srv


def run(
    engines: Sequence[str] = ("server", "speculative-example"),
    *,
    fixture: str | os.PathLike[str] | fixtures.FixtureSet | None = None,
    url: str | None = None,
    prompt: str | None = None,
    tokens: int = DEFAULT_TOKENS,
    positions: int | None = None,
    joint: int | None = None,
    sampler: fixtures.SamplerSettings = fixtures.REPORT_SAMPLER,
    seeds: int = 1000,
    seed_start: int = 1,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    sequential: bool = False,
    parallel: int = 4,
    concurrency: int | None = None,
    jobs: int | None = None,
    binaries: LlamaBinaries | Callable[[], LlamaBinaries] | None = None,
    plot: Path | None = None,
    progress: ProgressFn | None = None,
    work_dir: Path | None = None,
) -> DistResult:
    """Run the distribution test on each engine (`server` means two: without and with a draft)."""
    fs, wl = validate(
        engines,
        fixture=fixture,
        url=url,
        prompt=prompt,
        tokens=tokens,
        positions=positions,
        joint=joint,
        sampler=sampler,
        seeds=seeds,
        alpha=alpha,
        tolerance=tolerance,
        work_dir=work_dir,
    )
    seed_list = list(range(seed_start, seed_start + seeds))
    kw: dict[str, Any] = dict(
        alpha=alpha, tolerance=tolerance, sequential=sequential, progress=progress
    )

    def bins() -> LlamaBinaries:
        if isinstance(binaries, LlamaBinaries):
            return binaries
        if callable(binaries):
            return binaries()
        from specaudit import llama

        return llama.ensure()

    results: list[EngineResult] = []
    for name in dict.fromkeys(engines):
        if name == "server":
            b = bins()
            for draft in (False, True):
                with spawn_server(b, fs, draft=draft, parallel=parallel, log_dir=work_dir) as srv:
                    eng = ServerEngine(
                        srv.url, fs.spec, wl,
                        label="llama-server + draft" if draft else "llama-server, no draft",
                        kind="server-spec" if draft else "server-plain",
                        concurrency=concurrency or 2 * parallel,
                    )  # fmt: skip
                    results.append(measure(eng, fs.spec, wl, seed_list, **kw))
        elif name == "speculative-example":
            ex = ExampleEngine(bins().speculative, fs.target, fs.draft, fs.spec, wl, jobs=jobs)
            results.append(measure(ex, fs.spec, wl, seed_list, **kw))
        else:
            assert url is not None
            eng = ServerEngine(url, fs.spec, wl, concurrency=concurrency)
            results.append(measure(eng, fs.spec, wl, seed_list, **kw))
    out = DistResult(
        fixture=fs.spec.name,
        fixture_dir=fs.dir,
        sha256=dict(fs.sha256),
        workload=wl,
        alpha=alpha,
        tolerance=tolerance,
        sequential=sequential,
        engines=results,
    )
    if plot is not None:
        out.plot = plot_results(out, plot)
    return out


# ---------------------------------------------------------------------------------------------
# rendering


def tokens_cell(ctx: ContextResult) -> str:
    """'e .330 (.345)  g .452 (.452) ...': observed frequency (expected probability)."""
    return "  ".join(f"{r.token} {r.frequency:.3f} ({r.expected:.3f})" for r in ctx.tokens)


def test_rows(e: EngineResult) -> list[tuple[Any, ...]]:
    return [
        (
            x.name,
            x.n,
            x.contexts,
            x.gof.method,
            _fmt_stat(x.gof.statistic),
            x.gof.df,
            _fmt_p(x.gof.p_value),
            _fmt_p(x.p_holm),
            f"{x.tv.estimate:.3f} [{x.tv.lower:.3f}, {x.tv.upper:.3f}]",
            "reject" if x.rejected else "-",
        )
        for x in e.tests
    ]


TEST_HEADERS = ("test", "n", "contexts", "method", "G", "df", "p", "p (Holm)", "TV [CI]", "")
CONTEXT_HEADERS = ("pos", "context", "n", "observed (expected)", "p", "TV [CI]")


def context_rows(e: EngineResult) -> list[tuple[Any, ...]]:
    return [
        (
            c.position,
            c.label,
            c.n,
            tokens_cell(c),
            _fmt_p(c.gof.p_value),
            f"{c.tv.estimate:.3f} [{c.tv.lower:.3f}, {c.tv.upper:.3f}]",
        )
        for c in e.headline
    ]


def _fmt_p(p: float) -> str:
    if p == 0:
        return "0"  # only for impossible outcomes: certainty
    if p < 1e-300:
        return "<1e-300"
    return f"{p:.3g}" if p >= 1e-4 else f"{p:.1e}"


def _p_eq(p: float) -> str:
    """'= 0.0424' or '< 1e-300', for sentences."""
    f = _fmt_p(p)
    return f"< {f[1:]}" if f.startswith("<") else f"= {f}"


def _fmt_stat(g: float) -> str:
    return "inf" if math.isinf(g) else f"{g:.2f}"


def draft_cell(e: EngineResult) -> str:
    if e.drafted is None:
        return "-"
    return f"{e.drafted} drafted, {e.accepted} accepted"


def evidence_cell(e: EngineResult) -> str:
    """The number the verdict rests on: e-value (sequential) or smallest Holm p (fixed)."""
    if e.sequential is not None:
        q = e.sequential
        ev = math.exp(q.log_e_value) if q.log_e_value < 700 else math.inf
        return f"e = {ev:.3g} (reject at {q.e_threshold:g})"
    return f"min p (Holm) {_p_eq(min((x.p_holm for x in e.tests), default=1.0))}"


def summary_rows(res: DistResult) -> list[tuple[Any, ...]]:
    return [
        (e.engine, e.verdict.value, e.n_samples, draft_cell(e), evidence_cell(e), e.reason)
        for e in res.engines
    ]


SUMMARY_HEADERS = ("engine", "verdict", "samples", "drafted/accepted", "evidence", "why")


def to_markdown(res: DistResult) -> str:
    from specaudit.report import md_table

    wl = res.workload
    s = wl.sampler
    lines = [
        f"Fixture `{res.fixture}`, prompt `{wl.prompt}`, {wl.tokens} tokens per sample, "
        f"top-k {s.top_k}, top-p {s.top_p:g}, min-p {s.min_p:g}, temperature {s.temperature:g}; "
        f"alpha {res.alpha:g}, TV tolerance {res.tolerance:g}"
        + ("; sequential (anytime-valid)" if res.sequential else "")
        + ". Expected values come from the fixture's definition (closed form).",
        "",
        md_table(SUMMARY_HEADERS, summary_rows(res)),
    ]
    for e in res.engines:
        lines += [
            "",
            f"**{e.engine}**: {e.verdict.value}. Seeds {e.first_seed}..{e.last_seed}"
            + (f", {draft_cell(e)}" if e.drafted is not None else "")
            + f", {e.samples_per_s:.0f} samples/s.",
            "",
            md_table(CONTEXT_HEADERS, context_rows(e)),
            "",
            md_table(TEST_HEADERS, test_rows(e)),
        ]
        if e.sequential is not None:
            q = e.sequential
            lines += [
                "",
                f"Sequential: decided by {q.decided_by} after {q.samples_used} samples "
                f"({q.samples_drawn} drawn), log e-value {q.log_e_value:.2f} "
                f"(threshold log {math.log(q.e_threshold):.2f}).",
            ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# plot


def plot_results(res: DistResult, path: Path) -> Path:
    """Expected vs observed probability per token, with 95% CIs; one column per engine, one row
    per position (its most likely context)."""
    from specaudit import plots

    plt = plots.pyplot()
    engines = res.engines
    rows = max((len(e.headline) for e in engines), default=1) or 1
    fig, axes = plt.subplots(
        rows, max(len(engines), 1), figsize=(4.2 * max(len(engines), 1), 2.9 * rows),
        squeeze=False, sharey=True,
    )  # fmt: skip
    colors = {Verdict.PRESERVED: "tab:green", Verdict.BROKEN: "tab:red",
              Verdict.INCONCLUSIVE: "tab:orange"}  # fmt: skip
    for j, e in enumerate(engines):
        for i in range(rows):
            ax = axes[i][j]
            if i >= len(e.headline):
                ax.axis("off")
                ax.text(0.5, 0.5, "no sample reached the target's\nmost likely context here",
                        ha="center", va="center", fontsize=8, transform=ax.transAxes)  # fmt: skip
                continue
            c = e.headline[i]
            x = np.arange(len(c.tokens))
            exp = [r.expected for r in c.tokens]
            obs = [r.frequency for r in c.tokens]
            err = [
                [max(0.0, r.frequency - r.ci_low) for r in c.tokens],
                [max(0.0, r.ci_high - r.frequency) for r in c.tokens],
            ]
            ax.bar(x - 0.18, exp, width=0.36, color="lightgray", edgecolor="black",
                   label="expected (closed form)")  # fmt: skip
            bad = [r.expected == 0 and r.observed > 0 for r in c.tokens]
            ax.bar(x + 0.18, obs, width=0.36, yerr=err, capsize=3,
                   color=["tab:red" if b else "tab:blue" for b in bad],
                   label="observed, 95% CI")  # fmt: skip
            ax.set_xticks(x, [r.token for r in c.tokens])
            ax.set_ylim(0, 1.05)
            ax.set_title(
                f"pos {c.position} after {c.label}\nn={c.n}, p={_fmt_p(c.gof.p_value)}",
                fontsize=8,
            )
            if j == 0:
                ax.set_ylabel("probability")
            if i == 0:
                ax.text(
                    0.5, 1.32, f"{e.engine}: {e.verdict.value}", transform=ax.transAxes,
                    ha="center", fontsize=10, fontweight="bold", color=colors[e.verdict],
                )  # fmt: skip
            if i == 0 and j == 0:
                ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(
        f"specaudit dist: fixture {res.fixture}, prompt {res.workload.prompt}, alpha {res.alpha:g}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return plots.save(fig, path)


# ---------------------------------------------------------------------------------------------
# audit


def audit_section(ctx: audit.AuditContext) -> audit.Section:
    """The audit's dist section: the fixture through llama-server (no draft, draft) and
    llama-speculative, 1000 seeds each, as in the field report."""
    fs = ctx.fixture
    wl = make_workload(fs.spec)
    seed_list = list(range(1, 1001))
    results = []
    for role, label, kind in (
        ("fixture-plain", "llama-server, no draft", "server-plain"),
        ("fixture-spec", "llama-server + draft", "server-spec"),
    ):
        srv = ctx.server(role)
        ctx.progress(f"dist: {label}")
        eng = ServerEngine(srv.url, fs.spec, wl, label=label, kind=kind)
        results.append(measure(eng, fs.spec, wl, seed_list))
    ctx.progress("dist: llama-speculative")
    ex = ExampleEngine(ctx.binaries().speculative, fs.target, fs.draft, fs.spec, wl)
    results.append(measure(ex, fs.spec, wl, seed_list))
    res = DistResult(
        fixture=fs.spec.name, fixture_dir=fs.dir, sha256=dict(fs.sha256), workload=wl,
        alpha=DEFAULT_ALPHA, tolerance=DEFAULT_TOLERANCE, sequential=False, engines=results,
    )  # fmt: skip
    res.plot = plot_results(res, ctx.out_dir / "dist.png")
    broken = [e.engine for e in results if e.verdict is Verdict.BROKEN]
    summary = "; ".join(f"{e.engine} {e.verdict.value}" for e in results)
    return audit.Section(
        key="dist",
        title="Distribution: does speculation keep the sampling distribution?",
        markdown=to_markdown(res),
        data={"dist": res},
        plots=[res.plot],
        status="finding" if broken else "ok",
        summary=summary,
    )
