"""Driving an engine: seeds sampled concurrently, consumed in seed order, then analysed.

Bounded memory whatever the number of seeds: the seeds are read from their sequence (a
`range` is never materialised), at most a few windows of samples are in flight or waiting
for their turn, and consumed samples are only counted (`distribution.counting.OutcomeCounts`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from specaudit import fixtures, stats
from specaudit.distribution.analysis import analyse
from specaudit.distribution.counting import OutcomeCounts
from specaudit.distribution.engines import Engine, engine_error
from specaudit.distribution.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOLERANCE,
    EngineResult,
    ProgressFn,
    Sample,
    Workload,
)
from specaudit.distribution.sequential import Sequential
from specaudit.distribution.truth import Truth, encode_text
from specaudit.errors import SpecauditError
from specaudit.stats import Verdict


async def _drive(
    engine: Engine,
    seeds: Sequence[int],
    consume: Callable[[Sample], bool],
) -> int:
    """Sample `seeds` concurrently; hand results to `consume` in seed order until it says stop.

    Returns how many samples were drawn. On stop the few samples in flight are let finish and
    dropped (milliseconds; a process killed mid-start could be left unreaped); on an error or
    an interrupt they are cancelled.
    """
    order = seeds  # indexed, never copied: a range of a billion seeds stays a range
    running: dict[asyncio.Task[Sample], int] = {}
    ready: dict[int, Sample] = {}
    launched = consumed = drawn = 0
    window = max(1, engine.concurrency)
    finished = False
    try:
        while consumed < len(order):
            while (
                launched < len(order) and len(running) < window and launched - consumed < 4 * window
            ):
                seed = order[launched]
                running[asyncio.ensure_future(engine.sample(seed))] = seed
                launched += 1
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                seed = running.pop(task)
                try:
                    ready[seed] = task.result()  # re-raises the engine's error
                except SpecauditError as e:  # one line that names the engine, whichever it is
                    raise engine_error(engine.label, e) from e
                drawn += 1
            while consumed < len(order) and order[consumed] in ready:
                stop = consume(ready.pop(order[consumed]))
                consumed += 1
                if stop:
                    finished = True
                    return drawn + len(running)
        finished = True
        return drawn
    finally:
        if running:
            if not finished:
                for task in running:
                    task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


def collect(
    engine: Engine, seeds: Sequence[int], progress: ProgressFn | None = None
) -> list[Sample]:
    """Just the samples, in seed order, no analysis (benchmarks, studies over seed blocks)."""
    out: list[Sample] = []
    report = progress or (lambda label, done, planned: None)

    def consume(s: Sample) -> bool:
        out.append(s)
        report(engine.label, len(out), len(seeds))
        return False

    async def go() -> None:
        try:
            await _drive(engine, seeds, consume)
        finally:
            await engine.aclose()

    asyncio.run(go())
    return out


def measure(
    engine: Engine,
    spec: fixtures.FixtureSpec,
    workload: Workload,
    seeds: Sequence[int],
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    sequential: bool = False,
    progress: ProgressFn | None = None,
) -> EngineResult:
    """Sample `seeds` from `engine` and test them (fixed sample, or sequential with early stop)."""
    return asyncio.run(
        measure_async(
            engine, spec, workload, seeds,
            alpha=alpha, tolerance=tolerance, sequential=sequential, progress=progress,
        )
    )  # fmt: skip


async def measure_async(
    engine: Engine,
    spec: fixtures.FixtureSpec,
    workload: Workload,
    seeds: Sequence[int],
    *,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
    sequential: bool = False,
    progress: ProgressFn | None = None,
) -> EngineResult:
    truth = Truth(spec, workload)
    tally = OutcomeCounts.of((), workload)
    total = len(seeds)
    report = progress or (lambda label, done, planned: None)
    seq = Sequential(truth, workload, alpha, tolerance, total) if sequential else None

    def consume(s: Sample) -> bool:
        # a short output, a special token or text outside the fixture: outcomes of probability
        # 0 the analysis judges (BROKEN, with the seed), not errors
        s = replace(s, text=encode_text(s.text, workload.tokens, spec))
        tally.add(s)
        report(engine.label, tally.n, total)
        return seq.add(s) if seq is not None else False

    t0 = time.perf_counter()
    try:
        drawn = await _drive(engine, seeds, consume)
    finally:
        await engine.aclose()
    seconds = time.perf_counter() - t0
    res = analyse(
        spec, workload, tally,
        alpha=alpha, tolerance=tolerance, engine=engine.label, kind=engine.kind, seconds=seconds,
    )  # fmt: skip
    if seq is not None:
        res.sequential = seq.result(drawn)
        res.verdict = seq.verdict
        res.reason = seq.reason()
        if seq.tv_uppers:
            res.tv_bound = max(seq.tv_uppers)
        res.samples_needed = (
            stats.samples_needed(res.n_samples, max(seq.tv_uppers or [1.0]), tolerance)
            if seq.verdict is Verdict.INCONCLUSIVE
            else None
        )
    return res


__all__ = ["collect", "measure", "measure_async"]
