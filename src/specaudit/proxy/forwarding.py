"""The proxy's forwarding core: the common request served on raw asyncio protocols.

Why: aiohttp's server and client cost about 0.5 ms of CPU per request and 1.5 ms per 8-token
stream (docs/proxy.md), several times what the proxy's own work needs. On two cores that CPU
comes out of the backend's share. This core serves the plain case, a well-formed ``POST`` to a
generation endpoint whose backend is up, with one pass over the bytes each way and no
re-encoding of unchanged bytes:

- `Front` is each client connection's protocol. A request it does not take (another path or
  method, a chunked body, a request the routing rules refuse, a backend not known to be up, a
  stop in progress, a deadline passed) hands the whole connection, bytes read so far
  included, to aiohttp's path (through `state.ProxyState.new_handler`), with what the core
  knew of the request (`state.Handover`: its plan, never made twice). Error bodies for what the
  client did wrong (4xx, 408, 413) and fallbacks keep one home there.
- `Upstream` is one connection to a backend: kept alive and reused for non-streamed requests
  (idle at most 4 s, below llama-server's 5), a fresh one per stream (llama-server closes it).
- `Exchange` is one request from the backend's connection to the client's last byte. The
  re-send rule (docs/proxy.md, "When a request is sent twice"): the request goes to aiohttp's
  path only if the backend did not take it (the connection was refused: nothing was written;
  or it answered 503), and is re-sent on a fresh connection once if the backend closed a
  reused kept-alive connection without a byte of answer. Anything else after the request
  was written is answered here: the backend's own error status and body, a 502/504 JSON
  error, or (once the stream began) an SSE error event, built by the shared layer.

Responses to logprobs requests are checked here with the shared functions
(`answers.AnswerChecks.body_answer`, `answers.AnswerChecks.events`); the counters, access log and
graceful stop are shared. HTTP/1.1 is read with llhttp (`http1`). Memory per client
connection is bounded: while a request is answered at most `PIPELINE_BUFFER` bytes of
pipelined requests are read ahead, and while the client does not read its answers (its
transport paused) no next request is started.
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from specaudit.proxy import routing
from specaudit.proxy.exchange import Exchange
from specaudit.proxy.http1 import NotPlain, RequestReader
from specaudit.proxy.routing import RequestError
from specaudit.proxy.state import Handover, ProxyState

log = logging.getLogger("specaudit.proxy")

IDLE_KEEPALIVE = 75.0  # seconds an idle client connection stays open (aiohttp's default too)
PIPELINE_BUFFER = 65536  # bytes of pipelined requests read ahead while one is answered
PATHS = frozenset(p.encode() for p, (m, _) in routing.ENDPOINTS.items() if m == "POST")
_KINDS = {p: k for p, (_, k) in routing.ENDPOINTS.items()}


class Front(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    def __init__(self, proxy: ProxyState) -> None:
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
        self.px.fronts.add(self)
        self._begin(got_bytes=False)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.gone = True
        self._stop_timers()
        self.px.guard.end(self)
        self.px.fronts.discard(self)
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
        """A request may be starting: it has the client timeout from now (`state.ClientGuard`)."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        loop = asyncio.get_running_loop()
        self.got_bytes = got_bytes
        self.deadline = loop.time() + self.px.guard.timeout
        self._timer = loop.call_at(self.deadline, self.expire)
        self.px.guard.begin(self)

    def _process(self) -> None:
        buf = self.buf
        if self.reader is None:
            self.reader = RequestReader()
        px = self.px
        if px.draining:
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
        body = buf[head.end : total]
        try:
            p = routing.plan(_KINDS[head.path], body)
        except RequestError as e:
            self.hand_over(handover=Handover(body, e))  # aiohttp's path gives the 4xx
            return
        role = px.direct_role(p)
        if role is None:
            self.hand_over(handover=Handover(body, p))  # aiohttp's path picks a backend
            return
        self._stop_timers()
        px.guard.end(self)
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
        if close or self.px.draining:
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

    def take_back(self, transport: asyncio.Transport) -> None:
        """Serve a kept-alive connection aiohttp's path took (`hand_over`) and has answered
        on, from its next request on: it is between requests, nothing of the next one read."""
        self.transport = transport
        self.px.fronts.add(self)
        transport.set_protocol(self)
        self.px.metrics.returned.inc()
        self._idle = asyncio.get_running_loop().call_later(IDLE_KEEPALIVE, transport.close)

    def give_back(self, ex: Exchange, failed: tuple[str, str]) -> None:
        """The backend did not take the request (`failed`: its role, and why), and nothing of
        an answer was sent: aiohttp's path serves it (and the rest of the connection), with
        its plan, without that backend."""
        self.busy = None
        self.buf = ex.raw + self.buf
        if self.transport is None or self.gone:
            return
        self.deadline = asyncio.get_running_loop().time() + self.px.guard.timeout
        self.hand_over(handover=Handover(ex.p.body, ex.p, (failed,)))

    def expire(self, evicted: bool = False) -> None:
        """Past the deadline (or pushed out by newer connections): aiohttp's handler sends the
        408 and closes, as for any connection."""
        self._timer = None
        self.hand_over(expired=True, evicted=evicted)

    def hand_over(
        self, expired: bool = False, evicted: bool = False, handover: Handover | None = None
    ) -> None:
        """Give this connection to aiohttp's path, with the bytes read so far and what the
        core knew of the request they begin (`handover`); aiohttp's path gives it back
        between requests (`take_back`)."""
        self._stop_timers()
        self.reader = None
        self.px.fronts.discard(self)
        t, self.transport = self.transport, None
        if t is None or t.is_closing():
            self.px.guard.end(self)
            return
        handler = self.px.new_handler()
        t.set_protocol(cast(asyncio.BaseProtocol, handler))
        if self._paused:
            handler.pause_writing()
        t.resume_reading()
        deadline = asyncio.get_running_loop().time() if expired else self.deadline
        handler.adopt(self, t, self.buf, deadline, self.got_bytes, evicted, handover)
        self.buf = b""

    def _stop_timers(self) -> None:
        for h in (self._timer, self._idle):
            if h is not None:
                h.cancel()
        self._timer = self._idle = None

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.gone:
            self.transport.write(data)
