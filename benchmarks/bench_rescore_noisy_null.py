"""The noisy null on a real quantised model: how often `specaudit rescore` says BROKEN when
the engine under test is a plain Gemma 3 270M llama-server, with no speculation at all.

Why measure it: on a quantised model the reference's probabilities move a little with the
batch shape (which slots are busy, how the prefix was split), so an engine that is exactly
correct is still not an exact null for the re-scored tests. The simulated false-alarm rate
(`bench_rescore_null.py`) cannot show what that drift does; this runs the real thing.

Each run re-scores about `--tokens-per-run` tokens (default 4,000: 167 seeds x 3 prompts x
8 tokens = 4,008) sampled from a plain stock Gemma server (2 slots, concurrency 2) against
another plain Gemma server of the same file, both at one thread (`presets.server`, the
"gemma" policy), with top-k 40, top-p 1, min-p 0, T = 1, the default prompts, no control arm
and no temperature arm (one family at alpha = 0.01). Runs draw disjoint seed ranges (the r-th
starts at 1 + (r - 1) x 1,000,000; `request.seed_jobs` spreads a run's seeds over its prompts).

Per run it prints the seed range, the re-scored tokens, the verdict, the family's smallest
raw and Holm-adjusted p-values with their tests, the certificate's bounds, the impossible
and outside counts, and the seconds; at the end the BROKEN count out of the runs decided, its
Clopper-Pearson 95 % interval, and each test's share of runs with a raw p below alpha.

Exit 1 when the BROKEN count is significantly above alpha
(`binomtest(broken, K, 0.01, alternative="greater").pvalue < 0.01`: with 4 runs, 2 alarms),
else 0 (2 when no run decided). What K runs can and cannot show: a handful of runs cannot
bound the false-alarm rate tightly. With 4 runs and 0 alarms the rate's upper 95 % bound is
about 53 % one-sided (1 - 0.05^(1/4)), and the two-sided Clopper-Pearson interval printed
here reaches about 60 %. So the check guards against a systematic false alarm (the batch-shape
drift itself read as a bug, run after run), not against a small excess over alpha, which
would need hundreds of runs.

With `--resume` the runs already in `--json FILE` are kept and the new ones continue after
them (run r+1 on the next seed range), so the count accumulates across invocations: a rate
bound tight enough to say something about a small excess over alpha needs hundreds of runs
of about 4 minutes each, more than one sitting. The summary is over every run in the file.
Runs are only appended when they used the same settings (tokens per run, sampler), checked on
resume.

    .venv/bin/python benchmarks/bench_rescore_noisy_null.py [--runs 4]
        [--tokens-per-run 4000] [--json FILE [--resume]]
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scipy import stats

from specaudit import llama, models
from specaudit.fixtures import SamplerSettings
from specaudit.llama import presets
from specaudit.rescore import request, runner
from specaudit.stats import Verdict

ALPHA = 0.01
SAMPLER = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=1.0)
TOKENS_PER_SAMPLE = 8
CONCURRENCY = 2
SAMPLER_TEXT = "top-k 40, top-p 1, min-p 0, T = 1"
SEED_STRIDE = 1_000_000  # run r's seeds start at 1 + (r - 1) * SEED_STRIDE


def log(msg: str) -> None:
    print(f"[bench_rescore_noisy_null] {msg}", file=sys.stderr, flush=True)


def seeds_for(tokens: int, prompts: int = len(request.DEFAULT_PROMPTS)) -> int:
    """Seeds per prompt so that seeds x prompts x TOKENS_PER_SAMPLE >= `tokens`."""
    return math.ceil(tokens / (prompts * TOKENS_PER_SAMPLE))


def row_of(res: runner.RescoreResult, run: int, seed_start: int, seeds: int) -> dict[str, Any]:
    """One run's figures, as printed and written to --json."""
    prompts = len(request.DEFAULT_PROMPTS)
    row: dict[str, Any] = {
        "run": run,
        "sampler": SAMPLER_TEXT,
        "seed_first": seed_start,
        "seed_last": seed_start + seeds * prompts - 1,
        "sampled": res.sampled_tokens,
        "rescored": res.rescored,
        "seconds": round(res.total_seconds, 1),
        "error": res.error,
    }
    s = res.stats
    if s is None or res.error is not None or not s.tests:
        row["verdict"] = "no decision"
        return row
    raw = min(s.tests, key=lambda t: t.p_value)
    # Holm's adjusted p-values are monotone in the raw ones; ties (often at 1) go to the test
    # with the smaller raw p, so the name is the test that came nearest to rejecting
    adj = min(s.tests, key=lambda t: (t.adjusted, t.p_value))
    row.update(
        verdict=s.verdict.value,
        reason=s.reason,
        min_raw_p=raw.p_value,
        min_raw_test=raw.name,
        min_adjusted_p=adj.adjusted,
        min_adjusted_test=adj.name,
        tests={t.name: {"p": t.p_value, "adjusted": t.adjusted} for t in s.tests},
        impossible=s.impossible,
        outside=s.outside.outside if s.outside else None,
        outside_far=s.outside.far if s.outside else None,
        outside_expected=s.outside.expected if s.outside else None,
        boundary=res.boundary,
        noise_tv=res.noise_tv,
        bounds=[
            {"name": b.name, "estimate": b.estimate, "upper": b.upper, "within": b.within}
            for b in (s.certificate.bounds if s.certificate else ())
        ],
        needed=s.needed,
    )
    return row


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def describe(row: dict[str, Any]) -> str:
    head = (
        f"run {row['run']}: seeds {row['seed_first']}..{row['seed_last']}, "
        f"{row['rescored']}/{row['sampled']} tokens re-scored, {row['verdict']}, "
        f"{row['seconds']} s"
    )
    if "min_raw_p" not in row:
        return f"{head}\n  error: {row['error']}"
    bounds = "; ".join(
        f"{b['name']} {b['estimate']:.4g} <= {b['upper']:.4g}" + ("" if b["within"] else " (!)")
        for b in row["bounds"]
    )
    return (
        f"{head}\n"
        f"  smallest raw p {row['min_raw_p']:.3g} ({row['min_raw_test']}); smallest Holm-"
        f"adjusted p {row['min_adjusted_p']:.3g} ({row['min_adjusted_test']})\n"
        f"  impossible {row['impossible']}, outside the top-k {row['outside']} (far "
        f"{row['outside_far']}, at most {_g(row['outside_expected'])} expected), boundary "
        f"{row['boundary']}, reference noise TV {_g(row['noise_tv'])}\n"
        f"  certificate (estimate <= upper): {bounds}; tokens to decide: {row['needed']}"
    )


