"""Differential fuzzing of the forwarding core's HTTP/1.1 parsing against reference parsers.

Requests. Hypothesis builds a byte stream of one to four pipelined requests, valid or hostile
(smuggling: CL with TE, two CLs, TE variants; obs-fold; bare LF and CR line ends; odd
whitespace; control and non-ASCII bytes; chunk extensions; huge heads; missing or doubled
Host; a blank line first), and cuts it at random points (TCP splits). The pieces go, in order,
to three readers:

- the core: `http1.RequestReader.message`, driven as `forwarding.Front` drives it. Each request it
  takes is (path, body, where it starts, its length); at the first one it does not take, it
  hands the connection over with every byte from that request's first one;
- aiohttp's request parser (llhttp with aiohttp's own checks: the parser of aiohttp's path,
  which answers every request the core hands over, and would answer every request without
  the core), fed the same stream;
- h11, an independent pure-Python parser, on each request the core took.

They agree when:

1. every request the core took is, at the same place in the stream, a complete request to
   aiohttp's parser: method POST, the same path, HTTP/1.1, the same body bytes. So a request
   the core serves is one aiohttp's path would have read the same way, and the next request
   starts where aiohttp's parser says it does (no smuggling between the two);
2. h11 reads each request the core took the same way: POST, the same target, HTTP/1.1, the
   same body, the same length;
3. the core never waits where aiohttp's parser has decided: if, at the end of the stream, the
   core still waits for bytes of a request, aiohttp's parser has neither completed nor refused
   that request (a stall, like the bare-LF request that waited for the client timeout).

What the core hands over needs nothing more: aiohttp's path gets exactly the bytes it would
have got, so it answers as it would have (that is the reference for those inputs).

Responses. Hypothesis builds a backend's response (1xx heads first or not; status lines and
versions valid or not; Content-Type values with bare LF, CR, NUL and other controls, obs-fold,
non-ASCII; Content-Length right, short, long, doubled; chunked with extensions and trailers,
broken chunks, CL with TE, other codings; a body until close; bytes after the response), cut
at random points and followed by the end of the connection. It goes to `http1.ResponseReader`
and to h11 (the client of one request). Where the core accepts the response (no error, and
complete, or delimited by the close), h11 must accept it too with the same status,
Content-Type and body bytes, after the same number of 1xx heads; and the accepted
Content-Type can be written into the client's response head (`wire.response_head`: no
header injection). Where the core refuses a response, it gives the request back to aiohttp's
path before sending anything, and aiohttp's path answers it: nothing more to agree on.

The example count is bounded and derandomized for CI; `benchmarks/fuzz_proxy_wire.py` runs the
same properties with as many examples as asked.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import h11
import pytest
from aiohttp.http_parser import HttpRequestParser
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specaudit.proxy import forwarding, http1, wire

EXAMPLES = 200  # per property in the suite
MAX_BODY = 4 << 20

CI = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

PATHS = sorted(p.decode() for p in forwarding.PATHS)
RIGHT = 30  # weight of the right value against each hostile one: most inputs are mostly right


def pick(draw: st.DrawFn, right: Any, *hostile: Any, weight: int = RIGHT) -> Any:
    """`right`, or now and then one of `hostile`."""
    return draw(st.sampled_from([right] * weight + list(hostile)))


def eol(draw: st.DrawFn) -> bytes:
    """A line end: a bare LF or CR about once in ten heads."""
    end: bytes = pick(draw, b"\r\n", b"\n", b"\r", weight=150)
    return end


# requests ---------------------------------------------------------------------------------------


def _chunked(body: bytes, ext: bytes, broken: bool) -> bytes:
    mid = len(body) // 2
    out = b"".join(b"%x%b\r\n%b\r\n" % (len(p), ext, p) for p in (body[:mid], body[mid:]) if p)
    return out + (b"zz\r\n" if broken else b"0\r\n\r\n")


BENIGN = [  # headers real clients send, in any number
    (b"Content-Type", b"application/json"),
    (b"Accept", b"*/*"),
    (b"Connection", b"keep-alive"),
    (b"Authorization", b"Bearer k"),
    (b"User-Agent", b"OpenAI/Python 1.0"),
    (b"X-Stainless-Lang", b"python"),
    (b"X-Long", b"a" * 4000),
]
HOSTILE = [  # one now and then
    (b"Connection", b"close"),
    (b"Connection", b"keep-alive, Upgrade"),
    (b"Upgrade", b"websocket"),
    (b"Expect", b"100-continue"),
    (b"Authorization", b"Bearer k"),  # a second one, with the benign one
    (b"Content-Type", b"text/plain"),
    (b"Content-Encoding", b"gzip"),
    (b"Transfer-Encoding", b"identity"),
    (b"X-A", b"caf\xc3\xa9"),
    (b"X-A", b"a\x00b"),
    (b"X-A", b"a\x0bb"),
    (b"X-A", b"a\x7fb"),
    (b"X-A", b"a\r\n b"),  # obs-fold
    (b"X-A", b"a\rb"),
    (b"X-A", b"a\nb"),
    (b"X-A", b""),
    (b"X-A", b"\t a \t"),
    (b"X-A ", b"a"),  # whitespace before the colon
    (b" X-A", b"a"),
    (b"X A", b"a"),
    (b"X-Long", b"a" * 8200),
    (b"X-Long", b"a" * 20000),
]


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """One request's bytes: mostly what a client sends, with a hostile part now and then."""
    method = pick(draw, b"POST", b"GET", b"PUT", b"post", b"CONNECT")
    target = draw(st.sampled_from([p.encode() for p in PATHS]))
    target = pick(draw, target, b"/health", b"/v1/completions?x=1", b"*", b"http://x/completion")
    version = pick(draw, b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2")
    sp = pick(draw, b" ", b"  ", b"\t")
    body = draw(
        st.sampled_from([b'{"prompt": "a", "max_tokens": 1}', b"", b"{}"]) | st.binary(max_size=40)
    )
    framing = pick(
        draw,
        "cl",
        *["cl-short", "cl-long", "cl-two-same", "cl-two-diff", "cl-plus", "cl-ws", "cl-hex"],
        *["cl-empty", "te", "te-ext", "te-broken", "cl+te", "te-odd", "none"],
    )
    headers: list[tuple[bytes, bytes]] = [(b"Host", b"x")] * pick(draw, 1, 0, 2)
    n = len(body)
    cl = {
        "cl": [b"%d" % n],
        "cl-short": [b"%d" % max(n - 3, 0)],
        "cl-long": [b"%d" % (n + 5)],
        "cl-two-same": [b"%d" % n, b"%d" % n],
        "cl-two-diff": [b"%d" % n, b"%d" % (n + 1)],
        "cl-plus": [b"+%d" % n],
        "cl-ws": [b" %d \t" % n],
        "cl-hex": [b"0x%x" % n],
        "cl-empty": [b""],
        "cl+te": [b"%d" % n],
    }.get(framing, [])
    headers += [(b"Content-Length", v) for v in cl]
    odd = draw(st.sampled_from([b"Chunked", b" chunked", b"chunked, identity", b"gzip, chunked"]))
    te = {
        "te": b"chunked",
        "te-ext": b"chunked",
        "te-broken": b"chunked",
        "cl+te": b"chunked",
        "te-odd": odd,
    }.get(framing)
    if te is not None:
        headers.append((b"Transfer-Encoding", te))
        body = _chunked(body, b";a=b" if framing == "te-ext" else b"", framing == "te-broken")
    headers += draw(st.lists(st.sampled_from(BENIGN), max_size=3, unique=True))
    if draw(st.integers(0, 4)) == 0:
        headers += draw(st.lists(st.sampled_from(HOSTILE), min_size=1, max_size=2))
    headers += [(b"X-%d" % i, b"1") for i in range(pick(draw, 0, 200))]  # too many
    headers = draw(st.permutations(headers))
    out = pick(draw, b"", b"\r\n") + method + sp + target + sp + version + eol(draw)
    for name, value in headers:
        out += name + b":" + pick(draw, b" ", b"", b"\t", b"  ") + value + eol(draw)
    return out + eol(draw) + body


def cut(data: bytes, points: list[int]) -> list[bytes]:
    """`data` cut at `points` (TCP splits)."""
    edges = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]


