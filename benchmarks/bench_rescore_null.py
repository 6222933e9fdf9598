"""The re-scored test's false-alarm rate under the null, by simulation.

Each simulated run draws 240 tokens that really come from the reference's distribution
(random distributions over 8 tokens, one repeated prefix of 60 draws that the per-prefix test
sees) and runs `rescore.analyse` on them at alpha = 0.01 (`rescore.null_false_alarms`). The
rate of BROKEN verdicts must stay near alpha or below (Bonferroni over KS, the directed test
and the per-prefix tests); each batch prints its count and its 95 % Clopper-Pearson interval
(`scipy.stats.binomtest`), then all batches together. Exit 1 when the alarms of all batches
exceed the binomial(runs, alpha) 99.9 % quantile (the unit suite's check, on 40 runs there).

    .venv/bin/python benchmarks/bench_rescore_null.py [--runs 2000] [--batches 3]
"""

from __future__ import annotations

import argparse
import json

from scipy import stats

from specaudit.rescore import analysis


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=2000, help="simulated runs per batch")
    ap.add_argument("--batches", type=int, default=3, help="batches (seeds 11, 12, ...)")
    ap.add_argument("--tokens", type=int, default=240)
    ap.add_argument("--alpha", type=float, default=0.01)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    for b in range(args.batches):
        seed = 11 + b
        k, (lo, hi) = analysis.null_false_alarms(
            args.runs, args.tokens, alpha=args.alpha, seed=seed
        )
        rows.append({"seed": seed, "runs": args.runs, "alarms": k, "low": lo, "high": hi})
        print(
            f"batch seed {seed}: {k}/{args.runs} false alarms = {k / args.runs:.2%} "
            f"[{lo:.2%}, {hi:.2%}]",
            flush=True,
        )
    k = sum(r["alarms"] for r in rows)
    n = args.runs * args.batches
    ci = stats.binomtest(k, n).proportion_ci(0.95)
    above = stats.binomtest(k, n, args.alpha, alternative="greater").pvalue
    print(
        f"all: {k}/{n} = {k / n:.2%} [{ci.low:.2%}, {ci.high:.2%}] at alpha = {args.alpha} "
        f"(one-sided p that the rate exceeds alpha: {above:.2g})"
    )
    limit = int(stats.binom.ppf(0.999, n, args.alpha))
    passed = k <= limit
    print(f"binomial check: {k} <= {limit} (99.9 % quantile): {'pass' if passed else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "batches": rows,
                    "alarms": k,
                    "runs": n,
                    "low": ci.low,
                    "high": ci.high,
                    "limit": limit,
                    "passed": passed,
                },
                f,
            )
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
