"""`dist.OpenAIEngine` on fake servers: what a real server cannot play (another model, text
outside the fixture's letters, a malformed answer) is a one-line DistError, never a verdict."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

import fakes
from specaudit import distribution, fixtures


class _Handler:
    """An OpenAI-compatible server's /v1/models and completions; keeps every body it got."""

    def __init__(self, models: Any, text: str) -> None:
        self.models = models
        self.text = text
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, req: web.BaseRequest) -> web.StreamResponse:
        if req.path == "/v1/models":
            return web.json_response(self.models)
        self.seen.append(json.loads(await req.read()))
        return web.json_response({"choices": [{"text": self.text, "index": 0}]})


def _handler(models: Any, text: str = "fhag") -> _Handler:
    return _Handler(models, text)


SPEC = fixtures.default_spec()
WL = distribution.make_workload(SPEC)
FIXTURE_MODELS = {"data": [{"id": "/somewhere/target.gguf"}]}


def test_body_sets_every_knob_and_neutral_penalties() -> None:
    h = _handler(FIXTURE_MODELS)
    with fakes.serve(h) as s:
        eng = distribution.OpenAIEngine(s.url, SPEC, WL)
        (sample,) = distribution.collect(eng, [7])
    (body,) = h.seen
    assert sample.text == "fhag" and sample.drafted is None
    assert body["seed"] == 7 and body["model"] == "/somewhere/target.gguf"
    assert (body["top_k"], body["top_p"], body["min_p"], body["temperature"]) == (3, 1.0, 0.0, 1.0)
    assert body["repeat_penalty"] == 1.0 and body["presence_penalty"] == 0.0
    assert body["max_tokens"] == WL.tokens and body["prompt"] == SPEC.prompt


def test_alias_with_the_fixture_name_is_accepted() -> None:
    with fakes.serve(_handler({"data": [{"id": f"{SPEC.name}-alias"}]})) as s:
        assert distribution.fixture_model(s.url, SPEC) == f"{SPEC.name}-alias"


@pytest.mark.parametrize(
    ("models", "match"),
    [
        ({"data": [{"id": "gpt-4o"}]}, "not the fixture"),
        ({"data": []}, "lists no model"),
        ({"data": [{"id": "x/target.gguf", "meta": {"n_vocab": 262144}}]}, "262144 tokens"),
    ],
)
def test_another_model_is_refused(models: Any, match: str) -> None:
    with fakes.serve(_handler(models)) as s, pytest.raises(distribution.DistError, match=match):
        distribution.OpenAIEngine(s.url, SPEC, WL)


@pytest.mark.parametrize("text", ["fh g", "FHAG", "fhé"])
def test_text_outside_the_letters_is_an_error(text: str) -> None:
    with fakes.serve(_handler(FIXTURE_MODELS, text)) as s:
        eng = distribution.OpenAIEngine(s.url, SPEC, WL)
        with pytest.raises(distribution.DistError, match="not fixture letters"):
            distribution.collect(eng, [1])


def test_short_text_is_an_outcome_not_an_error() -> None:
    # a server that stopped early (EOS): outcomes of probability 0, judged BROKEN
    with fakes.serve(_handler(FIXTURE_MODELS, "fh")) as s:
        res = distribution.measure(
            distribution.OpenAIEngine(s.url, SPEC, WL), SPEC, WL, range(1, 21)
        )
    assert res.verdict.value == "BROKEN"


def test_url_and_openai_need_url_and_url_needs_them() -> None:
    with pytest.raises(distribution.DistError, match="--engine openai needs --url"):
        distribution.make_request(["openai"], fixture=distribution.load_fixture(None), seeds=10)
    with pytest.raises(distribution.DistError, match="--url applies"):
        distribution.make_request(["server"], url=["http://127.0.0.1:1"], seeds=10)
