"""Start and always stop a llama-server process.

Why a context manager with belt and braces: a test suite or an audit that leaves a llama-server
behind holds gigabytes and a port, and the next run fails in confusing ways. So the server
- binds 127.0.0.1 on a free port chosen for it,
- runs in its own process group, with the kernel told to SIGTERM it if we die (PDEATHSIG),
- is stopped on exit, exception or Ctrl-C: SIGTERM to the group, then SIGKILL,
- and a failed start raises `ServerError` carrying the tail of its log file.
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
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

from specaudit.errors import ServerError
from specaudit.llama.build import LlamaBinaries

_LIVE: set[LlamaServer] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


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


class LlamaServer:
    """A llama-server process bound to 127.0.0.1:<free port>, ready when `__enter__` returns.

    ``with LlamaServer(bins, model, draft=d, spec_type="draft-simple") as srv: srv.url``
    """

    def __init__(
        self,
        binaries: LlamaBinaries,
        model: Path,
        *,
        draft: Path | None = None,
        spec_type: str | None = None,
        parallel: int = 1,
        ctx_size: int | None = None,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        startup_timeout: float = 120.0,
        name: str = "llama-server",
    ) -> None:
        self.binaries = binaries
        self.model = Path(model)
        self.draft = Path(draft) if draft else None
        self.spec_type = spec_type
        self.parallel = parallel
        self.ctx_size = ctx_size
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.name = name
        self.host = "127.0.0.1"
        self.port = 0
        self._own_log = log_path is None
        self.log_path = log_path or Path(
            tempfile.mkstemp(prefix=f"specaudit-{name}-", suffix=".log")[1]
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def speculates(self) -> bool:
        """Whether we asked it to speculate (the server's own word is in /slots)."""
        return self.spec_type not in (None, "none")

    def argv(self) -> list[str]:
        args = [
            str(self.binaries.server),
            "-m",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "-np",
            str(self.parallel),
            "--no-webui",
        ]
        if self.ctx_size is not None:
            args += ["-c", str(self.ctx_size)]
        if self.draft is not None:
            args += ["-md", str(self.draft)]
        if self.spec_type:
            args += ["--spec-type", self.spec_type]
        return args + self.extra_args

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> LlamaServer:
        if not self.model.is_file():
            raise ServerError(f"model file not found: {self.model}")
        if self.draft is not None and not self.draft.is_file():
            raise ServerError(f"draft model file not found: {self.draft}")
        if not self.binaries.server.is_file():
            raise ServerError(f"llama-server binary not found: {self.binaries.server}")
        last: ServerError | None = None
        for _ in range(3):  # a port race with another process is retried with a new port
            self.port = free_port()
            try:
                self._spawn_and_wait()
                return self
            except ServerError as e:
                self.stop()
                last = e
                if "bind" not in e.log_tail and "address already in use" not in e.log_tail:
                    raise
        assert last is not None
        raise last

    def _spawn_and_wait(self) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.argv())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_pdeathsig,
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
                        f"(log {self.log_path}): {_last_error(tail)}",
                        tail,
                    )
                try:
                    r = client.get(f"{self.url}/health")
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    tail = log_tail(self.log_path)
                    raise ServerError(
                        f"{self.name} not healthy after {self.startup_timeout:.0f}s "
                        f"(log {self.log_path})",
                        tail,
                    )
                time.sleep(0.1)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL it; idempotent."""
        stop_process_group(self.proc, grace)
        _LIVE.discard(self)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> LlamaServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LlamaServer({self.name}, {self.url}, pid={self.proc.pid if self.proc else None})"


def _last_error(tail: str) -> str:
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        low = ln.lower()
        if "error" in low or "failed" in low or "unable" in low:
            return ln
    return lines[-1] if lines else "no output"


@atexit.register
def _stop_all() -> None:
    for srv in list(_LIVE):
        srv.stop(grace=3.0)
