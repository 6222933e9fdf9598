"""The audit's engines section on the session's servers: transformers (every generator, both
fixtures), llama-server through /v1/completions and llama-cpp-python with prompt lookup, in
one table, and `check` on llama-cpp-python. 100 seeds each: the table and its wiring; the
verdicts are tested in test_dist_transformers and test_llama_cpp_python."""

from __future__ import annotations

from specaudit import audit
from specaudit.audit.sections import engines
from specaudit.outcome import Outcome
from specaudit.stats import Verdict


def test_engines_section(audit_ctx: audit.AuditContext) -> None:
    results, chk, notes = engines.run_engines(audit_ctx, seeds=100)
    rows = engines.rows(results)
    gens = [(str(r[0]).split()[0], r[1], r[2]) for r in rows]
    for fx in (audit_ctx.fixture.spec.name, audit_ctx.context_fixture.spec.name):
        for g in ("assistant", "prompt-lookup", "early-exit"):
            assert ("transformers", g, fx) in gens
    assert any(str(r[0]).startswith("llama-cpp-python") for r in rows)
    assert any(r[1] == "llama-server draft-simple" for r in rows)
    assert all(r[3] != Verdict.BROKEN.value for r in rows), rows
    assert all(isinstance(r[4], int) and r[4] <= 100 for r in rows), rows
    assert len(notes) == 2 and all("closed form" in n for n in notes)
    assert chk.outcome is Outcome.OK and chk.speculation.state == "unknown"
