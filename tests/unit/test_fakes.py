"""The fake servers of tests/fakes.py do what the tests built on them rely on: `serve` always
stops, the proxy backends' modes behave, the relay records what the server sent, a canned
handler answers alike over a socket and through the transport."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp import web

from fakes import (
    URL,
    Answer,
    Asked,
    CannedTransport,
    Fake,
    Relay,
    http_body,
    not_http,
    serve,
    serve_tcp,
    serving,
)


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


def _echo(asked: Asked) -> Answer:
    body = f"{asked.method} {asked.path} {asked.body.decode()}".encode()
    return Answer(body, 418 if asked.path == "/teapot" else 200, "text/plain")


def _seen(r: httpx.Response) -> tuple[int, str, str]:
    return r.status_code, r.headers["content-type"].split(";")[0], r.text


def test_a_canned_handler_answers_alike_over_a_socket_and_through_the_transport() -> None:
    def ask(c: httpx.Client, base: str) -> list[tuple[int, str, str]]:
        return [
            _seen(c.post(base + "/teapot?q=1", content=b"tea")),
            _seen(c.get(base + "/x")),
        ]

    with serve(serving(_echo)) as srv, httpx.Client() as sock:
        over_socket = ask(sock, srv.url)
    with httpx.Client(transport=CannedTransport(_echo)) as mock:
        assert ask(mock, URL) == over_socket

    async def ask_async() -> tuple[int, str, str]:
        async with httpx.AsyncClient(transport=CannedTransport(_echo)) as c:
            return _seen(await c.post(URL + "/teapot?q=1", content=b"tea"))

    assert asyncio.run(ask_async()) == over_socket[0] == (418, "text/plain", "POST /teapot tea")


def test_a_delayed_answer_keeps_async_requests_in_flight_together() -> None:
    """An answer's delay is slept without holding the event loop: every request is asked
    before the first is answered (what a test of in-flight sharing needs)."""
    order: list[str] = []

    def slow(asked: Asked) -> Answer:
        order.append("asked")
        return Answer.json({}, delay=0.05)

    async def go() -> None:
        async with httpx.AsyncClient(transport=CannedTransport(slow)) as c:

            async def one() -> None:
                await c.get(URL + "/x")
                order.append("answered")

            await asyncio.gather(one(), one(), one())

    asyncio.run(go())
    assert order == ["asked"] * 3 + ["answered"] * 3
