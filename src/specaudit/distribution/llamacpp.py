"""llama.cpp's engines in `dist.registry`: how each is built from a `DistRequest`.

server (one spawned llama-server per verification path), speculative-example (llama.cpp's
llama-speculative, one process per seed) and url (running llama-servers, native /completion);
their sampling code is in `dist.engines`. `register_engines` is the registry's hook, as in
every engine module (openai, hf, openvino, a plug-in's). `spawn_server` is here because only
the server engine (and tests, benchmarks that want the same server) starts llama-servers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from pathlib import Path

from specaudit import fixtures
from specaudit.distribution import coverage
from specaudit.distribution.engines import ExampleEngine, ServerEngine
from specaudit.distribution.openai import url_fleet
from specaudit.distribution.registry import EngineEntry, EngineOption, Register, RunContext, Unit
from specaudit.distribution.request import DistRequest
from specaudit.distribution.results import DistError
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer

# llama.cpp's --spec-draft-sampling: greedy (default; sample-and-match), probabilistic (rejection)
DRAFT_SAMPLING = presets.DRAFT_SAMPLING
# the verification paths `server` runs, one llama-server each (presets.PATHS, dist.coverage)
PATHS = presets.PATHS
_SERVER_NAMES = {
    "plain": "dist-plain",
    "greedy": "dist-spec",
    "rejection": "dist-spec-probabilistic",
    "ngram": "dist-ngram",
    **{t: f"dist-{t}" for t in presets.NGRAM_TYPE_ARGS},
    "mtp": "dist-mtp",
    "mtp-rejection": "dist-mtp-probabilistic",
    "eagle3": "dist-eagle3",
    **{p: f"dist-{p}" for p in presets.BLOCK_DRAFT_PATHS},
    "replay": "dist-replay",
    "replay-rejection": "dist-replay-probabilistic",
}
# the presets' model of each fixture kind
_KIND_MODELS = {
    "last-token": "fixture",
    "context": "fixture-context",
    "mtp": "fixture-mtp",
    "mtp-context": "fixture-mtp-context",
    "mtp-attention": "fixture-mtp-attention",
    "replay": "fixture-replay",
}


# ------------------------------------------------------------------------------ server


def _server_paths(req: DistRequest) -> tuple[str, ...]:
    """The paths the server engine runs (checked by `_check_server`)."""
    paths = coverage.check_paths(
        req.option("paths"), req.workload.sampler.temperature, req.fixture.spec.kind
    )
    assert paths is not None
    return paths


def _check_server(req: DistRequest) -> None:
    _server_paths(req)


def _build_server(req: DistRequest, ctx: RunContext) -> Generator[Unit, None, None]:
    paths = _server_paths(req)
    ctx.not_covered.extend(coverage.not_covered(paths, req.workload.sampler.temperature))
    b = ctx.binaries()
    fs, wl = req.fixture, req.workload
    for path in paths:
        label, kind = coverage.PATH_ENGINES[path]
        with spawn_server(b, fs, path=path, parallel=req.parallel, log_dir=req.work_dir) as srv:
            eng = ServerEngine(
                srv.url, fs.spec, wl, label=_with_patches(label, b), kind=kind,
                concurrency=req.concurrency or 2 * req.parallel, timeout=req.timeout,
            )  # fmt: skip
            yield Unit(eng, path)


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

    Either `path` (a `PATHS` value), or the older spelling: `draft`
    (False: "plain") with `draft_sampling` "greedy" (llama.cpp's default, no flag: the draft
    proposes its argmax, verified by sample-and-match, lossless by construction) or
    "probabilistic" (``--spec-draft-sampling probabilistic``: the draft samples and reports
    its distribution q, verified by rejection sampling; only at temperature > 0). "ngram" is
    ``--spec-type ngram-mod`` without a draft model (`presets.FIXTURE_NGRAM_ARGS`);
    "ngram-simple", "ngram-map-k", "ngram-map-k4v" and "ngram-cache" are those types, with the
    flags that make each draft on the fixture (`presets.NGRAM_TYPE_ARGS`). "mtp" and
    "mtp-rejection" (``--spec-type draft-mtp``, no draft model: the target's MTP layer drafts,
    greedy or probabilistic) run only on the MTP fixture, which runs them and "plain".
    """
    path = _server_path(draft, draft_sampling, path)
    model = _KIND_MODELS[fixture.spec.kind]
    try:
        preset = presets.PRESETS[presets.fixture_role(model, path)]
    except ValueError as e:
        raise DistError(f"fixture {fixture.spec.name!r}: {e}") from None
    name = _SERVER_NAMES[path]
    # (the EAGLE3 path runs on one slot whatever `parallel` says: `presets.for_preset`)
    # presets' fixture policy: one thread (the fixture needs no second one; on a busy machine
    # extra threads only spin); a slot gets the fixture's whole context.
    srv = presets.for_preset(
        preset,
        binaries,
        Path(fixture.target),
        _draft_file(fixture, preset),
        parallel=parallel,
        ctx_per_slot=fixture.spec.config.context_length,
        log_path=(log_dir / f"{name}.log") if log_dir else None,
        name=name,
    )
    with srv:
        yield srv


