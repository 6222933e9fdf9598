"""The test suite's own time budget, measured as a new user meets it: a fresh clone, `./run test`.

Clones a revision of this checkout into a temporary folder, runs `./run test` there (which sets
up the clone's own venv, finds every llama.cpp build and engine environment in the shared
cache or builds it, then runs pytest over tests/unit and tests/integration) with pytest's
JUnit XML and `--durations`, and prints the wall time of the whole command, the wall span of
each test directory (its first test's start to its last test's end, from the summary
tests/conftest.py prints; `./run test` runs tests side by side, so the tests' summed seconds,
also printed, exceed it), and the slowest tests. Exit 1 when a budget is exceeded:

- ``tests/unit`` at most ``--unit-budget`` seconds (default 120), with ``--unit-only`` (in a
  whole run the unit files fill the gaps beside the integration files, so their span is not
  their own time);
- the whole `./run test` at most ``--total-budget`` seconds (default 900: a warm machine, every
  build and engine environment cached);
- with ``--cold``, the same command with an empty specaudit cache of its own (``SPECAUDIT_CACHE``
  set to a new folder in the clone's temporary directory, removed afterwards): every llama.cpp
  build, the models, the fixtures and llama-cpp-python's wheel made from nothing, as on a new
  machine (pip's download cache is left as it is); its budget defaults to 3,600 s, well inside
  CI's 90 minutes.

    python benchmarks/bench_suite.py [--rev HEAD] [--unit-only | --cold] [--json] [--keep]

Timing lives here, not in the tests: a test never asserts a duration.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT_BUDGET_S = 120.0
TOTAL_BUDGET_S = 900.0
COLD_BUDGET_S = 3600.0


@dataclass
class SuiteTimes:
    """One run: wall seconds of the command, pytest's seconds per directory, the slowest tests."""

    rev: str
    command: list[str]
    exit_code: int
    wall_s: float
    per_dir_s: dict[str, float] = field(default_factory=dict)  # wall span per directory
    summed_per_dir_s: dict[str, float] = field(default_factory=dict)  # the tests' own seconds
    tests_per_dir: dict[str, int] = field(default_factory=dict)
    slowest: list[tuple[str, float]] = field(default_factory=list)
    failures: int = 0
    skipped: int = 0


def _directory(classname: str) -> str:
    """JUnit's classname is the module path below rootdir: tests.unit.test_x -> tests/unit."""
    parts = classname.split(".")
    return "/".join(parts[:2]) if len(parts) >= 2 else classname


Junit = tuple[dict[str, float], dict[str, int], list[tuple[str, float]], int, int]


def read_junit(path: Path) -> Junit:
    """Seconds and test counts per directory, every test's time, failures and skips."""
    per_dir: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    tests: list[tuple[str, float]] = []
    failures = skipped = 0
    for case in ET.parse(path).getroot().iter("testcase"):
        t = float(case.get("time", "0"))
        cls = case.get("classname", "")
        per_dir[_directory(cls)] += t
        count[_directory(cls)] += 1
        tests.append((f"{cls}::{case.get('name')}", t))
        failures += sum(1 for c in case if c.tag in ("failure", "error"))
        skipped += sum(1 for c in case if c.tag == "skipped")
    tests.sort(key=lambda x: -x[1])
    return dict(per_dir), dict(count), tests, failures, skipped


SPAN_LINE = re.compile(r"^(tests/\S+)\s+([\d.]+) s wall\s+([\d.]+) s tests\s*$")


def read_spans(output: str) -> dict[str, float]:
    """The wall span per directory from tests/conftest.py's end-of-run summary."""
    spans = {}
    for line in output.splitlines():
        m = SPAN_LINE.match(line.strip())
        if m:
            spans[m.group(1)] = float(m.group(2))
    return spans


