"""The proxy's forwarding core: the common request served on raw asyncio protocols.

Why: aiohttp's server and client cost about 0.5 ms of CPU per request and 1.5 ms per 8-token
stream (docs/proxy.md), several times what the proxy's own work needs. On two cores that CPU
comes out of the backend's share. This core serves the plain case, a well-formed ``POST`` to a
generation endpoint whose backend is up, with one pass over the bytes each way and no
re-encoding of unchanged bytes:

- `Front` is each client connection's protocol. A request it does not take (another path or
  method, a chunked body, a request the routing rules refuse, a backend not known to be up, a
  stop in progress, a deadline passed) hands the whole connection, bytes read so far
  included, to aiohttp (`server._RequestHandler.adopt`), which answers it exactly as before:
  error bodies, 408/413, fallbacks and annotation keep one home.
- `Upstream` is one connection to a backend: kept alive and reused for non-streamed requests
  (idle at most 4 s, below llama-server's 5), a fresh one per stream (llama-server closes it).
- Until the first byte goes to the client, anything unusual (a refused connection, a status
  other than 200, a body that is not JSON) gives the request back to aiohttp, which sends it
  again (generation requests have no side effects) and handles it the documented way. After
  it, a stream ends with the same error events as aiohttp's path (`Proxy._stream_error`).

Responses to logprobs requests are checked here with the same functions (`Proxy._events`,
`Proxy._checked_body`); the counters, access log and graceful stop are shared.

HTTP/1.1 is parsed by llhttp (`httptools`), the parser aiohttp's own C extension is built on,
never by hand: `RequestReader` reads a request's head (its body is the ``Content-Length``
bytes after it), `ResponseReader` a backend's responses, chunked framing included. Memory per
client connection is bounded: while a request is answered at most `PIPELINE_BUFFER` bytes of
pipelined requests are read ahead, and while the client does not read its answers (its
transport paused) no next request is started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import httptools

from specaudit.proxy import routing, server, sse, wire
from specaudit.proxy.routing import Plan, RequestError, Route

if TYPE_CHECKING:
    from specaudit.proxy.server import Proxy, _Outcome

log = logging.getLogger("specaudit.proxy")

IDLE_KEEPALIVE = 75.0  # seconds an idle client connection stays open (aiohttp's default too)
POOL_IDLE = 4.0  # seconds a pooled backend connection may idle (llama-server drops it at 5)
PIPELINE_BUFFER = 65536  # bytes of pipelined requests read ahead while one is answered
PATHS = frozenset(p.encode() for p, (m, _) in routing.ENDPOINTS.items() if m == "POST")
_KINDS = {p: k for p, (_, k) in routing.ENDPOINTS.items()}
# what aiohttp's request parser refuses beyond llhttp, so the core hands such requests over:
MAX_HEADERS = 128  # more headers: a 400
_SINGLE = frozenset(  # one of each at most (aiohttp's SINGLETON_HEADERS, and Authorization)
    b"authorization content-length content-location content-range content-type etag host "
    b"max-forwards server transfer-encoding user-agent".split()
)
_REFUSED = frozenset(  # never plain: chunked bodies, 100-continue, upgrades, compressed bodies
    b"transfer-encoding expect upgrade content-encoding sec-websocket-key1".split()
)
_NOTED = _SINGLE | _REFUSED | {b"connection"}  # the headers the core looks at
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # no control character but tab in a value


# reading HTTP/1.1 with llhttp ------------------------------------------------------------------


class NotPlain(Exception):
    """A request the core does not take (`RequestReader.feed`): aiohttp's path decides."""


@dataclass(slots=True)
class RequestHead:
    """A ``POST`` the core may serve: its path, body length, where the body starts and what
    it asks of the connection."""

    path: str
    path_b: bytes
    length: int
    end: int  # bytes of the head, blank line included: the body starts here
    close: bool  # the client sent ``Connection: close``
    authorization: bytes | None