@dataclass
class Taken:
    path: str
    body: bytes
    start: int
    length: int


def core_reads(pieces: list[bytes]) -> tuple[list[Taken], str]:
    """What the core does with the pieces: the requests it takes, then "handed over" (the
    rest goes to aiohttp's path), "closed" (after a ``Connection: close``), "waiting" (for
    more bytes) or "idle"."""
    buf = b""
    offset = 0
    reader: http1.RequestReader | None = None
    taken: list[Taken] = []
    for piece in pieces:
        buf += piece
        while buf:
            if reader is None:
                reader = http1.RequestReader()
            try:
                got = reader.message(buf, forwarding.PATHS, MAX_BODY)
            except http1.NotPlain:
                return taken, "handed over"
            if got is None:
                break
            head, total = got
            taken.append(Taken(head.path, buf[head.end : total], offset, total))
            if head.close:
                return taken, "closed"  # answered, then the connection closes
            offset += total
            buf = buf[total:]
            reader = None
    return taken, "waiting" if buf else "idle"


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@dataclass
class AioRead:
    """What aiohttp's request parser made of a stream."""

    messages: list[tuple[Any, Any]]  # (RawRequestMessage, its body's StreamReader)
    error: str | None  # why it refused the stream, if it did

    def complete(self, i: int) -> bool:
        return i < len(self.messages) and self.messages[i][1].is_eof()

    def body(self, i: int) -> bytes:
        return bytes(self.messages[i][1].read_nowait(-1))

    def refused(self, i: int) -> bool:
        """aiohttp refused the stream at request `i` (in its head, or in its body)."""
        if self.error is None:
            return False
        return len(self.messages) == i or (len(self.messages) == i + 1 and not self.complete(i))


