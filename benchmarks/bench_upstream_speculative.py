"""upstream's test_speculative.py text-comparison cases, on stock b11434 and on the
spec-logprobs build: does the patch change what a speculating server generates?

Why: the suite (tests/integration/test_upstream_server_tests.py) runs only the
test_speculative.py cases stock passes with Gemma 3 270M as its own draft
(``-k "synth or slot_ctx or ctx_shift"``, `upstream.SPECULATIVE_FAST`). The other four compare
generated text (tokens with and without a draft, content across draft min/max settings, the
stories models' regex under parallel slots); they fail on stock with Gemma, and the file's
eight cases once took 1,448 s here, so the suite leaves them out. This runs exactly those
(``-k "not (synth or slot_ctx or ctx_shift)"``) on both builds, so a case that stock passes
and the patched build fails would show.

What it measures: per case, the outcome on each build (pass / FAIL / ERROR / skip, with the
failure's first line) and its seconds. Each build runs in one upstream pytest process
(`specaudit.llama.upstream.run`: the sdist's pristine ``tools/server/tests`` copied, every
model Gemma, every server forced to speculate with Gemma as its own draft, as the suite does).
The builds are the cached ``b11434-stock`` and ``b11434-spec-logprobs-*`` entries: nothing is
built; a missing one is an error. With ``both``, patched runs first.

    .venv/bin/python benchmarks/bench_upstream_speculative.py [--build stock|patched|both]
        [--timeout 3600] [--keep] [--json FILE]

Exit codes: 0 no case that passes on stock fails on patched (or only one build ran: nothing
to compare), 1 some case passes on stock and fails (or errors) on patched, 2 it could not run
(a build not cached, the tests could not run, or the selection is not the expected four cases).

Measured (docs/upstream-server-tests.md, "test_speculative.py's text-comparison cases"):
all four FAIL on both builds at the same assertion with the same generated text (Gemma's
logits depend on how tokens are batched, and the drafts change the batching); patched 302 s,
stock 262 s, niced, at a load of 4 to 5 on the shared 2-core machine; exit 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from specaudit import llama
from specaudit.errors import SpecauditError
from specaudit.llama import presets, upstream
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import DEFAULT_BUILD, resolve_all
from specaudit.models import gemma_270m

FILE = upstream.SPECULATIVE[0].path
KEYWORD = f"not ({upstream.SPECULATIVE_FAST})"
# the cases KEYWORD selects in b11434's test_speculative.py
CASES = tuple(
    f"{FILE}::{name}"
    for name in (
        "test_with_and_without_draft",
        "test_different_draft_min_draft_max",
        "test_multi_requests_parallel[1-2]",
        "test_multi_requests_parallel[2-2]",
    )
)
BUILDS = ("patched", "stock")  # the order of --build both
MARKS = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip"}


def cached(build: str) -> LlamaBinaries:
    """The cached binaries of `build` ("stock" or "patched"); never builds."""
    patches = resolve_all((presets.PATCH,)) if build == "patched" else ()
    bins = llama.find(DEFAULT_BUILD, patches)
    if bins is None:
        what = f"b{DEFAULT_BUILD} " + (presets.PATCH if patches else "stock")
        raise SpecauditError(f"{what} is not cached (build it with specaudit llama build)")
    return bins


def _cell(run: upstream.UpstreamRun | None, nodeid: str) -> str:
    if run is None:
        return "not run"
    t = next((t for t in run.results if t.nodeid == nodeid), None)
    if t is None:
        return "not collected"
    cell = f"{MARKS[t.outcome]} {t.seconds:.0f} s"
    return f"{cell} ({t.message[:70]})" if t.message else cell


def table(runs: dict[str, upstream.UpstreamRun]) -> str:
    head = "| case | stock | patched |\n|---|---|---|"
    rows = [
        f"| `{c.split('::', 1)[1]}` | {_cell(runs.get('stock'), c)} | "
        f"{_cell(runs.get('patched'), c)} |"
        for c in CASES
    ]
    return "\n".join([head, *rows])


def regressions(runs: dict[str, upstream.UpstreamRun]) -> list[str]:
    """The cases that pass on stock and fail (or error) on patched."""
    stock, patched = runs.get("stock"), runs.get("patched")
    if stock is None or patched is None:
        return []
    return [c for c in stock.passed if patched.outcome(c) in ("failed", "error")]


def _record(run: upstream.UpstreamRun) -> dict[str, object]:
    return {
        "label": run.label,
        "binaries": run.binaries,
        "forced_spec": run.forced_spec,
        "selection": [s.display for s in run.selections],
        "seconds": run.seconds,
        "servers_started": len(run.servers),
        "servers_speculating": sum(s.speculative for s in run.servers),
        "tests": [asdict(t) for t in run.results],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", choices=("stock", "patched", "both"), default="both")
    ap.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds for each build's pytest process"
    )
    ap.add_argument("--keep", action="store_true", help="keep the tests copy and pytest log")
    ap.add_argument("--json", type=Path, default=None, help="also write the runs here")
    args = ap.parse_args()
    builds = BUILDS if args.build == "both" else (args.build,)
    runs: dict[str, upstream.UpstreamRun] = {}
    try:
        bins = {b: cached(b) for b in builds}  # both checked before the first half hour
        model = gemma_270m().path
        print(f"{FILE} -k {KEYWORD!r}; " + ", ".join(b.label for b in bins.values()), flush=True)
        for b in builds:
            run = upstream.run(
                bins[b],
                model,
                (upstream.Selection(FILE, KEYWORD),),
                force_spec=True,
                label=f"{b}-forced-spec",
                timeout=args.timeout,
            )
            runs[b] = run
            spec = sum(s.speculative for s in run.servers)
            print(
                f"{b} ({run.binaries}): {len(run.passed)} passed, {len(run.failed)} failed of "
                f"{len(run.results)}; {spec}/{len(run.servers)} servers speculated; "
                f"{run.seconds:.0f} s" + (f"; kept {run.work_dir}" if args.keep else ""),
                flush=True,
            )
            if not args.keep:
                upstream.cleanup(run)
            if args.json is not None:  # after every build: a stopped run keeps the first
                args.json.write_text(
                    json.dumps({k: _record(r) for k, r in runs.items()}, indent=2) + "\n"
                )
            got = tuple(sorted(t.nodeid for t in run.results))
            if got != tuple(sorted(CASES)):
                print(f"error: {b} ran {list(got)}, expected {list(CASES)}", file=sys.stderr)
                return 2
    except SpecauditError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(runs))
    bad = regressions(runs)
    for c in bad:
        print(f"REGRESSION {c}: passes on stock, {runs['patched'].outcome(c)} on patched")
    if len(runs) < 2:
        print("one build only: nothing compared")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
