"""A re-scored run for people (Markdown, a PIT histogram) and machines (JSON).

Why apart from the runner: the audit and the CLI render the same result; the library returns
the typed result and never prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specaudit.report import md_table, to_jsonable
from specaudit.rescore.analysis import RescoreStats
from specaudit.rescore.certify import confidence_percent
from specaudit.rescore.draft_lr import DraftEvidence
from specaudit.rescore.engines import EngineRescoreResult
from specaudit.rescore.runner import RescoreResult


def to_json(res: RescoreResult) -> dict[str, Any]:
    """Everything but the per-token reference answers (which can be large): the samples'
    token ids are kept, so a partial run loses nothing it drew."""
    d = {
        "engine": res.engine,
        "path": res.path,
        "reference": res.reference,
        "identity": to_jsonable(res.identity),
        "prompts": res.prompts,
        "seeds": res.seeds,
        "tokens": res.tokens,
        "sampler": to_jsonable(res.sampler),
        "sampled_tokens": res.sampled_tokens,
        "rescored": res.rescored,
        "unreported": res.unreported,
        "boundary": res.boundary,
        "outside": _outside_json(res),
        "noise_tv": res.noise_tv,
        "noise_logprob": res.noise_logprob,
        "verdict": res.stats.verdict.value if res.stats else None,
        "outcome": res.outcome.value,
        "error": res.error,
        "drafted": res.drafted,
        "accepted": res.accepted,
        "probe_tv": res.probe_tv,
        "total_seconds": res.total_seconds,
        "reference_requests": res.reference_requests,
        "stats": to_jsonable(res.stats),
        "stopped_at": res.stopped_at,
        "coupling": to_jsonable(res.coupling),
        "batching": (
            {**to_jsonable(res.batching), "batched": res.batching.batched}
            if res.batching is not None
            else None
        ),
        "control": to_json(res.control) if res.control is not None else None,
        "arm": to_json(res.arm) if res.arm is not None else None,
        "notes": res.notes,
        "samples": [to_jsonable(s) for s in res.samples],
    }
    return d


def engines_json(res: EngineRescoreResult) -> dict[str, Any]:
    """A registry engines' run: one `to_json` per unit, the builds' notes, the outcome."""
    return {
        "fixture": res.fixture,
        "reference": res.reference,
        "outcome": res.outcome.value,
        "results": [to_json(r) for r in res.results],
        "notes": res.notes,
        "not_covered": [{"name": n, "why": w} for n, w in res.not_covered],
    }


def engines_markdown(res: EngineRescoreResult) -> str:
    """One section per unit (`markdown`), then the builds' notes and what is not covered."""
    parts = [f"fixture {res.fixture}, reference {res.reference} (plain llama-server)"]
    for r in res.results:
        title = r.engine + (f" (path {r.path})" if r.path else "")
        parts += ["", f"### {title}", "", markdown(r)]
    if res.notes:
        parts += [""] + [f"- {n}" for n in res.notes]
    if res.not_covered:
        parts += ["", "not covered:"] + [f"- {n}: {w}" for n, w in res.not_covered]
    return "\n".join(parts)


def rows(res: RescoreResult) -> list[tuple[Any, ...]]:
    s = res.stats
    return [
        ("engine", res.engine),
        ("reference", res.reference),
        ("verdict", s.verdict.value if s else f"no decision: {res.error}"),
        ("samples", f"{len(res.samples)} ({res.seeds} seeds x {len(res.prompts)} prompts)"),
        ("tokens re-scored", f"{res.rescored} of {res.sampled_tokens}"),
        ("tokens without a reported distribution", res.unreported),
        ("tokens outside the reference's top-k (count test)", _outside_cell(res)),
        (
            "reference's own spread (TV, raw logprob)",
            f"{res.noise_tv:.3g}, {res.noise_logprob:.3g}" if res.noise_tv is not None else None,
        ),
        ("drafted / accepted", f"{res.drafted} / {res.accepted}"),
        ("requests batched (/slots)", res.batching.summary() if res.batching else None),
        ("reference requests", res.reference_requests),
        ("favourite sampled / expected", f"{s.favourite_rate:.3f} / {s.favourite_expected:.3f}")
        if s
        else ("favourite", None),
        ("repeated prefixes tested", s.g_prefixes if s else None),
        ("impossible tokens (probability 0 in every batch shape)", s.impossible if s else None),
        ("PIT e-value (anytime-valid)", s.e_value if s else None),
        ("draft-aimed e-value", _draft_cell(s.draft) if s else None),
        ("tokens that would decide", s.needed if s and s.verdict.value == "INCONCLUSIVE" else None),
        ("control arm (the reference sampled at the same seeds)", _control_cell(res)),
        ("arm at another temperature (below)", _arm_cell(res)),
        ("same-seed coupling", res.coupling.summary() if res.coupling else None),
        (
            "stopped early (--sequential)",
            f"after {res.stopped_at} samples: the anytime evidence decided"
            if res.stopped_at
            else None,
        ),
        ("seconds", round(res.total_seconds, 1)),
    ]


def _control_cell(res: RescoreResult) -> str | None:
    c = res.control
    if c is None:
        return None
    if c.stats is None:
        return f"no decision: {c.error}"
    return (
        f"{c.stats.verdict.value} ({c.rescored} tokens, {_outside_cell(c)}, "
        f"KS p = {c.stats.ks_p:.3g})"
    )


