"""Framing the forwarding core once got wrong, against raw-TCP backends and raw clients.

Each case goes through the core (a plain ``POST``) and, where a backend's answer is tested,
through aiohttp's path too (the same request with a chunked body, which the core hands over),
and both must give the client the same answer:

- a backend header value holding a bare LF or CR cannot add headers (``Set-Cookie``, a forged
  ``X-Specaudit-Placeholders``) to the client's response;
- a 1xx before the answer is skipped, and the backend generates once;
- a stream ends right after ``data: [DONE]``, with no error event after it, even when the
  backend then breaks its framing or holds the connection open;
- complete events that arrive in the same read as broken framing are forwarded before the
  error event; a non-streamed body whose framing breaks is a 502, not a hang;
- a complete bare-LF request is answered at once (it used to wait for the client timeout);
- a head over the core's limit gets aiohttp's answer however its bytes arrive.

No timing is asserted: the proxy's own timeouts are set far above the client's, so a
proxy that waited for them fails the test by its client timing out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import aiohttp
import httpx
import pytest

import fakes
from specaudit.proxy import H_PLACEHOLDERS, ProxyConfig, RunningProxy, aio_client, serve_in_thread

CLIENT_TIMEOUT = 10.0  # seconds the test's clients wait; the proxy's timeouts are far longer
PROXY_TIMEOUT = 120.0  # --read-timeout and --client-timeout here

# what a raw backend sends for one generation request: bytes, or a float to sleep that long
Script = Sequence[bytes | float]


@dataclass
class RawBackend:
    """A backend answering ``/health`` and ``/slots`` like llama-server, and every generation
    request with `script`'s bytes as they are; `hits` counts generation requests."""

    script: Callable[[], Script]
    speculative: bool = False
    hits: list[bytes] = field(default_factory=list)

    async def __call__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ValueError):
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await r.readexactly(length)
                if path in (b"/health", b"/slots"):
                    body = json.dumps(
                        {"status": "ok"}
                        if path == b"/health"
                        else [{"id": 0, "speculative": self.speculative}]
                    ).encode()
                    w.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
                    )
                    await w.drain()
                    continue
                self.hits.append(path)
                for step in self.script():
                    if isinstance(step, float):
                        await asyncio.sleep(step)
                    else:
                        w.write(step)
                        await w.drain()
        w.close()


@contextlib.contextmanager
def proxy_over(plain: RawBackend, **config: float) -> Iterator[RunningProxy]:
    """A proxy whose plain backend (the logprobs route) is `plain`."""
    cfg: dict[str, Any] = {"read_timeout": PROXY_TIMEOUT, "client_timeout": PROXY_TIMEOUT, **config}
    with (
        fakes.serve_tcp(plain) as p,
        fakes.serve(fakes.Fake("ok", speculative=True)) as spec,
        serve_in_thread(ProxyConfig(p.url, spec.url, port=0, check_interval=3600, **cfg)) as px,
    ):
        yield px


def both_paths(px: RunningProxy, body: dict[str, object]) -> dict[str, httpx.Response]:
    """The same request through the core and through aiohttp's path (a chunked body)."""
    raw = json.dumps(body).encode()
    with httpx.Client(timeout=CLIENT_TIMEOUT) as c:
        return {
            "core": c.post(px.url + "/v1/completions", content=raw),
            "aiohttp": c.post(px.url + "/v1/completions", content=iter([raw])),
        }


LOGPROBS = {"prompt": "a", "max_tokens": 1, "logprobs": 1}
OK_BODY = json.dumps({"choices": [{"index": 0, "text": "a"}]}).encode()
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
    len(OK_BODY),
    OK_BODY,
)
EVENT = b'data: {"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}\n\n'
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def events(body: bytes) -> list[object]:
    """The parsed data of each event of an SSE body."""
    out: list[object] = []
    for ev in body.split(b"\n\n"):
        if ev.startswith(b"data: "):
            data = ev[6:]
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


# a backend's answer ----------------------------------------------------------------------------