def aiohttp_reads(pieces: list[bytes], loop: asyncio.AbstractEventLoop) -> AioRead:
    """aiohttp's request parser on the stream, a byte at a time (so the requests it completed
    before refusing a byte are all known)."""
    parser = HttpRequestParser(mock.Mock(), loop, 2**16, max_line_size=8190, max_field_size=8190)
    out = AioRead([], None)
    data = b"".join(pieces)
    for i in range(len(data)):
        try:
            msgs, upgraded, _ = parser.feed_data(data[i : i + 1])
        except Exception as e:
            out.error = type(e).__name__
            return out
        out.messages += msgs
        if upgraded:
            out.error = "upgraded"  # the rest is not HTTP to aiohttp either
            return out
    return out


def h11_reads(data: bytes) -> tuple[bytes, str, str, bytes, int] | str:
    """h11's reading of the request at the start of `data`: (method, target, version, body,
    length), or why it refused or could not finish it."""
    c = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 20)
    c.receive_data(data)
    body = b""
    req = None
    try:
        while True:
            ev = c.next_event()
            if isinstance(ev, h11.Request):
                req = ev
            elif isinstance(ev, h11.Data):
                body += bytes(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                return f"h11: {ev!r}"
    except h11.RemoteProtocolError as e:
        return f"h11 refused it: {e}"
    assert req is not None
    rest = c.trailing_data[0]
    return (
        bytes(req.method),
        req.target.decode("latin-1"),
        req.http_version.decode(),
        body,
        len(data) - len(rest),
    )


def check_requests(stream: bytes, points: list[int], loop: asyncio.AbstractEventLoop) -> str:
    """Assert the agreement above; what happened, for the statistics."""
    pieces = cut(stream, points)
    taken, state = core_reads(pieces)
    aio = aiohttp_reads(pieces, loop)
    for i, t in enumerate(taken):
        assert aio.complete(i), f"the core took request {i}, aiohttp's parser did not: {aio}"
        msg = aio.messages[i][0]
        assert (msg.method, msg.path, tuple(msg.version)) == ("POST", t.path, (1, 1))
        assert aio.body(i) == t.body, f"request {i}: the body differs from aiohttp's"
        h = h11_reads(stream[t.start :])
        assert h == (b"POST", t.path, "1.1", t.body, t.length), f"request {i}: h11 says {h}"
    if state == "waiting":
        k = len(taken)
        assert not aio.complete(k), f"the core waits on request {k}, which aiohttp completed"
        assert not aio.refused(k), f"the core waits on request {k}, which aiohttp refused"
    return f"core took {min(len(taken), 2)}+ then {state}; aiohttp {aio.error or 'accepted'}"


REQUESTS = (
    st.lists(requests(), min_size=1, max_size=4),  # pipelined
    st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=8),  # TCP splits
)


