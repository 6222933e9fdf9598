"""aiohttp's server, hardened against slow and malformed clients.

Why subclasses: aiohttp gives a client unlimited time to send a request (one byte a minute
held a connection forever) and answers a request it cannot parse with a text body quoting its
bytes and an ERROR with a traceback. `RequestHandler` adds the deadline for sending a request
(`state.ClientGuard`: 408) and a JSON 400 with one redacted log line; `WebServer` makes its
connections use it. A handler also takes over connections the forwarding core gives up
(`RequestHandler.adopt`), with the bytes read so far and what the core knew of the request
(`state.Handover`), and gives a kept-alive connection back to the core once it has answered
and the client has sent nothing more (`RequestHandler.taker`): what sent one request here (a
backend check that timed out, a ``GET /health``) must not keep the connection on the slower,
larger path for good.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Protocol

import httptools
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from specaudit.proxy.answers import error_body
from specaudit.proxy.redact import redact
from specaudit.proxy.state import ClientGuard, Handover

log = logging.getLogger("specaudit.proxy")

_QUOTED = re.compile(r"""(?:^|[\s:])b?['"].*$""")  # a quoted (or bytes-repr) value onward


def _reason(exc: HttpProcessingError) -> str:
    """The parser's complaint without the request bytes it quotes (first line, bounded).

    The bytes go: the C parser shows the offending line on the next lines, the pure-Python
    one quotes a header's value (``Invalid HTTP header: b'<token>'``) without its name.
    """
    first = str(exc.message or "").strip().split("\n", 1)[0]
    first = _QUOTED.sub("", first).strip().rstrip(":")
    return redact(first)[:120] or type(exc).__name__


# where a connection is in its current request (`RequestHandler.phase`)

IDLE = "idle"  # between requests (aiohttp's keep-alive timeout governs idling)
HEADERS = "headers"  # a new connection, or the first bytes of a request: headers not complete
BODY = "body"  # headers complete, the body not yet read
HANDLING = "handling"  # the request is whole; the proxy is answering it
CLOSING = "closing"  # timed out: answered 408, discarding what else arrives, closing soon
LINGER = 1.0  # seconds a timed-out connection is still read (and discarded) before closing


def raw_response(status: int, reason: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class Taker(Protocol):
    """Who takes back a kept-alive connection between requests (the forwarding core)."""

    def takes_back(self) -> bool: ...

    def take_back(self, transport: asyncio.Transport) -> None: ...


class Boundary:
    """Whether the client's bytes so far end between two requests, by llhttp (the parser
    aiohttp's own uses) reading them alongside: aiohttp's parser does not say whether it holds
    the start of a pipelined request, and a connection holding one must not change hands."""

    __slots__ = ("_p", "inside", "broken")

    def __init__(self) -> None:
        self._p = httptools.HttpRequestParser(self)
        self.inside = False  # a request has begun and not ended
        self.broken = False  # llhttp gave up on these bytes: never between requests again

    def on_message_begin(self) -> None:
        self.inside = True

    def on_message_complete(self) -> None:
        self.inside = False

    def feed(self, data: bytes) -> None:
        if self.broken or not data:
            return
        try:
            self._p.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self.broken = True

    @property
    def between(self) -> bool:
        return not (self.inside or self.broken)


class RequestHandler(web.RequestHandler):
    """aiohttp's connection handler, with

    - the proxy's answer to a request it cannot parse: a JSON 400 and one log line, instead of
      a text body quoting the request's bytes and an ERROR with a traceback per request
      (anyone can send those);
    - a deadline for sending a request, headers and body (`ClientGuard`): aiohttp has none,
      so a client trickling its request one byte at a time held its connection forever.
    """

    on_bad_http: Any = None
    guard: ClientGuard | None = None
    phase: str = IDLE
    deadline: float = 0.0  # loop time by which the request in HEADERS/BODY must be complete
    got_bytes: bool = False  # HEADERS: the client has begun a request (so it gets a 408)
    evicted: bool = False
    body_timeout: asyncio.Timeout | None = None  # BODY: the body read's timeout, while it runs
    payload: Any = None  # the last request's body stream (its unread rest is not a request)
    handover: Handover | None = None  # the core's plan for the connection's next request
    taker: Taker | None = None  # takes the connection back between requests
    boundary: Boundary | None = None
    _timer: asyncio.TimerHandle | None = None

    # the request's phases ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.taker is not None:
            self.boundary = Boundary()
        self._begin(got_bytes=False)

    def adopt(
        self,
        front: Any,
        transport: asyncio.Transport,
        data: bytes,
        deadline: float,
        got_bytes: bool,
        evicted: bool,
        handover: Handover | None = None,
    ) -> None:
        """Take over a connection the forwarding core (`forwarding.Front`) began: its bytes so far,
        and the deadline of the request they begin (a passed one answers 408 at once), keeping
        its place among the connections still sending (`ClientGuard`). `handover`: what the
        core knew of that request (its plan; `take_handover` gives it to the request)."""
        self.handover = handover
        guard, self.guard = self.guard, None  # `connection_made` must not start a new deadline
        self.connection_made(transport)
        self.guard = guard
        if guard is not None:
            self.phase, self.deadline = HEADERS, deadline
            self.got_bytes, self.evicted = got_bytes or bool(data), evicted
            guard.replace(front, self)
            if data:
                if self.boundary is not None:
                    self.boundary.feed(data)
                super().data_received(data)
            # aiohttp sees the parsed headers in its task, which runs before this timer even
            # when the deadline has passed: complete headers then go on to the body's deadline
            self._timer = asyncio.get_running_loop().call_at(deadline, self.expire)
            return
        if data:
            self.data_received(data)

    def take_handover(self, body: bytes) -> Handover | None:
        """The core's knowledge of the request whose body is `body`, once: it was about the
        first request of the bytes handed over, and only if the body is the one it planned."""
        h, self.handover = self.handover, None
        if h is None or h.body != body:
            return None
        return h

    def data_received(self, data: bytes) -> None:
        if data:
            if self.boundary is not None:
                self.boundary.feed(data)
            if self.phase == IDLE and (self.payload is None or self.payload.is_eof()):
                self._begin(got_bytes=True)
            elif self.phase == HEADERS:
                self.got_bytes = True
        super().data_received(data)

    def _begin(self, got_bytes: bool) -> None:
        if self.guard is None:
            return
        loop = asyncio.get_running_loop()
        self.phase, self.got_bytes, self.evicted = HEADERS, got_bytes, False
        self.deadline = loop.time() + self.guard.timeout
        self._timer = loop.call_at(self.deadline, self.expire)
        self.guard.begin(self)

    def headers_done(self, payload: Any) -> None:
        """The request factory saw complete headers: the body is next, same deadline."""
        self._cancel_timer()
        self.payload = payload
        if self.phase == IDLE and self.guard is not None:
            # its first bytes came with the previous request's (pipelined): from now
            self.deadline = asyncio.get_running_loop().time() + self.guard.timeout
            self.got_bytes = True
            self.guard.begin(self)
            self.phase = BODY
        elif self.phase == HEADERS:
            self.phase = BODY

    def body_done(self) -> None:
        """The body was read (or there is none to read): no longer a client still sending."""
        if self.phase in (HEADERS, BODY):
            self.phase = HANDLING
        self.body_timeout = None
        if self.guard is not None:
            self.guard.end(self)

    def _idle(self) -> None:
        self._cancel_timer()
        self.body_done()
        if self.phase == HANDLING:
            self.phase = IDLE
        if self.payload is not None and self.payload.is_eof():
            self.payload = None  # read to the end: what comes next is a new request

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._idle()
            task = asyncio.current_task()
            if self.taker is not None and task is not None:
                # runs after aiohttp's connection task, woken by the same task's end, has
                # gone back to waiting for the next request (its callback came first)
                task.add_done_callback(self._hand_back)

    def _hand_back(self, _: object) -> None:
        """Give the connection back to the forwarding core if it is between requests: the
        answer is out, keep-alive, nothing of a next request read, nothing paused."""
        t, taker, waiter = self.transport, self.taker, self._waiter
        if (
            t is None
            or taker is None
            or waiter is None  # aiohttp is still busy with the last request (lingering)
            or waiter.done()
            or t.is_closing()
            or self._force_close
            or self._close
            or not self._keepalive
            or self._messages
            or self.phase != IDLE
            or self.payload is not None
            or self._upgraded
            or self._payload_parser is not None
            or self._paused
            or self._reading_paused
            or self._buffer_paused
            or self.boundary is None
            or not self.boundary.between
            or not taker.takes_back()
        ):
            return
        # detach as aiohttp's `connection_lost` does, but leave the transport open
        self._cancel_timer()
        if self.guard is not None:
            self.guard.end(self)
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None
        manager = self._manager
        self.transport = None
        self._force_close = True
        waiter.cancel()  # aiohttp's connection task ends, as for an idle connection it closes
        if manager is not None:
            manager.connection_lost(self, None)
        self._manager = None
        self._request_handler = None
        self._request_factory = None
        self._parser = None
        self.phase = CLOSING
        taker.take_back(t)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._idle()
        self.phase = CLOSING
        super().connection_lost(exc)

    def expire(self, evicted: bool = False) -> None:
        """The request is past its deadline (or pushed out by newer ones): in the headers, a
        408 and close; in the body, end the body read (which answers 408)."""
        self._timer = None
        if self.guard is None:
            return
        self.guard.end(self)
        self.evicted = self.evicted or evicted
        loop = asyncio.get_running_loop()
        if self.phase == BODY:
            self.deadline = min(self.deadline, loop.time())
            if self.body_timeout is not None and not self.body_timeout.expired():
                self.body_timeout.reschedule(self.deadline)
            return
        if self.phase != HEADERS:
            return
        self.phase = CLOSING
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not self.got_bytes:
            self.force_close()  # nothing was asked: nothing to answer
            return
        message = self.guard.message(self.evicted)
        peer = transport.get_extra_info("peername")
        self.guard.on_timeout(str(peer[0]) if isinstance(peer, tuple) else "-")
        transport.write(raw_response(408, "Request Timeout", error_body(408, message)))
        # no more requests on it; what else arrives is discarded for a moment (closing with
        # unread data would reset the connection and could lose the 408), then close
        self.close()
        self._timer = loop.call_later(LINGER, self.force_close)

    # malformed HTTP ----------------------------------------------------------------------

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        reason = _reason(exc)
        if self.on_bad_http is not None:
            self.on_bad_http(status)
        log.warning("bad HTTP request from %s: status=%d (%s)", request.remote, status, reason)
        resp = web.Response(
            status=status,
            content_type="application/json",
            body=error_body(status, f"malformed HTTP request: {reason}"),
        )
        resp.force_close()
        return resp


def conn_of(request: web.BaseRequest) -> RequestHandler | None:
    proto = request.protocol
    return proto if isinstance(proto, RequestHandler) else None


class WebServer(web.Server):
    """`web.Server` whose connections use `RequestHandler`."""

    taker: Taker | None = None  # set by the proxy: who takes connections back between requests

    def __init__(
        self, handler: Any, *, on_bad_http: Any, guard: ClientGuard | None, **kwargs: Any
    ) -> None:
        super().__init__(handler, request_factory=self._request, **kwargs)
        self._on_bad_http = on_bad_http
        self._guard = guard
        self._handler_kwargs = {
            k: v
            for k, v in kwargs.items()
            if k not in ("request_factory", "handler_cancellation", "loop")
        }

    def __call__(self) -> RequestHandler:
        h = RequestHandler(self, loop=asyncio.get_running_loop(), **self._handler_kwargs)
        h.on_bad_http = self._on_bad_http
        h.guard = self._guard
        h.taker = self.taker
        return h

    def _request(
        self,
        message: Any,
        payload: Any,
        protocol: web.RequestHandler,
        writer: Any,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        """aiohttp's request factory, called once a request's headers are complete."""
        if isinstance(protocol, RequestHandler):
            protocol.headers_done(payload)
        return web.BaseRequest(message, payload, protocol, writer, task, asyncio.get_running_loop())
