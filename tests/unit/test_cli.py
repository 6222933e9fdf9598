"""The command line itself: lazy command loading, start-up imports, exit codes, progress lines.

In-process runs use the shared `cli` fixture (tests/conftest.py); what a fresh interpreter
imports is checked in a subprocess with ``python -X importtime``.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections.abc import Callable

import click
import pytest
from rich.console import Console

from specaudit import progress
from specaudit.cli import COMMANDS, SHORT_HELP, LazyGroup, cli, load_command

CliFn = Callable[..., tuple[int, str, str]]

HEAVY = ("scipy", "matplotlib", "numpy")


# --- lazy loading ---------------------------------------------------------------------------


def test_short_help_table_matches_each_command() -> None:
    """The static table the group's --help shows is each command's own short help."""
    assert set(SHORT_HELP) == set(COMMANDS)
    for name, target in COMMANDS.items():
        cmd = load_command(target)
        assert cmd.name == name
        assert cmd.get_short_help_str(limit=10**6) == SHORT_HELP[name], name


@pytest.mark.parametrize("width", [60, 80, 100, 200])
def test_group_help_lists_commands_as_click_would(width: int) -> None:
    lazy = LazyGroup("specaudit", lazy_commands=COMMANDS, short_help_table=SHORT_HELP)
    eager = click.Group("specaudit", commands={n: load_command(t) for n, t in COMMANDS.items()})
    got, want = click.HelpFormatter(width=width), click.HelpFormatter(width=width)
    lazy.format_commands(click.Context(lazy), got)
    eager.format_commands(click.Context(eager), want)
    assert got.getvalue() == want.getvalue()
    assert lazy.commands == {}  # listing imported nothing


def test_group_help_lists_every_command(cli: CliFn) -> None:
    code, out, err = cli("--help")
    assert code == 0 and err == ""
    listed = re.findall(r"^  (\w+)  ", out.split("Commands:")[1], re.M)
    assert listed == sorted(COMMANDS)
    assert "Exit codes:" in out


def test_a_missing_command_module_is_a_loud_error() -> None:
    group = LazyGroup("g", lazy_commands={"nope": "specaudit.cli.no_such_cmd:command"})
    assert group.list_commands(click.Context(group)) == ["nope"]
    with pytest.raises(ModuleNotFoundError, match="no_such_cmd"):
        group.get_command(click.Context(group), "nope")
    bad = LazyGroup("g", lazy_commands={"x": "specaudit.cli:COMMANDS"})
    with pytest.raises(TypeError, match="not a click command"):
        bad.get_command(click.Context(bad), "x")


def test_every_command_loads() -> None:
    for name in COMMANDS:
        assert cli.get_command(click.Context(cli), name) is not None, name


def _imported(*args: str) -> set[str]:
    """Top-level packages a fresh `python -m specaudit ARGS` imports."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "specaudit", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode in (0, 2), r.stderr[-2000:]
    mods = re.findall(r"^import time:\s*\d+ \|\s*\d+ \|\s*(\S+)$", r.stderr, re.M)
    assert mods, r.stderr[-2000:]
    return {m.split(".")[0] for m in mods}


@pytest.mark.parametrize(
    "args",
    [("--version",), ("--help",), ("check", "--help"), ("check", "http://127.0.0.1:9")],
)
def test_startup_imports_no_scipy_matplotlib_numpy(args: tuple[str, ...]) -> None:
    heavy = _imported(*args) & set(HEAVY)
    assert not heavy, f"specaudit {' '.join(args)} imported {sorted(heavy)}"


# --- exit codes and errors through the shared harness ----------------------------------------


def test_version(cli: CliFn) -> None:
    code, out, err = cli("--version")
    assert (code, err) == (0, "")
    assert out.startswith("specaudit, version ")


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["nope"], "No such command 'nope'"), (["check"], "Missing argument 'URL'")],
)
def test_usage_errors_are_one_line_exit_2(cli: CliFn, args: list[str], needle: str) -> None:
    code, out, err = cli(*args)
    assert code == 2 and out == ""
    assert err.splitlines() == [err.strip()] and err.startswith("error: ") and needle in err


def test_check_unreachable_is_one_line_exit_2(cli: CliFn) -> None:
    code, out, err = cli("check", "http://127.0.0.1:9")
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot connect")


# --- progress off a terminal: whole messages, one line per step ------------------------------

LONG = "Building C object vendor/hash/" + "x" * 150 + "/END.c.o"


def _plain() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=60), buf


def test_steps_off_a_terminal_print_one_whole_line_per_step() -> None:
    con, buf = _plain()
    with progress.steps("audit", console=con) as step:
        step("starting fixture-plain")
        step(LONG)
    assert buf.getvalue().splitlines() == [
        "[specaudit] audit: starting fixture-plain",
        f"[specaudit] audit: {LONG}",
    ]


def test_bar_off_a_terminal_prints_start_each_tenth_and_end() -> None:
    con, buf = _plain()
    with progress.bar("dist server", 1000, console=con) as update:
        for done in range(1001):
            update(done)
    lines = buf.getvalue().splitlines()
    assert lines == [f"[specaudit] dist server: {n}/1000" for n in range(0, 1001, 100)]


def test_bar_quiet_prints_nothing_off_a_terminal() -> None:
    con, buf = _plain()
    with progress.bar("sampling", 4, unit="responses", quiet=True, console=con) as update:
        for done in range(5):
            update(done, 4)
        update.step("starting plain server")
    assert buf.getvalue() == ""


def test_build_progress_never_cuts_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    from specaudit.cli import common

    con, buf = _plain()
    monkeypatch.setattr(common, "console", con)
    with common.build_progress("llama.cpp b1") as cb:
        for mib in range(1, 4):
            cb(0.0, f"downloading source {mib}/3 MiB")
        cb(0.0, "unpacking source")
        cb(0.0, "configuring with cmake")
        for pct in range(1, 100):
            cb(float(pct), LONG)
        cb(100.0, "done")
    lines = buf.getvalue().splitlines()
    assert lines[:3] == [
        "[specaudit] building llama.cpp b1:   0% downloading source 1/3 MiB",
        "[specaudit] building llama.cpp b1: unpacking source",
        "[specaudit] building llama.cpp b1: configuring with cmake",
    ]
    assert lines[3] == f"[specaudit] building llama.cpp b1:  10% {LONG}"  # whole, from its start
    assert lines[-1] == "[specaudit] building llama.cpp b1: 100% done"
    assert len(lines) == 3 + 9 + 1  # 10%..90%, then done


def test_on_a_terminal_a_long_message_is_cut_at_its_end() -> None:
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=100)
    with progress.bar("building llama.cpp", 100, percent=True, console=con) as update:
        update(42, msg=LONG)
    shown = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buf.getvalue())
    assert "Building C object vendor/hash/" in shown and "…" in shown
    assert "END.c.o" not in shown
