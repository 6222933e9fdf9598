"""Calibration of `specaudit dist`'s rules by simulation: false-alarm rates and power.

Each study draws hundreds of replicate runs from the fixture's closed form and checks how
often an event happened against a binomial bound (tests/calibration.py says what each study
asserts; the unit suite runs the same studies with a few replicates):

    dist-null        fixed-sample BROKEN of correct engines <= alpha 0.05 (both fixture kinds)
    sequential-null  sequential BROKEN of correct engines <= alpha 0.1 (both fixture kinds)
    history-null     BROKEN and each history test's rejection <= alpha 0.05
    seed-pairs-null  the seed-pair test's rejection of independent seeds <= alpha 0.05
    looks-power      a history bug only the looks can see is BROKEN before the maximum
    leakage-power    draft leakage at the reported minimum is detected with the claimed 80 %

    .venv/bin/python benchmarks/bench_calibration.py STUDY [--runs N] [--json FILE]
    .venv/bin/python benchmarks/bench_calibration.py all [--json FILE]

Exit 1 when a binomial check fails (a false-alarm count above the binomial(runs, alpha) 99.9 %
quantile, a detection count below the binomial(runs, power) 0.1 % quantile). The re-scored
test's null is benchmarks/bench_rescore_null.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import calibration  # noqa: E402

Study = Callable[[int], list[calibration.Rate]]

STUDIES: dict[str, tuple[Study, int, str]] = {
    "dist-null": (
        lambda runs: [calibration.dist_false_alarms(runs)],
        150,
        "correct engines per fixture kind, 400 samples each",
    ),
    "sequential-null": (
        lambda runs: [calibration.sequential_false_alarms(runs)],
        60,
        "correct engines per fixture kind, up to 200 samples each",
    ),
    "history-null": (
        calibration.history_false_alarms,
        200,
        "correct engines, 1000 samples each",
    ),
    "seed-pairs-null": (
        lambda runs: [calibration.seed_pair_false_alarms(runs)],
        300,
        "correct engines, 400 samples each",
    ),
    "looks-power": (
        lambda runs: [calibration.looks_detect_early(runs)],
        40,
        "sequential runs of the pool-preserving bug, up to 1000 samples each",
    ),
    "leakage-power": (
        lambda runs: [r for kind in (0, 1) for r in calibration.leakage_detected(runs, kind)[1]],
        200,
        "engines leaking toward the draft per fixture kind, 1000 samples each",
    ),
}


def run(name: str, runs: int | None) -> dict[str, object]:
    """One study: its rates printed, and as a JSON row."""
    study, default, what = STUDIES[name]
    n = default if runs is None else runs
    t0 = time.perf_counter()
    rates = study(n)
    seconds = time.perf_counter() - t0
    print(f"{name} ({n} {what}, {seconds:.0f} s):", flush=True)
    for r in rates:
        print(f"  {r.line()}", flush=True)
    return {
        "study": name,
        "runs": n,
        "seconds": round(seconds, 1),
        "rates": [r.to_json() for r in rates],
        "passed": all(r.passed for r in rates),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("study", choices=[*STUDIES, "all"])
    ap.add_argument("--runs", type=int, default=None, help="replicates (default: the study's)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    names = list(STUDIES) if args.study == "all" else [args.study]
    rows = [run(name, args.runs) for name in names]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    failed = [r["study"] for r in rows if not r["passed"]]
    if failed:
        print(f"binomial check failed: {', '.join(map(str, failed))}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
