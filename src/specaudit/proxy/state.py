"""The proxy's transport-neutral layer: what both of its transports share.

The proxy answers on two transports: the asyncio forwarding core (`forwarding`) and aiohttp's path
(`server`). Each depends on this module only (never on the other), so every rule that is not
about bytes on a socket has one home here:

- choosing a backend for a plan (`ProxyState.direct_role`; the fallbacks are aiohttp's path's);
- checking a backend's answer: a whole body (`ProxyState.body_answer`), stream events
  (`ProxyState.events`), the end of a stream (`ProxyState.unfinished`, `ProxyState.stream_error`);
- accounting for an outcome (`RequestRecord`, `ProxyState.account`, `ProxyState.count`,
  `ProxyState.mark_down`);
- error bodies (`error_body`) and the stop/drain state (`ProxyState.draining`,
  `ProxyState.inflight`);
- the pool of kept-alive backend connections (`ProxyState.pool_get`, `ProxyState.pool_put`) and the
  deadline for clients sending a request (`ClientGuard`);
- the hand-over of a connection from the core to aiohttp's path (`ProxyState.adopter`,
  `Handover`): a request handed over carries its plan, so it is never planned twice.

The re-send rule (docs/proxy.md, "When a request is sent twice") is kept by both transports:
a generation request is sent to a backend again only when nothing of it was written to one
(a refused connection), when the backend closed a reused kept-alive connection without a
byte of answer (re-sent once, on a fresh connection), or when it answered 503 (llama-server's
"not taking requests": it generated nothing). Anything else that goes wrong after its bytes
were written is answered by the transport that wrote them, with a JSON error or an SSE error
event, and the request is not sent anywhere again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from specaudit.proxy import metrics as metrics_mod
from specaudit.proxy import sse
from specaudit.proxy.backends import BackendStatus, State
from specaudit.proxy.config import ProxyConfig
from specaudit.proxy.placeholders import PlaceholderTally, check_body, check_event
from specaudit.proxy.routing import Kind, Plan, RequestError, Route

log = logging.getLogger("specaudit.proxy")

PLAIN, SPEC = "plain", "spec"

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


class Unreachable(Exception):
    """The backend did not take the request (nothing of an answer): it may go elsewhere."""


class ShuttingDown(Exception):
    """Set on a stream's upstream reader when the proxy stops: end the stream with an error."""


class UpstreamFailed(Exception):
    """The backend answered unusably (timeout, garbage); nothing sent to the client yet."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class Withheld(Exception):
    """An answer could not be checked (its message says why): withheld with a 500."""


def withheld(role: str, e: Exception) -> str:
    return (
        f"the proxy could not check the {role} backend's response ({type(e).__name__}); "
        "it is withheld so that no placeholder passes as real"
    )


def count_comment(t: PlaceholderTally) -> bytes:
    """Where an annotated stream says how many placeholders it rewrote (headers went first)."""
    return sse.comment(f"specaudit-placeholders {t.placeholders}")


@dataclass
class RequestRecord:
    """What the access log line and the request counter say about one request."""

    endpoint: str = "-"
    route: str = "-"
    backend: str = "none"
    status: int = 0
    placeholders: int | None = None
    note: str = ""
    shutdown: bool = False  # ended by the proxy stopping (`Proxy.stop`)
    # how `stop` ends the request after the grace period (a stream relayed by aiohttp's path,
    # any request of the forwarding core); None: its task is cancelled and answers 503
    stop_stream: Callable[[], None] | None = None


@dataclass
class StreamState:
    tally: PlaceholderTally = field(default_factory=PlaceholderTally)
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


@dataclass(frozen=True)
class Handover:
    """What the forwarding core already knows of the request it hands to aiohttp's path:
    its plan (or why routing refused it), and the backends that did not take it (role ->
    why: a refused connection, a 503), which aiohttp's path does not try again."""

    body: bytes  # the request's body, as the core read it
    planned: Plan | RequestError
    failed: tuple[tuple[str, str], ...] = ()


class Adopter(Protocol):
    """aiohttp's path's connection handler, as the core hands a connection to it."""

    def pause_writing(self) -> None: ...

    def adopt(
        self,
        front: Any,
        transport: asyncio.Transport,
        data: bytes,
        deadline: float,
        got_bytes: bool,
        evicted: bool,
        handover: Handover | None = None,
    ) -> None: ...


class Pooled(Protocol):
    """A kept-alive backend connection (`forwarding.Upstream`)."""

    lost: bool
    idle_since: float
    transport: asyncio.Transport | None

    def close(self) -> None: ...


