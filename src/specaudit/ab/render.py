"""`specaudit.ab`'s rendering, shared by the CLI and the audit: the report-shaped table, the
detail rows, the Δ and side lines, Markdown, and the plot (`draw`; matplotlib is imported only
when it runs, through `specaudit.plots`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specaudit.ab.analysis import (
    CONFIDENCE,
    SIDES,
    ABResult,
    ABVerdict,
    Delta,
    SideSummary,
    fmt,
)
from specaudit.client import ENDPOINTS


def report_shape_rows(result: ABResult) -> list[list[Any]]:
    """The field report's table: one row per side, naive mean per seed, then the mean."""
    rows: list[list[Any]] = []
    for side in SIDES:
        by = result.by_seed(side)
        s = result.side(side)
        label = "no speculation" if side == "plain" else "speculating"
        rows.append(
            [label]
            + [fmt(by[k].naive_mean) if k in by else "-" for k in result.settings.seed_values]
            + [fmt(s.naive_mean), f"{s.coverage:.1%}"]
        )
    return rows


def report_shape_headers(result: ABResult) -> list[str]:
    return (
        ["side"] + [f"seed {k}" for k in result.settings.seed_values] + ["mean (naive)", "coverage"]
    )


DETAIL_HEADERS = [
    "seed",
    "side",
    "naive mean",
    "real-only mean",
    "coverage",
    "real",
    "placeholders",
    "draft_n",
    "accepted",
]


def _ci(ci: tuple[float, float] | None, sep: str = " ") -> str:
    return "" if ci is None else f"{sep}[{ci[0]:.4f}, {ci[1]:.4f}]"


def detail_rows(result: ABResult, ci_sep: str = " ") -> list[list[Any]]:
    """Per seed and side, then a summary row per side (means with their t-intervals)."""
    rows: list[list[Any]] = []
    for r in result.responses:
        rows.append(
            [
                r.seed,
                r.side,
                fmt(r.naive_mean),
                fmt(r.real_mean),
                f"{r.coverage:.1%}",
                f"{r.real}/{r.tokens}",
                r.placeholder,
                "-" if r.draft_n is None else r.draft_n,
                "-" if r.draft_n_accepted is None else r.draft_n_accepted,
            ]
        )
    for side in SIDES:
        s = result.side(side)
        rows.append(
            [
                "all",
                side,
                fmt(s.naive_mean) + _ci(s.naive_ci, ci_sep),
                fmt(s.real_mean) + _ci(s.real_ci, ci_sep),
                f"{s.coverage:.1%}",
                f"{s.real}/{s.tokens}",
                s.placeholder,
                "-" if s.draft_n is None else s.draft_n,
                "-" if s.draft_n_accepted is None else s.draft_n_accepted,
            ]
        )
    return rows


def delta_line(d: Delta, confidence: float = CONFIDENCE) -> str:
    if d.mean is None:
        return f"Δ {d.name}: n/a (no seed with values on both sides)"
    ci = (
        f", {confidence:.0%} CI [{d.ci_low:+.4f}, {d.ci_high:+.4f}]"
        if d.ci_low is not None and d.ci_high is not None
        else ", no CI (1 seed)"
    )
    p = f", paired t-test p = {d.p_value:.3g}" if d.p_value is not None else ""
    return f"Δ {d.name}: {d.mean:+.4f}{ci} over {d.n} seeds{p}"


def side_line(s: SideSummary) -> str:
    said = {True: "speculates", False: "does not speculate", None: "unknown (no /slots)"}
    return f"{s.side} ({s.url}): /slots says it {said[s.speculative]}; {s.slots} slots used"


