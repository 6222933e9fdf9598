"""`DistRequest`: one `dist` run as a frozen value, checked in one place (`make_request`).

Why: the CLI, the audit, the matrix and the benchmarks all describe a run the same way; every
input is checked here once, before anything slow starts (a bad one must not wait for a build
or a fixture), and `dist.runner.run` takes the value as it is. Checks that every command
shares (URLs, integers, timeouts, writable files) live in `specaudit.validate`; what is
specific to one engine is that engine's `check` in the registry (`dist.registry`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specaudit import fixtures
from specaudit import validate as checks
from specaudit.distribution import registry
from specaudit.distribution.engines import MAX_CONCURRENCY
from specaudit.distribution.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOKENS,
    DEFAULT_TOLERANCE,
    DistError,
    Workload,
)
from specaudit.distribution.truth import Truth
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import Patch, resolve
from specaudit.paths import cache_root

MIN_TOKENS = 3  # llama-server drafts nothing when n_predict < 3
MAX_JOINT = 6
# What a spawned server, an HTTP client or a process pool can be asked for: beyond these a
# typo costs the machine (llama-server allocates every slot, every request is a connection).
MAX_PARALLEL = 256  # --parallel: slots of a spawned llama-server
# MAX_CONCURRENCY (dist.engines, 1024): --concurrency, requests in flight
MAX_JOBS = 1024  # --jobs: llama-speculative processes at once
DEFAULT_TIMEOUT = 60.0  # seconds per request to a server engine

Binaries = LlamaBinaries | Callable[[], LlamaBinaries]


@dataclass(frozen=True)
class DistRequest:
    """Everything one run of `dist.run` needs, already checked: build it with `make_request`.

    `patches`: what the binary engines' llama.cpp is built with when `binaries` is None,
    resolved once (`llama.patches.Patch`: a file's bytes are read when the request is made).
    `options`: the engines' own options by `EngineOption.param` (None: not given).
    """

    engines: tuple[str, ...]
    fixture: fixtures.FixtureSet
    workload: Workload
    urls: tuple[str, ...] = ()
    seeds: int = 1000
    seed_start: int = 1
    alpha: float = DEFAULT_ALPHA
    tolerance: float = DEFAULT_TOLERANCE
    sequential: bool = False
    parallel: int = 4
    concurrency: int | None = None
    jobs: int | None = None
    timeout: float = DEFAULT_TIMEOUT
    plot: Path | None = None
    work_dir: Path | None = None
    fixture_kind: str | None = None
    patches: tuple[Patch, ...] = ()
    binaries: Binaries | None = None
    options: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)

    @property
    def seed_range(self) -> range:
        """Seeds S..S+N-1: a range, never a list (--seeds may be huge)."""
        return range(self.seed_start, self.seed_start + self.seeds)

    @property
    def needs_binaries(self) -> bool:
        return any(registry.get(e).binaries for e in self.engines)

    def option(self, param: str) -> tuple[str, ...] | None:
        """An engine option's value (`EngineOption.param`), None when not given."""
        return self.options.get(param)

    def with_binaries(self, binaries: LlamaBinaries) -> DistRequest:
        """The same request on binaries provisioned for it (from its `patches`)."""
        return dataclasses.replace(self, binaries=binaries)


def make_request(
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
    timeout: float = DEFAULT_TIMEOUT,
    plot: Path | None = None,
    work_dir: Path | None = None,
    fixture_kind: str | None = None,
    patches: Sequence[Patch | str] = (),
    binaries: Binaries | None = None,
    **options: Sequence[str] | None,
) -> DistRequest:
    """Check every input, then load the fixture (`load_fixture`) and the workload
    (`make_workload`); a one-line DistError (BuildError for an unknown patch) on bad input.

    The plot's directory is created and checked writable now, not after the measurement.
    `url` (engines that sample running servers) may be several URLs of identical servers.
    `options`: the engines' own options (`paths` of the server engine, `generators` of
    transformers, ...: `dist.registry`).
    """
    names = tuple(dict.fromkeys(engines))
    urls = url_list(url)
    _check_engines(names, urls)
    _check_numbers(seeds, seed_start, alpha, tolerance)
    _check_run(parallel, concurrency, jobs, timeout, plot)
    opts = _check_options(names, options)
    patches = _check_patches(names, patches, binaries)
    if isinstance(fixture, fixtures.FixtureSet):
        fs = fixture
        _check_kind(fs, fixture_kind)
    else:
        fs = load_fixture(fixture, work_dir, fixture_kind)
    wl = make_workload(
        fs.spec, prompt=prompt, tokens=tokens, positions=positions, joint=joint, sampler=sampler
    )
    req = DistRequest(
        engines=names, fixture=fs, workload=wl, urls=urls, seeds=seeds, seed_start=seed_start,
        alpha=alpha, tolerance=tolerance, sequential=sequential, parallel=parallel,
        concurrency=concurrency, jobs=jobs, timeout=timeout, plot=plot, work_dir=work_dir,
        fixture_kind=fixture_kind, patches=patches, binaries=binaries, options=opts,
    )  # fmt: skip
    for name in names:
        check = registry.get(name).check
        if check is not None:
            check(req)
    return req


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
    the default, "context", "mtp", "mtp-context" or "replay": `fixtures.KINDS`) built into
    `work_dir`. With both, the fixture at `path` must be of that kind."""
    _check_kind(None, kind)
    if path is None:
        # Building is deterministic and atomic, so a shared cache directory is safe.
        d = work_dir or (cache_root() / "fixtures")
        for k in fixtures.KINDS:  # (`kind` is one of them: checked above)
            if kind == k and k != "last-token":
                return fixtures.build(d / k, kind=k)
        return fixtures.build(d / "default")
    try:
        fs = fixtures.load(path)
    except (fixtures.FixtureError, OSError, ValueError) as e:
        raise DistError(f"fixture {path}: {' '.join(str(e).split())}") from None
    _check_kind(fs, kind)
    return fs


def url_list(url: str | Sequence[str] | None) -> tuple[str, ...]:
    """`url` as a tuple: one URL, several (a fleet of identical servers), or none."""
    if url is None:
        return ()
    if isinstance(url, str):
        return (url,)
    return tuple(url)


def _check_kind(fs: fixtures.FixtureSet | None, kind: str | None) -> None:
    """DistError unless `kind` is None or a fixture kind, and `fs` (if given) of that kind."""
    if kind is not None and kind not in fixtures.KINDS:
        raise DistError(f"--fixture-kind must be one of {', '.join(fixtures.KINDS)}, got {kind!r}")
    if fs is not None and kind is not None and fs.spec.kind != kind:
        raise DistError(
            f"fixture {fs.dir}: {fs.spec.name!r} is of kind {fs.spec.kind!r}, not {kind!r}"
        )


def _check_engines(names: tuple[str, ...], urls: tuple[str, ...]) -> None:
    if not names:
        raise DistError("no engine given")
    for e in names:
        registry.get(e)  # unknown engine: one line naming the engines there are
    url_engines = registry.url_engines()
    for e in names:
        if e in url_engines and not urls:
            raise DistError(f"--engine {e} needs --url")
    if urls and not any(e in url_engines for e in names):
        raise DistError(
            f"--url applies to {' and '.join(f'--engine {e}' for e in url_engines)} only"
        )
    for u in urls:
        checks.url(u, "--url", DistError)


def _check_numbers(seeds: int, seed_start: int, alpha: float, tolerance: float) -> None:
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


def _check_options(
    names: tuple[str, ...], given: Mapping[str, Sequence[str] | None]
) -> dict[str, tuple[str, ...] | None]:
    """The engines' own options: each known, a sequence, and given only with its engine. The
    values are the engine's to check (its `check`)."""
    owners = {o.param: (e, o) for e, o in registry.options()}
    out: dict[str, tuple[str, ...] | None] = {}
    for param, value in given.items():
        if param not in owners:
            raise TypeError(f"make_request() got an unexpected keyword argument {param!r}")
        entry, opt = owners[param]
        if value is not None and entry.name not in names:
            raise DistError(f"{opt.flag} applies to the {entry.name} engine only")
        if isinstance(value, str):
            raise DistError(f"{param} must be a sequence of {opt.flag} values, not one string")
        out[param] = None if value is None else tuple(value)
    return out


def _check_patches(
    names: tuple[str, ...], patches: Sequence[Patch | str], binaries: Binaries | None
) -> tuple[Patch, ...]:
    """`patches` checked against the engines and `binaries`, each text resolved (`Patch`
    values are kept: a caller that resolved them already is not read again)."""
    if isinstance(patches, str):
        raise DistError("patches must be a sequence of patch names or paths, not one string")
    if not patches:
        return ()
    if binaries is not None:
        raise DistError("give binaries or patches, not both (binaries carry their own patches)")
    binary_engines = registry.binary_engines()
    if not any(e in binary_engines for e in names):
        raise DistError(f"--patch applies to the {' and '.join(binary_engines)} engines only")
    return tuple(p if isinstance(p, Patch) else resolve(p) for p in patches)


__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_JOBS",
    "MAX_JOINT",
    "MAX_PARALLEL",
    "MIN_TOKENS",
    "DistRequest",
    "load_fixture",
    "make_request",
    "make_workload",
    "url_list",
]