def requests_agree(loop: asyncio.AbstractEventLoop, reqs: list[bytes], points: list[int]) -> None:
    event(check_requests(b"".join(reqs), points, loop))


test_the_core_reads_requests_as_aiohttp_and_h11_do = CI(given(*REQUESTS)(requests_agree))


# responses --------------------------------------------------------------------------------------


@st.composite
def responses(draw: st.DrawFn) -> tuple[bytes, int]:
    """A backend's response (1xx heads first or not), and how many 1xx heads it starts with."""
    infos = draw(
        st.lists(
            st.sampled_from(
                [
                    b"HTTP/1.1 100 Continue\r\n\r\n",
                    b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n",
                    b"HTTP/1.1 102 Processing\r\n\r\n",
                ]
            ),
            max_size=2,
        )
    )
    version = pick(draw, b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"http/1.1")
    status = pick(draw, b"200", b"204", b"304", b"400", b"503", b"101", b"199", b"600", b"20")
    reason = pick(draw, b" OK", b" ", b"", b" Okay then", b" OK\x01")
    ctype = draw(
        st.sampled_from([b"application/json", b"text/event-stream", b"application/json; a=b"])
    )
    ctypes = [pick(draw, ctype, b"", b" application/json \t", b"caf\xc3\xa9")]
    if draw(st.integers(0, 4)) == 0:  # a hostile one now and then, instead or as well
        hostile = draw(
            st.sampled_from(
                [b"application/json\nSet-Cookie: a=1\nX-Specaudit-Placeholders: 0"]
                + [b"application/json\rSet-Cookie: a=1", b"application/json\r\n\tx"]
                + [b"a\x00b", b"a\x0bb", b"a\x7fb", b"text/html"]
            )
        )
        ctypes = draw(st.sampled_from([[hostile], [hostile, ctype], [ctype, ctype], []]))
    body = draw(
        st.sampled_from([b'{"choices": []}', b"", b"data: {}\n\n"]) | st.binary(max_size=40)
    )
    framing = draw(st.sampled_from(["cl", "te"]))
    framing = pick(
        draw,
        framing,
        *["cl-short", "cl-long", "cl-two-same", "cl-two-diff", "cl+te", "te-ext", "te-trailers"],
        *["te-broken", "te-gzip", "te-twice", "until-close"],
    )
    n = len(body)
    headers: list[tuple[bytes, bytes]] = [(b"Content-Type", c) for c in ctypes]
    cl = {
        "cl": [b"%d" % n],
        "cl-short": [b"%d" % max(n - 2, 0)],
        "cl-long": [b"%d" % (n + 4)],
        "cl-two-same": [b"%d" % n] * 2,
        "cl-two-diff": [b"%d" % n, b"%d" % (n + 1)],
        "cl+te": [b"%d" % n],
    }.get(framing, [])
    headers += [(b"Content-Length", v) for v in cl]
    if framing.startswith("te") or framing == "cl+te":
        coding = {"te-gzip": b"gzip", "te-twice": b"chunked, chunked"}.get(framing, b"chunked")
        headers.append((b"Transfer-Encoding", coding))
        chunked = _chunked(body, b";x=1" if framing == "te-ext" else b"", framing == "te-broken")
        if framing == "te-trailers":
            chunked = chunked[:-2] + b"X-Trailer: 1\r\n\r\n"
        body = chunked
    if draw(st.booleans()):
        headers.append((b"Connection", draw(st.sampled_from([b"close", b"keep-alive"]))))
    headers = draw(st.permutations(headers))
    out = version + b" " + status + reason + eol(draw)
    for name, value in headers:
        out += name + b": " + value + eol(draw)
    out += eol(draw) + body
    out += pick(draw, b"", b"\r\n", b"HTTP/1.1 200 OK\r\n\r\n", b"junk")
    return b"".join(infos) + out, len(infos)


@dataclass
class CoreResponse:
    status: int
    content_type: str
    body: bytes


