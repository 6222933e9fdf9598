"""The proxy's transport-neutral layer: the state both of its transports share.

The proxy answers on two transports: the asyncio forwarding core (`forwarding`) and aiohttp's
path (`server`). Each depends on the shared layer only (never on the other), so every rule that
is not about bytes on a socket has one home there. `ProxyState` holds it, in named pieces:

- `accounting` (`accounting.Accounting`): the counters and the access log, over one
  `accounting.RequestRecord` per request;
- `checks` (`answers.AnswerChecks`): a backend's answer checked (a whole body, stream events,
  a stream's end) and the proxy's error answers;
- `pool` (`pool.BackendPool`): the forwarding core's kept-alive backend connections and the
  requests it serves on each backend;

and itself keeps the backends' roles and the choice of a backend for a plan
(`ProxyState.direct_role`; the fallbacks are aiohttp's path's), the requests in flight and the
stop in progress (`ProxyState.inflight`, `ProxyState.draining`), the deadline for clients
sending a request (`ClientGuard`), and the hand-over of a connection from the core to
aiohttp's path (`ProxyState.adopter`, `Handover`): a request handed over carries its plan, so
it is never planned twice.

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
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from specaudit.proxy import metrics as metrics_mod
from specaudit.proxy.accounting import Accounting, ProxyStats, RequestRecord
from specaudit.proxy.answers import AnswerChecks
from specaudit.proxy.backends import PLAIN, SPEC, BackendStatus, State
from specaudit.proxy.config import ProxyConfig
from specaudit.proxy.pool import BackendPool
from specaudit.proxy.routing import Plan, RequestError, Route

log = logging.getLogger("specaudit.proxy")


class Unreachable(Exception):
    """The backend did not take the request (nothing of an answer): it may go elsewhere."""


class ShuttingDown(Exception):
    """Set on a stream's upstream reader when the proxy stops: end the stream with an error."""


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
    """The state both transports share: backends' roles, requests in flight, the stop in
    progress, and the pieces it owns (`accounting`, `checks`, `pool`). `lifecycle.Proxy` adds
    start, stop and role checks."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = metrics_mod.Metrics()
        self.metrics.in_flight.set(value=0)
        self.accounting = Accounting(self.metrics, self.recheck_roles)
        self.checks = AnswerChecks(self.accounting)
        self.backends = {
            PLAIN: BackendStatus(PLAIN, config.plain),
            SPEC: BackendStatus(SPEC, config.spec),
        }
        self.port = config.port
        self.started = 0.0
        self.guard = ClientGuard(
            config.client_timeout, config.max_incomplete_requests, self.accounting.client_timed_out
        )
        # every request being served (each transport's future or task), for a graceful stop
        self.inflight: dict[asyncio.Future[Any], RequestRecord] = {}
        self.draining = False
        self.wake: asyncio.Event | None = None  # set: re-check the backends' roles now
        # the forwarding core: client connections it holds, and its side of the backends
        self.fronts: set[Any] = set()
        self.pool = BackendPool(config.plain, config.spec)
        # makes the aiohttp handler a connection is handed to (set when the proxy starts)
        self.adopter: Callable[[], Adopter] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    # the backends ---------------------------------------------------------------------------

    def direct_role(self, p: Plan) -> str | None:
        """The backend the forwarding core may send `p` to now; None: aiohttp's path decides
        (fallbacks, a backend not known to be up, https, a total timeout, a full backend)."""
        role = SPEC if p.route is Route.DEFAULT else PLAIN
        if (
            self.backends[role].state is not State.UP
            or self.pool.targets[role] is None
            or self.config.total_timeout is not None
            or self.pool.busy[role] >= self.config.max_connections
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
        self.recheck_roles()

    def recheck_roles(self) -> None:
        """Wake the role checks (`health.Checker`): something suggests a role changed."""
        if self.wake is not None:
            self.wake.set()

    def gauges(self, b: BackendStatus) -> None:
        self.metrics.backend_up.set(b.role, value=1 if b.state is State.UP else 0)
        spec = -1 if b.speculating is None else int(b.speculating)
        self.metrics.backend_speculating.set(b.role, value=spec)

    def new_handler(self) -> Adopter:
        """aiohttp's path's handler for a connection the core gives up."""
        assert self.adopter is not None, "the proxy has not started"
        return self.adopter()

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

    # stopping -------------------------------------------------------------------------------

    def request_done(self, task: asyncio.Future[Any]) -> None:
        self.inflight.pop(task, None)

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
