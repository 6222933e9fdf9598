"""Differential fuzzing of the proxy core's HTTP/1.1 parsing, as long as you like.

    .venv/bin/python benchmarks/fuzz_proxy_wire.py [--examples 20000] [--seed N]

Runs the properties of tests/unit/test_proxy_wire_differential.py (which says what agreement
means: the core against aiohttp's parser and h11 for requests, against h11 for responses)
with `--examples` examples each instead of the suite's bounded count, randomized (or from
`--seed`), and prints how the inputs fell out and the first disagreement found, shrunk to a
minimal example. Exit 1 on a disagreement.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
import test_proxy_wire_differential as props  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=20_000, help="examples per property")
    ap.add_argument("--seed", type=int, default=None, help="a fixed seed (default: random)")
    args = ap.parse_args()
    counts: Counter[str] = Counter()

    def count(value: str, payload: object = "") -> None:
        """Stands in for hypothesis's ``event``: count instead of hypothesis stats."""
        counts.update([value])

    props.event = count
    run = settings(
        max_examples=args.examples,
        derandomize=False,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    loop = asyncio.new_event_loop()
    failed = False
    for name, test, extra in (
        ("requests", given(*props.REQUESTS)(props.requests_agree), (loop,)),
        ("responses", given(*props.RESPONSES)(props.responses_agree), ()),
    ):
        t = run(test)
        if args.seed is not None:
            t = seed(args.seed)(t)
        counts.clear()
        t0 = time.monotonic()
        try:
            t(*extra)
            verdict = "no disagreement"
        except AssertionError as e:
            failed = True
            notes = "\n".join(getattr(e, "__notes__", []))  # the minimal example
            verdict = f"DISAGREEMENT: {e}\n{notes}"
        total = sum(counts.values())
        print(f"{name}: {total} examples in {time.monotonic() - t0:.0f} s, {verdict}")
        for what, n in counts.most_common():
            print(f"  {n:7d}  {what}")
    loop.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