class RequestReader:
    """The head of one request, fed the connection's bytes from the request's first one.

    llhttp decides whether the bytes are HTTP/1.1 and where each header is (strict: CRLF line
    ends, no obs-fold, no CL with TE, no duplicate CL, token names, no CTL in values). The
    core then takes only the plain case: ``POST <one of paths> HTTP/1.1`` with one ``Host``
    and one ``Content-Length``, visible-ASCII values, no ``Transfer-Encoding``, ``Expect``,
    ``Content-Encoding`` or upgrade, nothing aiohttp's parser refuses beyond llhttp (a second
    ``Content-Type`` or ``User-Agent``, over `MAX_HEADERS` headers), its head (blank line
    included) at most `wire.MAX_HEAD` bytes however the bytes arrive. Anything else raises
    `NotPlain` as soon as it shows, and the connection goes to aiohttp's path, whose parser
    is llhttp too.

    The parser is fed no further than the head's blank line (the first CRLF CRLF: with CRLF
    line ends required and CR refused inside a line, nothing earlier can be one), so it never
    reads a body or the next pipelined request; the body is the ``Content-Length`` bytes after
    the head.
    """

    __slots__ = ("_p", "_fed", "_url", "_headers", "_done", "_head")

    def __init__(self) -> None:
        self._p = httptools.HttpRequestParser(self)
        self._fed = 0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._done = False
        self._head: RequestHead | None = None

    # llhttp's callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._done = True

    def feed(self, buf: bytes, paths: frozenset[bytes]) -> RequestHead | None:
        """`buf`: the bytes from the request's first one (growing between calls). The head
        once it is complete and plain; None while it is incomplete; `NotPlain` otherwise."""
        if self._head is not None:
            return self._head
        fed = self._fed
        if not fed and not b"POST ".startswith(buf[:5]):
            raise NotPlain("not a POST")  # /health, /v1/models, 404s: no need to parse
        end = buf.find(b"\r\n\r\n", max(fed - 3, 0), wire.MAX_HEAD)
        stop = wire.MAX_HEAD if end < 0 else end + 4
        if stop > fed:
            try:
                self._p.feed_data(buf[fed:stop])
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
                raise NotPlain(f"llhttp: {e!r}") from None
            self._fed = min(stop, len(buf))
        if not self._done:
            if end >= 0 or len(buf) >= wire.MAX_HEAD:
                raise NotPlain("the head is longer than the core reads")
            return None
        if end < 0:
            raise NotPlain("the head does not end in CRLF CRLF")
        self._head = self._plain(end + 4, paths, buf)
        return self._head

    def message(
        self, buf: bytes, paths: frozenset[bytes], max_body: int
    ) -> tuple[RequestHead, int] | None:
        """The head and the length of the whole request (head and body) once `buf` holds all
        of it; None while it does not; `NotPlain` as `feed`, or for a body over `max_body`
        (aiohttp's path answers 413)."""
        head = self.feed(buf, paths)
        if head is None:
            return None
        if head.length > max_body:
            raise NotPlain("a body over --max-body-bytes")
        total = head.end + head.length
        return (head, total) if len(buf) >= total else None

    def _plain(self, end: int, paths: frozenset[bytes], buf: bytes) -> RequestHead:
        p = self._p
        url = self._url
        if p.get_method() != b"POST" or p.get_http_version() != "1.1" or url not in paths:
            raise NotPlain("not POST <endpoint> HTTP/1.1")
        if not buf.startswith(b"POST %b HTTP/1.1\r\n" % url):
            raise NotPlain("not the request line's plain form")  # llhttp allows more spaces
        headers = self._headers
        if len(headers) > MAX_HEADERS:
            raise NotPlain("too many headers")
        length: int | None = None
        close = False
        auth: bytes | None = None
        seen: set[bytes] = set()
        for name, value in headers:
            # llhttp refused control characters (tab aside) and DEL: ASCII is visible ASCII
            if not value.isascii():
                raise NotPlain("a header value that is not ASCII")
            n = name.lower()
            if n not in _NOTED:
                continue  # most headers (Accept, X-Stainless-*, ...): nothing to do
            if n in _REFUSED:
                raise NotPlain(n.decode())
            if n in seen and n != b"connection":
                raise NotPlain(f"two {n.decode()} headers")
            seen.add(n)
            if n == b"content-length":
                value = value.strip(b" \t")
                if not value.isdigit() or len(value) > 15:
                    raise NotPlain("Content-Length")
                length = int(value)
            elif n == b"connection":
                tokens = {t.strip(b" \t").lower() for t in value.split(b",")}
                if b"upgrade" in tokens:
                    raise NotPlain("Connection: upgrade")
                close = close or b"close" in tokens
            elif n == b"authorization":
                auth = value.strip(b" \t")
        if length is None or b"host" not in seen:
            raise NotPlain("no Content-Length or no Host")
        return RequestHead(url.decode("ascii"), url, length, end, close, auth)


