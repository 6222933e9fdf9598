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


# Tests run side by side (`./run test`: pytest-xdist), one test file per worker, so a file's
# module-scoped servers start once. Files that share an expensive session fixture go to one
# worker too: the audit's dist section (1000 seeds on every path, `dist_section` in
# tests/integration/conftest.py) would otherwise be sampled once per worker. (xdist's own
# `--dist loadgroup` does not group under pytest 9: its suffix on the node id is ignored.)
SHARED_SESSION_GROUPS = {
    "dist-section": (
        "tests/integration/test_dist_llama.py",
        "tests/integration/test_dist_openai.py",
        "tests/integration/test_fixture_context_server.py",
        "tests/integration/test_mutants.py",
    ),
}
_GROUP_OF = {path: group for group, paths in SHARED_SESSION_GROUPS.items() for path in paths}
# The longest files first when workers share them out (longest-processing-time first): a long
# file started late would run alone at the end while the other worker idles; the tail is then
# short files, which fill both workers evenly. Ordered by their summed seconds in a measured
# `./run test` (benchmarks/bench_suite.py --keep, its JUnit XML); files not named follow,
# integration before unit.
FIRST = (
    "tests/integration/test_upstream_server_tests.py",  # 267 s
    "tests/integration/test_rescore_servers.py",  # 140 s
    "tests/integration/test_gemma_logprob_mutants.py",  # 139 s
    "tests/integration/test_dist_replay.py",  # 118 s
    "dist-section",  # 115 s
    "tests/integration/test_rescore_engines.py",  # 80 s
    "tests/integration/test_audit_model.py",  # 65 s
    "tests/integration/test_patched_proof.py",  # 65 s
    "tests/integration/test_patch_equality.py",  # 63 s
    "tests/integration/test_dist_mtp.py",  # 49 s
    "tests/integration/test_check_reference.py",  # 44 s
    "tests/integration/test_dist_under_load.py",  # 36 s
    "tests/integration/test_speculative_fix.py",  # 33 s
    "tests/unit/test_dist_verdicts.py",  # 30 s
    "tests/integration/test_ab_servers.py",  # 29 s
    "tests/integration/test_dist_ngram_types.py",  # 27 s
    "tests/unit/test_cli_guard.py",  # 24 s
    "tests/integration/test_check_servers.py",  # 22 s
    "tests/integration/test_dist_openvino.py",  # 21 s
)


def _group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return _GROUP_OF.get(path, path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Work units of whole files (and of `SHARED_SESSION_GROUPS`), in collection order."""
    # pytest-xdist ships no type information (no py.typed)
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByFile(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # in a worker (every worker collects alike): integration (minutes per file) before
        # unit (seconds), the longest first; a serial run keeps its order
        items.sort(key=lambda item: rank_of(item.nodeid))


def rank_of(nodeid: str) -> tuple[int, int]:
    """Where a test's file (or group) comes in a side-by-side run: `FIRST` in its order, then
    integration files, then unit files."""
    group = _group(nodeid)
    first = FIRST.index(group) if group in FIRST else len(FIRST)
    return (first, 0 if group.startswith("tests/integration/") else 1)


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
