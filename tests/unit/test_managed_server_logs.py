"""A managed server's temp log: made only when a server starts, gone when it stops in good
health, kept when it fails (its error names the file). A suite builds hundreds of server
objects it never starts (presets, argv checks); each used to leave an empty file in /tmp.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from specaudit.errors import ServerError
from specaudit.llama.process import ManagedServer


class _HttpServer(ManagedServer):
    """Python's own http.server: a real process, ready when "/" answers."""

    ready_path = "/"

    def __init__(self, *, fail: bool = False, log_path: Path | None = None) -> None:
        super().__init__(name="logs-probe", log_path=log_path, startup_timeout=30.0)
        self.fail = fail

    def argv(self) -> list[str]:
        if self.fail:
            return [sys.executable, "-c", "import sys; print('no such thing'); sys.exit(3)"]
        return [sys.executable, "-m", "http.server", str(self.port), "--bind", self.host]


def _temp_logs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("specaudit-logs-probe-*.log"))


def test_a_server_never_started_leaves_no_log_file() -> None:
    before = _temp_logs()
    srv = _HttpServer()
    srv.stop()
    assert _temp_logs() == before


def test_a_healthy_stop_removes_the_temp_log_it_made() -> None:
    before = _temp_logs()
    with _HttpServer() as srv:
        log = srv.log_path
        assert log.exists() and log.read_text().startswith("$ ")  # the command line first
    assert not log.exists()
    assert _temp_logs() == before


def test_a_failed_start_keeps_its_log_and_names_it() -> None:
    srv = _HttpServer(fail=True)
    with pytest.raises(ServerError) as ei:
        srv.start()
    log = srv.log_path
    try:
        assert str(log) in str(ei.value) and "code 3" in str(ei.value)
        assert "no such thing" in log.read_text()
    finally:
        log.unlink(missing_ok=True)


def test_a_log_the_caller_named_stays_after_a_healthy_stop(tmp_path: Path) -> None:
    named = tmp_path / "mine.log"
    with _HttpServer(log_path=named):
        pass
    assert named.exists()