def core_response(pieces: list[bytes]) -> CoreResponse | str:
    """The response as the core reads it, the connection closing after the pieces; or why it
    refuses it (then the request goes back to aiohttp's path)."""
    r = http1.ResponseReader()
    body = b""
    for piece in pieces:
        r.feed(piece)
        body += r.take()
        if r.complete or r.error is not None:
            break
    if r.error is not None:
        return r.error
    head = r.head
    if head is None:
        return "no head"
    if not r.complete and not (head.length is None and not head.chunked):
        return "incomplete at the close"
    return CoreResponse(head.status, head.content_type, body)


def h11_response(pieces: list[bytes]) -> tuple[int, tuple[int, str, bytes]] | str:
    """h11 as the client of one request: (1xx heads seen, (status, Content-Type, body))."""
    c = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)
    c.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    c.send(h11.EndOfMessage())
    infos = 0
    status, ctype, body = 0, "", b""
    try:
        for piece in [*pieces, b""]:  # b"": the connection closes
            c.receive_data(piece)
            while True:
                ev = c.next_event()
                if ev is h11.NEED_DATA or ev is h11.PAUSED:
                    break
                if isinstance(ev, h11.InformationalResponse):
                    infos += 1
                elif isinstance(ev, h11.Response):
                    status = ev.status_code
                    ctype = ", ".join(
                        v.decode("latin-1") for k, v in ev.headers if k == b"content-type"
                    )
                elif isinstance(ev, h11.Data):
                    body += bytes(ev.data)
                elif isinstance(ev, h11.EndOfMessage):
                    return infos, (status, ctype, body)
                else:
                    return f"h11: {ev!r}"
    except h11.RemoteProtocolError as e:
        return f"h11 refused it: {e}"
    return "h11: incomplete at the close"


def check_response(raw: bytes, infos: int, points: list[int]) -> str:
    """Assert the agreement above; what happened, for the statistics."""
    pieces = cut(raw, points)
    core = core_response(pieces)
    if isinstance(core, str):
        return "core refused"  # given back to aiohttp's path, which answers it
    wire.response_head(200, [("Content-Type", core.content_type)], length=0)  # never raises
    ref = h11_response(pieces)
    assert ref == (infos, (core.status, core.content_type, core.body)), (core, ref)
    return f"core accepted a {core.status}"


RESPONSES = (responses(), st.lists(st.integers(min_value=0, max_value=1 << 12), max_size=8))


def responses_agree(resp: tuple[bytes, int], points: list[int]) -> None:
    event(check_response(resp[0], resp[1], points))


test_the_core_reads_responses_as_h11_does = CI(given(*RESPONSES)(responses_agree))


# the reproductions, as examples of the properties -----------------------------------------------


def test_the_properties_hold_for_the_known_hostile_inputs(loop: asyncio.AbstractEventLoop) -> None:
    body = json.dumps({"prompt": "a"}).encode()
    plain = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (
        len(body),
        body,
    )
    for stream in (
        plain + plain,
        plain.replace(b"\r\n", b"\n"),  # bare LF: handed over at once, never a stall
        plain.replace(b"Host: x\r\n", b"Host: x\r\nX-Long: " + b"a" * 100_000 + b"\r\n"),
        plain.replace(b"Host: x\r\n", b"") + plain,  # no Host: aiohttp refuses it
        plain.replace(b"Content-Length", b"Transfer-Encoding: chunked\r\nContent-Length"),
    ):
        for points in ([], [5], list(range(0, len(stream), 2048)), list(range(len(stream)))[:64]):
            check_requests(stream, points, loop)
    injected = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\nSet-Cookie: injected=1\n"
        b"X-Specaudit-Placeholders: 0\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert isinstance(core_response([injected]), str)  # refused: never forwarded
    info = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    check_response(info, 1, [3, 30])
    # found by fuzzing: llhttp reads a body for a 199 with Content-Length, h11 does not
    check_response(
        b'HTTP/1.1 199 OK\r\nContent-Length: 15\r\n\r\n{"choices": []}HTTP/1.1 200 OK\r\n\r\n',
        0,
        [],
    )
    # found by fuzzing: after a Connection: close request, the next one is not served
    closing = plain.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
    check_requests(closing + plain, [], loop)
    assert core_response([info]) == CoreResponse(200, "", b"{}")
