"""`specaudit ab` error paths: one line on stderr, exit 2, no traceback, no server needed.

The unreachable URL is a real closed port on 127.0.0.1 (nothing listens there), not a fake.
In-process runs go through the shared `cli` fixture (tests/conftest.py).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from specaudit.llama import free_port

CliFn = Callable[..., tuple[int, str, str]]


def assert_one_line_error(code: int, stdout: str, stderr: str, needle: str) -> None:
    assert code == 2, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in stderr and stdout == ""


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
def test_bad_input_exits_2_with_one_line(cli: CliFn, args: list[str], needle: str) -> None:
    assert_one_line_error(*cli("ab", *args), needle)


def test_unreachable_url_exits_2_with_one_line(cli: CliFn) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = cli("ab", "--plain", url, "--spec", url, "--seeds", "2", "--tokens", "4")
    assert_one_line_error(*r, "cannot connect")


def test_unreachable_url_as_a_process() -> None:
    """The installed entry point, as a user runs it: same one line, exit 2."""
    url = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run(
        [sys.executable, "-m", "specaudit", "ab", "--plain", url, "--spec", url, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(r.returncode, r.stdout, r.stderr, "cannot connect")


def test_help_documents_exit_codes(cli: CliFn) -> None:
    code, out, _ = cli("ab", "--help")
    assert code == 0
    for needle in ("0  consistent", "1  instrument fault", "2  inconclusive"):
        assert needle in out
