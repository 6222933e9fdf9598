"""The audit's check section: are the logprobs of each audit server real?"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specaudit import check
from specaudit.audit.context import AuditContext, Section
from specaudit.check.rows import endpoint_rows
from specaudit.errors import SpecauditError
from specaudit.llama import presets
from specaudit.outcome import Outcome
from specaudit.report import md_table

# The servers the section covers: every endpoint for the fixture, chat for Gemma.
ROLES: tuple[str, ...] = ("fixture-plain", "fixture-spec", "gemma-plain", "gemma-spec")


def section(ctx: AuditContext, servers: Sequence[str] | None = None) -> Section:
    """Check each audit server: every endpoint for the fixture, chat for Gemma."""
    rows: list[tuple[Any, ...]] = []
    spec_rows: list[tuple[Any, ...]] = []
    data: dict[str, Any] = {}
    findings: list[str] = []
    errors: list[str] = []
    for name in servers or ROLES:
        model = presets.PRESETS[name].model
        fixture = model == "fixture"
        srv = ctx.server(name)
        try:
            res = check.run(
                srv.url,
                endpoint="all" if fixture else "chat",
                prompt=ctx.fixture.spec.prompt if fixture else check.DEFAULT_PROMPT,
                tokens=24,
                top_k=3,
                seed=1,
                temperature=1.0,
            )
        except SpecauditError as e:
            errors.append(f"{name}: {e}")
            rows.append((name, "-", "-", None, None, f"error: {e}"))
            data[name] = {"error": str(e)}
            continue
        data[name] = res
        rows.extend(
            (name, row.endpoint, row.stream, row.real, row.placeholder, row.verdict)
            for row in endpoint_rows(res)
        )
        sp = res.speculation
        spec_rows.append(
            (
                name,
                f"{sp.slots_speculative}/{sp.slots_total}" if sp.slots_total is not None else None,
                sp.props_types,
                sp.draft_n,
                sp.draft_n_accepted,
                res.switch.verdict if res.switch else "n/a",
                sp.summary,
            )
        )
        if res.placeholders:
            findings.append(f"{name} {res.placeholders}")
    md = [
        md_table(["server", "endpoint", "stream", "real", "placeholder", "verdict"], rows),
        "",
        md_table(
            [
                "server",
                "/slots speculative",
                "/props speculative.types",
                "draft_n",
                "accepted",
                "speculative.n_max 0",
                "speculation",
            ],
            spec_rows,
        ),
        "",
        "A token is *placeholder* when k=3 candidates were requested and none came back "
        "(logprob 0.0 / prob 1.0 non-streamed, no entry at all streamed).",
    ]
    error = None
    if errors:
        status = Outcome.NO_DECISION
        summary = error = "; ".join(errors)
    elif findings:
        status = Outcome.FINDING
        summary = "placeholder logprobs on " + ", ".join(findings)
    else:
        status = Outcome.OK
        summary = "every logprob real on every server"
    return Section(
        key="check",
        title="Check: are the logprobs real?",
        markdown="\n".join(md),
        data=data,
        status=status,
        summary=summary,
        error=error,
    )


__all__ = ["ROLES", "section"]
