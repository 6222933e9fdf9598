"""The audit's dist section: does speculation keep the sampling distribution?

On both fixtures (last-token and context), llama-server on every verification path it has
that a fixture can exercise (no draft; greedy draft, sample-and-match; probabilistic draft,
rejection sampling; ngram-mod), each through the audit's own servers (`presets`), plus
llama.cpp's llama-speculative example on the last-token fixture: 1000 seeds each, as in the
field report. Where the build has the MTP drafter, the mtp fixture (a glm4moe with its own MTP
layer: the only model the MTP paths run on) on the MTP paths, mtp (greedy MTP drafts,
sample-and-match) and mtp-rejection (probabilistic, rejection sampling), 1000 seeds each too.
One summary table with each row's fixture, path and drafted / accepted / rejected counts (an
MTP row's drafted > 0 shows the MTP path ran), then the paths no fixture can exercise
(`dist.NOT_COVERED`).

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


def mtp_paths(ctx: AuditContext) -> list[str]:
    """The MTP paths the audited build has on the mtp fixture (`matrix.build_mtp_paths`): its
    plain path is left out, the llama fixtures' plain rows are the audit's no-draft control."""
    return matrix.build_mtp_paths(ctx.binaries())


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
    ctx: AuditContext, fs: FixtureSet, model: str, paths: list[str], failures: list[str]
) -> list[distribution.EngineResult]:
    wl = distribution.make_workload(fs.spec)
    results = []
    for path in paths:
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


def _mtp(ctx: AuditContext, failures: list[str]) -> distribution.DistResult | None:
    """The mtp fixture on the MTP paths the build has (None: it has none)."""
    paths = mtp_paths(ctx)
    if not paths:
        return None
    mfs = ctx.mtp_fixture
    res = _result(mfs, _server_paths(ctx, mfs, "fixture-mtp", paths, failures))
    res.plot = distribution.plot_results(res, ctx.out_dir / "dist-mtp.png")
    return res


def _not_run_lines(ctx: AuditContext, res_mtp: distribution.DistResult | None) -> list[str]:
    """Paths this build lacks (markdown bullets)."""
    lines = []
    if "rejection" not in build_paths(ctx):
        lines.append(f"- rejection: b{ctx.build} has no rejection sampler (added by #27694)")
    if res_mtp is None:
        lines.append(
            f"- mtp, mtp-rejection: b{ctx.build} has no MTP drafter (--spec-type "
            f"{matrix.MTP_SPEC_TYPE})"
        )
    elif "mtp-rejection" not in mtp_paths(ctx):
        lines.append(f"- mtp-rejection: b{ctx.build} has no rejection sampler (added by #27694)")
    return lines


def section(ctx: AuditContext) -> Section:
    """The audit's dist section: both llama fixtures through llama-server on every path
    (plain, greedy, rejection, ngram...), the last-token fixture through llama-speculative,
    and the mtp fixture on the MTP paths (mtp, mtp-rejection), 1000 seeds each."""
    fs, cfs = ctx.fixture, ctx.context_fixture
    failures: list[str] = []  # one line per engine that could not sample
    last = _server_paths(ctx, fs, "fixture", build_paths(ctx), failures)
    last += _example(ctx, fs, failures)
    res = _result(fs, last)
    res_ctx = _result(cfs, _server_paths(ctx, cfs, "fixture-context", build_paths(ctx), failures))
    res.plot = distribution.plot_results(res, ctx.out_dir / "dist.png")
    res_ctx.plot = distribution.plot_results(res_ctx, ctx.out_dir / "dist-context.png")
    res_mtp = _mtp(ctx, failures)
    results = [res, res_ctx, *([res_mtp] if res_mtp is not None else [])]
    both = [(r, e) for r in results for e in r.engines]
    rows = [
        (r.fixture, *row, e.reason)
        for r in results
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
            "Every llama-server verification path a fixture can exercise, on both llama "
            "fixtures, and the MTP paths on the mtp fixture "
            f"(seeds {SEEDS.start}..{SEEDS.stop - 1}); rejected = drafted - accepted.",
            "",
            md_table(SUMMARY_HEADERS, rows),
            "",
            "Not covered (no fixture can exercise them):",
            "",
            *distribution.not_covered_lines(res.not_covered),
            *_not_run_lines(ctx, res_mtp),
            "",
            f"#### Fixture `{res.fixture}` (last-token)",
            "",
            distribution.to_markdown(res),
            "",
            f"#### Fixture `{res_ctx.fixture}` (context)",
            "",
            distribution.to_markdown(res_ctx),
            *(
                [
                    "",
                    f"#### Fixture `{res_mtp.fixture}` (mtp: its own MTP layer drafts)",
                    "",
                    distribution.to_markdown(res_mtp),
                ]
                if res_mtp is not None
                else []
            ),
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
        data={"dist": res, "dist_context": res_ctx, "dist_mtp": res_mtp},
        plots=[r.plot for r in results if r.plot is not None],
        status=status,
        summary=summary,
        error=error,
    )


__all__ = ["section"]
