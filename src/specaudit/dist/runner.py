"""Orchestration: check every input, start the engines, measure each, collect one result."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from specaudit import fixtures
from specaudit.dist.driver import measure
from specaudit.dist.engines import ExampleEngine, ServerEngine
from specaudit.dist.render import plot_results
from specaudit.dist.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOKENS,
    DEFAULT_TOLERANCE,
    DistError,
    DistResult,
    EngineResult,
    ProgressFn,
    Workload,
)
from specaudit.dist.truth import Truth
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer
from specaudit.paths import cache_root

ENGINES = ("server", "speculative-example", "url")
MIN_TOKENS = 3  # llama-server drafts nothing when n_predict < 3
MAX_JOINT = 6


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
    # presets' fixture policy: one thread (the fixture needs no second one; on a busy machine
    # extra threads only spin); a slot gets the fixture's whole context.
    srv = presets.server(
        binaries,
        fixture.target,
        kind="fixture",
        draft=fixture.draft if draft else None,
        spec_type="draft-simple" if draft else None,
        parallel=parallel,
        ctx_per_slot=fixture.spec.config.context_length,
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


__all__ = [
    "ENGINES",
    "MAX_JOINT",
    "MIN_TOKENS",
    "load_fixture",
    "make_workload",
    "needs_binaries",
    "run",
    "spawn_server",
    "validate",
]
