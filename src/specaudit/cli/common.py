"""Helpers every command shares: option factories, JSON output, consoles, build progress.

Kept light on purpose (no numpy, scipy, matplotlib, httpx at import): `specaudit check --help`
imports this module, and start-up time is part of the interface.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.console import Console

from specaudit import progress

if TYPE_CHECKING:
    from specaudit.llama import LlamaBinaries
    from specaudit.llama.build import ProgressFn

__all__ = [
    "build_progress",
    "console",
    "emit_json",
    "ensure_binaries",
    "json_option",
    "out",
    "prompt_option",
    "sample_progress",
    "seeds_option",
    "tokens_option",
    "top_k_option",
]

FC = TypeVar("FC", bound=Callable[..., Any] | click.Command)

console = progress.stderr_console()  # progress, status lines: stderr
out = Console()  # results: stdout


def emit_json(obj: Any) -> None:
    from specaudit.report import to_jsonable

    click.echo(json.dumps(to_jsonable(obj), indent=2, sort_keys=False))


# --- options shared by check, ab and dist (each passes its own default and help) -----------


def _int_type(min_value: int | None) -> click.ParamType:
    return click.INT if min_value is None else click.IntRange(min=min_value)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")


def seeds_option(*, default: int, help: str, min_value: int | None = None) -> Callable[[FC], FC]:
    """``--seeds N``: how many seeds (samples) to draw."""
    return click.option(
        "--seeds", type=_int_type(min_value), default=default, show_default=True, help=help
    )


def tokens_option(*, default: int, help: str, min_value: int | None = None) -> Callable[[FC], FC]:
    """``--tokens N``: tokens generated per request or sample."""
    return click.option(
        "--tokens", type=_int_type(min_value), default=default, show_default=True, help=help
    )


def prompt_option(*, default: str | None, help: str) -> Callable[[FC], FC]:
    """``--prompt TEXT``; with no default the command picks one (shown in `help`)."""
    if default is None:
        return click.option("--prompt", help=help)
    return click.option("--prompt", default=default, show_default=True, help=help)


TOP_K_HELP = "Candidates requested per token (top_logprobs / n_probs)."


def top_k_option(
    param: str = "top_k",
    *,
    default: int = 3,
    min_value: int | None = 1,
    help: str | None = TOP_K_HELP,
) -> Callable[[FC], FC]:
    """``--top-k K``: logprob candidates per token, passed to the command as `param`."""
    return click.option(
        "--top-k",
        param,
        type=_int_type(min_value),
        default=default,
        show_default=True,
        help=help,
    )


# --- progress ------------------------------------------------------------------------------


@contextlib.contextmanager
def sample_progress(
    label: str = "sampling", total: int | None = None, *, unit: str = "", quiet: bool = False
) -> Iterator[progress.Bar]:
    """A bar over samples or responses on stderr (see `specaudit.progress.bar`)."""
    with progress.bar(label, total, unit=unit, quiet=quiet, console=console) as update:
        yield update


@contextlib.contextmanager
def build_progress(what: str = "llama.cpp") -> Iterator[ProgressFn]:
    """A bar fed by cmake's own percentage; plain lines when stderr is not a terminal.

    Off a terminal: a line per step (downloading, unpacking, configuring, building), then one
    per tenth of the build; messages are never cut.
    """
    with progress.bar(f"building {what}", 100, percent=True, console=console) as update:

        def cb(pct: float, msg: str) -> None:
            if pct == 0 and msg and not msg.startswith("download"):
                update.step(msg)  # a new phase: unpacking, configuring, building ...
            else:
                update(pct, msg=msg)

        yield cb


def ensure_binaries(
    build: int | None = None, patches: tuple[str, ...] = (), jobs: int | None = None
) -> LlamaBinaries:
    """Cached binaries, or a build with a progress bar (`build`: default llama.DEFAULT_BUILD)."""
    from specaudit import llama

    if build is None:
        build = llama.DEFAULT_BUILD
    found = llama.find(build, patches)
    if found is not None:
        return found
    label = f"llama.cpp b{build}" + (f" + {'+'.join(patches)}" if patches else "")
    with build_progress(label) as cb:
        return llama.ensure(build, patches, jobs=jobs, progress=cb)
