"""CLI fuzz: every command x every option x hostile values -> exit 2, one `error:` line, no
traceback, in bounded time (and, for the subprocess cases, bounded memory).

The matrix is built from the click commands themselves, so a new option is fuzzed (or the
test fails until its type has a row in `hostile`). Values: empty, negative, zero, NaN, ±inf,
huge, not UTF-8, not a number, malformed URLs, unusable paths. Servers are a canned one
(tests/fakes.py, through the client's transport, no socket) that answers /slots and /props but
refuses every generation (HTTP 500): a value that slips past
validation reaches the request it would poison (JSON encoding, headers) and shows as a crash,
while a value that is valid still ends in a fast exit 2 ("no usable answer"). With
`SPECAUDIT_LLAMA_BIN` pointing at an empty directory nothing is ever built or started:
builds, server starts and model downloads are tripwires that fail the case (through the
guard's exit 3).

In-process cases use the shared `cli` fixture (tests/conftest.py); the few cases that need a
real process (argv bytes that are not UTF-8, a memory cap) use `subprocess`.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from fakes import Answer, Asked, route_clients
from specaudit.cli import cli as group
from specaudit.cli.common import FiniteFloat
from specaudit.llama import free_port

CliFn = Callable[..., tuple[int, str, str]]
SKIP_COMMANDS = {("proxy",)}  # a server that runs until stopped; its owner fuzzes it
# nothing listens here: filled in when a case runs (`fill`, `_closed`), so a test's id is the same
# in every collection (pytest-xdist's workers must collect the same ids)
CLOSED = "{closed}"


def _closed() -> str:
    return f"http://127.0.0.1:{free_port()}"


HUGE_INT = "9" * 40
NOT_UTF8 = os.fsdecode(b"\xff\xfe")

NUMBER = ["", "-1", "0", "nan", "inf", "-inf", "1e400", HUGE_INT, "abc", NOT_UTF8, "1,5"]
TEXT = ["", NOT_UTF8, "a" + NOT_UTF8 + "b"]
URL = [
    "", "http://[::1", "ftp://h", "http://", "http://:80", "http://h:99999", "http://h:abc",
    "localhost:8080", "http://a b", "http://h" + NOT_UTF8, "http://h:0", "http://h/?q=1",
    NOT_UTF8, "http://h\n",
]  # fmt: skip
CHOICE = ["", "nope", NOT_UTF8]
# {tmp}: the case's tmp dir (a directory), {file}: an existing file
FILE_PATH = ["", "/proc/foo/x.png", "{tmp}", "{file}/x.png", "/proc/foo", "a\0b"]
DIR_PATH = ["", "/proc/foo", "/proc/foo/x", "{file}", "{file}/sub", "a\0b"]


def hostile(param: click.Parameter) -> list[str]:
    """The hostile values for a parameter, by its type; unknown types fail the test."""
    t = param.type
    if "url" in (param.name or "") or (param.name in ("plain", "spec")):
        assert t.name == "url", f"{param.name}: declare URL options with common.URL"
    if isinstance(t, click.Choice):
        return CHOICE
    if isinstance(t, click.IntRange | click.FloatRange | FiniteFloat) or t in (
        click.INT,
        click.FLOAT,
    ):
        return NUMBER
    if t.name == "url":
        return URL
    if t.name == "auto|off|T":  # rescore --arm-temperature: a word or a number
        return CHOICE + NUMBER
    if isinstance(t, click.Path):
        return FILE_PATH if not t.dir_okay else DIR_PATH
    if t.name == "text" or t is click.STRING:
        return TEXT
    raise AssertionError(f"{param.name}: no hostile values for type {t!r}; add a row")


def leaf_commands() -> Iterator[tuple[tuple[str, ...], click.Command]]:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        if isinstance(cmd, click.Group):
            for sub in cmd.list_commands(ctx):
                subcmd = cmd.get_command(ctx, sub)
                assert subcmd is not None
                yield (name, sub), subcmd
        else:
            yield (name,), cmd


# Per command: arguments that make any *valid* value end fast in exit 2 (closed port, no
# binaries), and for each fuzzed parameter which of them to leave out.
BASE: dict[tuple[str, ...], list[str]] = {
    ("check",): ["{server}"],
    ("ab",): ["--plain", "{server}", "--spec", "{server}"],
    ("dist",): ["--engine", "url", "--url", "{server}", "--fixture", "{fixture}"],
    ("audit",): ["--out", "{tmp}/report"],
    ("fixtures", "build"): [],
    # a kind without an export: a valid value ends in exit 2 before anything is built
    ("fixtures", "export"): ["--format", "hf", "--kind", "mtp"],
    ("llama", "build"): [],
    ("llama", "path"): [],
    ("llama", "upstream-tests"): [],
    ("matrix",): [],
    ("rescore",): ["--url", "{server}", "--reference-url", "{server}"],
}
# ab's local-mode options apply without URLs: fuzzed without them (no binaries: exit 2)
LOCAL_AB = {"model", "draft", "spec_type", "log_dir"}


def base_args(path: tuple[str, ...], param: click.Parameter) -> list[str]:
    base = list(BASE[path])
    if isinstance(param, click.Argument):
        return [] if path == ("check",) else base
    opt = max(param.opts, key=len)
    if path == ("ab",) and param.name in LOCAL_AB:
        return []
    if opt in base:  # the fuzzed option replaces the base's value
        i = base.index(opt)
        del base[i : i + 2]
    return base


def cases() -> Iterator[Any]:
    for path, cmd in leaf_commands():
        if path in SKIP_COMMANDS:
            continue
        assert path in BASE, f"{' '.join(path)}: new command, add its BASE"
        for param in cmd.params:
            if isinstance(param, click.Option) and (param.is_flag or param.hidden):
                continue
            for value in hostile(param):
                yield pytest.param(
                    path, param.name, value, id=f"{'-'.join(path)}:{param.name}={value!r}"
                )


CASES = list(cases())


def _no_generation(asked: Asked) -> Answer:
    """A server that says who it is and refuses to generate anything."""
    if asked.path == "/slots":
        return Answer.json([{"id": 0, "speculative": False}])
    if asked.path == "/props":
        return Answer.json({"default_generation_settings": {}})
    return Answer.json({"error": {"message": "fuzz: no generation"}}, 500)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> str:
    return route_clients(monkeypatch, _no_generation)


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specaudit import fixtures

    return fixtures.build(tmp_path_factory.mktemp("fixture")).dir


@pytest.fixture
def tripwires(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """No build, no llama-server, no download can happen; the env every case runs in."""
    from specaudit import models
    from specaudit.llama import build, sdist, server

    def tripped(*a: Any, **k: Any) -> Any:
        raise AssertionError("a fuzz case reached a build, a server start or a download")

    for target, name in (
        (build, "_build"),
        (sdist, "fetch_sdist"),
        (sdist, "sdist_url"),
        (server.LlamaServer, "start"),
        (models, "gemma_270m"),
    ):
        monkeypatch.setattr(target, name, tripped)
    monkeypatch.chdir(tmp_path)  # a relative path a case creates lands here
    empty = tmp_path / "no-binaries"
    empty.mkdir()
    return {"SPECAUDIT_CACHE": str(tmp_path / "cache"), "SPECAUDIT_LLAMA_BIN": str(empty)}


def fill(args: list[str], tmp_path: Path, fixture: Path, server: str = CLOSED) -> list[str]:
    (tmp_path / "a-file").write_text("")
    subs = {
        "{tmp}": str(tmp_path),
        "{file}": str(tmp_path / "a-file"),
        "{fixture}": str(fixture),
        "{server}": server,
        CLOSED: _closed(),  # after {server}: a case without a server gets a closed port
    }
    out = []
    for a in args:
        for k, v in subs.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def assert_rejected(code: int, stdout: str, stderr: str) -> None:
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    lines = stderr.strip().splitlines()
    assert code == 2, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("path", "name", "value"), CASES)
def test_hostile_value_is_one_line_exit_2(
    cli: CliFn,
    tripwires: dict[str, str],
    tmp_path: Path,
    fixture_dir: Path,
    server: str,
    path: tuple[str, ...],
    name: str,
    value: str,
) -> None:
    cmd = dict(leaf_commands())[path]
    param = next(p for p in cmd.params if p.name == name)
    base = base_args(path, param)
    if isinstance(param, click.Argument):
        args = [*path, *base, value]
    else:
        args = [*path, *base, max(param.opts, key=len), value]
    code, out, err = cli(*fill(args, tmp_path, fixture_dir, server), env=tripwires)
    assert_rejected(code, out, err)


def test_the_matrix_covers_every_command_and_option() -> None:
    covered = {(p.values[0], p.values[1]) for p in CASES}
    for path, cmd in leaf_commands():
        if path in SKIP_COMMANDS:
            continue
        for param in cmd.params:
            if isinstance(param, click.Option) and (param.is_flag or param.hidden):
                continue
            assert (path, param.name) in covered, (path, param.name)
    assert len(CASES) > 300


# ------------------------------------------------------------- hostile environments

ENV_CASES = [
    (["llama", "path"], {"SPECAUDIT_CACHE": "/proc/foo"}),
    (["llama", "path"], {"SPECAUDIT_CACHE": "{file}"}),
    (["llama", "build"], {"SPECAUDIT_CACHE": "/proc/foo"}),
    (["llama", "build", "--patch", "spec-logprobs"], {"SPECAUDIT_CACHE": "{file}"}),
    (["audit", "--out", "{tmp}/r"], {"SPECAUDIT_CACHE": "/proc/foo"}),
    (["dist", "--engine", "url", "--url", CLOSED], {"SPECAUDIT_CACHE": "/proc/foo"}),
    (["ab"], {"SPECAUDIT_CACHE": "{file}"}),
    (["llama", "path"], {"SPECAUDIT_LLAMA_BIN": "/proc/foo"}),
    (["check", "{server}"], {"SPECAUDIT_API_KEY": "clé"}),
    (["check", "{server}"], {"SPECAUDIT_API_KEY": "two words"}),
    (["check", "{server}"], {"SPECAUDIT_API_KEY": NOT_UTF8}),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("args", "env"), ENV_CASES, ids=lambda x: repr(x)[:60])
def test_hostile_environment_is_one_line_exit_2(
    cli: CliFn,
    tripwires: dict[str, str],
    tmp_path: Path,
    fixture_dir: Path,
    server: str,
    args: list[str],
    env: dict[str, str],
) -> None:
    full: dict[str, str | None] = {**tripwires}
    if "SPECAUDIT_CACHE" in env:
        full["SPECAUDIT_LLAMA_BIN"] = None  # unset: the cache itself must be the error
    full.update({k: fill([v], tmp_path, fixture_dir)[0] for k, v in env.items()})
    code, out, err = cli(*fill(args, tmp_path, fixture_dir, server), env=full)
    assert_rejected(code, out, err)


# --------------------------------------------------- real processes: argv bytes, memory cap

MEMORY_CAP = 3 * 1024**3  # bytes of address space: `ulimit -v 3000000`


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


PROCESS_CASES: list[list[bytes]] = [
    [b"check", CLOSED.encode(), b"--prompt", b"\xff\xfe"],
    [b"check", b"http://h\xff/"],
    [b"check", CLOSED.encode(), b"--model", b"\xc3"],
    [b"ab", b"--plain", CLOSED.encode(), b"--spec", CLOSED.encode(), b"--prompt", b"\xff"],
    [b"ab", b"--spec-type", b"\xfe"],
    [b"dist", b"--engine", b"url", b"--url", CLOSED.encode(), b"--prompt", b"\xff"],
    # a billion seeds used to be a list first (MemoryError under the cap)
    [
        b"dist",
        b"--engine",
        b"url",
        b"--url",
        CLOSED.encode(),
        b"--seeds",
        b"1000000000",
        b"--tokens",
        b"3",
        b"--sequential",
    ],  # fmt: skip
    [b"dist", b"--engine", b"url", b"--url", CLOSED.encode(), b"--seeds", HUGE_INT.encode()],
    [b"audit", b"--out", b"/proc/foo"],
    [b"fixtures", b"build", b"/proc/foo"],
    [b"llama", b"build", b"--build", b"-1"],
    [b"llama", b"build", b"--patch", b"\xff"],
    [b"check", CLOSED.encode(), b"--temperature", b"nan"],
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", PROCESS_CASES, ids=lambda a: b" ".join(a)[:50].decode("latin-1"))
def test_hostile_argv_bytes_as_a_process(tmp_path: Path, argv: list[bytes]) -> None:
    empty = tmp_path / "no-binaries"
    empty.mkdir()
    env = {
        **os.environ,
        "SPECAUDIT_CACHE": str(tmp_path / "cache"),
        "SPECAUDIT_LLAMA_BIN": str(empty),
        "PATH": "/nonexistent",  # no cmake, no compiler: a build could not even start
    }
    closed = _closed().encode()
    argv = [a.replace(CLOSED.encode(), closed) for a in argv]
    r = subprocess.run(
        [os.fsencode(sys.executable), b"-m", b"specaudit", *argv],
        capture_output=True,
        timeout=50,
        env=env,
        cwd=tmp_path,
        preexec_fn=_cap_memory,
    )
    assert_rejected(r.returncode, r.stdout.decode(), r.stderr.decode("utf-8", "replace"))