@pytest.mark.parametrize("sep", [b"\n", b"\r"], ids=["bare-LF", "bare-CR"])
def test_a_backend_header_value_cannot_add_headers(sep: bytes) -> None:
    injected = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json"
        + sep
        + b"Set-Cookie: injected=1"
        + sep
        + b"X-Specaudit-Placeholders: 0\r\nContent-Length: %d\r\n\r\n%b" % (len(OK_BODY), OK_BODY)
    )
    backend = RawBackend(lambda: [injected])
    with proxy_over(backend) as px:
        got = both_paths(px, LOGPROBS)
    for path, r in got.items():
        assert "set-cookie" not in r.headers, path
        assert len(r.headers.get_list(H_PLACEHOLDERS)) <= 1, path  # never a second, forged one
        for name, value in r.headers.multi_items():
            assert "\r" not in value and "\n" not in value and "injected" not in value, (path, name)
    # the core does not vouch for the answer and says so itself, a JSON 502 (aiohttp's client
    # may accept it); it does not send the request again: once per transport reached the backend
    core = got["core"]
    assert core.status_code == 502 and core.json()["error"]["code"] == 502
    assert backend.hits == [b"/v1/completions"] * 2


def test_a_1xx_before_the_answer_is_skipped_and_the_backend_generates_once() -> None:
    info = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    backend = RawBackend(lambda: [info, 0.02, OK])
    with proxy_over(backend) as px, httpx.Client(timeout=CLIENT_TIMEOUT) as c:
        r = c.post(px.url + "/v1/completions", content=json.dumps(LOGPROBS).encode())
        assert r.status_code == 200 and r.content == OK_BODY
        assert backend.hits == [b"/v1/completions"]  # once: not given back and sent again
        backend.hits.clear()
        r = c.post(px.url + "/v1/completions", content=iter([json.dumps(LOGPROBS).encode()]))
        assert r.status_code == 200 and r.content == OK_BODY
        assert backend.hits == [b"/v1/completions"]


STREAM = {**LOGPROBS, "stream": True}


@pytest.mark.parametrize(
    "after",
    [b"", b"zz\r\n", chunk(b"data: {broken\n\n")],
    ids=["held-open", "broken-chunk", "garbage-event"],
)
def test_a_stream_ends_right_after_done(after: bytes) -> None:
    """Whatever the backend does after ``[DONE]`` (here: holds the connection far longer than
    the client waits), the client's stream ends with ``[DONE]``, no error event after it."""
    backend = RawBackend(
        lambda: [SSE_HEAD + chunk(EVENT), 0.02, chunk(b"data: [DONE]\n\n") + after, 60.0]
    )
    with proxy_over(backend) as px:
        got = both_paths(px, STREAM)
    for path, r in got.items():
        assert r.status_code == 200, path
        evs = events(r.content)
        assert len(evs) == 2 and evs[-1] == "[DONE]", (path, r.content)
        assert r.content.endswith(b"data: [DONE]\n\n"), path


def test_events_before_broken_framing_are_forwarded_then_the_error() -> None:
    """The second event arrives in the same read as a bad chunk size: it goes out, then the
    error event (it used to be dropped on the core's path; aiohttp's path hung)."""
    backend = RawBackend(lambda: [SSE_HEAD + chunk(EVENT), 0.05, chunk(EVENT) + b"zz\r\n", 60.0])
    with proxy_over(backend) as px:
        got = both_paths(px, STREAM)
    for path, r in got.items():
        evs = events(r.content)
        assert len(evs) == 3 and "[DONE]" not in evs, (path, r.content)
        first, second, err = evs
        assert isinstance(first, dict) and "choices" in first
        assert isinstance(second, dict) and "choices" in second
        assert isinstance(err, dict) and err["error"]["code"] == 502, (path, err)
    assert events(got["core"].content)[2] == events(got["aiohttp"].content)[2]


def test_a_body_with_broken_framing_is_a_502_not_a_hang() -> None:
    bad: Script = [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        b"\r\n" + chunk(b'{"choices":'),
        0.05,
        chunk(b"[]}") + b"zz\r\n",
        60.0,
    ]
    backend = RawBackend(lambda: bad)
    with proxy_over(backend) as px:
        got = both_paths(px, LOGPROBS)
    for path, r in got.items():
        assert r.status_code == 502, (path, r.content)
        assert "not valid HTTP" in r.json()["error"]["message"], path
    assert got["core"].content == got["aiohttp"].content