@dataclass(slots=True)
class ResponseHead:
    """What the core needs of a backend's response head."""

    status: int
    content_type: str  # the whole header value; "" when absent
    length: int | None  # Content-Length; None: chunked or until close
    chunked: bool
    close: bool  # the connection cannot carry another request

    @property
    def mime(self) -> str:
        return self.content_type.split(";", 1)[0].strip().lower()


class BadResponse(Exception):
    """A backend's answer the core does not vouch for (why, in its message)."""


class _Extra(Exception):
    """Bytes after a complete response: the connection is not reused."""


class ResponseReader:
    """A backend connection's responses as llhttp reads them: the head of the current one
    (a 1xx before it is skipped, as aiohttp's client skips it), its body decoded from its
    framing (``Content-Length``, chunked, or until the connection closes) and whether it is
    complete.

    `feed` sets `head`, adds the body's bytes to `pieces`, sets `complete`, and sets `error`
    when the bytes are not a valid response; body bytes that arrived before the error in the
    same read are in `pieces` all the same. A header value with a control character (CR, LF,
    NUL, ...) is an error (llhttp refuses most; this refuses them all), so no value the core
    forwards can add a header of the backend's choosing.
    """

    __slots__ = ("_p", "_headers", "_info", "_seen", "head", "pieces", "complete", "extra", "error")

    def __init__(self) -> None:
        self._p = httptools.HttpResponseParser(self)
        self.extra = False  # bytes came after a complete response
        self.error: str | None = None
        self.reset()

    def reset(self) -> None:
        """Ready for the next response on the same connection."""
        self._headers: list[tuple[bytes, bytes]] = []
        self._info = False  # in a 1xx
        self._seen = 0  # bytes fed before the head was complete
        self.head: ResponseHead | None = None
        self.pieces: list[bytes] = []
        self.complete = False

    # llhttp's callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            raise _Extra

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        p = self._p
        status = p.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._headers = []  # 100 Continue, 103 Early Hints: the response follows
            self._info = True
            return
        self.head = _response_head(status, p.get_http_version(), self._headers, p)

    def on_body(self, body: bytes) -> None:
        if self._info:  # llhttp reads a body for some 1xx (199 with Content-Length); h11 never
            raise BadResponse("a 1xx response with a body")
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        if self._info:
            self._info = False
        else:
            self.complete = True

    def feed(self, data: bytes) -> None:
        if self.error is not None or self.extra:
            return  # the parser stopped; so does this connection
        if self.head is None:
            self._seen += len(data)
        try:
            self._p.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            why = e.__context__
            if isinstance(why, _Extra):
                self.extra = True
            elif isinstance(why, BadResponse):
                self.error = str(why)
            else:  # a defect in a callback: the answer is not vouched for either way
                log.error("reading a backend's answer failed: %r", why)
                self.error = f"the proxy could not read its answer ({type(why).__name__})"
        except httptools.HttpParserUpgrade:
            self.error = "it switched protocols unasked"
        except httptools.HttpParserError as e:
            if self.complete:
                self.extra = True
            else:
                self.error = f"its answer is not valid HTTP ({e})"
        if self.head is None and self.error is None and self._seen > wire.MAX_RESPONSE_HEAD:
            self.error = "its response head is too long"

    def take(self) -> bytes:
        """The body's bytes fed since the last call, in one piece."""
        pieces = self.pieces
        self.pieces = []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _response_head(
    status: int, version: str, headers: list[tuple[bytes, bytes]], p: Any
) -> ResponseHead:
    if version not in ("1.1", "1.0"):
        raise BadResponse(f"HTTP/{version}")
    if not 200 <= status <= 599:
        raise BadResponse(f"status {status}")
    ctype: str | None = None
    length: int | None = None
    chunked = False
    for name, value in headers:
        if _CTL.search(value):
            raise BadResponse("a header value holds a control character")
        n = name.lower()
        if n == b"content-length":
            length = int(value.strip(b" \t"))  # llhttp checked it: digits, only one
        elif n == b"transfer-encoding":
            codings = [c.strip(b" \t").lower() for c in value.split(b",")]
            if chunked or codings != [b"chunked"]:
                raise BadResponse("unsupported Transfer-Encoding")
            chunked = True
        elif n == b"content-type":
            if ctype is not None:
                raise BadResponse("two Content-Type headers")  # which one? aiohttp's path says
            ctype = value.strip(b" \t").decode("latin-1")
    # llhttp knows: HTTP/1.0 without keep-alive, Connection: close, a body until close
    close = not p.should_keep_alive()
    if not chunked and length is None:
        close = True
    return ResponseHead(status, ctype or "", length, chunked, close)


