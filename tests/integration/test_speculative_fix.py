"""The llama-speculative fix (`speculative-fix`, #29975) proven with `dist` on the real binary.

Stock llama-speculative BROKEN and the patched one PRESERVED, on both fixtures (last-token and
context) and both prompts (the fixture's own and another), through the audit's own function.
The stock bias is gross (p < 1e-100 at 400 seeds), so a sequential test (at most 100 seeds,
anytime-valid, alpha 1e-3) shows it within a few dozen runs; the fixed example gets 400 seeds
and a TV tolerance of 0.25 (the audit runs 1000 seeds of each at the default 0.15).
"""

from __future__ import annotations

import pytest

from specaudit import audit
from specaudit.audit.sections import patched
from specaudit.stats import Verdict


@pytest.fixture(scope="module")
def pairs(audit_ctx: audit.AuditContext) -> list[patched.ExamplePair]:
    return patched.example_pairs(
        audit_ctx,
        stock_seeds=range(1, 101),
        fixed_seeds=range(1, 401),
        tolerance=0.25,
        stock_sequential=True,
    )


def test_every_fixture_and_prompt_is_measured(pairs: list[patched.ExamplePair]) -> None:
    assert [(x.kind, x.prompt) for x in pairs] == [
        ("last-token", "bcdbc"),
        ("last-token", patched.SECOND_PROMPT),
        ("context", "bcdbc"),
        ("context", patched.SECOND_PROMPT),
    ]


@pytest.mark.parametrize("i", range(4), ids=["last-own", "last-hag", "ctx-own", "ctx-hag"])
def test_stock_broken_fixed_preserved(pairs: list[patched.ExamplePair], i: int) -> None:
    """Stock is BROKEN on every fixture and prompt; the fix keeps every position (the last
    one too: it is the token drafted after an accepted one, which the acceptance draws
    biased while they replayed the samplers' own mt19937 stream), the joint, the history
    within each pool and the independence of consecutive seeds: no test rejects."""
    x = pairs[i]
    assert x.stock.verdict is Verdict.BROKEN, x.stock.reason
    assert x.fixed.verdict is Verdict.PRESERVED, x.fixed.reason
    assert x.proven
    positions = {t.position for t in x.fixed.tests if t.kind == "position"}
    assert positions == {1, 2, 3, 4}
    rejected = [f"{t.name} (p_holm {t.p_holm:.2g})" for t in x.fixed.tests if t.rejected]
    assert not rejected, rejected
    assert x.fixed.n_samples == 400 and x.stock.n_samples <= 100
    # the fixed example really speculated: it drafted, accepted some and rejected some (the
    # rejection path, with its residual, is what the fix changed)
    assert x.fixed.drafted is not None and x.fixed.accepted is not None
    assert 0 < x.fixed.accepted < x.fixed.drafted


def test_audit_section(audit_ctx: audit.AuditContext, pairs: list[patched.ExamplePair]) -> None:
    sec = patched.fix_section(audit_ctx, pairs)
    assert sec.key == "speculative" and sec.status == "ok", sec.summary
    assert sec.summary.count("BROKEN -> PRESERVED") == 4
    assert "| specaudit-context-abcdefgh (context) | hag |" in sec.markdown