def summary(rows: Sequence[dict[str, Any]]) -> tuple[str, int]:
    """The closing lines and the exit code: 1 when the BROKEN count is significantly above
    alpha, 2 when no run decided (no rate to judge), else 0."""
    decided = [r for r in rows if "min_raw_p" in r]
    k = len(decided)
    lines = []
    if len(decided) < len(rows):
        lines.append(f"{len(rows) - k} run(s) decided nothing (see their errors)")
    if not k:
        return "\n".join([*lines, "no run decided: no rate to report"]), 2
    broken = sum(r["verdict"] == Verdict.BROKEN.value for r in decided)
    ci = stats.binomtest(broken, k).proportion_ci(0.95)
    above = stats.binomtest(broken, k, ALPHA, alternative="greater").pvalue
    lines.append(
        f"BROKEN {broken}/{k} = {broken / k:.1%}, Clopper-Pearson 95 % [{ci.low:.1%}, "
        f"{ci.high:.1%}]; one-sided p that the rate exceeds alpha = {ALPHA}: {above:.3g}"
    )
    verdicts = sorted({r["verdict"] for r in decided})
    lines.append(
        "verdicts: " + ", ".join(f"{v} {sum(r['verdict'] == v for r in decided)}" for v in verdicts)
    )
    names = sorted({n for r in decided for n in r["tests"]})
    lines.append(f"share of runs with raw p < {ALPHA}, per test (runs where the test ran):")
    for n in names:
        ran = [r["tests"][n]["p"] for r in decided if n in r["tests"]]
        hits = sum(p < ALPHA for p in ran)
        lines.append(f"  {n}: {hits}/{len(ran)} (smallest raw p {min(ran):.3g})")
    failed = above < ALPHA
    lines.append(
        f"binomial check (BROKEN not significantly above alpha): {'FAIL' if failed else 'pass'}"
    )
    return "\n".join(lines), 1 if failed else 0


