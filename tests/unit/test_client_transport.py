"""`Client` and `AsyncClient` send through the transport they are given, else through
`client.default_transport`, else real sockets: code above them is tested with canned answers
(tests/fakes.py) and no server, through the same URL, JSON, SSE and error handling as on a
socket."""

from __future__ import annotations

import asyncio

import pytest

from fakes import URL, Answer, Asked, CannedTransport, route_clients
from specaudit.client import AsyncClient, Client, ClientError

SSE = b'data: {"content": "a"}\n\ndata: {"content": "b", "stop": true}\n\ndata: [DONE]\n\n'


def _llm(asked: Asked) -> Answer:
    if asked.path == "/props":
        return Answer.json({"build": 1})
    if asked.path == "/completion" and asked.json().get("stream"):
        return Answer(SSE, content_type="text/event-stream")
    if asked.path == "/completion":
        return Answer.json({"content": asked.json()["prompt"]})
    return Answer.json({"error": {"message": "no such endpoint"}}, 404)


def test_a_client_given_a_transport_gets_posts_and_streams_through_it() -> None:
    with Client(URL, transport=CannedTransport(_llm)) as c:
        assert c.get("/props") == {"build": 1}
        assert c.post("/completion", {"prompt": "hi"}) == {"content": "hi"}
        out = c.stream("/completion", {"prompt": "hi"})
        with pytest.raises(ClientError, match=r"/nope answered HTTP 404: no such endpoint"):
            c.get("/nope")
    assert [e["content"] for e in out.events] == ["a", "b"] and out.done and out.raw == SSE


def test_an_async_client_given_a_transport_posts_through_it() -> None:
    async def go() -> dict[str, object]:
        async with AsyncClient(URL, transport=CannedTransport(_llm)) as c:
            return await c.post("/completion", {"prompt": "hi"})

    assert asyncio.run(go()) == {"content": "hi"}


def test_clients_built_without_a_transport_use_the_default_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = route_clients(monkeypatch, _llm)
    with Client(url) as c:
        assert c.get("/props") == {"build": 1}

    async def go() -> dict[str, object]:
        async with AsyncClient(url) as c:
            return await c.get("/props")

    assert asyncio.run(go()) == {"build": 1}
    # a transport given explicitly wins over the default
    other = CannedTransport(lambda asked: Answer.json({"build": 2}))
    with Client(url, transport=other) as c:
        assert c.get("/props") == {"build": 2}
