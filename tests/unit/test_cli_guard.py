"""A crash never reads as a result: the CLI's guard and the validation that runs before any
work.

The guard (`specaudit.cli.run` + `specaudit.cli.crash`): an exception that is not a
`SpecauditError` is a bug; one ``error:`` line names it and the file its (redacted) traceback
went to, exit `EXIT_INTERNAL` (3), never Python's 1 (= finding). Bad input (URLs, timeouts,
temperatures, text that is not UTF-8, plot and cache paths, seed ranges) is one line, exit 2,
before anything is sent; a server that never answers ends in one line too; huge seed ranges
run in bounded memory. Servers are fakes (tests/fakes.py): canned answers through the client's
transport (no socket) where the CLI runs in-process, real sockets where a process is the client
or the point is a server that never answers.
In-process runs use the shared `cli` fixture (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import resource
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from fakes import Answer, Asked, route_clients, serve, serve_tcp, serving
from specaudit import ab, check, distribution, fixtures, paths
from specaudit.cli import COMMANDS, crash
from specaudit.errors import ServerError, SpecauditError
from specaudit.llama import free_port
from specaudit.llama.process import ManagedServer
from specaudit.outcome import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_NO_DECISION

CliFn = Callable[..., tuple[int, str, str]]
SPEC = fixtures.default_spec()
WL = distribution.make_workload(SPEC, tokens=3)
PROC = "/proc/foo"  # cannot be created, even by root
BAD_URL = "http://[::1"


def one_error_line(r: tuple[int, str, str], code: int = EXIT_NO_DECISION) -> str:
    exit_code, stdout, stderr = r
    assert exit_code == code, (exit_code, stdout, stderr)
    assert "Traceback" not in stderr and "Traceback" not in stdout
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


# --------------------------------------------------------------------------------- fakes


class Recorder:
    """A llama-server-like fake: /slots, /props, and generation endpoints; records requests.

    `text`: what /completion generates (letters of the fixture, for dist); chat and
    completions answer with one real token.
    """

    def __init__(self, text: str = "fgh") -> None:
        self.text = text
        self.hits: list[str] = []

    @property
    def generations(self) -> list[str]:
        return [h for h in self.hits if h not in ("/slots", "/props", "/health")]

    def __call__(self, asked: Asked) -> Answer:
        self.hits.append(asked.path)
        if asked.path == "/slots":
            return Answer.json([{"id": 0, "speculative": False}])
        if asked.path == "/props":
            return Answer.json({"default_generation_settings": {}})
        if asked.path == "/completion":
            n = int(asked.json().get("n_predict", 3))
            return Answer.json({"content": (self.text * n)[:n], "timings": {}})
        lp = {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5}]}
        return Answer.json(
            {"choices": [{"message": {"content": "a"}, "logprobs": {"content": [lp]}}]}
        )


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> tuple[Recorder, str]:
    """A Recorder answering every client the test's code builds (no socket), and its URL."""
    rec = Recorder()
    return rec, route_clients(monkeypatch, rec)


@pytest.fixture
def served_recorder() -> Iterator[tuple[Recorder, str]]:
    """A Recorder on a real socket: for a client in another process, or beside a socket that
    never answers."""
    rec = Recorder()
    with serve(serving(rec)) as srv:
        yield rec, srv.url


