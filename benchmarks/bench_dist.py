"""What `specaudit dist` costs and how well its statistics behave, in one run:

(a) harness throughput / a minimal raw concurrent client's, against the same fixture
    llama-server (goal >= 0.9);
(b) samples the sequential (anytime-valid) mode needs to flag llama-speculative at
    alpha = 1e-3 (goal <= 50; the field report used 1000);
(c) false-alarm rate of the plain (correct) server at alpha = 0.01 over >= 200 independent
    runs on disjoint seed blocks, with its 95% binomial (Clopper-Pearson) interval, which must
    contain 0.01. The sequential procedure is replayed on the same blocks too.

    .venv/bin/python benchmarks/bench_dist.py [--runs 200] [--block 200] [--rounds 5]

(a) alternates raw and harness runs on one server (raw, harness, raw, ..., raw), compares
each harness run with the mean of the raw runs around it (drift on a shared machine hits both
alike) and reports the median ratio; the harness time includes its statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from scipy import stats as st

from specaudit import distribution, fixtures, llama
from specaudit.stats import Verdict

PARALLEL = 4
CONCURRENCY = 2 * PARALLEL


async def raw_client(url: str, body: dict[str, Any], seeds: range) -> float:
    """The simplest fast client: one httpx pool, a semaphore, gather. Returns samples/s."""
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=CONCURRENCY)) as c:

        async def one(seed: int) -> str:
            async with sem:
                r = await c.post(url + "/completion", json={**body, "seed": seed})
                return str(r.json()["content"])

        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(s) for s in seeds))
        dt = time.perf_counter() - t0
    assert len(out) == len(seeds)
    return len(seeds) / dt


def bench_overhead(url: str, fs: fixtures.FixtureSet, n: int, rounds: int) -> None:
    wl = distribution.make_workload(fs.spec)
    seeds = range(1, n + 1)
    eng = distribution.ServerEngine(url, fs.spec, wl, concurrency=CONCURRENCY)
    body = eng.body(0)  # the very request the harness sends (seed replaced per request)
    # warm-up: connections, prompt cache
    distribution.measure(eng, fs.spec, wl, range(1, 201))
    # raw, harness, raw, harness, ..., raw: each harness run against the mean of the raw runs
    # on either side of it, so drift in the machine's load cancels out.
    raws = [asyncio.run(raw_client(url, body, seeds))]
    harn, ratios = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        req = distribution.make_request(
            ["url"], url=url, fixture=fs, concurrency=CONCURRENCY, seeds=n
        )
        (res,) = distribution.run(req).engines
        h = n / (time.perf_counter() - t0)  # end to end: the request, sampling, statistics
        assert res.n_samples == n
        raws.append(asyncio.run(raw_client(url, body, seeds)))
        harn.append(h)
        ratios.append(h / statistics.mean(raws[-2:]))
    print(
        f"(a) harness {statistics.median(harn):.0f} samples/s vs raw client "
        f"{statistics.median(raws):.0f} samples/s ({n} requests, concurrency {CONCURRENCY}, "
        f"-np {PARALLEL}, median of {rounds} rounds, each against the raw runs around it): "
        f"ratio {statistics.median(ratios):.3f} (rounds: "
        + ", ".join(f"{x:.3f}" for x in ratios)
        + ") goal >= 0.9",
        flush=True,
    )


def bench_sequential(bins: llama.LlamaBinaries, fs: fixtures.FixtureSet, blocks: int) -> None:
    used = []
    for b in range(blocks):
        req = distribution.make_request(
            ["speculative-example"], fixture=fs, binaries=bins, seeds=500,
            seed_start=1 + 500 * b, alpha=1e-3, sequential=True,
        )  # fmt: skip
        (res,) = distribution.run(req).engines
        assert res.sequential is not None
        if res.verdict is not Verdict.BROKEN:
            print(f"    block {b}: not flagged ({res.reason})")
            used.append(10**9)
            continue
        used.append(res.sequential.samples_used)
    print(
        f"(b) llama-speculative flagged BROKEN at alpha=1e-3 (sequential, anytime-valid) after "
        f"{used[0]} samples (seeds 1..); over {blocks} disjoint seed blocks of 500: median "
        f"{statistics.median(used):.0f}, min {min(used)}, max {max(used)}; goal <= 50",
        flush=True,
    )


def bench_false_alarms(url: str, fs: fixtures.FixtureSet, runs: int, block: int) -> None:
    wl = distribution.make_workload(fs.spec)
    eng = distribution.ServerEngine(url, fs.spec, wl, label="plain", concurrency=CONCURRENCY)
    t0 = time.perf_counter()
    samples = distribution.collect(eng, range(1, runs * block + 1))
    t_sample = time.perf_counter() - t0
    alarms = seq_alarms = inconclusive = 0
    t0 = time.perf_counter()
    for i in range(runs):
        chunk = samples[i * block : (i + 1) * block]
        res = distribution.analyse(fs.spec, wl, chunk, alpha=0.01, mc_seed=i)
        alarms += res.verdict is Verdict.BROKEN
        inconclusive += res.verdict is Verdict.INCONCLUSIVE
        v, _ = distribution.replay_sequential(fs.spec, wl, chunk, alpha=0.01)
        seq_alarms += v is Verdict.BROKEN
    t_stats = time.perf_counter() - t0
    for name, k in (("fixed-sample", alarms), ("sequential", seq_alarms)):
        ci = st.binomtest(k, runs).proportion_ci(0.95, method="exact")
        ok = "contains" if ci.low <= 0.01 <= ci.high else "DOES NOT contain"
        print(
            f"(c) plain llama-server, {name} test at alpha=0.01: {k}/{runs} false alarms = "
            f"{k / runs:.4f}, 95% CI [{ci.low:.4f}, {ci.high:.4f}] ({ok} 0.01)",
            flush=True,
        )
    print(
        f"    {runs} runs x {block} seeds (disjoint blocks 1..{runs * block}), "
        f"{wl.tokens} tokens, {len(res.tests)} tests per run (Holm); {inconclusive} runs "
        f"INCONCLUSIVE at this block size; sampling {t_sample:.0f} s, statistics "
        f"{t_stats:.0f} s",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--block", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--overhead-samples", type=int, default=2000)
    ap.add_argument("--seq-blocks", type=int, default=20)
    args = ap.parse_args()
    bins = llama.ensure()
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        fs = fixtures.build(Path(tmp) / "fixture")
        print(f"fixture {fs.spec.name}, llama.cpp {bins.label}, python {sys.version.split()[0]}")
        with distribution.spawn_server(bins, fs, draft=False, parallel=PARALLEL) as srv:
            bench_overhead(srv.url, fs, args.overhead_samples, args.rounds)
            bench_sequential(bins, fs, args.seq_blocks)
            bench_false_alarms(srv.url, fs, args.runs, args.block)


if __name__ == "__main__":
    main()
