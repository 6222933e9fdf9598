"""The proxy's forwarding core (`proxy.forwarding`, `proxy.wire`): strict framing, and requests it
serves itself or hands to aiohttp's path, against in-process fake backends."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from aiohttp import web

import fakes
from proxy_helpers import metric
from specaudit.proxy import (
    ProxyConfig,
    RunningProxy,
    forwarding,
    http1,
    pool,
    serve_in_thread,
    wire,
)

PATHS = forwarding.PATHS
HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8081\r\nContent-Type: application/json\r\n"
    b"Content-Length: 12\r\n"
)


# request heads -----------------------------------------------------------------------------


def parse(head: bytes) -> http1.RequestHead | None:
    """As `forwarding.Front` reads a request: its head lines, then the blank line. None: the core
    hands it to aiohttp."""
    try:
        h = http1.RequestReader().feed(head + b"\r\n", PATHS)
    except http1.NotPlain:
        return None
    assert h is not None, "a complete head was read as incomplete"
    return h


def test_a_plain_post_is_taken() -> None:
    assert parse(HEAD) is not None
    h = parse(HEAD + b"Authorization: Bearer k\r\n")
    assert h is not None
    assert (h.path, h.length, h.close, h.authorization, h.end) == (
        "/v1/completions",
        12,
        False,
        b"Bearer k",
        len(HEAD) + len(b"Authorization: Bearer k\r\n") + 2,
    )
    closing = parse(HEAD + b"Connection: keep-alive, Close\r\n")
    assert closing is not None and closing.close


@pytest.mark.parametrize(
    "head",
    [
        HEAD.replace(b"POST", b"GET"),
        HEAD.replace(b"HTTP/1.1", b"HTTP/1.0"),
        HEAD.replace(b"/v1/completions", b"/v1/completions?x=1"),
        HEAD.replace(b"/v1/completions", b"/health"),
        HEAD.replace(b"/v1/completions", b"/v1/models"),
        HEAD.replace(b"Content-Length: 12", b"Transfer-Encoding: chunked"),
        HEAD + b"Transfer-Encoding: chunked\r\n",
        HEAD + b"Content-Length: 12\r\n",  # two of them
        HEAD.replace(b"12", b"+12"),
        HEAD.replace(b"Content-Length: 12\r\n", b""),
        HEAD + b"Expect: 100-continue\r\n",
        HEAD + b"Upgrade: websocket\r\nConnection: Upgrade\r\n",
        HEAD + b" folded\r\n",  # obs-fold
        HEAD + b"X-Name: caf\xc3\xa9\r\n",  # not ASCII: aiohttp decides
        HEAD + b"Bad Name: x\r\n",
        HEAD + b"Authorization: a\r\nAuthorization: b\r\n",
        HEAD.replace(b"\r\n", b"\n"),  # bare LF
        HEAD.replace(b"Host: 127.0.0.1:8081\r\n", b"Host: x\n"),  # one bare LF
        HEAD + b"X-A: a\rb\r\n",  # bare CR
        HEAD + b"X-A: a\x00b\r\n",
        b"\r\n" + HEAD,  # a blank line first: aiohttp skips it
        HEAD + b"X-Long: " + b"a" * wire.MAX_HEAD + b"\r\n",  # over the head limit
        HEAD.replace(b"Host: 127.0.0.1:8081\r\n", b""),  # HTTP/1.1 without Host: aiohttp's 400
        HEAD + b"Host: y\r\n",
        HEAD + b"Content-Type: text/plain\r\n",  # a second one: aiohttp's 400
        HEAD + b"Content-Encoding: gzip\r\n",
        HEAD + b"".join(b"X-%d: 1\r\n" % i for i in range(http1.MAX_HEADERS)),
        HEAD.replace(b"POST /", b"POST  /"),  # llhttp takes runs of spaces: not the plain form
    ],
)
def test_anything_else_goes_to_aiohttp(head: bytes) -> None:
    assert parse(head) is None


def test_the_head_limit_holds_however_the_bytes_arrive() -> None:
    """A head over `wire.MAX_HEAD` is handed over whether it comes in one write or many
    (it used to be served when its blank line came in the same write)."""
    head = HEAD + b"X-Long: " + b"a" * 100_000 + b"\r\n\r\n"
    for step in (len(head), 2048, 1):
        r = http1.RequestReader()
        got: object = None
        for i in range(step, len(head) + step, step):
            try:
                got = r.feed(head[:i], PATHS)
            except http1.NotPlain:
                got = "hand over"
                break
            assert got is None
        assert got == "hand over", step
    # just under the limit, in any split: taken
    fill = wire.MAX_HEAD - len(HEAD) - len(b"X-Long: \r\n\r\n")
    head = HEAD + b"X-Long: " + b"a" * fill + b"\r\n\r\n"
    assert len(head) == wire.MAX_HEAD
    for step in (len(head), 1000, 7):
        r = http1.RequestReader()
        for i in range(step, len(head) + step, step):
            got = r.feed(head[:i], PATHS)
        assert isinstance(got, http1.RequestHead) and got.end == len(head)


def test_a_complete_bare_lf_request_is_handed_over_at_once() -> None:
    """llhttp (and so aiohttp) refuses bare LF line ends; the core hands such a request over
    as soon as its first bare LF arrives instead of waiting for a CRLF CRLF."""
    r = http1.RequestReader()
    with pytest.raises(http1.NotPlain):
        r.feed(b"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: 2\n\nab", PATHS)


# response heads and chunked bodies ----------------------------------------------------------


def read(raw: bytes) -> http1.ResponseReader:
    r = http1.ResponseReader()
    r.feed(raw)
    return r


def response_head(raw: bytes) -> http1.ResponseHead:
    """The head of a response (without its blank line), or ValueError as the core sees it."""
    r = read(raw + b"\r\n\r\n")
    if r.error is not None:
        raise ValueError(r.error)
    assert r.head is not None
    return r.head


def test_response_heads() -> None:
    h = response_head(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
        b"Content-Length: 40\r\nKeep-Alive: timeout=5, max=100"
    )
    assert (h.status, h.mime, h.length, h.chunked, h.close) == (
        200,
        "application/json",
        40,
        False,
        False,
    )
    s = response_head(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked"
    )
    assert s.chunked and s.length is None and not s.close
    assert response_head(b"HTTP/1.0 200 OK\r\nContent-Length: 1").close
    assert response_head(b"HTTP/1.1 200 OK").close  # body until close
    assert response_head(b"HTTP/1.1 503 x\r\nConnection: close\r\nContent-Length: 0").close
    for bad in (
        b"\x00\x01SSH-2.0-nope",
        b"HTTP/1.1 20 OK",
        b"HTTP/2 200 OK",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
        b"HTTP/1.1 200 OK\r\nno colon here",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked",
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x",
    ):
        with pytest.raises(ValueError):
            response_head(bad)


@pytest.mark.parametrize(
    "value",
    [
        b"application/json\nSet-Cookie: injected=1\nX-Specaudit-Placeholders: 0",
        b"application/json\rSet-Cookie: injected=1\rX-Specaudit-Placeholders: 0",
        b"application/json\x00",
        b"application/json\x0b",
    ],
)
def test_a_header_value_with_a_control_character_is_a_bad_answer(value: bytes) -> None:
    r = read(b"HTTP/1.1 200 OK\r\nContent-Type: " + value + b"\r\nContent-Length: 2\r\n\r\n{}")
    assert r.error is not None and r.head is None and not r.complete


def test_1xx_responses_before_the_answer_are_skipped() -> None:
    raw = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n"
        b"\r\nHTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )
    for step in (len(raw), 5, 1):
        r = http1.ResponseReader()
        body = b""
        for i in range(0, len(raw), step):
            r.feed(raw[i : i + step])
            body += r.take()
            assert r.error is None
        assert r.head is not None and r.head.status == 200 and r.complete and body == b"{}"


def test_a_1xx_with_a_body_is_a_bad_answer() -> None:
    """llhttp reads a body for a 199 with Content-Length, h11 (and RFC 9110) never: such an
    answer is refused rather than read one way or the other (found by differential fuzzing)."""
    r = read(b'HTTP/1.1 199 X\r\nContent-Length: 15\r\n\r\n{"choices": []}HTTP/1.1 200 OK\r\n\r\n')
    assert r.error is not None and not r.complete and r.take() == b""


def _chunked(pieces: list[bytes], ext: bool, trailers: bool) -> bytes:
    out = b""
    for p in pieces:
        out += b"%x%b\r\n%b\r\n" % (len(p), b";name=v" if ext else b"", p)
    return out + b"0\r\n" + (b"X-Trailer: 1\r\n" if trailers else b"") + b"\r\n"


@pytest.mark.parametrize("seed", range(40))
def test_dechunking_survives_any_split(seed: int) -> None:
    rng = random.Random(seed)
    pieces = [rng.randbytes(rng.randint(1, 300)) for _ in range(rng.randint(1, 12))]
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + _chunked(pieces, ext=seed % 3 == 0, trailers=seed % 2 == 0)
        + b"EXTRA" * (seed % 4 == 1)
    )
    r = http1.ResponseReader()
    got = b""
    i = 0
    while i < len(raw):
        k = rng.randint(1, 40)
        r.feed(raw[i : i + k])
        got += r.take()
        i += k
    assert r.complete and r.error is None and got == b"".join(pieces)
    assert r.extra == (seed % 4 == 1)


@pytest.mark.parametrize(
    "raw", [b"zz\r\nab\r\n", b"2\r\nabX\r\n", b"2" * 5000, b"-1\r\n", b"10000000000000000\r\n"]
)
def test_broken_chunking_is_an_error(raw: bytes) -> None:
    r = read(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + raw)
    assert r.error is not None and not r.complete


def test_body_bytes_before_broken_framing_are_kept() -> None:
    r = read(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n")
    assert r.error is not None and r.take() == b"abc"


def test_response_head_for_the_client() -> None:
    h = wire.response_head(200, [("X-A", "b")], length=3)
    assert h.startswith(b"HTTP/1.1 200 OK\r\nX-A: b\r\nContent-Length: 3\r\nDate: ")
    assert h.endswith(b" GMT\r\n\r\n")
    c = wire.response_head(503, [], length=None, close=True)
    assert b"Transfer-Encoding: chunked\r\nConnection: close\r\n" in c
    assert wire.chunk(b"abc") == b"3\r\nabc\r\n" and wire.LAST_CHUNK == b"0\r\n\r\n"
    for bad in ("a\nSet-Cookie: x=1", "a\rSet-Cookie: x=1", "a\r\nSet-Cookie: x=1", "a\0"):
        with pytest.raises(ValueError):
            wire.response_head(200, [("Content-Type", bad)], length=0)
        with pytest.raises(ValueError):
            wire.response_head(200, [(bad, "b")], length=0)


def test_https_backends_are_left_to_aiohttp() -> None:
    assert pool.target("https://example.com:8443/x") is None
    t = pool.target("http://127.0.0.1:8080/prefix")
    assert t is not None and (t.host, t.port, t.prefix_b) == ("127.0.0.1", 8080, b"/prefix")


# through a proxy ------------------------------------------------------------------------------


@contextmanager
def proxy_over(spec_handler: fakes.Handler, loop: str = "auto") -> Iterator[RunningProxy]:
    with (
        fakes.serve(fakes.Fake("ok")) as plain,
        fakes.serve(spec_handler) as spec,
        serve_in_thread(ProxyConfig(plain.url, spec.url, port=0, check_interval=3600), loop) as p,
    ):
        yield p


BODY = json.dumps({"prompt": "a", "max_tokens": 1}).encode()


def raw_request(body: bytes = BODY, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%b\r\n%b" % (len(body), extra, body)
    )


def read_responses(sock: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """`n` Content-Length responses read off a socket: (status, body)."""
    buf = b""
    out: list[tuple[int, bytes]] = []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(out)} responses: {buf!r}"
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        m = re.search(rb"(?i)content-length: (\d+)", head)
        assert m is not None, head
        length = int(m[1])
        while len(buf) < length:
            buf += sock.recv(65536)
        out.append((int(head.split()[1]), buf[:length]))
        buf = buf[length:]
    return out


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_kept_alive_requests_are_served_by_the_core(loop: str) -> None:
    with proxy_over(fakes.Fake("ok", speculative=True), loop) as p, httpx.Client() as c:
        for _ in range(20):
            r = c.post(p.url + "/v1/completions", content=BODY)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a"
            assert r.headers["x-specaudit-backend"] == "spec"
        assert metric(p, "fast_path_total") == {'{outcome="served"}': 20}
        reqs = metric(p, "requests_total")
        assert (
            reqs['{endpoint="/v1/completions",route="default",backend="spec",status="200"}'] == 20
        )


def test_pipelined_requests_are_answered_in_order() -> None:
    with proxy_over(fakes.Fake("ok", speculative=True)) as p:
        host, port = p.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            bad = b'{"prompt": 1}'  # refused by the routing rules: aiohttp's path answers 400
            s.sendall(raw_request() + raw_request() + raw_request(bad) + raw_request())
            got = read_responses(s, 4)
        assert [st for st, _ in got] == [200, 200, 400, 200]
        assert "prompt" in json.loads(got[2][1])["error"]["message"]
        # the core served the first two; the refused one moved the connection to aiohttp
        assert metric(p, "fast_path_total") == {'{outcome="served"}': 2}


def test_a_chunked_request_and_health_on_the_same_connection() -> None:
    with proxy_over(fakes.Fake("ok", speculative=True)) as p:
        host, port = p.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            chunked = (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"%x\r\n%b\r\n0\r\n\r\n" % (len(BODY), BODY)
            )
            s.sendall(raw_request() + chunked)
            got = read_responses(s, 2)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            health = read_responses(s, 1)
        assert [st for st, _ in got] == [200, 200] and health[0][0] == 200
        assert json.loads(health[0][1])["status"] == "ok"


def test_a_stream_is_relayed_as_its_events_arrive() -> None:
    """Each event reaches the client before the backend sends the next: the backend waits
    (bounded) for the client to have seen event i before it writes event i + 1, so a proxy
    that held events back would make every wait run out, and the test says so."""
    events = [b'data: {"choices":[{"index":0,"text":"%d"}]}\n\n' % i for i in range(5)]
    seen: list[threading.Event] = []
    waits_ran_out: list[int] = []

    async def spec(request: web.BaseRequest) -> web.StreamResponse:
        if request.path in ("/slots", "/health"):
            body = [{"id": 0, "speculative": True}] if request.path == "/slots" else {}
            return web.json_response(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, ev in enumerate(events):
            if i and not await asyncio.to_thread(seen[i - 1].wait, 10):
                waits_ran_out.append(i - 1)
            await resp.write(ev)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    with proxy_over(spec) as p, httpx.Client(timeout=60) as c:
        body = json.dumps({"prompt": "a", "stream": True}).encode()
        for _ in range(3):  # kept alive across streams
            seen[:] = [threading.Event() for _ in events]
            got = b""
            with c.stream("POST", p.url + "/v1/completions", content=body) as r:
                assert r.status_code == 200
                assert r.headers["content-type"] == "text/event-stream"
                for piece in r.iter_raw():
                    got += piece
                    for i in range(len(events)):
                        if got.startswith(b"".join(events[: i + 1])):
                            seen[i].set()
            assert got == b"".join(events) + b"data: [DONE]\n\n"  # byte for byte
            assert waits_ran_out == [], f"events {waits_ran_out} reached the client late"
        assert metric(p, "fast_path_total") == {'{outcome="served"}': 3}


def test_a_slow_reader_of_a_big_answer_does_not_stall_the_pooled_connection() -> None:
    """Writing a big JSON answer to a client that is not reading pauses nothing upstream:
    the backend connection goes back to the pool readable, and the next request on it is
    answered (it used to wait for the read timeout)."""
    big = {"choices": [{"index": 0, "text": "x" * (8 << 20)}]}

    async def spec(request: web.BaseRequest) -> web.StreamResponse:
        if request.path in ("/slots", "/health"):
            body = [{"id": 0, "speculative": True}] if request.path == "/slots" else {}
            return web.json_response(body)
        data = await request.json()
        return web.json_response(big if data["prompt"] == "big" else {"choices": []})

    with (
        fakes.serve(fakes.Fake("ok")) as plain,
        fakes.serve(spec) as backend,
        serve_in_thread(
            ProxyConfig(plain.url, backend.url, port=0, check_interval=3600, read_timeout=3.0)
        ) as p,
    ):
        host, port = p.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(raw_request(json.dumps({"prompt": "big"}).encode()))
            time.sleep(1.0)  # not reading: the proxy's writes to this client back up
            ((status, body),) = read_responses(s, 1)
            assert status == 200 and len(body) > 8 << 20
        r = httpx.post(p.url + "/v1/completions", content=BODY, timeout=20)
        # a stalled connection would get the 3 s read timeout's 504
        assert r.status_code == 200 and r.json() == {"choices": []}, r.text
        assert metric(p, "fast_path_total") == {'{outcome="served"}': 2}
