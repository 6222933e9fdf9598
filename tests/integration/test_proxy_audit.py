"""The proxy's audit section on the audit's own servers (fixture and Gemma, plain and spec)."""

from __future__ import annotations

import pytest

from specaudit import audit
from specaudit.audit.sections.proxy import DemoRow, section


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
