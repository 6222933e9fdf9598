"""Helpers every command shares: option types and factories, JSON output, consoles, build
progress.

Every option is checked by its type before the command body runs (so before any build,
server start or request): numbers are finite and in range (`FiniteFloat`, `IntRange`), text
is UTF-8 (`TEXT`), URLs parse (`URL`), output paths are writable (`WRITABLE_FILE`,
`WRITABLE_DIR`). The types wrap `specaudit.validate`, which the library calls again.

Kept light on purpose (no numpy, scipy, matplotlib, httpx at import): `specaudit check --help`
imports this module, and start-up time is part of the interface.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.console import Console

from specaudit import progress, validate
from specaudit.validate import MAX_INT32, MAX_SEED, MAX_TIMEOUT

if TYPE_CHECKING:
    from specaudit.llama import LlamaBinaries, Patch
    from specaudit.llama.build import ProgressFn

__all__ = [
    "API_KEY",
    "TEXT",
    "URL",
    "WRITABLE_DIR",
    "WRITABLE_FILE",
    "FIXTURE_KINDS",
    "FiniteFloat",
    "SafePath",
    "build_progress",
    "choice_option",
    "console",
    "emit_json",
    "ensure_binaries",
    "fixture_kind_option",
    "json_option",
    "out",
    "prompt_option",
    "sample_progress",
    "seed_option",
    "seeds_option",
    "temperature_option",
    "timeout_option",
    "tokens_option",
    "top_k_option",
]

FC = TypeVar("FC", bound=Callable[..., Any] | click.Command)

console = progress.stderr_console()  # progress, status lines: stderr
out = Console()  # results: stdout


def emit_json(obj: Any) -> None:
    from specaudit.report import to_jsonable

    click.echo(json.dumps(to_jsonable(obj), indent=2, sort_keys=False))


# --- option types: every value checked before the command runs ----------------------------


class FiniteFloat(click.FloatRange):
    """`click.FloatRange` that also rejects nan and ±inf (a range alone lets nan through)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


class _Checked(click.ParamType):
    """A type whose check is a `specaudit.validate` function (its error becomes click's)."""

    def __init__(self, name: str, check: Callable[[Any], Any]) -> None:
        self.name = name
        self._check = check

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return self._check(value)
        except validate.InputError as e:
            self.fail(str(e), param, ctx)