def test_a_backend_silent_after_its_head_still_gets_the_read_timeout() -> None:
    """Passing broken framing on to aiohttp's body reader must not turn its read timeout
    into a framing error: a 504, not a 502, on both paths."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    backend = RawBackend(lambda: [head + b'{"cho', 30.0])
    with proxy_over(backend, read_timeout=1.0) as px:
        got = both_paths(px, LOGPROBS)
    for path, r in got.items():
        assert r.status_code == 504, (path, r.content)


# a client's request ----------------------------------------------------------------------------


def exchange(px: RunningProxy, writes: Sequence[bytes]) -> bytes:
    """Send `writes` one by one on a fresh connection; the answer, until close.

    A proxy that answers and closes before reading all of a request resets the connection,
    which can cost the client the answer (or the rest of its writes): what arrived is kept.
    """
    host, port = px.url.removeprefix("http://").split(":")
    out = b""
    with socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT) as s:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            for w in writes:
                s.sendall(w)
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
    return out


def counted(px: RunningProxy) -> dict[str, float]:
    """``specaudit_proxy_requests_total`` by label set: every answer the proxy gave."""
    out = {}
    for line in httpx.get(px.url + "/metrics", timeout=CLIENT_TIMEOUT).text.splitlines():
        if line.startswith("specaudit_proxy_requests_total{") and "/metrics" not in line:
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def answered(px: RunningProxy, writes: Sequence[bytes]) -> tuple[str, bytes]:
    """The answer the proxy counted for one exchange (its labels: status included), and the
    answer's bytes as far as they reached the client."""
    before = counted(px)
    raw = exchange(px, writes)
    after = counted(px)
    new = [k for k in after if after[k] != before.get(k, 0)]
    assert len(new) == 1, (before, after)
    return new[0], raw


def status_and_body(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\nContent-Length: 2\r\n\r\n{}",
    ],
    ids=["all-bare-LF", "one-bare-LF"],
)
def test_a_bare_lf_request_is_answered_at_once(raw: bytes) -> None:
    """aiohttp's answer (a 400 naming the parser's reason), long before the client timeout."""
    with proxy_over(RawBackend(lambda: [OK])) as px:
        status, body = status_and_body(exchange(px, [raw]))
    assert status == 400
    assert json.loads(body)["error"]["message"].startswith("malformed HTTP request")


@pytest.mark.parametrize(
    "filler",
    [
        b"X-Long: " + b"a" * 100_000 + b"\r\n",  # one line over aiohttp's line limit: a 400
        b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 1000) for i in range(10)),  # long head: served
    ],
    ids=["100KB-line", "10KB-head"],
)
def test_the_head_limit_gives_one_answer_however_the_bytes_arrive(filler: bytes) -> None:
    body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        + filler
        + b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    with proxy_over(RawBackend(lambda: [OK])) as px:
        one, one_raw = answered(px, [raw])
        split, split_raw = answered(px, [raw[i : i + 2048] for i in range(0, len(raw), 2048)])
    assert one == split  # the same answer, counted by the proxy (the endpoint, the status)
    status = 400 if len(filler) > 50_000 else 200  # aiohttp's line limit; else it serves it
    assert f'status="{status}"' in one, one
    for got in (one_raw, split_raw):
        if got:  # a reset can cost the client the answer, never change it
            assert status_and_body(got)[0] == status
            if status == 400:
                assert b"8190" in status_and_body(got)[1]


def test_what_aiohttp_buffered_before_a_body_failed_is_recovered() -> None:
    """aiohttp's body reader raises a failure before handing out what it had buffered; the
    stream relay recovers those bytes (`server._unread`) so their complete events still go
    out when the relay was busy writing to the client as the failure came in."""

    async def run() -> tuple[bytes, bytes]:
        reader = aiohttp.StreamReader(mock.Mock(), 2**16, loop=asyncio.get_running_loop())
        reader.feed_data(EVENT)
        reader.feed_data(EVENT)
        reader.set_exception(aio_client.BrokenFraming("Invalid character in chunk size"))
        with pytest.raises(aio_client.BrokenFraming):
            await reader.readany()
        return aio_client.unread(reader), bytes(EVENT * 2)

    got, sent = asyncio.run(run())
    assert got == sent
