"""Hostile input never breaks the proxy, each case against the in-process proxy.

- Lone surrogates: a lone surrogate escape in a token (``"token": "\\ud800"``, valid JSON)
  must not crash the re-encoding of a response whose placeholders were nulled; anything that
  still goes wrong ends a stream with an error event instead of tearing the connection.
- Malformed requests and secrets: a malformed HTTP request gets a clean JSON 400 and one log
  line without a traceback, and no secret (Authorization, API keys) appears in any log line or
  traceback.
- Linear event splitting: SSE event splitting is linear in the bytes received (work is
  counted, not timed).

The hostile backend is a handler defined here, served by the shared `fakes.serve`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

import fakes
from specaudit.llama import free_port
from specaudit.proxy import H_PLACEHOLDERS, ProxyConfig, RunningProxy, redact, serve_in_thread, sse
from specaudit.proxy import answers as answers_mod
from specaudit.proxy.placeholders import PlaceholderTally, check_body, check_event
from specaudit.proxy.routing import Kind

MIB = 1 << 20
SECRET = "sk-hostile-0123456789abcdef"

# what a backend sends: ensure_ascii JSON keeps the lone surrogate as the escape \ud800
REAL = {
    "id": 2,
    "token": "\udfff",
    "bytes": [99],
    "logprob": -0.5,
    "top_logprobs": [{"id": 2, "token": "\udfff", "bytes": [99], "logprob": -0.5}],
}
FAKE = {"id": 3, "token": "\ud800", "bytes": [237, 160, 128], "logprob": 0.0, "top_logprobs": []}
BODY = {
    "choices": [
        {
            "text": "\udfff\ud800",
            "index": 0,
            "finish_reason": "length",
            "logprobs": {"content": [REAL, FAKE]},
        }
    ],
    "object": "text_completion",
}


def _ev(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _choice(text: str, logprobs: object, finish: str | None = None) -> dict[str, Any]:
    return {
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
        "object": "text_completion",
    }


STREAM = [
    _ev(_choice("\udfff", {"content": [REAL]})),  # real: forwarded byte-identical
    _ev(_choice("\ud800", None)),  # a streamed placeholder: no probability entry at all
    _ev(_choice("\ud800", {"content": [FAKE]})),  # a placeholder with an entry
    _ev(_choice("", None, "length")),
    b"data: [DONE]\n\n",
]


@dataclass
class Hostile:
    """A plain (non-speculating) backend whose generation endpoints answer per `mode`."""

    mode: str = "surrogates"  # surrogates | huge-event
    huge: int = 8 * MIB  # bytes of the event that never ends (huge-event)
    sent: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/health":
            return web.json_response({"status": "ok"})
        if request.path == "/slots":
            return web.json_response([{"id": 0, "speculative": False}])
        stream = json.loads(body).get("stream") is True
        if not stream:
            return web.Response(body=json.dumps(BODY).encode(), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if self.mode == "surrogates":
                for ev in STREAM:
                    await resp.write(ev)
            else:  # one event that never ends: "data: " and then no blank line, ever
                await resp.write(b"data: ")
                chunk = b"x" * 65536
                while self.sent < self.huge:
                    await resp.write(chunk)
                    self.sent += len(chunk)
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            self.done.set()
        return resp


@contextlib.contextmanager
def proxy_for(fake: Hostile, **kw: Any) -> Iterator[RunningProxy]:
    """A proxy over `fake`; `kw` are ProxyConfig options, which ProxyConfig checks."""
    dead = f"http://127.0.0.1:{free_port()}"
    with (
        fakes.serve(fake.handle) as backend,
        serve_in_thread(ProxyConfig(backend.url, dead, port=0, check_interval=3600, **kw)) as p,
    ):
        yield p


def sse_objects(raw: bytes) -> list[Any]:
    """Every event of an SSE body, parsed: decoded JSON (``[DONE]`` as a string)."""
    evs, rest = sse.split_events(raw)
    assert rest == b""
    return [sse.parse_event(e) for e in evs]


REQ = {"prompt": "a", "max_tokens": 4, "logprobs": 1}


# ---------------------------------------------------------------------- lone surrogates


def test_encode_event_keeps_a_lone_surrogate_escaped() -> None:
    obj = {"token": "\ud800", "text": "é", "logprob": None}
    raw = sse.encode_event(obj)
    assert raw == b'data: {"token":"\\ud800","text":"\xc3\xa9","logprob":null}\n\n'
    assert sse.parse_event(raw) == obj


def test_streamed_placeholder_with_a_lone_surrogate_gets_its_null_entry() -> None:
    ev = _choice("\ud800", None)
    t = check_event(Kind.COMPLETIONS, ev, requested=1)
    assert (t.tokens, t.placeholders) == (1, 1)
    entry = ev["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "\ud800" and entry["logprob"] is None
    assert sse.parse_event(sse.encode_event(ev)) == ev


def test_non_streamed_placeholder_with_a_lone_surrogate_is_nulled_not_a_500() -> None:
    with proxy_for(Hostile()) as p:
        r = httpx.post(p.url + "/v1/completions", json=REQ)
        assert r.status_code == 200, r.text
        assert r.headers[H_PLACEHOLDERS] == "1"
        real, fake = r.json()["choices"][0]["logprobs"]["content"]
        assert real == REAL
        assert fake["token"] == "\ud800" and fake["logprob"] is None
        assert p.stats().placeholders_caught == {"plain": 1}


def test_streamed_placeholders_with_lone_surrogates_are_nulled_and_the_stream_ends() -> None:
    with proxy_for(Hostile()) as p:
        r = httpx.post(p.url + "/v1/completions", json={**REQ, "stream": True})
        assert r.status_code == 200
        raw = r.content
        objs = sse_objects(raw)
        assert objs[-1] == "[DONE]" and not any("error" in o for o in objs if isinstance(o, dict))
        assert raw.startswith(STREAM[0])  # the real token's event is byte-identical
        entries = [o["choices"][0]["logprobs"]["content"][0] for o in objs[:3]]
        assert entries[0] == REAL
        assert [(e["token"], e["logprob"]) for e in entries[1:]] == [("\ud800", None)] * 2
        assert p.stats().placeholders_caught == {"plain": 2}


def test_a_failing_check_ends_a_stream_with_an_error_event(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken(
        kind: Kind, event: Any, requested: int, post_sampling: bool = False
    ) -> PlaceholderTally:
        calls.append(1)
        if len(calls) == 2:  # the first (real) event passes, the placeholder one fails
            raise RuntimeError("hostile")
        return check_event(kind, event, requested, post_sampling)

    monkeypatch.setattr(answers_mod, "check_event", broken)
    with proxy_for(Hostile()) as p:
        r = httpx.post(p.url + "/v1/completions", json={**REQ, "stream": True})
        objs = sse_objects(r.content)  # complete events, not a torn connection
        assert objs[0] == json.loads(STREAM[0][6:])
        assert len(objs) == 2, objs  # the unchecked placeholder never reaches the client
        err = objs[1]["error"]
        assert err["code"] == 500 and "withheld" in err["message"]


def test_a_failing_check_of_a_body_is_a_clean_json_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: object, **k: object) -> object:
        raise RuntimeError("hostile")

    monkeypatch.setattr(answers_mod, "check_body", broken)
    with proxy_for(Hostile()) as p:
        r = httpx.post(p.url + "/v1/completions", json=REQ)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        assert "\\ud800" not in r.text and "logprob" not in r.text


def test_check_body_counts_the_surrogate_placeholder() -> None:
    body = json.loads(json.dumps(BODY))
    t = check_body(Kind.COMPLETIONS, body, requested=1)
    assert (t.tokens, t.placeholders) == (2, 1)


# ---------------------------------------------------------------- malformed requests, secrets


def _raw_request(url: str, raw: bytes) -> bytes:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


MALFORMED = {
    "cl-and-te": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + SECRET.encode() + b"\r\n"
        b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}"
    ),
    "bad-char-in-authorization": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + SECRET.encode() + b"\x01\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    ),
    "bad-char-in-api-key": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b"X-Api-Key: " + SECRET.encode() + b"\x01\r\n\r\n"
    ),
    "bad-request-line": (
        b"POST /v1/completions?api_key=" + SECRET.encode() + b"\x01 HTTP/1.1\r\nHost: x\r\n\r\n"
    ),
}


@pytest.fixture(scope="module")
def dead_px() -> Iterator[RunningProxy]:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with serve_in_thread(ProxyConfig(dead[0], dead[1], port=0, check_interval=3600)) as p:
        yield p


def _formatted(records: list[logging.LogRecord]) -> str:
    fmt = logging.Formatter("%(levelname)s %(name)s %(message)s")
    return "\n".join(fmt.format(r) for r in records)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_request_is_a_clean_400_with_one_line_and_no_secret(
    dead_px: RunningProxy, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    out = _raw_request(dead_px.url, MALFORMED[case])
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"400", out
    assert b"application/json" in head
    err = json.loads(body)["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error"
    assert SECRET.encode() not in out
    ours = [r for r in caplog.records if r.name.startswith(("aiohttp", "specaudit"))]
    text = _formatted(ours)
    assert SECRET not in text, text
    assert "Traceback" not in text
    lines = [r for r in ours if r.levelno >= logging.INFO]
    assert len(lines) == 1, text
    assert lines[0].exc_info is None and "\n" not in lines[0].getMessage()


_PROCESS = """
import logging, socket, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
from specaudit.llama import free_port
from specaudit.proxy import ProxyConfig, serve_in_thread
dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
with serve_in_thread(ProxyConfig(dead[0], dead[1], port=0, check_interval=3600)) as p:
    port = int(p.url.rsplit(":", 1)[1])
    for raw in eval(sys.argv[1]):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(raw)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        print(out.split(b" ", 2)[1].decode())
