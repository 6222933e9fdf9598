"""Orchestration: check every input, start the engines, measure each, collect one result."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from specaudit import fixtures
from specaudit import validate as checks
from specaudit.distribution import coverage
from specaudit.distribution.driver import measure
from specaudit.distribution.engines import MAX_CONCURRENCY, Engine, ExampleEngine, ServerEngine
from specaudit.distribution.openai import FleetEngine, OpenAIEngine
from specaudit.distribution.render import plot_results
from specaudit.distribution.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOKENS,
    DEFAULT_TOLERANCE,
    DistError,
    DistResult,
    EngineResult,
    ProgressFn,
    Workload,
)
from specaudit.distribution.truth import Truth
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer
from specaudit.paths import cache_root

ENGINES = ("server", "speculative-example", "url", "openai", "transformers")
URL_ENGINES = ("url", "openai")  # engines that sample running servers (--url, repeatable)
MIN_TOKENS = 3  # llama-server drafts nothing when n_predict < 3
MAX_JOINT = 6
# What a spawned server, an HTTP client or a process pool can be asked for: beyond these a
# typo costs the machine (llama-server allocates every slot, every request is a connection).
MAX_PARALLEL = 256  # --parallel: slots of a spawned llama-server
# MAX_CONCURRENCY (dist.engines, 1024): --concurrency, requests in flight
MAX_JOBS = 1024  # --jobs: llama-speculative processes at once
DEFAULT_TIMEOUT = 60.0  # seconds per request to a server engine
# llama.cpp's --spec-draft-sampling: greedy (default; sample-and-match), probabilistic (rejection)
DRAFT_SAMPLING = presets.DRAFT_SAMPLING
# the verification paths `server` runs, one llama-server each (presets.PATHS, dist.coverage)
PATHS = presets.PATHS
_SERVER_NAMES = {
    "plain": "dist-plain",
    "greedy": "dist-spec",
    "rejection": "dist-spec-probabilistic",
    "ngram": "dist-ngram",
}


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
    if (
        not (0 < s.top_p <= 1)  # nan fails every comparison, so it is out of range here
        or not (0 <= s.min_p < 1)
        or isinstance(s.top_k, bool)
        or not isinstance(s.top_k, int)
        or not 0 <= s.top_k <= checks.MAX_INT32
    ):
        raise DistError(
            "sampler settings out of range (0 < top-p <= 1, 0 <= min-p < 1, top-k >= 0)"
        )
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise DistError("--temperature must be a finite number >= 0")
    wl = Workload(prompt, tokens, positions, joint, sampler)
    truth = Truth(spec, wl)
    truth.next("")  # surfaces ambiguous settings now
    if joint:
        truth.joint(joint)
    return wl


def load_fixture(
    path: str | os.PathLike[str] | None,
    work_dir: Path | None = None,
    kind: str | None = None,
) -> fixtures.FixtureSet:
    """The fixture at `path` (SHA-256 verified), or the built-in fixture of `kind` ("last-token",
    the default, or "context": `fixtures.KINDS`) built into `work_dir`. With both, the fixture
    at `path` must be of that kind."""
    _check_kind(None, kind)
    if path is None:
        # Building is deterministic and atomic, so a shared cache directory is safe.
        d = work_dir or (cache_root() / "fixtures")
        if kind == "context":
            return fixtures.build(d / "context", kind="context")
        return fixtures.build(d / "default")
    try:
        fs = fixtures.load(path)
    except (fixtures.FixtureError, OSError, ValueError) as e:
        raise DistError(f"fixture {path}: {' '.join(str(e).split())}") from None
    _check_kind(fs, kind)
    return fs


def _check_kind(fs: fixtures.FixtureSet | None, kind: str | None) -> None:
    """DistError unless `kind` is None or a fixture kind, and `fs` (if given) of that kind."""
    if kind is not None and kind not in fixtures.KINDS:
        raise DistError(f"--fixture-kind must be one of {', '.join(fixtures.KINDS)}, got {kind!r}")
    if fs is not None and kind is not None and fs.spec.kind != kind:
        raise DistError(
            f"fixture {fs.dir}: {fs.spec.name!r} is of kind {fs.spec.kind!r}, not {kind!r}"
        )


def url_list(url: str | Sequence[str] | None) -> tuple[str, ...]:
    """`url` as a tuple: one URL, several (a fleet of identical servers), or none."""
    if url is None:
        return ()
    if isinstance(url, str):
        return (url,)
    return tuple(url)


def _check_common(
    engines: Sequence[str],
    url: str | Sequence[str] | None,
    seeds: int,
    alpha: float,
    tolerance: float,
    seed_start: int = 1,
) -> None:
    if not engines:
        raise DistError("no engine given")
    for e in engines:
        if e not in ENGINES:
            raise DistError(f"unknown engine {e!r} (one of {', '.join(ENGINES)})")
    urls = url_list(url)
    for e in URL_ENGINES:
        if e in engines and not urls:
            raise DistError(f"--engine {e} needs --url")
    if urls and not any(e in engines for e in URL_ENGINES):
        raise DistError("--url applies to --engine url and --engine openai only")
    for u in urls:
        checks.url(u, "--url", DistError)
    if seeds < 1:
        raise DistError(f"--seeds must be at least 1, got {seeds}")
    checks.integer(seed_start, "--seed-start", min=0, max=checks.MAX_SEED, error=DistError)
    if seed_start + seeds - 1 > checks.MAX_SEED:
        # llama.cpp's seed is a uint32 (2^32-1 = random): seeds past it would repeat or vary
        raise DistError(
            f"--seed-start + --seeds - 1 must be <= {checks.MAX_SEED} "
            f"(llama.cpp's seed is a uint32), got {seed_start + seeds - 1}"
        )
    if not 0 < alpha < 1:
        raise DistError(f"--alpha must be in (0, 1), got {alpha}")
    if not 0 < tolerance <= 1:
        raise DistError(f"--tolerance must be in (0, 1], got {tolerance}")


def _check_run(
    parallel: int, concurrency: int | None, jobs: int | None, timeout: float, plot: Path | None
) -> None:
    checks.integer(parallel, "--parallel", min=1, max=MAX_PARALLEL, error=DistError)
    if concurrency is not None:
        checks.integer(concurrency, "--concurrency", min=1, max=MAX_CONCURRENCY, error=DistError)
    if jobs is not None:
        checks.integer(jobs, "--jobs", min=1, max=MAX_JOBS, error=DistError)
    checks.number(
        timeout, "--timeout", min=0, min_open=True, max=checks.MAX_TIMEOUT, error=DistError
    )
    if plot is not None:
        checks.writable_file(plot, "--plot", DistError)


def validate(
    engines: Sequence[str],
    *,
    fixture: str | os.PathLike[str] | fixtures.FixtureSet | None = None,
    url: str | Sequence[str] | None = None,
    prompt: str | None = None,
    tokens: int = DEFAULT_TOKENS,
    positions: int | None = None,
    joint: int | None = None,
    sampler: fixtures.SamplerSettings = fixtures.REPORT_SAMPLER,
    seeds: int = 1000,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    work_dir: Path | None = None,
    seed_start: int = 1,
    parallel: int = 4,
    concurrency: int | None = None,
    jobs: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    plot: Path | None = None,
    fixture_kind: str | None = None,
) -> tuple[fixtures.FixtureSet, Workload]:
    """Check every input before anything slow starts; returns the fixture and the workload.

    Includes the plot path (its directory is created and checked writable now, not after
    the measurement). `fixture_kind`: see `load_fixture`.
    """
    _check_common(engines, url, seeds, alpha, tolerance, seed_start)
    _check_run(parallel, concurrency, jobs, timeout, plot)
    if "transformers" in engines:
        if sampler.temperature <= 0:
            raise DistError("--engine transformers samples: --temperature must be > 0")
        from specaudit.distribution import hf

        hf.versions()  # the extra is installed, or a one-line error now
    if isinstance(fixture, fixtures.FixtureSet):
        fs = fixture
        _check_kind(fs, fixture_kind)
    else:
        fs = load_fixture(fixture, work_dir, fixture_kind)
    wl = make_workload(
        fs.spec, prompt=prompt, tokens=tokens, positions=positions, joint=joint, sampler=sampler
    )
    return fs, wl


def needs_binaries(engines: Sequence[str]) -> bool:
    return any(e in ("server", "speculative-example") for e in engines)


def _check_patches(
    engines: Sequence[str], patches: Sequence[str], binaries: object
) -> tuple[str, ...]:
    """`patches` checked against the engines and `binaries`; patch files as absolute paths."""
    if isinstance(patches, str):
        raise DistError("patches must be a sequence of patch names or paths, not one string")
    if not patches:
        return ()
    if binaries is not None:
        raise DistError("give binaries or patches, not both (binaries carry their own patches)")
    if not needs_binaries(engines):
        raise DistError("--patch applies to the server and speculative-example engines only")
    from specaudit.llama import patches as patches_

    return tuple(patches_.check_patch(p) for p in patches)


def _with_patches(label: str, b: LlamaBinaries) -> str:
    """An engine's label, naming the patches its binaries were built with (none: unchanged)."""
    if not b.patches:
        return label
    from specaudit.llama.patches import patch_label

    return f"{label} [{'+'.join(patch_label(p) for p in b.patches)}]"


