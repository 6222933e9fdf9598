"""`specaudit proxy` argument handling: one-line errors and exit 2, never a traceback."""

from __future__ import annotations

import pytest

from specaudit.cli import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as ei:
        main(argv)
    out, err = capsys.readouterr()
    return int(ei.value.code or 0), out, err


def test_help_documents_routing_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["proxy", "--help"], capsys)
    assert code == 0
    for needle in ("--plain", "--spec", "--on-plain-down", "top_logprobs > 0", "n_probs > 0",
                   "Exit codes", "could not start", "SPECAUDIT_PLAIN_API_KEY"):
        assert needle in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--listen", "localhost:notaport"], "--listen port"),
        (["--listen", "127.0.0.1:70000"], "--listen port"),
        (["--plain", "localhost:8080"], "plain URL must start with http"),
        (["--spec", "http://user:pw@127.0.0.1:1"], "must not carry credentials"),
        (["--on-plain-down", "guess"], "guess"),
        (["--read-timeout", "0"], "read-timeout"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"--plain": "http://127.0.0.1:1", "--spec": "http://127.0.0.1:2"}
    argv = ["proxy"]
    for k, v in base.items():
        if k not in args:
            argv += [k, v]
    code, _, err = run(argv + args, capsys)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err
    assert "Traceback" not in err


def test_port_in_use_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = run(["proxy", "--plain", "http://127.0.0.1:1", "--spec",
                            "http://127.0.0.1:2", "--listen", f"127.0.0.1:{port}"], capsys)
    assert code == 2
    assert f"error: cannot listen on 127.0.0.1:{port}" in err
