"""pytest plugin loaded into llama.cpp's own server tests (tools/server/tests) by
`specaudit.llama.upstream`: makes them run offline on one local model, optionally forces
every server to speculate, and records each test's outcome.

Why a plugin and not edited test files: upstream's files run unchanged (the point is to pass
*their* tests); everything that differs lives in this one place, applied to their `utils`
module before their conftest or any test module imports from it:

- every `ServerPreset` method's server, and any server a test points at a Hugging Face repo or
  URL, gets ``--model <local file>`` instead, and ``--offline``;
- `download_file` returns the local file (upstream's draft models, LoRA and media URLs all
  become that file; only model URLs are in the selections specaudit runs);
- `ServerPreset.load_all` (which starts every preset once to download its model) does nothing;
- each server binds 127.0.0.1 on a free port (the kernel's choice), retried if taken, and
  upstream's readiness probe waits 0.2 s between tries instead of spinning every 10 ms;
- with a draft set, every server that would not speculate gets it as ``--model-draft`` with
  ``--spec-type draft-simple`` (a server a test already set up to speculate keeps its own
  settings);
- every server is stopped at the end of the session, whatever happened.

Configuration comes from the environment (`ENV_*`), set by `specaudit.llama.upstream`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import socket
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

ENV_MODEL = "SPECAUDIT_UPSTREAM_MODEL"
ENV_DRAFT = "SPECAUDIT_UPSTREAM_DRAFT"
ENV_RESULTS = "SPECAUDIT_UPSTREAM_RESULTS"
START_ATTEMPTS = 3
HEALTH_POLL = 0.2  # seconds between upstream's readiness probes

_utils: Any = None
_reports: dict[str, dict[str, Any]] = {}
_servers: list[dict[str, Any]] = []
_current: str = ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _offline_wget() -> types.ModuleType:
    """A stand-in for the `wget` package upstream's utils imports: nothing is downloaded here,
    and a call that tried would fail loudly rather than reach the network."""
    mod = types.ModuleType("wget")

    def download(url: str, out: str | None = None) -> str:
        raise RuntimeError(f"offline run: refusing to download {url}")

    mod.download = download  # type: ignore[attr-defined]  # module built at run time
    return mod


def _localise(server: Any, model: str, draft: str | None) -> None:
    """Point one upstream `ServerProcess` at the local model (and draft) before it starts."""
    wants_model = any(
        getattr(server, a, None) for a in ("model_hf_repo", "model_hf_file", "model_url")
    )
    if wants_model or server.model_file:
        server.model_file = model
        server.model_hf_repo = None
        server.model_hf_file = None
        server.model_url = None
    server.offline = True
    server.server_host = "127.0.0.1"
    server.server_port = _free_port()
    if draft and server.model_file and not server.model_draft and not server.spec_type:
        server.model_draft = draft
        server.spec_type = "draft-simple"


def _install(utils: Any, model: str, draft: str | None) -> None:
    """Patch upstream's `utils` module in place (see the module docstring)."""
    utils.ServerPreset.load_all = staticmethod(lambda: None)
    utils.download_file = lambda url, output_file_path=None: model

    original_request = utils.ServerProcess.make_request

    def make_request(self: Any, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        # upstream polls /health every 10 ms while the model loads: on 2 cores that spinning
        # client takes a core from the loading server
        try:
            res = original_request(self, method, path, *args, **kwargs)
        except Exception:
            if path == "/health":
                time.sleep(HEALTH_POLL)
            raise
        if path == "/health" and res.status_code != 200:
            time.sleep(HEALTH_POLL)
        return res

    utils.ServerProcess.make_request = make_request

    original_start = utils.ServerProcess.start

    def start(self: Any, *args: Any, **kwargs: Any) -> Any:
        last: BaseException | None = None
        for _ in range(START_ATTEMPTS):
            _localise(self, model, draft)
            _servers.append(
                {
                    "test": _current,
                    "model_draft": self.model_draft,
                    "spec_type": self.spec_type,
                    "speculative": bool(self.model_draft or self.spec_type),
                }
            )
            try:
                return original_start(self, *args, **kwargs)
            except RuntimeError as e:  # upstream: "Server process died" (a taken port, ...)
                last = e
                self.stop()
                time.sleep(0.2)
        assert last is not None
        raise last

    utils.ServerProcess.start = start


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Before upstream's conftest (``from utils import *``) runs: patch `utils`."""
    global _utils
    model = os.environ.get(ENV_MODEL)
    if not model:
        raise pytest.UsageError(f"{ENV_MODEL} must name the local model file")
    draft = os.environ.get(ENV_DRAFT) or None
    tests_dir = str(Path.cwd())
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    if importlib.util.find_spec("wget") is None:  # upstream's requirement, only to download
        sys.modules["wget"] = _offline_wget()
    utils = importlib.import_module("utils")  # upstream's tools/server/tests/utils.py (the cwd)

    _install(utils, model, draft)
    _utils = utils


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    global _current
    _current = nodeid


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One outcome per test id: a failed setup or teardown is an error, a failed call a
    failure, otherwise the call's outcome."""
    rec = _reports.setdefault(report.nodeid, {"outcome": "passed", "message": "", "seconds": 0.0})
    rec["seconds"] += report.duration
    if report.failed:
        rec["outcome"] = "failed" if report.when == "call" else "error"
        rec["message"] = _first_line(report)
    elif report.skipped and rec["outcome"] == "passed":
        rec["outcome"] = "skipped"
        rec["message"] = _first_line(report)


def _first_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or str(report.longrepr or "")
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0][:300] if lines else ""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop every server still running, then write the outcomes."""
    if _utils is not None:
        for server in list(_utils.server_instances):
            with contextlib.suppress(Exception):
                server.stop()
    path = os.environ.get(ENV_RESULTS)
    if path:
        Path(path).write_text(
            json.dumps({"tests": _reports, "servers": _servers, "exitstatus": int(exitstatus)})
        )