async def _hang(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Accepts the connection, reads, never answers."""
    await asyncio.sleep(3600)


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache: crash files never land in the user's."""
    d = tmp_path / "cache"
    monkeypatch.setenv("SPECAUDIT_CACHE", str(d))
    return d


# ------------------------------------------------------------------------------- the guard


def _bug(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "boom: headers={'Authorization': 'Bearer sk-header-secret'} url=http://u:pw-in-url@h/"
    )


def test_a_bug_is_one_line_exit_3_with_a_redacted_traceback_file(
    cli: CliFn, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check, "run", _bug)
    env = {"SPECAUDIT_PLAIN_API_KEY": "env-secret-value"}
    r = cli("check", "http://127.0.0.1:9", "--api-key", "sk-argv-secret", env=env)
    line = one_error_line(r, EXIT_INTERNAL)
    assert "internal error" in line and "RuntimeError: boom" in line
    where = re.search(r"traceback: (\S+)$", line)
    assert where, line
    path = Path(where[1])
    assert path.parent == cache / "crashes" and path.is_file()
    assert path.stat().st_mode & 0o077 == 0  # private: it may quote a request
    text = path.read_text()
    assert "Traceback (most recent call last)" in text and "_bug" in text
    assert "argv: specaudit check http://127.0.0.1:9 --api-key [redacted]" in text
    for secret in ("sk-argv-secret", "sk-header-secret", "pw-in-url", "env-secret-value"):
        assert secret not in text and secret not in line


def test_the_guard_still_prints_one_line_when_no_traceback_file_can_be_written(
    cli: CliFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check, "run", _bug)
    monkeypatch.setattr(crash.tempfile, "gettempdir", lambda: PROC)
    line = one_error_line(cli("check", "http://127.0.0.1:9", env={"SPECAUDIT_CACHE": PROC}), 3)
    assert "RuntimeError: boom" in line and "the traceback could not be written" in line
    assert "sk-header-secret" not in line


def test_the_guard_as_a_process_exits_3_not_1(tmp_path: Path) -> None:
    code = (
        "import specaudit.check as c\n"
        "def bug(*a, **k): raise KeyError('x')\n"
        "c.run = bug\n"
        "from specaudit.cli import main\n"
        "main(['check', 'http://127.0.0.1:9'])\n"
    )
    env = {**os.environ, "SPECAUDIT_CACHE": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    line = one_error_line((r.returncode, r.stdout, r.stderr), EXIT_INTERNAL)
    assert "KeyError" in line and str(tmp_path / "crashes") in line


def test_interrupts_and_message_exits_are_never_verdicts(
    cli: CliFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(*a: Any, **k: Any) -> None:
        raise KeyboardInterrupt

    def message(*a: Any, **k: Any) -> None:
        raise SystemExit("the server is gone")

    monkeypatch.setattr(check, "run", interrupt)
    assert one_error_line(cli("check", "http://h"), EXIT_INTERRUPTED) == "error: interrupted"
    monkeypatch.setattr(check, "run", message)
    assert one_error_line(cli("check", "http://h")) == "error: the server is gone"


# A command's event loop interrupted by a real signal: asyncio.run's own SIGINT handling, SIGTERM
# (handled as SIGINT), and SIGTERM while SIGINT is ignored (a background job of a shell without
# job control: the KeyboardInterrupt is raised inside whichever task runs). asyncio used to print
# "Task exception was never retrieved" with a traceback after the one line, at exit.
_LOOP_INTERRUPTED = """
import asyncio, os, signal, sys, threading
ign = sys.argv[2] == "ignored"
signal.signal(signal.SIGINT, signal.SIG_IGN if ign else signal.default_int_handler)
import specaudit.cli as c
import specaudit.check as check

def run(*a, **k):
    async def one():  # busy in Python code: the signal's exception is raised inside a task
        while True:
            sum(range(10_000))
            await asyncio.sleep(0)
    async def go():  # as rescore's: requests gathered, a client closed on the way out
        try:
            await asyncio.gather(*(one() for _ in range(3)))
        finally:
            await asyncio.sleep(0)
    threading.Timer(0.5, os.kill, (os.getpid(), getattr(signal, sys.argv[1]))).start()
    asyncio.run(go())

check.run = run
c.main(["check", "http://127.0.0.1:9"])
"""


@pytest.mark.parametrize(
    ("sig", "sigint"),
    [("SIGTERM", "handled"), ("SIGINT", "handled"), ("SIGTERM", "ignored")],
)
def test_a_signal_inside_an_event_loop_is_one_line_and_130(sig: str, sigint: str) -> None:
    p = subprocess.run(
        [sys.executable, "-c", _LOOP_INTERRUPTED, sig, sigint],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == EXIT_INTERRUPTED, (p.returncode, p.stderr[-2000:])
    assert p.stderr.strip() == "error: interrupted", p.stderr[-2000:]


def test_a_click_error_inside_a_command_is_2_not_click_s_1(
    cli: CliFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    import click

    def click_error(*a: Any, **k: Any) -> None:
        raise click.ClickException("bad file")

    monkeypatch.setattr(check, "run", click_error)
    assert one_error_line(cli("check", "http://h")) == "error: bad file"


def test_redaction_of_known_and_credential_shaped_secrets() -> None:
    secrets = crash.secret_values(
        ["check", "--api-key", "k-argv", "--tokens", "1000", "--token=tok-eq"],
        {"SPECAUDIT_SPEC_API_KEY": "k-env", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert set(secrets) == {"k-argv", "tok-eq", "k-env"}  # not --tokens' 1000, not "false"
    text = (
        "k-argv k-env tok-eq Authorization: Bearer abc.def X-Api-Key: xyz "
        '{"api_key": "j1"} api-key=q2 Basic dXNlcjpwYXNzd29yZA== basic checks '
        "http://me:pw1@host/ --tokens 1000 false"
    )
    out = crash.redact(text, secrets)
    for s in ("k-argv", "k-env", "tok-eq", "abc.def", "xyz", "j1", "q2", "dXNlcjpw", "pw1"):
        assert s not in out, (s, out)
    assert "basic checks" in out and "--tokens 1000 false" in out


@pytest.mark.parametrize(
    "args",
    [["--help"], *([name, "--help"] for name in COMMANDS)]
    + [["llama", "build", "--help"], ["llama", "path", "--help"], ["fixtures", "build", "--help"]]
    + [["fixtures", "export", "--help"]],
)
def test_every_help_documents_the_internal_error_code(cli: CliFn, args: list[str]) -> None:
    code, out, _ = cli(*args)
    assert code == 0
    assert "  3  internal error" in out and "130 interrupted" in out, out


# ------------------------------------------------------------------- malformed URLs


@pytest.mark.parametrize(
    "args",
    [
        ["check", BAD_URL],
        ["ab", "--plain", BAD_URL, "--spec", "http://127.0.0.1:9"],
        ["ab", "--plain", "http://127.0.0.1:9", "--spec", BAD_URL],
        ["dist", "--engine", "url", "--url", BAD_URL],
    ],
)
def test_a_malformed_url_is_one_line_exit_2(cli: CliFn, args: list[str]) -> None:
    assert "is not an http(s) URL" in one_error_line(cli(*args))


def test_the_proxy_never_exits_1_on_a_malformed_url(cli: CliFn) -> None:
    # The proxy's own URL check is its owner's (proxy/config.py); until it is one line with
    # exit 2, the guard keeps it from reading as a finding.
    code, _, err = cli("proxy", "--plain", BAD_URL, "--spec", "http://127.0.0.1:9")
    assert code in (2, 3) and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_library_calls_reject_a_malformed_url_in_one_line(cache: Path) -> None:
    with pytest.raises(check.CheckError, match=r"http\(s\) URL"):
        check.run(BAD_URL)
    with pytest.raises(ab.ABError, match=r"--plain: 'http://\[::1' is not an http\(s\) URL"):
        ab.run(BAD_URL, "http://127.0.0.1:9")
    with pytest.raises(distribution.DistError, match=r"--url"):
        distribution.make_request(["url"], url=BAD_URL)


# ---------------------------------------------------------------- timeouts


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "1e12"])
def test_check_rejects_a_bad_timeout_before_any_request(
    cli: CliFn, recorder: tuple[Recorder, str], value: str
) -> None:
    rec, url = recorder
    line = one_error_line(cli("check", url, "--timeout", value))
    assert "--timeout" in line and rec.hits == []  # nothing sent to the server


def test_a_valid_timeout_still_reaches_the_live_server(
    cli: CliFn, recorder: tuple[Recorder, str]
) -> None:
    rec, url = recorder
    code, out, err = cli("check", url, "--timeout", "5", "--endpoint", "chat", "--no-stream")
    assert code == 0, err
    assert "/slots" in rec.hits and "/v1/chat/completions" in rec.hits


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_library_check_rejects_a_bad_timeout(timeout: float) -> None:
    with pytest.raises(check.CheckError, match="--timeout"):
        check.run("http://127.0.0.1:9", timeout=timeout)


# --------------------------------------------------------------- temperatures


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "-inf"])
@pytest.mark.parametrize("command", ["check", "ab", "dist"])
def test_temperature_must_be_finite_and_non_negative_everywhere(
    cli: CliFn, recorder: tuple[Recorder, str], command: str, value: str
) -> None:
    rec, url = recorder
    base = {
        "check": ["check", url],
        "ab": ["ab", "--plain", url, "--spec", url],
        "dist": ["dist", "--engine", "url", "--url", url],
    }[command]
    line = one_error_line(cli(*base, "--temperature", value))
    assert "--temperature" in line and rec.hits == []


@pytest.mark.parametrize("t", [float("nan"), -1.0, float("inf")])
def test_library_temperature_checks_agree(t: float) -> None:
    with pytest.raises(check.CheckError, match="--temperature"):
        check.run("http://127.0.0.1:9", temperature=t)
    with pytest.raises(ab.ABError, match="--temperature"):
        ab.Settings(temperature=t)
    with pytest.raises(distribution.DistError, match="--temperature"):
        distribution.make_workload(SPEC, sampler=fixtures.SamplerSettings(temperature=t))


# ------------------------------------------------------------ text that is not UTF-8

NOT_UTF8 = os.fsdecode(b"\xff\xfe")  # what Python makes of argv bytes that are not UTF-8


@pytest.mark.parametrize("command", ["check", "ab"])
def test_a_prompt_that_is_not_utf8_is_one_line(
    cli: CliFn, recorder: tuple[Recorder, str], command: str
) -> None:
    rec, url = recorder
    base = ["check", url] if command == "check" else ["ab", "--plain", url, "--spec", url]
    line = one_error_line(cli(*base, "--prompt", NOT_UTF8))
    assert "not valid UTF-8 (byte 0xff" in line and rec.hits == []


@pytest.mark.parametrize("command", ["check", "ab"])
def test_argv_bytes_that_are_not_utf8_are_one_line_in_a_process(
    served_recorder: tuple[Recorder, str], command: str
) -> None:
    rec, served = served_recorder
    url = served.encode()
    base = [b"check", url] if command == "check" else [b"ab", b"--plain", url, b"--spec", url]
    r = subprocess.run(
        [os.fsencode(sys.executable), b"-m", b"specaudit", *base, b"--prompt", b"\xff\xfe"],
        capture_output=True,
        timeout=120,
    )
    err = r.stderr.decode("utf-8", "replace")
    line = one_error_line((r.returncode, r.stdout.decode(), err))
    assert "--prompt" in line and "UTF-8" in line and rec.hits == []


def test_library_calls_reject_text_that_is_not_utf8() -> None:
    with pytest.raises(check.CheckError, match="--prompt is not valid UTF-8"):
        check.run("http://127.0.0.1:9", prompt=NOT_UTF8)
    with pytest.raises(ab.ABError, match="--prompt is not valid UTF-8"):
        ab.Settings(prompt=NOT_UTF8)
    with pytest.raises(check.CheckError, match="--api-key"):
        check.run("http://127.0.0.1:9", api_key="clé")


# ------------------------------------------------------------------- plot paths


@pytest.mark.parametrize("plot", [f"{PROC}/x.png", "FILE/x.png", "DIR"])
@pytest.mark.parametrize("command", ["ab", "dist"])
def test_an_unwritable_plot_fails_before_any_sample(
    cli: CliFn, recorder: tuple[Recorder, str], tmp_path: Path, command: str, plot: str
) -> None:
    rec, url = recorder
    (tmp_path / "FILE").write_text("")
    (tmp_path / "DIR").mkdir()
    plot = plot.replace("FILE", str(tmp_path / "FILE")).replace("DIR", str(tmp_path / "DIR"))
    base = {
        "ab": ["ab", "--plain", url, "--spec", url, "--seeds", "2", "--tokens", "4"],
        "dist": ["dist", "--engine", "url", "--url", url, "--seeds", "30"],
    }[command]
    line = one_error_line(cli(*base, "--plot", plot))
    assert "--plot" in line and rec.generations == []


def test_library_calls_check_the_plot_before_sampling(
    recorder: tuple[Recorder, str], cache: Path
) -> None:
    rec, url = recorder
    with pytest.raises(ab.ABError, match="--plot"):
        ab.run(url, url, ab.Settings(seeds=2, tokens=4), plot=f"{PROC}/x.png")
    with pytest.raises(distribution.DistError, match="--plot"):
        distribution.make_request(["url"], url=url, seeds=30, plot=Path(f"{PROC}/x.png"))
    assert rec.hits == []


def test_a_writable_plot_directory_is_created_and_the_plot_written(
    cli: CliFn, recorder: tuple[Recorder, str], tmp_path: Path
) -> None:
    _, url = recorder
    plot = tmp_path / "new" / "dir" / "ab.png"
    code, _, err = cli(
        "ab", "--plain", url, "--spec", url, "--seeds", "2", "--tokens", "1",
        "--plot", str(plot), "--json",
    )  # fmt: skip
    assert code in (0, 2) and "Traceback" not in err, err  # a verdict, whatever it is
    assert plot.is_file()


# ------------------------------------------------------------- a hanging backend
# The bound is pytest's timeout (60 s): without the timeouts under test these commands wait for
# the hanging server for 600 s or more, and the test fails; no elapsed time is asserted.


@pytest.mark.timeout(60)
def test_ab_against_a_backend_that_never_answers_times_out_in_one_line(
    cli: CliFn, served_recorder: tuple[Recorder, str]
) -> None:
    _, good = served_recorder
    with serve_tcp(_hang) as hanging:
        r = cli("ab", "--plain", hanging.url, "--spec", good, "--timeout", "0.5")
    assert "timed out" in one_error_line(r)


@pytest.mark.timeout(60)
def test_the_slots_probe_gives_up_even_with_a_long_timeout(
    cli: CliFn, served_recorder: tuple[Recorder, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from specaudit.ab import sampling

    monkeypatch.setattr(sampling, "PROBE_TIMEOUT", 1.0)
    _, good = served_recorder
    with serve_tcp(_hang) as hanging:
        r = cli("ab", "--plain", good, "--spec", hanging.url, "--timeout", "600")
    assert "timed out" in one_error_line(r)


@pytest.mark.timeout(60)
def test_dist_against_a_backend_that_never_answers_times_out_in_one_line(
    cli: CliFn, cache: Path
) -> None:
    with serve_tcp(_hang) as hanging:
        r = cli("dist", "--engine", "url", "--url", hanging.url, "--timeout", "0.5")
    assert "timed out" in one_error_line(r)


# Every command that talks to a server the user names gives up on one that accepts and never
# answers. The commands run as processes: the bound is `subprocess.run(timeout=...)` (a hang
# fails the test), and what is asserted is how each ends: its documented exit code and one
# line naming the timeout. `matrix` and `audit` take no URL: they talk only to the llama-servers
# they start themselves, whose start is bounded by `LlamaServer.startup_timeout` and whose
# requests go through `check.run`, `ServerEngine` and `Client`, each with a finite timeout.
BOUND = 120  # seconds any of these commands may take against a hanging server (--timeout 0.5)


def _specaudit(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    r = subprocess.run(
        [sys.executable, "-m", "specaudit", *args],
        capture_output=True,
        text=True,
        timeout=BOUND,
        env={**os.environ, **(env or {})},
    )
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["check", "{url}"],
        ["ab", "--plain", "{url}", "--spec", "{url}"],
        ["dist", "--engine", "url", "--url", "{url}"],
    ],
    ids=["check", "ab", "dist"],
)
def test_every_command_given_a_server_ends_with_a_one_line_timeout_against_one_that_never_answers(
    command: list[str], cache: Path
) -> None:
    with serve_tcp(_hang) as hanging:
        args = [a.replace("{url}", hanging.url) for a in command]
        r = _specaudit(*args, "--timeout", "0.5", env={"SPECAUDIT_CACHE": str(cache)})
    assert "timed out" in one_error_line(r, EXIT_NO_DECISION)


class _AnswersNothing:
    """A llama-server-like backend that answers /slots, /props and /health but never a
    generation: what the proxy meets when a backend hangs mid-service."""

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/slots":
            return web.json_response([{"id": 0, "speculative": False}])
        if request.path in ("/props", "/health"):
            return web.json_response({"status": "ok", "default_generation_settings": {}})
        await asyncio.sleep(3600)
        return web.json_response({})


def _first_json(stream: Any, bound: float) -> dict[str, Any]:
    """The first JSON object a process prints (maybe over several lines), or AssertionError
    after `bound` seconds."""
    import threading

    got: list[dict[str, Any]] = []

    def read() -> None:
        text = ""
        for line in stream:
            text += line
            try:
                got.append(json.loads(text))
                return
            except json.JSONDecodeError:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(bound)
    assert got, f"no JSON object printed within {bound}s"
    return got[0]


def test_the_proxy_answers_504_in_one_line_when_a_backend_never_answers(cache: Path) -> None:
    """The proxy keeps serving (it ends on SIGTERM, exit 0); its timeout is per request:
    --read-timeout turns a backend's silence into a 504 whose body names it."""
    import httpx

    with serve(_AnswersNothing()) as backend:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "specaudit", "proxy", "--plain", backend.url,
                "--spec", backend.url, "--listen", "127.0.0.1:0", "--read-timeout", "1",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "SPECAUDIT_CACHE": str(cache)},
        )  # fmt: skip
        try:
            listening = _first_json(proc.stdout, BOUND)
            assert listening["event"] == "listening", listening
            body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
            for extra in ({}, {"logprobs": True, "top_logprobs": 2}):  # spec, then plain
                r = httpx.post(
                    listening["url"] + "/v1/chat/completions",
                    json={**body, **extra},
                    timeout=BOUND,
                )
                assert r.status_code == 504, r.text
                assert "sent nothing for 1s" in r.text and "\n" not in r.text.strip(), r.text
        finally:
            proc.terminate()
            out, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


class _SilentServer(ManagedServer):
    """A server process that listens on its port, accepts, and never answers: a llama-server
    that hangs during start-up."""

    def argv(self) -> list[str]:
        script = (
            "import socket, sys\n"
            "s = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
            "held = []\n"
            "while True:\n"
            "    held.append(s.accept())\n"
        )
        return [sys.executable, "-c", script, self.host, str(self.port)]


def test_a_server_that_never_answers_during_start_up_is_one_line_not_a_hang(
    tmp_path: Path,
) -> None:
    """What bounds `matrix` and `audit`: every server they start waits at most its
    `startup_timeout` for readiness (then it is stopped), and every request after that has a
    timeout of its own. Bounded by `_bounded` (a hang fails the test); no elapsed time is
    asserted."""
    srv = _SilentServer(name="silent", log_path=tmp_path / "silent.log", startup_timeout=1)
    with pytest.raises(ServerError, match=r"^silent not healthy after 1s \(log "):
        _bounded(srv.__enter__, BOUND)
    assert not srv.alive()


def _bounded(fn: Callable[[], Any], bound: float) -> Any:
    """`fn()` in a thread: its result or exception, or AssertionError after `bound` seconds."""
    import threading

    done: list[tuple[bool, Any]] = []

    def call() -> None:
        try:
            done.append((True, fn()))
        except BaseException as e:  # handed to the caller
            done.append((False, e))

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(bound)
    assert done, f"still running after {bound}s"
    ok, value = done[0]
    if not ok:
        raise value
    return value


# -------------------------------------------------------- huge --seeds, bounded memory


class _ClosedForm:
    """An in-memory engine sampling the fixture's closed form: no HTTP, many samples fast."""

    label = "closed form"
    kind = "url"
    concurrency = 8

    def __init__(self, wl: distribution.Workload) -> None:
        self.truth = distribution.Truth(SPEC, wl)
        self.tokens = wl.tokens

    async def sample(self, seed: int) -> distribution.Sample:
        rng = np.random.default_rng(seed)
        text = ""
        for _ in range(self.tokens):
            p = self.truth.next(text)
            text += self.truth.labels[int(rng.choice(len(p), p=p))]
        return distribution.Sample(seed, text, 1, 1)

    async def aclose(self) -> None:
        pass


class _Watched(_ClosedForm):
    """Records the memory in use when it is asked for given seeds (while sampling)."""

    def __init__(self, wl: distribution.Workload, at: tuple[int, ...]) -> None:
        super().__init__(wl)
        self.concurrency = 1  # seed n is sampled after seeds < n were consumed
        self.at = at
        self.used: dict[int, int] = {}

    async def sample(self, seed: int) -> distribution.Sample:
        if seed in self.at:
            gc.collect()  # live memory only: garbage awaiting the collector is not growth
            self.used[seed] = tracemalloc.get_traced_memory()[0]
        return await super().sample(seed)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sequential", [False, True])
def test_memory_does_not_grow_while_sampling(sequential: bool) -> None:
    eng = _Watched(WL, at=(1_000, 2_000, 3_000))
    tracemalloc.start()
    try:
        # tolerance ~0: sequential mode never stops early, it consumes every sample
        distribution.measure(eng, SPEC, WL, range(1, 3_001), sequential=sequential, tolerance=1e-9)
    finally:
        tracemalloc.stop()
    # before: every sample was kept (~230 bytes each: +0.23 MB per 1,000 seeds); now only
    # counts are. A leak grows in both halves; a one-off allocation elsewhere in the process
    # (tracemalloc sees every thread) lands in one half only.
    growth = min(eng.used[2_000] - eng.used[1_000], eng.used[3_000] - eng.used[2_000])
    assert growth < 100_000, growth


def test_run_never_materialises_the_seed_range(
    monkeypatch: pytest.MonkeyPatch, cache: Path
) -> None:
    from specaudit.distribution import llamacpp, runner

    seen: list[Any] = []

    class Eng:
        def __init__(self, *a: Any, **k: Any) -> None:
            pass

    def fake_measure(eng: Any, spec: Any, wl: Any, seeds: Any, **kw: Any) -> Any:
        seen.append(seeds)
        raise SpecauditError("stop here")

    monkeypatch.setattr(llamacpp, "ServerEngine", Eng)
    monkeypatch.setattr(runner, "measure", fake_measure)
    with pytest.raises(SpecauditError, match="stop here"):
        req = distribution.make_request(
            ["url"], url="http://127.0.0.1:9", seeds=1_000_000_000, sequential=True
        )
        distribution.run(req)
    assert seen == [range(1, 1_000_000_001)]


def test_the_tally_gives_the_same_result_as_the_samples() -> None:
    wl = distribution.make_workload(SPEC)
    eng = _ClosedForm(wl)

    async def draw(n: int) -> list[distribution.Sample]:
        return [await eng.sample(s) for s in range(1, n + 1)]

    samples = asyncio.run(draw(400))
    samples.insert(7, distribution.Sample(999, "aaaa"))  # impossible tokens too
    from_list = distribution.analyse(SPEC, wl, samples)
    tally = distribution.OutcomeCounts.of(samples, wl)
    assert len(tally.texts) <= len(SPEC.letters) ** wl.positions
    assert distribution.analyse(SPEC, wl, tally) == from_list
    assert (from_list.n_samples, from_list.first_seed, from_list.last_seed) == (401, 1, 999)
    assert from_list.drafted == 400


def _limit_memory() -> None:
    cap = 3 * 1024**3  # `ulimit -v 3000000`
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _impossible_first_letter() -> str:
    truth = distribution.Truth(SPEC, WL)
    p = truth.next("")
    return next(ch for ch in SPEC.letters if p[truth.index[ch]] == 0)


@pytest.mark.timeout(120)
def test_a_billion_sequential_seeds_run_in_bounded_memory(tmp_path: Path) -> None:
    """`dist --seeds 1000000000 --sequential` under a 3 GB address-space cap: it used to die
    in MemoryError (`list(range(...))`); now it samples, and stops at the first decisive
    sample."""
    rec = Recorder(text=_impossible_first_letter() * 3)
    with serve(serving(rec)) as srv:
        r = subprocess.run(
            [sys.executable, "-m", "specaudit", "dist", "--engine", "url", "--url", srv.url,
             "--seeds", "1000000000", "--tokens", "3", "--sequential", "--json"],
            capture_output=True, text=True, timeout=100, preexec_fn=_limit_memory,
            env={**os.environ, "SPECAUDIT_CACHE": str(tmp_path)},
        )  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]  # BROKEN: a finding, honestly reached
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr
    res = json.loads(r.stdout)
    assert res["engines"][0]["verdict"] == "BROKEN"
    assert 1 <= len(rec.generations) < 1000


def test_seeds_past_the_uint32_seed_range_are_rejected(cli: CliFn, cache: Path) -> None:
    line = one_error_line(cli("dist", "--engine", "url", "--url", "http://h", "--seeds", "9" * 12))
    assert "--seeds" in line
    with pytest.raises(distribution.DistError, match="uint32"):
        distribution.make_request(["url"], url="http://h", seeds=2**32 - 10, seed_start=100)


def test_ab_seeds_are_capped_where_memory_grows_with_them(cli: CliFn) -> None:
    url = closed_url()
    line = one_error_line(cli("ab", "--plain", url, "--spec", url, "--seeds", "10001"))
    assert "--seeds" in line and "10000" in line
    with pytest.raises(ab.ABError, match="--seeds"):
        ab.Settings(seeds=ab.MAX_SEEDS + 1)


# ----------------------------------------------------------------- unusable paths


@pytest.mark.parametrize("where", ["proc", "file"])
def test_an_unusable_cache_is_one_line_exit_2(cli: CliFn, tmp_path: Path, where: str) -> None:
    root = PROC if where == "proc" else str(tmp_path / "a-file")
    (tmp_path / "a-file").write_text("")
    line = one_error_line(cli("llama", "path", env={"SPECAUDIT_CACHE": root}))
    assert line.startswith(f"error: SPECAUDIT_CACHE={root}: cannot create the cache directory")


def test_an_unusable_cache_is_one_line_exit_2_in_a_process() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "specaudit", "llama", "path"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SPECAUDIT_CACHE": PROC},
    )  # fmt: skip
    assert "SPECAUDIT_CACHE" in one_error_line((r.returncode, r.stdout, r.stderr))


