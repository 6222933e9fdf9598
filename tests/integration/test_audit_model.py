"""The audit's "your model" section on real Gemma servers: the stock speculating server
re-scored (a verdict and a PIT histogram; here a short run, INCONCLUSIVE), its tokens
placeholders, the patched server's real and correct, and a logprob mutant's real but
wrong."""

from __future__ import annotations

from specaudit import audit
from specaudit.audit.sections import model
from specaudit.outcome import Outcome


def test_your_model_section_classifies_stock_patched_and_a_mutant(
    audit_ctx: audit.AuditContext,
) -> None:
    sec = model.section(audit_ctx, seeds=11, tokens=4)
    fid = sec.data["fidelity"]
    stock = fid["stock, speculating"]
    patched = fid["spec-logprobs, speculating"]
    mutant = fid[model.MUTANT_LABEL]
    assert stock.placeholder + stock.missing > 0 and stock.real_wrong == 0
    assert patched.real_correct == patched.total > 0
    assert mutant.real_wrong > 0
    # draft-simple greedy is lossless: nothing rejects; 132 tokens cannot certify the default
    # tolerance, so the section says INCONCLUSIVE and how many would (the audit runs 810)
    assert sec.data["rescore"]["verdict"] == "INCONCLUSIVE"
    assert sec.data["rescore"]["rescored"] == 132
    assert "tokens would decide" in sec.markdown
    assert sec.plots and sec.plots[0].is_file() and sec.plots[0].stat().st_size > 5000
    assert "PIT histogram" in sec.markdown and sec.status is Outcome.FINDING
