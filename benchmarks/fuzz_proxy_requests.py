"""Fuzz the proxy with malformed, oversized and wrongly typed requests, as many as you like.

    .venv/bin/python benchmarks/fuzz_proxy_requests.py [--requests 10500] [--warmup 1000] [--seed N]

Runs tests/unit/test_proxy_fuzz.py's storm (which says what every request must get: a 4xx with
an OpenAI-style error message from the proxy itself, the proxy still serving after, RSS
bounded) with `--requests` requests instead of the suite's 2,000, and prints the categories,
the RSS before and after and the first problems. Exit 1 when a property is broken.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
import test_proxy_fuzz as storm  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_500, help="invalid requests to send")
    ap.add_argument("--warmup", type=int, default=1_000, help="requests before the first RSS")
    ap.add_argument("--seed", type=int, default=20261201)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    run = storm.fuzz(args.requests, args.warmup, args.seed)
    seconds = time.perf_counter() - t0
    print(f"{run.requests} requests in {seconds:.1f} s ({run.requests / seconds:.0f}/s)")
    print(f"categories: {run.categories}")
    print(f"proxy's errors: {run.errors}; health after: {run.health}")
    print(
        f"RSS {run.rss_before_kib} KiB -> {run.rss_after_kib} KiB "
        f"({run.rss_after_kib - run.rss_before_kib:+d} KiB over {run.requests - args.warmup})"
    )
    try:
        storm.check(run, args.warmup)
    except AssertionError as e:
        print(f"FAIL: {e}")
        return 1
    print("every request got a 4xx with a message; the proxy kept serving")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
