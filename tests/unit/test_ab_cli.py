"""`specaudit ab` error paths: one line on stderr, exit 2, no traceback, no server needed.

The unreachable URL is a real closed port on 127.0.0.1 (nothing listens there), not a fake.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from dataclasses import dataclass

import pytest

from specaudit.cli import main
from specaudit.llama import free_port


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str) -> Result:
    """`specaudit ab ARGS` in-process (fast); the exit code is what main() exits with."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["ab", *args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return Result(code, out.getvalue(), err.getvalue())


def assert_one_line_error(r: Result | subprocess.CompletedProcess[str], needle: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--seeds", "0"], "--seeds"),
        (["--tokens", "-1"], "--tokens"),
        (["--top-k", "0"], "--top-k"),
        (["--sampler-top-k", "-2"], "--sampler-top-k"),
        (["--endpoint", "completions"], "--endpoint"),
        (["--plain", "http://127.0.0.1:9"], "give both --plain and --spec"),
        (
            ["--plain", "http://127.0.0.1:9", "--spec", "http://127.0.0.1:9", "--model", "x"],
            "only apply when ab starts the servers",
        ),
        (["--plain", "127.0.0.1:9", "--spec", "http://127.0.0.1:9"], "http(s) URL"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], needle: str) -> None:
    assert_one_line_error(run_cli(*args), needle)


def test_unreachable_url_exits_2_with_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = run_cli("--plain", url, "--spec", url, "--seeds", "2", "--tokens", "4")
    assert_one_line_error(r, "cannot connect")


def test_unreachable_url_as_a_process() -> None:
    """The installed entry point, as a user runs it: same one line, exit 2."""
    url = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run(
        [sys.executable, "-m", "specaudit", "ab", "--plain", url, "--spec", url, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(r, "cannot connect")


def test_help_documents_exit_codes() -> None:
    r = run_cli("--help")
    assert r.returncode == 0
    for code in ("0  consistent", "1  instrument fault", "2  inconclusive"):
        assert code in r.stdout