class Target:
    """Where one backend's requests go: host, port and the request line's path prefix."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host = u.hostname or ""
        self.port = u.port or 80
        self.prefix_b = u.path.encode()
        self.host_header = u.netloc.encode()


def target(url: str) -> Target | None:
    """A plain-HTTP backend the fast path can reach; None for https (aiohttp serves those)."""
    return Target(url) if urlsplit(url).scheme == "http" else None


class Front(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    def __init__(self, proxy: Proxy) -> None:
        self.px = proxy
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.reader: RequestReader | None = None  # the head of the request in `buf`
        self.busy: Exchange | None = None  # the request being served
        self.gone = False
        self.deadline = 0.0
        self.got_bytes = False
        self._timer: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._paused = False  # the client's transport is above its high-water mark
        self._held = False  # an answer is out, the next request waits for the client to read

    # connection ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.px._fronts.add(self)
        self._begin(got_bytes=False)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.gone = True
        self._stop_timers()
        self.px._guard.end(self)
        self.px._fronts.discard(self)
        if self.busy is not None:
            self.busy.client_gone()

    def pause_writing(self) -> None:
        self._paused = True
        if self.busy is not None:
            self.busy.pause()

    def resume_writing(self) -> None:
        self._paused = False
        if self.busy is not None:
            self.busy.resume()
        elif self._held:
            self._held = False
            self._next()

    def data_received(self, data: bytes) -> None:
        if self.busy is not None or self._held:
            # pipelined behind a request being answered, or behind answers the client has not
            # read: kept, not started; past PIPELINE_BUFFER, reading stops until then
            self.buf += data
            if len(self.buf) > PIPELINE_BUFFER:
                assert self.transport is not None
                self.transport.pause_reading()
            return
        if self._timer is None:  # the first byte of a new request on a kept-alive connection
            self._begin(got_bytes=True)
        self.got_bytes = True
        self.buf += data
        self._process()

    # one request --------------------------------------------------------------------------

    def _begin(self, got_bytes: bool) -> None:
        """A request may be starting: it has the client timeout from now (`_ClientGuard`)."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        loop = asyncio.get_running_loop()
        self.got_bytes = got_bytes
        self.deadline = loop.time() + self.px._guard.timeout
        self._timer = loop.call_at(self.deadline, self.expire)
        self.px._guard.begin(self)

    def _process(self) -> None:
        buf = self.buf
        if self.reader is None:
            self.reader = RequestReader()
        px = self.px
        if px._draining:
            self.hand_over()  # aiohttp's path answers 503
            return
        try:
            got = self.reader.message(buf, PATHS, px.config.max_body_bytes)
        except NotPlain:
            self.hand_over()
            return
        if got is None:
            return  # the head or body is still coming, within the same deadline
        head, total = got
        try:
            p = routing.plan(_KINDS[head.path], buf[head.end : total])
        except RequestError:
            self.hand_over()  # aiohttp's path gives the 4xx and its message
            return
        role = px._fast_role(p)
        if role is None:
            self.hand_over()
            return
        self._stop_timers()
        px._guard.end(self)
        self.reader = None
        self.busy = ex = Exchange(self, head, p, role, buf[:total])
        self.buf = buf[total:]
        ex.start()

    def done(self, close: bool) -> None:
        """The response is out: next request (once the client reads its answers), or close."""
        self.busy = None
        t = self.transport
        if t is None or self.gone:
            return
        if close or self.px._draining:
            t.close()
            return
        if self._paused:
            self._held = True  # `resume_writing` goes on
            return
        self._next()

    def _next(self) -> None:
        t = self.transport
        if t is None or self.gone:
            return
        t.resume_reading()
        if self.buf:
            self._begin(got_bytes=True)
            self._process()
        else:
            self._idle = asyncio.get_running_loop().call_later(IDLE_KEEPALIVE, t.close)

    def give_back(self, ex: Exchange) -> None:
        """The request could not be served here, and nothing of an answer was sent: aiohttp's
        path serves it (and the rest of the connection)."""
        self.busy = None
        self.buf = ex.raw + self.buf
        if self.transport is None or self.gone:
            return
        self.deadline = asyncio.get_running_loop().time() + self.px._guard.timeout
        self.hand_over()

    def expire(self, evicted: bool = False) -> None:
        """Past the deadline (or pushed out by newer connections): aiohttp's handler sends the
        408 and closes, as for any connection."""
        self._timer = None
        self.hand_over(expired=True, evicted=evicted)

    def hand_over(self, expired: bool = False, evicted: bool = False) -> None:
        """Give this connection to aiohttp for good, with the bytes read so far."""
        self._stop_timers()
        self.reader = None
        self.px._fronts.discard(self)
        t, self.transport = self.transport, None
        if t is None or t.is_closing():
            self.px._guard.end(self)
            return
        handler = self.px._new_handler()
        t.set_protocol(handler)
        if self._paused:
            handler.pause_writing()
        t.resume_reading()
        deadline = asyncio.get_running_loop().time() if expired else self.deadline
        handler.adopt(self, t, self.buf, deadline, self.got_bytes, evicted)
        self.buf = b""

    def _stop_timers(self) -> None:
        for h in (self._timer, self._idle):
            if h is not None:
                h.cancel()
        self._timer = self._idle = None

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.gone:
            self.transport.write(data)


