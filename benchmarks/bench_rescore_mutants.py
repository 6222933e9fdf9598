"""Mutation testing on a real model: the rejection-sampler mutants, re-scored on the fixture
and on Gemma 3 270M side by side.

Every build (stock and spec-logprobs as controls, then each bundled mutant of b11434,
docs/mutants.md) serves ``--spec-draft-sampling probabilistic`` twice: on the default fixture
(its own draft) and on Gemma 3 270M with itself as its draft. Each is re-scored
(`specaudit.rescore`) against a plain stock server of the same model. "tokens to BROKEN" is
where the anytime-valid e-process first reached 1/alpha (valid at every look, so reading it
off the trajectory is honest); the verdict is the fixed-N test over all tokens.

Controls run every token; a mutant stops at the first look where the e-process crossed
(looks after 128, 256, 512 and 1000 tokens on Gemma; stopping there is what an anytime-valid test
allows, and it is what makes the table affordable on a small machine). `--full` runs every
row to the end.

On Gemma the draft samples with top-k 10 at the target's temperature while the target keeps
top-k 40 (common/speculative.cpp), so q differs from p and rejection sampling really runs; with
the target at top-k 10 too, q = p and every rejection-sampler mutant would be equivalent.

    .venv/bin/python benchmarks/bench_rescore_mutants.py [--fixture-seeds 500]
        [--gemma-tokens 1000] [--only NAME ...] [--json FILE] [--full]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specaudit import distribution, llama, models
from specaudit.fixtures import REPORT_SAMPLER, SamplerSettings
from specaudit.llama import LlamaServer
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import resolve
from specaudit.llama.presets import draft_chain
from specaudit.rescore import analysis, request, runner
from specaudit.rescore import fixture as fixture_ref

ALPHA = 0.01
GEMMA_SAMPLER = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=1.0)
GEMMA_PROMPT = "Once upon a time"
GEMMA_TOKENS_PER_SAMPLE = 4
CONTROLS = ("stock", "spec-logprobs")
FIRST_LOOK = 32  # seeds: 128 tokens, the fewest the re-scored test decides on (check_enough)


def log(msg: str) -> None:
    print(f"[bench_rescore_mutants] {msg}", file=sys.stderr, flush=True)


def binaries(build: str) -> LlamaBinaries:
    if build == "stock":
        return llama.ensure()
    return llama.ensure(patches=(resolve(build),))


@contextlib.contextmanager
def gemma_server(bins: LlamaBinaries, gemma: Path) -> Iterator[LlamaServer]:
    srv = LlamaServer(
        bins, gemma, draft=gemma, spec_type="draft-simple", parallel=2, ctx_size=4096,
        extra_args=("--spec-draft-sampling", "probabilistic"), name="gemma-rejection",
    )  # fmt: skip
    with srv:
        yield srv


def looks(total_seeds: int, first: int) -> list[int]:
    """Seeds per look: `first`, then as many again as were drawn (the total doubles), up to
    `total_seeds`."""
    out, drawn = [], 0
    while drawn < total_seeds:
        step = min(max(first, drawn), total_seeds - drawn)
        out.append(step)
        drawn += step
    return out


def rescore_looks(
    base: dict[str, Any], total_seeds: int, first: int, stop_early: bool, seed_start: int = 1
) -> runner.RescoreResult:
    """Re-score `total_seeds` seeds from `seed_start` in looks (fresh seed ranges), the draws
    pooled in seed order; with `stop_early`, stop after the first look whose e-process crossed
    1/alpha."""
    pooled: runner.RescoreResult | None = None
    start = seed_start
    for n in looks(total_seeds, first):
        res = runner.run(request.make_request(**base, seeds=n, seed_start=start))
        start += n
        if pooled is None:
            pooled = res
        else:
            pooled.samples += res.samples
            pooled.draws += res.draws
            pooled.rescored += res.rescored
            pooled.boundary += res.boundary
            pooled.seeds += res.seeds
            pooled.total_seconds += res.total_seconds
            pooled.drafted = (pooled.drafted or 0) + (res.drafted or 0)
            pooled.accepted = (pooled.accepted or 0) + (res.accepted or 0)
            pooled.error = pooled.error or res.error
        if pooled.error or not pooled.draws:
            break
        seq = analysis.analyse(pooled.draws, alpha=ALPHA, sequential=True)
        if stop_early and seq.crossed_at is not None:
            pooled.stats = seq
            return pooled
    assert pooled is not None
    if pooled.draws and not pooled.error:
        pooled.stats = analysis.analyse(pooled.draws, alpha=ALPHA)
    return pooled


def cell(res: runner.RescoreResult, per_sample: int) -> dict[str, Any]:
    s = res.stats
    if s is None:
        return {"verdict": f"no decision: {res.error}"}
    crossed = s.crossed_at
    return {
        "verdict": s.verdict.value,
        "seeds_drawn": res.seeds,
        "reason": s.reason,  # which test decided (a BROKEN on few differing samples is suspect)
        "impossible": s.impossible,
        "boundary": res.boundary,
        "tokens": s.tokens,
        "tokens_to_broken": crossed,
        "samples_to_broken": math.ceil(crossed / per_sample) if crossed else None,
        "ks_p": s.ks_p,
        "favourite_p": s.directed_p,
        "drafted": res.drafted,
        "accepted": res.accepted,
        "seconds": round(res.total_seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--fixture-seeds", type=int, default=500)
    ap.add_argument("--gemma-tokens", type=int, default=1000)
    ap.add_argument("--only", nargs="*", default=None, help="builds to run (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--full", action="store_true", help="no early stop for mutants")
    ap.add_argument(
        "--rows", type=Path, default=None, help="a JSON of rows already measured (kept)"
    )
    ap.add_argument(
        "--seed-start",
        type=int,
        default=1,
        help="first seed of every row (another range re-checks a borderline row)",
    )
    args = ap.parse_args(argv)
    # Ctrl-C stops the run as SIGTERM does: at once, the servers with it (they die with their
    # parent), the rows measured so far already in --json. Python's own SIGINT handling would
    # wait for a look's reference calls (sync HTTP in worker threads) to finish first.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    builds = [*CONTROLS, *llama.available_mutants()]
    if args.only:
        builds = [b for b in builds if b in args.only or b.removeprefix("mutants/") in args.only]
    builds = [b for b in builds if not b.removeprefix("mutants/").startswith(("lp-", "mtp-"))]
    fs = distribution.load_fixture(None)
    spec = fs.spec
    gemma = models.gemma_270m().path
    stock = llama.ensure()
    rows: list[dict[str, Any]] = json.loads(args.rows.read_text()) if args.rows else []
    builds = [b for b in builds if b not in {r["build"] for r in rows}]
    with (
        distribution.spawn_server(stock, fs, draft=False) as fref,
        LlamaServer(stock, gemma, parallel=2, ctx_size=4096, name="gemma-reference") as gref,
    ):
        for build in builds:
            log(f"{build}: building (or from the cache)")
            bins = binaries(build)
            row: dict[str, Any] = {"build": build, "seed_start": args.seed_start}
            t0 = time.monotonic()
            stop_early = build not in CONTROLS and not args.full
            with distribution.spawn_server(
                bins, fs, draft=True, draft_sampling="probabilistic"
            ) as srv:
                base = dict(
                    url=srv.url, reference_url=fref.url, prompt_ids=[spec.tokenize(spec.prompt)],
                    tokens=4, sampler=REPORT_SAMPLER, alpha=ALPHA,
                    draft=fixture_ref.FixtureDraft(spec, draft_chain(REPORT_SAMPLER)),
                )  # fmt: skip
                res = rescore_looks(
                    base, args.fixture_seeds, FIRST_LOOK, stop_early, args.seed_start
                )
                row["fixture"] = cell(res, 4)
            with gemma_server(bins, gemma) as srv:
                seeds = math.ceil(args.gemma_tokens / GEMMA_TOKENS_PER_SAMPLE)
                base = dict(
                    url=srv.url, reference_url=gref.url, prompts=[GEMMA_PROMPT],
                    tokens=GEMMA_TOKENS_PER_SAMPLE, sampler=GEMMA_SAMPLER, alpha=ALPHA,
                    concurrency=2, timeout=600.0,
                )  # fmt: skip
                res = rescore_looks(base, seeds, FIRST_LOOK, stop_early, args.seed_start)
                row["gemma"] = cell(res, GEMMA_TOKENS_PER_SAMPLE)
            log(f"{build}: {row['fixture']['verdict']} / {row['gemma']['verdict']} "
                f"({time.monotonic() - t0:.0f} s)")  # fmt: skip
            rows.append(row)
            if args.json:  # after every row: a cut-off run keeps what it measured
                args.json.write_text(json.dumps(rows, indent=2))
    print(table(rows, args.fixture_seeds * 4, args.gemma_tokens))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def _first(c: dict[str, Any]) -> str:
    if c.get("tokens_to_broken") is None:
        return f"> {c.get('tokens', '?')}"
    return f"{c['tokens_to_broken']} ({c['samples_to_broken']} samples)"


def table(rows: list[dict[str, Any]], fixture_tokens: int, gemma_tokens: int) -> str:
    lines = [
        f"Re-scored, --spec-draft-sampling probabilistic, alpha = {ALPHA}: fixture (top-k 3, "
        f"T = 1, {fixture_tokens} tokens) and Gemma 3 270M as its own draft (top-k 40, T = 1, "
        f"{gemma_tokens} tokens, {GEMMA_TOKENS_PER_SAMPLE} per sample)",
        "",
        "| build | fixture verdict | fixture tokens to BROKEN | Gemma verdict | Gemma tokens to "
        "BROKEN | Gemma drafted/accepted |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        f, g = r["fixture"], r["gemma"]
        lines.append(
            f"| {r['build']} | {f['verdict']} | {_first(f)} | {g['verdict']} | {_first(g)} | "
            f"{g.get('drafted')}/{g.get('accepted')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
