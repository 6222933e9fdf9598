"""Logprob fidelity on hand-made records: each class, the tolerance's edge, the noise floor, and
the closed form as a reference."""

from __future__ import annotations

import math
from typing import Any

import pytest

from specaudit import fidelity, fixtures, logprobs
from specaudit.fidelity import Fidelity, FidelityError, NoiseFloor
from specaudit.logprobs import TokenRecord
from specaudit.reference import NextToken

REF = NextToken(
    probs={0: 0.5, 1: 0.3, 2: 0.2},
    logprobs={0: math.log(0.4), 1: math.log(0.3), 2: math.log(0.2), 3: math.log(0.1)},
)
# a floor of 1e-3 in both modes: the bound is 2e-3 plus float32 resolution
TOL = fidelity.tolerance(NoiseFloor(prob=1e-3, logprob=1e-3, answers=3))


def post(tok: int, prob: float, top: list[tuple[int, float]], requested: int = 3) -> TokenRecord:
    entry = {
        "id": tok,
        "token": str(tok),
        "prob": prob,
        "top_probs": [{"id": t, "token": str(t), "prob": p} for t, p in top],
    }
    return logprobs.from_entries([entry], requested)[0]


def pre(tok: int, lp: float, top: list[tuple[int, float]], requested: int = 3) -> TokenRecord:
    entry: dict[str, Any] = {
        "id": tok,
        "token": str(tok),
        "logprob": lp,
        "top_logprobs": [{"id": t, "token": str(t), "logprob": v} for t, v in top],
    }
    return logprobs.from_entries([entry], requested)[0]


def exact_post(tok: int) -> TokenRecord:
    return post(tok, REF.probs[tok], sorted(REF.probs.items(), key=lambda kv: -kv[1]))


def exact_pre(tok: int) -> TokenRecord:
    top = sorted(REF.logprobs.items(), key=lambda kv: -kv[1])[:3]
    return pre(tok, REF.logprobs[tok], top)


def test_values_equal_to_the_reference_are_real_and_correct_in_both_modes() -> None:
    for rec in (exact_post(1), exact_pre(2)):
        got = fidelity.classify_token(rec, REF, TOL)
        assert got.klass is Fidelity.REAL_CORRECT
        assert got.compared >= 4 and got.worst is not None and got.worst.error < 1e-12


def test_a_sampled_value_off_by_more_than_the_tolerance_is_real_but_wrong() -> None:
    rec = post(1, 0.31, [(0, 0.5), (1, 0.31), (2, 0.2)])
    got = fidelity.classify_token(rec, REF, TOL)
    assert got.klass is Fidelity.REAL_WRONG
    assert got.worst is not None and got.worst.token_id == 1
    assert got.worst.expected == pytest.approx(0.3) and got.worst.error == pytest.approx(0.01)
    # and check's own classification calls the same record real
    assert rec.klass is logprobs.TokenClass.REAL


def test_the_tolerance_edge_is_the_spread_factor_times_the_floor() -> None:
    """Bound 2e-3 (+ float32 resolution, ~1e-7 at 0.3): 1.9e-3 is within, 2.1e-3 beyond."""
    inside = post(1, 0.3 + 1.9e-3, [(0, 0.5), (1, 0.3 + 1.9e-3), (2, 0.2)])
    outside = post(1, 0.3 + 2.1e-3, [(0, 0.5), (1, 0.3 + 2.1e-3), (2, 0.2)])
    assert fidelity.classify_token(inside, REF, TOL).klass is Fidelity.REAL_CORRECT
    assert fidelity.classify_token(outside, REF, TOL).klass is Fidelity.REAL_WRONG
    # the exact tolerance allows float32 rounding only
    nudged = post(1, 0.3 + 1e-7, [(0, 0.5), (1, 0.3 + 1e-7), (2, 0.2)])
    assert fidelity.classify_token(nudged, REF, fidelity.EXACT).klass is Fidelity.REAL_CORRECT
    assert fidelity.classify_token(inside, REF, fidelity.EXACT).klass is Fidelity.REAL_WRONG


def test_a_wrong_candidate_is_caught_even_when_the_sampled_value_is_right() -> None:
    rec = post(0, 0.5, [(0, 0.5), (1, 0.25), (2, 0.25)])  # renormalised over the wrong set
    got = fidelity.classify_token(rec, REF, TOL)
    assert got.klass is Fidelity.REAL_WRONG
    assert got.worst is not None and got.worst.where == "candidate"


def test_a_top_token_left_out_of_the_candidates_is_wrong() -> None:
    # the engine reports two of three asked-for candidates, leaving out the reference's 0.3
    rec = post(0, 0.5, [(0, 0.5), (2, 0.2)], requested=3)
    got = fidelity.classify_token(rec, REF, TOL)
    assert got.klass is Fidelity.REAL_WRONG
    assert got.worst is not None and got.worst.where == "absent" and got.worst.token_id == 1


