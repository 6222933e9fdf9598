"""Progress on stderr, one way for every command: live on a terminal, plain lines elsewhere.

On a terminal (rich): a transient live bar or spinner; a message too long for the line is cut
at its END with an ellipsis, never at its start. Off a terminal (CI logs, ``2> file``): one
plain line per step, ``[specaudit] LABEL: message``, with the whole message.

    with progress.steps("audit") as step:         # a status line per step
        step("starting fixture-plain")
    with progress.bar("building llama.cpp", 100, percent=True) as update:
        update(42, msg="Building C object ggml/...")  # a line per tenth off a terminal
        update.step("linking")                    # always a line off a terminal

rich is imported only when a display starts, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

PREFIX = "[specaudit]"

StepFn = Callable[[str], None]
"""``step(msg)``: report that a new step started."""


def line(label: str, msg: str) -> str:
    """The plain line printed off a terminal: ``[specaudit] LABEL: msg``, msg uncut."""
    return f"{PREFIX} {label}: {msg}" if msg else f"{PREFIX} {label}"


_default_console: Console | None = None


def stderr_console() -> Console:
    """The shared rich console on stderr (created on first use)."""
    global _default_console
    if _default_console is None:
        from rich.console import Console

        _default_console = Console(stderr=True)
    return _default_console


def _write(file: IO[str], text: str) -> None:
    file.write(text + "\n")
    file.flush()


def _msg_column() -> Any:
    from rich.progress import TextColumn
    from rich.table import Column

    # no_wrap + ellipsis: rich cuts a long message at its end to fit the line.
    return TextColumn(
        "{task.fields[msg]}",
        style="dim",
        markup=False,
        table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1),
    )


@contextlib.contextmanager
def steps(label: str, *, console: Console | None = None) -> Iterator[StepFn]:
    """Report the steps of one long task through the yielded ``step(msg)``.

    On a terminal a spinner shows ``LABEL: msg`` for the latest step; off a terminal every
    step prints one line ``[specaudit] LABEL: msg`` on stderr.
    """
    con = console or stderr_console()
    if not con.is_terminal:

        def step(msg: str) -> None:
            _write(con.file, line(label, msg))

        yield step
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}:", style="bold", markup=False),
        _msg_column(),
        console=con,
        transient=True,
        expand=True,  # the message column takes (only) the room left
    ) as prog:
        task = prog.add_task(label, total=None, msg="")

        def live_step(msg: str) -> None:
            prog.update(task, msg=msg)

        yield live_step


def say(label: str, msg: str, *, console: Console | None = None) -> None:
    """One step line that stays: dim above any live display on a terminal, plain off one."""
    con = console or stderr_console()
    if not con.is_terminal:
        _write(con.file, line(label, msg))
        return
    from rich.text import Text

    con.print(Text(f"{label}: {msg}", style="dim"))


class Bars:
    """Progress of one or more labelled tasks: ``bars(label, done, total=None, msg="")``.

    Off a terminal a task prints a line when it starts, each time it passes another tenth of
    its total, and when it completes; `step` prints a line whatever the count.
    """

    def __init__(
        self,
        prog: Progress | None,
        file: IO[str],
        *,
        percent: bool = False,
        unit: str = "",
        quiet: bool = False,
    ) -> None:
        self._prog = prog
        self._file = file
        self._percent = percent
        self._unit = unit
        self._quiet = quiet
        self._tasks: dict[str, TaskID] = {}
        self._tenth: dict[str, int] = {}
        self._finished: set[str] = set()

    def __call__(self, label: str, done: float, total: float | None = None, msg: str = "") -> None:
        if self._prog is not None:
            if label not in self._tasks:
                self._tasks[label] = self._prog.add_task(label, total=total, msg=msg)
            self._prog.update(self._tasks[label], completed=done, total=total, msg=msg)
            return
        if self._quiet:
            return
        first = label not in self._tenth
        tenth = min(int(10 * done / total), 10) if total else 0
        finished = bool(total) and done >= (total or 0)
        if first or tenth > self._tenth[label] or (finished and label not in self._finished):
            self._tenth[label] = max(tenth, self._tenth.get(label, -1))
            if finished:
                self._finished.add(label)
            _write(self._file, line(label, self._count(done, total, msg)))

    def step(self, label: str, msg: str) -> None:
        """A new step of task `label` (download, configure...): a line off a terminal."""
        if self._prog is not None:
            if label not in self._tasks:
                self._tasks[label] = self._prog.add_task(label, total=None, msg=msg)
            self._prog.update(self._tasks[label], msg=msg)
        elif not self._quiet:
            _write(self._file, line(label, msg))

    def _count(self, done: float, total: float | None, msg: str) -> str:
        if self._percent:
            head = f"{done:3.0f}%"
        else:
            head = f"{done:.0f}" + (f"/{total:.0f}" if total else "")
            if self._unit:
                head += f" {self._unit}"
        return f"{head} {msg}" if msg else head


class Bar:
    """One task of a `Bars`: ``bar(done, total=None, msg="")`` and ``bar.step(msg)``."""

    def __init__(self, bars: Bars, label: str, total: float | None) -> None:
        self._bars = bars
        self.label = label
        self.total = total

    def __call__(self, done: float, total: float | None = None, msg: str = "") -> None:
        if total is not None:
            self.total = total
        self._bars(self.label, done, self.total, msg)

    def step(self, msg: str) -> None:
        """A new step (download, configure...): always a line off a terminal."""
        self._bars.step(self.label, msg)


@contextlib.contextmanager
def bars(
    *,
    percent: bool = False,
    unit: str = "",
    quiet: bool = False,
    console: Console | None = None,
) -> Iterator[Bars]:
    """A display for several labelled bars, e.g. one per engine.

    `percent`: `done` is a percentage (shown ``42%``), else a count (shown ``42/100 UNIT``).
    `quiet`: print nothing off a terminal (only the live bar on one).
    """
    con = console or stderr_console()
    if not con.is_terminal:
        yield Bars(None, con.file, percent=percent, unit=unit, quiet=quiet)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import Progress as RichProgress

    count: list[ProgressColumn] = (
        [TextColumn("{task.percentage:>3.0f}%")] if percent else [MofNCompleteColumn()]
    )
    if unit and not percent:
        count.append(TextColumn(unit, markup=False))
    with RichProgress(
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(bar_width=24),
        *count,
        TimeElapsedColumn(),
        _msg_column(),
        console=con,
        transient=True,
        expand=True,  # the message column takes (only) the room left
    ) as prog:
        yield Bars(prog, con.file, percent=percent, unit=unit, quiet=quiet)


@contextlib.contextmanager
def bar(
    label: str,
    total: float | None = None,
    *,
    percent: bool = False,
    unit: str = "",
    quiet: bool = False,
    console: Console | None = None,
) -> Iterator[Bar]:
    """One bar: yields ``update(done, total=None, msg="")`` (with ``update.step(msg)``).

    On a terminal a live bar; off a terminal a line at the start, at each further tenth of
    `total` and at the end (nothing if `quiet`). See `bars` for `percent` and `unit`.
    """
    with bars(percent=percent, unit=unit, quiet=quiet, console=console) as b:
        yield Bar(b, label, total)


__all__ = [
    "PREFIX",
    "Bar",
    "Bars",
    "StepFn",
    "bar",
    "bars",
    "line",
    "say",
    "stderr_console",
    "steps",
]
