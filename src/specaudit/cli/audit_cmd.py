"""`specaudit audit`: run every section on built-in defaults and write the report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from specaudit import llama, progress
from specaudit.cli.common import (
    TEXT,
    WRITABLE_DIR,
    console,
    emit_json,
    ensure_binaries,
    json_option,
    out,
)
from specaudit.outcome import EXIT_TAIL_HELP
from specaudit.validate import MAX_INT32

if TYPE_CHECKING:
    from specaudit.llama.build import LlamaBinaries
    from specaudit.llama.patches import Patch

AUDIT_EXIT_HELP = (
    "\b\nExit codes:\n"
    "  0  every section ran (findings, such as placeholders, are in the report)\n"
    "  2  a section could not run (its error is in the report), or bad input\n" + EXIT_TAIL_HELP
)


@click.command("audit", epilog=AUDIT_EXIT_HELP)
@click.option(
    "--out",
    "out_dir",
    type=WRITABLE_DIR,
    default=Path("specaudit-report"),
    show_default=True,
    help="Directory for report.md, report.json, plots and server logs (checked writable "
    "before anything is built).",
)
@click.option(
    "--build",
    type=click.IntRange(1, MAX_INT32),
    default=llama.DEFAULT_BUILD,
    show_default=True,
    help="llama.cpp build number.",
)
@click.option(
    "--only",
    type=TEXT,
    multiple=True,
    help="Run only these sections (servers, check, ab, ...).",
)
@json_option
def command(out_dir: Path, build: int, only: tuple[str, ...], as_json: bool) -> None:
    """Provision llama.cpp, fixtures and Gemma 3 270M, start plain and speculating servers,
    and audit them: what /slots and /props say, placeholder logprobs, aggregates,
    sampling distributions, the proxy, and the patched server."""
    from specaudit import audit
    from specaudit.audit.runner import select
    from specaudit.llama.patches import resolve_all

    select(only)  # an unknown section is an error now, not after the build
    # Build (or find) every binary first, with its own progress bar: one live display at a time.
    prebuilt: dict[tuple[Patch, ...], LlamaBinaries] = {(): ensure_binaries(build)}
    for p in llama.available_patches(build):
        values = resolve_all((p,), build)
        prebuilt[values] = ensure_binaries(build, values)

    def ensure(b: int, patches: tuple[Patch, ...]) -> LlamaBinaries:
        return prebuilt.get(patches) or llama.ensure(b, patches)

    # On a terminal a live status line; off one, a line per step: [specaudit] audit: ...
    with progress.steps("audit", console=console) as step:
        report = audit.run(out_dir, build=build, only=only, progress=step, ensure_bins=ensure)
    if as_json:
        emit_json(audit.to_json(report))
    else:
        md = audit.to_markdown(report)
        # Rich's Markdown squeezes wide tables into 80 columns off a terminal: print it raw.
        if out.is_terminal:
            from rich.markdown import Markdown

            out.print(Markdown(md))
        else:
            click.echo(md)
        out.print(f"\nreport: {out_dir / 'report.md'}  {out_dir / 'report.json'}", highlight=False)
    raise SystemExit(report.exit_code)  # 2 if a section could not run, else 0
