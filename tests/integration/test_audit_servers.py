"""`specaudit audit`'s server table, in-process on the session servers and end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specaudit import audit
from specaudit.audit.sections import servers


def test_servers_section_reports_hidden_speculation(audit_ctx: audit.AuditContext) -> None:
    sec = servers.section(audit_ctx)
    rows = {r["name"]: r for r in sec.data["servers"]}
    assert rows["fixture-spec"]["verdict"].startswith("hidden")
    assert rows["gemma-spec"]["verdict"].startswith("hidden")
    assert rows["fixture-plain"]["verdict"] == "does not speculate"
    assert rows["gemma-plain"]["verdict"] == "does not speculate"
    assert sec.status == "finding"
    assert "| fixture-spec |" in sec.markdown


def test_audit_cli_writes_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    env = dict(os.environ)
    r = subprocess.run(
        [sys.executable, "-m", "specaudit", "audit", "--only", "servers", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    md = (out / "report.md").read_text()
    assert "/slots speculative" in md and "gemma-spec" in md
    data = json.loads((out / "report.json").read_text())
    (sec,) = data["sections"]
    assert sec["key"] == "servers" and sec["status"] == "finding"
    assert "fixture-spec" in r.stdout
