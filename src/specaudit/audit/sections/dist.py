"""The audit's dist section: does speculation keep the sampling distribution?

On both fixtures (last-token and context), llama-server on every verification path it has
that a fixture can exercise (no draft; greedy draft, sample-and-match; probabilistic draft,
rejection sampling; ngram-mod), each through the audit's own servers (`presets`), plus
llama.cpp's llama-speculative example on the last-token fixture: 1000 seeds each, as in the
field report. One summary table with each row's path and drafted / accepted / rejected
counts, then the paths no fixture can exercise (`dist.NOT_COVERED`).

An engine that cannot produce a sample (a server that does not start, an example run that
fails) does not take the others with it: their results are kept, and the section's error is
one line naming each such engine and why (the audit then exits 2, no decision).
"""

from __future__ import annotations

from collections.abc import Callable

from specaudit import distribution, matrix
from specaudit.audit.context import AuditContext, Section
from specaudit.errors import SpecauditError
from specaudit.fixtures import FixtureSet
from specaudit.llama import presets
from specaudit.outcome import Outcome
from specaudit.report import md_table
from specaudit.stats import Verdict

SEEDS = range(1, 1001)  # the report's 1000 seeds
SUMMARY_HEADERS = ("fixture", *distribution.PATH_HEADERS, "why")


def build_paths(ctx: AuditContext) -> list[str]:
    """The verification paths the audited build has on the llama fixtures (the MTP paths
    need the mtp fixture): no rejection sampler before #27694."""
    from specaudit.distribution.coverage import kind_paths

    have = matrix.has_rejection(ctx.binaries())
    return [p for p in kind_paths("last-token") if p != "rejection" or have]


def _attempt(
    failures: list[str], fixture: str, label: str, run: Callable[[], distribution.EngineResult]
) -> distribution.EngineResult | None:
    """`run()`, or None with one line in `failures` naming the engine and why it could not
    sample (the engines after it still run)."""
    try:
        return run()
    except SpecauditError as e:
        failures.append(f"{fixture}: {distribution.engine_error(label, e)}")
        return None


def _server_paths(
    ctx: AuditContext, fs: FixtureSet, model: str, failures: list[str]
) -> list[distribution.EngineResult]:
    wl = distribution.make_workload(fs.spec)
    results = []
    for path in build_paths(ctx):
        label, kind = distribution.PATH_ENGINES[path]

        def run(
            path: str = path, label: str = label, kind: str = kind
        ) -> distribution.EngineResult:
            srv = ctx.server(presets.fixture_role(model, path))
            ctx.progress(f"dist: {fs.spec.name}: {label}")
            eng = distribution.ServerEngine(srv.url, fs.spec, wl, label=label, kind=kind)
            res = distribution.measure(eng, fs.spec, wl, SEEDS)
            res.path = path
            return res

        res = _attempt(failures, fs.spec.name, label, run)
        if res is not None:
            results.append(res)
    return results


def _example(
    ctx: AuditContext, fs: FixtureSet, failures: list[str]
) -> list[distribution.EngineResult]:
    ctx.progress("dist: llama-speculative")
    wl = distribution.make_workload(fs.spec)

    def run() -> distribution.EngineResult:
        speculative = ctx.binaries().speculative
        ex = distribution.ExampleEngine(speculative, fs.target, fs.draft, fs.spec, wl)
        return distribution.measure(ex, fs.spec, wl, SEEDS)

    res = _attempt(failures, fs.spec.name, "llama-speculative", run)
    return [] if res is None else [res]


def _result(fs: FixtureSet, engines: list[distribution.EngineResult]) -> distribution.DistResult:
    return distribution.DistResult(
        fixture=fs.spec.name, fixture_dir=fs.dir, sha256=dict(fs.sha256),
        workload=distribution.make_workload(fs.spec), alpha=distribution.DEFAULT_ALPHA,
        tolerance=distribution.DEFAULT_TOLERANCE, sequential=False, engines=engines,
        not_covered=list(distribution.NOT_COVERED),
    )  # fmt: skip


def section(ctx: AuditContext) -> Section:
    """The audit's dist section: both fixtures through llama-server on every path (plain,
    greedy, rejection, ngram) and the last-token fixture through llama-speculative, 1000
    seeds each."""
    fs, cfs = ctx.fixture, ctx.context_fixture
    failures: list[str] = []  # one line per engine that could not sample
    last = _server_paths(ctx, fs, "fixture", failures)
    last += _example(ctx, fs, failures)
    res = _result(fs, last)
    res_ctx = _result(cfs, _server_paths(ctx, cfs, "fixture-context", failures))
    res.plot = distribution.plot_results(res, ctx.out_dir / "dist.png")
    res_ctx.plot = distribution.plot_results(res_ctx, ctx.out_dir / "dist-context.png")
    both = [(r, e) for r in (res, res_ctx) for e in r.engines]
    rows = [
        (r.fixture, *row, e.reason)
        for r in (res, res_ctx)
        for e, row in zip(r.engines, distribution.path_rows(r), strict=True)
    ]
    markdown = "\n".join(
        [
            *(
                ["**Could not sample** (no decision for these engines):", ""]
                + [f"- {line}" for line in failures]
                + [""]
                if failures
                else []
            ),
            "Every llama-server verification path a fixture can exercise, on both fixtures "
            f"(seeds {SEEDS.start}..{SEEDS.stop - 1}); rejected = drafted - accepted.",
            "",
            md_table(SUMMARY_HEADERS, rows),
            "",
            "Not covered (no fixture can exercise them):",
            "",
            *distribution.not_covered_lines(res.not_covered),
            *(
                [f"- rejection: b{ctx.build} has no rejection sampler (added by #27694)"]
                if "rejection" not in build_paths(ctx)
                else []
            ),
            "",
            f"#### Fixture `{res.fixture}` (last-token)",
            "",
            distribution.to_markdown(res),
            "",
            f"#### Fixture `{res_ctx.fixture}` (context)",
            "",
            distribution.to_markdown(res_ctx),
        ]
    )
    broken = [e for _, e in both if e.verdict is Verdict.BROKEN]
    summary = "; ".join(f"{r.fixture}: {e.engine} {e.verdict.value}" for r, e in both)
    error = "; ".join(failures) if failures else None
    if error is not None:
        status = Outcome.NO_DECISION
        summary = f"error: {error}" + (f" (measured: {summary})" if summary else "")
    else:
        # FINDING when an engine is BROKEN; an INCONCLUSIVE engine is reported, not a finding
        status = Outcome.FINDING if broken else Outcome.OK
    return Section(
        key="dist",
        title="Distribution: does speculation keep the sampling distribution?",
        markdown=markdown,
        data={"dist": res, "dist_context": res_ctx},
        plots=[res.plot, res_ctx.plot],
        status=status,
        summary=summary,
        error=error,
    )


__all__ = ["section"]
