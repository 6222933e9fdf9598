"""aiohttp's path: every request the forwarding core does not serve, and every rule.

Every connection starts on the forwarding core (`forwarding`); whatever it does not take goes, bytes
read so far included, to aiohttp's server (`slow_clients.WebServer`), whose handler is
`AiohttpPath.handle`. Both depend on the shared layer (`state`) only: the backends' roles, the
counters, the access log and the graceful stop live there.

Request path, in order:
1. exact path match (`routing.ENDPOINTS`; anything else is a 404 from the proxy), method check,
   headers and body read with a size limit and a deadline (`state.ClientGuard`: 408), JSON and
   field-type validation (4xx with a message);
2. routing: a request that asks for logprobs goes to the plain backend, anything else to the
   speculating one (`routing.plan`, or the plan the core handed over with the request);
3. forwarding: the body bytes unchanged to ``<backend URL><same path>``; only
   ``Content-Type`` and the client's ``Authorization`` are passed on (`aio_client`);
4. relaying: non-streamed bodies are checked and forwarded whole
   (`answers.AnswerChecks.body_answer`), SSE event by event as it arrives (`stream_relay`).
   Responses to logprobs requests are checked token by token whichever backend sent them; a
   placeholder becomes ``logprob: null`` (`placeholders`).

A backend that did not take a request (refused connection, HTTP 503) is marked down and the
request falls back (plain serves everything; a logprobs request is refused or annotated per
``--on-plain-down``). A backend that took it and then failed is answered for (502/504), never
re-sent (`aio_client`, docs/proxy.md "When a request is sent twice").
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

from specaudit import __version__
from specaudit.proxy import metrics as metrics_mod
from specaudit.proxy import routing
from specaudit.proxy.accounting import RequestRecord
from specaudit.proxy.aio_client import BackendClient
from specaudit.proxy.answers import (
    H_ANNOTATED,
    H_BACKEND,
    H_FALLBACK,
    H_ROUTE,
    UpstreamFailed,
    error_body,
)
from specaudit.proxy.backends import PLAIN, SPEC, State
from specaudit.proxy.config import OnPlainDown
from specaudit.proxy.health import Checker
from specaudit.proxy.routing import Kind, Plan, RequestError, Route
from specaudit.proxy.slow_clients import BODY, WebServer, conn_of
from specaudit.proxy.state import ProxyState, Unreachable
from specaudit.proxy.stream_relay import relay_stream

log = logging.getLogger("specaudit.proxy")

_KNOWN_PATHS = frozenset(list(routing.ENDPOINTS) + ["/health", "/metrics"])
_CANONICAL = {k: k for k in routing.ENDPOINTS}


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None, param: str | None = None
) -> web.Response:
    return web.Response(
        body=error_body(status, message, param=param),
        status=status,
        content_type="application/json",
        headers=headers,
    )


class AiohttpPath:
    """aiohttp's handler for the proxy's requests, over the shared `ProxyState`."""

    def __init__(self, state: ProxyState, client: BackendClient, checker: Checker) -> None:
        self.state = state
        self.config = state.config
        self.metrics = state.metrics
        self.client = client
        self.checker = checker

    def web_server(self) -> WebServer:
        return WebServer(
            self.handle,
            on_bad_http=self.state.accounting.bad_http,
            guard=self.state.guard,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=75.0,
            # after refusing a body (413) do not wait long for the rest of it
            lingering_time=1.0,
        )

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        t0 = time.perf_counter()
        o = RequestRecord(endpoint=request.path if request.path in _KNOWN_PATHS else "other")
        task = asyncio.current_task()
        if task is not None:
            self.state.inflight[task] = o
            task.add_done_callback(self.state.request_done)
        self.state.accounting.started(o)
        resp: web.StreamResponse | None = None
        try:
            if self.state.draining:
                resp = self._draining(o)
            else:
                resp = await self._dispatch(request, o)
            o.status = o.status or resp.status
            return resp
        except RequestError as e:
            resp = self._refused(e, o)
            return resp
        except Exception as e:
            # a defect in the proxy: a clean JSON error (never aiohttp's text 500), the
            # traceback in the log (redacted like every record)
            log.exception("internal error serving %s %s", request.method, o.endpoint)
            self.metrics.errors.inc("internal")
            o.status, o.note = 500, f"internal error: {type(e).__name__}"
            return error_response(500, f"the proxy failed on this request ({type(e).__name__})")
        except asyncio.CancelledError:
            resp = self._stopped(task, o)
            if resp is None:
                self.state.accounting.disconnected(o)
                raise
            return resp
        finally:
            if self.state.draining and resp is not None:
                resp.force_close()  # no further request on this connection
            conn = conn_of(request)
            if conn is not None:
                conn.body_done()
            self.state.accounting.account(request.method, o, t0)

    def _draining(self, o: RequestRecord) -> web.Response:
        """A request that arrived while the proxy stops: 503 at once."""
        self.metrics.errors.inc("shutdown")
        o.note = "shutting down"
        return error_response(503, "the proxy is shutting down; retry elsewhere or later")

    def _refused(self, e: RequestError, o: RequestRecord) -> web.Response:
        """What the client did wrong, answered with its 4xx (a 408 also closes)."""
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

    def _stopped(self, task: asyncio.Task[Any] | None, o: RequestRecord) -> web.Response | None:
        """The 503 for a request `stop` cancelled after the grace period, before anything was
        sent; None when the cancellation is not `stop`'s (the client went away)."""
        if not (o.shutdown and task is not None and task.cancelling() == 1):
            return None
        task.uncancel()
        self.metrics.errors.inc("shutdown")
        o.status, o.note = 503, "shutting down"
        return error_response(503, self.state.shutdown_message())

    async def _dispatch(self, request: web.BaseRequest, o: RequestRecord) -> web.StreamResponse:
        path = request.path
        if path in ("/health", "/metrics"):
            self._body_done(request)
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
            self._body_done(request)
            o.route = Route.DEFAULT.value
            return await self._serve_models(request, o)
        raw = await self._read_body(request)
        conn = conn_of(request)
        h = conn.take_handover(raw) if conn is not None else None
        if h is None:
            p = routing.plan(kind, raw)
            failed: dict[str, str] = {}
        else:  # the forwarding core planned it already (and may have tried a backend)
            if isinstance(h.planned, RequestError):
                raise h.planned
            p, failed = h.planned, dict(h.failed)
        o.route = p.route.value
        return await self._serve(request, p, o, failed)

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        """The whole body, by the request's deadline (`state.ClientGuard`) and within the limit."""
        limit = self.config.max_body_bytes
        conn = conn_of(request)
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
                raise RequestError(408, self.state.guard.message(evicted)) from None
            return b"".join(chunks)
        finally:
            if conn is not None:
                conn.body_done()

    def _health(self) -> web.Response:
        b = self.state.backends
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

    async def _serve_models(self, request: web.BaseRequest, o: RequestRecord) -> web.StreamResponse:
        for role in (SPEC, PLAIN):
            try:
                return await self._forward(
                    request, None, role, o, check=False, annotated=False, method="GET"
                )
            except Unreachable as e:
                self.state.mark_down(role, str(e))
        return self._no_backend(o)

    def _no_backend(self, o: RequestRecord) -> web.Response:
        self.metrics.errors.inc("no_backend")
        o.note = "no backend reachable"
        return error_response(
            503,
            "neither backend is reachable: plain "
            f"{self.state.backends[PLAIN].detail}; spec {self.state.backends[SPEC].detail}",
        )

    async def _serve(
        self, request: web.BaseRequest, p: Plan, o: RequestRecord, failed: dict[str, str]
    ) -> web.StreamResponse:
        """`failed`: backends that did not take this request already (the core tried them)."""
        if p.route is Route.DEFAULT:
            try:
                return await self._forward(
                    request, p, SPEC, o, check=False, annotated=False, failed=failed
                )
            except Unreachable as e:
                self.state.mark_down(SPEC, str(e))
            # the plain backend serves everything correctly, only slower
            try:
                return await self._forward(
                    request,
                    p,
                    PLAIN,
                    o,
                    check=False,
                    annotated=False,
                    fallback="spec-down",
                    failed=failed,
                )
            except Unreachable as e:
                self.state.mark_down(PLAIN, str(e))
            return self._no_backend(o)

        why = await self.checker.usable(PLAIN)
        if why is None:
            try:
                return await self._forward(
                    request, p, PLAIN, o, check=True, annotated=False, failed=failed
                )
            except Unreachable as e:
                why = str(e)
                self.state.mark_down(PLAIN, why)
        if self.config.on_plain_down is OnPlainDown.ERROR:
            self.metrics.errors.inc("plain_down")
            o.note = "plain backend down"
            b = self.state.backends[PLAIN]
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
                request,
                p,
                SPEC,
                o,
                check=True,
                annotated=True,
                fallback="plain-down",
                failed=failed,
            )
        except Unreachable as e:
            self.state.mark_down(SPEC, str(e))
        return self._no_backend(o)

    # forwarding -----------------------------------------------------------------------------

    async def _forward(
        self,
        request: web.BaseRequest,
        p: Plan | None,
        role: str,
        o: RequestRecord,
        *,
        check: bool,
        annotated: bool,
        method: str = "POST",
        fallback: str | None = None,
        failed: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        if failed and role in failed:
            raise Unreachable(failed[role])  # it did not take this request a moment ago
        try:
            resp = await self.client.open(
                role,
                # the upstream path is the routing table's own key, never text from the request
                _CANONICAL[request.path],
                method,
                p.body if p else None,
                _upstream_headers(request, p),
                stream=p is not None and p.stream,
            )
        except UpstreamFailed as e:
            self.metrics.errors.inc(e.kind)
            o.backend, o.note = role, e.kind
            return error_response(e.status, e.message, headers={H_BACKEND: role})
        o.backend = role
        out_headers = _answer_headers(role, p, annotated=annotated, fallback=fallback)
        try:
            if resp.status == 503:
                detail = await self._error_message(resp, role)
                raise Unreachable(f"answered HTTP 503 ({detail})")
            if resp.status == 200 and resp.content_type == "text/event-stream" and p is not None:
                return await relay_stream(
                    self.state, request, resp, p, role, o, out_headers, check, annotated
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
            raw = await self.client.read_limited(resp, role, 65536)
            err = json.loads(raw).get("error")
            msg = err.get("message") if isinstance(err, dict) else err
            return " ".join(str(msg).split())[:200] if msg else "no message"
        except Exception:
            return "no message"

    async def _relay_body(
        self,
        resp: aiohttp.ClientResponse,
        p: Plan | None,
        role: str,
        o: RequestRecord,
        headers: dict[str, str],
        *,
        check: bool,
    ) -> web.Response:
        raw = await self.client.read_limited(resp, role, self.config.max_response_bytes)
        ctype = resp.headers.get("Content-Type", "application/json")
        raw = self.state.checks.body_answer(
            raw, resp.status, ctype, p, role, o, headers, check=check
        )
        return web.Response(body=raw, status=resp.status, headers=headers)

    @staticmethod
    def _body_done(request: web.BaseRequest) -> None:
        conn = conn_of(request)
        if conn is not None:
            conn.body_done()


def _upstream_headers(request: web.BaseRequest, p: Plan | None) -> dict[str, str]:
    """What a backend gets of the client's headers: the body's type, and its Authorization."""
    headers = {"Content-Type": "application/json"} if p is not None else {}
    auth = request.headers.get("Authorization")
    if auth is not None:
        headers["Authorization"] = auth  # only ever to a configured backend
    return headers


def _answer_headers(
    role: str, p: Plan | None, *, annotated: bool, fallback: str | None
) -> dict[str, str]:
    """The proxy's own headers on an answer: who served it, on which route, in whose place."""
    headers = {H_BACKEND: role}
    if p is not None:
        headers[H_ROUTE] = p.route.value
    if annotated:
        headers[H_ANNOTATED] = "true"
    if fallback:
        headers[H_FALLBACK] = fallback
    return headers
