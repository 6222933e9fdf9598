"""Real llama-server lifecycle: start, what /slots and /props say, and no orphans ever."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from specaudit import audit, fixtures
from specaudit.audit.sections import servers
from specaudit.errors import ServerError
from specaudit.llama import LlamaBinaries, LlamaServer, presets


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def _wait_dead(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.parametrize(
    ("name", "speculates"),
    [
        ("fixture-plain", False),
        ("fixture-spec", True),
        pytest.param("gemma-plain", False, marks=pytest.mark.gemma),
        pytest.param("gemma-spec", True, marks=pytest.mark.gemma),
    ],
)
def test_slots_tell_the_truth_props_do_not(
    audit_ctx: audit.AuditContext, name: str, speculates: bool
) -> None:
    row = servers.describe_server(name, audit_ctx.server(name))
    assert row.slots_total and row.slots_total >= 1
    assert row.slots_speculative == (row.slots_total if speculates else 0)
    # Observed on b11434: /props claims no speculation whatever the server does.
    assert row.props_spec_types == "none"
    assert row.verdict.startswith("hidden") == speculates


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} give them) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, hexport = local.partition(":")
                if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                    out.append(addr)
    return out


def test_server_binds_loopback_and_stops(
    llama_bins: LlamaBinaries, fixture_set: fixtures.FixtureSet
) -> None:
    with presets.server(llama_bins, fixture_set.target, kind="fixture", parallel=1) as srv:
        assert srv.host == "127.0.0.1"
        assert httpx.get(f"{srv.url}/health").status_code == 200
        # the kernel's word: the only socket listening on the port is 127.0.0.1's
        assert _listening(srv.port) == ["0100007F"]
        assert srv.proc is not None
        pid = srv.proc.pid
        assert _alive(pid)
    assert _wait_dead(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health")


def test_failing_start_is_clear_and_leaves_nothing(
    llama_bins: LlamaBinaries, tmp_path: Path
) -> None:
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"this is not a gguf file" * 100)
    srv = LlamaServer(llama_bins, bogus, log_path=tmp_path / "bad.log", startup_timeout=60)
    with pytest.raises(ServerError) as ei, srv:
        pass
    msg = str(ei.value)
    assert "\n" not in msg
    assert "exited" in msg and "bad.log" in msg
    assert ei.value.log_tail  # the log's tail travels with the error
    assert srv.proc is not None and srv.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(srv.proc.pid, 0)


def test_missing_model_path_is_clear(llama_bins: LlamaBinaries, tmp_path: Path) -> None:
    with pytest.raises(ServerError, match="model file not found"):
        LlamaServer(llama_bins, tmp_path / "nope.gguf").start()


def _child_script(bins: LlamaBinaries, model: Path, body: str) -> str:
    return textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from specaudit.llama import LlamaBinaries, presets
        bins = LlamaBinaries(Path({str(bins.bin_dir)!r}), None, "external")
        with presets.server(bins, Path({str(model)!r}), kind="fixture", parallel=1) as srv:
            print(srv.proc.pid, flush=True)
        """
    ) + textwrap.indent(textwrap.dedent(body), "    ")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_no_orphan_when_the_parent_is_interrupted_or_killed(
    llama_bins: LlamaBinaries,
    fixture_set: fixtures.FixtureSet,
    sig: signal.Signals,
    tmp_path: Path,
) -> None:
    """Ctrl-C, SIGTERM (via the CLI's handler semantics) and even SIGKILL of the parent."""
    script = _child_script(llama_bins, Path(fixture_set.target), "time.sleep(120)\n")
    if sig == signal.SIGTERM:
        script = (
            "import signal\n"
            "def _t(s, f): raise KeyboardInterrupt\n"
            "signal.signal(signal.SIGTERM, _t)\n" + script
        )
    if sig == signal.SIGINT:
        # Ctrl-C as a terminal delivers it: Python's own handler, even when this run inherited
        # SIGINT ignored (a suite started in the background of a non-interactive shell)
        script = (
            "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n" + script
        )
    # the child's Python stacks on SIGUSR1 (faulthandler): a child that does not exit in time
    # says where it waits, in the failure's message
    script = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1)\n" + script
    err = tmp_path / "child.err"
    with err.open("wb") as err_file:
        child = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err_file, text=True
        )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        server_pid = int(line.strip())
        assert _alive(server_pid)
        child.send_signal(sig)
        # stopping takes at most the server's 10 s grace and a SIGKILL; the rest is slack for
        # a loaded machine
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR1)
            time.sleep(2)
            pytest.fail(f"the child did not exit after {sig.name}:\n{err.read_text()}")
        assert _wait_dead(server_pid), f"llama-server {server_pid} outlived its parent ({sig.name})"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.gemma
def test_gemma_answers(server: Callable[[str], Any]) -> None:
    for name in ("gemma-plain", "gemma-spec"):
        h = server(name)
        r = httpx.post(
            f"{h.url}/completion",
            json={"prompt": "The capital of France is", "n_predict": 4, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200
        assert r.json()["content"].strip()
