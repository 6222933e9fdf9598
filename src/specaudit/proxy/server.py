"""The proxy itself: two fixed llama-server backends behind one listener.

Every connection starts on the forwarding core (`fast`), which serves the common request on
raw asyncio protocols; whatever it does not take goes, bytes read so far included, to the
aiohttp server here, which implements every rule below. Both share this object's state: the
backends' roles, the counters, the access log and the graceful stop.

Request path, in order:
1. exact path match (`routing.ENDPOINTS`; anything else is a 404 from the proxy), method check,
   headers and body read with a size limit and a deadline (`_ClientGuard`: 408), JSON and
   field-type validation (4xx with a message);
2. routing: a request that asks for logprobs goes to the plain backend, anything else to the
   speculating one (`routing.plan`);
3. forwarding: the body bytes unchanged to ``<backend URL><same path>``; only
   ``Content-Type`` and the client's ``Authorization`` are passed on;
4. relaying: non-streamed bodies are checked and forwarded whole, SSE is forwarded event by
   event as it arrives. Responses to logprobs requests are checked token by token whichever
   backend sent them; a placeholder becomes ``logprob: null`` (`placeholders`).

Why the upstream connection after a stream is closed, never pooled: llama-server closes a
streamed connection although it advertised keep-alive, and a pooled client that reuses it fails
the next request ("Can not write request body"). A request that still meets a dropped pooled
connection before any response byte is re-sent once on a fresh one (generation requests have
no side effects, so the retry is safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
from aiohttp import web
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError

from specaudit import __version__
from specaudit.proxy import fast, routing, sse
from specaudit.proxy import metrics as metrics_mod
from specaudit.proxy.backends import BackendStatus, State, assess, describe_error, probe
from specaudit.proxy.config import OnPlainDown, ProxyConfig, ProxyError
from specaudit.proxy.placeholders import Tally, check_body, check_event
from specaudit.proxy.routing import Kind, Plan, RequestError, Route

log = logging.getLogger("specaudit.proxy")

PLAIN, SPEC = "plain", "spec"
MIN_RECHECK = 1.0  # seconds: a backend found down is re-probed at most this often per request
ABORT_WAIT = 1.0  # seconds, on stop: for the requests ended after the grace period to finish

H_BACKEND = "X-Specaudit-Backend"
H_ROUTE = "X-Specaudit-Route"
H_PLACEHOLDERS = "X-Specaudit-Placeholders"
H_ANNOTATED = "X-Specaudit-Annotated"
H_FALLBACK = "X-Specaudit-Fallback"

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    502: "upstream_error",
    503: "unavailable_error",
    504: "timeout_error",
}

# a secret-bearing name, its separator (quoted, as in a dict or JSON), an optional auth
# scheme, and the value; or an auth scheme and its credentials anywhere
_SECRET = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api[-_]?key|access[-_]?token)"
    r"(\\?[\"']?\s*[:=]?\s*\\?[\"']?\s*)"
    r"((?:bearer|basic|token)\s+)?"
    r"([^\s\"'\\]+)"
)
_SCHEME = re.compile(r"(?i)\b(bearer|basic)(\s+)(?!\[redacted\])([^\s\"'\\]+)")


def redact(text: str) -> str:
    """`text` with anything that looks like a credential replaced by ``[redacted]``."""
    text = _SECRET.sub(lambda m: f"{m[1]}{m[2]}{m[3] or ''}[redacted]", text)
    return _SCHEME.sub(r"\1\2[redacted]", text)


class _Redact(logging.Filter):
    """Belt and braces: the proxy never logs headers, and this masks any that slip through,
    in the message and in the traceback (an exception's text can quote a request's bytes:
    aiohttp's parser errors show the offending header line, ``Authorization`` included).

    The traceback is formatted here, redacted, and kept as ``exc_text`` (which every
    `logging.Formatter` prints); ``exc_info`` is dropped so no handler formats the raw one.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a bad format string must not hide the record, nor leak its args
            msg = f"{record.msg} {record.args!r}"
        clean = redact(msg)
        if clean != msg or record.args:
            record.msg, record.args = clean, None
        if record.exc_info:
            text = record.exc_text or _FORMATTER.formatException(record.exc_info)
            record.exc_info = None
            record.exc_text = redact(text)
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_FORMATTER = logging.Formatter()
_REDACT = _Redact()
_LOGGERS = (
    "specaudit.proxy",
    "aiohttp.access",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.client",
    "aiohttp.internal",
    "asyncio",
)


def install_log_redaction() -> None:
    for name in _LOGGERS:
        lg = logging.getLogger(name)
        if _REDACT not in lg.filters:
            lg.addFilter(_REDACT)


_QUOTED = re.compile(r"""(?:^|[\s:])b?['"].*$""")  # a quoted (or bytes-repr) value onward


def _reason(exc: HttpProcessingError) -> str:
    """The parser's complaint without the request bytes it quotes (first line, bounded).

    The bytes go: the C parser shows the offending line on the next lines, the pure-Python
    one quotes a header's value (``Invalid HTTP header: b'<token>'``) without its name.
    """
    first = str(exc.message or "").strip().split("\n", 1)[0]
    first = _QUOTED.sub("", first).strip().rstrip(":")
    return redact(first)[:120] or type(exc).__name__


# where a connection is in its current request (`_RequestHandler.phase`)
IDLE = "idle"  # between requests (aiohttp's keep-alive timeout governs idling)
HEADERS = "headers"  # a new connection, or the first bytes of a request: headers not complete
BODY = "body"  # headers complete, the body not yet read
HANDLING = "handling"  # the request is whole; the proxy is answering it
CLOSING = "closing"  # timed out: answered 408, discarding what else arrives, closing soon
LINGER = 1.0  # seconds a timed-out connection is still read (and discarded) before closing


class _ClientGuard:
    """Connections still sending a request, oldest first (slow-loris defence, D12).

    A request has ``timeout`` seconds from its first byte (a new connection's first request:
    from connecting) until its body has been read. The header phase is timed by the
    connection (`_RequestHandler.expire`), the body phase by `Proxy._read_body`
    (``asyncio.timeout_at(conn.deadline)``). At most ``limit`` connections may be in either
    phase: one more pushes out the one that has been sending longest.
    """

    def __init__(self, timeout: float, limit: int, on_timeout: Callable[[str], None]) -> None:
        self.timeout, self.limit = timeout, limit
        self.on_timeout = on_timeout  # called with the peer when a 408 is sent in the headers
        # `_RequestHandler`s and `fast.Front`s, insertion order: oldest first
        self._sending: dict[Any, None] = {}

    def __len__(self) -> int:
        return len(self._sending)

    def begin(self, conn: Any) -> None:
        self._sending[conn] = None
        while len(self._sending) > self.limit:
            oldest = next(iter(self._sending))
            self.end(oldest)
            oldest.expire(evicted=True)

    def end(self, conn: Any) -> None:
        self._sending.pop(conn, None)

    def replace(self, old: Any, new: Any) -> None:
        """`new` takes `old`'s place in the order, if `old` has one (an evicted or finished
        request has none: its deadline, already set, is all that is left to enforce)."""
        if old in self._sending:
            self._sending = {(new if c is old else c): None for c in self._sending}

    def message(self, evicted: bool) -> str:
        if evicted:
            return (
                f"client timeout: {self.limit} connections were still sending a request, and "
                "this one had been sending longest"
            )
        return f"client timeout: the request was not complete {self.timeout:g}s after it began"


def _raw_response(status: int, reason: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _RequestHandler(web.RequestHandler):
    """aiohttp's connection handler, with

    - the proxy's answer to a request it cannot parse: a JSON 400 and one log line, instead of
      a text body quoting the request's bytes and an ERROR with a traceback per request
      (anyone can send those);
    - a deadline for sending a request, headers and body (`_ClientGuard`): aiohttp has none,
      so a client trickling its request one byte at a time held its connection forever.
    """

    on_bad_http: Any = None
    guard: _ClientGuard | None = None
    phase: str = IDLE
    deadline: float = 0.0  # loop time by which the request in HEADERS/BODY must be complete
    got_bytes: bool = False  # HEADERS: the client has begun a request (so it gets a 408)
    evicted: bool = False
    body_timeout: asyncio.Timeout | None = None  # BODY: the body read's timeout, while it runs
    payload: Any = None  # the last request's body stream (its unread rest is not a request)
    _timer: asyncio.TimerHandle | None = None

    # the request's phases ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._begin(got_bytes=False)

    def adopt(
        self,
        front: Any,
        transport: asyncio.Transport,
        data: bytes,
        deadline: float,
        got_bytes: bool,
        evicted: bool,
    ) -> None:
        """Take over a connection the fast path (`fast.Front`) began: its bytes so far, and the
        deadline of the request they begin (a passed one answers 408 at once), keeping its
        place among the connections still sending (`_ClientGuard`)."""
        guard, self.guard = self.guard, None  # `connection_made` must not start a new deadline
        self.connection_made(transport)
        self.guard = guard
        if guard is not None:
            self.phase, self.deadline = HEADERS, deadline
            self.got_bytes, self.evicted = got_bytes or bool(data), evicted
            guard.replace(front, self)
            if data:
                super().data_received(data)
            # aiohttp sees the parsed headers in its task, which runs before this timer even
            # when the deadline has passed: complete headers then go on to the body's deadline
            self._timer = asyncio.get_running_loop().call_at(deadline, self.expire)
            return
        if data:
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if data:
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
        transport.write(_raw_response(408, "Request Timeout", error_body(408, message)))
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


def _conn(request: web.BaseRequest) -> _RequestHandler | None:
    proto = request.protocol
    return proto if isinstance(proto, _RequestHandler) else None


class _WebServer(web.Server):
    """`web.Server` whose connections use `_RequestHandler`."""

    def __init__(
        self, handler: Any, *, on_bad_http: Any, guard: _ClientGuard | None, **kwargs: Any
    ) -> None:
        super().__init__(handler, request_factory=self._request, **kwargs)
        self._on_bad_http = on_bad_http
        self._guard = guard
        self._handler_kwargs = {
            k: v
            for k, v in kwargs.items()
            if k not in ("request_factory", "handler_cancellation", "loop")
        }

    def __call__(self) -> web.RequestHandler:
        h = _RequestHandler(self, loop=asyncio.get_running_loop(), **self._handler_kwargs)
        h.on_bad_http = self._on_bad_http
        h.guard = self._guard
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
        if isinstance(protocol, _RequestHandler):
            protocol.headers_done(payload)
        return web.BaseRequest(message, payload, protocol, writer, task, asyncio.get_running_loop())


class Unreachable(Exception):
    """The backend could not answer at all; nothing has been sent to the client yet."""


class _ShuttingDown(Exception):
    """Set on a stream's upstream reader when the proxy stops: end the stream with an error."""


class UpstreamFailed(Exception):
    """The backend answered unusably (timeout, garbage); nothing sent to the client yet."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


@dataclass
class _Outcome:
    """What the access log line and the request counter say about one request."""

    endpoint: str = "-"
    route: str = "-"
    backend: str = "none"
    status: int = 0
    placeholders: int | None = None
    note: str = ""
    shutdown: bool = False  # ended by the proxy stopping (`Proxy.stop`)
    # how `stop` ends the request after the grace period (a stream relayed by aiohttp's path,
    # any fast-path request); None: its task is cancelled and answers 503
    stop_stream: Callable[[], None] | None = None
    counted: bool = True  # False: given back by the fast path, counted by aiohttp's


@dataclass
class _StreamState:
    tally: Tally = field(default_factory=Tally)
    finished: bool = False  # saw [DONE], a final stop event, or an error event


@dataclass
class ProxyStats:
    """A snapshot of what the proxy has done (returned by `run`, shown by /health)."""

    url: str
    uptime_s: float
    on_plain_down: str
    requests: int
    requests_by_route: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    placeholders_caught: dict[str, int] = field(default_factory=dict)
    backends: dict[str, dict[str, Any]] = field(default_factory=dict)


def error_body(
    status: int, message: str, type_: str | None = None, param: str | None = None
) -> bytes:
    """OpenAI's error shape (llama-server uses the same)."""
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": type_ or ERROR_TYPES.get(status, "error"),
                "param": param,
                "code": status,
            }
        }
    ).encode()


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None, param: str | None = None
) -> web.Response:
    return web.Response(
        body=error_body(status, message, param=param),
        status=status,
        content_type="application/json",
        headers=headers,
    )


