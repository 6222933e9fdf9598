"""Fixtures every test can use: `cli`, the one way to run specaudit's command line in-process.

`cli("check", "--help")` runs the CLI through `specaudit.cli.run`, the same error handling as
the console script (`main` is `run` plus `sys.exit`): the exit code a user's shell would see,
usage and `SpecauditError`s as one ``error:`` line on stderr. stdout and stderr are captured
apart with click's `CliRunner` isolation (not a terminal, 80 columns). A test that needs the
installed entry point as a process (signals, start-up imports) uses `subprocess` instead.
`toy`: the toy `dist` engine installed as a package for one test (the registry's and
rescore's tests), installed by `engine_package.install_engine_package`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from click.testing import CliRunner

from engine_package import install_engine_package
from suite_order import group_of, rank_of

# LiteLLM fetches its model price map from the internet when imported; the tests never need it
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Every llama.cpp process the tests start computes on one thread unless it asks for more (`-t`;
# specaudit's presets already ask for one): the suite runs tests side by side (pytest-xdist,
# `./run test`) on a small machine, and llama.cpp's idle workers spin: with upstream's servers
# at their default two threads, llama.cpp's own server tests took 713 s beside the other
# worker's tests on 2 cores, at one thread 311 s (181 s alone).
os.environ.setdefault("LLAMA_ARG_THREADS", "1")


class CliRun(NamedTuple):
    """What one run of the CLI left behind; unpacks as ``code, out, err``."""

    exit_code: int
    stdout: str
    stderr: str


CliFn = Callable[..., CliRun]


def run_cli(
    *args: str, input: str | None = None, env: Mapping[str, str | None] | None = None
) -> CliRun:
    """``specaudit ARGS`` in-process; returns (exit_code, stdout, stderr)."""
    from specaudit.cli import run

    runner = CliRunner()
    with runner.isolation(input=input, env=env) as (out, err, _mixed):
        try:
            code = run(list(args))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue(), err.getvalue()
    return CliRun(code, stdout.decode(), stderr.decode(errors="replace"))


@pytest.fixture
def cli() -> CliFn:
    """``cli(*args, input=None, env=None) -> CliRun(exit_code, stdout, stderr)``."""
    return run_cli


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The toy `dist` engine (tests/toy_engine.py) installed as the package ``specaudit-toy``,
    whose entry point names that module, found by the registry's next read; gone afterwards."""
    from specaudit.distribution import registry

    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path))
    site = install_engine_package(tmp_path / "site", "specaudit-toy", {"toy": "toy_engine"})
    monkeypatch.syspath_prepend(str(site))
    sys.modules.pop("toy_engine", None)
    registry.reset()
    yield
    registry.reset()  # loaded again on the next read, without the package (sys.path restored)
    sys.modules.pop("toy_engine", None)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Work units of whole files (and of `suite_order.SHARED_SESSION_GROUPS`), in collection
    order (`suite_order.rank_of`)."""
    # pytest-xdist ships no type information (no py.typed)
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByFile(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # in a worker (every worker collects alike): integration (minutes per file) before
        # unit (seconds), the longest first; a serial run keeps its order
        items.sort(key=lambda item: rank_of(item.nodeid))


# Seconds per test directory, printed at the end of a run: the suite's time budget (README,
# benchmarks/bench_suite.py) is stated per directory. Two figures: the wall span (the first
# test's start to the last one's end, what the budget counts) and the tests' summed seconds
# (setup, call and teardown), which exceed the span when xdist runs tests side by side.
_SECONDS_PER_DIR: dict[str, float] = {}
_SPAN_PER_DIR: dict[str, tuple[float, float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    folder = report.nodeid.split("::", 1)[0].rsplit("/", 1)[0]
    _SECONDS_PER_DIR[folder] = _SECONDS_PER_DIR.get(folder, 0.0) + report.duration
    first, last = _SPAN_PER_DIR.get(folder, (report.start, report.stop))
    _SPAN_PER_DIR[folder] = (min(first, report.start), max(last, report.stop))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _SECONDS_PER_DIR:
        return
    terminalreporter.section("seconds per directory (wall span, summed test seconds)")
    for folder, seconds in sorted(_SECONDS_PER_DIR.items()):
        first, last = _SPAN_PER_DIR[folder]
        wall = last - first
        terminalreporter.write_line(f"{folder:<24} {wall:9.1f} s wall {seconds:9.1f} s tests")
