"""Schema normalisation on real llama-server b11434 responses (tests/data/responses/check-*.json,
recorded by tests/data/responses/record.py), plus the few shapes llama-server never sends."""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from specaudit import logprobs
from specaudit.client import parse_sse
from specaudit.logprobs import Missing, TokenClass, TokenRecord

DATA = Path(__file__).parents[1] / "data" / "responses"
KINDS = ("chat", "completions", "native", "native-post")


@cache
def recorded(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"check-{name}.json").read_text())


def endpoint(kind: str) -> str:
    return "completion" if kind.startswith("native") else kind


def parsed(name: str, kind: str, stream: bool) -> list[TokenRecord]:
    d = recorded(name)[kind]
    if stream:
        events = parse_sse(d["stream_sse"].encode()).events
        return logprobs.from_stream(endpoint(kind), events, 3)
    return logprobs.from_response(endpoint(kind), d["response"], 3)


def predicted_n(name: str, kind: str) -> int:
    return int(recorded(name)[kind]["response"]["timings"]["predicted_n"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["fixture-plain", "gemma-plain"])
def test_plain_server_every_token_real(name: str, kind: str, stream: bool) -> None:
    recs = parsed(name, kind, stream)
    assert len(recs) == predicted_n(name, kind)
    assert all(r.klass is TokenClass.REAL for r in recs)
    assert all(r.logprob is not None for r in recs)
    # post-sampling lists only what survives the sampler chain (one when top-k leaves one)
    want = range(1, 4) if kind == "native-post" else range(3, 4)
    assert all(r.n_candidates in want for r in recs)
    assert [r.index for r in recs] == list(range(len(recs)))
    c = logprobs.counts(recs)
    assert (c.real, c.placeholder, c.coverage) == (len(recs), 0, 1.0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["fixture-spec", "gemma-spec"])
def test_speculating_server_placeholders_after_first(name: str, kind: str, stream: bool) -> None:
    recs = parsed(name, kind, stream)
    assert len(recs) == predicted_n(name, kind)
    first, rest = recs[0], recs[1:]
    assert first.is_first and first.klass is TokenClass.REAL and first.logprob is not None
    # every later token came from the speculative loop in these recordings (23 of 24 on Gemma)
    assert all(r.klass is TokenClass.PLACEHOLDER for r in rest)
    assert all(r.logprob is None and r.n_candidates == 0 for r in rest)
    if stream:
        # streamed placeholders carry no probability entry at all
        assert all(r.reported_logprob is None for r in rest)
    else:
        # non-streamed ones say logprob 0.0 (or prob 1.0): the value a trusting client reads
        assert all(r.reported_logprob == 0.0 for r in rest)


def test_gemma_spec_is_the_reports_23_of_24() -> None:
    c = logprobs.counts(parsed("gemma-spec", "chat", False))
    assert (c.total, c.real, c.placeholder) == (24, 1, 23)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["fixture-plain", "fixture-spec", "gemma-plain", "gemma-spec"])
def test_stream_and_non_stream_agree(name: str, kind: str) -> None:
    a, b = parsed(name, kind, False), parsed(name, kind, True)
    assert [r.token for r in a] == [r.token for r in b]
    assert [r.klass for r in a] == [r.klass for r in b]
    assert [r.logprob for r in a] == [r.logprob for r in b]


def test_ngram_response_mixes_real_and_placeholder() -> None:
    for stream in (False, True):
        recs = parsed("gemma-ngram", "chat", stream)
        c = logprobs.counts(recs)
        assert c.real + c.placeholder == c.total == predicted_n("gemma-ngram", "chat") == 48
        assert (c.real, c.placeholder) == (18, 30)
        # real tokens also appear after the first: the n-gram drafter only drafts repeats
        assert any(r.klass is TokenClass.REAL for r in recs[1:])


def test_native_fields_preserved() -> None:
    recs = parsed("gemma-plain", "native", False)
    raw = recorded("gemma-plain")["native"]["response"]["completion_probabilities"]
    for r, e in zip(recs, raw, strict=True):
        assert r.token == e["token"] and r.token_id == e["id"] and r.form == "logprob"
        assert r.logprob == e["logprob"]
        assert [c.token for c in r.candidates] == [c["token"] for c in e["top_logprobs"]]
        assert [c.token_id for c in r.candidates] == [c["id"] for c in e["top_logprobs"]]


def test_post_sampling_form() -> None:
    recs = parsed("gemma-plain", "native-post", False)
    raw = recorded("gemma-plain")["native-post"]["response"]["completion_probabilities"]
    for r, e in zip(recs, raw, strict=True):
        assert r.form == "prob" and r.prob == e["prob"]
        assert r.logprob == pytest.approx(math.log(e["prob"]))
        assert [c.prob for c in r.candidates] == [c["prob"] for c in e["top_probs"]]
    # prob 1.0 WITH a candidate is a real certainty (post-sampling top-k leaves one), not a
    # placeholder: this recording has such tokens
    certain = [r for r in recs if r.prob == 1.0]
    assert certain and all(r.klass is TokenClass.REAL and r.logprob == 0.0 for r in certain)
    spec = parsed("gemma-spec", "native-post", False)
    assert all(r.form == "prob" and r.prob is None for r in spec[1:])
    assert all(r.reported_logprob == 0.0 for r in spec[1:])  # log of the prob 1.0 sent


