"""`specaudit.ab` without a server: settings, parsing recorded responses, statistics, verdicts.

Parsing uses responses recorded from a real llama-server (Gemma 3 270M, plain and with itself
as draft, tests/data/responses/ab-gemma-*). The verdict rules are pure functions of per-seed
numbers, so their boundaries are pinned here with constructed numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
from scipy import stats

from specaudit import ab
from specaudit.errors import SpecauditError

DATA = Path(__file__).resolve().parents[1] / "data" / "responses"


def recorded(endpoint: str, side: str) -> dict:
    name = {"plain": "plain", "spec": "spec-draft-simple"}[side]
    return json.loads((DATA / f"ab-gemma-{endpoint}-{name}-12tok-seed1.json").read_text())


# ---------------------------------------------------------------------------------------------
# settings


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"seeds": 0}, "--seeds"),
        ({"tokens": -1}, "--tokens"),
        ({"tokens": 0}, "--tokens"),
        ({"top_logprobs": 0}, "--top-k"),
        ({"temperature": -0.5}, "--temperature"),
        ({"temperature": math.nan}, "--temperature"),
        ({"sampler_top_k": -1}, "--sampler-top-k"),
        ({"endpoint": "completions"}, "--endpoint"),
        ({"prompt": ""}, "--prompt"),
        ({"confidence": 1.0}, "confidence"),
    ],
)
def test_bad_settings_raise_one_line_errors(kwargs: dict, needle: str) -> None:
    with pytest.raises(ab.ABError) as ei:
        ab.Settings(**kwargs)
    assert isinstance(ei.value, SpecauditError) and ei.value.exit_code == 2
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_request_bodies() -> None:
    chat = ab.Settings(tokens=7, sampler_top_k=3, temperature=0.5).request(4)
    assert chat == {
        "messages": [{"role": "user", "content": ab.DEFAULT_PROMPT}],
        "max_tokens": 7,
        "logprobs": True,
        "top_logprobs": 3,
        "temperature": 0.5,
        "seed": 4,
        "top_k": 3,
    }
    native = ab.Settings(tokens=7, endpoint="completion", top_logprobs=5).request(2)
    assert native == {
        "prompt": ab.DEFAULT_PROMPT,
        "n_predict": 7,
        "n_probs": 5,
        "temperature": 1.0,
        "seed": 2,
    }
    assert ab.Settings(seeds=3, first_seed=10).seed_values == [10, 11, 12]


# ---------------------------------------------------------------------------------------------
# parsing recorded real responses


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_parse_plain_recording_is_fully_real(endpoint: str) -> None:
    r = ab.parse_response("plain", 1, endpoint, recorded(endpoint, "plain"), 3)
    assert r.tokens == 12 == r.n_predicted == r.real
    assert r.placeholder == 0 and r.coverage == 1.0
    assert r.naive_mean == pytest.approx(r.real_mean)
    assert r.naive_mean is not None and r.naive_mean < -0.1
    assert r.draft_n is None and r.draft_n_accepted is None  # plain: no timings.draft_n
    assert r.text and "".join(r.token_texts) == r.text


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_parse_spec_recording_counts_placeholders(endpoint: str) -> None:
    body = recorded(endpoint, "spec")
    r = ab.parse_response("spec", 1, endpoint, body, 3)
    assert r.tokens == 12 == r.n_predicted
    assert r.real + r.placeholder + r.unchecked == r.tokens
    assert r.placeholder >= 10 and r.real >= 1
    assert r.real_logprobs[0] is not None  # the first token comes from the normal path
    # placeholders: reported as 0.0, missing in the real trace
    for rep, real in zip(r.reported_logprobs, r.real_logprobs, strict=True):
        if real is None:
            assert rep == 0.0
    # naive = real values plus zeros, over all tokens
    real_vals = [v for v in r.real_logprobs if v is not None]
    assert r.naive_mean == pytest.approx(sum(real_vals) / r.tokens)
    assert r.real_mean == pytest.approx(sum(real_vals) / len(real_vals))
    assert r.draft_n == body["timings"]["draft_n"] and r.draft_n is not None and r.draft_n > 0
    assert r.draft_n_accepted == body["timings"]["draft_n_accepted"]


def test_text_without_logprobs_is_an_error() -> None:
    body = recorded("chat", "plain")
    body["choices"][0]["logprobs"] = None
    with pytest.raises(ab.ABError, match="no logprobs"):
        ab.parse_response("plain", 1, "chat", body, 3)


def test_empty_response_has_no_means() -> None:
    body = {"content": "", "tokens_predicted": 0, "completion_probabilities": []}
    r = ab.parse_response("spec", 1, "completion", body, 3)
    assert r.tokens == 0 and r.naive_mean is None and r.real_mean is None and r.coverage == 0


# ---------------------------------------------------------------------------------------------
# statistics


def test_t_interval_matches_scipy_and_degenerate_cases() -> None:
    xs = [-0.5158, -0.6775, -0.3832, -0.3360, -0.4898]
    ci = ab.t_interval(xs)
    assert ci is not None
    lo, hi = ci
    ref = stats.ttest_1samp(xs, 0.0).confidence_interval(0.95)
    assert lo == pytest.approx(ref.low) and hi == pytest.approx(ref.high)
    assert ab.t_interval([1.0]) is None
    assert ab.t_interval([0.25, 0.25, 0.25]) == (0.25, 0.25)


def test_paired_delta() -> None:
    a: dict[int, float | None] = {1: -0.1, 2: -0.2, 3: None, 4: -0.15}
    b: dict[int, float | None] = {1: -0.5, 2: -0.4, 3: -0.6, 4: -0.45}
    d = ab.paired("x", a, b)
    assert d.n == 3  # seed 3 has no value on one side
    assert d.mean == pytest.approx((0.4 + 0.2 + 0.3) / 3)
    ref = stats.ttest_rel([-0.1, -0.2, -0.15], [-0.5, -0.4, -0.45])
    assert d.p_value == pytest.approx(ref.pvalue)
    assert d.ci_low is not None and d.mean is not None and d.ci_high is not None
    assert d.ci_low < d.mean < d.ci_high
    one = ab.paired("x", a, b, alternative="greater")
    assert one.p_value == pytest.approx(ref.pvalue / 2)
    same = ab.paired("x", {1: -1.0, 2: -2.0}, {1: -1.0, 2: -2.0})
    assert (same.mean, same.ci_low, same.ci_high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    shifted = ab.paired("x", {1: 0.0, 2: -1.0}, {1: -1.0, 2: -2.0}, alternative="greater")
    assert shifted.p_value == 0.0  # constant positive difference: beyond any noise
    none = ab.paired("x", {1: None}, {1: -1.0})
    assert none.n == 0 and none.mean is None and none.p_value is None


# ---------------------------------------------------------------------------------------------
# verdict rules, on constructed per-seed numbers


def resp(side: str, seed: int, values: Sequence[float | None]) -> ab.Response:
    """A response whose tokens have these logprobs (None = placeholder sent as 0.0)."""
    real = [v for v in values if v is not None]
    return ab.Response(
        side=side,
        seed=seed,
        text="",
        n_predicted=len(values),
        tokens=len(values),
        real=len(real),
        placeholder=len(values) - len(real),
        unchecked=0,
        coverage=len(real) / len(values) if values else 0.0,
        naive_mean=sum(real) / len(values) if values else None,
        real_mean=sum(real) / len(real) if real else None,
        draft_n=None,
        draft_n_accepted=None,
        reported_logprobs=[0.0 if v is None else v for v in values],
        real_logprobs=list(values),
    )


def verdict_of(responses: list[ab.Response]) -> ab.VerdictInfo:
    return ab.analyse(
        ab.Settings(seeds=len({r.seed for r in responses})),
        responses,
        {"plain": "http://p", "spec": "http://s"},
    ).verdict


def plain_values(seed: int, n: int = 20) -> list[float]:
    return [-0.3 - 0.05 * ((seed * 7 + i) % 9) for i in range(n)]


def draft_like(seed: int, n: int = 20) -> list[float | None]:
    """First token real, the rest placeholders: draft-simple's shape."""
    return [plain_values(seed, n)[0]] + [None] * (n - 1)