def previous_rows(path: Path, seeds: int) -> list[dict[str, Any]]:
    """The runs already in `path` (none if it does not exist); SystemExit with one line when
    they were measured with other settings or their run numbers are not consecutive (the next
    run's seed range follows the last run's)."""
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--resume: cannot read {path}: {exc}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise SystemExit(f"--resume: {path} is not a list of runs")
    prompts = len(request.DEFAULT_PROMPTS)
    for prev, row in zip([None, *rows], rows, strict=False):
        run = row.get("run")
        if not isinstance(run, int) or (prev is not None and run != prev.get("run", 0) + 1):
            raise SystemExit(f"--resume: {path}: run numbers are not consecutive at {run}")
        start = 1 + (run - 1) * SEED_STRIDE
        if row.get("seed_first") != start or row.get("seed_last") != start + seeds * prompts - 1:
            raise SystemExit(
                f"--resume: {path}: run {run} used other seeds or another --tokens-per-run "
                f"({row.get('seed_first')}..{row.get('seed_last')})"
            )
        if row.get("sampler") != SAMPLER_TEXT:
            raise SystemExit(f"--resume: {path}: run {run} used another sampler")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=4, help="runs, each on its own seed range")
    ap.add_argument("--tokens-per-run", type=int, default=4000)
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in --json and add --runs more after them",
    )
    ap.add_argument(
        "--first-run",
        type=int,
        default=1,
        help="number of the first run when not resuming (run r samples seeds from "
        "1 + (r - 1) x 1,000,000): start after runs already reported elsewhere",
    )
    args = ap.parse_args(argv)
    if args.first_run < 1:
        ap.error("--first-run must be at least 1")
    if args.resume and args.json is None:
        ap.error("--resume needs --json FILE (the runs to continue)")
    # Ctrl-C stops at once, the servers with it, the runs so far already in --json
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    seeds = seeds_for(args.tokens_per_run)
    gemma = models.gemma_270m().path
    stock = llama.ensure()
    rows = previous_rows(args.json, seeds) if args.resume else []
    first = rows[-1]["run"] if rows else args.first_run - 1  # runs done before this one
    if rows:
        log(f"resuming after run {first} ({len(rows)} in {args.json})")
    print(
        f"noisy null, Gemma 3 270M Q4_K_M: plain engine (2 slots) vs plain reference, 1 thread "
        f"each; top-k 40, top-p 1, min-p 0, T = 1; {seeds} seeds x "
        f"{len(request.DEFAULT_PROMPTS)} prompts x {TOKENS_PER_SAMPLE} tokens = "
        f"{seeds * len(request.DEFAULT_PROMPTS) * TOKENS_PER_SAMPLE} per run; alpha = {ALPHA}",
        flush=True,
    )
    with (
        presets.server(stock, gemma, kind="gemma", name="gemma-engine") as eng,
        presets.server(stock, gemma, kind="gemma", name="gemma-reference") as ref,
    ):
        for r in range(first, first + args.runs):
            start = 1 + r * SEED_STRIDE
            log(f"run {r + 1} (last {first + args.runs}): seeds from {start}")
            req = request.make_request(
                eng.url, reference_url=ref.url, prompts=request.DEFAULT_PROMPTS, seeds=seeds,
                seed_start=start, tokens=TOKENS_PER_SAMPLE, sampler=SAMPLER, alpha=ALPHA,
                concurrency=CONCURRENCY, timeout=600.0, control=False, arm_temperature=None,
            )  # fmt: skip
            row = row_of(runner.run(req), r + 1, start, seeds)
            rows.append(row)
            print(describe(row), flush=True)
            if args.json:  # after every run: a cut-off benchmark keeps what it measured
                args.json.write_text(json.dumps(rows, indent=2))
    text, code = summary(rows)
    print(text, flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
