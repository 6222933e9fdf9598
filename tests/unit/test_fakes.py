"""The fake servers of tests/fakes.py do what the tests built on them rely on: `serve` always
stops, the proxy backends' modes behave, the relay records what the server sent."""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web

from fakes import Fake, Relay, http_body, not_http, serve, serve_tcp


async def _hello(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response(body=b"hello " + request.path.encode(), content_type="text/plain")


def test_serve_answers_on_loopback_and_always_stops() -> None:
    with serve(_hello) as srv:
        assert srv.url == f"http://127.0.0.1:{srv.port}"
        assert httpx.get(srv.url + "/x").text == "hello /x"
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/x")
    # an exception inside the block stops the server too
    with pytest.raises(RuntimeError, match="inside"), serve(_hello) as srv2:
        raise RuntimeError("inside")
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv2.url + "/x")


def test_endless_stream_notices_the_client_leaving() -> None:
    fake = Fake("endless-stream")
    with serve(fake) as srv:
        assert httpx.get(srv.url + "/slots").json() == [{"id": 0, "speculative": False}]
        with httpx.stream("POST", srv.url + "/v1/completions", content=b'{"stream": true}') as r:
            assert next(r.iter_bytes()).startswith(b"data:")
        assert fake.stream_started.is_set()
        assert fake.stream_closed.wait(5)
    assert [h.path for h in fake.hits] == ["/slots", "/v1/completions"]


def test_slow_answers_late() -> None:
    with serve(Fake("slow", delay=0.3)) as srv:
        r = httpx.post(srv.url + "/v1/completions", content=b"{}")
        assert r.json()["choices"][0]["text"] == "late"


def test_not_http_is_not_http() -> None:
    with serve_tcp(not_http) as srv, httpx.Client() as c, pytest.raises(httpx.HTTPError):
        c.get(srv.url + "/health")


def test_relay_records_what_the_server_sent() -> None:
    with serve(Fake("ok")) as backend:
        relay = Relay(backend.port)
        with serve_tcp(relay) as front:
            r = httpx.post(front.url + "/v1/completions", content=b"{}")
        assert r.json() == {"choices": [{"index": 0, "text": "a"}]}
        (raw,) = relay.responses
        assert raw.startswith(b"HTTP/1.1 200") and http_body(raw) == r.content