def test_draft_shape_is_instrument_fault() -> None:
    rs = [resp("plain", s, plain_values(s)) for s in (1, 2, 3)]
    rs += [resp("spec", s, draft_like(s)) for s in (1, 2, 3)]
    v = verdict_of(rs)
    assert v.kind is ab.ABVerdict.INSTRUMENT_FAULT, v
    assert "5.0%" in v.message and "tool, not the model" in v.message
    assert v.fault_test is not None and v.fault_test.p_value is not None
    assert v.fault_test.p_value < ab.ALPHA


def test_fault_needs_two_seeds() -> None:
    v = verdict_of([resp("plain", 1, plain_values(1)), resp("spec", 1, draft_like(1))])
    assert v.kind is ab.ABVerdict.INCONCLUSIVE
    assert any("fewer than 2 seeds" in r for r in v.reasons)


def test_fault_needs_a_clean_plain_side() -> None:
    rs = [resp("plain", s, draft_like(s)) for s in (1, 2, 3)]
    rs += [resp("spec", s, draft_like(s)) for s in (1, 2, 3)]
    v = verdict_of(rs)
    assert v.kind is ab.ABVerdict.INCONCLUSIVE
    assert any("no reference" in r for r in v.reasons)


def test_mixed_coverage_above_half_is_inconclusive() -> None:
    # n-gram shape: most tokens real, a run of placeholders
    rs = [resp("plain", s, plain_values(s)) for s in (1, 2, 3)]
    rs += [resp("spec", s, plain_values(s)[:14] + [None] * 6) for s in (1, 2, 3)]
    v = verdict_of(rs)
    assert v.kind is ab.ABVerdict.INCONCLUSIVE
    assert any("coverage 70%" in r for r in v.reasons)
    assert any("not fully covered" in r for r in v.reasons)