def markdown(result: ABResult, title: str | None = None) -> str:
    """The result as Markdown: report-shaped table, detail table, Δs and the verdict."""
    from specaudit.report import md_table

    st = result.settings
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines += [
        f"{st.seeds} seeds × {st.tokens} tokens, temperature {st.temperature:g}, "
        f"endpoint `{ENDPOINTS[st.endpoint]}`, {st.top_logprobs} candidates requested, "
        f"prompt {st.prompt!r}.",
        "",
        md_table(report_shape_headers(result), report_shape_rows(result)),
        "",
        md_table(DETAIL_HEADERS, detail_rows(result)),
        "",
        *[f"- {side_line(result.side(side))}" for side in SIDES],
        "- " + delta_line(result.delta_naive, st.confidence),
        "- " + delta_line(result.delta_real, st.confidence),
        "",
        f"**Verdict: {result.verdict.message}.**",
    ]
    if result.verdict.reasons:
        lines += [""] + [f"- {r}" for r in result.verdict.reasons]
    if result.plot is not None:
        lines += ["", f"Plot: `{result.plot}`"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# plot


def draw(result: ABResult, path: str | Path) -> Path:
    """A PNG a person reads at a glance: traces with placeholders marked, per-seed means."""
    import textwrap

    from specaudit import plots

    plt = plots.pyplot()
    colors = {"plain": plots.PLAIN_COLOR, "spec": plots.SPEC_COLOR}
    fig = plt.figure(figsize=(12, 8.2))
    gs = fig.add_gridspec(2, 3, height_ratios=[1.25, 1], hspace=0.42, wspace=0.32)
    ax_tr = fig.add_subplot(gs[0, :])
    ax_means = fig.add_subplot(gs[1, :2])
    ax_cov = fig.add_subplot(gs[1, 2])

    # 1. per-token traces, as reported: placeholders are the red x's sitting at 0.0
    marked = False
    for r in result.responses:
        xs = list(range(len(r.reported_logprobs)))
        ys = [v if v is not None else 0.0 for v in r.reported_logprobs]
        ax_tr.plot(xs, ys, color=colors[r.side], lw=1.1, alpha=0.55)
        ph = [(x, y) for x, y, real in zip(xs, ys, r.real_logprobs, strict=True) if real is None]
        if ph:
            px, py = zip(*ph, strict=True)
            ax_tr.scatter(
                px,
                py,
                marker="x",
                s=22,
                color=plots.MISSING_COLOR,
                linewidths=1.0,
                zorder=3,
                label=None if marked else "placeholder (0.0 sent, no candidates)",
            )
            marked = True
    for side in SIDES:
        s = result.side(side)
        ax_tr.plot([], [], color=colors[side], lw=2, label=f"{side}: {s.responses} responses")
    ax_tr.axhline(0.0, color="black", lw=0.6)
    ax_tr.set_title("Per-token logprob as the server reported it (all seeds overlaid)")
    ax_tr.set_xlabel("token index in response")
    ax_tr.set_ylabel("logprob (nats)")
    ax_tr.legend(loc="lower right", fontsize=9, framealpha=0.9)
    ax_tr.grid(alpha=0.3)

    # 2. per-seed means: filled = naive (what a client computes), hollow = real tokens only
    seeds = result.settings.seed_values
    offs = {"plain": -0.12, "spec": 0.12}
    for side in SIDES:
        by = result.by_seed(side)
        ks = [k for k in seeds if k in by]
        xs_n = [k + offs[side] for k in ks if by[k].naive_mean is not None]
        ys_n = [by[k].naive_mean for k in ks if by[k].naive_mean is not None]
        xs_r = [k + offs[side] for k in ks if by[k].real_mean is not None]
        ys_r = [by[k].real_mean for k in ks if by[k].real_mean is not None]
        ax_means.scatter(
            xs_n, ys_n, s=60, color=colors[side], label=f"{side}: naive mean", zorder=3
        )
        ax_means.scatter(
            xs_r,
            ys_r,
            s=150,
            facecolors="none",
            edgecolors=colors[side],
            linewidths=1.5,
            label=f"{side}: real tokens only",
            zorder=3,
        )
        for k in ks:  # a real-only mean over a handful of tokens says so
            rr = by[k]
            if rr.real_mean is not None and rr.real < rr.tokens:
                ax_means.annotate(
                    f"{rr.real} tok",
                    (k + offs[side], rr.real_mean),
                    xytext=(9, -3),
                    textcoords="offset points",
                    fontsize=8,
                    color=colors[side],
                )
        m = result.side(side).naive_mean
        if m is not None:
            ax_means.axhline(m, color=colors[side], ls="--", lw=1, alpha=0.8)
    ax_means.axhline(0.0, color="black", lw=0.6)
    ax_means.set_xticks(seeds)
    ax_means.set_xlim(seeds[0] - 0.6, seeds[-1] + 0.75)  # room for the "n tok" labels
    ax_means.set_xlabel("seed")
    ax_means.set_ylabel("mean logprob per token")
    ax_means.set_title("Per-seed means (dashed: mean over seeds of the naive means)")
    ax_means.legend(fontsize=8, loc="best", framealpha=0.9)
    ax_means.grid(alpha=0.3)

    # 3. coverage: real vs placeholder tokens per side
    reals = [result.side(n).real for n in SIDES]
    phs = [result.side(n).placeholder for n in SIDES]
    ax_cov.bar(list(SIDES), reals, color=[colors[n] for n in SIDES], label="real")
    ax_cov.bar(
        list(SIDES), phs, bottom=reals, color=plots.MISSING_COLOR, alpha=0.75, label="placeholder"
    )
    for i, name in enumerate(SIDES):
        sm = result.side(name)
        ax_cov.text(i, sm.tokens, f"{sm.coverage:.1%} real", ha="center", va="bottom", fontsize=10)
    ax_cov.set_ylim(0, max(1, max(result.side(n).tokens for n in SIDES)) * 1.4)
    ax_cov.set_ylabel("tokens")
    ax_cov.set_title("Coverage: real vs placeholder tokens")
    ax_cov.legend(fontsize=8, loc="upper center", ncol=2)

    st = result.settings
    head = (
        f"specaudit ab: {st.seeds} seeds × {st.tokens} tokens, T={st.temperature:g}, "
        f"{ENDPOINTS[st.endpoint]}"
    )
    verdict = textwrap.fill(result.verdict.message, 125)
    vcolor = {
        ABVerdict.INSTRUMENT_FAULT: plots.MISSING_COLOR,
        ABVerdict.CONSISTENT: "#2ca02c",
    }.get(result.verdict.kind, "#555555")
    fig.text(0.5, 0.995, head, ha="center", va="top", fontsize=12, weight="bold")
    fig.text(0.5, 0.962, verdict, ha="center", va="top", fontsize=10, color=vcolor)
    fig.subplots_adjust(top=0.86)
    return plots.save(fig, path)


__all__ = [
    "DETAIL_HEADERS",
    "delta_line",
    "detail_rows",
    "draw",
    "markdown",
    "report_shape_headers",
    "report_shape_rows",
    "side_line",
]