@contextlib.contextmanager
def spawn_server(
    binaries: LlamaBinaries,
    fixture: fixtures.FixtureSet,
    *,
    draft: bool | None = None,
    parallel: int = 4,
    log_dir: Path | None = None,
    draft_sampling: str = "greedy",
    path: str | None = None,
) -> Iterator[LlamaServer]:
    """A llama-server on the fixture on one verification path (`PATHS`), from its preset
    (`presets.fixture_role`).

    Either `path` ("plain", "greedy", "rejection", "ngram"), or the older spelling: `draft`
    (False: "plain") with `draft_sampling` "greedy" (llama.cpp's default, no flag: the draft
    proposes its argmax, verified by sample-and-match, lossless by construction) or
    "probabilistic" (``--spec-draft-sampling probabilistic``: the draft samples and reports
    its distribution q, verified by rejection sampling; only at temperature > 0). "ngram" is
    ``--spec-type ngram-mod`` without a draft model (`presets.FIXTURE_NGRAM_ARGS`).
    """
    path = _server_path(draft, draft_sampling, path)
    model = "fixture-context" if fixture.spec.kind == "context" else "fixture"
    preset = presets.PRESETS[presets.fixture_role(model, path)]
    name = _SERVER_NAMES[path]
    # presets' fixture policy: one thread (the fixture needs no second one; on a busy machine
    # extra threads only spin); a slot gets the fixture's whole context.
    srv = presets.for_preset(
        preset,
        binaries,
        Path(fixture.target),
        Path(fixture.draft) if preset.uses_draft else None,
        parallel=parallel,
        ctx_per_slot=fixture.spec.config.context_length,
        log_path=(log_dir / f"{name}.log") if log_dir else None,
        name=name,
    )
    with srv:
        yield srv


