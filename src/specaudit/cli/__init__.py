"""The `specaudit` command line: argument parsing and rendering only; the work is in the library.

Each command lives in its own module here and is loaded only when it runs (or its own --help
is asked for): `specaudit --version` and `specaudit --help` import no command module, so no
numpy, scipy or matplotlib. Errors a user can cause are `SpecauditError`s: printed as one line
on stderr, exit code from the error (see `specaudit.outcome`). Any other exception is a bug:
`run`'s guard (`specaudit.cli.crash`) writes its traceback, redacted, to a file, prints one
``error:`` line naming the bug and that file, and exits 3 (`EXIT_INTERNAL`), so a crash can
never read as a verdict (Python's own exit 1 would mean "finding").
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import signal
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

import click

from specaudit import __version__
from specaudit.errors import SpecauditError
from specaudit.outcome import (
    EXIT_CODES_HELP,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NO_DECISION,
)

# name -> "module:attribute" of the click command.
COMMANDS: dict[str, str] = {
    "ab": "specaudit.cli.ab_cmd:command",
    "audit": "specaudit.cli.audit_cmd:command",
    "check": "specaudit.cli.check_cmd:command",
    "dist": "specaudit.cli.dist_cmd:command",
    "fixtures": "specaudit.cli.fixtures_cmd:command",
    "llama": "specaudit.cli.llama_cmd:command",
    "matrix": "specaudit.cli.matrix_cmd:command",
    "proxy": "specaudit.cli.proxy_cmd:command",
    "rescore": "specaudit.cli.rescore_cmd:command",
}

# The group's --help lists these without importing the commands. Each is the first sentence of
# the command's docstring (click's short help); tests/unit/test_cli.py checks they agree.
SHORT_HELP: dict[str, str] = {
    "ab": "Sample the same prompt and seeds from a plain and a speculating server and compare "
    "the mean logprob a client would compute (naive) with the mean over real tokens.",
    "audit": "Provision llama.cpp, fixtures and Gemma 3 270M, start plain and speculating "
    "servers, and audit them: what /slots and /props say, placeholder logprobs, aggregates, "
    "sampling distributions, the proxy, and the patched server.",
    "check": "Check whether the logprobs a server at URL returns are real.",
    "dist": "Prove whether speculative decoding preserves the sampling distribution.",
    "fixtures": "Tiny GGUF models with exactly known next-token distributions.",
    "llama": "Build and locate the llama.cpp binaries (llama-server, llama-speculative...).",
    "matrix": "Run placeholders (check), /props vs /slots and dist of the speculating server, "
    "stock and patched, on several llama.cpp builds, and print one table.",
    "proxy": "Route logprobs requests to a plain llama-server and the rest to a speculating one.",
    "rescore": "Re-score any model's samples against a plain reference of the same model.",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use.

    `lazy_commands` maps a command name to ``"module:attribute"``; `short_help` gives the line
    the group's --help shows for each, so listing the commands imports none of them. A
    command module that fails to import raises: it is a bug, never silently skipped.
    """

    def __init__(
        self,
        *args: Any,
        lazy_commands: Mapping[str, str] | None = None,
        short_help_table: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands: dict[str, str] = dict(lazy_commands or {})
        self.short_help_table: dict[str, str] = dict(short_help_table or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        target = self.lazy_commands.get(cmd_name)
        if target is None:
            return None
        cmd = load_command(target)
        self.add_command(cmd, cmd_name)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """As click's, but lazy commands' short help comes from the table (no import)."""
        rows: list[tuple[str, str]] = []
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)
        for name in names:
            if name in self.commands or name not in self.short_help_table:
                cmd = self.get_command(ctx, name)
                if cmd is None or cmd.hidden:
                    continue
                rows.append((name, cmd.get_short_help_str(limit)))
            else:
                # A throwaway command shortens the text exactly as click would the real one.
                stub = click.Command(name, help=self.short_help_table[name])
                rows.append((name, stub.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def load_command(target: str) -> click.Command:
    """Import ``"module:attribute"`` and return that click command; errors propagate."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    cmd = getattr(module, attr)
    if not isinstance(cmd, click.Command):
        raise TypeError(f"{target} is {type(cmd).__name__}, not a click command")
    return cmd


@click.group(
    cls=LazyGroup,
    lazy_commands=COMMANDS,
    short_help_table=SHORT_HELP,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EXIT_CODES_HELP,
)
@click.version_option(__version__, prog_name="specaudit")
def cli() -> None:
    """specaudit: trust what a speculating LLM server returns.

    llama-server, when it speculates, sends logprob 0.0 and no candidates for every token of
    its speculative loop, and its /props hides that it speculates. specaudit detects that
    (check), measures what it does to aggregates (ab), proves whether speculation keeps the
    sampling distribution (dist), routes around it (proxy) and runs everything at once (audit).
    """


def _sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM is handled as SIGINT is, so context managers stop the servers we started.

    Inside `asyncio.run` SIGINT's handler is asyncio's own: it cancels the main task and
    raises KeyboardInterrupt once the loop has unwound. Raising here instead would raise inside
    whichever task runs, and asyncio would print that task's traceback at exit."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not _sigterm:
        handler(signal.SIGINT, frame)
        return
    # SIGINT ignored (a background job of a shell without job control): the interrupt is
    # raised inside whichever task runs, and asyncio would report the tasks it leaves behind,
    # with tracebacks, as soon as they are collected: silence it before anything unwinds
    logging.getLogger("asyncio").disabled = True
    raise KeyboardInterrupt


def run(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code; errors are one `error:` line on stderr.

    `main` is this plus `sys.exit`; tests call it in-process (tests/conftest.py). Whatever
    happens the result is a documented exit code: a bug is `EXIT_INTERNAL`, never 1.
    """
    try:
        return _run(argv)
    except KeyboardInterrupt:
        _echo_err("error: interrupted")
        # an interrupt raised inside a task (SIGTERM while SIGINT is ignored, as in a
        # background job) leaves tasks that asyncio would report with tracebacks at exit
        logging.getLogger("asyncio").disabled = True
        return EXIT_INTERRUPTED
    except Exception as e:  # the guard: anything else is a bug in specaudit
        try:
            from specaudit.cli.crash import report

            line = report(e, argv)
        except Exception:  # noqa: BLE001 - even reporting failed: still one line
            line = f"error: internal error (a bug in specaudit): {type(e).__name__}"
        _echo_err(line)
        return EXIT_INTERNAL


def _echo_err(line: str) -> None:
    # if stderr itself is gone the exit code still tells
    with contextlib.suppress(Exception):
        click.echo(line, err=True)


def _run(argv: list[str] | None) -> int:
    try:
        rc = cli.main(args=argv, prog_name="specaudit", standalone_mode=False)
    except SystemExit as e:
        # a command's own exit code (raise SystemExit(result.exit_code))
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        # sys.exit("message"): an error that is not a verdict
        click.echo(f"error: {' '.join(str(e.code).split())}", err=True)
        return EXIT_NO_DECISION
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        return EXIT_INTERRUPTED
    except click.ClickException as e:
        # usage and other click errors: one line, exit 2 (click's own default, 1, is a finding)
        msg = e.format_message().splitlines()[0] if e.format_message() else str(e)
        click.echo(f"error: {msg}", err=True)
        return EXIT_NO_DECISION
    except SpecauditError as e:
        click.echo(f"error: {e}", err=True)
        return e.exit_code
    return rc if isinstance(rc, int) else 0


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    signal.signal(signal.SIGTERM, _sigterm)
    sys.exit(run(argv))