@pytest.mark.parametrize("where", [PROC, f"{PROC}/x", "FILE", "FILE/sub"])
def test_fixtures_build_into_an_unusable_directory_is_one_line(
    cli: CliFn, tmp_path: Path, where: str
) -> None:
    (tmp_path / "FILE").write_text("")
    target = where.replace("FILE", str(tmp_path / "FILE"))
    line = one_error_line(cli("fixtures", "build", target))
    assert "DIRECTORY" in line and ("is a file" in line or "not a writable directory" in line)


def test_audit_out_is_checked_before_anything_is_built(
    cli: CliFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specaudit.cli import audit_cmd

    def no_build(*a: Any, **k: Any) -> None:
        raise AssertionError("audit reached the build with an unusable --out")

    monkeypatch.setattr(audit_cmd, "ensure_binaries", no_build)
    assert "--out" in one_error_line(cli("audit", "--out", PROC))
    assert "unknown section" in one_error_line(cli("audit", "--only", "nope"))


def test_library_calls_reject_unusable_paths_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specaudit import audit

    monkeypatch.setenv("SPECAUDIT_CACHE", PROC)
    with pytest.raises(paths.CacheError, match="SPECAUDIT_CACHE=/proc/foo"):
        paths.cache_root()
    with pytest.raises(fixtures.FixtureError, match="cannot write the fixture"):
        fixtures.build(PROC)
    with pytest.raises(SpecauditError, match="not a writable directory"):
        audit.run(Path(PROC), sections=())
