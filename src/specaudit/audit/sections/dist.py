"""The audit's dist section: does speculation keep the sampling distribution?

The fixture through the audit's own llama-servers (no draft, draft) and through llama.cpp's
llama-speculative example, 1000 seeds each, as in the field report.
"""

from __future__ import annotations

from specaudit import dist
from specaudit.audit.context import AuditContext, Section
from specaudit.outcome import Outcome
from specaudit.stats import Verdict


def section(ctx: AuditContext) -> Section:
    """The audit's dist section: the fixture through llama-server (no draft, draft) and
    llama-speculative, 1000 seeds each, as in the field report."""
    fs = ctx.fixture
    wl = dist.make_workload(fs.spec)
    seed_list = list(range(1, 1001))
    results = []
    for role, label, kind in (
        ("fixture-plain", "llama-server, no draft", "server-plain"),
        ("fixture-spec", "llama-server + draft", "server-spec"),
    ):
        srv = ctx.server(role)
        ctx.progress(f"dist: {label}")
        eng = dist.ServerEngine(srv.url, fs.spec, wl, label=label, kind=kind)
        results.append(dist.measure(eng, fs.spec, wl, seed_list))
    ctx.progress("dist: llama-speculative")
    ex = dist.ExampleEngine(ctx.binaries().speculative, fs.target, fs.draft, fs.spec, wl)
    results.append(dist.measure(ex, fs.spec, wl, seed_list))
    res = dist.DistResult(
        fixture=fs.spec.name, fixture_dir=fs.dir, sha256=dict(fs.sha256), workload=wl,
        alpha=dist.DEFAULT_ALPHA, tolerance=dist.DEFAULT_TOLERANCE, sequential=False,
        engines=results,
    )  # fmt: skip
    res.plot = dist.plot_results(res, ctx.out_dir / "dist.png")
    broken = [e.engine for e in results if e.verdict is Verdict.BROKEN]
    summary = "; ".join(f"{e.engine} {e.verdict.value}" for e in results)
    return Section(
        key="dist",
        title="Distribution: does speculation keep the sampling distribution?",
        markdown=dist.to_markdown(res),
        data={"dist": res},
        plots=[res.plot],
        # FINDING when an engine is BROKEN; an INCONCLUSIVE engine is reported, not a finding
        status=Outcome.FINDING if broken else Outcome.OK,
        summary=summary,
    )


__all__ = ["section"]
