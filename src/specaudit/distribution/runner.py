"""Orchestration: run a checked `DistRequest`, engine by engine, and collect one result.

The request was checked when it was built (`dist.request.make_request`); each engine is built
from it by its registry entry (`dist.registry`, built-ins and plug-ins alike) and measured here.
"""

from __future__ import annotations

import contextlib

from specaudit.distribution import registry
from specaudit.distribution.driver import measure
from specaudit.distribution.engines import MAX_CONCURRENCY
from specaudit.distribution.llamacpp import DRAFT_SAMPLING, PATHS, spawn_server
from specaudit.distribution.render import plot_results
from specaudit.distribution.request import (
    DEFAULT_TIMEOUT,
    MAX_JOBS,
    MAX_JOINT,
    MAX_PARALLEL,
    MIN_TOKENS,
    DistRequest,
    load_fixture,
    make_request,
    make_workload,
    url_list,
)
from specaudit.distribution.results import DistResult, EngineResult, ProgressFn
from specaudit.llama.build import LlamaBinaries


def run(request: DistRequest, *, progress: ProgressFn | None = None) -> DistResult:
    """Run the distribution test on each engine of `request` (`server` means one llama-server
    per verification path: each result's `path` says which). The result's `not_covered` lists
    what the engines that ran cannot exercise (`dist.coverage.NOT_COVERED`, ...).

    Memory does not grow with the seeds (a range, counted as sampled: `dist.driver`). The
    binary engines run on `request.binaries`, else on llama.cpp built (or found) with
    `request.patches` (`llama.ensure`), once, when the first of them starts; their labels name
    the patches.
    """
    req = request
    built: list[LlamaBinaries] = []

    def binaries() -> LlamaBinaries:
        if not built:
            b = req.binaries
            if isinstance(b, LlamaBinaries):
                built.append(b)
            elif b is not None:
                built.append(b())
            else:
                from specaudit import llama

                built.append(llama.ensure(patches=req.patches))
        return built[0]

    ctx = registry.RunContext(binaries)
    results: list[EngineResult] = []
    for name in req.engines:
        units = registry.get(name).build(req, ctx)
        with contextlib.closing(units):  # a server still up stops when measuring fails
            for unit in units:
                res = measure(
                    unit.engine, unit.spec or req.fixture.spec, req.workload, req.seed_range,
                    alpha=req.alpha, tolerance=req.tolerance, sequential=req.sequential,
                    progress=progress,
                )  # fmt: skip
                if unit.path is not None:
                    res.path = unit.path
                results.append(res)
    out = DistResult(
        fixture=req.fixture.spec.name,
        fixture_dir=req.fixture.dir,
        sha256=dict(req.fixture.sha256),
        workload=req.workload,
        alpha=req.alpha,
        tolerance=req.tolerance,
        sequential=req.sequential,
        engines=results,
        notes=ctx.notes,
        not_covered=ctx.not_covered,
    )
    if req.plot is not None:
        out.plot = plot_results(out, req.plot)
    return out


__all__ = [
    "DEFAULT_TIMEOUT",
    "DRAFT_SAMPLING",
    "MAX_CONCURRENCY",
    "MAX_JOBS",
    "MAX_JOINT",
    "MAX_PARALLEL",
    "MIN_TOKENS",
    "PATHS",
    "DistRequest",
    "load_fixture",
    "make_request",
    "make_workload",
    "run",
    "spawn_server",
    "url_list",
]
