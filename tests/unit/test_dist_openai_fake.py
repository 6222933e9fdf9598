"""`dist.OpenAIEngine` on canned servers (tests/fakes.py, through the client's transport, no
socket): what a real server cannot play (another model, text outside the fixture's letters, a
malformed answer) is a one-line DistError, never a verdict."""

from __future__ import annotations

from typing import Any

import pytest

import fakes
from fakes import Answer, Asked
from specaudit import distribution, fixtures


class _Handler:
    """An OpenAI-compatible server's /v1/models and completions; keeps every body it got."""

    def __init__(self, models: Any, text: str) -> None:
        self.models = models
        self.text = text
        self.seen: list[dict[str, Any]] = []

    def __call__(self, asked: Asked) -> Answer:
        if asked.path == "/v1/models":
            return Answer.json(self.models)
        self.seen.append(asked.json())
        return Answer.json({"choices": [{"text": self.text, "index": 0}]})


def _handler(models: Any, text: str = "fhag") -> _Handler:
    return _Handler(models, text)


SPEC = fixtures.default_spec()
WL = distribution.make_workload(SPEC)
FIXTURE_MODELS = {"data": [{"id": "/somewhere/target.gguf"}]}


def test_body_sets_every_knob_and_neutral_penalties(monkeypatch: pytest.MonkeyPatch) -> None:
    h = _handler(FIXTURE_MODELS)
    eng = distribution.OpenAIEngine(fakes.route_clients(monkeypatch, h), SPEC, WL)
    (sample,) = distribution.collect(eng, [7])
    (body,) = h.seen
    assert sample.text == "fhag" and sample.drafted is None
    assert body["seed"] == 7 and body["model"] == "/somewhere/target.gguf"
    assert (body["top_k"], body["top_p"], body["min_p"], body["temperature"]) == (3, 1.0, 0.0, 1.0)
    assert body["repeat_penalty"] == 1.0 and body["presence_penalty"] == 0.0
    assert body["max_tokens"] == WL.tokens and body["prompt"] == SPEC.prompt


def test_alias_with_the_fixture_name_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    url = fakes.route_clients(monkeypatch, _handler({"data": [{"id": f"{SPEC.name}-alias"}]}))
    assert distribution.fixture_model(url, SPEC) == f"{SPEC.name}-alias"


@pytest.mark.parametrize(
    ("models", "match"),
    [
        ({"data": [{"id": "gpt-4o"}]}, "not the fixture"),
        ({"data": []}, "lists no model"),
        ({"data": [{"id": "x/target.gguf", "meta": {"n_vocab": 262144}}]}, "262144 tokens"),
    ],
)
def test_another_model_is_refused(models: Any, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    url = fakes.route_clients(monkeypatch, _handler(models))
    with pytest.raises(distribution.DistError, match=match):
        distribution.OpenAIEngine(url, SPEC, WL)


@pytest.mark.parametrize("text", ["fh g", "FHAG", "fhé"])
def test_text_outside_the_letters_is_an_error(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = distribution.OpenAIEngine(
        fakes.route_clients(monkeypatch, _handler(FIXTURE_MODELS, text)), SPEC, WL
    )
    with pytest.raises(distribution.DistError, match="not fixture letters"):
        distribution.collect(eng, [1])


def test_short_text_is_an_outcome_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # a server that stopped early (EOS): outcomes of probability 0, judged BROKEN
    url = fakes.route_clients(monkeypatch, _handler(FIXTURE_MODELS, "fh"))
    res = distribution.measure(distribution.OpenAIEngine(url, SPEC, WL), SPEC, WL, range(1, 21))
    assert res.verdict.value == "BROKEN"


def test_url_and_openai_need_url_and_url_needs_them() -> None:
    with pytest.raises(distribution.DistError, match="--engine openai needs --url"):
        distribution.make_request(["openai"], fixture=distribution.load_fixture(None), seeds=10)
    with pytest.raises(distribution.DistError, match="--url applies"):
        distribution.make_request(["server"], url=["http://127.0.0.1:1"], seeds=10)