class Proxy:
    """``await Proxy(config).start()``; then ``proxy.url`` serves until ``await proxy.stop()``."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = metrics_mod.Metrics()
        self.metrics.in_flight.set(value=0)
        self.backends = {
            PLAIN: BackendStatus(PLAIN, config.plain),
            SPEC: BackendStatus(SPEC, config.spec),
        }
        self._keys = {PLAIN: config.plain_api_key, SPEC: config.spec_api_key}
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._stream_sessions: dict[str, aiohttp.ClientSession] = {}
        self._probe_session: aiohttp.ClientSession | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._wake: asyncio.Event | None = None
        self._checker: asyncio.Task[None] | None = None
        self._web: web.Server | None = None
        self._server: asyncio.AbstractServer | None = None
        self._started = 0.0
        self._guard = _ClientGuard(
            config.client_timeout, config.max_incomplete_requests, self._client_timed_out
        )
        # every request being served (aiohttp runs each in its own task), for a graceful stop
        self._inflight: dict[asyncio.Future[Any], _Outcome] = {}
        # the fast path (`fast`): client connections it holds, kept-alive backend connections,
        # requests it is serving per backend, and where each backend is (None: https)
        self._fronts: set[fast.Front] = set()
        self._pools: dict[str, list[fast.Upstream]] = {PLAIN: [], SPEC: []}
        self._busy = {PLAIN: 0, SPEC: 0}
        self._targets = {PLAIN: fast.target(config.plain), SPEC: fast.target(config.spec)}
        self._draining = False
        self._hurry: asyncio.Event | None = None
        self.port = config.port
        self._timeout = aiohttp.ClientTimeout(
            total=config.total_timeout,
            connect=None,
            sock_connect=config.connect_timeout,
            sock_read=config.read_timeout,
        )

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    # lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Check both backends' roles, then listen. Refuses to start if plain speculates."""
        install_log_redaction()
        self._started = time.monotonic()
        self._wake = asyncio.Event()
        self._hurry = asyncio.Event()
        self._draining = False
        self._locks = {PLAIN: asyncio.Lock(), SPEC: asyncio.Lock()}
        for role in (PLAIN, SPEC):
            self._sessions[role] = self._new_session(self.config.max_connections)
            # streams get a fresh connection each, closed afterwards: llama-server closes it
            # anyway, and a pooled one it already closed would fail the request
            self._stream_sessions[role] = self._new_session(
                self.config.max_connections, force_close=True
            )
        # role checks use their own short-lived connections, never the request pool
        self._probe_session = self._new_session(4, force_close=True)
        try:
            await self.check_backends()
            plain = self.backends[PLAIN]
            if plain.state is State.UNUSABLE:
                raise ProxyError(f"refusing to start: the plain backend {plain.url} {plain.detail}")
            for b in self.backends.values():
                if b.state is not State.UP:
                    log.warning("%s backend %s is %s: %s", b.role, b.url, b.state.value, b.detail)
                if b.warning:
                    log.warning("%s backend %s: %s", b.role, b.url, b.warning)
            self._web = _WebServer(
                self._handle,
                on_bad_http=self._bad_http,
                guard=self._guard,
                handler_cancellation=True,
                access_log=None,
                keepalive_timeout=75.0,
                # after refusing a body (413) do not wait long for the rest of it
                lingering_time=1.0,
            )
            loop = asyncio.get_running_loop()
            try:
                self._server = await loop.create_server(
                    lambda: fast.Front(self),
                    self.config.host,
                    self.config.port,
                    reuse_address=True,
                    backlog=1024,
                )
            except OSError as e:
                raise ProxyError(
                    f"cannot listen on {self.config.host}:{self.config.port}: {e.strerror or e}"
                ) from None
            sock = self._server.sockets[0]
            self.port = int(sock.getsockname()[1])
            self._checker = asyncio.create_task(self._check_loop())
            if not self.config.loopback:
                log.warning(
                    "listening on %s: anyone who can reach it can use both backends",
                    self.config.host,
                )
            log.info(
                "specaudit proxy %s on %s: plain %s (%s), spec %s (%s), on plain down: %s",
                __version__,
                self.url,
                self.config.plain,
                self.backends[PLAIN].state.value,
                self.config.spec,
                self.backends[SPEC].state.value,
                self.config.on_plain_down.value,
            )
        except BaseException:
            await self._close_sessions()
            raise

    def _new_handler(self) -> _RequestHandler:
        """A connection handler of aiohttp's path, for a connection `fast.Front` gives up."""
        assert self._web is not None
        h = self._web()
        assert isinstance(h, _RequestHandler)
        return h

    def _fast_role(self, p: Plan) -> str | None:
        """The backend the fast path may send `p` to now; None: aiohttp's path decides."""
        role = SPEC if p.route is Route.DEFAULT else PLAIN
        if (
            self.backends[role].state is not State.UP
            or self._targets[role] is None
            or self.config.total_timeout is not None
            or self._busy[role] >= self.config.max_connections
        ):
            return None
        return role

    def _pool_get(self, role: str) -> fast.Upstream | None:
        pool = self._pools[role]
        now = asyncio.get_running_loop().time()
        while pool:
            up = pool.pop()
            if not up.lost and now - up.idle_since < fast.POOL_IDLE:
                return up
            up.close()
        return None

    def _pool_put(self, role: str, up: fast.Upstream) -> None:
        if up.transport is not None:
            up.transport.resume_reading()  # never pool a connection left paused
        up.idle_since = asyncio.get_running_loop().time()
        self._pools[role].append(up)

    def _bad_http(self, status: int) -> None:
        self.metrics.errors.inc("bad_request")
        self.metrics.requests.inc("other", "-", "none", str(status))

    def _client_timed_out(self, peer: str) -> None:
        """A client sent part of a request's headers but not all in time: it got a 408."""
        self.metrics.errors.inc("client_timeout")
        self.metrics.requests.inc("other", "-", "none", "408")
        log.info("client %s: status=408 (request headers not complete in time)", peer)

    def hurry(self) -> None:
        """End a `stop` in progress without waiting for the rest of its grace period."""
        if self._hurry is not None:
            self._hurry.set()

    async def stop(self, grace: float | None = None) -> None:
        """Stop gracefully: stop accepting, let the requests in flight finish for up to
        `grace` seconds (default ``config.shutdown_grace``), then end the rest: a stream with
        an SSE error event, a request not yet answered with a 503. Returns within about
        ``grace + 1.5`` seconds whatever the backends and clients do."""
        grace = self.config.shutdown_grace if grace is None else grace
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
            self._checker = None
        if self._server is not None:
            self._draining = True
            self._server.close()  # no new connections
            for front in list(self._fronts):
                if front.busy is None:
                    if front.got_bytes and front.buf:
                        front.hand_over()  # a request begun: aiohttp's path answers it (503)
                    elif front.transport is not None:
                        front.transport.close()  # idle: close now
            if self._web is not None:
                for conn in self._web.connections:
                    phase = conn.phase if isinstance(conn, _RequestHandler) else IDLE
                    if phase == HANDLING:
                        conn.close()  # closed once its answer is out
                    elif phase != BODY:  # BODY: the request's answer closes it (`_handle`)
                        conn.force_close()  # idle, or a request not yet begun: close now
            if self._inflight:
                log.info(
                    "stopping: %d request(s) in flight, waiting up to %gs",
                    len(self._inflight),
                    grace,
                )
            await self._drain(grace)
            for task, o in list(self._inflight.items()):
                self._abort(task, o)
            if self._inflight:  # each ends at once: its error event or 503 is written
                await asyncio.wait(set(self._inflight), timeout=ABORT_WAIT)
            if self._web is not None:
                # whatever is left (a client not reading its answer) is cut here
                await self._web.shutdown(timeout=ABORT_WAIT / 2)
            for front in list(self._fronts):
                if front.transport is not None:
                    front.transport.abort()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), ABORT_WAIT)
            self._server = None
        await self._close_sessions()
        for pool in self._pools.values():
            while pool:
                pool.pop().close()

    async def _drain(self, grace: float) -> None:
        """Wait until no request is in flight, `grace` has passed, or `hurry` was called."""
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        hurry = self._hurry
        while self._inflight and not (hurry is not None and hurry.is_set()):
            left = end - loop.time()
            if left <= 0:
                return
            waiter = asyncio.ensure_future(hurry.wait()) if hurry is not None else None
            try:
                await asyncio.wait(
                    {*self._inflight, *([waiter] if waiter else [])},
                    timeout=left,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                if waiter is not None:
                    waiter.cancel()

    def _abort(self, task: asyncio.Future[Any], o: _Outcome) -> None:
        """End one request at the end of the grace period."""
        if o.shutdown or task.done():
            return
        o.shutdown = True
        if o.stop_stream is not None:
            # a stream being relayed ends with an error event (`_relay_stream`); a fast-path
            # request ends itself (`fast.Exchange.shut_down`: the error event, or a 503)
            o.stop_stream()
        else:
            # nothing sent yet: the handler answers 503 (`_handle`)
            task.cancel()

    async def __aenter__(self) -> Proxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _new_session(self, limit: int, force_close: bool = False) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=limit,
            # below llama-server's 5 s keep-alive, so an idle pooled connection is dropped by us
            # before the server drops it under us
            keepalive_timeout=4.0 if not force_close else None,
            force_close=force_close,
            use_dns_cache=True,
        )
        if hasattr(connector, "_factory"):  # aiohttp's protocol factory (private): see _BodyFailing
            loop = asyncio.get_running_loop()
            cast(Any, connector)._factory = functools.partial(_BodyFailing, loop=loop)
        return aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # bytes pass through as the backend sent them
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,  # never route through an HTTP(S)_PROXY from the environment
            skip_auto_headers=("User-Agent",),
        )

    async def _close_sessions(self) -> None:
        for s in (
            list(self._sessions.values())
            + list(self._stream_sessions.values())
            + ([self._probe_session] if self._probe_session else [])
        ):
            await s.close()
        self._sessions.clear()
        self._stream_sessions.clear()
        self._probe_session = None

    # role checks ----------------------------------------------------------------------------

    async def check_backends(self) -> None:
        await asyncio.gather(self._check(PLAIN), self._check(SPEC))

    async def _check(self, role: str, not_before: float | None = None) -> None:
        """Probe one backend; concurrent callers share one probe."""
        lock = self._locks[role]
        b = self.backends[role]
        async with lock:
            if not_before is not None and b.checked_mono >= not_before:
                return  # someone else probed while we waited
            assert self._probe_session is not None
            before = (b.state, b.warning)
            p = await probe(
                self._probe_session,
                b.url,
                self._keys[role],
                timeout=min(self.config.connect_timeout + 5.0, 30.0),
            )
            assess(b, p)
            self._gauges(b)
            if (b.state, b.warning) != before:
                level = logging.INFO if b.state is State.UP and not b.warning else logging.WARNING
                log.log(
                    level,
                    "%s backend %s: %s (%s)%s",
                    role,
                    b.url,
                    b.state.value,
                    b.detail,
                    f"; {b.warning}" if b.warning else "",
                )

    def _gauges(self, b: BackendStatus) -> None:
        self.metrics.backend_up.set(b.role, value=1 if b.state is State.UP else 0)
        spec = -1 if b.speculating is None else int(b.speculating)
        self.metrics.backend_speculating.set(b.role, value=spec)

    async def _check_loop(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.config.check_interval)
            self._wake.clear()
            try:
                await self.check_backends()
            except Exception as e:  # a failed check must never stop future checks
                log.warning("backend check failed: %s", type(e).__name__)
            await asyncio.sleep(MIN_RECHECK / 2)

    def _mark_down(self, role: str, why: str) -> None:
        b = self.backends[role]
        if b.state is not State.DOWN:
            log.warning("%s backend %s: down (%s)", role, b.url, why)
        if b.state is not State.UNUSABLE:
            b.state = State.DOWN
            b.detail = why
        b.checked_mono = time.monotonic()
        self._gauges(b)
        if self._wake is not None:
            self._wake.set()

    async def _usable(self, role: str) -> str | None:
        """None when `role` may take requests now, else why not (re-probing at most 1/s)."""
        b = self.backends[role]
        if b.state is State.UP:
            return None
        now = time.monotonic()
        if now - b.checked_mono >= MIN_RECHECK:
            await self._check(role, not_before=now)
        return None if b.state is State.UP else b.detail

    # serving --------------------------------------------------------------------------------

    def stats(self) -> ProxyStats:
        m = self.metrics
        by_route: dict[str, int] = {}
        for (_, route, _, _), v in m.requests.values.items():
            by_route[route] = by_route.get(route, 0) + int(v)
        return ProxyStats(
            url=self.url,
            uptime_s=time.monotonic() - self._started if self._started else 0.0,
            on_plain_down=self.config.on_plain_down.value,
            requests=int(m.requests.total()),
            requests_by_route=by_route,
            errors={k[0]: int(v) for k, v in m.errors.values.items()},
            placeholders_caught={k[0]: int(v) for k, v in m.placeholders.values.items()},
            backends={r: b.public() for r, b in self.backends.items()},
        )

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        t0 = time.perf_counter()
        o = _Outcome(endpoint=request.path if request.path in _KNOWN_PATHS else "other")
        task = asyncio.current_task()
        if task is not None:
            self._inflight[task] = o
            task.add_done_callback(self._request_done)
        self.metrics.in_flight.inc()
        resp: web.StreamResponse | None = None
        try:
            if self._draining:
                self.metrics.errors.inc("shutdown")
                o.note = "shutting down"
                resp = error_response(503, "the proxy is shutting down; retry elsewhere or later")
            else:
                resp = await self._dispatch(request, o)
            o.status = o.status or resp.status
            return resp
        except RequestError as e:
            kind = {
                404: "not_found",
                405: "bad_method",
                408: "client_timeout",
                413: "body_too_large",
            }.get(e.status, "bad_request")
            self.metrics.errors.inc(kind)
            o.status, o.note = e.status, e.message
            resp = error_response(e.status, e.message, param=e.param)
            if e.status == 408:
                resp.force_close()
            return resp
        except Exception as e:
            # a defect in the proxy: a clean JSON error (never aiohttp's text 500), the
            # traceback in the log (redacted like every record)
            log.exception("internal error serving %s %s", request.method, o.endpoint)
            self.metrics.errors.inc("internal")
            o.status, o.note = 500, f"internal error: {type(e).__name__}"
            return error_response(500, f"the proxy failed on this request ({type(e).__name__})")
        except asyncio.CancelledError:
            if o.shutdown and task is not None and task.cancelling() == 1:
                # cancelled by `stop` after the grace period, before anything was sent
                task.uncancel()
                self.metrics.errors.inc("shutdown")
                o.status, o.note = 503, "shutting down"
                resp = error_response(503, self._shutdown_message())
                return resp
            self._disconnected(o)
            raise
        except ConnectionResetError:
            self._disconnected(o)
            raise
        finally:
            if self._draining and resp is not None:
                resp.force_close()  # no further request on this connection
            conn = _conn(request)
            if conn is not None:
                conn.body_done()
            self._account(request.method, o, t0)

    def _account(self, method: str, o: _Outcome, t0: float) -> None:
        """One request answered (by either path): its counters and its access log line."""
        self.metrics.in_flight.inc(by=-1)
        dt = time.perf_counter() - t0
        self.metrics.duration_sum.inc(by=dt)
        self.metrics.duration_count.inc()
        if o.endpoint not in ("/health", "/metrics"):
            self.metrics.requests.inc(o.endpoint, o.route, o.backend, str(o.status))
        if log.isEnabledFor(logging.INFO):
            log.info(
                "%s %s route=%s backend=%s status=%s%s %.1fms%s",
                method,
                o.endpoint,
                o.route,
                o.backend,
                o.status,
                "" if o.placeholders is None else f" placeholders={o.placeholders}",
                dt * 1000,
                f" ({o.note})" if o.note else "",
            )

    def _request_done(self, task: asyncio.Future[Any]) -> None:
        self._inflight.pop(task, None)

    def _disconnected(self, o: _Outcome) -> None:
        # the client went away; leaving the handler closes the upstream request
        self.metrics.errors.inc("client_disconnect")
        o.status = o.status or 499
        o.note = "client disconnected"

    async def _dispatch(self, request: web.BaseRequest, o: _Outcome) -> web.StreamResponse:
        path = request.path
        if path in ("/health", "/metrics"):
            _body_done(request)
            if request.method != "GET":
                raise RequestError(405, f"{path} takes GET, not {request.method[:10]}")
            if path == "/health":
                return self._health()
            return web.Response(
                body=self.metrics.render().encode(),
                headers={"Content-Type": metrics_mod.CONTENT_TYPE},
            )
        ep = routing.ENDPOINTS.get(path)
        if ep is None:
            raise RequestError(
                404,
                f"unknown endpoint {path[:100]!r}; this proxy serves "
                + ", ".join(list(routing.ENDPOINTS) + ["/health", "/metrics"]),
            )
        method, kind = ep
        if request.method != method:
            raise RequestError(405, f"{path} takes {method}, not {request.method[:10]}")
        if kind is Kind.MODELS:
            _body_done(request)
            o.route = Route.DEFAULT.value
            return await self._serve_models(request, o)
        raw = await self._read_body(request)
        p = routing.plan(kind, raw)
        o.route = p.route.value
        return await self._serve(request, p, o)

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        """The whole body, by the request's deadline (`_ClientGuard`) and within the limit."""
        limit = self.config.max_body_bytes
        conn = _conn(request)
        try:
            if request.content_length is not None and request.content_length > limit:
                raise RequestError(
                    413, f"request body is {request.content_length} bytes; the limit is {limit}"
                )
            if conn is not None and conn.phase == BODY:
                deadline = conn.deadline
            else:
                deadline = asyncio.get_running_loop().time() + self.config.client_timeout
            chunks: list[bytes] = []
            n = 0
            try:
                async with asyncio.timeout_at(deadline) as timeout:
                    if conn is not None:
                        conn.body_timeout = timeout
                    async for chunk in request.content.iter_chunked(65536):
                        n += len(chunk)
                        if n > limit:
                            raise RequestError(
                                413, f"request body is over the limit of {limit} bytes"
                            )
                        chunks.append(chunk)
            except TimeoutError:
                evicted = conn is not None and conn.evicted
                raise RequestError(408, self._guard.message(evicted)) from None
            return b"".join(chunks)
        finally:
            if conn is not None:
                conn.body_done()

    def _health(self) -> web.Response:
        b = self.backends
        plain_ok = b[PLAIN].state is State.UP
        spec_ok = b[SPEC].state is State.UP
        if plain_ok and spec_ok:
            status, code = "ok", 200
        elif plain_ok or spec_ok:
            status, code = "degraded", 200
        else:
            status, code = "down", 503
        logprobs_served_by = (
            PLAIN
            if plain_ok
            else SPEC + " (annotated)"
            if spec_ok and self.config.on_plain_down is OnPlainDown.ANNOTATE
            else None
        )
        body = {
            "status": status,
            "version": __version__,
            "on_plain_down": self.config.on_plain_down.value,
            "logprobs_requests_served_by": logprobs_served_by,
            "backends": {r: s.public() for r, s in b.items()},
        }
        return web.Response(
            body=json.dumps(body).encode(), status=code, content_type="application/json"
        )

    # routing decisions ----------------------------------------------------------------------

    async def _serve_models(self, request: web.BaseRequest, o: _Outcome) -> web.StreamResponse:
        for role in (SPEC, PLAIN):
            try:
                return await self._forward(
                    request, None, role, o, check=False, annotated=False, method="GET"
                )
            except Unreachable as e:
                self._mark_down(role, str(e))
        return self._no_backend(o)

    def _no_backend(self, o: _Outcome) -> web.Response:
        self.metrics.errors.inc("no_backend")
        o.note = "no backend reachable"
        return error_response(
            503,
            "neither backend is reachable: plain "
            f"{self.backends[PLAIN].detail}; spec {self.backends[SPEC].detail}",
        )

    async def _serve(self, request: web.BaseRequest, p: Plan, o: _Outcome) -> web.StreamResponse:
        if p.route is Route.DEFAULT:
            try:
                return await self._forward(request, p, SPEC, o, check=False, annotated=False)
            except Unreachable as e:
                self._mark_down(SPEC, str(e))
            # the plain backend serves everything correctly, only slower
            try:
                return await self._forward(
                    request, p, PLAIN, o, check=False, annotated=False, fallback="spec-down"
                )
            except Unreachable as e:
                self._mark_down(PLAIN, str(e))
            return self._no_backend(o)

        why = await self._usable(PLAIN)
        if why is None:
            try:
                return await self._forward(request, p, PLAIN, o, check=True, annotated=False)
            except Unreachable as e:
                why = str(e)
                self._mark_down(PLAIN, why)
        if self.config.on_plain_down is OnPlainDown.ERROR:
            self.metrics.errors.inc("plain_down")
            o.note = "plain backend down"
            b = self.backends[PLAIN]
            return error_response(
                503,
                f"this request asks for logprobs, which only the plain (non-speculating) backend "
                f"{b.url} can answer truthfully, and it is {b.state.value}: {why}. The "
                "speculating backend would return placeholder values (logprob 0.0 with no "
                "candidates). Retry later, or run the proxy with --on-plain-down annotate to be "
                "served by the speculating backend with placeholders set to null.",
                headers={H_ROUTE: p.route.value},
            )
        try:
            return await self._forward(
                request, p, SPEC, o, check=True, annotated=True, fallback="plain-down"
            )
        except Unreachable as e:
            self._mark_down(SPEC, str(e))
        return self._no_backend(o)

    # forwarding -----------------------------------------------------------------------------

    async def _open(
        self,
        role: str,
        path: str,
        method: str,
        body: bytes | None,
        headers: dict[str, str],
        stream: bool,
    ) -> aiohttp.ClientResponse:
        session = (self._stream_sessions if stream else self._sessions)[role]
        url = self.backends[role].url + path
        for attempt in range(2):
            try:
                return await session.request(
                    method,
                    url,
                    data=body,
                    headers=headers,
                    timeout=self._timeout,
                    allow_redirects=False,
                )
            except aiohttp.ClientConnectorError as e:
                raise Unreachable(describe_error(e)) from None
            except aiohttp.ConnectionTimeoutError:
                raise Unreachable(
                    f"connect timed out after {self.config.connect_timeout:g}s"
                ) from None
            except (TimeoutError, aiohttp.ServerTimeoutError):
                raise UpstreamFailed(
                    504,
                    "upstream_timeout",
                    f"the {role} backend sent nothing for {self.config.read_timeout:g}s",
                ) from None
            except (
                aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError,
                aiohttp.ClientPayloadError,
            ) as e:
                if attempt == 0:
                    self.metrics.retries.inc(role)
                    log.debug(
                        "%s backend dropped a connection (%s); re-sending once",
                        role,
                        describe_error(e),
                    )
                    continue
                raise Unreachable(describe_error(e)) from None
            except aiohttp.ClientError as e:  # e.g. an answer that is not HTTP at all
                raise UpstreamFailed(
                    502,
                    "upstream_garbage",
                    f"the {role} backend's answer is not valid HTTP ({type(e).__name__})",
                ) from None
        raise AssertionError("unreachable")

    async def _forward(
        self,
        request: web.BaseRequest,
        p: Plan | None,
        role: str,
        o: _Outcome,
        *,
        check: bool,
        annotated: bool,
        method: str = "POST",
        fallback: str | None = None,
    ) -> web.StreamResponse:
        headers = {"Content-Type": "application/json"} if p is not None else {}
        auth = request.headers.get("Authorization")
        if auth is not None:
            headers["Authorization"] = auth  # only ever to a configured backend
        # the upstream path is the routing table's own key, never text from the request
        path = _CANONICAL[request.path]
        try:
            resp = await self._open(
                role,
                path,
                method,
                p.body if p else None,
                headers,
                stream=p is not None and p.stream,
            )
        except UpstreamFailed as e:
            self.metrics.errors.inc(e.kind)
            o.backend, o.note = role, e.kind
            return error_response(e.status, e.message, headers={H_BACKEND: role})
        o.backend = role
        out_headers = {H_BACKEND: role}
        if p is not None:
            out_headers[H_ROUTE] = p.route.value
        if annotated:
            out_headers[H_ANNOTATED] = "true"
        if fallback:
            out_headers[H_FALLBACK] = fallback
        try:
            if resp.status == 503:
                detail = await self._error_message(resp, role)
                raise Unreachable(f"answered HTTP 503 ({detail})")
            if resp.status == 200 and resp.content_type == "text/event-stream" and p is not None:
                return await self._relay_stream(
                    request, resp, p, role, o, out_headers, check=check, annotated=annotated
                )
            return await self._relay_body(resp, p, role, o, out_headers, check=check)
        except UpstreamFailed as e:
            self.metrics.errors.inc(e.kind)
            o.note = e.kind
            return error_response(e.status, e.message, headers=out_headers)
        finally:
            # Never pool a connection that carried a stream (llama-server closes it anyway);
            # a fully read non-streamed response goes back to the pool.
            if resp.content_type == "text/event-stream" or not resp.content.at_eof():
                resp.close()
            else:
                resp.release()

    async def _error_message(self, resp: aiohttp.ClientResponse, role: str) -> str:
        try:
            raw = await self._read_limited(resp, role, 65536)
            err = json.loads(raw).get("error")
            msg = err.get("message") if isinstance(err, dict) else err
            return " ".join(str(msg).split())[:200] if msg else "no message"
        except Exception:
            return "no message"

    async def _read_limited(self, resp: aiohttp.ClientResponse, role: str, limit: int) -> bytes:
        if resp.content_length is not None and resp.content_length > limit:
            raise UpstreamFailed(
                502, "upstream_too_large", f"the {role} backend's response is over {limit} bytes"
            )
        chunks: list[bytes] = []
        n = 0
        try:
            async for chunk in resp.content.iter_any():
                n += len(chunk)
                if n > limit:
                    raise UpstreamFailed(
                        502,
                        "upstream_too_large",
                        f"the {role} backend's response is over {limit} bytes",
                    )
                chunks.append(chunk)
        except (TimeoutError, aiohttp.ServerTimeoutError):
            raise UpstreamFailed(
                504,
                "upstream_timeout",
                f"the {role} backend went silent for {self.config.read_timeout:g}s mid-response",
            ) from None
        except BrokenFraming as e:
            raise UpstreamFailed(
                502, "upstream_garbage", f"the {role} backend's answer is not valid HTTP ({e})"
            ) from None
        except (
            aiohttp.ClientPayloadError,
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
        ) as e:
            raise Unreachable(f"{describe_error(e)} before the response was complete") from None
        return b"".join(chunks)

    async def _relay_body(
        self,
        resp: aiohttp.ClientResponse,
        p: Plan | None,
        role: str,
        o: _Outcome,
        headers: dict[str, str],
        *,
        check: bool,
    ) -> web.Response:
        raw = await self._read_limited(resp, role, self.config.max_response_bytes)
        status = resp.status
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            if status >= 400:
                raise UpstreamFailed(
                    502,
                    "upstream_error",
                    f"the {role} backend answered HTTP {status} with a body that is not JSON",
                ) from None
            raise UpstreamFailed(
                502,
                "upstream_garbage",
                f"the {role} backend answered HTTP {status} with a body that is not JSON",
            ) from None
        if status < 400 and not isinstance(obj, dict | list):
            raise UpstreamFailed(
                502, "upstream_garbage", f"the {role} backend answered JSON that is not an object"
            )
        if status >= 400:
            self.metrics.errors.inc(f"upstream_{status // 100}xx")
        elif check and p is not None:
            try:
                raw, n = self._checked_body(p, raw, obj, role, o)
            except Exception as e:
                # the body cannot be vouched for: withhold it rather than pass it unchecked
                log.exception("checking the %s backend's response failed", role)
                raise UpstreamFailed(500, "internal", _withheld(role, e)) from None
            headers[H_PLACEHOLDERS] = str(n)
        ctype = resp.headers.get("Content-Type", "application/json")
        headers["Content-Type"] = ctype
        return web.Response(body=raw, status=status, headers=headers)

    def _checked_body(
        self, p: Plan, raw: bytes, obj: Any, role: str, o: _Outcome
    ) -> tuple[bytes, int]:
        """A logprobs response body checked: the bytes to send (re-encoded only when a
        placeholder was rewritten to null) and how many were."""
        t = check_body(p.kind, obj, p.requested)
        if t.placeholders:
            raw = sse.encode_json(obj)  # lone surrogates stay escaped
        self._count(role, t, o)
        return raw, t.placeholders

    def _count(self, role: str, t: Tally, o: _Outcome) -> None:
        o.placeholders = (o.placeholders or 0) + t.placeholders
        if t.tokens:
            self.metrics.tokens_checked.inc(role, by=t.tokens)
        if t.placeholders:
            self.metrics.placeholders.inc(role, by=t.placeholders)
            if role == PLAIN:
                # the plain backend must never send placeholders: re-check its role now
                log.warning(
                    "plain backend sent %d placeholder token(s); re-checking /slots", t.placeholders
                )
                if self._wake is not None:
                    self._wake.set()

    async def _relay_stream(
        self,
        request: web.BaseRequest,
        resp: aiohttp.ClientResponse,
        p: Plan,
        role: str,
        o: _Outcome,
        headers: dict[str, str],
        *,
        check: bool,
        annotated: bool,
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            status=200,
            headers={
                **headers,
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )
        # `stop` ends the relay through its upstream body (`_ShuttingDown`)
        o.stop_stream = lambda: resp.content.set_exception(_ShuttingDown())
        if o.shutdown:
            resp.content.set_exception(_ShuttingDown())
        await out.prepare(request)
        st = _StreamState()
        # linear in the bytes received, however long an event grows (one 64 MiB event used
        # to cost seconds of CPU here and stall every other request)
        splitter = sse.EventSplitter()
        limit = self.config.max_response_bytes
        error: tuple[str, str] | None = None  # (metric kind, message)

        async def relay(chunk: bytes) -> bool:
            """Forward the events `chunk` completes; False when the client has gone."""
            events = splitter.feed(chunk)
            if events:
                pieces, bad = self._events(events, p, st, role, check=check, annotated=annotated)
                if pieces and not await self._send(out, b"".join(pieces), o):
                    return False
                if bad is not None:
                    if bad[0] == "internal":
                        raise _Withheld(bad[1])
                    raise sse.BadEvent(bad[1])
            if splitter.pending > limit and not st.finished:
                raise sse.BadEvent(f"an event is over {limit} bytes")
            return True

        try:
            try:
                async for chunk in resp.content.iter_any():
                    if not await relay(chunk):
                        if check:
                            self._count(role, st.tally, o)
                        return out
                    if st.finished:
                        break  # the stream's last event: end it now, whatever follows
            except aiohttp.ClientPayloadError:
                # broken framing: the complete events that came with it still go first
                # (aiohttp raises before handing out what it had buffered)
                if not await relay(_unread(resp.content)):
                    if check:
                        self._count(role, st.tally, o)
                    return out
                if not st.finished:
                    raise
            if not st.finished:
                error = self._unfinished(splitter, st, role)
        except _Withheld as e:
            error = ("internal", str(e))
        except BrokenFraming as e:
            error = (
                "upstream_garbage",
                f"the {role} backend sent an invalid stream (its answer is not valid HTTP ({e}))",
            )
        except sse.BadEvent as e:
            error = ("upstream_garbage", f"the {role} backend sent an invalid stream ({e})")
        except _ShuttingDown:
            error = self._shutdown_error(role)
        except (TimeoutError, aiohttp.ServerTimeoutError):
            error = (
                "upstream_timeout",
                f"the {role} backend went silent for {self.config.read_timeout:g}s",
            )
        except (
            aiohttp.ClientPayloadError,
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
        ) as e:
            error = (
                "upstream_closed",
                f"the {role} backend {describe_error(e)} mid-stream; the response is incomplete",
            )
            self._mark_down(role, describe_error(e))
        except Exception as e:
            # a defect in the proxy mid-stream: end the stream with an error event (headers
            # are gone, so no status can say it) instead of tearing the connection
            log.exception("relaying the %s backend's stream failed", role)
            error = ("internal", _withheld(role, e))
        if check:
            self._count(role, st.tally, o)
        if error is not None:
            tail = self._stream_error(error, st, o, annotated)
            if not await self._send(out, tail, o):
                return out
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out

    def _unfinished(
        self, splitter: sse.EventSplitter, st: _StreamState, role: str
    ) -> tuple[str, str] | None:
        """Why a stream whose backend ended it cleanly is still incomplete, if it is."""
        if splitter.rest().strip():
            return ("upstream_closed", f"the {role} backend ended the stream mid-event")
        if not st.finished:
            return (
                "upstream_closed",
                f"the {role} backend ended the stream without its final event",
            )
        return None

    def _shutdown_message(self) -> str:
        return (
            "the proxy is shutting down and the backend had not answered this request "
            f"within the {self.config.shutdown_grace:g}s grace period; retry"
        )

    def _shutdown_error(self, role: str) -> tuple[str, str]:
        return (
            "shutdown",
            f"the proxy is shutting down; the {role} backend's response did not finish within "
            f"the {self.config.shutdown_grace:g}s grace period and is incomplete",
        )

    def _stream_error(
        self, error: tuple[str, str], st: _StreamState, o: _Outcome, annotated: bool
    ) -> bytes:
        """The end of a stream that failed: counted, then its SSE error event."""
        self.metrics.errors.inc(error[0])
        o.note = error[0]
        tail = _count_comment(st.tally) if annotated else b""
        code = {"upstream_timeout": 504, "internal": 500, "shutdown": 503}.get(error[0], 502)
        return tail + sse.encode_event(
            {"error": {"message": error[1], "type": ERROR_TYPES[code], "code": code}}
        )

    def _events(
        self,
        events: list[bytes],
        p: Plan,
        st: _StreamState,
        role: str,
        *,
        check: bool,
        annotated: bool,
    ) -> tuple[list[bytes], tuple[str, str] | None]:
        """The bytes to forward for complete events, and why the stream is bad (if it is:
        ``(metric kind, message)``): events before a bad one still go out."""
        pieces: list[bytes] = []
        for ev in events:
            try:
                obj = sse.parse_event(ev)
            except sse.BadEvent as e:
                return pieces, ("upstream_garbage", str(e))
            try:
                piece = self._event(ev, obj, p, st, check=check, annotated=annotated)
            except Exception as e:
                # never forward an event that could not be checked: it may hold a placeholder
                log.exception("checking an event from the %s backend failed", role)
                return pieces, ("internal", _withheld(role, e))
            if piece is None:
                return pieces, ("upstream_garbage", "event data is not a JSON object")
            pieces += piece
            if st.finished:
                break  # the last event ([DONE], "stop": true, an error): nothing after it
        return pieces, None

    def _event(
        self, ev: bytes, obj: Any, p: Plan, st: _StreamState, *, check: bool, annotated: bool
    ) -> list[bytes] | None:
        """What to forward for one parsed event; None when it is not a JSON object."""
        if obj == "[DONE]":
            st.finished = True
            return [_count_comment(st.tally), ev] if annotated else [ev]
        if obj is None:  # a comment (keep-alive ping)
            return [ev]
        if not isinstance(obj, dict):
            return None
        if check:
            t = check_event(p.kind, obj, p.requested, p.post_sampling)
            if t.tokens:
                st.tally.add(t)
            if t.placeholders:
                ev = sse.encode_event(obj)  # lone surrogates stay escaped
        if obj.get("stop") is True or "error" in obj:
            st.finished = True
            if annotated and p.kind is Kind.COMPLETION:
                return [ev, _count_comment(st.tally)]
        return [ev]

    async def _send(self, out: web.StreamResponse, data: bytes, o: _Outcome) -> bool:
        """Write to the client; False when it has gone (the caller then drops upstream)."""
        try:
            await out.write(data)
            return True
        except ConnectionResetError:
            self.metrics.errors.inc("client_disconnect")
            o.status, o.note = 499, "client disconnected"
            return False


class _BodyFailing(ResponseHandler):
    """aiohttp's client protocol, telling a response body's reader when its framing breaks.

    When a body's framing breaks mid-body (a bad chunk size after good chunks), aiohttp 3.14
    closes the connection but never tells the body's reader: a relay reading it waited
    forever, past ``sock_read`` too (the error drops that timer). Here the error reaches the
    reader as `aiohttp.ClientPayloadError`, like a connection closed mid-body.
    """

    def set_exception(self, exc: BaseException, exc_cause: BaseException | None = None) -> None:
        payload = getattr(self, "_payload", None)
        if exc_cause is None:
            super().set_exception(exc)
        else:
            super().set_exception(exc, exc_cause)
        if (
            isinstance(exc, HttpProcessingError)  # the parser's (not a timeout, not a close)
            and isinstance(payload, aiohttp.StreamReader)
            and not payload.is_eof()
            and payload.exception() is None
        ):
            why = str(getattr(exc, "message", "") or "").strip().split("\n", 1)[0]
            payload.set_exception(BrokenFraming(why.rstrip(":")[:120] or "broken framing"))


class BrokenFraming(aiohttp.ClientPayloadError):
    """A backend's response body whose framing broke mid-body (`_BodyFailing`); its message is
    the parser's reason."""


class _Withheld(Exception):
    """An event could not be checked (its message says why): the stream ends with a 500."""


def _unread(content: Any) -> bytes:
    """What aiohttp had received of a body but not handed out when the body failed.

    Its StreamReader raises a framing error (a bad chunk) before returning what it had
    buffered, which may hold complete events that came in the same read. The buffer is
    private (``_buffer``, ``_buffer_offset``); if it ever changes, nothing is recovered.
    """
    buf = getattr(content, "_buffer", None)
    if not buf:
        return b""
    data = b"".join(buf)
    return data[getattr(content, "_buffer_offset", 0) :]


def _withheld(role: str, e: Exception) -> str:
    return (
        f"the proxy could not check the {role} backend's response ({type(e).__name__}); "
        "it is withheld so that no placeholder passes as real"
    )


def _count_comment(t: Tally) -> bytes:
    """Where an annotated stream says how many placeholders it rewrote (headers went first)."""
    return sse.comment(f"specaudit-placeholders {t.placeholders}")


def _body_done(request: web.BaseRequest) -> None:
    conn = _conn(request)
    if conn is not None:
        conn.body_done()


_KNOWN_PATHS = frozenset(list(routing.ENDPOINTS) + ["/health", "/metrics"])
_CANONICAL = {k: k for k in routing.ENDPOINTS}
