"""`specaudit matrix` input handling: build lists, bad input as one line with exit 2."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from specaudit import matrix

CliFn = Callable[..., tuple[int, str, str]]


def test_parse_builds() -> None:
    assert matrix.parse_builds("10705,11205,11434") == (10705, 11205, 11434)
    assert matrix.parse_builds(" b10705 , 10705,11434") == (10705, 11434)  # deduplicated


@pytest.mark.parametrize("bad", ["", "x", "10705,,11434", "-1", "0", "1.5", "99999999999"])
def test_parse_builds_rejects(bad: str) -> None:
    with pytest.raises(matrix.MatrixError, match="--builds"):
        matrix.parse_builds(bad)


@pytest.mark.parametrize(
    "args",
    [["--builds", "abc"], ["--builds", "10705,x"], ["--seeds", "0"]],
)
def test_cli_bad_input_is_one_line_exit_2(cli: CliFn, args: list[str]) -> None:
    code, out, err = cli("matrix", *args)
    assert code == 2
    assert out == "" and len(err.strip().splitlines()) <= 3  # click's usage + one error line
    assert "Traceback" not in err


def test_help_documents_exit_codes(cli: CliFn) -> None:
    code, out, _ = cli("matrix", "--help")
    assert code == 0 and "Exit codes:" in out and "--builds" in out
