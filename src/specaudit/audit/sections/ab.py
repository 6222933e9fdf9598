"""The audit's `ab` section: the report's aggregate table on Gemma 3 270M and on the fixture,
plain vs draft-simple, with plots."""

from __future__ import annotations

from specaudit import ab
from specaudit.audit.context import AuditContext, Section
from specaudit.outcome import Outcome
from specaudit.report import md_table, to_jsonable

FIXTURE_PROMPT_FALLBACK = "bcdbc"


def _runs(ctx: AuditContext, seeds: int, tokens: int) -> list[tuple[str, ab.ABResult]]:
    out: list[tuple[str, ab.ABResult]] = []
    configs = [
        ("Gemma 3 270M", "gemma", ab.DEFAULT_PROMPT),
        ("fixture", "fixture", getattr(getattr(ctx.fixture, "spec", None), "prompt", None)),
    ]
    for label, key, prompt in configs:
        ctx.progress(f"ab: {label}")
        plain = ctx.server(f"{key}-plain")
        spec = ctx.server(f"{key}-spec")
        settings = ab.Settings(seeds=seeds, tokens=tokens, prompt=prompt or FIXTURE_PROMPT_FALLBACK)
        res = ab.run(plain.url, spec.url, settings, plot=ctx.out_dir / f"ab-{key}.png")
        out.append((label, res))
    return out


def _ci_pair(d: ab.Delta) -> str:
    if d.ci_low is None or d.ci_high is None:
        return ""
    return f" [{d.ci_low:+.4f}, {d.ci_high:+.4f}]"


def section(
    ctx: AuditContext, *, seeds: int = ab.DEFAULT_SEEDS, tokens: int = ab.DEFAULT_TOKENS
) -> Section:
    """The report's aggregate table on Gemma 3 270M and on the fixture, with plots.

    `seeds` and `tokens` default to the CLI's; tests pass smaller ones for a short run."""
    fmt = ab.fmt
    runs = _runs(ctx, seeds, tokens)
    summary_rows = []
    for label, r in runs:
        summary_rows.append(
            [
                label,
                fmt(r.plain.naive_mean),
                fmt(r.spec.naive_mean),
                f"{r.plain.coverage:.1%}",
                f"{r.spec.coverage:.1%}",
                f"{r.delta_naive.mean:+.4f}{_ci_pair(r.delta_naive)}"
                if r.delta_naive.mean is not None
                else "n/a",
                r.verdict.kind.value,
            ]
        )
    md = [
        "Same prompt and seeds on a plain and a speculating server; naive = what a client "
        "that averages the logprobs it got computes (placeholders count as 0.0).",
        "",
        md_table(
            [
                "model",
                "plain naive mean",
                "spec naive mean",
                "plain coverage",
                "spec coverage",
                "Δ naive (spec − plain), 95% CI",
                "verdict",
            ],
            summary_rows,
        ),
    ]
    for label, r in runs:
        md += ["", ab.markdown(r, title=label)]
    faults = [label for label, r in runs if r.verdict.kind is ab.ABVerdict.INSTRUMENT_FAULT]
    summary = "; ".join(
        f"{label}: {r.verdict.kind.value} (naive {fmt(r.plain.naive_mean)} plain vs "
        f"{fmt(r.spec.naive_mean)} spec, spec coverage {r.spec.coverage:.0%})"
        for label, r in runs
    )
    return Section(
        key="ab",
        title="Aggregates: what placeholders do to a mean logprob (speculative vs plain)",
        markdown="\n".join(md),
        data={label: to_jsonable(r) for label, r in runs},
        plots=[r.plot for _, r in runs if r.plot is not None],
        status=Outcome.FINDING if faults else Outcome.OK,
        summary=summary,
    )


__all__ = ["section"]