def _server_path(draft: bool | None, draft_sampling: str, path: str | None) -> str:
    if draft_sampling not in DRAFT_SAMPLING:
        raise DistError(
            f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {draft_sampling!r}"
        )
    if path is not None:
        if path not in PATHS:
            raise DistError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
        if draft is not None or draft_sampling != "greedy":
            raise DistError("give path, or draft (and draft_sampling), not both")
        return path
    if draft is None:
        raise DistError("spawn_server needs path (or draft)")
    if draft_sampling != "greedy" and not draft:
        raise DistError(f"draft_sampling={draft_sampling!r} needs a draft (draft=True)")
    if not draft:
        return "plain"
    return "rejection" if draft_sampling == "probabilistic" else "greedy"


def _url_engine(
    name: str,
    urls: Sequence[str],
    spec: fixtures.FixtureSpec,
    wl: Workload,
    concurrency: int | None,
    timeout: float,
) -> Engine:
    """`url` (native /completion) or `openai` (/v1/completions) on every URL: one engine, or a
    fleet that spreads the seeds over them (`--concurrency` is per server)."""
    members: list[Engine] = []
    for u in urls:
        if name == "url":
            members.append(ServerEngine(u, spec, wl, concurrency=concurrency, timeout=timeout))
        else:
            members.append(OpenAIEngine(u, spec, wl, concurrency=concurrency, timeout=timeout))
    return members[0] if len(members) == 1 else FleetEngine(members)