"""


@pytest.mark.parametrize("parser", ["c", "python"])
def test_a_proxy_process_stderr_never_shows_a_secret(parser: str) -> None:
    """The issue's reproduction: malformed requests with credentials, then grep stderr."""
    env = {**os.environ, "AIOHTTP_NO_EXTENSIONS": "1" if parser == "python" else ""}
    r = subprocess.run(
        [sys.executable, "-c", _PROCESS, repr(list(MALFORMED.values()))],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["400"] * len(MALFORMED)
    assert SECRET not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("bad HTTP request") == len(MALFORMED), r.stderr


@pytest.mark.parametrize(
    "message",
    [
        "Authorization: Bearer {s}",
        "b'Authorization: Bearer {s}\\x01'",
        "headers {{'authorization': 'Basic {s}'}}",
        "X-Api-Key: {s}",
        '{{"api_key": "{s}"}}',
        "GET /x?api_key={s}&a=1",
        "token Bearer {s} here",
    ],
)
def test_redaction_masks_messages_and_tracebacks(message: str) -> None:
    text = message.format(s=SECRET)
    try:
        raise ValueError(text)
    except ValueError as e:
        exc = e
    rec = logging.LogRecord(
        "aiohttp.server",
        logging.ERROR,
        __file__,
        1,
        "oops %s",
        (text,),
        (type(exc), exc, exc.__traceback__),
    )
    assert redact.REDACT.filter(rec)
    out = _formatted([rec])
    assert SECRET not in out and "[redacted]" in out and "ValueError" in out


def test_redaction_is_installed_on_the_loggers_that_write(dead_px: RunningProxy) -> None:
    for name in ("specaudit.proxy", "aiohttp.server", "aiohttp.access", "asyncio"):
        assert redact.REDACT in logging.getLogger(name).filters


# ---------------------------------------------------------------- linear event splitting


def _feed(splitter: sse.EventSplitter, total: int, chunk: int = 64 * 1024) -> None:
    assert splitter.feed(b"data: ") == []
    block = b"x" * chunk
    for _ in range(total // chunk):
        assert splitter.feed(block) == []


@pytest.mark.parametrize("mib", [4, 16, 64])
def test_an_unfinished_event_is_scanned_once(mib: int) -> None:
    s = sse.EventSplitter()
    _feed(s, mib * MIB)
    assert s.pending == mib * MIB + 6
    fed = mib * MIB + 6
    # each separator search resumes where the last one stopped (plus its overlap): at most
    # every byte once per separator, where today's code rescans the whole buffer per chunk
    assert s.scanned <= 2 * fed + 8 * (mib * 16 + 1), s.scanned


def test_many_small_events_in_one_chunk_are_linear() -> None:
    ev = b'data: {"a":1}\n\n'
    s = sse.EventSplitter()
    events = s.feed(ev * 100_000)
    assert events == [ev] * 100_000 and s.pending == 0
    assert s.scanned <= 3 * len(ev) * 100_000, s.scanned


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 64 * 1024])
def test_splitter_matches_split_events_at_any_chunking(chunk: int) -> None:
    data = (
        b'data: {"a":1}\n\n: ping\r\n\r\ndata: x\r\n\ndata: y\n\r\n\r\n'
        b"data: z\r\ndata: w\r\n\r\n\n\ndata: tail"
    )
    whole, rest = sse.split_events(data)
    s = sse.EventSplitter()
    got: list[bytes] = []
    for i in range(0, len(data), chunk):
        got += s.feed(data[i : i + chunk])
    assert got == whole and s.rest() == rest == b"data: tail"
    assert b"".join(got) + rest == data


def test_huge_event_through_the_proxy_is_linear_and_still_limited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[sse.EventSplitter] = []

    class Counting(sse.EventSplitter):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(sse, "EventSplitter", Counting)
    limit = 8 * MIB
    fake = Hostile(mode="huge-event", huge=4 * limit)
    with proxy_for(fake, max_response_bytes=limit) as p:
        r = httpx.post(p.url + "/v1/completions", json={**REQ, "stream": True}, timeout=60)
        (s,) = made  # the proxy's, before sse_objects below makes its own
        objs = sse_objects(r.content)
        assert len(objs) == 1, objs  # no half event, no [DONE]: one error event
        err = objs[0]["error"]
        assert err["code"] == 502 and f"over {limit} bytes" in err["message"]
        assert fake.done.wait(10) and fake.sent < 4 * limit  # upstream was dropped
        assert httpx.get(p.url + "/health").status_code == 200  # the proxy still serves
    received = s.pending
    assert limit < received <= limit + 4 * MIB
    assert s.scanned <= 3 * received, (s.scanned, received)
