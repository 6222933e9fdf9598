"""The proxy itself: an aiohttp server in front of two fixed llama-server backends.

Request path, in order:
1. exact path match (`routing.ENDPOINTS`; anything else is a 404 from the proxy), method check,
   body read with a size limit, JSON and field-type validation (4xx with a message);
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
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from specaudit import __version__
from specaudit.proxy import metrics as metrics_mod
from specaudit.proxy import routing, sse
from specaudit.proxy.backends import BackendStatus, State, assess, describe_error, probe
from specaudit.proxy.config import OnPlainDown, ProxyConfig, ProxyError
from specaudit.proxy.placeholders import Tally, check_body, check_event
from specaudit.proxy.routing import Kind, Plan, RequestError, Route

log = logging.getLogger("specaudit.proxy")

PLAIN, SPEC = "plain", "spec"
MIN_RECHECK = 1.0  # seconds: a backend found down is re-probed at most this often per request

H_BACKEND = "X-Specaudit-Backend"
H_ROUTE = "X-Specaudit-Route"
H_PLACEHOLDERS = "X-Specaudit-Placeholders"
H_ANNOTATED = "X-Specaudit-Annotated"
H_FALLBACK = "X-Specaudit-Fallback"

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "unavailable_error",
    504: "timeout_error",
}

_SECRET = re.compile(r"(?i)(authorization|bearer|api[-_]?key)([\"']?\s*[:=]?\s*)(\S+)")


class _Redact(logging.Filter):
    """Belt and braces: the proxy never logs headers, and this masks any that slip through."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if _SECRET.search(msg):
            record.msg = _SECRET.sub(r"\1\2[redacted]", msg)
            record.args = None
        return True


_REDACT = _Redact()


def install_log_redaction() -> None:
    for name in ("specaudit.proxy", "aiohttp.access", "aiohttp.server", "aiohttp.web",
                 "aiohttp.client", "aiohttp.internal"):
        lg = logging.getLogger(name)
        if _REDACT not in lg.filters:
            lg.addFilter(_REDACT)


