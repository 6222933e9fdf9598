"""The audit's first section: what /slots and /props say about each server's speculation."""

from __future__ import annotations

from dataclasses import dataclass

from specaudit import speculation
from specaudit.audit.context import AuditContext, Section
from specaudit.client import Client
from specaudit.llama.server import LlamaServer
from specaudit.outcome import Outcome
from specaudit.report import md_table

ROLES = ("fixture-plain", "fixture-spec", "gemma-plain", "gemma-spec")


@dataclass
class ServerRow:
    name: str
    model: str
    draft: str | None
    spec_type: str | None
    binaries: str
    slots_total: int | None
    slots_speculative: int | None
    props_spec_types: str | None
    verdict: str


def describe_server(name: str, srv: LlamaServer) -> ServerRow:
    """What /slots and /props say about whether `srv` speculates."""
    with Client(srv.url, timeout=30) as c:
        info = speculation.read(c)
    return ServerRow(
        name=name,
        model=srv.model.name,
        draft=srv.draft.name if srv.draft else None,
        spec_type=srv.spec_type,
        binaries=srv.binaries.label,
        slots_total=info.slots_total,
        slots_speculative=info.slots_speculative,
        props_spec_types=info.props_types,
        verdict=info.describe(),
    )


def section(ctx: AuditContext) -> Section:
    rows = [describe_server(n, ctx.server(n)) for n in ROLES]
    headers = [
        "server",
        "model",
        "draft",
        "--spec-type",
        "/slots speculative",
        "/props speculative.types",
        "verdict",
    ]
    md = [
        md_table(
            headers,
            [
                (
                    r.name,
                    r.model,
                    r.draft,
                    r.spec_type,
                    f"{r.slots_speculative}/{r.slots_total}",
                    r.props_spec_types,
                    r.verdict,
                )
                for r in rows
            ],
        )
    ]
    hidden = [r for r in rows if r.verdict.startswith("hidden")]
    md.append("")
    md.append(
        f"{len(hidden)} of {len(rows)} servers speculate while /props claims they don't; "
        "read /slots, not /props."
        if hidden
        else "No server hides its speculation."
    )
    return Section(
        key="servers",
        title="Servers: does /props tell the truth about speculation?",
        markdown="\n".join(md),
        data={"servers": [r.__dict__ for r in rows]},
        status=Outcome.FINDING if hidden else Outcome.OK,
        summary=f"{len(hidden)}/{len(rows)} servers hide that they speculate",
    )


__all__ = ["ROLES", "ServerRow", "describe_server", "section"]
