"""A server process specaudit starts and always stops: the lifecycle shared by llama-server
(`specaudit.llama.server.LlamaServer`) and llama-cpp-python's server
(`specaudit.llama_cpp_python.LlamaCppPythonServer`).

Why one base with belt and braces: a test suite or an audit that leaves a server behind holds
gigabytes and a port, and the next run fails in confusing ways. So every managed server
- binds 127.0.0.1 on a free port chosen for it (a port taken in the meantime is retried),
- writes its output to a log file (the command line first),
- runs in its own process group, with the kernel told to SIGTERM it if we die (PDEATHSIG),
- is ready when `start` (or ``with``) returns: its readiness URL answered 200,
- is stopped on exit, exception, Ctrl-C or interpreter exit: SIGTERM to the group, then SIGKILL,
- and a failed start raises `ServerError` carrying the tail of its log file.
A subclass says only what differs: its command line (`argv`), what must exist before it
starts (`preflight`), its readiness path and how it is named in messages.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

import httpx

from specaudit.errors import ServerError

_LIVE: set[ManagedServer] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pdeathsig() -> None:
    """`preexec_fn` for a child that must die with us: PR_SET_PDEATHSIG = SIGTERM (runs in the
    child between fork and exec)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log file ("" if unreadable)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def last_error(tail: str) -> str:
    """The line of a log tail that best says what went wrong (for a one-line message)."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        low = ln.lower()
        if "error" in low or "failed" in low or "unable" in low:
            return ln
    return lines[-1] if lines else "no output"


def stop_process_group(proc: subprocess.Popen[bytes] | None, grace: float = 10.0) -> None:
    """SIGTERM a server's process group, SIGKILL it after `grace` seconds; idempotent. Why the
    group: a server started in its own session may have children of its own."""
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the group may hold stragglers even after the leader exited
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _temp_log(name: str) -> Path:
    fd, path = tempfile.mkstemp(prefix=f"specaudit-{name}-", suffix=".log")
    os.close(fd)
    return Path(path)


class ManagedServer:
    """A server process on 127.0.0.1:<free port>, ready when `start` / ``__enter__`` returns
    and stopped by ``__exit__`` / `stop`. Subclasses implement `argv` (using `host` and `port`)
    and may extend `preflight`."""

    ready_path: ClassVar[str] = "/health"  # answers 200 once the server serves
    not_ready: ClassVar[str] = "not healthy"  # how a start-up timeout is worded
    poll_interval: ClassVar[float] = 0.1  # seconds between readiness probes
    start_attempts: ClassVar[int] = 3  # a port taken by another process is retried

    def __init__(
        self, *, name: str, log_path: Path | None = None, startup_timeout: float = 120.0
    ) -> None:
        self.name = name
        self.startup_timeout = startup_timeout
        self.host = "127.0.0.1"
        self.port = 0
        # a log of our own choosing (a temp file) goes when the server is stopped in good
        # health: nothing is left to read in it, and every run would leave files in /tmp. One
        # whose server died on its own stays (an error names it), as does a log the caller named
        self._own_log = log_path is None
        self._log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        """The server's log; a temp file of our own is made on first use, so a server that is
        built but never started (a preset, an argv check) leaves no empty file behind."""
        if self._log_path is None:
            self._log_path = _temp_log(self.name)
        return self._log_path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        """The command line, given `host` and `port`."""
        raise NotImplementedError

    def preflight(self) -> None:
        """ServerError (one line) if something the server needs is missing; before any start."""

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> Self:
        self.preflight()
        last: ServerError | None = None
        for _ in range(self.start_attempts):
            self.port = free_port()
            try:
                self._spawn_and_wait()
                return self
            except ServerError as e:
                self.stop(keep_log=True)
                last = e
                if "bind" not in e.log_tail and "address already in use" not in e.log_tail:
                    raise
        assert last is not None
        raise last

    def _spawn_and_wait(self) -> None:
        argv = self.argv()
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=pdeathsig,
            )
        _LIVE.add(self)
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    tail = log_tail(self.log_path)
                    raise ServerError(
                        f"{self.name} exited with code {rc} during start-up "
                        f"(log {self.log_path}): {last_error(tail)}",
                        tail,
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}{self.ready_path}").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"{self.name} {self.not_ready} after {self.startup_timeout:.0f}s "
                        f"(log {self.log_path})",
                        log_tail(self.log_path),
                    )
                time.sleep(self.poll_interval)

    def stop(self, grace: float = 10.0, *, keep_log: bool = False) -> None:
        """SIGTERM the process group, then SIGKILL it; idempotent. `keep_log`: a failure
        names the log, so it stays."""
        healthy = self.alive() and not keep_log
        stop_process_group(self.proc, grace)
        _LIVE.discard(self)
        if healthy and self._own_log and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop(keep_log=True)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"{type(self).__name__}({self.name}, {self.url}, pid={pid})"


@atexit.register
def _stop_all() -> None:
    for srv in list(_LIVE):
        srv.stop(grace=3.0)
