"""`specaudit audit`'s server table, in-process on the session servers and end to end."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from specaudit import audit
from specaudit.audit.sections import servers

CliFn = Callable[..., tuple[int, str, str]]


@pytest.mark.gemma
def test_servers_section_reports_hidden_speculation(audit_ctx: audit.AuditContext) -> None:
    sec = servers.section(audit_ctx)
    rows = {r["name"]: r for r in sec.data["servers"]}
    assert rows["fixture-spec"]["verdict"].startswith("hidden")
    assert rows["gemma-spec"]["verdict"].startswith("hidden")
    assert rows["fixture-plain"]["verdict"] == "does not speculate"
    assert rows["gemma-plain"]["verdict"] == "does not speculate"
    assert sec.status == "finding"
    assert "| fixture-spec |" in sec.markdown


@pytest.mark.gemma
def test_audit_cli_writes_report(tmp_path: Path, cli: CliFn) -> None:
    out = tmp_path / "report"
    code, stdout, err = cli("audit", "--only", "servers", "--out", str(out))
    assert code == 0, err[-2000:]
    md = (out / "report.md").read_text()
    assert "/slots speculative" in md and "gemma-spec" in md
    data = json.loads((out / "report.json").read_text())
    (sec,) = data["sections"]
    assert sec["key"] == "servers" and sec["status"] == "finding"
    assert "fixture-spec" in stdout
