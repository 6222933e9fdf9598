"""The proxy's audit section on the audit's own servers (fixture and Gemma, plain and spec)."""

from __future__ import annotations

import pytest

from specaudit import audit
from specaudit.audit.sections.proxy import DemoRow, problems, section


@pytest.mark.gemma
def test_audit_section(audit_ctx: audit.AuditContext) -> None:
    sec = section(audit_ctx)
    assert sec.key == "proxy" and sec.status == "ok", sec.markdown
    rows: list[DemoRow] = sec.data["rows"]
    by = {(r.model, r.request, r.via): r for r in rows}
    for model in ("fixture", "gemma"):
        lp = by[(model, "logprobs", "proxy")]
        assert lp.backend == "plain" and lp.tokens > 0 and lp.real == lp.tokens
        assert lp.mean_logprob is not None and lp.mean_logprob < 0
        direct = by[(model, "logprobs", "direct to spec")]
        assert (direct.placeholders or 0) > 0  # what the proxy saved its client from
        plain = by[(model, "plain", "proxy")]
        assert plain.backend == "spec" and (plain.draft_n or 0) > 0 and plain.tokens > 0
    assert "every logprobs token is real" in sec.markdown
    assert "| gemma | logprobs | proxy | plain |" in sec.markdown


def test_problems_name_what_went_wrong() -> None:
    ok = DemoRow("m", "logprobs", "proxy", "plain", 200, 5, 5, 0, -0.5, None, None)
    assert problems([ok]) == []
    bad = DemoRow("m", "logprobs", "proxy", "spec", 200, 5, 1, 4, -0.1, 4, 3)
    assert problems([bad]) == [
        "m logprobs request: served by spec, not plain",
        "m logprobs request: 1/5 real values",
    ]
    slow = DemoRow("m", "plain", "proxy", "spec", 200, 5, None, None, None, 0, 0)
    assert problems([slow]) == ["m plain request: draft_n 0, the server did not speculate"]
