"""Rendering: table rows for the CLI, Markdown for reports, and the expected-vs-observed plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from specaudit.distribution.coverage import counts_consistent, rejected
from specaudit.distribution.results import ContextResult, DistResult, EngineResult, TestResult
from specaudit.stats import GofResult, Verdict

#: Verdict colours in plots (and for anyone drawing them): a pass green, WITHIN TOLERANCE a
#: lighter green (certified within the tolerance, not more), BROKEN red, INCONCLUSIVE orange.
VERDICT_COLORS = {
    Verdict.PRESERVED: "tab:green",
    Verdict.WITHIN_TOLERANCE: "yellowgreen",
    Verdict.BROKEN: "tab:red",
    Verdict.INCONCLUSIVE: "tab:orange",
}


def tokens_cell(ctx: ContextResult) -> str:
    """'e .330 (.345)  g .452 (.452) ...': observed frequency (expected probability)."""
    return "  ".join(f"{r.token} {r.frequency:.3f} ({r.expected:.3f})" for r in ctx.tokens)


def test_rows(e: EngineResult) -> list[tuple[Any, ...]]:
    """One row per test: the G (or, for the draft direction, z) statistic, p-values, the
    descriptive TV interval (a position's marginal, the joint's), and the certified one-sided
    bound the verdict uses (a position's prefix-averaged next-token TV, the joint's TV)."""
    return [
        (
            x.name,
            x.n,
            x.contexts,
            x.gof.method,
            _fmt_stat(x.gof.statistic),
            x.gof.df,
            fmt_gof_p(x.gof),
            fmt_p(x.p_holm),
            _tv_cell(x),
            _bound_cell(x, e),
            "reject" if x.rejected else "-",
        )
        for x in e.tests
    ]


def _tv_cell(x: TestResult) -> str:
    if x.kind in ("history", "seeds"):
        return "-"  # a test of independence: no TV of its own
    if x.kind == "directed":
        if x.gof.method == "impossible":
            return "-"
        return f"toward draft ~{x.tv.estimate:.3f}"
    return f"{x.tv.estimate:.3f} [{x.tv.lower:.3f}, {x.tv.upper:.3f}]"


def _bound_cell(x: TestResult, e: EngineResult) -> str:
    if x.kind == "directed":
        return power_cell(e)
    b = x.tv_bound
    if b is None:
        return "-"
    mark = "" if b.upper <= e.tolerance else " (> tol)"
    return f"{b.estimate:.3f}, <= {b.upper:.3f}{mark}"


def power_cell(e: EngineResult) -> str:
    """'80% power from TV 0.031': the smallest draft leakage the directed test sees."""
    d = e.directed
    if d is None:
        return "-"
    if d.tv is None:
        return f"{d.power:.0%} power not reached even at the draft itself"
    return f"{d.power:.0%} power from TV {d.tv:.3f}"


TEST_HEADERS = (
    "test", "n", "contexts", "method", "G / z", "df", "p", "p (Holm)", "TV [CI]",
    "certified TV (est, bound)", "",
)  # fmt: skip
CONTEXT_HEADERS = ("pos", "context", "n", "observed (expected)", "p", "TV [CI]")


def context_rows(e: EngineResult) -> list[tuple[Any, ...]]:
    return [
        (
            c.position,
            c.label,
            c.n,
            tokens_cell(c),
            fmt_gof_p(c.gof),
            f"{c.tv.estimate:.3f} [{c.tv.lower:.3f}, {c.tv.upper:.3f}]",
        )
        for c in e.headline
    ]


def fmt_p(p: float) -> str:
    if p == 0:
        return "0"  # only for impossible outcomes: certainty
    if p < 1e-300:
        return "<1e-300"
    return f"{p:.3g}" if p >= 1e-4 else f"{p:.1e}"


def fmt_gof_p(g: GofResult) -> str:
    """A test's p-value for people: like `fmt_p`, but a p-value below floating point that the
    test knows in log space is printed as its power of ten ('~1e-1381'), never as 0."""
    if g.p_value < 1e-300 and g.p_value > 0 and g.log10_p is not None:
        return f"~1e{math.floor(g.log10_p):d}"
    return fmt_p(g.p_value)


def p_eq(p: float) -> str:
    """'= 0.0424' or '< 1e-300', for sentences."""
    f = fmt_p(p)
    return f"< {f[1:]}" if f.startswith("<") else f"= {f}"


def _fmt_stat(g: float) -> str:
    return "inf" if math.isinf(g) else f"{g:.2f}"


def draft_cell(e: EngineResult) -> str:
    if e.drafted is None:
        return "-"
    if not counts_consistent(e):
        return (
            f"{e.drafted} drafted, {e.accepted} accepted (the engine's counters are "
            "inconsistent: more accepted than drafted)"
        )
    n = rejected(e)
    return f"{e.drafted} drafted, {e.accepted} accepted" + (
        f", {n} rejected" if n is not None else ""
    )


def evidence_cell(e: EngineResult) -> str:
    """The number the verdict rests on: e-value (sequential) or smallest Holm p (fixed)."""
    if e.sequential is not None:
        q = e.sequential
        if q.decided_by == "fixed-look" and q.look_level is not None:
            return f"fixed tests reject at look level {q.look_level:.2g}"
        ev = math.exp(q.log_e_value) if q.log_e_value < 700 else math.inf
        return f"e = {ev:.3g} (reject at {q.e_threshold:g})"
    return f"min p (Holm) {p_eq(min((x.p_holm for x in e.tests), default=1.0))}"


def evidence_lines(e: EngineResult, prompt: str) -> list[str]:
    """The forbidden tokens seen, one line each: seed, position, context, token."""
    out = []
    for x in e.evidence:
        after = f"{prompt}+{x.prefix}" if x.prefix else prompt
        what = "output ended" if x.token == "<end>" else f"token {x.token}"
        more = f" ({x.count} samples)" if x.count > 1 else ""
        out.append(f"seed {x.seed}: {what} at position {x.position} after {after}{more}")
    return out


def detail_lines(e: EngineResult, prompt: str) -> list[str]:
    """What the verdict rests on besides the tables: the directed test's power at this N,
    the certified bound, samples needed, the evidence."""
    lines = []
    d = e.directed
    if d is not None:
        if d.tv is not None and d.lambda_ is not None:
            lines.append(
                f"Draft-direction test: {d.power:.0%} power (at level {d.level:.2g}, n = {d.n}) "
                f"against leakage toward the draft from a prefix-averaged next-token TV of "
                f"{d.tv:.3f} (lambda = {d.lambda_:.3f})."
            )
        else:
            lines.append(
                f"Draft-direction test: not {d.power:.0%} power even against the draft itself "
                f"at n = {d.n}."
            )
    g = e.power
    if g is not None:

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.3f}"

        lines.append(
            f"Any deviation: {g.power:.0%} power (each test at level {g.level:.2g}, n = {g.n}, "
            f"noncentral chi-square) from a prefix-averaged next-token TV of "
            f"{', '.join(f(x) for x in g.tv_by_position)} at positions 1-"
            f"{len(g.tv_by_position)}"
            + (f", a joint TV of {f(g.tv_joint)}" if g.tv_joint is not None else "")
            + f", a TV of the whole tested sequence of {f(g.tv_sequence)}, in any direction."
        )
    if e.sequence_tv_bound is not None:
        lines.append(
            f"Whole tested sequence: TV <= {e.sequence_tv_bound:.3f} (one-sided, at "
            f"{1 - e.alpha:.4g})."
        )
    if e.tv_bound is not None:
        lines.append(
            f"Certified TV (largest one-sided bound, positions and joint): {e.tv_bound:.3f}, "
            f"tolerance {e.tolerance:g}."
        )
    if e.samples_needed is not None:
        lines.append(f"About {e.samples_needed} samples would bring every bound within it.")
    ev = evidence_lines(e, prompt)
    if ev:
        lines.append("Tokens with probability 0: " + "; ".join(ev) + ".")
    return lines


def summary_rows(res: DistResult) -> list[tuple[Any, ...]]:
    return [
        (
            e.engine,
            e.path or "-",
            e.verdict.value,
            e.n_samples,
            draft_cell(e),
            evidence_cell(e),
            e.reason,
        )
        for e in res.engines
    ]


SUMMARY_HEADERS = ("engine", "path", "verdict", "samples", "drafted/accepted", "evidence", "why")


def to_markdown(res: DistResult) -> str:
    from specaudit.report import md_table

    wl = res.workload
    s = wl.sampler
    lines = [
        f"Fixture `{res.fixture}`, prompt `{wl.prompt}`, {wl.tokens} tokens per sample, "
        f"top-k {s.top_k}, top-p {s.top_p:g}, min-p {s.min_p:g}, temperature {s.temperature:g}; "
        f"alpha {res.alpha:g}, TV tolerance {res.tolerance:g}"
        + ("; sequential (anytime-valid)" if res.sequential else "")
        + ". Expected values come from the fixture's definition (closed form).",
        "",
        md_table(SUMMARY_HEADERS, summary_rows(res)),
    ]
    for e in res.engines:
        lines += [
            "",
            f"**{e.engine}**: {e.verdict.value}. Seeds {e.first_seed}..{e.last_seed}"
            + (f", {draft_cell(e)}" if e.drafted is not None else "")
            + f", {e.samples_per_s:.0f} samples/s.",
            "",
            md_table(CONTEXT_HEADERS, context_rows(e)),
            "",
            md_table(TEST_HEADERS, test_rows(e)),
        ]
        details = detail_lines(e, wl.prompt)
        if details:
            lines += ["", " ".join(details)]
        if e.sequential is not None:
            q = e.sequential
            lines += [
                "",
                f"Sequential: decided by {q.decided_by} after {q.samples_used} samples "
                f"({q.samples_drawn} drawn), log e-value {q.log_e_value:.2f} "
                f"(threshold log {math.log(q.e_threshold):.2f}).",
            ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# plot


def plot_results(res: DistResult, path: Path) -> Path:
    """Expected vs observed probability per token, with 95% CIs; one column per engine, one row
    per position (its most likely context)."""
    from specaudit import plots

    plt = plots.pyplot()
    engines = res.engines
    rows = max((len(e.headline) for e in engines), default=1) or 1
    fig, axes = plt.subplots(
        rows, max(len(engines), 1), figsize=(4.2 * max(len(engines), 1), 2.9 * rows),
        squeeze=False, sharey=True,
    )  # fmt: skip
    colors = VERDICT_COLORS
    for j, e in enumerate(engines):
        for i in range(rows):
            ax = axes[i][j]
            if i >= len(e.headline):
                ax.axis("off")
                ax.text(0.5, 0.5, "no sample reached the target's\nmost likely context here",
                        ha="center", va="center", fontsize=8, transform=ax.transAxes)  # fmt: skip
                continue
            c = e.headline[i]
            x = np.arange(len(c.tokens))
            exp = [r.expected for r in c.tokens]
            obs = [r.frequency for r in c.tokens]
            err = [
                [max(0.0, r.frequency - r.ci_low) for r in c.tokens],
                [max(0.0, r.ci_high - r.frequency) for r in c.tokens],
            ]
            ax.bar(x - 0.18, exp, width=0.36, color="lightgray", edgecolor="black",
                   label="expected (closed form)")  # fmt: skip
            bad = [r.expected == 0 and r.observed > 0 for r in c.tokens]
            ax.bar(x + 0.18, obs, width=0.36, yerr=err, capsize=3,
                   color=["tab:red" if b else "tab:blue" for b in bad],
                   label="observed, 95% CI")  # fmt: skip
            ax.set_xticks(x, [r.token for r in c.tokens])
            ax.set_ylim(0, 1.05)
            ax.set_title(
                f"pos {c.position} after {c.label}\nn={c.n}, p={fmt_p(c.gof.p_value)}",
                fontsize=8,
            )
            if j == 0:
                ax.set_ylabel("probability")
            if i == 0:
                ax.text(
                    0.5, 1.32, f"{e.engine}: {e.verdict.value}", transform=ax.transAxes,
                    ha="center", fontsize=10, fontweight="bold", color=colors[e.verdict],
                )  # fmt: skip
            if i == 0 and j == 0:
                ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(
        f"specaudit dist: fixture {res.fixture}, prompt {res.workload.prompt}, alpha {res.alpha:g}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return plots.save(fig, path)


__all__ = [
    "CONTEXT_HEADERS",
    "SUMMARY_HEADERS",
    "TEST_HEADERS",
    "VERDICT_COLORS",
    "context_rows",
    "detail_lines",
    "draft_cell",
    "evidence_cell",
    "evidence_lines",
    "fmt_gof_p",
    "fmt_p",
    "p_eq",
    "plot_results",
    "power_cell",
    "summary_rows",
    "test_rows",
    "to_markdown",
    "tokens_cell",
]