def _arm_cell(res: RescoreResult) -> str | None:
    a = res.arm
    if a is None:
        return None
    verdict = a.stats.verdict.value if a.stats else f"no decision: {a.error}"
    return (
        f"T = {a.sampler.temperature:g}: {verdict} ({a.rescored} tokens); both arms at "
        f"alpha / 2, together {_together(res)}"
    )


def _together(res: RescoreResult) -> str:
    """Both arms' outcome in the verdicts' words."""
    return {"ok": "not broken", "finding": "BROKEN", "no decision": "no decision"}[
        res.outcome.value
    ]


def _outside_cell(res: RescoreResult) -> str | None:
    """Observed against the reference's own rate, and the count test's p-value."""
    o = res.stats.outside if res.stats else None
    if o is None:
        return None
    if res.edge is None:
        return f"{o.outside} outside, none expected (no leak measured), p = {o.p_value:.3g}"
    return (
        f"{o.outside} outside ({res.boundary} at the edge, {o.far} impossible); expected under "
        f"the reference's noise at most {o.expected:.3g} (measured {o.estimate:.3g} at "
        f"{len(res.edge.leaks)} prefixes), p = {o.p_value:.3g}"
    )


def _outside_json(res: RescoreResult) -> dict[str, Any] | None:
    o = res.stats.outside if res.stats else None
    if o is None:
        return None
    return {
        "count": o.outside, "at_edge": res.boundary, "impossible": o.far,
        "expected_bound": o.expected, "expected_measured": o.estimate, "p_value": o.p_value,
        "delta": o.delta, "leak_units": list(res.edge.leaks) if res.edge else None,
    }  # fmt: skip


def _draft_cell(d: DraftEvidence | None) -> str:
    if d is None:
        return "no draft distribution (give --draft-url or --draft-model)"
    likely = f", most evidence {d.best_bug}" if d.best_bug else ""
    return f"{d.e_value:.3g} over {d.used} tokens{likely}"


def tests_table(s: RescoreStats) -> str:
    """The family Holm decides over: every test the verdict accounts for, raw and adjusted."""
    shown = [t for t in s.tests if not t.name.startswith("prefix ")]
    prefixes = [t for t in s.tests if t.name.startswith("prefix ")]
    rows_ = [
        (t.name, f"{t.p_value:.3g}", f"{t.adjusted:.3g}", "yes" if t.rejects else "") for t in shown
    ]
    if prefixes:
        worst = min(prefixes, key=lambda t: t.adjusted)
        rows_.append(
            (
                f"{len(prefixes)} repeated prefixes (smallest shown)",
                f"{worst.p_value:.3g}",
                f"{worst.adjusted:.3g}",
                str(sum(t.rejects for t in prefixes)) if any(t.rejects for t in prefixes) else "",
            )
        )
    return md_table(("test", "p", "Holm-adjusted", "rejects"), rows_)


def bounds_table(s: RescoreStats) -> str:
    """The certificate: each bound against the tolerance."""
    cert = s.certificate
    if cert is None:
        return ""
    return md_table(
        (
            "bound",
            "estimate",
            f"upper ({confidence_percent(cert.confidence)} jointly)",
            "tolerance",
            "within",
            "tokens to decide",
        ),
        [
            (
                b.what,
                f"{b.estimate:.3g}",
                f"{b.upper:.3g}",
                f"{b.tolerance:.3g}",
                "yes" if b.within else "no",
                b.needed if not b.within else "",
            )
            for b in cert.bounds
        ],
    )


def markdown(res: RescoreResult) -> str:
    lines = [md_table(("", ""), rows(res))]
    if res.stats:
        lines += ["", tests_table(res.stats), "", bounds_table(res.stats)]
        lines += ["", f"**{res.stats.verdict.value}**: {res.stats.reason}.", ""]
        lines.append(f"What it certifies: {res.stats.certifies}.")
    if res.notes:
        lines += [""] + [f"- {n}" for n in res.notes]
    if res.error:
        lines += ["", f"error: {res.error}"]
    if res.arm is not None:
        t = res.arm.sampler.temperature
        lines += ["", f"#### The arm at temperature {t:g}", "", markdown(res.arm)]
        lines += ["", f"Both arms together (each at alpha / 2): **{_together(res)}**."]
    return "\n".join(lines)


def plot_pit(res: RescoreResult, path: Path, title: str | None = None) -> Path:
    """A histogram of the PIT values against the flat line they must follow: a bar at the
    left is the draft's favourite sampled too often."""
    from specaudit import plots

    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    u = res.stats.u if res.stats else []
    bins = 20
    ax.hist(u, bins=bins, range=(0, 1), color=plots.SPEC_COLOR, edgecolor="white")
    if u:
        ax.axhline(len(u) / bins, color=plots.PLAIN_COLOR, linestyle="--", label="uniform")
        ax.legend(loc="upper right")
    verdict = res.stats.verdict.value if res.stats else "no decision"
    ax.set_title(title or f"{res.engine}: {verdict}", fontsize=10)
    ax.set_xlabel("PIT value u (left: the draft's favourite token)")
    ax.set_ylabel("tokens")
    return plots.save(fig, path)


__all__ = [
    "bounds_table",
    "engines_json",
    "engines_markdown",
    "markdown",
    "plot_pit",
    "rows",
    "tests_table",
    "to_json",
]
