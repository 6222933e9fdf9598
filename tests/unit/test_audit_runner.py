"""The audit runner without servers: an explicit section list, a failing section reported as
an error while every other section still runs, and an exit code that says so."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from specaudit import audit
from specaudit.audit import sections
from specaudit.audit.context import AuditContext, Section
from specaudit.errors import SpecauditError
from specaudit.outcome import Outcome

SRC = Path(__file__).parents[2] / "src" / "specaudit"


def _ok(key: str, status: Outcome = Outcome.OK) -> sections.SectionFn:
    def fn(ctx: AuditContext) -> Section:
        ran.append(key)
        return Section(key=key, title=key.title(), markdown=f"{key} body", status=status,
                       summary=f"{key} summary")  # fmt: skip

    return fn


def _boom(ctx: AuditContext) -> Section:
    ran.append("boom")
    raise RuntimeError("the server\nfell over")


ran: list[str] = []


def test_a_section_that_raises_is_an_error_and_the_others_still_run(tmp_path: Path) -> None:
    ran.clear()
    secs = (("first", _ok("first")), ("boom", _boom), ("last", _ok("last", Outcome.FINDING)))
    rep = audit.run(tmp_path, sections=secs, ensure_bins=lambda b, p: pytest.fail("no build"))
    assert ran == ["first", "boom", "last"]
    assert [s.key for s in rep.sections] == ["first", "boom", "last"]
    boom = rep.sections[1]
    assert boom.status is Outcome.NO_DECISION and boom.error == "the server fell over"
    assert rep.errors == [boom]
    assert rep.exit_code == 2
    md = (tmp_path / "report.md").read_text()
    assert "| boom | error | error: the server fell over |" in md
    assert "| last | finding | last summary |" in md and "RuntimeError" in md
    data = json.loads((tmp_path / "report.json").read_text())
    assert [s["status"] for s in data["sections"]] == ["ok", "error", "finding"]
    assert data["sections"][1]["error"] == "the server fell over"


def test_findings_alone_exit_0(tmp_path: Path) -> None:
    ran.clear()
    rep = audit.run(tmp_path, sections=(("a", _ok("a", Outcome.FINDING)),))
    assert rep.exit_code == 0 and not rep.errors


def test_every_plot_is_shown_once(tmp_path: Path) -> None:
    def fn(ctx: AuditContext) -> Section:
        inline, appended = tmp_path / "inline.png", tmp_path / "appended.png"
        md = "verdict\n\n![PIT histogram](inline.png)\n\ntable"
        return Section(key="p", title="P", markdown=md, plots=[inline, appended])

    audit.run(tmp_path, sections=(("p", fn),))
    md = (tmp_path / "report.md").read_text()
    assert md.count("](inline.png)") == 1 and md.count("](appended.png)") == 1


def test_unknown_only_is_an_error_not_an_empty_report(tmp_path: Path) -> None:
    with pytest.raises(SpecauditError, match="unknown section nope"):
        audit.run(tmp_path, only=("nope",), sections=(("a", _ok("a")),))
    assert not (tmp_path / "report.md").exists()


def test_the_section_list_is_explicit_and_complete() -> None:
    keys = [k for k, _ in sections.SECTIONS]
    assert keys == [
        "servers", "check", "ab", "dist", "engines", "proxy", "patched", "model", "speculative",
        "replay", "vllm",
    ]  # fmt: skip
    mods = sorted(p.stem for p in (SRC / "audit" / "sections").glob("*.py") if p.stem != "__init__")
    assert sorted(keys) == mods  # a section module that is not in the list is a mistake


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_capability_imports_the_audit() -> None:
    """Dependencies point one way: the audit imports the capabilities, never the reverse."""
    offenders = []
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC)
        if rel.parts[0] in ("audit", "cli"):
            continue
        if any(n == "specaudit.audit" or n.startswith("specaudit.audit.") for n in _imports(p)):
            offenders.append(str(rel))
    assert offenders == []


def test_slots_is_parsed_in_one_module() -> None:
    hits = sorted(
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if '.get("speculative")' in p.read_text() or "total_slots" in p.read_text()
    )
    assert hits == ["speculation.py"]
