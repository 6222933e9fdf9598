"""The audit's vLLM section on the real CPU build (`audit.sections.vllm`): stock n-gram
speculation samples forbidden tokens at top-k 0 / top-p 0.8 (BROKEN) and then crashes with
top-k on (one line naming vLLM's exception, and the rest of the server's rows not run);
specaudit's fix is not BROKEN at either setting and accepts drafts. Each server is started
once and sampled at both settings through `dist --vllm-url`, its closed form checked first.
(The section's plain server is the session's plain server in test_dist_vllm.py; Gemma's rows
are test_vllm_rescore.py's.)"""

from __future__ import annotations

import pytest

from specaudit import audit, fixtures

pytestmark = pytest.mark.timeout(3600)
SEEDS = 300  # the stock server's forbidden tokens come within a few dozen seeds


def test_stock_ngram_breaks_then_crashes_and_the_fix_holds_at_both_settings(
    audit_ctx: audit.AuditContext, fixture_set: fixtures.FixtureSet
) -> None:
    from specaudit.audit.sections import vllm as av

    servers = (("ngram", False), ("ngram", True))
    report = av.run_fixtures(audit_ctx, [fixture_set], SEEDS, servers=servers)
    by = {(r.server, r.sampler): r for r in report.rows}
    top_p, top_k = (label for label, _ in av.SAMPLERS)
    assert len(report.rows) == 4, [r.cells() for r in report.rows]
    broken = by[("ngram (stock)", top_p)]
    assert broken.verdict == "BROKEN" and "true probability 0" in broken.why
    crash = by[("ngram (stock)", top_k)]
    assert crash.verdict == av.CRASH and "RuntimeError: max(): Expected reduction dim" in crash.why
    for label in (top_p, top_k):
        fixed = by[("ngram + cpu-sampler fix", label)]
        assert fixed.verdict != "BROKEN" and fixed.samples == SEEDS, fixed.why
        assert fixed.drafted and fixed.accepted and fixed.accepted > 0.1 * fixed.drafted
    assert sum("vs the closed form on 9 contexts" in n for n in report.notes) == 3
    section = av.render_section(report)
    assert section.status.value == "finding" and "| ngram (stock) |" in section.markdown
