"""A re-scored run's arm at another temperature: on by default where the run's own temperature
is 1 (a sampler that applies the temperature wrongly is invisible there), each arm decided at
alpha / 2, and the two outcomes combined so that either arm's BROKEN is the run's. The real
mutant it catches, invisible at T = 1, is in tests/integration/test_rescore_servers.py."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from specaudit.fixtures import SamplerSettings
from specaudit.outcome import Outcome
from specaudit.reference import NextToken, SamplerBoundSource
from specaudit.rescore import analysis, render, request, runner
from specaudit.rescore.records import RescoreError, TokenDraw
from specaudit.stats import Verdict


def _req(**kw: Any) -> request.RescoreRequest:
    return request.make_request("http://127.0.0.1:9", reference_url="http://127.0.0.1:8", **kw)


def test_the_arm_is_on_at_t_1_and_off_where_production_already_differs() -> None:
    assert request.default_arm(SamplerSettings(temperature=1.0)) == request.ARM_TEMPERATURE
    assert request.default_arm(SamplerSettings(temperature=0.8)) is None


def test_an_arm_at_the_run_s_own_temperature_or_with_self_is_refused() -> None:
    with pytest.raises(RescoreError, match="is the run's own temperature"):
        _req(arm_temperature=1.0)
    with pytest.raises(RescoreError, match="above 0"):
        _req(arm_temperature=0.0)
    with pytest.raises(RescoreError, match="--self takes no temperature arm"):
        request.make_request("http://127.0.0.1:9", self_check=True, arm_temperature=0.7)
    assert _req(arm_temperature=0.7).arm_temperature == 0.7


def test_each_arm_needs_enough_tokens_at_half_the_alpha() -> None:
    """The smallest run that decides at alpha decides no longer at alpha / 2: with the arm,
    the same seeds are refused as too few."""
    with pytest.raises(RescoreError, match=r"need at least (\d+) tokens") as ei:
        _req(seeds=1, tokens=1, prompts=["x"])
    fewest = int(re.search(r"need at least (\d+) tokens", str(ei.value)).group(1))  # type: ignore[union-attr]  # matched just above
    _req(seeds=fewest, tokens=1, prompts=["x"])  # enough alone
    with pytest.raises(RescoreError, match="too few to decide"):
        _req(seeds=fewest, tokens=1, prompts=["x"], arm_temperature=0.7)


def _result(verdict: Verdict | None, temperature: float = 1.0) -> runner.RescoreResult:
    """A result whose stats say `verdict` (None: no decision)."""
    draws = [TokenDraw(i, 0, 0, f"0:{i}", 0, NextToken(probs={0: 0.5, 1: 0.5})) for i in range(4)]
    res = runner.RescoreResult(
        "engine", "ref", None, [[1]], 4, 1, SamplerSettings(temperature=temperature), draws=draws
    )
    res.rescored = len(draws)
    if verdict is None:
        res.error = "the reference failed"
        return res
    stats = analysis.analyse(draws)
    res.stats = dataclasses.replace(stats, verdict=verdict)
    return res


@pytest.mark.parametrize(
    ("main", "arm", "together"),
    [
        (Verdict.PRESERVED, Verdict.PRESERVED, Outcome.OK),
        (Verdict.PRESERVED, Verdict.BROKEN, Outcome.FINDING),
        (Verdict.BROKEN, None, Outcome.FINDING),
        (Verdict.INCONCLUSIVE, Verdict.BROKEN, Outcome.FINDING),
        (Verdict.PRESERVED, Verdict.INCONCLUSIVE, Outcome.NO_DECISION),
        (Verdict.PRESERVED, None, Outcome.NO_DECISION),
    ],
)
def test_either_arm_s_broken_is_the_run_s_and_ok_needs_both(
    main: Verdict, arm: Verdict | None, together: Outcome
) -> None:
    res = _result(main)
    res.arm = _result(arm, temperature=0.7)
    assert res.outcome is together
    assert res.own_outcome is main.outcome  # the first arm alone is still read apart


def test_the_report_shows_the_arm_s_verdict_and_both_together() -> None:
    res = _result(Verdict.PRESERVED)
    res.arm = _result(Verdict.BROKEN, temperature=0.7)
    row = dict(render.rows(res))["arm at another temperature (below)"]
    assert row == "T = 0.7: BROKEN (4 tokens); both arms at alpha / 2, together BROKEN"
    md = render.markdown(res)
    assert "#### The arm at temperature 0.7" in md
    assert md.rstrip().endswith("Both arms together (each at alpha / 2): **BROKEN**.")
    js = render.to_json(res)
    assert js["outcome"] == "finding" and js["arm"]["verdict"] == "BROKEN"
    assert js["arm"]["sampler"]["temperature"] == 0.7


def test_a_closed_form_draft_follows_the_arm_s_temperature() -> None:
    from specaudit import fixtures
    from specaudit.rescore.fixture import FixtureDraft

    spec = fixtures.default_spec()
    draft = FixtureDraft(spec, SamplerSettings(temperature=1.0))
    assert isinstance(draft, SamplerBoundSource)
    cooler = draft.at(SamplerSettings(temperature=0.7))
    assert isinstance(cooler, FixtureDraft) and cooler.sampler.temperature == 0.7