def test_zero_logprob_with_candidates_is_real() -> None:
    # synthetic: the report's 1B model returned ',' at logprob 0 with three candidates
    body = {
        "choices": [
            {
                "logprobs": {
                    "content": [
                        {
                            "token": ",",
                            "logprob": 0.0,
                            "top_logprobs": [
                                {"token": ",", "logprob": 0.0},
                                {"token": ".", "logprob": -17.0},
                                {"token": ";", "logprob": -18.0},
                            ],
                        },
                        {"token": " let", "logprob": 0.0, "top_logprobs": []},
                    ]
                }
            }
        ]
    }
    a, b = logprobs.from_response("chat", body, 3)
    assert a.klass is TokenClass.REAL and a.logprob == 0.0
    assert b.klass is TokenClass.PLACEHOLDER and b.logprob is None and b.reported_logprob == 0.0


def test_unchecked_when_no_candidates_requested() -> None:
    body = {"choices": [{"logprobs": {"content": [{"token": "a", "logprob": 0.0}]}}]}
    (r,) = logprobs.from_response("chat", body, 0)
    assert r.klass is TokenClass.UNCHECKED and r.logprob == 0.0


def test_openai_legacy_completions_and_stream() -> None:
    # OpenAI's legacy /v1/completions shape (llama-server sends the chat-style one instead)
    lp = {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, 0.0],
        "top_logprobs": [{"a": -0.5, "c": -1.2}, {}],
        "text_offset": [0, 1],
    }
    recs = logprobs.from_response("completions", {"choices": [{"logprobs": lp}]}, 2)
    assert [r.klass for r in recs] == [TokenClass.REAL, TokenClass.PLACEHOLDER]
    assert recs[0].candidates[1].token == "c" and recs[1].logprob is None
    events: list[dict[str, Any]] = [
        {
            "choices": [
                {"text": "a", "logprobs": {**lp, "tokens": ["a"], "top_logprobs": [{"a": -0.5}]}}
            ]
        },
        {"choices": [{"text": "b", "logprobs": None}]},
        {
            "choices": [
                {
                    "text": "c",
                    "logprobs": {
                        "tokens": ["c"],
                        "token_logprobs": [-1.0],
                        "top_logprobs": [{"c": -1.0}],
                    },
                }
            ]
        },
    ]
    recs = logprobs.from_stream("completions", events, 2)
    assert [r.index for r in recs] == [0, 1, 2]
    assert [r.token for r in recs] == ["a", "b", "c"]
    assert [r.klass for r in recs] == [TokenClass.REAL, TokenClass.PLACEHOLDER, TokenClass.REAL]


def test_missing_policies() -> None:
    recs = parsed("gemma-spec", "chat", False)
    first = recs[0].logprob
    assert first is not None
    assert logprobs.mean_logprob(recs, Missing.SKIP) == pytest.approx(first)
    # what a trusting client computes: 23 zeros pull the mean towards certainty
    assert logprobs.mean_logprob(recs, Missing.NAIVE) == pytest.approx(first / 24)
    with pytest.raises(logprobs.MissingLogprobError):
        logprobs.mean_logprob(recs, Missing.RAISE)
    streamed = parsed("gemma-spec", "chat", True)
    assert logprobs.values(streamed, Missing.NAIVE)[1:] == [0.0] * 23
    plain = parsed("gemma-plain", "chat", False)
    assert logprobs.mean_logprob(plain, Missing.RAISE) == logprobs.mean_logprob(plain)
    assert logprobs.mean_logprob([], Missing.SKIP) is None


def test_stream_reasoning_tokens_count() -> None:
    events: list[dict[str, Any]] = [
        {"choices": [{"delta": {"role": "assistant", "content": None}}]},
        {"choices": [{"delta": {"reasoning_content": "Hm"}}]},
        {"choices": [{"delta": {"content": "Hi"}}]},
        {"choices": [{"delta": {}, "finish_reason": "stop"}]},
    ]
    recs = logprobs.from_stream("chat", events, 3)
    assert [(r.token, r.klass) for r in recs] == [
        ("Hm", TokenClass.PLACEHOLDER),
        ("Hi", TokenClass.PLACEHOLDER),
    ]


def test_empty_and_foreign_bodies() -> None:
    assert logprobs.from_response("chat", {}, 3) == []
    assert logprobs.from_response("chat", {"choices": [{"logprobs": None}]}, 3) == []
    assert logprobs.from_response("completion", {"content": "x"}, 3) == []
    assert logprobs.from_stream("chat", [{"choices": []}, {"foo": 1}], 3) == []