class Upstream(asyncio.Protocol):
    """One connection to a backend, carrying one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self.sink: Exchange | None = None
        self.reader = ResponseReader()
        self._told = False  # the sink has the current response's head
        self.reusable = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        sink, self.sink = self.sink, None
        if sink is not None:
            head = self.reader.head if self._told else None
            if head is not None and head.length is None and not head.chunked:
                sink.on_end()  # a body delimited by the connection's close
            else:
                sink.on_lost(exc)

    def send(self, data: bytes, sink: Exchange) -> None:
        self.sink = sink
        self.reader.reset()
        self._told = False
        self.reusable = False
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        self.sink = None
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # bytes nobody asked for: this connection cannot be trusted again
            self.close()
            return
        sink.last = sink.loop.time()
        r = self.reader
        r.feed(data)
        if r.head is not None and not self._told:
            self._told = True
            if not sink.on_head(r.head):
                return
        if r.pieces:
            # what arrived together goes on together: one pass, one write to the client
            sink.on_data(r.take())
            if self.sink is not sink:
                return
        if r.complete:
            self._finish(sink, extra=r.extra or r.error is not None)
        elif r.error is not None:
            sink.on_garbage(r.error)

    def _finish(self, sink: Exchange, extra: bool) -> None:
        head = self.reader.head
        assert head is not None
        self.sink = None
        self.reusable = not (extra or head.close or self.lost)
        sink.on_end()


class Exchange:
    """One request served by the fast path, from the backend's connection to the client's last
    byte. Driven by callbacks (a task only to open a connection); `Proxy.stop` waits for its
    future and ends it through ``outcome.stop_stream``."""

    def __init__(self, front: Front, head: RequestHead, p: Plan, role: str, raw: bytes):
        self.front, self.head, self.p, self.role, self.raw = front, head, p, role, raw
        self.px = px = front.px
        self.loop = loop = asyncio.get_running_loop()
        self.t0 = time.perf_counter()
        self.last = 0.0  # loop time of the backend's last byte
        self.check = p.route is Route.LOGPROBS
        self.up: Upstream | None = None
        self.pooled = False
        self.attempt = 0
        self.resp: ResponseHead | None = None
        self.body: list[bytes] = []
        self.size = 0
        self.sent = False  # bytes of an answer have gone to the client
        self.stream: _Relay | None = None
        self.finished = False
        self._timer: asyncio.TimerHandle | None = None
        self.outcome = o = server._Outcome(endpoint=head.path, route=p.route.value, backend=role)
        o.stop_stream = self.shut_down
        self.done: asyncio.Future[None] = loop.create_future()
        px._inflight[self.done] = o
        self.done.add_done_callback(px._request_done)
        px._busy[role] += 1
        px.metrics.in_flight.inc()

    # sending --------------------------------------------------------------------------------

    def start(self) -> None:
        up = None if self.p.stream or self.attempt else self.px._pool_get(self.role)
        if up is None:
            self.loop.create_task(self._connect())
        else:
            self.pooled = True
            self._send(up)

    async def _connect(self) -> None:
        t = self.px._targets[self.role]
        assert t is not None
        try:
            async with asyncio.timeout(self.px.config.connect_timeout):
                _, up = await self.loop.create_connection(Upstream, t.host, t.port)
        except (OSError, TimeoutError):
            self._finish("give-back")  # aiohttp's path says why, marks it down, falls back
            return
        if self.finished:  # the client left (or the proxy stopped) meanwhile
            up.close()
            return
        self.pooled = False
        self._send(up)

    def _send(self, up: Upstream) -> None:
        self.up = up
        self.last = self.loop.time()
        t = self.px._targets[self.role]
        assert t is not None
        up.send(self._request_bytes(t), self)
        if self._timer is None:
            self._timer = self.loop.call_at(
                self.last + self.px.config.read_timeout, self._read_timeout
            )

    def _request_bytes(self, t: Target) -> bytes:
        h = self.head
        body = self.p.body
        auth = b"Authorization: " + h.authorization + b"\r\n" if h.authorization else b""
        return (
            b"POST %b%b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%b\r\n%b"
            % (
                t.prefix_b,
                h.path_b,
                t.host_header,
                len(body),
                auth,
                body,
            )
        )

    def _read_timeout(self) -> None:
        """The backend's longest silence, checked lazily (no timer per byte)."""
        left = self.last + self.px.config.read_timeout - self.loop.time()
        if left > 0:
            self._timer = self.loop.call_later(left, self._read_timeout)
            return
        self._timer = None
        if self.stream is not None:
            self.stream.end(self.stream.timeout_error())
            self._finish("end")
        else:
            self._finish("timeout")

    # the backend's side (called by `Upstream`) --------------------------------------------

    def on_head(self, head: ResponseHead) -> bool:
        self.resp = head
        if head.status != 200:
            self._finish("give-back")  # aiohttp's path relays errors (503: marked down, fallback)
            return False
        if head.mime == "text/event-stream" and self.p.stream:
            self.stream = _Relay(self, self.outcome)
            self.sent = True
            self.front.write(
                wire.response_head(
                    200,
                    [
                        *self._headers(),
                        ("Content-Type", head.content_type or "text/event-stream"),
                        ("Cache-Control", "no-cache"),
                        ("X-Accel-Buffering", "no"),
                    ],
                    length=None,
                    close=self.head.close,
                )
            )
        elif head.length is not None and head.length > self.px.config.max_response_bytes:
            self._finish("give-back")
            return False
        return True

    def on_data(self, data: bytes) -> None:
        if self.stream is not None:
            self.stream.feed(data)
            return
        self.size += len(data)
        if self.size > self.px.config.max_response_bytes:
            self._finish("give-back")
            return
        self.body.append(data)

    def on_end(self) -> None:
        if self.stream is not None:
            self.stream.end(None)
        self._finish("end")

    def on_lost(self, exc: BaseException | None) -> None:
        if self.pooled and self.resp is None and not self.attempt and not self.finished:
            # a kept-alive connection the backend had closed: once more, on a fresh one
            self.px.metrics.retries.inc(self.role)
            self.attempt = 1
            self.start()
            return
        if self.stream is not None:
            self.stream.end(self.stream.closed_error())
            self._finish("end")
        else:
            self._finish("give-back")

    def on_garbage(self, why: str) -> None:
        if self.stream is not None:
            self.stream.end(
                ("upstream_garbage", f"the {self.role} backend sent an invalid stream ({why})")
            )
            self._finish("end")
        else:
            self._finish("give-back")

    # the client's side (called by `Front`) ------------------------------------------------

    def client_gone(self) -> None:
        self._finish("client-gone")

    def pause(self) -> None:
        """The client reads slower than the backend streams: stop reading the backend (only
        a stream's connection: a finished one may be going back to the pool)."""
        if self.stream is None or self.finished:
            return
        if self.up is not None and self.up.transport is not None and not self.up.lost:
            self.up.transport.pause_reading()

    def resume(self) -> None:
        if self.up is not None and self.up.transport is not None and not self.up.lost:
            self.up.transport.resume_reading()

    def shut_down(self) -> None:
        """`Proxy.stop` ends this request at the end of the grace period."""
        if self.stream is not None:
            self.stream.end(self.px._shutdown_error(self.role))
            self._finish("end")
        else:
            self._finish("shutdown")

    # the end --------------------------------------------------------------------------------

    def _headers(self) -> list[tuple[str, str]]:
        return [(server.H_BACKEND, self.role), (server.H_ROUTE, self.p.route.value)]

    def _finish(self, how: str) -> None:
        """The exchange is over (`how`): answer, or give the request back; then clean up."""
        if self.finished:
            return
        self.finished = True
        px, front, o = self.px, self.front, self.outcome
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        close = self.head.close
        give_back = how == "give-back"
        if not give_back:
            try:
                close = self._answer(how, o) or close
            except _GiveBack:
                give_back = True
            except Exception as e:  # a defect here must not lose the request
                log.exception("the fast path failed on %s", self.head.path)
                if self.sent:
                    px.metrics.errors.inc("internal")
                    o.note = f"internal error: {type(e).__name__}"
                    close = True
                else:
                    give_back = True
        up = self.up
        if up is not None:
            if up.reusable and not up.lost and not self.p.stream and how == "end":
                px._pool_put(self.role, up)
            else:
                up.close()
        px._busy[self.role] -= 1
        if give_back and not self.sent:
            px.metrics.fast_path.inc("given_back")
            px.metrics.in_flight.inc(by=-1)
            self.done.set_result(None)
            front.give_back(self)
            return
        px.metrics.fast_path.inc("served")
        px._account("POST", o, self.t0)
        self.done.set_result(None)
        front.done(close)

    def _answer(self, how: str, o: _Outcome) -> bool:
        """Write the response (or its end) to the client; True to close the connection."""
        px, front = self.px, self.front
        if self.stream is not None:
            if how == "client-gone":
                self.stream.client_gone()
            return self.stream.close_after
        if how == "client-gone":
            px._disconnected(o)
            return True
        if how in ("timeout", "shutdown"):
            if how == "timeout":
                kind, status = "upstream_timeout", 504
                msg = (
                    f"the {self.role} backend sent nothing for {px.config.read_timeout:g}s"
                    if self.resp is None
                    else f"the {self.role} backend went silent for "
                    f"{px.config.read_timeout:g}s mid-response"
                )
                o.note = kind
            else:
                kind, status, msg = "shutdown", 503, px._shutdown_message()
                o.note = "shutting down"
            px.metrics.errors.inc(kind)
            o.status = status
            body = server.error_body(status, msg)
            headers = self._headers() if how == "timeout" else []
            self.sent = True
            front.write(
                wire.response_head(
                    status,
                    [*headers, ("Content-Type", "application/json; charset=utf-8")],
                    length=len(body),
                    close=how == "shutdown",
                )
                + body
            )
            return how == "shutdown"
        # a whole JSON body
        resp = self.resp
        assert resp is not None
        raw = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        try:
            obj: Any = json.loads(raw)
        except (ValueError, RecursionError):
            raise _GiveBack from None  # aiohttp's path answers the 502
        if not isinstance(obj, dict | list):
            raise _GiveBack
        headers = self._headers()
        if self.check:
            # a failure here is a defect: the request goes back, and aiohttp's path
            # withholds the body with a 500 (never passes it unchecked)
            raw, n = px._checked_body(self.p, raw, obj, self.role, o)
            headers.append((server.H_PLACEHOLDERS, str(n)))
        headers.append(("Content-Type", resp.content_type or "application/json"))
        self.sent = True
        o.status = 200
        front.write(wire.response_head(200, headers, length=len(raw), close=self.head.close) + raw)
        return False