class SafePath(click.Path):
    """`click.Path` returning `Path`s that rejects "" (it would silently mean ".") and a NUL
    byte (os.stat's ValueError) as usage errors."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(path_type=Path, **kwargs)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail("the path is empty.", param, ctx)
        try:
            return super().convert(value, param, ctx)
        except ValueError as e:  # embedded null byte
            self.fail(f"{value!r} is not a usable path ({e}).", param, ctx)


class _CheckedPath(SafePath):
    """`SafePath`, then a writability check that may create directories."""

    def __init__(self, check: Callable[[Path], Path], *, file: bool) -> None:
        super().__init__(file_okay=file, dir_okay=not file)
        self._check = check

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = super().convert(value, param, ctx)
        try:
            return self._check(Path(os.fsdecode(path)))
        except validate.InputError as e:
            self.fail(str(e), param, ctx)


URL = _Checked("url", validate.url)  # http(s), parseable host and port
TEXT = _Checked("text", validate.text)  # UTF-8 (no undecodable argv bytes)
API_KEY = _Checked("text", validate.token)  # printable ASCII; never echoed
WRITABLE_FILE = _CheckedPath(validate.writable_file, file=True)  # its directory: made, writable
WRITABLE_DIR = _CheckedPath(validate.writable_dir, file=False)  # made, writable


def _int_type(min_value: int | None, max_value: int | None = MAX_INT32) -> click.ParamType:
    return click.IntRange(min=min_value, max=max_value)


# --- options shared by check, ab and dist (each passes its own default and help) -----------


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")


def seeds_option(
    *, default: int, help: str, min_value: int | None = None, max_value: int = MAX_SEED
) -> Callable[[FC], FC]:
    """``--seeds N``: how many seeds (samples) to draw."""
    return click.option(
        "--seeds",
        type=_int_type(min_value, max_value),
        default=default,
        show_default=True,
        help=help,
    )


def seed_option(
    name: str = "--seed", *, default: int = 1, help: str | None = None
) -> Callable[[FC], FC]:
    """``--seed N``: a reproducible llama.cpp seed, 0..2^32-2 (2^32-1 means random there)."""
    return click.option(
        name,
        type=click.IntRange(0, MAX_SEED),
        default=default,
        show_default=True,
        help=help,
    )


def tokens_option(*, default: int, help: str, min_value: int | None = None) -> Callable[[FC], FC]:
    """``--tokens N``: tokens generated per request or sample."""
    return click.option(
        "--tokens", type=_int_type(min_value), default=default, show_default=True, help=help
    )


def prompt_option(*, default: str | None, help: str) -> Callable[[FC], FC]:
    """``--prompt TEXT``; with no default the command picks one (shown in `help`)."""
    if default is None:
        return click.option("--prompt", type=TEXT, help=help)
    return click.option("--prompt", type=TEXT, default=default, show_default=True, help=help)


def temperature_option(
    *names: str, default: float = 1.0, help: str = "Sampling temperature (finite, >= 0)."
) -> Callable[[FC], FC]:
    """``--temperature T``: finite and >= 0 everywhere (0 = greedy)."""
    return click.option(
        *(names or ("--temperature",)),
        type=FiniteFloat(min=0),
        default=default,
        show_default=True,
        help=help,
    )


def timeout_option(*, default: float, help: str = "Seconds per request.") -> Callable[[FC], FC]:
    """``--timeout S``: per request, > 0 and at most a day (more overflows the socket layer)."""
    return click.option(
        "--timeout",
        type=FiniteFloat(min=0, min_open=True, max=MAX_TIMEOUT),
        default=default,
        show_default=True,
        help=f"{help} (0 < S <= {MAX_TIMEOUT:g})",
    )


def choice_option(
    *names: str,
    choices: Sequence[str],
    param: str | None = None,
    multiple: bool = False,
    default: str | None = None,
    help: str,
) -> Callable[[FC], FC]:
    """``--NAME CHOICE``: one of `choices` (exact, case-sensitive), checked before the command
    runs; `multiple`: repeatable, passed as a tuple; `param`: the command's parameter name."""
    return click.option(
        *names,
        *([param] if param else []),
        type=click.Choice(tuple(choices)),
        multiple=multiple,
        default=default,
        show_default=default is not None,
        help=help,
    )


# `specaudit.fixtures.KINDS`, spelled out here: that module imports numpy, and `--help` must
# not (tests/unit/test_cli_dist_paths.py checks they agree).
FIXTURE_KINDS = ("last-token", "context", "mtp", "mtp-context", "mtp-attention", "replay")
FIXTURE_KIND_HELP = (
    "Fixture kind: last-token (each token's distribution depends on the previous token only), "
    "context (on the whole context, through attention), mtp (last-token, a glm4moe whose "
    "multi-token-prediction layer drafts for --spec-type draft-mtp), mtp-context (the same "
    "glm4moe on the context kind's attention: target and draft see the whole context), "
    "mtp-attention (mtp whose MTP layer attends over its own KV cache: its drafts depend on "
    "what that cache holds) or "
    "replay (last-token, a "
    "Mamba target: llama-server verifies through its checkpoint replay path)."
)


def fixture_kind_option(
    *names: str, default: str | None = None, help: str = FIXTURE_KIND_HELP
) -> Callable[[FC], FC]:
    """``--fixture-kind KIND`` (or `names`): a `FIXTURE_KINDS` value."""
    return choice_option(
        *(names or ("--fixture-kind",)),
        param="fixture_kind",
        choices=FIXTURE_KINDS,
        default=default,
        help=help,
    )


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
    build: int | None = None, patches: tuple[Patch, ...] = (), jobs: int | None = None
) -> LlamaBinaries:
    """Cached binaries, or a build with a progress bar (`build`: default llama.DEFAULT_BUILD).

    `patches`: resolved once where the user typed them (`specaudit.llama.patches.resolve`);
    the lookup and the build use the same values."""
    from specaudit import llama

    if build is None:
        build = llama.DEFAULT_BUILD
    found = llama.find(build, patches)
    if found is not None:
        return found
    label = f"llama.cpp b{build}" + (f" + {'+'.join(p.name for p in patches)}" if patches else "")
    with build_progress(label) as cb:
        return llama.ensure(build, patches, jobs=jobs, progress=cb)