def _draft_file(fixture: fixtures.FixtureSet, preset: presets.Preset) -> Path | None:
    """The -md of a role: the fixture's draft model, its EAGLE3 head, its DFlash or DSpark
    draft, or none."""
    if not preset.uses_draft:
        return None
    block = {t: markov for t, markov in presets.BLOCK_DRAFT_PATHS.values()}
    try:
        if preset.spec_type == "draft-eagle3":
            return fixtures.eagle3_draft(fixture)
        if preset.spec_type in block:
            return fixtures.dflash_draft(fixture, markov=block[preset.spec_type])
    except fixtures.FixtureError as e:
        raise DistError(str(e)) from None
    return Path(fixture.draft)


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


def _with_patches(label: str, b: LlamaBinaries) -> str:
    """An engine's label, naming the patches its binaries were built with (none: unchanged)."""
    if not b.patches:
        return label
    from specaudit.llama.patches import labels

    return f"{label} [{labels(b.patches)}]"


# ----------------------------------------------------------------- speculative-example


def _build_example(req: DistRequest, ctx: RunContext) -> Generator[Unit, None, None]:
    b = ctx.binaries()
    fs = req.fixture
    yield Unit(
        ExampleEngine(
            b.speculative,
            fs.target,
            fs.draft,
            fs.spec,
            req.workload,
            jobs=req.jobs,
            label=_with_patches("llama-speculative", b),
        )  # fmt: skip
    )


# ---------------------------------------------------------------------------------- url


def _build_url(req: DistRequest, ctx: RunContext) -> Generator[Unit, None, None]:
    yield Unit(url_fleet(ServerEngine, req))


# --------------------------------------------------------------------------- the table

SERVER = EngineEntry(
    "server",
    _build_server,
    help="llama-servers spawned on the fixture, one per verification path (--path)",
    binaries=True,
    options=(
        EngineOption(
            "--path",
            "paths",
            PATHS,
            "Verification path(s) of --engine server, repeatable [default: all the "
            "fixture's; rejection paths only at --temperature > 0]: plain (no draft), "
            "greedy (draft, sample-and-match), rejection (--spec-draft-sampling "
            "probabilistic: rejection sampling), ngram (ngram-mod, no draft model), and "
            "ngram-simple, ngram-map-k, ngram-map-k4v, ngram-cache (those n-gram types, no "
            "draft model); mtp, mtp-rejection (--spec-type draft-mtp: the target's MTP "
            "layer drafts, greedy or probabilistic; only --fixture-kind mtp, which runs "
            "plain, mtp, mtp-rejection); eagle3 (--spec-type draft-eagle3: the fixture's "
            "EAGLE3 head drafts from the target's hidden states); dflash, dspark "
            "(--spec-type draft-dflash / draft-dspark: the fixture's DFlash or DSpark draft "
            "drafts a block anchored on the last token); replay, "
            "replay-rejection (the draft model, greedy or probabilistic, on a Mamba "
            "target: llama-server's checkpoint replay path; only --fixture-kind replay, "
            "which runs plain, replay, replay-rejection).",
        ),
    ),
    check=_check_server,
)
SPECULATIVE_EXAMPLE = EngineEntry(
    "speculative-example",
    _build_example,
    help="llama.cpp's llama-speculative, one process per seed",
    binaries=True,
)
URL = EngineEntry("url", _build_url, help="a running llama-server (--url)", url=True)


def register_engines(register: Register) -> None:
    """The registry's hook (`dist.registry.BUILTIN`)."""
    for entry in (SERVER, SPECULATIVE_EXAMPLE, URL):
        register(entry)


__all__ = [
    "DRAFT_SAMPLING",
    "PATHS",
    "SERVER",
    "SPECULATIVE_EXAMPLE",
    "URL",
    "register_engines",
    "spawn_server",
]
