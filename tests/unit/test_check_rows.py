"""`check`'s table rows come from one place: the terminal table and the audit report read the
same values (endpoint label, stream, counts, draft counts, verdict)."""

from __future__ import annotations

from specaudit.check import CheckResult, CheckSettings, EndpointResult, Speculation
from specaudit.check.rows import EndpointRow, endpoint_rows
from specaudit.outcome import Outcome


def _result(*endpoints: EndpointResult) -> CheckResult:
    spec = Speculation(state="unknown", summary="no /slots")
    return CheckResult(
        "http://127.0.0.1:1", CheckSettings(), spec, list(endpoints), None, "x", Outcome.OK, "r"
    )


def test_rows_carry_counts_draft_counts_and_verdict_of_each_probe() -> None:
    placeholders = EndpointResult(
        "chat", "/v1/chat/completions", True, "ok", total=5, real=3, placeholder=2,
        draft_n=8, draft_n_accepted=6,
    )  # fmt: skip
    absent = EndpointResult("native", "/completion", False, "absent", error="404")
    chat = EndpointRow(
        "/v1/chat/completions", "yes", True, 5, 3, 2, "8 (6 acc.)", "placeholders (2/5)"
    )
    native = EndpointRow("/completion n_probs", "no", False, 0, 0, 0, "-", "absent: 404")
    assert endpoint_rows(_result(placeholders, absent)) == [chat, native]