def test_pre_sampling_values_are_compared_with_the_raw_logprobs() -> None:
    # the processed probability (0.3) reported where the raw one (0.3 too) belongs: correct;
    # the processed 0.5 for token 0, whose raw probability is 0.4: wrong
    assert fidelity.classify_token(exact_pre(1), REF, TOL).klass is Fidelity.REAL_CORRECT
    top = [(0, math.log(0.5)), (1, math.log(0.3)), (2, math.log(0.2))]
    got = fidelity.classify_token(pre(0, math.log(0.5), top), REF, TOL)
    assert got.klass is Fidelity.REAL_WRONG and got.mode == "pre"
    assert got.worst is not None and got.worst.token_id == 0


def test_a_pre_sampling_value_outside_the_references_top_n_may_not_rank_above_it() -> None:
    ref = NextToken(REF.probs, {0: math.log(0.4), 1: math.log(0.3)})  # top-2 only
    ok = pre(0, math.log(0.4), [(0, math.log(0.4)), (1, math.log(0.3)), (5, math.log(0.05))])
    bad = pre(0, math.log(0.4), [(0, math.log(0.4)), (1, math.log(0.3)), (5, math.log(0.35))])
    assert fidelity.classify_token(ok, ref, TOL).klass is Fidelity.REAL_CORRECT
    assert fidelity.classify_token(bad, ref, TOL).klass is Fidelity.REAL_WRONG


def test_zero_with_no_candidates_is_a_placeholder_in_both_forms() -> None:
    for entry in (
        {"id": 1, "token": "1", "logprob": 0.0, "top_logprobs": []},
        {"id": 1, "token": "1", "prob": 1.0, "top_probs": []},
    ):
        rec = logprobs.from_entries([entry], 3)[0]
        got = fidelity.classify_token(rec, None, TOL)  # no reference needed
        assert got.klass is Fidelity.PLACEHOLDER


def test_a_streamed_token_without_a_probability_entry_is_missing() -> None:
    events: list[dict[str, Any]] = [
        {"content": "0", "completion_probabilities": [exact_post_entry(0)]},
        {"content": "1", "tokens": [1]},  # the speculative loop's token: no entry at all
    ]
    recs = logprobs.from_stream("completion", events, 3)
    got = [fidelity.classify_token(r, REF, TOL).klass for r in recs]
    assert got == [Fidelity.REAL_CORRECT, Fidelity.MISSING]


def exact_post_entry(tok: int) -> dict[str, Any]:
    return {
        "id": tok,
        "token": str(tok),
        "prob": REF.probs[tok],
        "top_probs": [{"id": t, "token": str(t), "prob": p} for t, p in REF.probs.items()],
    }


def test_unchecked_zero_that_disagrees_is_a_placeholder_and_other_values_are_compared() -> None:
    zero = logprobs.from_entries([{"id": 1, "token": "1", "logprob": 0.0}], 0)[0]
    right = logprobs.from_entries([{"id": 1, "token": "1", "logprob": math.log(0.3)}], 0)[0]
    wrong = logprobs.from_entries([{"id": 1, "token": "1", "logprob": math.log(0.2)}], 0)[0]
    assert fidelity.classify_token(zero, REF, TOL).klass is Fidelity.PLACEHOLDER
    assert fidelity.classify_token(right, REF, TOL).klass is Fidelity.REAL_CORRECT
    assert fidelity.classify_token(wrong, REF, TOL).klass is Fidelity.REAL_WRONG


def test_records_without_ids_need_the_vocabulary() -> None:
    body = {
        "choices": [
            {
                "logprobs": {
                    "tokens": ["b"],
                    "token_logprobs": [math.log(0.3)],
                    "top_logprobs": [{"a": math.log(0.4), "b": math.log(0.3), "c": math.log(0.2)}],
                }
            }
        ]
    }
    rec = logprobs.from_response("completions", body, 3)[0]
    with pytest.raises(FidelityError, match="without a token id"):
        fidelity.classify_token(rec, REF, TOL)
    vocab = {"a": 0, "b": 1, "c": 2, "d": 3}
    assert fidelity.classify_token(rec, REF, TOL, vocab).klass is Fidelity.REAL_CORRECT


def test_a_real_value_without_a_reference_is_refused() -> None:
    with pytest.raises(FidelityError, match="no reference"):
        fidelity.classify_token(exact_post(0), None, TOL)