def _run_teed(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `cmd`, its output shown as it comes and kept."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    kept = []
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        kept.append(line)
        sys.stdout.write(line)
    return proc.wait(), "".join(kept)


def run(rev: str, unit_only: bool, keep: bool, cold: bool = False) -> SuiteTimes:
    work = Path(tempfile.mkdtemp(prefix="specaudit-suite-"))
    env = {**os.environ, "SPECAUDIT_CACHE": str(work / "cache")} if cold else None
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", rev], check=True)
    junit = work / "junit.xml"
    extra = ["--junitxml", str(junit), "--durations=25", "-q"]
    if unit_only:
        # the unit suite alone, as README tells a developer to run it after one ./run test:
        # the clone's venv is set up by ./run's provisioning (no builds needed for unit tests)
        setup = ["bash", "-c", "./run 2>/dev/null; true"]
        subprocess.run(setup, cwd=clone, check=False)
        workers = ["-n", str(min(os.cpu_count() or 2, 4)), "--dist", "loadfile"]  # as ./run test
        pytest = str(clone / ".venv/bin/pytest")
        cmd = [pytest, "tests/unit", "-p", "no:cacheprovider", *workers, *extra]
    else:
        cmd = ["./run", "test", *extra]
    t0 = time.perf_counter()
    code, output = _run_teed(cmd, clone, env)
    wall = time.perf_counter() - t0
    out = SuiteTimes(rev=rev, command=cmd, exit_code=code, wall_s=wall)
    if junit.exists():
        out.summed_per_dir_s, out.tests_per_dir, tests, out.failures, out.skipped = read_junit(
            junit
        )
        out.slowest = tests[:25]
    out.per_dir_s = read_spans(output)
    if keep:
        print(f"kept {work}", file=sys.stderr)
    else:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="Revision of this checkout to clone.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--unit-only", action="store_true", help="Only pytest tests/unit.")
    mode.add_argument("--cold", action="store_true", help="An empty specaudit cache of its own.")
    ap.add_argument("--unit-budget", type=float, default=UNIT_BUDGET_S)
    ap.add_argument("--total-budget", type=float, default=None)
    ap.add_argument("--json", action="store_true", help="Print the result as JSON.")
    ap.add_argument("--keep", action="store_true", help="Keep the clone and the JUnit XML.")
    args = ap.parse_args()

    if args.total_budget is None:
        args.total_budget = COLD_BUDGET_S if args.cold else TOTAL_BUDGET_S
    r = run(args.rev, args.unit_only, args.keep, cold=args.cold)
    over: list[str] = []
    # the unit budget is for the unit suite alone: in a whole run its files fill the gaps beside
    # the integration files, so its wall span is the run's, not its own time
    unit_s = r.per_dir_s.get("tests/unit") if args.unit_only else None
    if unit_s is not None and unit_s > args.unit_budget:
        over.append(f"tests/unit took {unit_s:.0f} s > {args.unit_budget:.0f} s")
    if not args.unit_only and r.wall_s > args.total_budget:
        over.append(f"./run test took {r.wall_s:.0f} s > {args.total_budget:.0f} s")
    if args.json:
        print(json.dumps({**asdict(r), "over_budget": over}, indent=2))
    else:
        print(
            f"rev {r.rev}: {' '.join(r.command[:2])} ... exit {r.exit_code}, wall {r.wall_s:.0f} s"
        )
        for d, s in sorted(r.per_dir_s.items()):
            summed = r.summed_per_dir_s.get(d, 0.0)
            n = r.tests_per_dir.get(d, 0)
            print(f"  {d:<20} {s:8.1f} s wall ({summed:.1f} s of tests side by side) {n:5d} tests")
        print(f"  failures {r.failures}, skipped {r.skipped}")
        print("slowest:")
        for name, s in r.slowest:
            print(f"  {s:8.1f} s  {name}")
        for line in over:
            print(f"over budget: {line}")
    if r.exit_code != 0:
        return 2
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
