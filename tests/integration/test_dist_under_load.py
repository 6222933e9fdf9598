"""`specaudit dist` finishes with its verdict while the machine is saturated.

Beside a CPU hog (twice as many busy processes as cores, started here and always killed by
PID), the stock llama-speculative example used to lose its whole output in most runs: it
prints through llama.cpp's asynchronous logger and exits before the logger's thread has run
(docs/dist.md, "llama-speculative's output"). Read with its logger drained at exit, every run
counts: the stock example is BROKEN, the `speculative-fix` build and a speculating llama-server
PRESERVED, each from 300 seeds (at the TV tolerance 300 seeds certify, 0.3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from specaudit import distribution, fixtures
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.stats import Verdict

CliFn = Callable[..., tuple[int, str, str]]
SEEDS = "300"
HOG = ("-c", "while True: pass")


@pytest.fixture(scope="module")
def cpu_hog() -> Iterator[list[int]]:
    """Busy processes, twice as many as cores, for the module's tests; killed by PID."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(2 * (os.cpu_count() or 1)):
            procs.append(subprocess.Popen([sys.executable, *HOG]))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _still_busy(pids: list[int]) -> None:
    """Every hog process is still running (the load really was there)."""
    for pid in pids:
        os.kill(pid, 0)  # ProcessLookupError if it is gone


def _dist(cli: CliFn, fs: fixtures.FixtureSet, *args: str) -> tuple[int, dict[str, Any], str]:
    code, out, err = cli(
        "dist", "--fixture", str(fs.dir), "--seeds", SEEDS, "--tolerance", "0.3", "--json", *args
    )
    return code, (json.loads(out) if out.strip() else {}), err


class _CountingRuns(distribution.ExampleEngine):
    """The stock engine, counting the llama-speculative processes it starts per seed."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.runs: Counter[int] = Counter()

    def argv(self, seed: int) -> list[str]:
        self.runs[seed] += 1
        return super().argv(seed)


def test_every_example_run_under_load_is_read_the_first_time(
    llama_bins: LlamaBinaries, fixture_set: fixtures.FixtureSet, cpu_hog: list[int]
) -> None:
    """Nothing lost, so nothing repeated: one process per seed, each one's text and statistics
    read (most of these runs lost all of it before the exit flush)."""
    fs = fixture_set
    wl = distribution.make_workload(fs.spec)
    eng = _CountingRuns(llama_bins.speculative, fs.target, fs.draft, fs.spec, wl)
    res = distribution.measure(eng, fs.spec, wl, range(1, int(SEEDS) + 1))
    _still_busy(cpu_hog)
    assert res.verdict is Verdict.BROKEN, res.reason
    assert res.n_samples == int(SEEDS)
    assert eng.runs == Counter(range(1, int(SEEDS) + 1))  # every seed run exactly once


def test_stock_example_under_load_is_broken(
    cli: CliFn, fixture_set: fixtures.FixtureSet, cpu_hog: list[int]
) -> None:
    code, data, err = _dist(cli, fixture_set, "--engine", "speculative-example")
    _still_busy(cpu_hog)
    assert code == 1, err
    (eng,) = data["engines"]
    assert eng["kind"] == "speculative-example" and eng["verdict"] == "BROKEN", eng["reason"]
    assert eng["n_samples"] == int(SEEDS)
    assert eng["drafted"] > 0 and eng["accepted"] > 0  # every run's statistics were read


def test_fixed_example_under_load_is_preserved(
    cli: CliFn, fixture_set: fixtures.FixtureSet, cpu_hog: list[int]
) -> None:
    # the patch flushes the logger itself; the exit flush comes after it and finds nothing left
    code, data, err = _dist(
        cli, fixture_set, "--engine", "speculative-example", "--patch", presets.SPECULATIVE_FIX
    )
    _still_busy(cpu_hog)
    assert code == 0, err
    (eng,) = data["engines"]
    assert eng["verdict"] == "PRESERVED", eng["reason"]
    # every position (the fourth, drafted after an accepted token, too), the joint, the
    # history and the seed pairs: no test rejects
    assert {t["position"] for t in eng["tests"] if t["kind"] == "position"} == {1, 2, 3, 4}
    assert not [t["name"] for t in eng["tests"] if t["rejected"]], eng["reason"]
    assert eng["n_samples"] == int(SEEDS) and 0 < eng["accepted"] < eng["drafted"]


def test_speculating_server_under_load_is_preserved(
    cli: CliFn, fixture_set: fixtures.FixtureSet, cpu_hog: list[int]
) -> None:
    code, data, err = _dist(cli, fixture_set, "--engine", "server", "--path", "greedy")
    _still_busy(cpu_hog)
    assert code == 0, err
    (eng,) = data["engines"]
    assert eng["path"] == "greedy" and eng["verdict"] == "PRESERVED", eng["reason"]
    assert eng["n_samples"] == int(SEEDS) and eng["drafted"] > 0