class _GiveBack(Exception):
    """A backend's 200 body the fast path does not vouch for: aiohttp's path handles it."""


class _Relay:
    """A stream relayed event by event as it arrives (the fast path's `_relay_stream`)."""

    def __init__(self, ex: Exchange, o: _Outcome) -> None:
        self.ex, self.o = ex, o
        self.st = server._StreamState()
        self.splitter = sse.EventSplitter()
        self.ended = False
        self.close_after = False

    def feed(self, data: bytes) -> None:
        if self.ended:
            return
        ex = self.ex
        px = ex.px
        events = self.splitter.feed(data)
        if events:
            pieces, bad = px._events(
                events, ex.p, self.st, ex.role, check=ex.check, annotated=False
            )
            if pieces:
                ex.front.write(wire.chunk(b"".join(pieces)))
            if bad is not None:
                if bad[0] != "internal":
                    bad = (
                        "upstream_garbage",
                        f"the {ex.role} backend sent an invalid stream ({bad[1]})",
                    )
                self.end(bad)
                ex._finish("end")
                return
            if self.st.finished:  # the last event: end the stream now, whatever follows
                self.end(None)
                ex._finish("end")
                return
        limit = px.config.max_response_bytes
        if self.splitter.pending > limit:
            self.end(
                (
                    "upstream_garbage",
                    f"the {ex.role} backend sent an invalid stream "
                    f"(an event is over {limit} bytes)",
                )
            )
            ex._finish("end")

    def closed_error(self) -> tuple[str, str]:
        ex = self.ex
        why = "closed the connection"
        ex.px._mark_down(ex.role, why)
        return (
            "upstream_closed",
            f"the {ex.role} backend {why} mid-stream; the response is incomplete",
        )

    def timeout_error(self) -> tuple[str, str]:
        ex = self.ex
        return (
            "upstream_timeout",
            f"the {ex.role} backend went silent for {ex.px.config.read_timeout:g}s",
        )

    def end(self, error: tuple[str, str] | None) -> None:
        """The stream's end: its error event if any, then the last chunk."""
        if self.ended:
            return
        self.ended = True
        ex = self.ex
        px = ex.px
        if self.st.finished:
            error = None  # nothing after the last event, not even an error
        elif error is None:
            error = px._unfinished(self.splitter, self.st, ex.role)
        if ex.check:
            px._count(ex.role, self.st.tally, self.o)
        self.o.status = self.o.status or 200
        tail = b""
        if error is not None:
            tail = px._stream_error(error, self.st, self.o, annotated=False)
        ex.front.write((wire.chunk(tail) if tail else b"") + wire.LAST_CHUNK)
        if ex.up is not None and error is not None:
            ex.up.close()

    def client_gone(self) -> None:
        if not self.ended:
            self.ended = True
            if self.ex.check:
                self.ex.px._count(self.ex.role, self.st.tally, self.o)
            self.ex.px.metrics.errors.inc("client_disconnect")
            self.o.status, self.o.note = 499, "client disconnected"
        self.close_after = True
