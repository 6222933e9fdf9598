"""The audit's replay section rendered from measured results, without servers: stock and fixed
side by side with their verdicts, draft counts and rejecting tests; a fix that does not keep
the distribution is a finding; a build without the patch says it was not measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specaudit import distribution
from specaudit.audit import sections
from specaudit.audit.context import AuditContext
from specaudit.audit.sections import patched, replay
from specaudit.outcome import Outcome
from specaudit.report import to_jsonable
from specaudit.stats import Verdict
from specaudit.stats.base import GofResult, TvInterval


def _test(name: str, position: int, p_holm: float, alpha: float = 0.01) -> distribution.TestResult:
    gof = GofResult(statistic=1.0, df=2, p_value=p_holm, method="g-test", n=15000, n_strata=3,
                    min_expected=5.0)  # fmt: skip
    return distribution.TestResult(
        name=name, kind="position", position=position, n=15000, contexts=3, gof=gof,
        p_holm=p_holm, tv=TvInterval(0.02, 0.0, 0.04, 0.99), rejected=p_holm < alpha,
    )  # fmt: skip


def _engine(verdict: Verdict, drafted: int, accepted: int, *tests: distribution.TestResult
            ) -> distribution.EngineResult:  # fmt: skip
    return distribution.EngineResult(
        engine="x", kind="server-spec", verdict=verdict, alpha=0.01, tolerance=0.15,
        n_samples=15000, first_seed=1, last_seed=15000, drafted=drafted, accepted=accepted,
        tests=list(tests), contexts=[], headline=[], impossible=0, reason="", seconds=1.0,
        tv_bound=0.031, path="replay-rejection",
    )  # fmt: skip


STOCK = _engine(
    Verdict.BROKEN, 85048, 51430,
    _test("position 1", 1, 1.0), _test("position 4", 4, 0.000194), _test("position 5", 5, 0.0004),
)  # fmt: skip
FIXED = _engine(Verdict.PRESERVED, 84906, 51650, _test("position 1", 1, 1.0),
                _test("position 4", 4, 0.9))  # fmt: skip


def test_stock_broken_and_fixed_preserved_side_by_side(tmp_path: Path) -> None:
    pair = patched.ReplayPair("specaudit-replay-abcdefgh", 8, STOCK, FIXED)
    assert pair.proven
    sec = patched.replay_section(AuditContext(tmp_path), pair)
    assert sec.key == "replay" and sec.status is Outcome.OK
    assert sec.summary == "replay-rejection, 8 tokens, 15000 seeds: BROKEN -> PRESERVED"
    assert "specaudit-replay-abcdefgh, 8 tokens per sample:" in sec.markdown
    assert (
        "| stock | BROKEN (15000 seeds, TV <= 0.031) | 85048 / 51430 "
        "| position 4 (0.00019), position 5 (0.0004) |"
    ) in sec.markdown
    assert "| replay-fix | PRESERVED (15000 seeds, TV <= 0.031) | 84906 / 51650 | none |" in (
        sec.markdown
    )
    data = json.loads(json.dumps(to_jsonable(sec.data)))
    assert data["pair"]["stock"]["verdict"] == "BROKEN"
    assert data["pair"]["fixed"]["verdict"] == "PRESERVED"


def test_a_fix_that_does_not_preserve_is_a_finding(tmp_path: Path) -> None:
    pair = patched.ReplayPair("specaudit-replay-abcdefgh", 8, STOCK, STOCK)
    assert not pair.proven
    sec = patched.replay_section(AuditContext(tmp_path), pair)
    assert sec.status is Outcome.FINDING
    assert sec.summary.endswith("BROKEN -> BROKEN")


def test_a_build_without_the_patch_is_not_measured(tmp_path: Path) -> None:
    ctx = AuditContext(tmp_path, build=1)  # no bundled patches: nothing is built or started
    assert patched.replay_pair(ctx) is None
    sec = patched.replay_section(ctx, None)
    assert sec.status is Outcome.OK
    assert "No `replay-fix` patch for b1: not measured." in sec.markdown
    assert sec.summary == "no replay-fix patch for b1"


def test_the_audit_runs_it_as_its_own_section() -> None:
    assert dict(sections.SECTIONS)["replay"] is replay.section


def test_the_seeds_must_be_consecutive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="consecutive"):
        patched.replay_run(AuditContext(tmp_path), "stock", seeds=range(1, 100, 2))
