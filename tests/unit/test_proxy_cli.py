"""`specaudit proxy` argument handling: one-line errors and exit 2, never a traceback.

Runs in-process through the shared `cli` fixture (tests/conftest.py).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

CliFn = Callable[..., tuple[int, str, str]]


def test_help_documents_routing_and_exit_codes(cli: CliFn) -> None:
    code, out, _ = cli("proxy", "--help")
    assert code == 0
    for needle in (
        "--plain",
        "--spec",
        "--on-plain-down",
        "top_logprobs > 0",
        "n_probs > 0",
        "Exit codes",
        "could not start",
        "SPECAUDIT_PLAIN_API_KEY",
    ):
        assert needle in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--listen", "localhost:notaport"], "--listen port"),
        (["--listen", "127.0.0.1:70000"], "--listen port"),
        (["--plain", "localhost:8080"], "plain URL must start with http"),
        # an unclosed IPv6 literal must be a usage error, not a ValueError (exit 1, "finding")
        (["--plain", "http://[::1"], "plain URL cannot be parsed"),
        (["--spec", "http://[::1"], "spec URL cannot be parsed"),
        (["--spec", "http://user:pw@127.0.0.1:1"], "must not carry credentials"),
        (["--on-plain-down", "guess"], "guess"),
        (["--read-timeout", "0"], "read-timeout"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(cli: CliFn, args: list[str], needle: str) -> None:
    base = {"--plain": "http://127.0.0.1:1", "--spec": "http://127.0.0.1:2"}
    argv = ["proxy"]
    for k, v in base.items():
        if k not in args:
            argv += [k, v]
    code, _, err = cli(*argv, *args)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err
    assert "Traceback" not in err


def test_port_in_use_exits_2(cli: CliFn) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = cli(
            "proxy",
            "--plain",
            "http://127.0.0.1:1",
            "--spec",
            "http://127.0.0.1:2",
            "--listen",
            f"127.0.0.1:{port}",
        )
    assert code == 2
    assert f"error: cannot listen on 127.0.0.1:{port}" in err
