"""Every engine `dist` has, re-scored: one adapter from the `dist` engine registry to a
rescore `Sampler`, with no code per engine here.

Why: `dist` measures an engine against the fixture's closed form, which the engine's own
runtime (a converted copy, a Hugging Face model) is trusted to have loaded faithfully.
Re-scoring asks the same engines a second, independent question: is every token it sampled a
draw from the distribution a *plain, stock llama-server serving the fixture's GGUF* gives for
its exact prefix? That reference is another process the engine cannot influence.

How: the request is a `dist` request (`distribution.make_request`: the engine, its own options,
the fixture, the workload); each engine is built by its registry entry (`build(req, ctx)`), and
each `Unit` it yields becomes an `EngineSampler`: its samples' fixture letters turned into
token ids with the fixture spec (a letter is its id; a special token its id; anything else, a
short output or text outside the fixture, `NOT_A_TOKEN`), the sample cut after the first
token that is not a letter (it has no letter prefix to ask the reference about). Every token is
then re-scored by `rescore.runner` as any engine's is, the directed test aimed at the fixture
draft's distribution (`rescore.fixture.FixtureDraft`). Before sampling, the reference's
distribution for the prompt is compared with the closed form of the fixture the unit runs
(the F16 copy for OpenVINO): the same-model probe. A new engine registered in `dist` is
re-scorable as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specaudit import fixtures
from specaudit.distribution import registry
from specaudit.distribution.request import DistRequest
from specaudit.distribution.request import make_request as make_dist_request
from specaudit.distribution.results import DistError
from specaudit.distribution.truth import encode_text
from specaudit.errors import SpecauditError
from specaudit.fixtures import REPORT_SAMPLER, FixtureSpec, SamplerSettings
from specaudit.llama import presets
from specaudit.outcome import Outcome
from specaudit.reference import start_reference
from specaudit.rescore import request, runner
from specaudit.rescore.analysis import DEFAULT_ALPHA
from specaudit.rescore.certify import DEFAULT_TOLERANCE
from specaudit.rescore.fixture import FixtureDraft, text_of
from specaudit.rescore.records import RescoreError
from specaudit.rescore.sampling import SeededGeneration
from specaudit.rescore.spread import AnyReference, probe_difference

if TYPE_CHECKING:
    from specaudit.distribution.engines import Engine
    from specaudit.llama.build import LlamaBinaries
    from specaudit.llama.patches import Patch

# The id of an outcome that is no token of the fixture (a short output, an id outside the
# vocabulary, text the fixture cannot spell): no reference gives it a probability.
NOT_A_TOKEN = -1
NAMED_IMPOSSIBLE = 10  # impossible tokens named in a result's notes

# (engine label, samples re-scored, samples planned)
EngineProgressFn = Callable[[str, int, int], None]


def fixture_ids(spec: FixtureSpec, text: str, tokens: int) -> tuple[int, ...]:
    """A `dist` sample's outcomes (`distribution.Sample.text`) as token ids of `spec`'s
    vocabulary, cut after the first outcome that is not a letter: BOS/EOS/UNK keep their ids,
    anything else (a short output, an id outside the vocabulary, other text) is
    `NOT_A_TOKEN`."""
    from specaudit.distribution.results import SPECIAL_CODES

    specials = {code: spec.token_ids[tok] for tok, code in SPECIAL_CODES.items()}
    letters = spec.token_ids
    out: list[int] = []
    for ch in encode_text(text, tokens, spec):
        if ch in spec.letters:
            out.append(letters[ch])
            continue
        out.append(specials.get(ch, NOT_A_TOKEN))
        break
    return tuple(out)


class EngineSampler:
    """A `dist` engine (`distribution.engines.Engine`) as a rescore `Sampler`: one prompt (the
    workload's, prompt index 0), the sample's fixture letters as ids of `spec`."""

    def __init__(self, engine: Engine, spec: FixtureSpec, tokens: int) -> None:
        self.engine = engine
        self.spec = spec
        self.tokens = tokens
        self.label = engine.label

    async def sample(self, prompt: int, prompt_ids: Sequence[int], seed: int) -> SeededGeneration:
        try:
            s = await self.engine.sample(seed)
        except RescoreError:
            raise
        except SpecauditError as e:  # the engine's one line, naming it once
            from specaudit.distribution.engines import engine_error

            raise RescoreError(str(engine_error(self.label, e))) from None
        ids = fixture_ids(self.spec, s.text, self.tokens)
        return SeededGeneration(seed, prompt, ids, s.drafted, s.accepted)

    async def aclose(self) -> None:
        await self.engine.aclose()


@dataclass(frozen=True)
class EngineRescoreRequest:
    """A re-scored run of registry engines on a fixture, checked (`make_request`). The
    reference is `reference_url` (a running plain llama-server of the fixture) or, when None,
    a plain stock llama-server specaudit starts on `reference_model` (default: the fixture's
    target GGUF)."""

    dist: DistRequest
    reference_url: str | None = None
    reference_model: Path | None = None
    alpha: float = DEFAULT_ALPHA
    sequential: bool = False
    tolerance: float = DEFAULT_TOLERANCE
    concurrency: int = 4
    timeout: float = 60.0

    @property
    def model(self) -> Path:
        return self.reference_model or Path(self.dist.fixture.target)


@dataclass
class EngineRescoreResult:
    """One `RescoreResult` per unit the engines yielded (a server engine: one per verification
    path), with what the engines' builds noted and could not cover."""

    fixture: str
    reference: str
    results: list[runner.RescoreResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    not_covered: list[tuple[str, str]] = field(default_factory=list)

    @property
    def outcome(self) -> Outcome:
        if not self.results:
            return Outcome.NO_DECISION
        return Outcome.worst(r.outcome for r in self.results)

    @property
    def exit_code(self) -> int:
        return self.outcome.exit_code


def make_request(
    engines: Sequence[str],
    *,
    fixture: str | Path | fixtures.FixtureSet | None = None,
    fixture_kind: str | None = None,
    url: str | Sequence[str] | None = None,
    prompt: str | None = None,
    reference_url: str | None = None,
    reference_model: Path | str | None = None,
    seeds: int = 200,
    seed_start: int = 1,
    tokens: int = 8,
    sampler: SamplerSettings = REPORT_SAMPLER,
    alpha: float = DEFAULT_ALPHA,
    sequential: bool = False,
    tolerance: float | None = None,
    concurrency: int = 4,
    timeout: float = 60.0,
    jobs: int | None = None,
    patches: Sequence[Patch | str] = (),
    binaries: LlamaBinaries | Callable[[], LlamaBinaries] | None = None,
    work_dir: Path | None = None,
    **options: Sequence[str] | None,
) -> EngineRescoreRequest:
    """Check every input before anything starts (one-line RescoreError, exit 2): the `dist`
    request's own checks (the engine exists, its options, its extra installed, its --url),
    then what re-scoring needs."""
    names = tuple(dict.fromkeys(engines))
    if not names:
        raise RescoreError("no --dist-engine given")
    for name in names:
        if name not in registry.names():
            raise RescoreError(
                f"unknown --dist-engine {name!r} (one of {', '.join(registry.names())})"
            )
        if registry.get(name).url and not url:
            raise RescoreError(f"--dist-engine {name} needs --url")
    reference_url, ref_model = request.check_reference(
        reference_url, reference_model, required=False
    )
    request.check_run(
        seeds=seeds, tokens=tokens, alpha=alpha, concurrency=concurrency, sampler=sampler
    )
    own: dict[str, Any] = dict(options)  # the engines' own options (`EngineOption.param`)
    try:
        dist = make_dist_request(
            names, fixture=fixture, fixture_kind=fixture_kind, url=url, prompt=prompt,
            tokens=tokens, sampler=sampler, seeds=seeds, seed_start=seed_start,
            parallel=concurrency, concurrency=concurrency, jobs=jobs, timeout=timeout,
            patches=patches, binaries=binaries, work_dir=work_dir, **own,
        )  # fmt: skip
    except DistError as e:
        raise RescoreError(str(e)) from None
    return EngineRescoreRequest(
        dist=dist, reference_url=reference_url, reference_model=ref_model, alpha=alpha,
        sequential=sequential, concurrency=concurrency, timeout=timeout,
        tolerance=DEFAULT_TOLERANCE if tolerance is None else tolerance,
    )  # fmt: skip


def closed_form_probe(
    truth: FixtureSpec, spec: FixtureSpec, sampler: SamplerSettings
) -> runner.ProbeFn:
    """The same-model probe of a fixture engine: TV between the reference's distribution
    after the prompt and the closed form of the fixture the engine runs (`truth`; ids of the
    reference's `spec`)."""

    async def probe(ref: AnyReference, ids: Sequence[int]) -> float | None:
        got = await ref.next_token(ids)
        closed = fixtures.next_token_distribution(truth, text_of(spec, ids), sampler)
        want = {spec.token_ids[t]: p for t, p in closed.items() if p > 0.0}
        return probe_difference(got.probs, want)

    return probe


def run(req: EngineRescoreRequest, progress: EngineProgressFn | None = None) -> EngineRescoreResult:
    """Build each engine of `req` from its registry entry and re-score every unit it yields
    against one reference (started here, and always stopped, unless `reference_url`)."""
    dist = req.dist
    built: list[LlamaBinaries] = []

    def binaries() -> LlamaBinaries:
        if not built:
            b = dist.binaries
            if b is None:
                from specaudit import llama

                built.append(llama.ensure(patches=dist.patches))
            else:
                built.append(b if not callable(b) else b())
        return built[0]

    ctx = registry.RunContext(binaries)
    with runner.reference_refusals(), _reference(req) as ref_url:
        out = EngineRescoreResult(fixture=dist.fixture.spec.name, reference=ref_url)
        for name in dist.engines:
            units = registry.get(name).build(dist, ctx)
            with contextlib.closing(units):  # a server still up stops when re-scoring fails
                try:
                    for unit in units:
                        out.results.append(_rescore_unit(req, name, unit, ref_url, progress))
                except DistError as e:
                    raise RescoreError(str(e)) from None
    out.notes, out.not_covered = ctx.notes, ctx.not_covered
    return out


@contextlib.contextmanager
def _reference(req: EngineRescoreRequest) -> Iterator[str]:
    if req.reference_url is not None:
        yield req.reference_url
        return
    ctx_size = req.dist.fixture.spec.config.context_length
    # the engine's own server and this reference compute at once: each its share of the cores
    threads = presets.shared_threads(2)
    with start_reference(
        req.model, parallel=req.concurrency, ctx_size=ctx_size, threads=threads
    ) as url:
        yield url


def _rescore_unit(
    req: EngineRescoreRequest,
    name: str,
    unit: registry.Unit,
    ref_url: str,
    progress: EngineProgressFn | None,
) -> runner.RescoreResult:
    dist = req.dist
    spec = dist.fixture.spec  # the reference's vocabulary: letters -> ids
    truth = unit.spec or spec  # the fixture the engine runs (a converted copy, or the same)
    wl = dist.workload
    eng = unit.engine
    rreq = request.RescoreRequest(
        url=ref_url, engine=f"dist:{name}", reference_url=ref_url,
        prompts=(), prompt_ids=(tuple(spec.tokenize(wl.prompt)),), seeds=dist.seeds,
        seed_start=dist.seed_start, tokens=wl.tokens, sampler=wl.sampler, alpha=req.alpha,
        sequential=req.sequential, tolerance=req.tolerance,
        concurrency=min(req.concurrency, max(1, eng.concurrency)),
        timeout=req.timeout, label=eng.label, draft=FixtureDraft(truth, wl.sampler),
    )  # fmt: skip

    def cb(done: int, total: int) -> None:
        if progress is not None:
            progress(eng.label, done, total)

    sampler = EngineSampler(eng, spec, wl.tokens)
    probe = closed_form_probe(truth, spec, wl.sampler)

    async def go() -> runner.RescoreResult:
        try:
            return await runner.run_against(rreq, ref_url, cb, engine=sampler, probe=probe)
        finally:  # also when the probe refused it before sampling (closing twice is harmless)
            await sampler.aclose()

    res = asyncio.run(go())
    res.path = unit.path
    res.notes.extend(impossible_lines(res, spec))
    return res


def impossible_lines(res: runner.RescoreResult, spec: FixtureSpec) -> list[str]:
    """The first `NAMED_IMPOSSIBLE` tokens the reference gives probability 0, in the fixture's
    letters: seed, position, prefix, the token, and the reference's support."""
    bad = [d for d in res.draws if d.ref.probs.get(d.token, 0.0) <= 0.0]
    out = []
    for d in bad[:NAMED_IMPOSSIBLE]:
        prefix = text_of(spec, [*res.prompts[d.prompt], *runner.generated_ids(res, d)])
        support = ", ".join(
            f"{_token(spec, t)} {p:.3f}" for t, p in sorted(d.ref.probs.items()) if p > 0.0
        )
        out.append(
            f"impossible token: seed {d.seed}, position {d.position + 1}, after {prefix!r}: "
            f"{_token(spec, d.token)} (the reference's support: {support})"
        )
    if len(bad) > NAMED_IMPOSSIBLE:
        out.append(f"... and {len(bad) - NAMED_IMPOSSIBLE} more impossible tokens")
    return out


def _token(spec: FixtureSpec, t: int) -> str:
    if 0 <= t < len(spec.tokens):
        return repr(spec.tokens[t])
    return "<not a fixture token>" if t == NOT_A_TOKEN else f"<id {t}>"


__all__ = [
    "NOT_A_TOKEN",
    "EngineRescoreRequest",
    "EngineRescoreResult",
    "EngineSampler",
    "closed_form_probe",
    "fixture_ids",
    "impossible_lines",
    "make_request",
    "run",
]
