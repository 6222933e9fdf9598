"""Start-up time of the `specaudit` command: `--version` and `check --help` against bare Python.

Runs each command N times, interleaved (so drift hits them alike), and prints the median,
min-max and the ratio of the median to `python -c pass`. Goal: under 0.3 s. No asserts: run it
before and after a change and compare.

    python benchmarks/bench_startup.py [-n 7] [--specaudit PATH]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL_S = 0.3


def _specaudit_cmd(explicit: str | None) -> list[str]:
    """The console script next to this interpreter if there is one, else `python -m specaudit`."""
    if explicit:
        return [explicit]
    beside = Path(sys.executable).with_name("specaudit")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("specaudit")
    return [found] if found else [sys.executable, "-m", "specaudit"]


def _time_once(argv: list[str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.decode()[-500:]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--runs", type=int, default=7, help="Runs per command (default 7).")
    ap.add_argument("--specaudit", help="Path of the specaudit executable to time.")
    args = ap.parse_args()

    exe = _specaudit_cmd(args.specaudit)
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "specaudit --version": [*exe, "--version"],
        "specaudit check --help": [*exe, "check", "--help"],
    }
    for argv in cases.values():  # warm the file cache and .pyc files
        _time_once(argv)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, argv in cases.items():
            times[name].append(_time_once(argv))

    base = statistics.median(times["python -c pass"])
    print(f"start-up, {args.runs} interleaved runs each ({' '.join(exe)}); goal: < {GOAL_S} s")
    print(f"{'command':<26}{'median':>9}{'min':>9}{'max':>9}{'x python':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<26}{med:>8.3f}s{min(ts):>8.3f}s{max(ts):>8.3f}s{med / base:>9.1f}x")
    worst = max(statistics.median(times[n]) for n in cases if n.startswith("specaudit"))
    verdict = "met" if worst < GOAL_S else "not met"
    print(f"goal < {GOAL_S} s: {verdict} (slowest median {worst:.3f} s)")


if __name__ == "__main__":
    main()
