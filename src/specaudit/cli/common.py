"""Helpers every command shares: JSON output, the exit-code epilog, a build progress bar."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from specaudit import llama
from specaudit.llama.build import ProgressFn
from specaudit.report import to_jsonable

EXIT_CODES_HELP = (
    "\b\nExit codes:\n"
    "  0  OK: nothing found (every logprob real, distribution preserved, ...)\n"
    "  1  finding: placeholders found, distribution broken, instrument fault, ...\n"
    "  2  no decision: bad input, unreachable or non-LLM server, failed build\n"
    "  130 interrupted"
)

console = Console(stderr=True)
out = Console()


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(to_jsonable(obj), indent=2, sort_keys=False))


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")


@contextlib.contextmanager
def build_progress(what: str = "llama.cpp") -> Iterator[ProgressFn]:
    """A rich progress bar fed by cmake's own percentage; plain lines when not a terminal."""
    if sys.stderr.isatty():
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[msg]}", style="dim"),
            console=console,
            transient=True,
        ) as prog:
            task = prog.add_task(f"building {what}", total=100, msg="")

            def cb(pct: float, msg: str) -> None:
                prog.update(task, completed=pct, msg=msg[-60:])

            yield cb
    else:
        last = [-10.0]

        def cb(pct: float, msg: str) -> None:
            if pct >= last[0] + 10 or (pct == 0 and msg and not msg.startswith("download")):
                last[0] = max(pct, last[0]) if pct else last[0]
                print(f"[specaudit] building {what}: {pct:3.0f}% {msg[-70:]}", file=sys.stderr)

        yield cb


def ensure_binaries(
    build: int = llama.DEFAULT_BUILD, patches: tuple[str, ...] = (), jobs: int | None = None
) -> llama.LlamaBinaries:
    """Cached binaries, or a build with a progress bar."""
    found = llama.find(build, patches)
    if found is not None:
        return found
    label = f"llama.cpp b{build}" + (f" + {'+'.join(patches)}" if patches else "")
    with build_progress(label) as cb:
        return llama.ensure(build, patches, jobs=jobs, progress=cb)