def run(
    engines: Sequence[str] = ("server", "speculative-example"),
    *,
    fixture: str | os.PathLike[str] | fixtures.FixtureSet | None = None,
    url: str | Sequence[str] | None = None,
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
    timeout: float = DEFAULT_TIMEOUT,
    patches: Sequence[str] = (),
    fixture_kind: str | None = None,
    paths: Sequence[str] | None = None,
    generators: Sequence[str] | None = None,
) -> DistResult:
    """Run the distribution test on each engine (`server` means one llama-server per
    verification path in `paths`, default every `PATHS` value: plain, greedy, rejection (only
    at temperature > 0), ngram; each result's `path` says which). The result's `not_covered`
    lists the paths no fixture can exercise (`dist.coverage.NOT_COVERED`) when `server` ran.

    Memory does not grow with `seeds` (a range, counted as sampled: `dist.driver`).
    `patches`: when `binaries` is not given, the server and llama-speculative engines run on
    llama.cpp built with these (bundled names, ``mutants/<name>``, paths to ``.patch`` files:
    see `llama.ensure`); their engine labels name the patches.
    `url` (for `url` and `openai`) may be several URLs of identical servers: the seeds are
    spread over them. `generators`: the `transformers` engine's candidate generators
    (`dist.hf.GENERATORS`, default all), one result each, after its truth check (in `notes`).
    """
    if generators is not None and "transformers" not in engines:
        raise DistError("--generator applies to the transformers engine only")
    patches = _check_patches(engines, patches, binaries)
    if paths is not None and "server" not in engines:
        raise DistError("--path applies to the server engine only")
    server_paths = coverage.check_paths(paths, sampler.temperature)
    assert server_paths is not None
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
        seed_start=seed_start,
        parallel=parallel,
        concurrency=concurrency,
        jobs=jobs,
        timeout=timeout,
        plot=plot,
        fixture_kind=fixture_kind,
    )
    seed_list = range(seed_start, seed_start + seeds)  # never a list: --seeds may be huge
    kw: dict[str, Any] = dict(
        alpha=alpha, tolerance=tolerance, sequential=sequential, progress=progress
    )

    def bins() -> LlamaBinaries:
        if isinstance(binaries, LlamaBinaries):
            return binaries
        if callable(binaries):
            return binaries()
        from specaudit import llama

        return llama.ensure(patches=patches)

    results: list[EngineResult] = []
    notes: list[str] = []
    not_covered = (
        coverage.not_covered(server_paths, sampler.temperature) if "server" in engines else []
    )
    for name in dict.fromkeys(engines):
        if name == "server":
            b = bins()
            for path in server_paths:
                label, kind = coverage.PATH_ENGINES[path]
                with spawn_server(b, fs, path=path, parallel=parallel, log_dir=work_dir) as srv:
                    eng = ServerEngine(
                        srv.url, fs.spec, wl, label=_with_patches(label, b), kind=kind,
                        concurrency=concurrency or 2 * parallel, timeout=timeout,
                    )  # fmt: skip
                    res = measure(eng, fs.spec, wl, seed_list, **kw)
                    res.path = path
                    results.append(res)
        elif name == "speculative-example":
            b = bins()
            ex = ExampleEngine(
                b.speculative, fs.target, fs.draft, fs.spec, wl, jobs=jobs,
                label=_with_patches("llama-speculative", b),
            )  # fmt: skip
            results.append(measure(ex, fs.spec, wl, seed_list, **kw))
        elif name in URL_ENGINES:
            url_eng = _url_engine(name, url_list(url), fs.spec, wl, concurrency, timeout)
            results.append(measure(url_eng, fs.spec, wl, seed_list, **kw))
        else:
            from specaudit.distribution import hf

            hf_engines, truth_check = hf.engines(fs, wl, tuple(generators or hf.GENERATORS))
            notes.append(truth_check.line())
            for hf_eng in hf_engines:
                results.append(measure(hf_eng, fs.spec, wl, seed_list, **kw))
            not_covered += list(hf.NOT_RUNNABLE)
    out = DistResult(
        fixture=fs.spec.name,
        fixture_dir=fs.dir,
        sha256=dict(fs.sha256),
        workload=wl,
        alpha=alpha,
        tolerance=tolerance,
        sequential=sequential,
        engines=results,
        notes=notes,
        not_covered=not_covered,
    )
    if plot is not None:
        out.plot = plot_results(out, plot)
    return out


__all__ = [
    "DEFAULT_TIMEOUT",
    "DRAFT_SAMPLING",
    "ENGINES",
    "MAX_CONCURRENCY",
    "MAX_JOBS",
    "MAX_JOINT",
    "MAX_PARALLEL",
    "MIN_TOKENS",
    "PATHS",
    "URL_ENGINES",
    "load_fixture",
    "make_workload",
    "needs_binaries",
    "run",
    "spawn_server",
    "url_list",
    "validate",
]