class Target:
    """Where one backend's requests go: host, port and the request line's path prefix."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host = u.hostname or ""
        self.port = u.port or 80
        self.prefix_b = u.path.encode()
        self.host_header = u.netloc.encode()


def target(url: str) -> Target | None:
    """A plain-HTTP backend the core can reach; None for https (aiohttp's path serves those)."""
    return Target(url) if urlsplit(url).scheme == "http" else None


POOL_IDLE = 4.0  # seconds a pooled backend connection may idle (llama-server drops it at 5)


class ClientGuard:
    """Connections still sending a request, oldest first (slow-loris defence).

    A request has ``timeout`` seconds from its first byte (a new connection's first request:
    from connecting) until its body has been read. The header phase is timed by the
    connection (``expire``), the body phase by aiohttp's path's body read
    (``asyncio.timeout_at(conn.deadline)``). At most ``limit`` connections may be in either
    phase: one more pushes out the one that has been sending longest.
    """

    def __init__(self, timeout: float, limit: int, on_timeout: Callable[[str], None]) -> None:
        self.timeout, self.limit = timeout, limit
        self.on_timeout = on_timeout  # called with the peer when a 408 is sent in the headers
        # aiohttp's handlers and the core's `forwarding.Front`s, insertion order: oldest first
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


class ProxyState:
    """The state both transports share: backends' roles, counters, requests in flight, the
    stop in progress, the core's pool. `lifecycle.Proxy` adds start, stop and role checks."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = metrics_mod.Metrics()
        self.metrics.in_flight.set(value=0)
        self.backends = {
            PLAIN: BackendStatus(PLAIN, config.plain),
            SPEC: BackendStatus(SPEC, config.spec),
        }
        self.port = config.port
        self.started = 0.0
        self.guard = ClientGuard(
            config.client_timeout, config.max_incomplete_requests, self.client_timed_out
        )
        # every request being served (each transport's future or task), for a graceful stop
        self.inflight: dict[asyncio.Future[Any], RequestRecord] = {}
        self.draining = False
        self.wake: asyncio.Event | None = None  # set: re-check the backends' roles now
        # the forwarding core: client connections it holds, kept-alive backend connections,
        # requests it is serving per backend, and where each backend is (None: https)
        self.fronts: set[Any] = set()
        self.pools: dict[str, list[Pooled]] = {PLAIN: [], SPEC: []}
        self.busy = {PLAIN: 0, SPEC: 0}
        self.targets = {PLAIN: target(config.plain), SPEC: target(config.spec)}
        # makes the aiohttp handler a connection is handed to (set when the proxy starts)
        self.adopter: Callable[[], Adopter] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    # choosing a backend -------------------------------------------------------------------

    def direct_role(self, p: Plan) -> str | None:
        """The backend the forwarding core may send `p` to now; None: aiohttp's path decides
        (fallbacks, a backend not known to be up, https, a total timeout, a full backend)."""
        role = SPEC if p.route is Route.DEFAULT else PLAIN
        if (
            self.backends[role].state is not State.UP
            or self.targets[role] is None
            or self.config.total_timeout is not None
            or self.busy[role] >= self.config.max_connections
        ):
            return None
        return role

    def mark_down(self, role: str, why: str) -> None:
        b = self.backends[role]
        if b.state is not State.DOWN:
            log.warning("%s backend %s: down (%s)", role, b.url, why)
        if b.state is not State.UNUSABLE:
            b.state = State.DOWN
            b.detail = why
        b.checked_mono = time.monotonic()
        self.gauges(b)
        if self.wake is not None:
            self.wake.set()

    def gauges(self, b: BackendStatus) -> None:
        self.metrics.backend_up.set(b.role, value=1 if b.state is State.UP else 0)
        spec = -1 if b.speculating is None else int(b.speculating)
        self.metrics.backend_speculating.set(b.role, value=spec)

    # the core's pool ----------------------------------------------------------------------

    def pool_get(self, role: str) -> Pooled | None:
        pool = self.pools[role]
        now = asyncio.get_running_loop().time()
        while pool:
            up = pool.pop()
            if not up.lost and now - up.idle_since < POOL_IDLE:
                return up
            up.close()
        return None

    def pool_put(self, role: str, up: Pooled) -> None:
        if up.transport is not None:
            up.transport.resume_reading()  # never pool a connection left paused
        up.idle_since = asyncio.get_running_loop().time()
        self.pools[role].append(up)

    def new_handler(self) -> Adopter:
        """aiohttp's path's handler for a connection the core gives up."""
        assert self.adopter is not None, "the proxy has not started"
        return self.adopter()

    # accounting ---------------------------------------------------------------------------

    def stats(self) -> ProxyStats:
        m = self.metrics
        by_route: dict[str, int] = {}
        for (_, route, _, _), v in m.requests.values.items():
            by_route[route] = by_route.get(route, 0) + int(v)
        return ProxyStats(
            url=self.url,
            uptime_s=time.monotonic() - self.started if self.started else 0.0,
            on_plain_down=self.config.on_plain_down.value,
            requests=int(m.requests.total()),
            requests_by_route=by_route,
            errors={k[0]: int(v) for k, v in m.errors.values.items()},
            placeholders_caught={k[0]: int(v) for k, v in m.placeholders.values.items()},
            backends={r: b.public() for r, b in self.backends.items()},
        )

    def bad_http(self, status: int) -> None:
        self.metrics.errors.inc("bad_request")
        self.metrics.requests.inc("other", "-", "none", str(status))

    def client_timed_out(self, peer: str) -> None:
        """A client sent part of a request's headers but not all in time: it got a 408."""
        self.metrics.errors.inc("client_timeout")
        self.metrics.requests.inc("other", "-", "none", "408")
        log.info("client %s: status=408 (request headers not complete in time)", peer)

    def account(self, method: str, o: RequestRecord, t0: float) -> None:
        """One request answered (by either transport): its counters and its access log line."""
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

    def request_done(self, task: asyncio.Future[Any]) -> None:
        self.inflight.pop(task, None)

    def disconnected(self, o: RequestRecord) -> None:
        # the client went away; leaving the handler closes the upstream request
        self.metrics.errors.inc("client_disconnect")
        o.status = o.status or 499
        o.note = "client disconnected"

    def failed(self, e: UpstreamFailed, o: RequestRecord) -> None:
        """A backend's unusable answer, counted (the transport answers `e.status`)."""
        self.metrics.errors.inc(e.kind)
        o.note = e.kind

    def count(self, role: str, t: PlaceholderTally, o: RequestRecord) -> None:
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
                if self.wake is not None:
                    self.wake.set()

    # checking a whole body ----------------------------------------------------------------

    def body_answer(
        self,
        raw: bytes,
        status: int,
        content_type: str,
        p: Plan | None,
        role: str,
        o: RequestRecord,
        headers: dict[str, str],
        *,
        check: bool,
    ) -> bytes:
        """A backend's whole non-streamed answer made ready for the client: the bytes to send
        (a logprobs answer checked, placeholders nulled), its headers added to `headers`.
        Raises `UpstreamFailed` for an answer the proxy does not vouch for."""
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            kind = "upstream_error" if status >= 400 else "upstream_garbage"
            raise UpstreamFailed(
                502, kind, f"the {role} backend answered HTTP {status} with a body that is not JSON"
            ) from None
        if status < 400 and not isinstance(obj, dict | list):
            raise UpstreamFailed(
                502, "upstream_garbage", f"the {role} backend answered JSON that is not an object"
            )
        if status >= 400:
            self.metrics.errors.inc(f"upstream_{status // 100}xx")
        elif check and p is not None:
            try:
                raw, n = self.checked_body(p, raw, obj, role, o)
            except Exception as e:
                # the body cannot be vouched for: withhold it rather than pass it unchecked
                log.exception("checking the %s backend's response failed", role)
                raise UpstreamFailed(500, "internal", withheld(role, e)) from None
            headers[H_PLACEHOLDERS] = str(n)
        headers["Content-Type"] = content_type
        return raw

    def checked_body(
        self, p: Plan, raw: bytes, obj: Any, role: str, o: RequestRecord
    ) -> tuple[bytes, int]:
        """A logprobs response body checked: the bytes to send (re-encoded only when a
        placeholder was rewritten to null) and how many were."""
        t = check_body(p.kind, obj, p.requested)
        if t.placeholders:
            raw = sse.encode_json(obj)  # lone surrogates stay escaped
        self.count(role, t, o)
        return raw, t.placeholders

    # checking a stream --------------------------------------------------------------------

    def events(
        self,
        events: list[bytes],
        p: Plan,
        st: StreamState,
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
                return pieces, ("internal", withheld(role, e))
            if piece is None:
                return pieces, ("upstream_garbage", "event data is not a JSON object")
            pieces += piece
            if st.finished:
                break  # the last event ([DONE], "stop": true, an error): nothing after it
        return pieces, None

    def _event(
        self, ev: bytes, obj: Any, p: Plan, st: StreamState, *, check: bool, annotated: bool
    ) -> list[bytes] | None:
        """What to forward for one parsed event; None when it is not a JSON object."""
        if obj == "[DONE]":
            st.finished = True
            return [count_comment(st.tally), ev] if annotated else [ev]
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
                return [ev, count_comment(st.tally)]
        return [ev]

    def unfinished(
        self, splitter: sse.EventSplitter, st: StreamState, role: str
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

    def stream_error(
        self, error: tuple[str, str], st: StreamState, o: RequestRecord, annotated: bool
    ) -> bytes:
        """The end of a stream that failed: counted, then its SSE error event."""
        self.metrics.errors.inc(error[0])
        o.note = error[0]
        tail = count_comment(st.tally) if annotated else b""
        code = {"upstream_timeout": 504, "internal": 500, "shutdown": 503}.get(error[0], 502)
        return tail + sse.encode_event(
            {"error": {"message": error[1], "type": ERROR_TYPES[code], "code": code}}
        )

    # stopping -----------------------------------------------------------------------------

    def shutdown_message(self) -> str:
        return (
            "the proxy is shutting down and the backend had not answered this request "
            f"within the {self.config.shutdown_grace:g}s grace period; retry"
        )

    def shutdown_error(self, role: str) -> tuple[str, str]:
        return (
            "shutdown",
            f"the proxy is shutting down; the {role} backend's response did not finish within "
            f"the {self.config.shutdown_grace:g}s grace period and is incomplete",
        )