def test_identical_sides_are_consistent() -> None:
    rs = [resp(side, s, plain_values(s)) for s in (1, 2, 3) for side in ab.SIDES]
    v = verdict_of(rs)
    assert v.kind is ab.ABVerdict.CONSISTENT and "0.01 nats" in v.message


def test_single_identical_seed_is_consistent() -> None:
    rs = [resp(side, 1, plain_values(1)) for side in ab.SIDES]
    assert verdict_of(rs).kind is ab.ABVerdict.CONSISTENT


def test_different_samples_within_noise_are_consistent() -> None:
    # independent samples: means differ by more than the tolerance, not beyond noise
    rs = [resp("plain", s, plain_values(s)) for s in (1, 2, 3, 4)]
    offsets = {1: 0.2, 2: -0.1, 3: 0.15, 4: -0.15}  # mean +0.025, spread ~0.17
    rs += [resp("spec", s, [v + offsets[s] for v in plain_values(s)]) for s in (1, 2, 3, 4)]
    v = verdict_of(rs)
    assert v.agreement_test is not None and v.agreement_test.mean is not None
    assert abs(v.agreement_test.mean) > ab.AGREE_TOLERANCE
    assert v.kind is ab.ABVerdict.CONSISTENT, v
    assert "sampling error" in v.message


def test_full_coverage_but_different_model_is_inconclusive() -> None:
    rs = [resp("plain", s, plain_values(s)) for s in (1, 2, 3)]
    rs += [resp("spec", s, [v - 1.0 for v in plain_values(s)]) for s in (1, 2, 3)]
    v = verdict_of(rs)
    assert v.kind is ab.ABVerdict.INCONCLUSIVE
    assert any("beyond sampling error" in r for r in v.reasons)


def test_exit_codes_follow_the_verdict() -> None:
    ok = ab.analyse(
        ab.Settings(seeds=1),
        [resp(s, 1, [-0.5]) for s in ab.SIDES],
        {"plain": "http://p", "spec": "http://s"},
    )
    assert ok.exit_code == 0
    rs = [resp("plain", s, plain_values(s)) for s in (1, 2)]
    rs += [resp("spec", s, draft_like(s)) for s in (1, 2)]
    fault = ab.analyse(ab.Settings(seeds=2), rs, {"plain": "http://p", "spec": "http://s"})
    assert fault.verdict.kind is ab.ABVerdict.INSTRUMENT_FAULT and fault.exit_code == 1


def test_uses_draft() -> None:
    assert ab.uses_draft("draft-simple")
    assert ab.uses_draft("ngram-mod,draft-simple")
    assert not ab.uses_draft("ngram-mod")
    assert not ab.uses_draft("draft-mtp")
