"""Size and power of the re-scored run's q-free tests (`specaudit.rescore.scores`), next to
today's tests (`rescore.analysis`: KS of the PIT values, the one-sided favourite, the
asymptotic per-prefix G-test).

Null: simulated runs whose tokens really are drawn from the reference's distributions
(`tests/rescore_synthetic.py`): top-k 40 distributions with a heavy head (Dirichlet weights
2 j^-1.5 over the ranks) and flat ones (Dirichlet(1)), 200, 1200 and 4800 tokens, each at its
own prefix ("independent") or in generations of 8 whose distributions depend on the token
before ("chain"); and one prefix repeated 200 times (every seed's first token). Each test's
false alarms at alpha are checked by a one-sided binomial test (`scipy.stats.binomtest`) that
the rate exceeds alpha: exit 1 when one has p < 0.001. Today's G-test is printed beside the
per-prefix test, not asserted (its chi-square approximation is known to be over its level).

Power: the same runs drawn from a bug's distortion of p (temperature 0.8; 30 % of rank 2's
mass moved to rank 3; the favourite sampled 10 % less often; an acceptance rule
min(1, 1.25 p / q) against a draft q), each test alone at alpha.

    .venv/bin/python benchmarks/bench_rescore_scores.py [--scale 1] [--alpha 0.01] [--json FILE]

Measured (alpha = 0.01, about 20 min on a loaded 2-core machine): every asserted null rate
passes (the largest 1.67 %, 10/600, surprisal on head n = 4800, one-sided p = 0.08; the dependent
chains 0.67-1.30 %); per-prefix at 200 draws 0.95 % (head) and 0.85 % (flat) where today's G
rejects 0.95 % and 1.68 % (p = 5e-5 that it exceeds alpha). Power at n = 4800 (head): the
acceptance rule min(1, 1.25 p/q) surprisal 82 %, rank bins 50 %, favourite two-sided 20 %,
today's KS 26 % and one-sided favourite 27 %; the favourite 10 % too rare: 100 % for each new
test and for KS, 0 % for the one-sided favourite; rank 2 -> 3: rank bins 100 % already at
n = 1200 (KS 39 %).

Monte-Carlo p-values use at most --mc-draws draws (default 2000: a floor of 5e-4, below every
alpha studied; Besag-Clifford stopping makes most far fewer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import rescore_synthetic as rs  # noqa: E402
from specaudit.rescore import analysis, scores  # noqa: E402
from specaudit.rescore.records import TokenDraw  # noqa: E402

Gen = Callable[[int, np.random.Generator], list[TokenDraw]]
FAIL_BELOW = 1e-3  # the one-sided binomial p-value below which a rate exceeds alpha
NEW = ("surprisal", "rank bins", "favourite 2-sided")
TODAY = ("KS (today)", "favourite 1-sided (today)")


def _independent(shape: rs.Shape, bug: rs.Bug = rs.none) -> Gen:
    return lambda n, rng: rs.run(n, rng, shape, bug)


def _chain(shape: rs.Shape, bug: rs.Bug = rs.none) -> Gen:
    return lambda n, rng: rs.chain(n, rng, shape, bug)


def _new(draws: list[TokenDraw], mc: int, seed: int) -> dict[str, float]:
    return {
        "surprisal": scores.surprisal_test(draws, mc_draws=mc, seed=seed).p_value,
        "rank bins": scores.rank_bin_test(draws, mc_draws=mc, seed=seed).p_value,
        "favourite 2-sided": scores.favourite_test(draws).p_value,
    }


def _today(draws: list[TokenDraw], seed: int) -> dict[str, float]:
    res = analysis.analyse(draws, seed=seed)
    return {
        "KS (today)": res.ks_p,
        "favourite 1-sided (today)": res.directed_p,
        "G asymptotic (today)": res.g_p,
    }


def _rate_row(
    cell: str, test: str, alarms: int, runs: int, alpha: float, asserted: bool
) -> dict[str, object]:
    ci = stats.binomtest(alarms, runs).proportion_ci(0.95)
    above = float(stats.binomtest(alarms, runs, alpha, alternative="greater").pvalue)
    passed = above >= FAIL_BELOW or not asserted
    return {
        "cell": cell,
        "test": test,
        "alarms": alarms,
        "runs": runs,
        "rate": alarms / runs,
        "low": float(ci.low),
        "high": float(ci.high),
        "p_above_alpha": above,
        "asserted": asserted,
        "passed": passed,
    }


def null_cells(scale: float) -> list[tuple[str, Gen, int, int]]:
    """(label, generator, tokens, runs): fewer runs where each costs more."""
    cells = []
    for n, runs in ((200, 5000), (1200, 2000), (4800, 600)):
        r = max(20, int(runs * scale))
        cells.append((f"head independent n={n}", _independent(rs.head), n, r))
        cells.append((f"flat independent n={n}", _independent(rs.flat), n, r))
        cells.append((f"head chain n={n}", _chain(rs.head), n, r))
    return cells


def run_null(
    scale: float, alpha: float, mc: int, prefix_only: bool = False
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for c, (label, gen, n, runs) in enumerate([] if prefix_only else null_cells(scale)):
        rng = np.random.default_rng(1000 + c)
        alarms = dict.fromkeys(NEW, 0)
        t0 = time.perf_counter()
        for r in range(runs):
            for test, p in _new(gen(n, rng), mc, r).items():
                alarms[test] += p < alpha
        for test in NEW:
            rows.append(_rate_row(label, test, alarms[test], runs, alpha, True))
        print(f"  {label}: {runs} runs, {time.perf_counter() - t0:.0f} s", flush=True)
    for shape_name, shape in rs.SHAPES.items():
        label = f"prefix {shape_name} 200 draws"
        runs = max(20, int(4000 * scale))
        rng = np.random.default_rng(2000 + len(rows))
        new = old = 0
        t0 = time.perf_counter()
        for r in range(runs):
            draws = rs.repeated(200, rng, shape)
            (pre,) = scores.prefix_tests(draws, mc_draws=mc, seed=r)
            new += pre.p_value < alpha
            old += analysis.analyse(draws, seed=r).g_p < alpha
        rows.append(_rate_row(label, "prefix exact/MC", new, runs, alpha, True))
        rows.append(_rate_row(label, "G asymptotic (today)", old, runs, alpha, False))
        print(f"  {label}: {runs} runs, {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def run_power(
    scale: float, alpha: float, mc: int, prefix_only: bool = False
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    runs = max(10, int(100 * scale))
    for b, (bug_name, bug) in enumerate(rs.BUGS.items()):
        for n in () if prefix_only else (1200, 4800):
            rng = np.random.default_rng(3000 + 10 * b + n)
            hits = dict.fromkeys((*NEW, *TODAY), 0)
            t0 = time.perf_counter()
            for r in range(runs):
                draws = rs.run(n, rng, rs.head, bug)
                ps = {**_new(draws, mc, r), **_today(draws, r)}
                for test in hits:
                    hits[test] += ps[test] < alpha
            rows.append({"bug": bug_name, "cell": f"head n={n}", "runs": runs, **hits})
            print(f"  {bug_name}, n={n}: {time.perf_counter() - t0:.0f} s", flush=True)
        rng = np.random.default_rng(4000 + b)
        pre = {"prefix exact/MC": 0, "G asymptotic (today)": 0}
        for r in range(runs):
            draws = rs.repeated(200, rng, rs.head, bug)
            pre["prefix exact/MC"] += (
                scores.prefix_tests(draws, mc_draws=mc, seed=r)[0].p_value < alpha
            )
            pre["G asymptotic (today)"] += analysis.analyse(draws, seed=r).g_p < alpha
        rows.append({"bug": bug_name, "cell": "prefix head 200 draws", "runs": runs, **pre})
    return rows


def print_null(rows: list[dict[str, object]], alpha: float) -> None:
    print(f"\nnull: false alarms at alpha = {alpha} (one-sided binomial p that the rate > alpha)")
    print(f"{'cell':<28} {'test':<22} {'alarms':>11} {'rate':>7} {'95 % CI':>17} {'p':>8}")
    for r in rows:
        mark = "" if r["passed"] else "  FAIL"
        mark = mark if r["asserted"] else "  (not asserted)"
        ci = f"[{r['low']:.2%}, {r['high']:.2%}]"
        print(
            f"{r['cell']!s:<28} {r['test']!s:<22} {r['alarms']!s:>5}/{r['runs']!s:<5} "
            f"{r['rate']:>7.2%} {ci:>17} {r['p_above_alpha']:>8.3g}{mark}"
        )


def print_power(rows: list[dict[str, object]], alpha: float) -> None:
    cols = (*NEW, *TODAY, "prefix exact/MC", "G asymptotic (today)")
    print(f"\npower: rejections at alpha = {alpha}, each test alone")
    head = "".join(f"{c[:16]:>18}" for c in cols)
    print(f"{'bug':<25} {'cell':<22}{head}")
    for r in rows:
        runs = int(str(r["runs"]))
        vals = "".join(f"{int(str(r[c])) / runs:>18.0%}" if c in r else f"{'-':>18}" for c in cols)
        print(f"{r['bug']!s:<25} {r['cell']!s:<22}{vals}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every run count")
    ap.add_argument("--alpha", type=float, default=0.01)
    ap.add_argument("--mc-draws", type=int, default=2000)
    ap.add_argument("--no-power", action="store_true", help="the null study only")
    ap.add_argument("--prefix-only", action="store_true", help="the per-prefix cells only")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print("null study:", flush=True)
    null = run_null(args.scale, args.alpha, args.mc_draws, args.prefix_only)
    power: list[dict[str, object]] = []
    if not args.no_power:
        print("power study:", flush=True)
        power = run_power(args.scale, args.alpha, args.mc_draws, args.prefix_only)
    print_null(null, args.alpha)
    if power:
        print_power(power, args.alpha)
    failed = [f"{r['cell']} / {r['test']}" for r in null if not r["passed"]]
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps({"null": null, "power": power}, indent=2) + "\n")
    if failed:
        print(f"binomial check failed: {', '.join(failed)}")
        return 1
    print(f"binomial check: every asserted rate within alpha (p >= {FAIL_BELOW})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
