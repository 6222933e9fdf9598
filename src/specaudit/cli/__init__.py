"""The `specaudit` command line: argument parsing and rendering only; the work is in the library.

Each command lives in its own module here and is registered below. Errors a user can cause
are `SpecauditError`s: printed as one line on stderr, exit code from `specaudit.errors`.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

import click

from specaudit import __version__
from specaudit.cli.common import EXIT_CODES_HELP
from specaudit.errors import EXIT_ERROR, SpecauditError


@click.group(
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


def _register() -> None:
    from specaudit.cli import audit_cmd, fixtures_cmd, llama_cmd

    for mod in (llama_cmd, fixtures_cmd, audit_cmd):
        cli.add_command(mod.command)
    import importlib

    # Capability commands register themselves if their module is present.
    for name in ("check_cmd", "ab_cmd", "dist_cmd", "proxy_cmd"):
        try:
            mod = importlib.import_module(f"specaudit.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"specaudit.cli.{name}":
                raise
            continue
        cli.add_command(mod.command)


def _sigterm(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so context managers stop the servers we started.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    signal.signal(signal.SIGTERM, _sigterm)
    _register()
    try:
        rc = cli.main(args=argv, prog_name="specaudit", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        # usage errors: one line, exit 2
        msg = e.format_message().splitlines()[0] if e.format_message() else str(e)
        click.echo(f"error: {msg}", err=True)
        sys.exit(e.exit_code if e.exit_code else EXIT_ERROR)
    except SpecauditError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)
