"""The audit's engines section on the session's servers: transformers (every generator, both
fixtures), llama-server through /v1/completions, llama-cpp-python with prompt lookup and
OpenVINO GenAI's three paths, in one table, and `check` on llama-cpp-python. 100 seeds each:
the table and its wiring; the verdicts are tested in test_dist_transformers,
test_llama_cpp_python and test_dist_openvino."""

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
    # OpenVINO GenAI on both fixtures; its draft path is the one BROKEN row (docs/openvino.md)
    ov = [r for r in rows if str(r[0]).startswith("openvino-genai")]
    assert sorted((r[1], r[2]) for r in ov) == sorted(
        (p, fx)
        for p in ("plain", "draft", "prompt-lookup")
        for fx in (audit_ctx.fixture.spec.name, audit_ctx.context_fixture.spec.name)
    )
    broken = [r for r in rows if r[3] == Verdict.BROKEN.value]
    assert broken and all(r in ov and r[1] == "draft" for r in broken), rows
    assert all(isinstance(r[4], int) and r[4] <= 100 for r in rows), rows
    assert sum("transformers next-token probabilities vs the closed form" in n for n in notes) == 2
    assert sum("OpenVINO probabilities (plain, f32) vs the closed form" in n for n in notes) == 2
    assert sum("OpenVINO draft, seeds" in n and "NOT reproducible" in n for n in notes) == 2
    assert chk.outcome is Outcome.OK and chk.speculation.state == "unknown"
