"""The proxy's audit section names what went wrong in each demo row (no server needed;
tests/integration/test_proxy_audit.py runs the section on the audit's servers)."""

from __future__ import annotations

from specaudit.audit.sections.proxy import DemoRow, problems


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