def test_the_noise_floor_is_the_largest_spread_across_answers_and_prefixes() -> None:
    a = NextToken({0: 0.5, 1: 0.5}, {0: -0.70, 1: -0.70})
    b = NextToken({0: 0.49, 1: 0.51}, {0: -0.71, 1: -0.69, 2: -5.0})
    c = NextToken({0: 0.5, 1: 0.497, 2: 0.003}, {0: -0.70, 1: -0.70})
    f = fidelity.spread([a, b, c])
    assert f.prob == pytest.approx(0.013) and f.prob_token == 1  # 0.51 - 0.497
    assert f.logprob == pytest.approx(0.01) and f.answers == 3  # token 2 is not in every top-n
    both = fidelity.noise_floor([[a, b], [a, a]])
    assert both.prefixes == 2 and both.prob == pytest.approx(0.01)
    assert fidelity.noise_floor([[a, a]]).prob == 0.0
    tol = fidelity.tolerance(f)
    assert tol.prob == pytest.approx(2 * 0.013) and tol.logprob == pytest.approx(0.02)


def test_noise_floor_inputs_are_checked() -> None:
    a = NextToken({0: 1.0})
    with pytest.raises(FidelityError, match="two answers"):
        fidelity.spread([a])
    with pytest.raises(FidelityError, match="at least one prefix"):
        fidelity.noise_floor([])
    with pytest.raises(FidelityError, match="factor"):
        fidelity.tolerance(NoiseFloor(0.0, 0.0, 2), factor=0.5)
    with pytest.raises(FidelityError, match="not finite"):
        fidelity.tolerance(NoiseFloor(math.nan, 0.0, 2))


def test_the_fixture_reference_is_the_closed_form_after_the_ids() -> None:
    spec = fixtures.default_spec()
    sampler = fixtures.SamplerSettings(top_k=3, top_p=1.0, min_p=0.0, temperature=0.7)
    ref = fidelity.FixtureReference(spec, sampler)
    ids = spec.tokenize("bcdbcf")
    nt = ref.next_token(ids)
    truth = fixtures.next_token_distribution(spec, "bcdbcf", sampler)
    assert {spec.tokens[t]: p for t, p in nt.probs.items()} == {
        t: p for t, p in truth.items() if p > 0
    }
    raw = fixtures.raw_distribution(spec, "bcdbcf")
    assert len(nt.probs) == 3 and len(nt.logprobs) == sum(p > 0 for p in raw.values()) >= 8
    assert nt.logprobs[ids[-1]] == pytest.approx(math.log(raw["f"]))
    with pytest.raises(FidelityError, match="not a letter"):
        ref.next_token([*ids, spec.n_vocab - 1])


def _response(
    spec: fixtures.FixtureSpec, ref: fidelity.FixtureReference, prompt: str, out: str
) -> list[dict[str, Any]]:
    """Native post-sampling entries for `out` after `prompt`, each from the closed form of the
    prefix it follows (what a correct engine sends)."""
    entries = []
    ctx = spec.tokenize(prompt)
    for ch in out:
        tid = spec.tokenize(ch)[0]
        nt = ref.next_token(ctx)
        top = sorted(nt.probs.items(), key=lambda kv: -kv[1])
        entries.append(
            {
                "id": tid,
                "token": ch,
                "prob": nt.probs.get(tid, 0.0),
                "top_probs": [{"id": t, "token": spec.tokens[t], "prob": p} for t, p in top],
            }
        )
        ctx.append(tid)
    return entries


def test_classify_asks_the_reference_for_each_tokens_own_prefix() -> None:
    spec = fixtures.default_spec()
    sampler = fixtures.SamplerSettings(top_k=3, top_p=1.0, min_p=0.0, temperature=1.0)
    ref = fidelity.FixtureReference(spec, sampler)
    entries = _response(spec, ref, "bcdbc", "fgh")
    recs = logprobs.from_entries(entries, 3)
    prompt = spec.tokenize("bcdbc")
    res = fidelity.classify(recs, prompt, ref, fidelity.EXACT)
    assert res.counts == fidelity.FidelityCounts(real_correct=3)
    # the neighbouring position's values: token 1 ("g") reported with the distribution after
    # "g" (its own position) instead of after "f"
    shifted = [entries[0], {**_response(spec, ref, "bcdbcfg", "h")[0], "id": 6, "token": "g"}]
    res = fidelity.classify(logprobs.from_entries(shifted, 3), prompt, ref, fidelity.EXACT)
    assert [t.klass for t in res.tokens] == [Fidelity.REAL_CORRECT, Fidelity.REAL_WRONG]
    assert res.counts.real_wrong == 1 and res.worst is res.tokens[1]


def test_next_token_from_records_reads_a_plain_servers_first_token() -> None:
    p = exact_post(0)
    q = pre(0, math.log(0.4), [(0, math.log(0.4)), (1, math.log(0.3))])
    nt = fidelity.next_token_from_records(q, p)
    assert nt.probs == REF.probs and nt.logprobs == {0: math.log(0.4), 1: math.log(0.3)}
    with pytest.raises(FidelityError):
        fidelity.next_token_from_records(p, q)