class Unreachable(Exception):
    """The backend could not answer at all; nothing has been sent to the client yet."""


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


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None
               ) -> bytes:
    """OpenAI's error shape (llama-server uses the same)."""
    return json.dumps(
        {"error": {"message": message, "type": type_ or ERROR_TYPES.get(status, "error"),
                   "param": param, "code": status}}
    ).encode()


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   param: str | None = None) -> web.Response:
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
        self._locks = {PLAIN: asyncio.Lock(), SPEC: asyncio.Lock()}
        for role in (PLAIN, SPEC):
            self._sessions[role] = self._new_session(self.config.max_connections)
            # streams get a fresh connection each, closed afterwards: llama-server closes it
            # anyway, and a pooled one it already closed would fail the request
            self._stream_sessions[role] = self._new_session(
                self.config.max_connections, force_close=True)
        # role checks use their own short-lived connections, never the request pool
        self._probe_session = self._new_session(4, force_close=True)
        try:
            await self.check_backends()
            plain = self.backends[PLAIN]
            if plain.state is State.UNUSABLE:
                raise ProxyError(
                    f"refusing to start: the plain backend {plain.url} {plain.detail}"
                )
            for b in self.backends.values():
                if b.state is not State.UP:
                    log.warning("%s backend %s is %s: %s", b.role, b.url, b.state.value, b.detail)
                if b.warning:
                    log.warning("%s backend %s: %s", b.role, b.url, b.warning)
            self._web = web.Server(
                self._handle,
                handler_cancellation=True,
                access_log=None,
                keepalive_timeout=75.0,
                # after refusing a body (413) do not wait long for the rest of it
                lingering_time=1.0,
            )
            loop = asyncio.get_running_loop()
            try:
                self._server = await loop.create_server(
                    self._web, self.config.host, self.config.port, reuse_address=True, backlog=1024
                )
            except OSError as e:
                raise ProxyError(
                    f"cannot listen on {self.config.host}:{self.config.port}: "
                    f"{e.strerror or e}"
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
                __version__, self.url, self.config.plain, self.backends[PLAIN].state.value,
                self.config.spec, self.backends[SPEC].state.value,
                self.config.on_plain_down.value,
            )
        except BaseException:
            await self._close_sessions()
            raise

    async def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
            self._checker = None
        if self._server is not None:
            self._server.close()
            if self._web is not None:
                await self._web.shutdown(timeout=5.0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None
        await self._close_sessions()

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
                self._probe_session, b.url, self._keys[role],
                timeout=min(self.config.connect_timeout + 5.0, 30.0),
            )
            assess(b, p)
            self._gauges(b)
            if (b.state, b.warning) != before:
                level = logging.INFO if b.state is State.UP and not b.warning else logging.WARNING
                log.log(level, "%s backend %s: %s (%s)%s", role, b.url, b.state.value, b.detail,
                        f"; {b.warning}" if b.warning else "")

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
        self.metrics.in_flight.inc()
        resp: web.StreamResponse | None = None
        try:
            resp = await self._dispatch(request, o)
            o.status = o.status or resp.status
            return resp
        except RequestError as e:
            kind = {404: "not_found", 405: "bad_method", 413: "body_too_large"}.get(
                e.status, "bad_request")
            self.metrics.errors.inc(kind)
            o.status, o.note = e.status, e.message
            return error_response(e.status, e.message, param=e.param)
        except (ConnectionResetError, asyncio.CancelledError):
            # the client went away; leaving this handler closes the upstream request
            self.metrics.errors.inc("client_disconnect")
            o.status = o.status or 499
            o.note = "client disconnected"
            raise
        finally:
            self.metrics.in_flight.inc(by=-1)
            dt = time.perf_counter() - t0
            self.metrics.duration_sum.inc(by=dt)
            self.metrics.duration_count.inc()
            if o.endpoint not in ("/health", "/metrics"):
                self.metrics.requests.inc(o.endpoint, o.route, o.backend, str(o.status))
            if log.isEnabledFor(logging.INFO):
                log.info(
                    "%s %s route=%s backend=%s status=%s%s %.1fms%s",
                    request.method, o.endpoint, o.route, o.backend, o.status,
                    "" if o.placeholders is None else f" placeholders={o.placeholders}",
                    dt * 1000, f" ({o.note})" if o.note else "",
                )

    async def _dispatch(self, request: web.BaseRequest, o: _Outcome) -> web.StreamResponse:
        path = request.path
        if path in ("/health", "/metrics"):
            if request.method != "GET":
                raise RequestError(405, f"{path} takes GET, not {request.method[:10]}")
            if path == "/health":
                return self._health()
            return web.Response(body=self.metrics.render().encode(),
                                headers={"Content-Type": metrics_mod.CONTENT_TYPE})
        ep = routing.ENDPOINTS.get(path)
        if ep is None:
            raise RequestError(404, f"unknown endpoint {path[:100]!r}; this proxy serves "
                               + ", ".join(list(routing.ENDPOINTS) + ["/health", "/metrics"]))
        method, kind = ep
        if request.method != method:
            raise RequestError(405, f"{path} takes {method}, not {request.method[:10]}")
        if kind is Kind.MODELS:
            o.route = Route.DEFAULT.value
            return await self._serve_models(request, o)
        raw = await self._read_body(request)
        p = routing.plan(kind, raw)
        o.route = p.route.value
        return await self._serve(request, p, o)

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(413, f"request body is {request.content_length} bytes; the "
                               f"limit is {limit}")
        chunks: list[bytes] = []
        n = 0
        async for chunk in request.content.iter_chunked(65536):
            n += len(chunk)
            if n > limit:
                raise RequestError(413, f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

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
            PLAIN if plain_ok
            else SPEC + " (annotated)" if spec_ok and self.config.on_plain_down
            is OnPlainDown.ANNOTATE else None
        )
        body = {
            "status": status,
            "version": __version__,
            "on_plain_down": self.config.on_plain_down.value,
            "logprobs_requests_served_by": logprobs_served_by,
            "backends": {r: s.public() for r, s in b.items()},
        }
        return web.Response(body=json.dumps(body).encode(), status=code,
                            content_type="application/json")

    # routing decisions ----------------------------------------------------------------------

    async def _serve_models(self, request: web.BaseRequest, o: _Outcome) -> web.StreamResponse:
        for role in (SPEC, PLAIN):
            try:
                return await self._forward(request, None, role, o, check=False,
                                           annotated=False, method="GET")
            except Unreachable as e:
                self._mark_down(role, str(e))
        return self._no_backend(o)

    def _no_backend(self, o: _Outcome) -> web.Response:
        self.metrics.errors.inc("no_backend")
        o.note = "no backend reachable"
        return error_response(503, "neither backend is reachable: plain "
                              f"{self.backends[PLAIN].detail}; spec {self.backends[SPEC].detail}")

    async def _serve(self, request: web.BaseRequest, p: Plan, o: _Outcome) -> web.StreamResponse:
        if p.route is Route.DEFAULT:
            try:
                return await self._forward(request, p, SPEC, o, check=False, annotated=False)
            except Unreachable as e:
                self._mark_down(SPEC, str(e))
            # the plain backend serves everything correctly, only slower
            try:
                return await self._forward(request, p, PLAIN, o, check=False, annotated=False,
                                           fallback="spec-down")
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
            return await self._forward(request, p, SPEC, o, check=True, annotated=True,
                                       fallback="plain-down")
        except Unreachable as e:
            self._mark_down(SPEC, str(e))
        return self._no_backend(o)

    # forwarding -----------------------------------------------------------------------------

    async def _open(self, role: str, path: str, method: str, body: bytes | None,
                    headers: dict[str, str], stream: bool) -> aiohttp.ClientResponse:
        session = (self._stream_sessions if stream else self._sessions)[role]
        url = self.backends[role].url + path
        for attempt in range(2):
            try:
                return await session.request(
                    method, url, data=body, headers=headers, timeout=self._timeout,
                    allow_redirects=False,
                )
            except aiohttp.ClientConnectorError as e:
                raise Unreachable(describe_error(e)) from None
            except aiohttp.ConnectionTimeoutError:
                raise Unreachable(f"connect timed out after {self.config.connect_timeout:g}s"
                                  ) from None
            except (TimeoutError, aiohttp.ServerTimeoutError):
                raise UpstreamFailed(
                    504, "upstream_timeout",
                    f"the {role} backend sent nothing for {self.config.read_timeout:g}s",
                ) from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    aiohttp.ClientPayloadError) as e:
                if attempt == 0:
                    self.metrics.retries.inc(role)
                    log.debug("%s backend dropped a connection (%s); re-sending once", role,
                              describe_error(e))
                    continue
                raise Unreachable(describe_error(e)) from None
            except aiohttp.ClientError as e:  # e.g. an answer that is not HTTP at all
                raise UpstreamFailed(
                    502, "upstream_garbage",
                    f"the {role} backend's answer is not valid HTTP ({type(e).__name__})",
                ) from None
        raise AssertionError("unreachable")

    async def _forward(self, request: web.BaseRequest, p: Plan | None, role: str, o: _Outcome,
                       *, check: bool, annotated: bool, method: str = "POST",
                       fallback: str | None = None) -> web.StreamResponse:
        headers = {"Content-Type": "application/json"} if p is not None else {}
        auth = request.headers.get("Authorization")
        if auth is not None:
            headers["Authorization"] = auth  # only ever to a configured backend
        # the upstream path is the routing table's own key, never text from the request
        path = _CANONICAL[request.path]
        try:
            resp = await self._open(role, path, method, p.body if p else None, headers,
                                    stream=p is not None and p.stream)
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
                return await self._relay_stream(request, resp, p, role, o, out_headers,
                                                check=check, annotated=annotated)
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
            raise UpstreamFailed(502, "upstream_too_large",
                                 f"the {role} backend's response is over {limit} bytes")
        chunks: list[bytes] = []
        n = 0
        try:
            async for chunk in resp.content.iter_any():
                n += len(chunk)
                if n > limit:
                    raise UpstreamFailed(502, "upstream_too_large",
                                         f"the {role} backend's response is over {limit} bytes")
                chunks.append(chunk)
        except (TimeoutError, aiohttp.ServerTimeoutError):
            raise UpstreamFailed(
                504, "upstream_timeout",
                f"the {role} backend went silent for {self.config.read_timeout:g}s mid-response",
            ) from None
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError) as e:
            raise Unreachable(f"{describe_error(e)} before the response was complete") from None
        return b"".join(chunks)

    async def _relay_body(self, resp: aiohttp.ClientResponse, p: Plan | None, role: str,
                          o: _Outcome, headers: dict[str, str], *, check: bool) -> web.Response:
        raw = await self._read_limited(resp, role, self.config.max_response_bytes)
        status = resp.status
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            if status >= 400:
                raise UpstreamFailed(502, "upstream_error",
                                     f"the {role} backend answered HTTP {status} with a body "
                                     "that is not JSON") from None
            raise UpstreamFailed(502, "upstream_garbage",
                                 f"the {role} backend answered HTTP {status} with a body that is "
                                 "not JSON") from None
        if status < 400 and not isinstance(obj, dict | list):
            raise UpstreamFailed(502, "upstream_garbage",
                                 f"the {role} backend answered JSON that is not an object")
        if status >= 400:
            self.metrics.errors.inc(f"upstream_{status // 100}xx")
        elif check and p is not None:
            t = check_body(p.kind, obj, p.requested)
            self._count(role, t, o)
            headers[H_PLACEHOLDERS] = str(t.placeholders)
            if t.placeholders:
                raw = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        ctype = resp.headers.get("Content-Type", "application/json")
        headers["Content-Type"] = ctype
        return web.Response(body=raw, status=status, headers=headers)

    def _count(self, role: str, t: Tally, o: _Outcome) -> None:
        o.placeholders = (o.placeholders or 0) + t.placeholders
        if t.tokens:
            self.metrics.tokens_checked.inc(role, by=t.tokens)
        if t.placeholders:
            self.metrics.placeholders.inc(role, by=t.placeholders)
            if role == PLAIN:
                # the plain backend must never send placeholders: re-check its role now
                log.warning("plain backend sent %d placeholder token(s); re-checking /slots",
                            t.placeholders)
                if self._wake is not None:
                    self._wake.set()

    async def _relay_stream(self, request: web.BaseRequest, resp: aiohttp.ClientResponse,
                            p: Plan, role: str, o: _Outcome, headers: dict[str, str], *,
                            check: bool, annotated: bool) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={
            **headers,
            "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        })
        await out.prepare(request)
        st = _StreamState()
        buf = b""
        limit = self.config.max_response_bytes
        error: tuple[str, str] | None = None  # (metric kind, message)
        try:
            async for chunk in resp.content.iter_any():
                buf += chunk
                events, buf = sse.split_events(buf)
                if len(buf) > limit:
                    raise sse.BadEvent(f"an event is over {limit} bytes")
                if not events:
                    continue
                pieces, bad = self._events(events, p, st, check=check, annotated=annotated)
                if pieces and not await self._send(out, b"".join(pieces), o):
                    if check:
                        self._count(role, st.tally, o)
                    return out
                if bad is not None:
                    raise sse.BadEvent(bad)
            if buf.strip():
                error = ("upstream_closed", f"the {role} backend ended the stream mid-event")
            elif not st.finished:
                error = ("upstream_closed",
                         f"the {role} backend ended the stream without its final event")
        except sse.BadEvent as e:
            error = ("upstream_garbage", f"the {role} backend sent an invalid stream ({e})")
        except (TimeoutError, aiohttp.ServerTimeoutError):
            error = ("upstream_timeout",
                     f"the {role} backend went silent for {self.config.read_timeout:g}s")
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError) as e:
            error = ("upstream_closed",
                     f"the {role} backend {describe_error(e)} mid-stream; the response is "
                     "incomplete")
            self._mark_down(role, describe_error(e))
        if check:
            self._count(role, st.tally, o)
        if error is not None:
            self.metrics.errors.inc(error[0])
            o.note = error[0]
            tail = b""
            if annotated:
                tail += _count_comment(st.tally)
            code = 504 if error[0] == "upstream_timeout" else 502
            tail += sse.encode_event(
                {"error": {"message": error[1], "type": ERROR_TYPES[code], "code": code}}
            )
            if not await self._send(out, tail, o):
                return out
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out

    def _events(self, events: list[bytes], p: Plan, st: _StreamState, *, check: bool,
                annotated: bool) -> tuple[list[bytes], str | None]:
        """The bytes to forward for complete events, and why the stream is bad (if it is):
        events before a bad one still go out."""
        pieces: list[bytes] = []
        for ev in events:
            try:
                obj = sse.parse_event(ev)
            except sse.BadEvent as e:
                return pieces, str(e)
            if obj == "[DONE]":
                st.finished = True
                if annotated:
                    pieces.append(_count_comment(st.tally))
            elif isinstance(obj, dict):
                if check:
                    t = check_event(p.kind, obj, p.requested, p.post_sampling)
                    if t.tokens:
                        st.tally.add(t)
                    if t.placeholders:
                        ev = sse.encode_event(obj)
                if obj.get("stop") is True or "error" in obj:
                    st.finished = True
                    if annotated and p.kind is Kind.COMPLETION:
                        pieces += (ev, _count_comment(st.tally))
                        continue
            elif obj is not None:
                return pieces, "event data is not a JSON object"
            pieces.append(ev)
        return pieces, None

    async def _send(self, out: web.StreamResponse, data: bytes, o: _Outcome) -> bool:
        """Write to the client; False when it has gone (the caller then drops upstream)."""
        try:
            await out.write(data)
            return True
        except ConnectionResetError:
            self.metrics.errors.inc("client_disconnect")
            o.status, o.note = 499, "client disconnected"
            return False


def _count_comment(t: Tally) -> bytes:
    """Where an annotated stream says how many placeholders it rewrote (headers went first)."""
    return sse.comment(f"specaudit-placeholders {t.placeholders}")


_KNOWN_PATHS = frozenset(list(routing.ENDPOINTS) + ["/health", "/metrics"])
_CANONICAL = {k: k for k in routing.ENDPOINTS}
